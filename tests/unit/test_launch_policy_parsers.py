"""The launch policy against the engines' own parsers: whatever argv it lets through, the
parser vLLM or SGLang builds from it sets only the options the policy allowed, and a file
option's value stays under launch.file_dirs.

vLLM and SGLang parse with Python's argparse, prefixes of option names accepted
(`allow_abbrev`). The parsers here are built from the generated option references in
tests/fixtures/engines (every spelling, and whether each takes a value, one or more
values, or none); vLLM's own rewriting before argparse (`_` as `-` in option names,
`--opt.key value` gathered into one JSON value) is done as vLLM 0.33.0 does it.
"""

from __future__ import annotations

import argparse
import json
import posixpath
import re
from functools import cache
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.agent.engines import allowlists
from llmgw.agent.engines import policy as launch_policy
from llmgw.agent.engines.policy import LaunchPolicy
from llmgw.core.profile import Engine

REFERENCE = Path(__file__).parents[1] / "fixtures" / "engines"
FILES = {"vllm": "vllm-serve-flags.txt", "sglang": "sglang-server-flags.txt"}
DIRS = ("/opt/t",)


class Refused(Exception):
    """The engine's parser would stop with an error: nothing runs."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # type: ignore[override]
        raise Refused(message)


@cache
def options(engine: str) -> dict[str, tuple[str, str]]:
    """Every spelling -> (the option's primary spelling, its value type)."""
    out: dict[str, tuple[str, str]] = {}
    for line in (REFERENCE / FILES[engine]).read_text().splitlines():
        if not line.startswith("-"):
            continue
        head, _, rest = line.partition(" | ")
        primary, kind = head.split()[:2]
        for name in (primary, *re.findall(r"(--?[\w-]+)", rest.partition(" | ")[0])):
            out.setdefault(name, (primary, kind))
    return out


@cache
def parser(engine: str) -> _Parser:
    p = _Parser(prog=engine, allow_abbrev=True, add_help=False, exit_on_error=False)
    if engine == "vllm":
        p.add_argument("model_tag", nargs="?")
    spellings: dict[str, list[str]] = {}
    for name, (primary, _) in options(engine).items():
        spellings.setdefault(primary, []).append(name)
    for primary, names in spellings.items():
        kind = options(engine)[primary][1]
        if kind in ("<FLAG>", "<BOOL-FLAG>"):
            p.add_argument(*names, dest=primary, action="store_true")
        elif kind.endswith("..."):
            p.add_argument(*names, dest=primary, nargs="+")
        elif kind.startswith("["):
            p.add_argument(*names, dest=primary, nargs="?", const="")
        else:
            p.add_argument(*names, dest=primary)
    return p


def vllm_rewrite(args: list[str]) -> list[str]:
    """FlexibleArgumentParser.parse_args before argparse: `_` as `-` in an option's name
    (up to its first `.`), then every `-x.key` (value after `=` or the next argument)
    gathered into `-x '{"key": value}'` at the end."""
    named = []
    for arg in args:
        if arg.startswith("--"):
            key, eq, value = arg.partition("=")
            head, dot, tail = key.partition(".")
            named.append(head.replace("_", "-") + dot + tail + eq + value)
        else:
            named.append(arg)
    out: list[str] = []
    gathered: dict[str, dict[str, object]] = {}
    skip = False
    for i, arg in enumerate(named):
        if skip:
            skip = False
            continue
        if not (arg.startswith("-") and "." in arg):
            out.append(arg)
            continue
        key, eq, value = arg.partition("=")
        if eq and "." not in key:
            out.append(arg)
            continue
        if not eq:
            if i + 1 == len(named):
                raise Refused(f"{arg} has no value")
            value, skip = named[i + 1], True
        name, _, path = key.partition(".")
        try:
            loaded: object = json.loads(value)
        except ValueError:
            loaded = value
        gathered.setdefault(name, {})[path] = loaded
    for name, value in gathered.items():
        out += [name, json.dumps(value)]
    return out


def parsed(engine: Engine, args: list[str]) -> dict[str, object]:
    """The options the engine's parser sets from the agent's argv plus `args`."""
    argv = ["org/model", *args] if engine == "vllm" else ["--model-path", "org/model", *args]
    if engine == "vllm":
        argv = vllm_rewrite(argv)
    namespace = parser(engine).parse_args(argv)
    defaults = parser(engine).parse_args(argv[:1] if engine == "vllm" else argv[:2])
    return {
        k: v
        for k, v in vars(namespace).items()
        if v != getattr(defaults, k) and k not in ("model_tag", "--model-path")
    }


def _allowed(engine: Engine) -> set[str]:
    known = options(engine)
    return {known[name][0] for name in allowlists.DEFAULT_ARGS_ALLOW[engine]}


_VALUES = [
    "8", "0.5", "-1", "-1.5", "-.5", "-1.x", "-", "", "org/name", "chatml", "{{ m }}",
    "{x}/../../etc/shadow", "/etc/shadow", "/opt/t/x.jinja", "/opt/t/../etc",
    " --trust-remote-code", "--", "true", '{"a": 1}',
]  # fmt: skip


def _argv(engine: Engine) -> st.SearchStrategy[list[str]]:
    """Mostly options the policy allows (the file options often: what they read is what
    the policy bounds most) with their values in every spelling the engines take, so that
    the engine's parser has something to read; now and then any spelling or value at all."""
    allowed = sorted(allowlists.DEFAULT_ARGS_ALLOW[engine])
    name = st.sampled_from(sorted(options(engine)))
    prefix = st.builds(lambda n, k: n[: max(3, len(n) - k)], name, st.integers(1, 12))
    values = st.sampled_from(_VALUES)
    ok = st.sampled_from(allowed).map(lambda n: n[:2] + n[2:].replace("-", "_")) | st.sampled_from(
        allowed
    )
    files = st.sampled_from(sorted(allowlists.FILE_ARGS[engine]))
    chunks = [
        st.tuples(files, values).map(list),
        st.builds(lambda n, v: [f"{n}={v}"], files | ok, values),
        st.tuples(ok, st.lists(values, max_size=2)).map(lambda c: [c[0], *c[1]]),
        st.one_of(name, prefix, values).map(lambda t: [t]),
    ]
    chunk = st.sampled_from([0, 0, 0, 1, 1, 2, 2, 2, 2, 3]).flatmap(lambda i: chunks[i])
    return st.lists(chunk, max_size=4).map(lambda cs: [t for c in cs for t in c])


def _check(engine: Engine, args: list[str]) -> None:
    policy = LaunchPolicy(file_dirs=DIRS)
    if launch_policy.args_problems(policy, engine, args):
        return
    try:
        used = parsed(engine, args)
    except (Refused, argparse.ArgumentError):
        return  # the engine stops at its own parser: it runs nothing
    assert set(used) <= _allowed(engine), (args, sorted(set(used) - _allowed(engine)))
    for option in allowlists.FILE_ARGS[engine]:
        value = used.get(options(engine)[option][0])
        if isinstance(value, str):
            path = posixpath.normpath(value)
            assert not value.startswith("/") or path.startswith(DIRS[0]), (args, value)
            assert ".." not in value.split("/"), (args, value)


@settings(max_examples=600, deadline=None)
@given(_argv("vllm"))
def test_what_the_policy_passes_vllms_parser_reads_as_allowed_options_only(
    args: list[str],
) -> None:
    _check("vllm", args)


@settings(max_examples=600, deadline=None)
@given(_argv("sglang"))
def test_what_the_policy_passes_sglangs_parser_reads_as_allowed_options_only(
    args: list[str],
) -> None:
    _check("sglang", args)


def test_the_parsers_model_what_the_engines_accept() -> None:
    # The model of each parser reads what the engines' documentation says they read.
    assert parsed("vllm", ["--max_num_seqs", "8"]) == {"--max-num-seqs": "8"}
    assert parsed("vllm", ["--tensor-parallel", "2"]) == {"--tensor-parallel-size": "2"}
    assert parsed("sglang", ["--tp", "8"]) == {"--tp-size": "8"}
    assert parsed("vllm", ["--limit-mm-per-prompt.image", "2"]) == {
        "--limit-mm-per-prompt": '{"image": 2}'
    }
