"""`python -m llmgw`: the same CLI as the `llmgw` script (the agent launches engines this way)."""

from llmgw.cli.entry import main

if __name__ == "__main__":
    main()
