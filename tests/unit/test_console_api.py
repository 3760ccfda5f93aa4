"""The console's HTTP API in process (aiohttp's test server running the app `llmgw console`
serves, over a fold held in memory): the event list's limit and filters, the write guard's
JSON body, the body size bound, the headers that keep the page out of another site's frame,
the answers while the log is away, the token never a cookie, the `Host` values a
browser sends, the fields of a write, and the live fold's handling of a batch seen twice and
of a page that stops reading."""

from __future__ import annotations

import asyncio
import types
from typing import Any
from urllib.parse import quote

import pytest
from aiohttp.test_utils import TestClient, TestServer

from llmgw import bus
from llmgw.cli import console as console_cli
from llmgw.core import events, state
from llmgw.ctl.console import live as live_
from llmgw.ctl.console import server
from llmgw.ctl.errors import BadInput

TOKEN = "t0ken"
WRITE = {"X-Llmgw-Console": "1", "Authorization": f"Bearer {TOKEN}"}


def _row(seq: int) -> dict[str, Any]:
    return {"seq": seq, "type": "operator.node_cordoned", "nodes": ["node-a"], "replicas": [],
            "model": ""}  # fmt: skip


def _client(recent: list[dict[str, Any]] | None = None) -> TestClient[Any, Any]:
    fleet = types.SimpleNamespace(state=state.ClusterState(), recent=recent or [], session=None)
    return TestClient(TestServer(server.build_app(fleet, set(), TOKEN)))  # type: ignore[arg-type]


async def test_the_event_list_gives_the_newest_rows_and_clamps_its_limit() -> None:
    async with _client([_row(s) for s in range(1, 11)]) as client:

        async def seqs(limit: str) -> list[int]:
            r = await client.get(f"/api/events?limit={limit}", headers=WRITE)
            assert r.status == 200, await r.text()
            return [row["seq"] for row in await r.json()]

        assert await seqs("3") == [8, 9, 10]
        assert await seqs("0") == [10]
        assert await seqs("-4") == [10]
        assert await seqs("99999") == list(range(1, 11))


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data"]
)
async def test_a_write_whose_body_is_not_json_is_refused_before_it_is_read(
    content_type: str,
) -> None:
    """The content types a form of another site may post without asking first."""
    async with _client() as client:
        r = await client.post("/api/nodes/node-a/cordon", data=b"{}",
                              headers={**WRITE, "Content-Type": content_type})  # fmt: skip
        assert r.status == 403
        assert "JSON body" in (await r.json())["error"]
        # The same write as JSON reaches the checks: no node-a in an empty fleet.
        r = await client.post("/api/nodes/node-a/cordon", json={}, headers=WRITE)
        assert r.status == 400
        assert "node-a" in (await r.json())["error"]


async def test_a_body_beyond_64_kib_is_refused_with_413() -> None:
    async with _client() as client:
        body = {"reason": "x" * (80 * 1024)}
        r = await client.post("/api/nodes/node-a/cordon", json=body, headers=WRITE)
        assert r.status == 413
        assert "error" in await r.json()


async def test_no_answer_may_be_framed_by_another_site() -> None:
    """Over HTTPS a browser presents the operator's certificate to a frame too: a page of
    another site that framed the console could have the operator click its drain."""
    async with _client() as client:
        for path, headers in (("/", WRITE), ("/api/events", WRITE), ("/api/fleet", {}),
                              (f"/?token={TOKEN}", {})):  # fmt: skip
            r = await client.get(path, headers=headers, allow_redirects=False)
            assert r.headers.get("X-Frame-Options") == "DENY", path
            policy = r.headers.get("Content-Security-Policy", "")
            assert "frame-ancestors 'none'" in policy, path
            assert "default-src 'none'" in policy, path
            assert "script-src 'sha256-" in policy, path
            assert r.headers.get("X-Content-Type-Options") == "nosniff", path
            # The fleet's state is never cached; the page may be.
            cached = r.headers.get("Cache-Control")
            assert (cached == "no-store") == path.startswith("/api/"), path


class _LogAway:
    """Stands in for the NATS connection while the server is away: a request raises as the
    connection's `request` does."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def request(self, *args: object, **kwargs: object) -> object:
        raise self.error


@pytest.mark.parametrize(
    ("error", "status", "said"),
    [
        (ConnectionResetError("reset by peer"), 503, "the log cannot be read now (reset by peer)"),
        (TimeoutError(), 502, "no answer from JetStream"),
    ],
)
async def test_a_fleet_view_that_needs_the_log_while_it_is_away_says_so(
    error: Exception, status: int, said: str
) -> None:
    """The live view asks the log for its bounds (the slider's); before it ever had them,
    the log's absence is the answer: a connection's failure is a 503 (retry), JetStream's
    silence a 502."""
    fleet = types.SimpleNamespace(
        state=state.ClusterState(), recent=[], attested=None, last_time=None, bounds=None,
        following=False, ready=types.SimpleNamespace(is_set=lambda: True),
        session=types.SimpleNamespace(nc=_LogAway(error)),
    )  # fmt: skip
    app = server.build_app(fleet, set(), TOKEN)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/api/fleet", headers=WRITE)
        assert r.status == status
        assert said in (await r.json())["error"]


async def test_the_token_is_never_a_cookie_nor_taken_from_one() -> None:
    """A browser sends a host's cookies to every port of it (cookies do not isolate
    ports): a cookie holding the token would reach any other user's server on 127.0.0.1
    the operator's browser opens, and with it the console. The token is the page's, in
    the printed address's fragment (never sent to a server), and sent as a header."""
    async with _client() as client:
        r = await client.get(f"/?token={TOKEN}", allow_redirects=False)
        assert r.status == 200  # the page itself holds nothing of the fleet
        assert "Set-Cookie" not in r.headers
        r = await client.get("/api/events", headers={"Cookie": f"llmgw_console={TOKEN}"})
        assert r.status == 401
        assert "Authorization: Bearer" in (await r.json())["error"]
        r = await client.get(f"/api/events?token={TOKEN}", allow_redirects=False)
        assert r.status == 401


def test_a_loopback_console_answers_to_every_name_a_browser_gives_it() -> None:
    assert console_cli._hosts("127.0.0.1", 8300) == {
        "127.0.0.1:8300", "localhost:8300", "[::1]:8300"
    }  # fmt: skip
    assert console_cli._hosts("::1", 8300) == {
        "::1:8300", "[::1]:8300", "localhost:8300", "127.0.0.1:8300"
    }  # fmt: skip
    # Port 80 is the address's default: a browser leaves it out of `Host`.
    assert console_cli._hosts("127.0.0.1", 80) == {
        "127.0.0.1:80", "localhost:80", "[::1]:80", "127.0.0.1", "localhost", "[::1]"
    }  # fmt: skip


@pytest.mark.parametrize(
    ("listen", "port", "host"),
    [("10.1.2.3", 443, "10.1.2.3"), ("0.0.0.0", 8300, "console.example:8300"),
     ("fd00::5", 443, "console.example"), ("127.0.0.1", 8300, "console.example:8300")],
)  # fmt: skip
async def test_over_https_the_console_answers_to_any_name(
    listen: str, port: int, host: str
) -> None:
    """Over HTTPS the browser checks the console's certificate against the name it was
    given, so a DNS name rebound to the console's address fails the handshake; the names
    an operator may use (a DNS name, any address of a wildcard bind, the default port left
    out) are not the console's to know, and refusing them refused every browser."""
    fleet = types.SimpleNamespace(state=state.ClusterState(), recent=[], session=None)
    app = server.build_app(fleet, console_cli._hosts(listen, port, tls=True), "")  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        r = await client.get("/api/events", headers={"Host": host})
        assert r.status == 200, await r.text()


def test_a_write_without_fields_is_a_reasonless_drain_of_600_s_for_real() -> None:
    assert server._action_fields({}) == ("", 600.0, False)


@pytest.mark.parametrize(
    "body",
    [{"reason": "x" * 500}, {"grace_s": 0}, {"grace_s": server.MAX_GRACE_S}, {"dry_run": True}],
)
def test_the_bounds_of_a_writes_fields_are_accepted(body: dict[str, Any]) -> None:
    reason, grace, dry_run = server._action_fields(body)
    assert reason == body.get("reason", "")
    assert grace == body.get("grace_s", 600.0)
    assert dry_run is body.get("dry_run", False)


@pytest.mark.parametrize("body", [{"reason": "x" * 501}, {"grace_s": server.MAX_GRACE_S + 1}])
def test_just_beyond_the_bounds_is_refused(body: dict[str, Any]) -> None:
    with pytest.raises(BadInput):
        server._action_fields(body)


def _record(seq: int) -> bus.Record:
    ev = events.NodeCordoned(id=f"e{seq}", ts=1000.0 + seq, operator="alice", node="node-a")
    return bus.Record(seq=seq, subject="fleet.operator.alice", time=1000.0 + seq, event=ev)


async def test_a_batch_read_again_after_a_reconnect_adds_only_what_is_new() -> None:
    fleet = live_.LiveFleet(types.SimpleNamespace())  # type: ignore[arg-type]
    watched = fleet.watch()
    first = asyncio.ensure_future(anext(watched))
    await asyncio.sleep(0)  # the watcher's queue exists once the generator runs
    fleet._fold([_record(1), _record(2)])
    assert [r["seq"] for r in await first] == [1, 2]
    fleet._fold([_record(2)])  # nothing new: nothing for the pages either
    fleet._fold([_record(1), _record(2), _record(3)])
    assert [r["seq"] for r in await anext(watched)] == [3]
    assert [r["seq"] for r in fleet.recent] == [1, 2, 3]
    assert fleet.state.last_seq == 3
    assert fleet.last_time == 1003.0
    await watched.aclose()


async def test_a_page_that_stops_reading_loses_its_oldest_batches_not_the_console() -> None:
    fleet = live_.LiveFleet(types.SimpleNamespace(), recent=3)  # type: ignore[arg-type]
    watched = fleet.watch()
    first = asyncio.ensure_future(anext(watched))
    await asyncio.sleep(0)
    fleet._fold([_record(1)])
    assert [r["seq"] for r in await first] == [1]
    total = live_.WATCH_QUEUE + 5
    for seq in range(2, total + 2):
        fleet._fold([_record(seq)])  # nobody reads: never raises, never grows past the bound
    assert [r["seq"] for r in fleet.recent] == [total - 1, total, total + 1]
    got = [(await anext(watched))[0]["seq"] for _ in range(live_.WATCH_QUEUE)]
    assert got == list(range(total + 2 - live_.WATCH_QUEUE, total + 2))
    await watched.aclose()


def test_a_record_row_names_what_it_touched_and_the_phase_it_shows() -> None:
    row = live_.views.event_row(_record(7))
    assert (row["seq"], row["time"], row["type"]) == (7, 1007.0, "operator.node_cordoned")
    assert row["phase"] == "cordoned"
    assert row["nodes"] == ["node-a"]
    shard = events.ShardStatus(id="s1", ts=1.0, node="node-b", replica_id="r1", generation=1,
                               phase="loading")  # fmt: skip
    row = live_.views.event_row(
        bus.Record(seq=8, subject="llmgw.events.node.node-b.shard", time=2.0, event=shard)
    )
    assert (row["phase"], row["nodes"], row["replicas"]) == ("loading", ["node-b"], ["r1"])


def test_a_filter_names_a_whole_node_model_or_replica_never_part_of_one() -> None:
    rows = [{**_row(1), "model": "m1", "replicas": ["r1"]}, {**_row(2), "model": "m"}]
    assert live_.views.matching(rows, model="m") == [rows[1]]
    assert live_.views.matching(rows, node="node") == []
    assert live_.views.matching(rows, replica="r") == []
    assert live_.views.matching(rows, node="node-a", model="m1", replica="r1") == [rows[0]]


@pytest.mark.parametrize("name", ["org/m", "a{b}"])
async def test_explain_reaches_a_model_whatever_its_name_holds(name: str) -> None:
    """A served model's name may hold `/` (a Hugging Face id) and braces: the page quotes
    it, and the console takes it whole, as the control plane's admin API does."""
    async with _client() as client:
        for path in (f"/api/explain/{quote(name, safe='')}", f"/api/explain/{name}"):
            r = await client.get(path, headers=WRITE)
            assert r.status == 400, path
            assert f"unknown model {name!r}" in (await r.json())["error"], path


CROSS_SITE = {
    "Sec-Fetch-Site": "cross-site",
    "Sec-Fetch-Mode": "no-cors",
    "Sec-Fetch-Dest": "image",
}
"""What a browser sends with an `<img>` of another site's page pointing at the console."""


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
async def test_a_request_another_page_made_is_refused_before_any_work(site: str) -> None:
    """Over HTTPS the browser presents the operator's certificate to any page's requests,
    an `<img>` of another site's included: each could start a scan of the whole log. The
    browser says who made a request (`Sec-Fetch-Site`); the console serves its own page's
    requests, the operator's typed addresses and clients that send no such header."""
    fleet = types.SimpleNamespace(state=state.ClusterState(), recent=[], session=None)
    app = server.build_app(fleet, set(), "")  # type: ignore[arg-type]  # as over HTTPS
    async with TestClient(TestServer(app)) as client:
        for path in ("/api/events", "/api/timeline?target=node-a", "/"):
            r = await client.get(path, headers={**CROSS_SITE, "Sec-Fetch-Site": site})
            assert r.status == 403, path
            assert "another site" in (await r.json())["error"], path
        for headers in ({"Sec-Fetch-Site": "same-origin"}, {"Sec-Fetch-Site": "none"}, {}):
            r = await client.get("/api/events", headers=headers)
            assert r.status == 200, headers
        # A link elsewhere may open the page itself, which holds nothing of the fleet.
        link = {"Sec-Fetch-Site": site, "Sec-Fetch-Mode": "navigate", "Sec-Fetch-Dest": "document"}
        r = await client.get("/", headers=link)
        assert r.status == 200


async def test_a_timeline_answers_its_last_rows_and_how_many_there_were(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A model's replicas over a long log touch far more events than a page shows: the
    console answers the last `limit` (5,000 unless asked, at most 50,000) and the count."""

    def cordon(seq: int, node: str) -> bus.Record:
        event = events.NodeCordoned(id=f"c-{seq}", ts=float(seq), node=node, operator="alice")
        return bus.Record(seq, events.subject_of(event), float(seq), event)

    async def records(nc: object, **_: object) -> Any:
        for first in range(1, 60_001, 10_000):
            yield [cordon(s, "node-a" if s % 2 else "node-b") for s in range(first, first + 10_000)]

    monkeypatch.setattr(server.history, "records", records)
    fleet = types.SimpleNamespace(state=state.ClusterState(), recent=[],
                                  session=types.SimpleNamespace(nc=None))  # fmt: skip
    app = server.build_app(fleet, set(), TOKEN)  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:

        async def timeline(query: str) -> tuple[list[int], str | None]:
            r = await client.get(f"/api/timeline?target=node-a{query}", headers=WRITE)
            assert r.status == 200, await r.text()
            return [row["seq"] for row in await r.json()], r.headers.get("X-Llmgw-Timeline-Total")

        seqs, total = await timeline("")
        assert (len(seqs), seqs[-1], total) == (5_000, 59_999, "30000")
        assert seqs == list(range(50_001, 60_000, 2))
        seqs, total = await timeline("&limit=3")
        assert (seqs, total) == ([59_995, 59_997, 59_999], "30000")
        seqs, total = await timeline("&limit=999999")
        assert (len(seqs), seqs[0], total) == (30_000, 1, "30000")
        r = await client.get("/api/timeline?target=node-a&limit=many", headers=WRITE)
        assert r.status == 400
        assert "give 1 to 50000" in (await r.json())["error"]
