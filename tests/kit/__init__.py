"""Helpers every kind of test shares: timings, free ports, real processes.

- `timings`: the control plane's fast timings, for in-process tests and for fleets of
  real processes (defined once here; the kits import them).
- `ports`: a free loopback port; waiting for an HTTP server to answer.
- `processes`: the base of every test's subprocess wrapper (pid, stop, kill, log tail),
  waiting for a process's announce line, whether a pid is alive.
- `raw_http`: raw HTTP/1.1 on real sockets, plain or TLS (a head trickled in or never
  finished, a malformed header holding a key), for every listener's front-door tests.

The kits beside the tests build on these: `tests/harness.py` (nats-server, PKI),
`tests/integration/{control,agent,router,ctl}_kit.py`, `tests/e2e/{fleet,up}_kit.py`.
"""
