"""`python -m llmgw`: the same CLI as the `llmgw` script (the agent launches engines this way).

`llmgw.cli.entry` imports only the standard library, so its Ctrl-C handler is in place
before the heavy imports begin."""

from llmgw.cli.entry import main

if __name__ == "__main__":
    main()
