"""The control plane: folds the log, leads by lease, reconciles, publishes decisions.

- `config`: ControlConfig, loaded by `llmgw control --config FILE`;
- `service`: the ControlService (consume -> fold -> reconcile -> fenced publish);
  its parts: `instance` (shared state, the fenced write), `snapshotting`,
  `leadership` (the lease), `policing` (quarantines, deletions), `deciding`;
- `folding`: the folded state, the fence's position, refused events;
- `models`: the config file's models as operator events, diffed against the log;
- `admin`: the read-only management API and /metrics;
- `verify`: a log checked against its own recorded decisions and digests;
- `metrics`: the Prometheus metrics.
"""
