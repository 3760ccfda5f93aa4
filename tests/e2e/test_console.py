"""`llmgw console` against a real fleet, through its HTTP API as the page uses it: the
grid, a drain with its dry run, the live view following it, the slider's past, the diff
between two points, an unhealthy GPU's reason, bad input, the write guards, and NATS
restarting under it. The browser test (tests/e2e/test_console_browser.py) drives the
page itself."""

from __future__ import annotations

import asyncio
import http.client
import json
import urllib.parse
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.console_kit import bearer, call, fleet, holder, start_console
from tests.harness import TestNatsServer, wait_for

pytestmark = pytest.mark.slow


async def fleet_view(base: str, at: str = "") -> dict[str, Any]:
    status, view = await asyncio.to_thread(call, base + "/api/fleet" + (f"?at={at}" if at else ""))
    assert status == 200, view
    return view  # type: ignore[no-any-return]


async def test_the_console_shows_drives_and_rewinds_a_fleet(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    f = fleet(nats_server, tmp_path)
    console = None
    try:
        await f.start()
        console, base = await asyncio.to_thread(start_console, nats_server, tmp_path)
        await wait_for(lambda: call(base + "/api/fleet")[0] == 200, 30, "the console caught up")
        view = await fleet_view(base)
        assert sorted(n["name"] for n in view["nodes"]) == ["node-a", "node-b"]
        (old_node,) = holder(view)
        new_node = "node-b" if old_node == "node-a" else "node-a"
        # The simulated fault shows with its reason, on both nodes' GPU 1.
        for n in view["nodes"]:
            (bad,) = [g for g in n["gpus"] if g["problems"]]
            assert bad["index"] == 1
            assert bad["problems"] == ["uncorrected ECC errors (3)"]
        (m1,) = view["models"]
        assert (m1["replicas_wanted"], m1["replicas_serving"]) == (1, 1)
        before = view["seq"]

        # The write guards: no header, another site's Host.
        drain = f"{base}/api/nodes/{old_node}/drain"
        status, refused = await asyncio.to_thread(call, drain, body={"dry_run": True},
                                                  headers={"X-Llmgw-Console": "0"})  # fmt: skip
        assert status == 403, refused
        assert "X-Llmgw-Console" in refused["error"]
        status, refused = await asyncio.to_thread(
            call, base + "/api/fleet", headers={"Host": "evil.example:80"}
        )
        assert status == 421, refused

        # The dry run names the move; nothing is written.
        status, plan = await asyncio.to_thread(call, drain, body={"dry_run": True})
        assert status == 200, plan
        (move,) = plan["moves"]
        assert plan["published"] is None
        assert new_node in move["text"]
        _, written = await asyncio.to_thread(call, f"{base}/api/events?type=node_drain_requested")
        assert written == []  # the log moves on with heartbeats, but no drain is written

        status, done = await asyncio.to_thread(call, drain, body={"reason": "test"})
        assert status == 200, done
        assert done["published"]["operator"] == "alice"
        assert done["published"]["type"] == "operator.node_drain_requested"

        async def moved() -> bool:
            v = await fleet_view(base)
            return holder(v) == {new_node: 1} and v["models"][0]["replicas_serving"] == 1

        await wait_for(moved, 60, f"the live view shows m1 moved to {new_node}")
        after = (await fleet_view(base))["seq"]

        # The slider's past: the replica back on its old node.
        past = await fleet_view(base, str(before))
        assert past["live"] is False
        assert past["seq"] == before
        assert holder(past) == {old_node: 1}
        # ... at a time, too (the store time of that point).
        when = urllib.parse.quote(f"@{past['time']}")
        assert holder(await fleet_view(base, when)) == {old_node: 1}

        # The diff names the move.
        status, d = await asyncio.to_thread(call, f"{base}/api/diff?from={before}&to={after}")
        assert status == 200, d
        text = "\n".join(c["text"] for c in d["changes"])
        assert old_node in text
        assert new_node in text
        assert "drain" in text

        # Events, filtered, and a node's timeline over the whole log.
        status, rows = await asyncio.to_thread(call, f"{base}/api/events?node={old_node}")
        assert status == 200
        assert rows
        assert all(old_node in r["nodes"] for r in rows)
        assert any(r["type"] == "operator.node_drain_requested" for r in rows)
        status, strip = await asyncio.to_thread(call, f"{base}/api/timeline?target={old_node}")
        assert status == 200
        assert strip[0]["type"] == "node.registered"

        await _bad_input(base, after)
        await asyncio.to_thread(_only_with_its_token, base)
        await _survives_a_nats_restart(nats_server, base, after)
    finally:
        if console is not None:
            console.terminate()
        await f.stop()


async def _bad_input(base: str, last: int) -> None:
    """Each bad request gets a 400 (or 404) whose message says what to do, as JSON."""
    cases = [
        (f"/api/fleet?at={last + 10_000}", "beyond the end of the log"),
        ("/api/fleet?at=1999-01-01T00:00:00Z", "before the log begins"),
        ("/api/fleet?at=yesterday-ish", "cannot read"),
        ("/api/diff?from=1", "give both points"),
        ("/api/events?limit=lots", "not a number"),
        ("/api/timeline?target=nobody", "no node, replica or model"),
        ("/api/explain/nope", "unknown model"),
        ("/api/fleet?at=@inf", "cannot read"),
        ("/api/fleet?at=@nan", "cannot read"),
        ("/api/fleet?at=%C2%B2", "cannot read"),
        ("/api/fleet?at=99999999999999d", "cannot read"),
        (f"/api/fleet?at={'9' * 4400}", "no sequence"),
        ("/api/diff?from=@-1e300&to=1", "cannot read"),
    ]
    for path, said in cases:
        status, body = await asyncio.to_thread(call, base + path)
        assert status == 400, (path, body)
        assert said in body["error"], (path, body)
    posts: list[tuple[str, Any, str]] = [
        ("/api/nodes/ghost/cordon", {}, "unknown node"),
        ("/api/nodes/node-a/drain", {"grace_s": -1}, "grace_s"),
        ("/api/nodes/node-a/drain", {"grace_s": True}, "grace_s"),
        ("/api/nodes/node-a/cordon", {"reason": 7}, "reason"),
        ("/api/nodes/node-a/cordon", {"reason": "x" * 501}, "reason"),
        ("/api/nodes/node-a/cordon", [], "JSON object"),
        ("/api/nodes/node-a/drain", {"dry_run": "yes"}, "dry_run"),
    ]
    for path, body, said in posts:
        status, answer = await asyncio.to_thread(call, base + path, body=body)
        assert status == 400, (path, answer)
        assert said in answer["error"], (path, answer)
    # Not JSON at all, with the write header: still a clear 400.
    host = urllib.parse.urlsplit(base).netloc
    conn = http.client.HTTPConnection(host, timeout=10)
    conn.request("POST", "/api/nodes/node-a/cordon", body=b"{not json",
                 headers={"Content-Type": "application/json", "X-Llmgw-Console": "1",
                          **bearer(base)})  # fmt: skip
    resp = conn.getresponse()
    assert resp.status == 400
    assert "not JSON" in json.loads(resp.read())["error"]
    # A charset that does not exist, and a body nested past the decoder's depth: the same.
    for body, content_type in ((b"{}", "application/json; charset=no-such-charset"),
                               (b"[" * 30_000, "application/json")):  # fmt: skip
        conn.request("POST", "/api/nodes/node-a/cordon", body=body,
                     headers={"Content-Type": content_type, "X-Llmgw-Console": "1",
                              **bearer(base)})  # fmt: skip
        resp = conn.getresponse()
        assert resp.status == 400, content_type
        assert "not JSON" in json.loads(resp.read())["error"]
    conn.close()
    status, _ = await asyncio.to_thread(call, base + "/api/nodes/node-a/reboot", body={})
    assert status in (404, 405)


def _only_with_its_token(base: str) -> None:
    """Another user of the machine reaches 127.0.0.1 too: without the printed token the
    console shows nothing and writes nothing. The page (nothing of the fleet in it) is
    served to anyone; no answer sets a cookie, and none is taken as the token."""
    host = urllib.parse.urlsplit(base).netloc
    token = bearer(base)["Authorization"].removeprefix("Bearer ")
    conn = http.client.HTTPConnection(host, timeout=30)

    def ask(method: str, path: str, headers: dict[str, str], body: bytes | None = None) -> Any:
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        resp.read()
        return resp

    write = {"Content-Type": "application/json", "X-Llmgw-Console": "1"}
    for method, path, headers, body in [
        ("GET", "/api/fleet", {}, None),
        ("GET", "/api/stream", {}, None),
        ("POST", "/api/nodes/node-a/cordon", write, b"{}"),
        ("POST", "/api/nodes/node-a/cordon", {**write, "Authorization": "Bearer x" + token}, b"{}"),
        ("GET", "/api/fleet", {"Cookie": f"llmgw_console={token}"}, None),
        ("GET", f"/api/fleet?token={token}", {}, None),
    ]:
        assert ask(method, path, headers, body).status == 401, (method, path, headers)
    page = ask("GET", "/", {})
    assert page.status == 200
    assert page.getheader("Set-Cookie") is None
    assert ask("GET", "/api/fleet", {"Authorization": f"Bearer {token}"}).status == 200
    conn.close()


async def _survives_a_nats_restart(server: TestNatsServer, base: str, last: int) -> None:
    server.stop()
    await asyncio.sleep(1.0)
    status, body = await asyncio.to_thread(call, base + "/api/fleet")
    assert status == 200, body  # the live view still answers, from what it folded
    status, body = await asyncio.to_thread(call, f"{base}/api/fleet?at={last}")
    assert status in (502, 503), body  # the past needs the log: said, not a trace
    assert "error" in body
    server.start()

    async def following() -> bool:
        s, v = await asyncio.to_thread(call, base + "/api/fleet")
        return s == 200 and v["following"] and v["seq"] >= last

    await wait_for(following, 90, "the console following the log again")
    status, v = await asyncio.to_thread(call, f"{base}/api/fleet?at={last}")
    assert status == 200, v
