"""The router's own handlers (llmgw.router.app) through its front door, in-process: what a
key sees of the models, the request id an engine gets, /ready, what a request is counted
as, and the keys in force after a reload or a change of the log's keys."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from llmgw.config import ConfigError
from llmgw.core.state import KeyState
from llmgw.core.tenancy import KeySettings
from llmgw.router import auth
from llmgw.router.app import Router
from llmgw.router.attempts import Attempt
from llmgw.router.config import AuthConfig, RouterConfig
from llmgw.router.relay import ClientStream
from tests.unit import route_kit
from tests.unit.route_kit import Recording


def _bearer(secret: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {secret}"}


def _key(router: Router, name: str, *models: str) -> dict[str, str]:
    """A new key of the router's that may use `models`; its headers."""
    secret = auth.new_key()
    principal = auth.Principal(KeySettings(name=name, models=models), auth.digest(secret), 0.0)
    router.keys.by_digest[principal.sha256] = principal
    return _bearer(secret)


# ---------------------------------------------------------------- request ids


@pytest.mark.parametrize(
    ("sent", "kept"),
    [
        ("a" * 128, True),
        ("req-1_x.y:z", True),
        ("a" * 129, False),
        ("id\r\nX-Injected: 1", False),
        ("id\nnext", False),
        ("tab\there", False),
        ("del\x7f", False),
        ("nul\x00", False),
        ("caf\u00e9", False),
        ("\u0131d", False),
        ("", False),
    ],
    ids=["128", "printable", "129", "crlf", "lf", "tab", "del", "nul", "latin", "dotless", "empty"],
)
async def test_only_a_short_printable_ascii_request_id_reaches_the_engine_as_sent(
    sent: str, kept: bool
) -> None:
    """The id goes into the engine's request head: anything that could split that head or
    that a header cannot carry as is gets an id of the router's own instead."""
    fleet = Recording()
    try:
        resp = await fleet.chat("m", {"X-Request-Id": sent})
        assert resp.status == 200
        [(_, rid, _)] = fleet.sent
        # A refused request's answer carries the same kind of id.
        refused = await fleet.chat("nope", {"X-Request-Id": sent})
        assert refused.status == 404
        assert (refused.headers["X-Request-Id"] == sent) is kept
        if kept:
            assert rid == sent
        else:
            assert rid != sent
            assert rid.startswith(fleet.router._rid_prefix)
            assert rid.isascii()
            assert rid.isprintable()
            assert 0 < len(rid) <= 128
    finally:
        fleet.close()


async def test_the_routers_own_request_ids_are_never_the_same_twice() -> None:
    fleet = Recording()
    try:
        for _ in range(3):
            assert (await fleet.chat("m")).status == 200
        assert (await fleet.chat("m", {"X-Request-Id": "x\r\n"})).status == 200
        rids = [rid for _, rid, _ in fleet.sent]
        assert len(set(rids)) == 4
    finally:
        fleet.close()


# ---------------------------------------------------------------- the models a key sees


async def test_a_key_never_sees_a_model_it_may_not_use_by_its_name_or_an_alias() -> None:
    fleet = Recording(anonymous=False)
    router = fleet.router
    try:
        only_f = _key(router, "only-f", "f")
        status, listed = await fleet.get("/v1/models", only_f)
        assert status == 200
        assert [m["id"] for m in listed["data"]] == ["f"]
        _, nothing = await fleet.get("/v1/models/nope", only_f)
        for name in ("m", "ma", "w"):
            status, answer = await fleet.get(f"/v1/models/{name}", only_f)
            assert status == 404, name
            # The same answer as for a model that does not exist: nothing to tell them apart.
            assert answer == msgspec.json.decode(
                msgspec.json.encode(nothing).replace(b"nope", name.encode())
            )
        assert (await fleet.get("/v1/models/f", only_f))[0] == 200
        # Without a key, or with a wrong one, a router with keys lists nothing.
        for headers in ({}, _bearer("sk-wrong")):
            status, answer = await fleet.get("/v1/models", headers)
            assert status == 401
            assert "data" not in answer
            assert (await fleet.get("/v1/models/m", headers))[0] == 401
    finally:
        fleet.close()


async def test_a_key_given_only_an_alias_sees_that_alias_and_not_the_models_name() -> None:
    """The alias is what the key was given: it is listed, with the model it stands for as
    its root; the model's own name is not this key's."""
    fleet = Recording()
    try:
        alias_only = _key(fleet.router, "alias-only", "ma")
        status, listed = await fleet.get("/v1/models", alias_only)
        assert status == 200
        assert [(m["id"], m["root"]) for m in listed["data"]] == [("ma", "m")]
        status, one = await fleet.get("/v1/models/ma", alias_only)
        assert (status, one["id"], one["root"]) == (200, "ma", "m")
        assert (await fleet.get("/v1/models/m", alias_only))[0] == 404
        every = _key(fleet.router, "every", "*")
        _, listed = await fleet.get("/v1/models", every)
        assert [(m["id"], m["root"]) for m in listed["data"]] == [
            ("f", "f"), ("m", "m"), ("ma", "m"), ("w", "w")
        ]  # fmt: skip
    finally:
        fleet.close()


async def test_a_web_page_reads_no_model_of_an_anonymous_router() -> None:
    """A page of another origin sends no key: an anonymous router refuses it each of its
    model answers, and /ready names it no model; a client that is no page is served."""
    fleet = Recording()
    page = {"Origin": "https://evil.example"}
    try:
        for path in ("/v1/models", "/v1/models/m", "/v1/models/ma"):
            status, answer = await fleet.get(path, page)
            assert status == 403, path
            assert "data" not in answer
            assert "root" not in answer
            assert (await fleet.get(path, {}))[0] == 200, path
        _, ready = await fleet.get("/ready", page)
        assert ready["ready_endpoints"] == {}
    finally:
        fleet.close()


async def test_ready_is_503_until_some_models_endpoint_is_ready() -> None:
    fleet = Recording()
    try:
        for ep_id in ("e0", "e1", "e2"):
            fleet.endpoint(ep_id).ready = False
        status, answer = await fleet.get("/ready", {})
        assert (status, answer["ready"]) == (503, False)
        fleet.endpoint("e2").ready = True
        status, answer = await fleet.get("/ready", {})
        assert (status, answer["ready"]) == (200, True)
        assert answer["ready_endpoints"] == {"m": 0, "f": 1, "w": 0}
    finally:
        fleet.close()


async def test_a_keys_request_is_its_keys_and_a_stream_keeps_the_usage_it_asked_for() -> None:
    """The router asks a stream's engine for its usage to count its tokens, and drops that
    chunk only when the client did not ask for it."""
    fleet = Recording()
    try:
        kc = route_kit.auth_headers("kc", None)
        assert (await fleet.chat("m", kc)).status == 200
        assert fleet.router.metrics.key_requests.values == {("kc", "t1", "m", "200"): 1.0}
        assert (await fleet.chat("m", kc, stream=True)).status == 200
        usage = {"include_usage": True}
        assert (await fleet.chat("m", kc, stream=True, stream_options=usage)).status == 200
        assert fleet.drops_usage == [False, True, False]
        assert [body.get("stream_options") for _, _, body in fleet.sent] == [None, usage, usage]
    finally:
        fleet.close()


async def test_a_stream_that_ended_in_an_error_event_counts_as_that_error() -> None:
    """A stream's status went out as 200 before its engine failed: the metrics count it as
    the error its event told (the key's counts too), not as the 200."""
    fleet = Recording()

    async def cut(at: Attempt, body: bytes, state: ClientStream) -> web.StreamResponse:
        state.failed_status = 502
        return web.Response(status=200)

    fleet.router.dispatcher._attempt = cut  # type: ignore[method-assign]
    try:
        resp = await fleet.chat("m", route_kit.auth_headers("kc", None), stream=True)
        assert resp.status == 200
        assert fleet.router.metrics.requests.values == {("m", "502"): 1.0}
        assert fleet.router.metrics.key_requests.values == {("kc", "t1", "m", "502"): 1.0}
    finally:
        fleet.close()


# ---------------------------------------------------------------- keys in force


def _write_keys(path: Path, *entries: tuple[str, str, int]) -> None:
    """A keys file of (name, secret, requests per second) entries."""
    keys = [
        {"name": name, "sha256": auth.digest(secret), "models": ["*"], "requests_per_s": rps}
        for name, secret, rps in entries
    ]
    path.write_bytes(msgspec.json.encode({"keys": keys}))


def _log_key(name: str, secret: str) -> KeyState:
    return KeyState(settings=KeySettings(name=name, models=("*",)), sha256=auth.digest(secret))


def _names(router: Router) -> set[str]:
    return {p.name for p in router.keys.by_digest.values()}


def test_a_reload_keeps_unchanged_keys_buckets_and_the_logs_keys(tmp_path: Path) -> None:
    path = tmp_path / "keys.json"
    stays, changes, goes, comes, logged = (auth.new_key() for _ in range(5))
    _write_keys(path, ("stays", stays, 1), ("changes", changes, 1), ("goes", goes, 1))
    router = Router(RouterConfig(auth=AuthConfig(keys_file=str(path))))
    try:
        router.set_log_keys({"logged": _log_key("logged", logged)})
        assert _names(router) == {"stays", "changes", "goes", "logged"}
        was_logged = router.keys.lookup(f"Bearer {logged}")
        router.set_log_keys({"logged": _log_key("logged", logged)})
        assert router.keys.lookup(f"Bearer {logged}") is was_logged  # its buckets stay
        before = router.keys.lookup(f"Bearer {stays}")
        old_changes = router.keys.lookup(f"Bearer {changes}")
        _write_keys(path, ("stays", stays, 1), ("changes", changes, 5), ("comes", comes, 1))
        router.reload_keys()
        assert _names(router) == {"stays", "changes", "comes", "logged"}
        # A key as it was keeps its principal, so its spent requests stay spent.
        assert router.keys.lookup(f"Bearer {stays}") is before
        changed = router.keys.lookup(f"Bearer {changes}")
        assert changed is not None
        assert changed is not old_changes
        assert changed.settings.requests_per_s == 5
        assert router.keys.lookup(f"Bearer {goes}") is None
        assert router.keys.lookup(f"Bearer {logged}") is was_logged
        # The log's keys changing afterwards merges them with the file as it is now.
        router.set_log_keys({"logged": _log_key("logged", logged)})
        assert _names(router) == {"stays", "changes", "comes", "logged"}
        assert router.keys.lookup(f"Bearer {goes}") is None
        # A broken file keeps every key in force.
        path.write_text("keys: [{name: broken}]\n")
        router.reload_keys()
        assert _names(router) == {"stays", "changes", "comes", "logged"}
        assert router.keys.lookup(f"Bearer {stays}") is before
    finally:
        router.pool.close()
        router.deadlines.close()


@contextlib.contextmanager
def _reloaded_with(tmp_path: Path, content: bytes) -> Iterator[tuple[Router, Path]]:
    """A router whose keys file held the key "stays", reloaded after the file became
    `content`, which it refused: the key is still in force."""
    path = tmp_path / "keys.yaml"
    _write_keys(path, ("stays", auth.new_key(), 1))
    router = Router(RouterConfig(auth=AuthConfig(keys_file=str(path))))
    try:
        path.write_bytes(content)
        router.reload_keys()
        assert _names(router) == {"stays"}
        yield router, path
    finally:
        router.pool.close()
        router.deadlines.close()


@pytest.mark.parametrize(
    "value", ["9" * 5000, "2001-13-45", "[" * 5000, "{a: 1, a: 2}", "\xff", ".nan"]
)
def test_a_reload_of_a_file_yaml_cannot_read_keeps_the_keys_and_says_why(
    tmp_path: Path, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # SIGHUP calls reload_keys from the event loop: anything but a logged refusal was a
    # traceback in the router's log ("Exception in callback") and no keys_reload_failed.
    content = f"keys: []\nteam: {value}\n".encode("utf-8", "surrogateescape")
    with _reloaded_with(tmp_path, content) as (_router, _path):
        said = capsys.readouterr()
        assert "keys_reload_failed" in said.out + said.err


@pytest.mark.parametrize(
    "text", ["", "\n  \n", "# keys for the team\n", "{}\n", "keys:\n", "keys: null\n"]
)
def test_a_reload_of_a_file_that_lists_no_keys_section_keeps_the_keys(
    tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # An editor's save that failed on a full disk leaves the file empty: read as "no keys"
    # it revoked every key of the file at the next SIGHUP. `keys: []` still revokes them.
    with _reloaded_with(tmp_path, text.encode()) as (router, path):
        said = capsys.readouterr()
        assert "keys: []" in said.out + said.err
        path.write_text("keys: []\n")
        router.reload_keys()
        assert _names(router) == set()


def test_log_keys_past_the_shared_limits_room_leave_the_keys_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Workers share keys' limits in a file of fixed room: log keys with limits past it are
    not applied, and every key in force stays so (none is dropped, none added)."""
    import multiprocessing

    monkeypatch.setattr(auth, "SLOTS", 2)
    shared_path = tmp_path / "limits"
    auth.SharedLimits.create(shared_path)
    limits = auth.SharedLimits(shared_path, multiprocessing.get_context("spawn").Lock())
    path = tmp_path / "keys.json"
    filed, first, second, third = (auth.new_key() for _ in range(4))
    _write_keys(path, ("filed", filed, 1))
    router = Router(RouterConfig(auth=AuthConfig(keys_file=str(path))), limits=limits)

    def limited(name: str, secret: str) -> KeyState:
        settings = KeySettings(name=name, models=("*",), requests_per_s=1)
        return KeyState(settings=settings, sha256=auth.digest(secret))

    try:
        router.set_log_keys({"first": limited("first", first)})
        assert _names(router) == {"filed", "first"}
        in_force = router.keys
        router.set_log_keys({"second": limited("second", second), "third": limited("third", third)})
        assert router.keys is in_force
        assert _names(router) == {"filed", "first"}
        assert router.keys.lookup(f"Bearer {second}") is None
        # Nor does a reload of the file bring them in later.
        router.reload_keys()
        assert _names(router) == {"filed", "first"}
    finally:
        router.pool.close()
        router.deadlines.close()
        limits.close()


def test_a_reload_whose_merge_finds_no_room_keeps_every_key_in_force(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A SIGHUP handler that raised would leave the file's new keys half applied (read,
    but not in force): a merge that fails keeps the keys as they were, file and log."""
    path = tmp_path / "keys.json"
    kept, comes, logged = (auth.new_key() for _ in range(3))
    _write_keys(path, ("kept", kept, 1))
    router = Router(RouterConfig(auth=AuthConfig(keys_file=str(path))))
    try:
        router.set_log_keys({"logged": _log_key("logged", logged)})
        in_force, filed = router.keys, router.file_keys
        _write_keys(path, ("comes", comes, 1))

        def no_room(*_: object, **__: object) -> auth.Keys:
            raise ConfigError(f"more than {auth.SLOTS} keys with limits: the router holds no more")

        monkeypatch.setattr(auth, "merged", no_room)
        router.reload_keys()
        assert router.keys is in_force
        assert router.file_keys is filed
        assert _names(router) == {"kept", "logged"}
        monkeypatch.undo()
        router.reload_keys()  # with room again, the file as it is now
        assert _names(router) == {"comes", "logged"}
    finally:
        router.pool.close()
        router.deadlines.close()
