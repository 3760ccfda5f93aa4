"""`llmgw ctl`: what an operator runs against a fleet, and how it travels through its history.

- `settings`, `session`: where the log is and who the operator is (the certificate's CN),
  one connection, operator events published and refusals explained;
- `history`: the cluster state at any point of the log (newest snapshot + tail);
- `changes`, `eventlines`: pure functions from folded state and records to the
  differences and lines that are shown (the node / replica / model rows are
  `llmgw.core.views`, shared with the control plane's admin API);
- `catalogfile`, `operations`: models.yaml diffs, drain plans and drain progress (pure);
- `leadership`: whether anyone leads, from the lease and the log (pure);
- `render`: tables, colour, JSON and the progress bar; `errors`: exit codes 1 and 2.

The typer commands are llmgw.cli.ctl_fleet (nodes, replicas, models, apply,
explain-placement, cordon, uncordon, drain), llmgw.cli.ctl_history (events, replay) and
llmgw.cli.ctl_status (status); tests in tests/unit/test_ctl.py, tests/integration/test_ctl*.py and
tests/e2e/test_ctl_fleet.py; tests/bench/bench_replay.py measures replay.
"""
