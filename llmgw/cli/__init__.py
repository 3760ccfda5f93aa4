"""The `llmgw` command line: one typer module per command group, registered in main."""
