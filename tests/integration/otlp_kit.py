"""An OTLP/HTTP trace receiver in the test process: what a collector would be handed.

It serves `POST /v1/traces` on its own thread and loop, decodes each body with
opentelemetry-proto (as a real collector does) and keeps every span as a `Got`.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2

from tests.kit.threaded_http import ThreadedApp


@dataclass(frozen=True)
class Got:
    service: str
    trace_id: str
    span_id: str
    parent_id: str
    name: str
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    error: str


def _value(v: Any) -> Any:
    field = v.WhichOneof("value")
    return getattr(v, field) if field else None


def decode(body: bytes) -> list[Got]:
    req = trace_service_pb2.ExportTraceServiceRequest()
    req.ParseFromString(body)
    out: list[Got] = []
    for rs in req.resource_spans:
        res = {kv.key: _value(kv.value) for kv in rs.resource.attributes}
        for ss in rs.scope_spans:
            for s in ss.spans:
                out.append(
                    Got(
                        service=str(res.get("service.name", "")),
                        trace_id=s.trace_id.hex(),
                        span_id=s.span_id.hex(),
                        parent_id=s.parent_span_id.hex(),
                        name=s.name,
                        kind=s.kind,
                        start_ns=s.start_time_unix_nano,
                        end_ns=s.end_time_unix_nano,
                        attributes={kv.key: _value(kv.value) for kv in s.attributes},
                        error=s.status.message if s.status.code == 2 else "",
                    )
                )
    return out


class Receiver(ThreadedApp):
    """A collector's OTLP/HTTP endpoint at `url`; `spans` is everything it was sent.
    Bodies are kept as sent and decoded when read (a benchmark's receiver, beside the
    router on the same cores, does no more work per export than a real collector's
    socket would)."""

    def __init__(self) -> None:
        self._raw: list[bytes] = []
        self._decoded: list[Got] = []
        self.bodies = 0
        self.content_types: set[str] = set()
        self._lock = threading.Lock()
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        super().__init__(app)

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.read()
        with self._lock:
            self.bodies += 1
            self.content_types.add(request.content_type)
            self._raw.append(body)
        return web.Response(body=b"", content_type="application/x-protobuf")

    @property
    def spans(self) -> list[Got]:
        with self._lock:
            raw, self._raw = self._raw, []
        for body in raw:
            self._decoded += decode(body)
        return self._decoded

    def of_trace(self, trace_id: str) -> list[Got]:
        return [s for s in self.spans if s.trace_id == trace_id]

    def wait_for(self, trace_id: str, *, router: int, sim: int, timeout: float = 60.0) -> list[Got]:
        """The trace's spans once `router` of the router's and `sim` of the sim's are in."""
        deadline = time.monotonic() + timeout
        while True:
            spans = self.of_trace(trace_id)
            by = [s.service for s in spans]
            if by.count("llmgw-router") >= router and by.count("llmgw-sim") >= sim:
                return spans
            if time.monotonic() > deadline:
                raise AssertionError(f"trace {trace_id}: only {by} within {timeout} s")
            time.sleep(0.05)
