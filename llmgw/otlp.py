"""OTLP/HTTP export of spans (llmgw.core.tracing), for the router and the sim.

Spans wait in a bounded buffer and a background task posts them, in batches, as
OTLP's protobuf (`POST {endpoint}/v1/traces`, `application/x-protobuf`) to a
collector: a request never waits on the collector, and a collector that is down or
slow costs spans (counted in `dropped`, said once a minute in the log), never memory
or latency. opentelemetry-proto is imported on the first export only, so a process
that traces nothing never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import aiohttp

from llmgw import __version__, logs
from llmgw.core.tracing import Attribute, Span

log = logs.get("llmgw.otlp")

TRACES_PATH = "/v1/traces"
SCOPE = "llmgw"


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector `endpoint` (`http://host:4318`), as the
    OpenTelemetry SDKs build it from OTEL_EXPORTER_OTLP_ENDPOINT."""
    base = endpoint.rstrip("/")
    return base if base.endswith(TRACES_PATH) else base + TRACES_PATH


def endpoint_problem(endpoint: str) -> str | None:
    """Why `endpoint` is not an OTLP/HTTP collector's address, or None."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in ("http", "https") or not rest.strip("/"):
        return (
            f"{endpoint!r} is not an OTLP/HTTP address: give the collector's"
            " http://host:4318 (OTLP over HTTP with protobuf)"
        )
    return None


def _value(v: Attribute, pb: Any) -> Any:
    if isinstance(v, bool):
        return pb.AnyValue(bool_value=v)
    if isinstance(v, int):
        return pb.AnyValue(int_value=v)
    if isinstance(v, float):
        return pb.AnyValue(double_value=v)
    return pb.AnyValue(string_value=v)


def encode(spans: Sequence[Span], service_name: str) -> bytes:
    """An ExportTraceServiceRequest holding `spans` of one service, serialized."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.resource.v1 import resource_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    def attrs(items: Iterable[tuple[str, Attribute]]) -> list[Any]:
        return [common_pb2.KeyValue(key=k, value=_value(v, common_pb2)) for k, v in items]

    out = []
    for s in spans:
        status = (
            trace_pb2.Status(code=trace_pb2.Status.STATUS_CODE_ERROR, message=s.error)
            if s.error
            else trace_pb2.Status()
        )
        out.append(
            trace_pb2.Span(
                trace_id=bytes.fromhex(s.trace_id),
                span_id=bytes.fromhex(s.span_id),
                parent_span_id=bytes.fromhex(s.parent_id) if s.parent_id else b"",
                name=s.name,
                kind=s.kind,  # type: ignore[arg-type]  # the enum's values are ints
                start_time_unix_nano=s.start_ns,
                end_time_unix_nano=s.end_ns,
                attributes=attrs(s.attributes.items()),
                status=status,
            )
        )
    resource = resource_pb2.Resource(attributes=attrs([("service.name", service_name)]))
    scope = common_pb2.InstrumentationScope(name=SCOPE, version=__version__)
    request = trace_service_pb2.ExportTraceServiceRequest(
        resource_spans=[
            trace_pb2.ResourceSpans(
                resource=resource, scope_spans=[trace_pb2.ScopeSpans(scope=scope, spans=out)]
            )
        ]
    )
    return request.SerializeToString()  # type: ignore[no-any-return]


class Exporter:
    """A bounded buffer of finished spans and the task that posts them."""

    def __init__(
        self,
        endpoint: str,
        service_name: str,
        *,
        max_spans: int = 8192,
        batch: int = 512,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = traces_url(endpoint)
        self.service_name = service_name
        self.max_spans = max_spans
        self.batch = batch
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.buffer: deque[Span] = deque()
        self.exported = 0
        self.dropped = 0
        self._said_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def add(self, spans: Iterable[Span]) -> None:
        """Queue `spans` for export; beyond the buffer's bound they are dropped (counted)."""
        room = self.max_spans - len(self.buffer)
        for s in spans:
            if room <= 0:
                self.dropped += 1
                continue
            self.buffer.append(s)
            room -= 1

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        """Post everything buffered now, a batch at a time; a failed batch is dropped."""
        while self.buffer:
            n = min(self.batch, len(self.buffer))
            batch = [self.buffer.popleft() for _ in range(n)]
            problem = await self._post(encode(batch, self.service_name))
            if problem is None:
                self.exported += n
                continue
            self.dropped += n
            now = time.monotonic()
            if now - self._said_at >= 60.0:
                self._said_at = now
                log.warning("traces_not_exported", url=self.url, error=problem,
                            dropped=self.dropped)  # fmt: skip
            return  # the collector is failing: try again at the next interval

    async def _post(self, body: bytes) -> str | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        try:
            headers = {"Content-Type": "application/x-protobuf"}
            async with self._session.post(self.url, data=body, headers=headers) as resp:
                if resp.status >= 300:
                    return f"HTTP {resp.status}: {(await resp.text())[:200]}"
                await resp.read()
                return None
        except (aiohttp.ClientError, TimeoutError) as exc:
            return f"{type(exc).__name__}: {exc}"

    async def close(self) -> None:
        """Stop the task, post what is left (bounded by the timeout), close the session."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.flush(), self.timeout_s)
        if self._session is not None:
            await self._session.close()
            self._session = None
