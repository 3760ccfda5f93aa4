"""The console's reads of the past are bounded: with every scan slot taken, another request
for a point in the past, a diff or a timeline is told to retry (429) at once, before it
reads anything, and the live view still answers."""

from __future__ import annotations

import types

from aiohttp.test_utils import TestClient, TestServer

from llmgw.core import state
from llmgw.ctl.console import server


class _NoLog:
    """Stands in for the NATS connection: nothing here may reach the log."""

    async def request(self, *args: object, **kwargs: object) -> object:
        raise AssertionError("the log was read while every scan slot was taken")


async def test_with_every_scan_slot_taken_the_past_is_refused_and_the_present_answers() -> None:
    live = types.SimpleNamespace(
        session=types.SimpleNamespace(nc=_NoLog()),
        attested=None,
        state=state.ClusterState(),
        last_time=None,
        ready=types.SimpleNamespace(is_set=lambda: False),
    )
    app = server.build_app(live, set())  # type: ignore[arg-type]
    async with TestClient(TestServer(app)) as client:
        scans = app[server.SCANS]
        for _ in range(server.MAX_SCANS):
            await scans.acquire()
        for path in ("/api/fleet?at=12", "/api/diff?from=1&to=2", "/api/timeline?target=n",
                     "/api/explain/m?at=@1764386000"):  # fmt: skip
            r = await client.get(path)
            assert r.status == 429, path
            assert "retry" in (await r.json())["error"]
        r = await client.get("/api/fleet")  # the live view: no scan
        assert r.status == 503  # still reading the log at start, as it says
        for _ in range(server.MAX_SCANS):
            scans.release()
