"""The pure parts of `llmgw ctl`: points in time, models.yaml, views, diffs, drain plans,
event lines, certificates' identities, tables. No NATS here (tests/integration/test_ctl*.py).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import errno
import gc
import io
import json
import sys
import weakref
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from llmgw import bus
from llmgw.core import events, state, views
from llmgw.ctl import catalogfile, changes, eventlines, history, operations, render
from llmgw.ctl.errors import BadInput
from llmgw.ctl.session import Session
from llmgw.ctl.settings import CtlConfig, identity_of, load
from llmgw.pki.ca import CertificateAuthority, subject_name
from llmgw.pki.identity import Identity
from llmgw.pki.store import utcnow
from tests.harness import TestPki
from tests.unit import scenarios, strategies

NOW = 1_800_000_000.0


# --------------------------------------------------------------------------- points


def test_times_in_every_accepted_form() -> None:
    assert (
        history.parse_time("2027-01-15T08:00:00Z", NOW)
        == dt.datetime(2027, 1, 15, 8, tzinfo=dt.UTC).timestamp()
    )
    assert (
        history.parse_time("2027-01-15 08:00:00+01:00", NOW)
        == dt.datetime(2027, 1, 15, 7, tzinfo=dt.UTC).timestamp()
    )
    assert (
        history.parse_time("2027-01-15T08:00:00", NOW)
        == dt.datetime(2027, 1, 15, 8, tzinfo=dt.UTC).timestamp()
    )  # no zone: UTC, as the log's times are
    assert history.parse_time("@1764386000.5", NOW) == 1764386000.5
    assert history.parse_time("10m", NOW) == NOW - 600
    assert history.parse_time("2h ago", NOW) == NOW - 7200
    assert history.parse_time("1.5d", NOW) == NOW - 1.5 * 86400
    assert history.parse_point("1234", NOW) == history.Point(seq=1234)
    assert history.parse_point("30s", NOW) == history.Point(time=NOW - 30)


@given(st.text(max_size=40))
def test_any_text_is_a_time_or_a_one_line_bad_input(text: str) -> None:
    try:
        value = history.parse_time(text, NOW)
    except BadInput as exc:
        message = str(exc)
    else:
        assert isinstance(value, float)
        return
    assert "\n" not in message
    assert "use ISO 8601" in message


def test_server_times_with_nanoseconds() -> None:
    assert history._parse_server_time("2026-11-29T16:41:36.508123456Z") == pytest.approx(
        dt.datetime(2026, 11, 29, 16, 41, 36, tzinfo=dt.UTC).timestamp() + 0.508123456
    )
    assert history._parse_server_time("0001-01-01T00:00:00Z") == 0.0
    assert history.format_time(0.25) == "1970-01-01T00:00:00.250Z"


# --------------------------------------------------------------------------- models.yaml


def test_models_yaml_in_both_shapes() -> None:
    listed = catalogfile.parse("- name: a\n  engine: sim\n", "f")
    nested = catalogfile.parse("models:\n  - name: a\n    engine: sim\n", "f")
    assert listed == nested
    assert listed[0].name == "a"
    assert catalogfile.parse("", "f") == []
    assert catalogfile.parse("models:\n", "f") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("models: [1]\nextra: 2\n", "unknown top-level key(s) extra"),
        ("- name: a\n  engine: sim\n  dtype: int4\n", "dtype 'int4' is not supported"),
        ("- name: a\n  engine: sim\n  replicas: many\n", "replicas"),
        ("- name: a\n  engine: sim\n  aliases: [b]\n- name: b\n  engine: sim\n", "already a name"),
        ("- [1, 2]\n", "entry 0 is a list"),
        (": : :\n", "not valid YAML"),
    ],
)
def test_malformed_models_yaml(text: str, expected: str) -> None:
    with pytest.raises(BadInput) as info:
        catalogfile.parse(text, "models.yaml")
    assert expected in str(info.value)
    assert str(info.value).startswith("models.yaml")
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("field", ["name", "engine", "dtype"])
def test_a_refusal_quotes_a_huge_value_shortened(field: str) -> None:
    # `engine: <a megabyte>` came back whole in the one-line error (and a list of a
    # million values through aliases as its repr): megabytes on the operator's terminal.
    big = "x" * 1_000_000
    entry = {"name": "a", "engine": "sim", field: big}
    with pytest.raises(BadInput) as info:
        catalogfile.parse(json.dumps([entry]), "models.yaml")
    assert len(str(info.value)) < 1000
    assert "\n" not in str(info.value)


@settings(suppress_health_check=[HealthCheck.too_slow], max_examples=200)
@given(st.text(max_size=200))
def test_any_text_parses_or_is_refused_cleanly(text: str) -> None:
    with contextlib.suppress(BadInput):
        catalogfile.parse(text, "f")


def test_plan_declares_changes_removes_removals_first() -> None:
    current = {
        "a": state.ModelState(profile=scenarios.profile("a", engine="sim")),
        "b": state.ModelState(profile=scenarios.profile("b", engine="sim")),
        "c": state.ModelState(profile=scenarios.profile("c", engine="sim")),
    }
    wanted = [
        scenarios.profile("a", engine="sim"),
        scenarios.profile("b", engine="sim", replicas=3),
        scenarios.profile("d", engine="sim"),
    ]
    ops = catalogfile.plan(current, wanted)
    assert [(o.action, o.name) for o in ops] == [
        ("remove", "c"),
        ("change", "b"),
        ("declare", "d"),
    ]
    assert ops[1].changes == ("replicas: 1 -> 3", "(no restart needed)")
    assert "~ change b" in ops[1].render()
    kept = catalogfile.plan(current, wanted, prune=False)
    assert [o.action for o in kept] == ["change", "declare"]
    assert catalogfile.plan(current, [m.profile for m in current.values()]) == []


# --------------------------------------------------------------------------- views, drain


def test_node_rows_count_gpus_by_class_and_say_why_excluded() -> None:
    sim = scenarios.Sim()
    sim.register("node-a", count=4, unhealthy=[3])
    sim.declare(scenarios.profile("m", engine="sim"))
    sim.settle()
    (row,) = views.node_rows(sim.state, sim.now + 5)
    c = row["gpu_classes"]["h100-80g"]
    assert (c["total"], c["free"], c["used"], c["unhealthy"]) == (4, 2, 1, 1)
    assert c["excluded"] == ["GPU 3: uncorrected ECC errors (2)"]
    assert row["state"] == "ready"
    assert row["heartbeat_age_s"] == 5.0
    (m,) = views.model_rows(sim.state, sim.now)
    assert (m["replicas_serving"], m["replicas_wanted"], m["unplaceable"]) == (1, 1, None)
    table = render.nodes_table([row])
    assert "h100-80g 2/4 free, 1 used, 1 unhealthy" in table
    assert "GPU 3: uncorrected ECC errors" in table


def test_an_uncordoned_node_shows_no_drain() -> None:
    # `ctl nodes --json` showed when a drain began after the node was uncordoned, beside
    # draining: false (the fold keeps the time; the view shows it only while it applies).
    sim = scenarios.Sim()
    sim.register("node-a", count=2)
    sim.drain("node-a", grace_s=100)
    (row,) = views.node_rows(sim.state, sim.now)
    assert (row["draining"], row["drain_since"], row["drain_grace_s"]) == (True, sim.now, 100)
    sim.append(events.NodeUncordoned(id=sim.eid("op"), ts=sim.now, operator="alice", node="node-a"))
    (row,) = views.node_rows(sim.state, sim.now)
    assert (row["draining"], row["drain_since"], row["drain_grace_s"]) == (False, None, None)


def test_drain_plan_progress_and_diff_across_it() -> None:
    sim = scenarios.Sim()
    for n in ("node-a", "node-b"):
        sim.register(n, count=2)
    sim.declare(scenarios.profile("m", engine="sim", gpu_class=""))
    sim.settle()
    (replica,) = sim.serving("m")
    holder = replica.shards[0].node
    other = "node-b" if holder == "node-a" else "node-a"
    (move,) = operations.drain_plan(sim.state, holder, sim.now)
    assert move.replica == replica.id
    assert move.to.startswith(f"{other}:")
    assert not sim.state.nodes[holder].draining  # the plan changed a copy only
    before = history.copy_state(sim.state)
    progress = operations.drain_progress(sim.state, holder, [replica.id], sim.now)
    assert not progress.done
    sim.drain(holder, grace_s=100)
    sim.settle()
    progress = operations.drain_progress(sim.state, holder, [replica.id], sim.now)
    assert (progress.stopped, progress.replaced, progress.done) == (0, 1, False)
    sim.advance(60)  # past the shard drain time: the original is stopped
    sim.settle()
    progress = operations.drain_progress(sim.state, holder, [replica.id], sim.now)
    assert progress.done
    assert (progress.stopped, progress.replaced) == (1, 1)
    (moved,) = sim.serving("m")
    found = {(c.scope, c.key, c.field) for c in changes.diff(before, sim.state)}
    assert found == {
        ("node", holder, "draining"),
        ("node", holder, "drain_grace_s"),
        ("replica", replica.id, "removed"),
        ("replica", moved.id, "added"),
        ("endpoint", replica.id, "removed"),
        ("endpoint", moved.id, "added"),
    }
    assert changes.diff(sim.state, sim.state) == []


def test_a_drain_with_nowhere_to_go_says_why() -> None:
    sim = scenarios.Sim()
    sim.register("node-a", count=1)
    sim.declare(scenarios.profile("m", engine="sim"))
    sim.settle()
    (move,) = operations.drain_plan(sim.state, "node-a", sim.now)
    assert move.to == ""
    assert "draining" in move.why_not
    assert "nowhere" in move.render()


@settings(max_examples=30, deadline=None)
@given(st.lists(st.sampled_from(["node-a", "node-b", "node-c"]), min_size=1, max_size=6))
def test_diff_is_empty_only_between_equal_states(cordons: list[str]) -> None:
    sim = scenarios.Sim()
    for n in ("node-a", "node-b", "node-c"):
        sim.register(n, count=2)
    before = history.copy_state(sim.state)
    for n in cordons:
        sim.cordon(n, reason=f"r-{n}")
    found = changes.diff(before, sim.state)
    assert {c.key for c in found} == set(cordons)
    assert all(c.scope == "node" for c in found)
    assert changes.diff(sim.state, history.copy_state(sim.state)) == []
    assert (found == []) == (state.digest(before) == state.digest(sim.state))


# --------------------------------------------------------------------------- event lines


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(strategies.any_event)
def test_every_event_has_a_line_and_filters_never_crash(event: events.Event) -> None:
    line = eventlines.summary(event)
    assert line
    assert "\n" not in line
    assert "\x1b" not in line
    tag = events.tag_of(type(event))
    assert eventlines.matches(event, tag)
    assert eventlines.matches(event, tag.partition(".")[0])
    for target in eventlines.nodes_of(event) | eventlines.replicas_of(event):
        assert eventlines.touches(event, target)


def test_timeline_membership() -> None:
    placed = events.ReplicaPlaced(
        id="p",
        ts=0,
        replica_id="r2",
        model="m",
        replaces="r1",
        shards=(events.ShardAssignment(shard=0, node="node-b", gpus=(0,)),),
    )
    assert eventlines.touches(placed, "r1")
    assert eventlines.touches(placed, "node-b")
    assert not eventlines.touches(placed, "node-a")
    hb = events.Heartbeat(id="h", ts=0, node="node-a")
    assert eventlines.touches(hb, "node-a", "llmgw.events.node.node-a.heartbeat")
    assert eventlines.matches_tag("node.heartbeat", "heartbeat")
    assert not eventlines.matches_tag("node.heartbeat", "node.shard")


# --------------------------------------------------------------------------- settings


class TriedAgain(OSError):
    """A reconnect try that failed (a class of its own: OSError takes no weak reference)."""


async def test_a_long_session_keeps_no_error_of_its_connection(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Session.open keeps the connection's errors to say why a connect failed; the console's
    session, connected for days, kept every one after it too (each reconnect try of an
    outage, each slow-consumer drop, with its subscription) for as long as it ran."""
    pki = TestPki(tmp_path)
    operator = pki.issue(Identity("operator", "carol"), reload=False)
    cfg = CtlConfig(ca_file=str(pki.certs.ca_cert), cert_file=str(pki.certs.cert(operator)))
    callbacks: list[Callable[[Exception], Awaitable[None]]] = []

    async def connect(*_: object, error_cb: Callable[[Exception], Awaitable[None]],
                      **__: object) -> object:  # fmt: skip
        callbacks.append(error_cb)
        return type("Client", (), {"jetstream": lambda self: None})()

    monkeypatch.setattr(bus, "connect", connect)
    await Session.open(cfg, reconnect_forever=True)
    errors = [TriedAgain(f"try {i}") for i in range(100)]
    kept = [weakref.ref(e) for e in errors]
    for e in errors:
        await callbacks[0](e)
    del errors, e
    gc.collect()
    assert sum(ref() is not None for ref in kept) <= 1


def test_identity_comes_from_the_certificate(tmp_path: Path) -> None:
    ca = CertificateAuthority.create(now=utcnow())
    issued = ca.issue_client(Identity("operator", "carol"), now=utcnow())
    cert = tmp_path / "carol.pem"
    cert.write_bytes(issued.cert_pem)
    assert identity_of(cert) == Identity("operator", "carol")
    foreign = ca.issue_client(subject_name("x", "strangers", "elsewhere"), now=utcnow())
    other = tmp_path / "x.pem"
    other.write_bytes(foreign.cert_pem)
    with pytest.raises(BadInput, match="not an llmgw identity"):
        identity_of(other)
    with pytest.raises(BadInput, match="cert issue operator"):
        identity_of(tmp_path / "missing.pem")
    key = tmp_path / "k.pem"
    key.write_bytes(issued.key_pem)
    with pytest.raises(BadInput, match="not a PEM certificate"):
        identity_of(key)


def test_settings_layers(tmp_path: Path) -> None:
    assert load(environ={}).cert_file == "nats/certs/operator/admin.pem"
    assert load(environ={}).key_path == "nats/certs/operator/admin-key.pem"
    path = tmp_path / "ctl.yaml"
    path.write_text("servers: [tls://a:4222]\ncert_file: /x/bob.pem\n")
    cfg = load(path, environ={"LLMGW_CTL__CA_FILE": "/ca.pem"})
    assert cfg.servers == ("tls://a:4222",)
    assert cfg.ca_file == "/ca.pem"
    assert cfg.key_path == "/x/bob-key.pem"
    assert load(path, overrides={"servers": ["tls://b:1"]}, environ={}).servers == ("tls://b:1",)
    assert load(environ={"LLMGW_CTL_CONFIG": str(path)}).servers == ("tls://a:4222",)
    path.write_text("server: x\n")
    with pytest.raises(BadInput, match="server"):
        load(path, environ={})


def test_a_bad_config_that_the_variable_named_says_so(tmp_path: Path) -> None:
    # LLMGW_CTL_CONFIG left set from an `llmgw up` whose folder is gone: the error named a
    # file the operator never gave, and not where it came from.
    gone = tmp_path / "gone" / "ctl.yaml"
    with pytest.raises(BadInput) as info:
        load(environ={"LLMGW_CTL_CONFIG": str(gone)})
    assert str(gone) in str(info.value)
    assert "LLMGW_CTL_CONFIG" in str(info.value)
    assert "unset it" in str(info.value)
    broken = tmp_path / "ctl.yaml"
    broken.write_text("servers: [a\n")
    with pytest.raises(BadInput, match="LLMGW_CTL_CONFIG"):
        load(environ={"LLMGW_CTL_CONFIG": str(broken)})
    with pytest.raises(BadInput) as info:  # a path given as --config is that flag's
        load(gone, environ={"LLMGW_CTL_CONFIG": str(broken)})
    assert "LLMGW_CTL_CONFIG" not in str(info.value)


# --------------------------------------------------------------------------- render


def test_tables_align_and_colour_only_when_asked() -> None:
    text = render.table(["A", "LONGER"], [["xx", "ready"], ["y", "lost"]])
    assert text.splitlines() == ["A   LONGER", "xx  ready", "y   lost"]
    painted = render.table(["A", "S"], [["x", "lost"]], colour=True, colour_col=1)
    assert "\x1b[31m" in painted
    assert "\x1b[" not in render.table(["A", "S"], [["x", "lost"]], colour_col=1)
    hostile = render.table(["E"], [["boom\n\x1b[2Jcleared"]])
    assert hostile.splitlines() == ["E", "boom\\x0a\\x1b[2Jcleared"]
    assert render.age(None) == "-"
    assert render.age(5) == "5.0s"
    assert render.age(7200) == "2.0h"


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_only_on_a_terminal() -> None:
    tty = _Tty()
    bar = render.ProgressBar(tty)
    bar(500, 1000)
    bar(1000, 1000)
    bar.close()
    out = tty.getvalue()
    assert "\r" in out
    assert "100% 1,000/1,000 events" in out
    assert out.endswith("\n")
    plain = io.StringIO()
    quiet = render.ProgressBar(plain)
    quiet(1000, 1000)
    quiet.close()
    assert plain.getvalue() == ""


def test_event_lines_are_coloured_by_writer_on_a_terminal() -> None:
    from llmgw.bus import Record
    from llmgw.cli.ctl_history import _event_line

    rec = Record(7, "llmgw.events.operator.node_cordoned", 0.0, events.NodeCordoned(
        id="c", ts=0, operator="carol", node="node-a"))  # fmt: skip
    coloured = _event_line(rec, True)
    assert "\x1b[35moperator.node_cordoned" in coloured
    assert coloured.endswith("node-a cordoned by carol")
    assert "\x1b[" not in _event_line(rec, False)


def test_the_example_files_in_deploy_load() -> None:
    deploy = Path(__file__).resolve().parents[2] / "deploy"
    cfg = load(deploy / "ctl.example.yaml", environ={})
    assert cfg.cert_file == "nats/certs/operator/admin.pem"
    assert cfg.control_url == "http://127.0.0.1:9190"
    text = (deploy / "models.example.yaml").read_text()
    names = [p.name for p in catalogfile.parse(text, "models.example.yaml")]
    assert names == ["llama-3.1-8b", "qwen2.5-72b", "tiny-sim"]


def test_replica_rows_show_errors_and_engine_log_tails() -> None:
    sim = scenarios.Sim()
    sim.register("node-a", count=2)
    sim.declare(scenarios.profile("m", engine="sim"))
    sim.settle()
    (rid,) = sim.state.replicas
    # What a failed status leaves in the state (the fold's own handling is test_state's).
    replica = sim.state.replicas[rid]
    shard = replica.shards[0]
    shard.phase = "failed"
    shard.error = "engine exited with code 1"
    shard.log_tail = ("loading weights", "CUDA out of memory")
    (row,) = views.replica_rows(sim.state, "m")
    assert row["shards"][0]["error"] == "engine exited with code 1"
    assert row["shards"][0]["log_tail"] == ["loading weights", "CUDA out of memory"]
    assert views.replica_rows(sim.state, "other") == []
    text = render.replicas_table([row], log_lines=1)
    assert "engine exited with code 1" in text
    assert f"{rid}/0 on node-a, engine log tail:" in text
    assert "  | CUDA out of memory" in text
    assert "loading weights" not in text


@given(
    seen=st.lists(st.one_of(st.none(), st.floats(0, 1e4)), max_size=6),
    horizon=st.one_of(st.none(), st.floats(0, 1e4)),
)
def test_only_ages_from_before_the_heartbeat_horizon_are_unset(
    seen: list[float | None], horizon: float | None
) -> None:
    rows = [{"last_seen": s, "heartbeat_age_s": 1.0} for s in seen]
    changed = history.without_expired_heartbeats(rows, horizon)
    for s, row in zip(seen, rows, strict=True):
        gone = s is not None and (horizon is None or s < horizon)
        assert (row["heartbeat_age_s"] is None) == gone
        assert row.get("heartbeat_expired", False) == gone
    assert changed == sum(1 for r in rows if r.get("heartbeat_expired"))
    assert "expired" in render.nodes_table(
        [
            {
                "name": "n",
                "state": "ready",
                "cordon_reason": "",
                "gpu_classes": {},
                "fabrics": [],
                "heartbeat_age_s": None,
                "heartbeat_expired": True,
            }
        ]
    )


# --------------------------------------------------------------------------- output


class _ClosedPipe(io.StringIO):
    """stdout whose reader has gone (`head` after its lines): every write is EPIPE."""

    def write(self, text: str) -> int:
        raise BrokenPipeError(errno.EPIPE, "Broken pipe")


def test_a_reader_that_stops_reading_is_not_a_nats_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """`llmgw ctl events | head -7`, as README shows it: the write after head exits finds
    the pipe closed. That ends the command as click ends any on a closed pipe (quietly),
    not with "check that NATS is up" and the exit status of a failed command."""
    from llmgw.cli import ctl_common

    class Session:
        async def close(self) -> None:
            pass

    async def open_session(_cfg: object) -> Session:
        return Session()

    async def body(_session: object) -> int:
        ctl_common.out("first line")
        return 0

    monkeypatch.setattr(ctl_common.Session, "open", staticmethod(open_session))
    monkeypatch.setattr(sys, "stdout", _ClosedPipe())
    conn = ctl_common.Conn(config=None, servers=None, ca=None, cert=None, key=None)
    with pytest.raises(BrokenPipeError):  # typer's main turns it into a quiet exit
        ctl_common.run(conn, body)
    assert capsys.readouterr().err == ""


def test_a_drain_preview_puts_each_replica_where_the_drain_does() -> None:
    """The preview reserved each move twice, so the next move of the same model spread
    away from a node the real drain still chooses."""
    sim = scenarios.Sim()
    for n in ("node-a", "node-c"):
        sim.register(n, count=4)
    sim.declare(scenarios.profile("m", engine="sim", gpu_class="", replicas=3))
    sim.settle()
    assert sorted(s.node for r in sim.serving("m") for s in r.shards) == [
        "node-a",
        "node-a",
        "node-c",
    ]
    sim.register("node-b", count=4)  # empty: the drain's first choice, for both
    moves = operations.drain_plan(sim.state, "node-a", sim.now)
    assert [m.to.split(":")[0] for m in moves] == ["node-b", "node-b"], moves
    sim.drain("node-a", grace_s=100)
    sim.settle()
    placed = [s.node for r in sim.state.active_replicas("m") for s in r.shards]
    assert sorted(n for n in placed if n != "node-a") == ["node-b", "node-b", "node-c"]
