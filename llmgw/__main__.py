"""`python -m llmgw`: the same CLI as the `llmgw` script (the agent launches engines this way)."""

from llmgw.cli.main import main

if __name__ == "__main__":
    main()
