"""Configuration files: YAML, overlaid with `LLMGW_` environment variables, validated.

Every long-running command (control, agent, router, sim) describes its settings
as a msgspec Struct and loads them here. `LLMGW_ROUTER__LISTEN__PORT=9000`
overrides `listen.port` of a config whose env section is `ROUTER` (`__` nests).
A variable's value is read as the setting's type: a string setting takes the
text as it is (`0123` stays `0123`, `on` stays `on`), a number or a boolean is
parsed as one, and lists or mappings are written in YAML's flow style (`[a, b]`).
Errors say which file, key or variable is wrong and what to do about it.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, TypeVar

import msgspec
import msgspec.inspect as mi
import yaml

from llmgw.core.limits import WHOLE_END
from llmgw.safeyaml import MAX_DEPTH as MAX_DEPTH  # the limits, as the tests read them
from llmgw.safeyaml import MAX_VALUES as MAX_VALUES
from llmgw.safeyaml import Refused
from llmgw.safeyaml import parse_yaml as parse_yaml

T = TypeVar("T")

Port = Annotated[int, msgspec.Meta(ge=0, le=65535)]
"""A TCP port: 0 (pick a free one) to 65535."""
LogLevel = Annotated[
    str,
    msgspec.Meta(
        pattern="^(debug|info|warning|error|critical|Debug|Info|Warning|Error|Critical"
        "|DEBUG|INFO|WARNING|ERROR|CRITICAL|warn|Warn|WARN|fatal|Fatal|FATAL)" + WHOLE_END,
        description="debug, info, warning (or warn), error or critical (or fatal)",
    ),
]
"""A service's `log_level`: a misspelt level is refused rather than read as info. Each is
taken lower case, capitalised or upper case (`info`, `Info`, `INFO`), as logging reads it,
and so are the other names logging knows, `warn` (Go's and many tools' word for warning)
and `fatal` (critical)."""


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says what to change."""


MAX_FILE_BYTES = 16 * 1024 * 1024
"""The largest file read as configuration. The largest real one, a keys file of 50,000
keys, is about 10 MiB; a path to a disk image or a log would otherwise be read whole (and
decoded, a second copy) before YAML refused its first line."""


def read_text(path: str | Path, what: str = "config file") -> str:
    """The UTF-8 text of `path`, at most MAX_FILE_BYTES; ConfigError saying what to do."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError(f"{what} {p} does not exist: check the path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {p}: {exc.strerror}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(
            f"{what} {p} is larger than {MAX_FILE_BYTES >> 20} MiB, which no configuration is:"
            " check the path"
        )
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise ConfigError(
            f"{what} {p} is not UTF-8 text (byte {data[exc.start]:#04x} on line {line}):"
            " save it as UTF-8"
        ) from None


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`; an empty file is an empty mapping."""
    p = Path(path)
    text = read_text(p)
    try:
        data = parse_yaml(text)
    except Refused as exc:
        line = exc.problem_mark.line + 1 if exc.problem_mark is not None else "?"
        raise ConfigError(f"{p}, line {line}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p} must hold a mapping of settings at the top, not a {type(data).__name__}"
        )
    return data


def env_overrides(
    section: str, environ: Mapping[str, str] | None = None, cls: type | None = None
) -> dict[str, Any]:
    """Nested mapping from `LLMGW_<SECTION>__A__B=value` variables.

    With `cls`, each value is read as the type of the setting it names (see the module's
    docstring) and a variable naming no setting of `cls` is an error; without, as YAML.
    """
    return _env_entries(section, environ, cls)[0]


_EnvPaths = dict[tuple[str, ...], tuple[str, str]]
"""Path of keys -> (variable, raw value), to name the variable in errors."""


def _env_entries(
    section: str, environ: Mapping[str, str] | None, cls: type | None
) -> tuple[dict[str, Any], _EnvPaths]:
    prefix = _env_prefix(section)
    root = mi.type_info(cls) if cls is not None else None
    out: dict[str, Any] = {}
    paths: _EnvPaths = {}
    for name, raw, keys in _env_settings(section, environ):
        if root is None:
            value = _yaml_value(name, raw)
        else:
            target = _setting_type(root, keys)
            if target is None:
                raise ConfigError(
                    f"{name}: there is no setting {'.'.join(keys)}: check the name"
                    f" ({prefix}A__B sets b of section a) or unset the variable"
                )
            value = _typed_value(name, raw, target)
        node = out
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {key} is both a value and a section")
            node = child
        node[keys[-1]] = value
        paths[tuple(keys)] = (name, raw)
    return out, paths


def _env_prefix(section: str) -> str:
    return f"LLMGW_{section.upper()}__" if section else "LLMGW_"


def _env_settings(
    section: str, environ: Mapping[str, str] | None
) -> list[tuple[str, str, list[str]]]:
    """(variable, raw value, keys of the setting it names) of each `LLMGW_` variable of
    `section`, in the variables' order."""
    environ = os.environ if environ is None else environ
    prefix = _env_prefix(section)
    out = []
    for name, raw in sorted(environ.items()):
        if name.startswith(prefix):
            keys = [k.lower() for k in name[len(prefix) :].split("__") if k]
            if keys:
                out.append((name, raw, keys))
    return out


def name_variables(
    problems: list[str], section: str, environ: Mapping[str, str] | None = None, *,
    where: str = "", overrides: Mapping[str, Any] | None = None,
) -> list[str]:  # fmt: skip
    """`problems` (a validation's, each naming the settings it is about, each after
    `where: ` when given), each followed by the `LLMGW_` variables that set a setting it
    names: a value a variable set is not in the file the problem is reported against, and
    the operator looks there first. A variable `overrides` (flags) replaced is not named."""
    found = [
        (_pattern(keys), name, raw)
        for name, raw, keys in _env_settings(section, environ)
        if not _overridden(keys, overrides or {})
    ]
    if not found:
        return problems
    out = []
    for problem in problems:
        text = problem.removeprefix(f"{where}: ") if where else problem
        named = [_shown(name, raw) for pattern, name, raw in found if pattern.search(text)]
        if named:
            problem += f" ({', '.join(named)} set it: change the variable or unset it)"
        out.append(problem)
    return out


def _pattern(keys: list[str]) -> re.Pattern[str]:
    """Where a problem names the setting at `keys` (`_named_as`). A plain word (`name`,
    `host`) is also a word of sentences and hints ("the model's own name", `http://host`):
    it names the setting at the problem's start, as a list's index or in backticks only."""
    paths = _named_as(keys)
    either = [rf"(?<![\w.])(?:{'|'.join(map(re.escape, paths))})(?!\w|\.\w)"]
    if "_" not in paths[0] and "." not in paths[0]:
        word = re.escape(paths[0])
        either = [rf"^{word}(?!\w|\.\w)", rf"(?<![\w.]){word}\[", f"`{word}`"]
    return re.compile("|".join(either))


def _overridden(keys: list[str], overrides: Mapping[str, Any]) -> bool:
    """Whether `overrides` replace the value at `keys` (merged after the variables)."""
    node: Any = overrides
    for key in keys:
        if not isinstance(node, Mapping):
            return True  # a section above it replaced by a value
        if key not in node:
            return False
        node = node[key]
    return not isinstance(node, Mapping)


_SECRET_WORDS = ("KEY", "SECRET", "TOKEN", "PASSWORD", "PASSPHRASE")
MAX_SHOWN_VALUE = 64
_USERINFO = re.compile(r"://[^/\s]*@")
"""A URL's credentials (`tls://user:password@host`), whatever the setting is named."""


def _shown(name: str, raw: str) -> str:
    """A variable as an error names it: with its value, unless the value may be a secret
    (a setting named like one, a URL with credentials) or is long (a list or mapping,
    which may hold one), since errors reach terminals and logs."""
    secret = any(word in name.upper() for word in _SECRET_WORDS) or _USERINFO.search(raw)
    if len(raw) > MAX_SHOWN_VALUE or secret:
        return name
    return f"{name}={raw!r}"


def _named_as(keys: list[str]) -> list[str]:
    """How a problem may name the setting at `keys`: its dotted path, or a section above it
    whose name no sentence would use as a word (`engine_ports`, `admin.tls`, not `log`)."""
    out = []
    for i in range(len(keys), 0, -1):
        path = ".".join(keys[:i])
        if i == len(keys) or "_" in path or "." in path:
            out.append(path)
    return out


def _setting_type(t: mi.Type, keys: list[str]) -> mi.Type | None:
    """The type of the setting at `keys` under `t`; None when there is none."""
    for key in keys:
        if isinstance(t, mi.UnionType):
            # `section: X | None`: a variable sets a key inside X.
            t = next((m for m in t.types if isinstance(m, (mi.StructType, mi.DictType))), t)
        if isinstance(t, mi.StructType):
            field = next((f for f in t.fields if f.encode_name == key), None)
            if field is None:
                return None
            t = field.type
        elif isinstance(t, mi.DictType):
            t = t.value_type
        elif isinstance(t, mi.AnyType):
            return t
        else:
            return None
    return t


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NULL = {"", "null", "~", "none"}


def _typed_value(name: str, raw: str, t: mi.Type) -> Any:
    members = t.types if isinstance(t, mi.UnionType) else (t,)
    text = raw.strip()
    if any(_is_text(m) for m in members):
        return raw
    if any(isinstance(m, mi.NoneType) for m in members) and text.lower() in _NULL:
        return None
    if any(isinstance(m, mi.BoolType) for m in members):
        if text.lower() in _TRUE:
            return True
        if text.lower() in _FALSE:
            return False
    if any(isinstance(m, mi.IntType) for m in members):
        try:
            return int(text, 10)
        except ValueError:
            pass
    if any(isinstance(m, mi.FloatType) for m in members):
        try:
            number = float(text)
        except ValueError:
            pass
        else:
            if not math.isfinite(number):  # `nan` passes every `<= 0` check of a duration
                raise ConfigError(
                    f"{_shown(name, raw)} is not a finite number: set one, or unset it"
                )
            return number
    if all(isinstance(m, (mi.BoolType, mi.IntType, mi.FloatType, mi.NoneType)) for m in members):
        wanted = " or ".join(_describe(m) for m in members)
        raise ConfigError(f"{_shown(name, raw)} is not {wanted}: set it to one, or unset it")
    return _yaml_value(name, raw)


def _is_text(t: mi.Type) -> bool:
    if isinstance(t, (mi.StrType, mi.CustomType, mi.EnumType)):
        return True
    return isinstance(t, mi.LiteralType) and all(isinstance(v, str) for v in t.values)


def _describe(t: mi.Type) -> str:
    if isinstance(t, mi.BoolType):
        return "true or false"
    if isinstance(t, mi.IntType):
        return "a whole number"
    if isinstance(t, mi.FloatType):
        return "a number"
    return "empty"


def _yaml_value(name: str, raw: str) -> Any:
    if raw == "":
        return ""
    try:
        return parse_yaml(raw)
    except Refused as exc:
        raise ConfigError(f"{_shown(name, raw)}: {exc.problem}") from None
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else "unreadable"
        raise ConfigError(
            f"{name} is not valid YAML ({first}): write a list as [a, b] and a mapping as"
            " {key: value}"
        ) from None


_AT = re.compile(r"^(?P<what>.*) - at `\$(?P<path>[^`]*)`$", re.DOTALL)


def _blame(exc: msgspec.ValidationError, where: str, paths: _EnvPaths) -> str:
    """The error, naming the environment variable that set the value, if one did."""
    m = _AT.match(str(exc))
    if m is None:
        return f"{where}: {exc}"
    at = m.group("path")
    for keys, (name, raw) in paths.items():
        p = "." + ".".join(keys)
        if at == p or at.startswith((p + ".", p + "[")):
            return f"{_shown(name, raw)}: {m.group('what')}: change the variable or unset it"
    return f"{where}: {exc}"


def _check_finite(value: Any, at: str) -> None:
    """Refuse a NaN or an infinity among the overrides (command-line flags), as the file's
    and the variables' are refused."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{at} is {value} on the command line: give a finite number")
    if isinstance(value, Mapping):
        for key, child in value.items():
            _check_finite(child, f"{at}.{key}" if at else str(key))


def merge(base: dict[str, Any], over: Mapping[str, Any]) -> dict[str, Any]:
    """Deep merge: mappings merge key by key, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out


def load(
    cls: type[T],
    path: str | Path | None = None,
    *,
    section: str = "",
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> T:
    """Load `cls` from an optional YAML file, then env overrides, then explicit overrides."""
    data: dict[str, Any] = read_yaml(path) if path is not None else {}
    env, env_paths = _env_entries(section, environ, cls)
    data = merge(data, env)
    if overrides:
        _check_finite(overrides, "")
        data = merge(data, overrides)
        env_paths = {k: v for k, v in env_paths.items() if not _overridden(list(k), overrides)}
    where = str(path) if path is not None else "configuration"
    try:
        return msgspec.convert(data, cls, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(_blame(exc, where, env_paths)) from None
