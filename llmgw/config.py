"""Configuration files: YAML, overlaid with `LLMGW_` environment variables, validated.

Every long-running command (control, agent, router, sim) describes its settings
as a msgspec Struct and loads them here. `LLMGW_ROUTER__LISTEN__PORT=9000`
overrides `listen.port` of a config whose env section is `ROUTER` (`__` nests).
Errors say which file and which key is wrong and what to do about it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration that cannot be used; the message says what to change."""


def read_yaml(path: str | Path) -> dict[str, Any]:
    """Read a YAML mapping from `path`; an empty file is an empty mapping."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist: check the path") from None
    except OSError as exc:
        raise ConfigError(f"cannot read config file {p}: {exc.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{p} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(
            f"{p} must hold a mapping of settings at the top, not a {type(data).__name__}"
        )
    return data


def env_overrides(section: str, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Nested mapping from `LLMGW_<SECTION>__A__B=value` variables (values parsed as YAML)."""
    environ = os.environ if environ is None else environ
    prefix = f"LLMGW_{section.upper()}__" if section else "LLMGW_"
    out: dict[str, Any] = {}
    for name, raw in environ.items():
        if not name.startswith(prefix):
            continue
        keys = [k.lower() for k in name[len(prefix) :].split("__") if k]
        if not keys:
            continue
        try:
            value = yaml.safe_load(raw) if raw != "" else ""
        except yaml.YAMLError:
            value = raw
        node = out
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ConfigError(f"{name}: {key} is both a value and a section")
            node = child
        node[keys[-1]] = value
    return out


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
    data = merge(data, env_overrides(section, environ))
    if overrides:
        data = merge(data, overrides)
    where = str(path) if path is not None else "configuration"
    try:
        return msgspec.convert(data, cls, str_keys=True)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from None
