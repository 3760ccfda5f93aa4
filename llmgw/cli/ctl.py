"""`llmgw ctl`: what an operator runs against a fleet. Each sub-group lives in its own module
and is added here once it works (`cert` now; the log's tools join it)."""

from __future__ import annotations

import typer

from llmgw.cli import cert

app = typer.Typer(help="Operator tools: the fleet's certificates.", no_args_is_help=True)
app.add_typer(cert.app, name="cert")
