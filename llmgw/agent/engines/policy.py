"""A node's launch policy: what an operator's model profile (its `env` and
`engine_args`, carried in every StartShard) may make this node run.

The operator's certificate reaches every node; the node's own config bounds what that
certificate can do there. Purely computational; the agent calls `check_policy` before
`llmgw.agent.engines.plan`, and the config loader `policy_errors`.
"""

from __future__ import annotations

import posixpath
import re
from collections.abc import Mapping, Sequence
from typing import Literal

import msgspec

from llmgw.agent.engines.allowlists import (
    DEFAULT_ARGS_ALLOW,
    DEFAULT_ENV_ALLOW,
    ENGINES,
    FILE_ARGS,
    loads_code,
)
from llmgw.agent.engines.validation import LaunchRefused, option_name
from llmgw.core.profile import Engine, LaunchSpec

PolicyScope = Literal["all", "vllm", "sglang", "llamacpp", "sim"]

_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_ENV_PATTERN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\*?")
_NUMBER = re.compile(r"-(\d|\.\d)")
_REFUSED = "\x00refused"
_HF_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?")


class LaunchPolicy(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """What a StartShard may make this node run (the agent config's `launch` section).

    A shard asking for anything else is refused before launch, with the setting to
    change, and reported as a failed ShardStatus.
    """

    engines: tuple[Engine, ...] = ENGINES
    """Engines this node may start."""
    defaults: bool = True
    """Start from the built-in allowlists (env names per engine: CUDA_*, NCCL_*, HF_*,
    VLLM_* / SGLANG_* ... without those that load code or name files; engine options:
    tuning, sampling and logging flags). False: only what env_allow and args_allow list."""
    env_allow: dict[PolicyScope, tuple[str, ...]] = {}
    """Environment names a launch may set besides the defaults, per engine or under `all`:
    exact names (`LD_PRELOAD` is admitted only so) or `PREFIX_*` patterns."""
    args_allow: dict[PolicyScope, tuple[str, ...]] = {}
    """Engine options a launch may pass besides the defaults, per engine or under `all`,
    in their full spelling (`--max-num-seqs`); values are not restricted."""
    file_dirs: tuple[str, ...] = ()
    """Absolute directories from which options such as `--chat-template` may read files."""


def _where(source: str) -> str:
    return f"agent config {source}" if source else "the agent config"


def _listed(
    policy: LaunchPolicy,
    table: Mapping[Engine, tuple[str, ...]],
    engine: Engine,
    extra: Mapping[PolicyScope, tuple[str, ...]],
) -> tuple[str, ...]:
    base = table[engine] if policy.defaults else ()
    return (*base, *extra.get("all", ()), *extra.get(engine, ()))


def env_allowed(policy: LaunchPolicy, engine: Engine, name: str) -> bool:
    """True when a launch of `engine` may set `name` on this node. Purely computational."""
    if not _ENV_NAME.fullmatch(name):
        return False
    configured = (*policy.env_allow.get("all", ()), *policy.env_allow.get(engine, ()))
    defaults = DEFAULT_ENV_ALLOW[engine] if policy.defaults else ()
    if name in configured or name in defaults:
        return True
    for entry in (*defaults, *configured):
        if entry.endswith("*") and name.startswith(entry[:-1]) and not loads_code(name):
            return True
    return False


def _is_value(token: str) -> bool:
    return not token.startswith("-") or bool(_NUMBER.match(token)) or token == "-"


def _inline(template: str) -> bool:
    """True for a `template` value the engine can only take as the template itself.

    vLLM opens the value as a file first and reads it as Jinja only when that fails, so
    braces do not make it inline: one that begins with `/` is any file on the node, and
    one with a `..` step climbs out of the engine's working folder (the agent's own) to
    any file once a folder on the way exists (a model repository may hold one named
    `{x}`, and the engine downloads it). What is left names at most a file in that folder.
    """
    return (
        any(c in template for c in "{}\n")
        and not template.startswith("/")
        and ".." not in template.split("/")
    )


def _file_value(kind: str, value: str, dirs: tuple[str, ...]) -> str | None:
    """The file `value` names when it is not under `dirs`; None when it is fine."""
    if kind == "template" and _inline(value):
        return None
    if kind == "name_or_path" and _HF_ID.fullmatch(value) and ".." not in value:
        return None
    if value.startswith("/"):
        path = posixpath.normpath(value)
        for d in dirs:
            root = posixpath.normpath(d)
            if path == root or path.startswith(root.rstrip("/") + "/"):
                return None
        return path
    return value


def args_problems(
    policy: LaunchPolicy, engine: Engine, args: Sequence[str], source: str = ""
) -> list[str]:
    """Why `args` (a profile's engine_args) may not run on this node. Purely computational."""
    allowed = set(_listed(policy, DEFAULT_ARGS_ALLOW, engine, policy.args_allow))
    files = FILE_ARGS[engine]
    where = _where(source)
    problems: list[str] = []
    flag = ""  # the option the next values belong to; _REFUSED after a refused one
    for token in args:
        if token.startswith("@"):
            problems.append(
                f"engine argument {token!r} would read arguments from a file: "
                "give the options themselves"
            )
            continue
        if "\x00" in token:
            problems.append(f"engine argument {token!r} contains a NUL byte")
            continue
        if _is_value(token):
            if flag == _REFUSED:
                continue
            if not flag:
                problems.append(
                    f"engine argument {token!r} is not an option (a value without one before "
                    "it): the model is the profile's `model`, options start with --"
                )
            elif flag in files:
                problems += _file_problem(flag, files[flag], token, policy, where)
            continue
        flag = option_name(token)
        if flag not in allowed:
            problems.append(
                f"engine argument {flag} is not allowed by this node's "
                f"launch.args_allow.{engine} ({where}): add it there if this node should run it"
            )
            flag = _REFUSED
            continue
        if "=" in token and flag in files:
            problems += _file_problem(flag, files[flag], token.split("=", 1)[1], policy, where)
    return problems + _files_missing(args, files, allowed)


def _files_missing(args: Sequence[str], files: Mapping[str, str], allowed: set[str]) -> list[str]:
    """An allowed file option with no value after it: llama-server takes the next argument
    as the file whatever it looks like (`--chat-template-file --jinja` reads `--jinja`),
    which the checks above took for an option."""
    problems = []
    for i, token in enumerate(args):
        flag = option_name(token)
        if _is_value(token) or "=" in token or flag not in files or flag not in allowed:
            continue
        if i + 1 == len(args) or not _is_value(args[i + 1]):
            problems.append(
                f"engine argument {flag} names no file: give its value right after it "
                f"({flag} VALUE)"
            )
    return problems


def _file_problem(flag: str, kind: str, value: str, policy: LaunchPolicy, where: str) -> list[str]:
    outside = _file_value(kind, value, policy.file_dirs)
    if outside is None:
        return []
    dirs = list(policy.file_dirs) or "none"
    inline = (
        " (the engine opens a template as a file first: one given inline must not begin "
        "with / nor have a .. step)"
        if kind == "template" and any(c in value for c in "{}\n")
        else ""
    )
    return [
        f"engine argument {flag} names the file {outside!r}{inline}, which is not under this "
        f"node's launch.file_dirs ({dirs}; {where}): give an absolute path under one of them, "
        "or add its directory there if this node should read it"
    ]


def env_problems(
    policy: LaunchPolicy, engine: Engine, env: Mapping[str, str], source: str = ""
) -> list[str]:
    """Why `env` (a profile's environment) may not be set on this node. Purely computational."""
    where = _where(source)
    problems = []
    for name, value in env.items():
        if not env_allowed(policy, engine, name):
            problems.append(
                f"env {name} is not allowed by this node's launch.env_allow ({where}): "
                "add it there if this node should run it"
            )
        elif "\x00" in value:
            problems.append(f"env {name} has a NUL byte in its value")
    return problems


def check_policy(spec: LaunchSpec, policy: LaunchPolicy, *, source: str = "") -> None:
    """Raise LaunchRefused when `spec` asks for what this node's launch policy does not allow."""
    if spec.engine not in policy.engines:
        raise LaunchRefused(
            [
                f"engine {spec.engine} is not allowed by this node's launch.engines "
                f"({_where(source)}): add it there if this node should run it"
            ]
        )
    problems = env_problems(policy, spec.engine, spec.env, source)
    problems += args_problems(policy, spec.engine, spec.engine_args, source)
    if problems:
        raise LaunchRefused(problems)


def policy_errors(policy: LaunchPolicy) -> list[str]:
    """What is wrong with a `launch` section itself, each with what to change. Pure."""
    errors = []
    if not policy.engines:
        errors.append(
            "launch.engines is empty: this node would refuse every shard; list the engines "
            f"it may run ({', '.join(ENGINES)})"
        )
    for scope, names in policy.env_allow.items():
        for name in names:
            if not _ENV_PATTERN.fullmatch(name) or name == "*":
                errors.append(
                    f"launch.env_allow.{scope}: {name!r} is neither an environment name "
                    "(LETTERS_DIGITS_UNDERSCORES) nor a PREFIX_* pattern"
                )
    for scope, flags in policy.args_allow.items():
        for flag in flags:
            if not flag.startswith("-") or _is_value(flag) or "=" in flag or flag.strip() != flag:
                errors.append(
                    f"launch.args_allow.{scope}: {flag!r} is not an option name: give the full "
                    "spelling without a value, e.g. --max-num-seqs"
                )
    for d in policy.file_dirs:
        # normpath keeps a leading `//` (POSIX leaves its meaning open): `//` is / too.
        if not d.startswith("/") or not posixpath.normpath(d).strip("/"):
            errors.append(
                f"launch.file_dirs: {d!r} must be an absolute directory other than / "
                "(engines may read files under it)"
            )
    return errors
