"""`llmgw ctl`: what an operator runs against a fleet. Each sub-group lives in its own module
and is added here once it works: `cert` (llmgw.cli.cert), the fleet commands
(llmgw.cli.ctl_fleet: nodes, replicas, models, apply, explain-placement, cordon, uncordon,
drain), the history commands (llmgw.cli.ctl_history: events, replay), the autoscaler's
(llmgw.cli.ctl_scaling: explain-scaling, scale), tenants' keys (llmgw.cli.ctl_keys: key)
and `status` (llmgw.cli.ctl_status)."""

from __future__ import annotations

import typer

from llmgw.cli import cert, ctl_fleet, ctl_history, ctl_keys, ctl_scaling, ctl_status

app = typer.Typer(
    help="Operator tools: the fleet's certificates, its state, changes and history.",
    no_args_is_help=True,
)
app.add_typer(cert.app, name="cert")
ctl_fleet.register(app)
ctl_keys.register(app)
ctl_history.register(app)
ctl_scaling.register(app)
ctl_status.register(app)
