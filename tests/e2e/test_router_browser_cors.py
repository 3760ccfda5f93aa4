"""A web application calling the router from a real browser (llmgw.router.cors): headless
Chromium (tests/kit/browser.py) opens a page of a listed origin on 127.0.0.1, whose fetch()
sends a streamed chat completion with its key in `Authorization` (a preflighted request)
and reads the stream as it comes; a page of an unlisted origin, the same page on another
port, cannot: its preflight is refused and no request reaches the router's model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from llmgw.router import auth
from tests.integration.router_kit import Router, Sim
from tests.kit.browser import chromium
from tests.kit.threaded_http import ThreadedApp

pytestmark = pytest.mark.slow

KEY = auth.new_key()

# What a chat UI does: a streamed completion read chunk by chunk, with the page's key.
FETCH_STREAM = """
const [url, key, done] = arguments;
(async () => {
  try {
    const r = await fetch(url + "/v1/chat/completions", {
      method: "POST",
      headers: {"Authorization": "Bearer " + key, "Content-Type": "application/json"},
      body: JSON.stringify({model: "m", stream: true,
                            messages: [{role: "user", content: "hello"}]}),
    });
    const reader = r.body.getReader();
    const decoder = new TextDecoder();
    let text = "", chunks = 0;
    for (;;) {
      const {done: end, value} = await reader.read();
      if (end) break;
      chunks += 1;
      text += decoder.decode(value, {stream: true});
    }
    done({status: r.status, text, chunks, requestId: r.headers.get("X-Request-Id")});
  } catch (e) {
    done({error: String(e)});
  }
})();
"""


def _page_server() -> ThreadedApp:
    """A web application's origin: one blank page on 127.0.0.1, on a port of its own."""

    async def page(_: web.Request) -> web.Response:
        return web.Response(text="<!doctype html><title>chat</title>", content_type="text/html")

    app = web.Application()
    app.router.add_get("/", page)
    return ThreadedApp(app)


@pytest.fixture
def pages() -> Iterator[tuple[ThreadedApp, ThreadedApp]]:
    listed, unlisted = _page_server(), _page_server()
    try:
        yield listed, unlisted
    finally:
        listed.stop()
        unlisted.stop()


@pytest.fixture
def browser() -> Iterator[Any]:
    with chromium() as driver:
        yield driver


def _fetch_from(driver: Any, page: str, router: Router) -> dict[str, Any]:
    driver.get(page + "/")
    driver.set_script_timeout(60)
    found: dict[str, Any] = driver.execute_async_script(FETCH_STREAM, router.url, KEY)
    return found


def _served(router: Router) -> float:
    """Requests the router counted (any model, any status)."""
    return sum(
        v for k, v in router.metrics().items() if k.startswith("llmgw_router_requests_total")
    )


def test_a_listed_origins_page_reads_a_stream_and_another_origins_cannot(
    tmp_path: Path, procs: list[Any], pages: tuple[ThreadedApp, ThreadedApp], browser: Any
) -> None:
    listed, unlisted = pages
    sim = Sim.start("m")
    procs.append(sim)
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n" + auth.entry_yaml("page", KEY))
    page_auth = {"keys_file": str(keys), "allowed_origins": [listed.url]}
    router = Router.start(tmp_path, {"e": sim}, auth=page_auth)
    procs.append(router)

    read = _fetch_from(browser, listed.url, router)
    assert read.get("status") == 200, read
    assert read["text"].rstrip().endswith("data: [DONE]"), read
    assert '"choices"' in read["text"]
    assert read["requestId"], "X-Request-Id is exposed to the page"
    assert _served(router) == 1

    refused = _fetch_from(browser, unlisted.url, router)
    assert "status" not in refused, refused
    assert "Failed to fetch" in refused["error"]
    assert _served(router) == 1  # its preflight was refused: the request never came
