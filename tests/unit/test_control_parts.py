"""The control plane's pure parts: config validation, the models-from-config diff, metric
labels, and the control identity's extra permission (only the three model_* subjects)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import bus, config
from llmgw.control import config as control_config
from llmgw.control import models
from llmgw.control.folding import Folded
from llmgw.control.metrics import Metrics
from llmgw.core import events, subjects
from llmgw.core.profile import ModelProfile
from llmgw.core.state import ClusterState, apply, digest, fold_records
from llmgw.pki.authorization import permissions
from llmgw.pki.identity import Identity
from tests.unit.strategies import any_event

CERTS = {"ca_file": "ca.pem", "cert_file": "c.pem", "key_file": "c-key.pem"}


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_the_example_config_loads() -> None:
    cfg = control_config.load(Path(__file__).parents[2] / "deploy" / "control.example.yaml")
    assert cfg.name == "control-1"
    assert [m.name for m in cfg.models] == ["llama-3.1-8b", "llama-3.1-70b"]


def test_environment_overrides_and_the_default_name(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LLMGW_CONTROL__LEASE_TTL_S", "3")
    monkeypatch.setenv("LLMGW_CONTROL__RECONCILE__LOST_AFTER_S", "90")
    cfg = control_config.load(write(tmp_path, {"nats": CERTS}))
    assert cfg.lease_ttl_s == 3
    assert cfg.reconcile.lost_after_s == 90
    assert cfg.name  # the short hostname


@pytest.mark.parametrize(
    ("data", "says"),
    [
        ({"name": "a.b"}, "cannot be used in a NATS subject"),
        ({"lease_ttl_s": 0.5}, "whole seconds"),
        ({"reconcile": {"unreachable_after_s": 10, "lost_after_s": 5}}, "raise it"),
        ({"models": [{"name": "m"}, {"name": "m"}]}, "listed twice"),
        ({"models": [{"name": "m", "dtype": "fp8", "gpu_class": "a100-80g"}]}, "fp8"),
        ({"nats": {"ca_file": ""}}, "llmgw ctl cert issue control"),
        ({"nats": {"servers": []}}, "nats.servers is empty"),
        ({"snapshot": {"keep": 0}}, "snapshot.keep"),
        # --check said ok; the server refused these at start, or (a window of 0, which it
        # reads as 2 minutes) at every start after the first.
        ({"nats": {"stream_replicas": 7}}, "nats.stream_replicas is 7: JetStream keeps 1 to 5"),
        ({"nats": {"stream_replicas": -1}}, "nats.stream_replicas is -1"),
        ({"nats": {"duplicate_window_s": 0}}, "nats.duplicate_window_s must be above 0"),
        ({"nats": {"duplicate_window_s": -5}}, "nats.duplicate_window_s must be above 0"),
        ({"lease_ttl": 3}, "unknown field"),
        ({"admin": {"cert_file": "admin.pem"}}, "set all of cert_file, key_file and ca_file"),
        ({"admin": {"header_timeout_s": 0}}, r"admin.header_timeout_s must be above 0"),
    ],
)
def test_bad_configs_are_refused_with_what_to_change(
    tmp_path: Path, data: dict[str, Any], says: str
) -> None:
    base: dict[str, Any] = {"name": "control-1", "nats": dict(CERTS)}
    for key, value in data.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    with pytest.raises(config.ConfigError, match=says):
        control_config.load(write(tmp_path, base))


def test_a_long_models_list_is_checked_in_time_linear_in_its_models(
    tmp_path: Path, names_read: Callable[[], int]
) -> None:
    # Each model was checked against every model before it: quadratic in the list, as
    # `llmgw ctl apply`'s file was. Counted, not timed.
    n = 2_000
    models: list[dict[str, Any]] = [{"name": f"m{i}", "aliases": [f"a{i}"]} for i in range(n)]
    path = write(tmp_path, {"name": "control-1", "nats": dict(CERTS), "models": models})
    assert len(control_config.load(path).models) == n
    assert names_read() <= 4 * n
    models.append({"name": "late", "aliases": ["a7"]})
    with pytest.raises(config.ConfigError, match="already a name or alias of model 'm7'"):
        control_config.load(write(tmp_path, {"nats": dict(CERTS), "models": models}))


yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)
keys = st.sampled_from(
    ["name", "nats", "lease_ttl_s", "models", "reconcile", "snapshot", "admin", "zzz"]
)


@settings(max_examples=150, deadline=None)
@given(data=st.dictionaries(keys, yaml_values, max_size=5))
def test_any_yaml_gives_a_config_or_a_config_error(data: dict[str, Any]) -> None:
    try:
        config_obj = config.load(control_config.ControlConfig, None, overrides=data)
    except config.ConfigError:
        return
    control_config.validate(config_obj)  # never raises: problems are returned


# --------------------------------------------------------------------------- model sync


def profile(name: str, **fields: Any) -> ModelProfile:
    return ModelProfile(name=name, engine="sim", replicas=0, **fields)


def folded(evs: list[events.Event]) -> ClusterState:
    st = ClusterState()
    for seq, ev in enumerate(evs, 1):
        assert apply(st, ev, seq) is None
    return st


def test_the_diff_declares_changes_and_removes_only_what_a_config_declared() -> None:
    by_config = events.ModelDeclared(id="config-x-1-0", ts=1.0, operator="x", profile=profile("a"))
    by_config_b = events.ModelDeclared(
        id="config-x-1-1", ts=1.0, operator="x", profile=profile("b")
    )
    by_hand = events.ModelDeclared(id="op-1", ts=2.0, operator="alice", profile=profile("c"))
    history: list[events.Event] = [by_config, by_config_b, by_hand]
    st = folded(history)
    assert models.managed(history) == {"a", "b"}
    wanted = [profile("a", aliases=("aa",)), profile("d")]
    out = models.diff(wanted, st, models.managed(history), operator="ctl-1", now=5.0, basis_seq=3)
    assert [(type(e).__name__, getattr(e, "name", None) or e.profile.name) for e in out] == [  # type: ignore[union-attr]
        ("ModelRemoved", "b"),
        ("ModelChanged", "a"),
        ("ModelDeclared", "d"),
    ]
    assert [e.id for e in out] == ["config-ctl-1-3-0", "config-ctl-1-3-1", "config-ctl-1-3-2"]
    assert all(e.operator == "ctl-1" for e in out)
    # "c" was declared by an operator: left alone although the file does not list it.
    history += out
    assert models.managed(history) == {"a", "d"}


names = st.sampled_from(["m1", "m2", "m3", "m4"])
profiles = st.builds(
    lambda name, replicas, tp: ModelProfile(
        name=name, engine="sim", replicas=replicas, tensor_parallel=tp
    ),
    names,
    st.integers(0, 3),
    st.sampled_from([1, 2, 4]),
)
catalogs = st.lists(profiles, max_size=4, unique_by=lambda p: p.name)


@settings(max_examples=100, deadline=None)
@given(first=catalogs, second=catalogs)
def test_applying_the_diff_makes_the_next_diff_empty(
    first: list[ModelProfile], second: list[ModelProfile]
) -> None:
    st_ = ClusterState()
    history: list[events.Event] = []
    seq = 0
    for wanted in (first, second):
        out = models.diff(
            wanted, st_, models.managed(history), operator="c", now=1.0, basis_seq=seq
        )
        for ev in out:
            seq += 1
            assert apply(st_, ev, seq) is None
        history += out
        assert (
            models.diff(wanted, st_, models.managed(history), operator="c", now=1.0, basis_seq=seq)
            == []
        )
        assert {n: m.profile for n, m in st_.models.items()} == {p.name: p for p in wanted}


# --------------------------------------------------------------------------- the rest


def test_the_control_plane_may_write_model_events_and_no_other_operator_event() -> None:
    perms = permissions(Identity("control", "control-1"))
    for kind in ("model_declared", "model_changed", "model_removed"):
        assert subjects.control_operator_event("control-1", kind) in perms.publish
    operator_subjects = [p for p in perms.publish if p.startswith("llmgw.events.operator")]
    assert sorted(operator_subjects) == sorted(
        subjects.control_operator_event("control-1", k)
        for k in ("model_declared", "model_changed", "model_removed")
    )


# --------------------------------------------------------------------------- the service's fold


@settings(max_examples=60, deadline=None)
@given(evs=st.lists(any_event, max_size=40))
def test_the_batched_fold_is_the_cores_and_tracks_the_fence(evs: list[events.Event]) -> None:
    folded = Folded(Metrics(), lambda: 2.0)
    records = []
    for seq, ev in enumerate(evs, 1):
        try:
            subject = events.subject_of(ev)
        except subjects.SubjectTokenError:
            continue
        records.append(bus.Record(seq, subject, 1.0, ev))  # type: ignore[arg-type]
    half = len(records) // 2
    folded.fold(records[:half])
    folded.fold(records[half:])
    core, rejected = fold_records([(r.seq, r.event) for r in records])
    assert digest(folded.state) == digest(core)
    assert folded.rejected == len(rejected)
    control = [r.seq for r in records if r.subject.startswith("llmgw.events.control.")]
    assert folded.control_seq == (control[-1] if control else 0)


def test_skipped_control_messages_move_the_fence_once_a_later_event_is_folded() -> None:
    folded = Folded(Metrics(), lambda: 2.0)
    hb = events.NodeRegistered(id="r", ts=1.0, node="n", address="a")

    def rec(seq: int) -> bus.Record:
        return bus.Record(seq, "llmgw.events.node.n.registered", 1.0, hb)

    folded.fold([rec(1)])
    junk = bus.Skipped(seq=3, subject="llmgw.events.control.x", time=1.0, error="bad")
    folded.note_skipped(junk)
    assert folded.control_seq == 0  # seq 2 may still be on its way: not yet
    folded.fold([rec(2)])
    assert folded.control_seq == 0
    folded.fold([rec(4)])
    assert folded.control_seq == 3


async def test_a_task_the_control_plane_starts_is_held_until_it_ends() -> None:
    """The event loop holds its tasks weakly: a deletion waiting on an answer that only it
    holds could be collected half done, its messages neither deleted nor retried."""
    import asyncio
    import contextlib
    import gc
    import weakref

    from llmgw.control.service import ControlService
    from tests.unit.test_control_ports import config

    svc = ControlService(config())

    async def waits_on_its_own() -> None:
        await asyncio.get_running_loop().create_future()  # held by nothing but this task

    task = svc._spawn(waits_on_its_own(), "orphan")
    held = weakref.ref(task)
    del task
    await asyncio.sleep(0)  # its first step: from now on only what holds it keeps it
    gc.collect()
    survivor = held()
    assert survivor is not None
    survivor.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await survivor
    assert survivor not in svc._spawned
