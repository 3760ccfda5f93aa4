"""Tenants' keys in the core: the fold of key events, the budget calendar, the fleet-wide
limit arithmetic, subject escaping, `ctl key`'s flags, and the router's merged key set.
Property-tested where the input is a writer's or an operator's."""

from __future__ import annotations

import datetime
import string

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw.cli.main import app
from llmgw.core import events, quota, state, subjects, tenancy
from llmgw.ctl import keys as keys_view
from llmgw.ctl.errors import BadInput
from llmgw.router import auth

NAMES = st.sampled_from(["a", "b", "c"])
DIGESTS = st.sampled_from(["1" * 64, "2" * 64, "3" * 64, "4" * 64])
SETTINGS = st.builds(
    tenancy.KeySettings,
    name=NAMES,
    team=st.sampled_from(["", "t"]),
    models=st.sampled_from([("*",), ("m",), ()]),
    requests_per_s=st.none() | st.floats(0.001, 100),
)


def _event(draw: st.DrawFn, i: int) -> events.Event:
    kind = draw(st.sampled_from(["create", "change", "rotate", "revoke"]))
    common = {"id": f"e{i}", "ts": float(i), "operator": "alice"}
    if kind == "create":
        return events.KeyCreated(**common, key=draw(SETTINGS), sha256=draw(DIGESTS))
    if kind == "change":
        return events.KeyChanged(**common, key=draw(SETTINGS))
    if kind == "rotate":
        overlap = draw(st.sampled_from([0.0, 5.0]))
        return events.KeyRotated(**common, name=draw(NAMES), sha256=draw(DIGESTS),
                                 overlap_s=overlap)  # fmt: skip
    return events.KeyRevoked(**common, name=draw(NAMES))


@st.composite
def key_logs(draw: st.DrawFn) -> list[events.Event]:
    return [_event(draw, i) for i in range(draw(st.integers(1, 25)))]


@settings(max_examples=300, deadline=None)
@given(key_logs())
def test_no_two_keys_ever_admit_the_same_secret_and_every_key_is_usable(
    log: list[events.Event],
) -> None:
    st_ = state.ClusterState()
    for seq, ev in enumerate(log, 1):
        # Through the log's own codec, as every reader folds it.
        before = state.digest(st_)
        reason = state.apply(st_, events.decode(events.encode(ev)), seq)
        if reason is not None:
            assert state.digest(st_) == before, "a refused key event changed the state"
        digests = [d for k in st_.keys.values() for d in (k.sha256, k.previous_sha256) if d]
        assert len(digests) == len(set(digests))
        for name, key in st_.keys.items():
            assert key.settings.name == name
            assert tenancy.problems(key.settings) == []
        if isinstance(ev, events.KeyRevoked) and reason is None:
            assert ev.name not in st_.keys
    again = state.decode_snapshot(state.encode_snapshot(st_))
    assert state.digest(again) == state.digest(st_)


def test_a_key_name_is_one_key_until_revoked_and_then_may_be_made_again() -> None:
    st_ = state.ClusterState()
    k = tenancy.KeySettings(name="a")
    made = events.KeyCreated(id="1", ts=1.0, operator="alice", key=k, sha256="1" * 64)
    assert state.apply(st_, made, 1) is None
    again = events.KeyCreated(id="2", ts=2.0, operator="bob", key=k, sha256="2" * 64)
    assert "exists" in (state.apply(st_, again, 2) or "")
    revoked = events.KeyRevoked(id="3", ts=3.0, operator="bob", name="a")
    assert state.apply(st_, revoked, 3) is None
    assert state.apply(st_, events.KeyCreated(id="4", ts=4.0, operator="bob", key=k,
                                              sha256="2" * 64), 4) is None  # fmt: skip
    assert st_.keys["a"].created_by == "bob"


@settings(max_examples=500, deadline=None)
@given(st.floats(0, 2.0**34 - 1), st.sampled_from(["day", "month"]))
def test_budget_periods_are_utc_days_and_months(ts: float, period: tenancy.Period) -> None:
    d = datetime.datetime.fromtimestamp(ts, datetime.UTC)
    assert tenancy.period_of(ts, period) == d.strftime("d%Y%m%d" if period == "day" else "m%Y%m")
    end = tenancy.period_end(ts, period)
    assert end > ts
    assert tenancy.period_of(end, period) != tenancy.period_of(ts, period)
    assert tenancy.period_of(end - 1e-3, period) == tenancy.period_of(ts, period)
    assert datetime.datetime.fromtimestamp(end, datetime.UTC).time() == datetime.time(0)


@settings(max_examples=300, deadline=None)
@given(
    st.floats(1 / 60, 1000),
    st.lists(st.tuples(st.integers(0, 3), st.integers(1, 50)), max_size=200),
)
def test_the_routers_grants_in_a_window_never_exceed_the_limit_nor_waste_it(
    per_s: float, increments: list[tuple[int, int]]
) -> None:
    """However the routers' leases interleave at the server, what the totals grant adds up
    to at most the window's allowance, and to all of it once enough was asked."""
    allowed = quota.allowance(per_s)
    total = granted = asked = 0
    for _router, lease in increments:
        total += lease  # the server applies increments one after another
        asked += lease
        got = quota.granted(total, lease, allowed)
        assert 0 <= got <= lease
        granted += got
    assert granted == min(asked, allowed)


@given(st.text(max_size=40))
def test_any_model_name_escapes_to_one_subject_token_and_back(name: str) -> None:
    token = subjects.escape(name)
    assert token
    assert not any(c in token for c in ". *>\t\r\n")
    assert subjects.unescape(token) == name.encode("utf-8", "replace").decode("utf-8", "replace")


def test_usage_subjects_are_read_back() -> None:
    s = subjects.usage_counter("team-a", 491_000, "meta-llama/Llama-3.1-8B", "out")
    assert subjects.usage_parts(s) == ("team-a", 491_000, "meta-llama/Llama-3.1-8B", "out")
    assert subjects.usage_parts(subjects.budget_counter("team-a", "d20261202")) is None
    with pytest.raises(subjects.SubjectTokenError):
        subjects.limit_counter("a.b", "r", 1)


TEXT = st.text(alphabet=string.printable + "é∞", max_size=12)


@settings(max_examples=300, deadline=None)
@given(
    st.text(max_size=70), TEXT | st.none(), TEXT | st.none(), TEXT | st.none(),
    TEXT | st.none(), TEXT | st.none(),
)  # fmt: skip
def test_any_ctl_key_flags_make_usable_settings_or_say_what_to_change(
    name: str, rps: str | None, tpm: str | None, budget: str | None, expires: str | None,
    priority: str | None,
) -> None:  # fmt: skip
    flags = keys_view.Flags(rps=rps, tpm=tpm, budget=budget, expires=expires, priority=priority)
    try:
        made = keys_view.settings(name, flags, now=1.8e9)
    except BadInput as exc:
        problem = str(exc)
        assert problem, "a refusal that says nothing"
        return
    # What ctl would publish decodes in every reader and folds.
    ev = events.KeyCreated(id="x", ts=1.8e9, operator="alice", key=made, sha256="a" * 64)
    assert state.apply(state.ClusterState(), events.decode(events.encode(ev)), 1) is None


@pytest.mark.parametrize(
    "args",
    [
        ["key", "create", "--name", "a.b"],
        ["key", "create", "--name", "ok", "--rps", "-1"],
        ["key", "create", "--name", "ok", "--tpm", "lots"],
        ["key", "create", "--name", "ok", "--budget-tokens", "10/week"],
        ["key", "create", "--name", "ok", "--expires", "yesterday"],
        ["key", "create", "--name", "ok", "--priority", "urgent"],
        ["key", "create", "--name", "ok", "--rps", "0.001"],
        ["key", "update", "bad name", "--rps", "5"],
        ["key", "rotate", "ok", "--overlap", "1y"],
        ["key", "create"],
        ["usage", "--since", "forever"],
        ["usage", "--key", "a.b"],
    ],
)
def test_bad_ctl_key_input_exits_2_before_connecting(args: list[str]) -> None:
    # No server is given or reachable: a 2 here is the flag check, not a connection error.
    result = CliRunner().invoke(app, ["ctl", *args, "--server", "nats://127.0.0.1:1"])
    assert result.exit_code == 2, result.output
    assert "error" in result.output.lower() or "usage" in result.output.lower()


def test_a_rotated_secret_is_refused_after_its_overlap_and_the_file_keeps_its_own() -> None:
    old, new = auth.new_key(), auth.new_key()
    key = state.KeyState(settings=tenancy.KeySettings(name="svc"), sha256=auth.digest(new),
                         previous_sha256=auth.digest(old), previous_until=100.0)  # fmt: skip
    keys = auth.merged(None, {"svc": key}, now=0.0)
    assert keys.lookup(f"Bearer {old}", wall=99.0) is not None
    assert keys.lookup(f"Bearer {old}", wall=100.0) is None
    assert keys.lookup(f"Bearer {new}", wall=1e9) is not None
    file_keys = auth.Keys([auth.Principal(tenancy.KeySettings(name="boot"), auth.digest(old), 0)])
    both = auth.merged(file_keys, {"svc": key}, now=0.0)
    p = both.lookup(f"Bearer {old}", wall=1e9)
    assert p is not None
    assert p.name == "boot"
    assert not p.fleet
    assert both.lookup(f"Bearer {new}", wall=0).fleet  # type: ignore[union-attr]


def test_a_keys_change_is_in_force_at_the_next_merge_and_an_unchanged_key_keeps_its_buckets() -> (
    None
):
    secret = auth.new_key()
    wide = tenancy.KeySettings(name="svc", models=("a", "b"), requests_per_s=1.0)
    narrow = msgspec.structs.replace(wide, models=("a",))

    def logged(settings: tenancy.KeySettings) -> dict[str, state.KeyState]:
        return {"svc": state.KeyState(settings=settings, sha256=auth.digest(secret))}

    first = auth.merged(None, logged(wide), 0.0)
    p = first.lookup(f"Bearer {secret}")
    assert p is not None
    assert p.may_use("b")
    same = auth.merged(None, logged(wide), 1.0, old=first)
    assert same.lookup(f"Bearer {secret}") is p  # its spent requests stay spent
    q = auth.merged(None, logged(narrow), 2.0, old=same).lookup(f"Bearer {secret}")
    assert q is not None
    assert q.may_use("a")
    assert not q.may_use("b")
    assert q.fleet


def test_the_keys_settings_schema_refuses_what_the_fold_must_never_meet() -> None:
    for bad in (
        {"name": "a.b"},
        {"name": "ok", "requests_per_s": 0},
        {"name": "ok", "budget_tokens": -5},
        {"name": "ok", "priority": "urgent"},
        {"name": "ok", "budget_period": "week"},
    ):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert(bad, tenancy.KeySettings)


FLAG = st.text(alphabet=string.printable + "é", max_size=10)


@settings(max_examples=60, deadline=None)
@given(
    command=st.sampled_from(["create", "update", "rotate", "revoke", "show"]),
    name=FLAG,
    flags=st.dictionaries(st.sampled_from(["--rps", "--tpm", "--budget-tokens", "--expires",
                                           "--priority", "--team", "--model", "--overlap"]),
                          FLAG, max_size=4),
)  # fmt: skip
def test_any_ctl_key_command_line_exits_0_1_or_2_never_a_traceback(
    command: str, name: str, flags: dict[str, str]
) -> None:
    args = ["ctl", "key", command]
    args += ["--name", name] if command == "create" else [name]
    allowed = {"create": None, "update": None, "rotate": {"--overlap"}, "revoke": set(),
               "show": set()}[command]  # fmt: skip
    for flag, value in flags.items():
        if (allowed is None and flag != "--overlap") or (allowed and flag in allowed):
            args += [flag, value]
    # No certificate at these paths: a command whose flags are fine stops at the connection.
    result = CliRunner().invoke(
        app, [*args, "--server", "nats://127.0.0.1:1", "--cert", "/nonexistent/op.pem"]
    )
    assert result.exit_code in (1, 2), (args, result.output)
    assert result.exception is None or isinstance(result.exception, SystemExit), result.output
