"""The OTLP exporter's task against collectors that answer, fail, stall or reply oddly:
whole batches posted early, a failing collector tried once an interval, a stalled one
costing a batch (counted) within the timeout, its error quoted bounded and said once a
minute, a bug in a flush never ending the task, and closing bounded in time."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import structlog
from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from llmgw import __version__, otlp
from llmgw.core.tracing import SPAN_SERVER, Span
from tests.harness import wait_for
from tests.integration.otlp_kit import decode
from tests.kit import local_app

SPAN = Span("ab" * 16, "cd" * 8, "", "x", SPAN_SERVER, 0, 1)


@contextlib.asynccontextmanager
async def collector(
    answer: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> AsyncIterator[str]:
    """A collector on this loop whose `POST /v1/traces` is answered by `answer`: its URL."""
    app = web.Application()
    app.router.add_post("/v1/traces", answer)
    async with local_app.served(app, shutdown_timeout=1) as url:
        yield url


async def test_a_collectors_odd_reply_costs_its_batch_never_the_exporter() -> None:
    # A collector answering an error in bytes that are no text (and a charset that does not
    # exist), or a body of megabytes: that batch is dropped, the exporter's task goes on and
    # exports the next, and closing the router's exporter raises nothing.
    replies = [
        web.Response(status=400, body=b"bad \xff\xfe request", content_type="text/html",
                     charset="no-such-charset"),
        web.Response(status=200, body=b"\xff" * 5_000_000),
        web.Response(status=200),
    ]  # fmt: skip
    posts: list[int] = []

    async def traces(request: web.Request) -> web.StreamResponse:
        posts.append(len(await request.read()))
        return replies[min(len(posts), len(replies)) - 1]

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", batch=1, interval_s=0.05)
        try:
            ex.start()
            for want in (1, 2, 3):
                ex.add([SPAN])
                await wait_for(lambda n=want: len(posts) >= n, 30, f"post {want} received")
            await wait_for(lambda: ex.exported + ex.dropped >= 3, 30, "three batches ended")
            assert len(posts) == 3
            assert (ex.dropped, ex.exported) == (1, 2)
            assert ex._task is not None
            assert not ex._task.done()
        finally:
            await asyncio.wait_for(ex.close(), 10)


async def test_a_full_batch_is_posted_at_once_and_only_whole_batches_early() -> None:
    """A busy router fills a batch well within the interval: the task posts it as soon as it
    is full, and leaves what does not fill one to the interval."""
    posted: list[int] = []

    async def traces(request: web.Request) -> web.Response:
        posted.append(len(decode(await request.read())))
        return web.Response()

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", batch=4, interval_s=3600)
        ex.start()
        try:
            await asyncio.sleep(0)  # the task waits for its first wake
            for _ in range(4):
                ex.add([SPAN])
            await wait_for(lambda: ex.exported == 4, 30, "a batch of exactly 4 posted")
            for _ in range(5):
                ex.add([SPAN])
            await wait_for(lambda: ex.exported >= 8, 30, "the next whole batch posted")
            assert (ex.exported, ex.buffered) == (8, 1)  # the fifth waits for the interval
            assert posted == [4, 4]
        finally:
            await asyncio.wait_for(ex.close(), 10)


async def test_a_failing_collector_is_tried_once_an_interval_however_busy_the_router() -> None:
    posts: list[int] = []

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        posts.append(1)
        return web.Response(status=503)

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", batch=1, interval_s=3600)
        ex.start()
        try:
            await asyncio.sleep(0)
            ex.add([SPAN])
            await wait_for(lambda: ex.dropped == 1, 30, "the first batch failed")
            for _ in range(3):
                ex.add([SPAN])  # each fills a batch: no early wake while the collector fails
            await asyncio.sleep(0.5)
            assert len(posts) == 1
            assert ex.buffered == 3
        finally:
            await asyncio.wait_for(ex.close(), 10)


async def test_a_stalled_collector_costs_one_batch_within_the_timeout_counted() -> None:
    release = asyncio.Event()

    async def traces(request: web.Request) -> web.Response:
        await release.wait()
        return web.Response()

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", batch=2, timeout_s=0.5)
        try:
            for _ in range(3):
                ex.add([SPAN])
            assert await asyncio.wait_for(ex.flush(), 30) is False
            assert (ex.exported, ex.dropped, ex.buffered) == (0, 2, 1)
        finally:
            release.set()
            await asyncio.wait_for(ex.close(), 10)


async def test_closing_posts_what_is_left_for_no_longer_than_the_timeout() -> None:
    """A collector slow to answer each post (though it answers): a stopping router gives
    the last spans `timeout_s`, not a post's time per batch left."""

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        await asyncio.sleep(0.4)
        return web.Response()

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", batch=1, timeout_s=1.0)
        for _ in range(30):
            ex.add([SPAN])
        await asyncio.wait_for(ex.close(), 30)
        assert ex.exported < 30
        assert ex.buffered > 0  # left: the router's stop does not wait for them


async def test_a_collectors_error_is_quoted_bounded_and_said_once_a_minute() -> None:
    """A collector answering a 3xx it does not follow, or an error with a body of
    megabytes: the batch is dropped, and the log line quotes a few hundred bytes of it,
    once a minute however many batches fail."""

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=300, body=b"y" * 1_000_000)

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", timeout_s=5)
        ex._said_at = float("-inf")  # said once a minute: whatever the clock, now
        try:
            with structlog.testing.capture_logs() as logged:
                for n in (1, 2):
                    ex.add([SPAN])
                    assert await ex.flush() is False
                    assert ex.dropped == n
            said = [e for e in logged if e["event"] == "traces_not_exported"]
            assert len(said) == 1
            assert said[0]["error"].startswith("HTTP 300")
            assert len(said[0]["error"]) < 300
        finally:
            await asyncio.wait_for(ex.close(), 10)


class _Unencodable:
    """A request whose spans fail to encode (a bug)."""

    def encode_spans(self, offset_ns: int) -> bytes:
        raise ValueError("a bug")


class _BrokenOnce(otlp.Exporter):
    """An exporter whose first post meets a bug (not a collector's failure)."""

    broke = False

    async def _post(self, body: bytes) -> str | None:
        if not self.broke:
            self.broke = True
            raise RuntimeError("a bug")
        return await super()._post(body)


async def test_a_bug_in_a_flush_never_ends_the_export() -> None:
    got: list[int] = []

    async def traces(request: web.Request) -> web.Response:
        got.append(len(await request.read()))
        return web.Response()

    async with collector(traces) as url:
        ex = _BrokenOnce(url, "svc", batch=1, interval_s=0.05)
        ex.start()
        try:
            with structlog.testing.capture_logs() as logged:
                ex.add([SPAN])
                await wait_for(lambda: ex.broke, 30, "the first flush met the bug")
                ex.add([SPAN])
                await wait_for(lambda: ex.exported == 1, 30, "the next batch still posted")
            assert any(e["event"] == "export_failed" for e in logged)
            assert len(got) == 1
        finally:
            await asyncio.wait_for(ex.close(), 10)


async def test_closing_closes_the_collectors_session() -> None:
    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response()

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc")
        ex.add([SPAN])
        assert await ex.flush() is True
        session = ex._session
        assert session is not None
        await asyncio.wait_for(ex.close(), 10)
        assert session.closed
        assert ex._session is None


async def test_a_collector_echoing_the_password_has_it_left_out_of_the_log() -> None:
    """aiohttp sends the URL's userinfo as Basic auth; a collector refusing it may quote it
    back: the log line's error has it blanked, as its URL does."""

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response(status=401, text=f"bad credentials: {request.headers['Authorization']}"
                            " (user:s3cret-pw)")  # fmt: skip

    async with collector(traces) as url:
        ex = otlp.Exporter(url.replace("http://", "http://user:s3cret-pw@"), "svc")
        ex._said_at = float("-inf")
        ex.add([SPAN])
        with structlog.testing.capture_logs() as logged:
            assert await ex.flush() is False
        await asyncio.wait_for(ex.close(), 10)
    (said,) = [e for e in logged if e["event"] == "traces_not_exported"]
    assert said["error"].startswith("HTTP 401")
    assert "s3cret-pw" not in repr(logged)


async def test_a_batch_none_of_whose_spans_encode_is_not_posted() -> None:
    posts: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        posts.append(await request.read())
        return web.Response()

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc")
        ex.put(_Unencodable(), 3)
        assert await ex.flush() is True
        assert (ex.dropped, ex.exported, posts) == (3, 0, [])
        ex.add([SPAN])
        assert await ex.flush() is True
        await asyncio.wait_for(ex.close(), 10)
    (body,) = posts
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.ParseFromString(body)
    (resource,) = req.resource_spans
    (scope,) = resource.scope_spans
    assert (scope.scope.name, scope.scope.version) == ("llmgw", __version__)
    assert [s.name for s in scope.spans] == ["x"]


async def test_what_is_exported_and_dropped_is_counted_in_spans_not_requests() -> None:
    """A batch with a request whose spans fail to encode is encoded one request at a time:
    the others' spans are counted exported, each of them."""

    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response()

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc")
        ex.add([SPAN] * 5)  # one request's five spans
        ex.put(_Unencodable(), 3)
        ex.add([SPAN] * 2)
        assert await ex.flush() is True
        assert (ex.exported, ex.dropped, ex.buffered) == (7, 3, 0)
        await asyncio.wait_for(ex.close(), 10)


async def test_a_collectors_endless_reply_is_read_bounded_and_the_batch_counts_exported() -> None:
    """A 2xx whose body never ends (a misbehaving proxy in front of the collector): the
    exporter reads a bounded part and moves on, within the timeout, holding no more."""

    async def traces(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse()
        await resp.prepare(request)
        with contextlib.suppress(ConnectionError):
            for _ in range(6_000):  # until the exporter hangs up (at most a minute)
                await resp.write(b"x" * 65_536)
                await asyncio.sleep(0.01)
        return resp

    async with collector(traces) as url:
        ex = otlp.Exporter(url, "svc", timeout_s=5)
        ex.add([SPAN])
        assert await asyncio.wait_for(ex.flush(), 30) is True
        assert (ex.exported, ex.dropped) == (1, 0)
        await asyncio.wait_for(ex.close(), 10)


class _Broken(otlp.Exporter):
    """An exporter whose post fails with what no network raises (a bug, or an error the
    HTTP client does not wrap), the first time only."""

    failures = 1

    async def _post(self, body: bytes) -> str | None:
        if self.failures:
            self.failures -= 1
            raise RuntimeError("not a network error")
        return await super()._post(body)


async def test_spans_a_failing_post_lost_are_counted_whatever_it_raised() -> None:
    async def traces(request: web.Request) -> web.Response:
        await request.read()
        return web.Response()

    async with collector(traces) as url:
        ex = _Broken(url, "svc")
        ex.add([SPAN] * 4)
        assert await ex.flush() is False  # the batch is lost; the rest waits an interval
        assert (ex.exported, ex.dropped, ex.buffered) == (0, 4, 0)
        ex.add([SPAN] * 2)
        assert await ex.flush() is True
        assert (ex.exported, ex.dropped) == (2, 4)
        await asyncio.wait_for(ex.close(), 10)
