"""OTLP/HTTP export of spans (llmgw.core.tracing), for the router and the sim.

Spans wait in a bounded buffer and a background task posts them, in batches, as
OTLP's protobuf (`POST {endpoint}/v1/traces`, `application/x-protobuf`) to a
collector: a request never waits on the collector, and a collector that is down or
slow costs spans (counted in `dropped`, said once a minute in the log), never memory
or latency.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

import aiohttp

from llmgw import __version__, logs
from llmgw.core import redaction
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
            f"{redaction.shown_url(endpoint)!r} is not an OTLP/HTTP address: give the"
            " collector's http://host:4318 (OTLP over HTTP with protobuf)"
        )
    return None


# OTLP's protobuf, written directly: the messages are few and fixed, and building them
# through the generated classes costs several times more CPU per span (measured in
# tests/bench/bench_tracing.py). Field numbers are those of opentelemetry-proto's
# trace/v1, common/v1, resource/v1 and collector/trace/v1; the tests decode the output
# with the official generated classes.
_LEN, _VARINT, _I64 = 2, 0, 1
_ONE_BYTE = [bytes((i,)) for i in range(128)]


def _varint(n: int) -> bytes:
    if 0 <= n < 128:  # tags, lengths of short strings, kinds: most varints written
        return _ONE_BYTE[n]
    n &= (1 << 64) - 1  # int64 fields carry negatives as their two's complement
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return _varint(field << 3 | wire)


def _bytes(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field; `tag` is its `_tag(field, _LEN)`."""
    n = len(data)
    return tag + (_ONE_BYTE[n] if n < 128 else _varint(n)) + data


def _utf8(text: str) -> bytes:
    # A lone surrogate (JSON can carry one) is not UTF-8: it is written as "?".
    return text.encode("utf-8", "replace")


_T1, _T2, _T4, _T5, _T9, _T15 = (_tag(f, _LEN) for f in (1, 2, 4, 5, 9, 15))
_KIND, _START, _END = _tag(6, _VARINT), _tag(7, _I64), _tag(8, _I64)
_BOOL, _INT, _DOUBLE = _tag(2, _VARINT), _tag(3, _VARINT), _tag(4, _I64)
_ERROR = _tag(3, _VARINT) + _varint(2)  # Status.code STATUS_CODE_ERROR
_F64 = struct.Struct("<d")


def _any_value(v: Attribute) -> bytes:
    """An AnyValue: string_value 1, bool_value 2, int_value 3, double_value 4."""
    if isinstance(v, str):
        return _bytes(_T1, v.encode("utf-8", "replace"))  # see _utf8
    if isinstance(v, bool):
        return _BOOL + _ONE_BYTE[v]
    if isinstance(v, int):
        return _INT + _varint(v)
    return _DOUBLE + _F64.pack(v)


_KEYS: dict[str, bytes] = {}
"""Attribute keys as KeyValue's encoded `key` field: the same dozen names on every span."""
_CACHE_BOUND = 4096
"""How many repeated fields (keys, names, attributes) are kept encoded: their values
come from the code and from requests (a model's name), so the memory is bounded and an
unusual value is simply encoded again."""


def keep(cache: dict[Any, bytes], key: Any, encoded: bytes) -> bytes:
    """`encoded`, kept in `cache` under `key` while the cache is under its bound."""
    if len(cache) < _CACHE_BOUND:
        cache[key] = encoded
    return encoded


def _key(k: str) -> bytes:
    return _KEYS.get(k) or keep(_KEYS, k, _bytes(_T1, _utf8(k)))


def attribute(key: str, value: Attribute) -> bytes:
    """One KeyValue{key 1, value 2} as a field of Span.attributes (9)."""
    return _bytes(_T9, _key(key) + _bytes(_T2, _any_value(value)))


_ATTRIBUTES: dict[tuple[str, type, Attribute], bytes] = {}


def repeated_attribute(key: str, value: Attribute) -> bytes:
    """`attribute`, kept encoded: for values many spans share (a model, an endpoint, a
    status code)."""
    cached = (key, type(value), value)  # True == 1 == 1.0, but each encodes apart
    return _ATTRIBUTES.get(cached) or keep(_ATTRIBUTES, cached, attribute(key, value))


_BLOCKS: dict[tuple[tuple[str, Attribute], ...], bytes] = {}
_BLOCK_TYPES = (str, int)


def repeated_attributes(items: tuple[tuple[str, Attribute], ...]) -> bytes:
    """`attribute`s of values that recur together (a request's model, operation and status;
    an attempt's endpoint), kept encoded as one block."""
    # Keyed by value, and True == 1 == 1.0: only blocks of str and int values are kept or
    # looked up, so one never stands for another.
    if not all(type(v) in _BLOCK_TYPES for _, v in items):
        return b"".join(repeated_attribute(k, v) for k, v in items)
    found = _BLOCKS.get(items)
    if found is None:
        found = keep(_BLOCKS, items, b"".join(repeated_attribute(k, v) for k, v in items))
    return found


_PREFIXES: dict[tuple[str, int, int], bytes] = {}


def string_attribute(key: str, value: str) -> bytes:
    """`attribute(key, value)` for a string that differs from span to span (a request id):
    all but the value's own bytes depends only on its length, kept encoded per length."""
    raw = value.encode("utf-8", "replace")  # see _utf8
    n = len(raw)
    prefix = _PREFIXES.get((key, 1, n))
    if prefix is None:
        whole = attribute(key, "x" * n)  # the same length, so the same prefix
        prefix = keep(_PREFIXES, (key, 1, n), whole[: len(whole) - n])
    return prefix + raw


def int_attribute(key: str, value: int) -> bytes:
    """`attribute(key, value)` for an int that differs from span to span (a count of
    tokens): all but the value's varint depends only on the varint's length."""
    v = _varint(value)
    n = len(v)
    prefix = _PREFIXES.get((key, 3, n))
    if prefix is None:
        prefix = keep(_PREFIXES, (key, 3, n), attribute(key, value)[:-n])
    return prefix + v


def _key_values(tag: bytes, items: Iterable[tuple[str, Attribute]]) -> bytes:
    """Repeated KeyValue{key 1, value 2}."""
    return b"".join(_bytes(tag, _key(k) + _bytes(_T2, _any_value(v))) for k, v in items)


_TRACE_ID = _T1 + _ONE_BYTE[16]
_SPAN_ID = _T2 + _ONE_BYTE[8]
_PARENT_ID = _T4 + _ONE_BYTE[8]


def _id(prefix: bytes, size: int, hex_id: str) -> bytes:
    """A fixed-size id field (its length byte in `prefix`); any other size is encoded as
    it is, for the collector to refuse, rather than misframing the message."""
    raw = bytes.fromhex(hex_id)
    return prefix + raw if len(raw) == size else _bytes(prefix[:1], raw)


def trace_id_field(hex_id: str) -> bytes:
    return _id(_TRACE_ID, 16, hex_id)


def span_id_field(hex_id: str) -> bytes:
    return _id(_SPAN_ID, 8, hex_id)


def parent_id_field(hex_id: str) -> bytes:
    """The parent_span_id field, absent (empty) for a root."""
    return _id(_PARENT_ID, 8, hex_id) if hex_id else b""


_NAMED: dict[tuple[str, int], bytes] = {}


def named(name: str, kind: int) -> bytes:
    """A span's name (5) and kind (6) fields, kept encoded for names that repeat."""
    return _NAMED.get((name, kind)) or keep(
        _NAMED, (name, kind), _bytes(_T5, _utf8(name)) + _KIND + _varint(kind)
    )


TIMES = struct.Struct("<BQBQ")  # start_time_unix_nano 7 and end 8, fixed64 each
START_TAG, END_TAG = _START[0], _END[0]


def status_error(message: str) -> bytes:
    """A span's status field (15): Status{message 2, code 3} with code ERROR (2)."""
    return _bytes(_T15, _bytes(_T2, _utf8(message)) + _ERROR)


def length_delimited_span(body: bytes) -> bytes:
    """The tag and length that make `body` (a Span's fields) one of ScopeSpans.spans (2)."""
    n = len(body)
    return _T2 + (_ONE_BYTE[n] if n < 128 else _varint(n))


def span_field(
    ids: bytes, name_kind: bytes, start_ns: int, end_ns: int, attributes: bytes = b"",
    error: str = "",
) -> bytes:  # fmt: skip
    """One Span as a field of ScopeSpans.spans (2), from its parts already encoded: `ids`
    (its trace_id 1, span_id 2 and parent_span_id 4 fields, in any order: a parser takes
    fields in any order, so what a request's spans share is encoded once by the caller),
    `named` (name 5, kind 6), then start 7, end 8, `attribute`s (9) and the status 15
    (Status{message 2, code 3}; code 2 is ERROR)."""
    body = b"".join(
        (
            ids,
            name_kind,
            TIMES.pack(START_TAG, start_ns, END_TAG, end_ns),
            attributes,
            status_error(error) if error else b"",
        )
    )
    return _bytes(_T2, body)


_ID_TIMES = struct.Struct("<BB8sBQBQ")  # span_id 2 (8 bytes), start 7, end 8


class PlainSpans:
    """Spans of one name and kind without attributes or status, many of them: only their
    span id and times differ once a trace's shared fields are encoded."""

    __slots__ = ("fixed", "name_kind")

    def __init__(self, name: str, kind: int) -> None:
        self.name_kind = named(name, kind)
        self.fixed = len(self.name_kind) + _ID_TIMES.size

    def field(self, shared: bytes, span_id: bytes, start_ns: int, end_ns: int) -> bytes:
        """The span of 8 raw bytes `span_id` (the caller's, never all zeros); `shared` is
        its trace_id and parent_span_id fields."""
        n = len(shared) + self.fixed
        return b"".join(
            (
                _T2,
                _ONE_BYTE[n] if n < 128 else _varint(n),
                shared,
                self.name_kind,
                _ID_TIMES.pack(_SPAN_ID[0], 8, span_id, START_TAG, start_ns, END_TAG, end_ns),
            )
        )


def _span(s: Span) -> bytes:
    return span_field(
        trace_id_field(s.trace_id) + span_id_field(s.span_id) + parent_id_field(s.parent_id),
        _bytes(_T5, _utf8(s.name)) + _KIND + _varint(s.kind),
        s.start_ns,
        s.end_ns,
        _key_values(_T9, s.attributes.items()) if s.attributes else b"",
        s.error,
    )


def encode(spans: Sequence[Span], service_name: str) -> bytes:
    """An ExportTraceServiceRequest holding `spans` of one service, serialized."""
    return encode_fields(b"".join(_span(s) for s in spans), service_name)


def encode_fields(spans: bytes, service_name: str) -> bytes:
    """An ExportTraceServiceRequest around spans already encoded (`span_field`s):
    resource_spans 1 → ResourceSpans{resource 1 (Resource{attributes 1}), scope_spans 2}
    → ScopeSpans{scope 1 (InstrumentationScope{name 1, version 2}), spans 2}."""
    return b"".join(encode_parts([spans], len(spans), service_name))


def encode_parts(parts: list[bytes], size: int, service_name: str) -> list[bytes]:
    """`encode_fields` of the spans `parts` (`size` bytes in all), as parts to join once:
    the export's head goes first in `parts`, so a batch of a few hundred kilobytes is
    copied once rather than at every level of the message."""
    resource = _bytes(_T1, _key_values(_T1, [("service.name", service_name)]))
    scope = _bytes(_T1, _bytes(_T1, _utf8(SCOPE)) + _bytes(_T2, _utf8(__version__)))
    n = len(scope) + size  # ScopeSpans
    head = _T2 + _varint(n) + scope
    n += len(head) - len(scope) + len(resource)  # ResourceSpans
    parts.insert(0, _T1 + _varint(n) + resource + head)
    return parts


def _done(wake: asyncio.Future[int]) -> None:
    if not wake.done():
        wake.set_result(1)


class Later(Protocol):
    """Spans noted as clock readings (a router's request), which the exporter's task
    encodes in its batches, with its offset to Unix time."""

    def encode_spans(self, offset_ns: int) -> bytes:
        """The spans as `span_field`s; `offset_ns` is the Unix time of time.monotonic's
        zero, in nanoseconds."""
        ...


class Exporter:
    """A bounded buffer of finished spans, kept encoded, and the task that posts them."""

    def __init__(
        self,
        endpoint: str,
        service_name: str,
        *,
        max_spans: int = 8192,
        batch: int = 2048,
        interval_s: float = 1.0,
        timeout_s: float = 5.0,
    ) -> None:
        self.url = traces_url(endpoint)
        self.shown_url = redaction.shown_url(self.url)  # the log's: without a password
        self.service_name = service_name
        self.max_spans = max_spans
        self.batch = batch
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.buffer: deque[tuple[bytes | Later, int]] = deque()
        """Spans (encoded `span_field`s, or to encode) and how many, a request's (or one
        call's) at a time."""
        self.buffered = 0
        """Spans in the buffer."""
        self.exported = 0
        self.dropped = 0
        self._said_at = 0.0
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Future[int] | None = None
        """What the task waits on between flushes: done at the interval (with 1: post
        everything), or as soon as a batch is buffered (with `batch`: post whole batches
        only), since a busy router fills the buffer's bound well within a second, and spans
        beyond it would be dropped."""
        self._session: aiohttp.ClientSession | None = None

    def add(self, spans: Sequence[Span]) -> None:
        """Queue `spans` for export (see `put`)."""
        self.put(b"".join(_span(s) for s in spans), len(spans))

    def put(self, spans: bytes | Later, count: int) -> None:
        """Queue `count` spans, encoded as `span_field`s or to encode, all or none: beyond
        the buffer's bound they are dropped (counted), so a trace is never exported in
        part. Spans to encode are encoded by the task, a batch in a row: in a busy router
        that costs less CPU than encoding each request's as it ends, between other work
        (measured under load, about 5 us a request, though the readings are kept meanwhile)."""
        if self.buffered + count > self.max_spans:
            self.dropped += count
            return
        self.buffer.append((spans, count))
        self.buffered += count
        wake = self._wake
        if self.buffered >= self.batch and wake is not None and not wake.done():
            wake.set_result(self.batch)

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake = wake = loop.create_future()
            timer = loop.call_later(self.interval_s, _done, wake)
            try:
                least = await wake
            finally:
                timer.cancel()
                self._wake = None
            try:
                posted = await self.flush(least)
            except Exception:  # a bug here must not end the export for the process's life
                log.exception("export_failed")
                posted = False
            if not posted:
                await asyncio.sleep(self.interval_s)  # a failing collector: no early wake

    async def flush(self, least: int = 1) -> bool:
        """Post what is buffered, a batch at a time, while at least `least` spans are (a
        POST has a cost of its own beside its bytes', about a third of a full batch's, so
        a busy router's are full batches); a failed batch is dropped, and the rest waits
        (False)."""
        buffer = self.buffer
        while buffer and self.buffered >= least:
            offset_ns = time.time_ns() - time.monotonic_ns()
            taken: list[tuple[bytes | Later, int]] = []
            n = 0
            while buffer and n < self.batch:
                item = buffer.popleft()
                taken.append(item)
                n += item[1]
            self.buffered -= n
            try:  # a batch in one go; one that fails is encoded again one by one
                parts = [s if isinstance(s, bytes) else s.encode_spans(offset_ns) for s, _ in taken]
            except Exception:
                parts, n = self._encoded_apart(taken, offset_ns)
            if not parts:
                continue
            body = b"".join(encode_parts(parts, sum(map(len, parts)), self.service_name))
            try:
                problem = await self._post(body)
            except Exception as exc:  # not the network's: a bug, still this batch's loss
                log.exception("export_failed")
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                self.exported += n
                continue
            self.dropped += n
            now = time.monotonic()
            if now - self._said_at >= 60.0:
                self._said_at = now
                log.warning("traces_not_exported", url=self.shown_url, dropped=self.dropped,
                            error=redaction.without_url_secret(problem, self.url))  # fmt: skip
            return False  # the collector is failing: try again at the next interval
        return True

    def _encoded_apart(
        self, taken: list[tuple[bytes | Later, int]], offset_ns: int
    ) -> tuple[list[bytes], int]:
        """A batch's spans encoded one request at a time, and how many: a bug in one
        request's spans costs those spans (dropped, counted), never the others'."""
        parts, n = [], 0
        for spans, count in taken:
            try:
                parts.append(spans if isinstance(spans, bytes) else spans.encode_spans(offset_ns))
                n += count
            except Exception:
                log.exception("spans_not_encoded")
                self.dropped += count
        return parts, n

    async def _post(self, body: bytes) -> str | None:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            )
        try:
            headers = {"Content-Type": "application/x-protobuf"}
            async with self._session.post(self.url, data=body, headers=headers) as resp:
                # The collector's reply is its own: read bounded, in whatever encoding; what
                # is left unread closes the connection rather than being kept alive.
                if resp.status >= 300:
                    said = (await resp.content.read(200)).decode("utf-8", "replace")
                    return f"HTTP {resp.status}: {said}"
                await resp.content.read(65_536)  # OTLP's reply: partial success, if anything
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
        try:
            await asyncio.wait_for(self.flush(), self.timeout_s)
        except TimeoutError:
            pass
        except Exception:  # the last spans are lost, the router's stop goes on
            log.exception("export_failed")
        if self._session is not None:
            await self._session.close()
            self._session = None
