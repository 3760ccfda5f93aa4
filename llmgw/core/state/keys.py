"""The fold's handlers for tenants' API keys: created, changed, rotated, revoked.

A name is one key for its whole life; a digest belongs to one key at a time, so no two
names ever admit the same secret. A revoked key's name may be created again (with a new
secret). Expiry is a setting routers compare with their clock, not a change of state.
"""

from __future__ import annotations

from llmgw.core import events, tenancy
from llmgw.core.state.model import ClusterState, KeyState
from llmgw.core.state.rules import Reject


def _key(state: ClusterState, name: str, what: str) -> KeyState:
    key = state.keys.get(name)
    if key is None:
        raise Reject(f"{what}: no key named {name!r} (llmgw ctl key list shows them)")
    return key


def _digest_free(state: ClusterState, digest: str, name: str) -> None:
    for other, key in state.keys.items():
        if digest in (key.sha256, key.previous_sha256) and other != name:
            raise Reject(f"key {name!r}: its secret's digest is key {other!r}'s already")


def _settings(settings: tenancy.KeySettings) -> None:
    found = tenancy.problems(settings)
    if found:
        raise Reject(f"key {settings.name!r}: " + "; ".join(found))


def on_key_created(state: ClusterState, ev: events.KeyCreated, seq: int, at: float) -> None:
    name = ev.key.name
    if name in state.keys:
        raise Reject(f"key {name!r} exists: change it (llmgw ctl key update) or revoke it")
    _settings(ev.key)
    _digest_free(state, ev.sha256, name)
    state.keys[name] = KeyState(
        settings=ev.key, sha256=ev.sha256, created_ts=float(ev.ts), created_by=ev.operator
    )


def on_key_changed(state: ClusterState, ev: events.KeyChanged, seq: int, at: float) -> None:
    key = _key(state, ev.key.name, "change")
    _settings(ev.key)
    key.settings = ev.key
    key.changed_ts, key.changed_by = float(ev.ts), ev.operator


def on_key_rotated(state: ClusterState, ev: events.KeyRotated, seq: int, at: float) -> None:
    key = _key(state, ev.name, "rotation")
    if ev.sha256 == key.sha256:
        raise Reject(f"rotation of {ev.name!r}: the new secret is the current one")
    _digest_free(state, ev.sha256, ev.name)
    key.previous_sha256 = key.sha256 if ev.overlap_s > 0 else ""
    key.previous_until = float(ev.ts) + float(ev.overlap_s) if ev.overlap_s > 0 else 0.0
    key.sha256 = ev.sha256
    key.changed_ts, key.changed_by = float(ev.ts), ev.operator


def on_key_revoked(state: ClusterState, ev: events.KeyRevoked, seq: int, at: float) -> None:
    _key(state, ev.name, "revocation")
    del state.keys[ev.name]
