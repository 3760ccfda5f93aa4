"""`llmgw ctl`: what an operator runs against a fleet, and how it travels through its history.

- `settings` / `session`: where the log is and who the operator is (the certificate's CN);
- `history`: rebuilding the cluster state at any point (newest snapshot + tail);
- `views`, `changes`, `timeline`: pure functions from folded state / records to rows;
- `catalogfile`, `operations`: models.yaml diffs, cordon / drain plans and their events;
- `render`: tables, colour and JSON for the terminal.

The typer commands are in `llmgw.cli.ctl_fleet`; tests in tests/*/test_ctl*.py.
"""
