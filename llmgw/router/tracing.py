"""The router's spans: one request's trace, from admission to its last byte.

A recorded request is one SERVER span (`{operation} {model}`, a child of the client's
span when it sent a valid `traceparent`) over these children:

- `admission`: the key, the body, the model, the key's limits;
- `queue`: held at zero replicas or queued behind full endpoints;
- one CLIENT span per attempt (`attempt`), whose id goes to the engine as its parent
  in `traceparent`, so vLLM's or SGLang's own span is the attempt's child;
- `first_token`, from the answering attempt's send to the first token reaching the
  client, and `completion`, from there to the end.

The root carries OpenTelemetry's GenAI attributes (`gen_ai.operation.name`,
`gen_ai.request.model`, `gen_ai.response.model`, `gen_ai.usage.input_tokens`,
`gen_ai.usage.output_tokens`) beside `http.response.status_code` and
`llmgw.request_id`. The request path only notes monotonic clock readings in a
`RequestTrace`; when the request is done it goes to the exporter (llmgw.otlp), whose
task encodes the spans straight from those readings, in batches, and posts them in the
background. A router without `traces` has no Tracer, and each request pays one `is None`
check.
"""

from __future__ import annotations

import contextvars
import random
import struct
from collections.abc import Mapping

from llmgw import logs, otlp
from llmgw.core import redaction, tracing
from llmgw.core.tracing import SPAN_CLIENT, SPAN_INTERNAL, SPAN_SERVER
from llmgw.router import tracecontext
from llmgw.router.config import TracesConfig


class Tracer:
    """Which requests are recorded, and where their spans go."""

    def __init__(self, cfg: TracesConfig, exporter: otlp.Exporter | None = None) -> None:
        self.ratio = cfg.sample_ratio
        self.obey_parent = cfg.client_sampling
        self.exporter = exporter or otlp.Exporter(cfg.endpoint, cfg.service_name)
        self._bits = random.SystemRandom().getrandbits(64)
        self._rng = random.Random(self._bits)
        self._raw, self._hex = b"", ""
        self._at = _POOL_BYTES  # drawn at the first recorded request

    def start(self) -> None:
        self.exporter.start()

    async def close(self) -> None:
        await self.exporter.close()

    def begin(self, headers: Mapping[str, str], rid: str, start: float) -> RequestTrace | None:
        """The trace of a request that began at `start` (time.monotonic), if it is sampled.

        A recorded request takes its ids (its trace's, when it starts one, its root span's,
        its first attempt's and its children's) from a pool drawn for many requests at a
        time (`_refill`), already written out in hex: each call and object on a request's
        path costs several times more in a busy router than in a loop
        (tests/bench/bench_tracing.py)."""
        value = tracecontext.traceparent(headers)
        parent = tracing.parse_traceparent(value) if value is not None else None
        if parent is None:
            ratio = self.ratio
            if ratio <= 0.0:
                return None  # nothing to draw: only a client's sampled flag records a trace
            if ratio < 1.0:
                draw = self._rng.getrandbits(128)
                if not tracing.draw_sampled(draw, ratio):
                    return None
        elif not tracing.sampled(parent, 0, self.ratio, self.obey_parent):
            return None
        at = self._at
        if at >= _POOL_BYTES:
            self._refill()
            at = 0
        self._at = at + _IDS
        hexed, h = self._hex, 2 * at
        if parent is None:
            trace_id = hexed[h : h + 32] if ratio >= 1.0 else tracing.trace_id_of(draw)
            return RequestTrace(trace_id, "", hexed[h + 32 : h + 48], rid, start, "", self._rng,
                                self._raw, at, hexed[h + 48 : h + 64])  # fmt: skip
        return RequestTrace(parent.trace_id, parent.span_id, hexed[h + 32 : h + 48], rid, start,
                            tracecontext.tracestate(headers), self._rng, self._raw, at,
                            hexed[h + 48 : h + 64])  # fmt: skip

    def _refill(self) -> None:
        """Draw the next `_POOL` requests' ids, none of them all zeros."""
        raw = self._rng.randbytes(_POOL_BYTES)
        if _ZERO in raw:
            raw = _nonzero(raw)
        self._raw, self._hex = raw, raw.hex()

    def finish(
        self, trace: RequestTrace, end: float, *, kind: str, model: str, status: int,
        tokens_in: int, tokens_out: int,
    ) -> None:  # fmt: skip
        """The request ended at `end`: its spans go to the exporter."""
        self.exporter.put(trace, trace.ended(end, kind, model, status, tokens_in, tokens_out))


def bind_logs(
    trace: RequestTrace | None, headers: Mapping[str, str]
) -> contextvars.Token[tuple[str, str]] | None:
    """Put the request's trace id (and span) in every log line it makes (llmgw.logs.TRACE);
    a client's valid trace id too when the router does not record the trace. The token to
    unbind with, None when nothing was bound."""
    if trace is not None:
        return logs.TRACE.set((trace.trace_id, trace.root_id))
    value = tracecontext.traceparent(headers)
    if value is None:
        return None
    parent = tracing.parse_traceparent(value)
    if parent is None:
        return None
    return logs.TRACE.set((parent.trace_id, ""))


def unbind_logs(token: contextvars.Token[tuple[str, str]]) -> None:
    """Undo `bind_logs`: the connection's next request starts without them."""
    logs.TRACE.reset(token)


class _Attempt:
    __slots__ = ("end", "endpoint", "error", "model", "span_id", "start", "url")

    def __init__(self, span_id: str, endpoint: str, url: str, model: str, start: float) -> None:
        self.span_id = span_id
        self.endpoint = endpoint
        self.url = url
        self.model = model
        self.start = start
        self.end = 0.0
        self.error = ""


class RequestTrace:
    """A recorded request's clock readings (time.monotonic), turned into spans after its
    end, by the exporter's task (`encode_spans`)."""

    __slots__ = (
        "admitted", "answered", "attempts", "end", "first_attempt", "first_token", "kind",
        "model", "parent_id", "pool", "pool_at", "queue", "rid", "rng", "root_id", "start",
        "status", "tokens", "trace_id", "tracestate",
    )  # fmt: skip

    def __init__(
        self, trace_id: str, parent_id: str, root_id: str, rid: str, start: float,
        tracestate: str, rng: random.Random, pool: bytes = b"", at: int = 0,
        first_attempt: str = "",
    ) -> None:  # fmt: skip
        self.pool, self.pool_at = pool, at
        """The tracer's pool of ids and where this request's are in it (`_IDS` bytes: the
        trace id, the root's and first attempt's span ids, those given here in hex, and the
        three children's that every answered request has); without a pool, each is drawn
        from `rng` as it is needed."""
        self.first_attempt = first_attempt
        self.trace_id = trace_id
        self.parent_id = parent_id
        self.root_id = root_id
        self.rid = rid
        self.start = start
        self.tracestate = tracestate
        self.rng = rng
        self.admitted = 0.0
        self.queue: tuple[float, float] | None = None
        self.attempts: list[_Attempt] = []
        self.first_token = 0.0
        # end, kind, model, status, tokens and answered are set by `ended`, which always
        # comes before `encode_spans`: a traced request writes six fields fewer.

    end: float
    kind: str
    model: str
    status: int
    tokens: tuple[int, int]
    answered: _Attempt | None
    """The attempt that answered, once the request ended."""

    def attempt_begin(self, endpoint: str, url: str, model: str, now: float) -> None:
        attempts = self.attempts
        span_id = _span_id(self.rng) if attempts or not self.first_attempt else self.first_attempt
        attempts.append(_Attempt(span_id, endpoint, url, model, now))

    def attempt_end(self, error: str, now: float) -> None:
        at = self.attempts[-1]
        at.end, at.error = now, error

    def headers(self) -> list[tuple[str, str]]:
        """The trace context the current attempt sends: its own span as the engine's parent."""
        parent = ("traceparent", tracing.traceparent(self.trace_id, self.attempts[-1].span_id))
        if self.tracestate:
            return [parent, ("tracestate", self.tracestate)]
        return [parent]

    def ended(
        self, end: float, kind: str, model: str, status: int, tokens_in: int = 0,
        tokens_out: int = 0,
    ) -> int:  # fmt: skip
        """The request ended at `end`, answered with `status`: how many spans it makes."""
        self.end, self.kind, self.model, self.status = end, kind, model, status
        self.tokens = (tokens_in, tokens_out)
        attempts = self.attempts
        answered = None
        if len(attempts) == 1:  # nearly every request
            if not attempts[0].error:
                answered = attempts[0]
        else:
            for at in reversed(attempts):  # the last that did not fail
                if not at.error:
                    answered = at
                    break
        self.answered = answered
        timed = answered is not None and self.first_token
        return 2 + (self.queue is not None) + len(attempts) + (2 if timed else 0)

    def encode_spans(self, offset_ns: int) -> bytes:
        """The ended request's spans, encoded for export (OTLP's span fields); `offset_ns`
        is the Unix time, in nanoseconds, of the monotonic clock's zero. The exporter's
        task encodes a batch of requests in one go, off the requests' path
        (tests/bench/bench_tracing.py measures both). What a request's spans share with
        other requests' (names, kinds, the model, the endpoint, the status) is looked up
        already encoded; only ids, times, the request id and the token counts are written
        per request."""
        ns, off = 1e9, offset_ns
        start, end = int(self.start * ns) + off, int(self.end * ns) + off
        answered, attempts = self.answered, self.attempts
        if len(attempts) == 1 and answered is not None and self.first_token and not self.queue:
            spans = self._one_attempt(answered, start, end, off)
            if spans is not None:
                return spans
        trace = otlp.trace_id_field(self.trace_id)
        root = otlp.span_id_field(self.root_id)
        shared = trace + otlp.parent_id_field(self.root_id)  # the children's ids but their own
        kind, model, status = self.kind, self.model, self.status
        fixed = _ROOTS.get((kind, model, status, answered.model if answered else None))
        if fixed is None:
            fixed = _root_fixed(kind, model, status, answered)
        root_body = [trace, root, otlp.parent_id_field(self.parent_id), fixed,
                     _TIMES.pack(_START_TAG, start, _END_TAG, end),
                     otlp.string_attribute("llmgw.request_id", self.rid)]  # fmt: skip
        t_in, t_out = self.tokens
        if t_in or t_out:
            root_body.append(otlp.int_attribute("gen_ai.usage.input_tokens", t_in))
            root_body.append(otlp.int_attribute("gen_ai.usage.output_tokens", t_out))
        body = b"".join(root_body)
        # the children's span ids: four at most (the queue's drawn only here)
        if self.pool:
            ids = self.pool[self.pool_at + 32 : self.pool_at + _IDS] + self.rng.randbytes(8)
        else:
            ids = self.rng.randbytes(32)
        a, b, c, d = ids[:8], ids[8:16], ids[16:24], ids[24:]
        admitted = int(self.admitted * ns) + off if self.admitted else end
        out = [otlp.length_delimited_span(body), body,
               _ADMISSION.field(shared, a if a != _ZERO else _ONE, start, admitted)]  # fmt: skip
        if self.queue is not None:
            q0, q1 = self.queue
            out.append(_QUEUE.field(shared, b if b != _ZERO else _ONE, int(q0 * ns) + off,
                                    int(q1 * ns) + off))  # fmt: skip
        if answered is not None and self.first_token:
            first = int(self.first_token * ns) + off
            out.append(_FIRST_TOKEN.field(shared, c if c != _ZERO else _ONE,
                                          int(answered.start * ns) + off, first))  # fmt: skip
            out.append(_COMPLETION.field(shared, d if d != _ZERO else _ONE, first, end))
        for i, at in enumerate(attempts, 1):
            key = (at.endpoint, at.url, at.model, i, at.error)
            fixed = _ATTEMPTS.get(key) or _attempt_fixed(key)
            body = b"".join((
                shared, otlp.span_id_field(at.span_id), fixed,
                _TIMES.pack(_START_TAG, int(at.start * ns) + off, _END_TAG,
                            int(at.end * ns) + off if at.end else end),
            ))  # fmt: skip
            out.append(otlp.length_delimited_span(body))
            out.append(body)
        return b"".join(out)

    def _one_attempt(self, at: _Attempt, start: int, end: int, off: int) -> bytes | None:
        """`encode_spans` for the shape of nearly every request: one attempt, which
        answered, a first token, no queue. Written in one function from parts kept per
        shape (`_Shape`): each call and object it touches costs more in a busy router than
        in a loop (measured with the thread's CPU clock under load);
        None for ids of another size (not the router's own), left to the general path."""
        trace, root = bytes.fromhex(self.trace_id), bytes.fromhex(self.root_id)
        parent = bytes.fromhex(self.parent_id) if self.parent_id else b""
        if len(trace) != 16 or len(root) != 8 or len(parent) not in (0, 8):
            return None
        key = (self.kind, self.model, self.status, at.endpoint, at.url, at.model, bool(parent))
        shape = _SHAPES.get(key) or _shape(key, at)
        rid = self.rid.encode("utf-8", "replace")  # see otlp._utf8
        rid_prefix = _RID_PREFIXES.get(len(rid)) or _rid_prefix(len(rid))
        t_in, t_out = self.tokens
        if not (t_in or t_out):
            tokens = b""
        elif 0 <= t_in < 128 and 0 <= t_out < 128:
            tokens = _TOKENS_IN[t_in] + _TOKENS_OUT[t_out]
        else:
            tokens = otlp.int_attribute(_IN, t_in) + otlp.int_attribute(_OUT, t_out)
        n = shape.root_len + len(rid_prefix) + len(rid) + len(tokens)
        if n >= 1 << 14:
            return None  # a client's request id of kilobytes: its length takes 3 bytes
        ns = 1e9
        first = int(self.first_token * ns) + off
        sent = int(at.start * ns) + off
        if self.pool:  # the attempt's and the children's ids, drawn in the tracer's pool
            ids = self.pool[self.pool_at + 24 : self.pool_at + _IDS]
        else:
            ids = bytes.fromhex(at.span_id) + self.rng.randbytes(24)
            if _ZERO in ids:
                ids = _nonzero(ids)
        shared = _TRACE_ID + trace + _PARENT_ID + root + _START_BYTE
        return b"".join((
            _T2 + bytes((n,)) if n < 128 else _T2 + bytes((n & 127 | 128, n >> 7)),
            _TRACE_ID, trace, _SPAN_ID, root, _PARENT_ID + parent if parent else b"",
            _TIMES.pack(_START_TAG, start, _END_TAG, end), shape.root, rid_prefix, rid, tokens,
            shape.children.pack(
                _ADMISSION_LEAD, ids[8:16], shared, start, _END_TAG,
                int(self.admitted * ns) + off if self.admitted else end,
                _FIRST_TOKEN_LEAD, ids[16:24], shared, sent, _END_TAG, first,
                _COMPLETION_LEAD, ids[24:], shared, first, _END_TAG, end,
                shape.attempt_lead, ids[:8], shared, sent, _END_TAG,
                int(at.end * ns) + off if at.end else end,
            ),
        ))  # fmt: skip


_IDS = 56
"""Bytes of a recorded request's ids in the pool: a trace id (16; unused for a client's
trace) and five span ids (8 each): the root's, the first attempt's and three children's
(admission, first_token, completion)."""
_POOL = 256
"""Requests whose ids are drawn at once."""
_POOL_BYTES = _POOL * _IDS


def _nonzero(ids: bytes) -> bytes:
    """`ids` with every 8 bytes of zeros (a span id or half a trace id the spec forbids
    as all zeros: a draw of 1 in 2**64) made one."""
    return b"".join(
        _ONE if ids[i : i + 8] == _ZERO else ids[i : i + 8] for i in range(0, len(ids), 8)
    )


def _span_id(rng: random.Random) -> str:
    """A random span id (never all zeros), as hex."""
    raw = rng.randbytes(8)
    return raw.hex() if raw != _ZERO else _ONE.hex()


_SHARED = 28
"""The length of the fields a request's children share: trace_id (2 + 16 bytes) and
parent_span_id (2 + 8), the ids being the router's own or a validated client's."""
_OK_ATTEMPTS: dict[tuple[str, str, str, int, str], tuple[bytes, bytes]] = {}
_SHAPES: dict[tuple[str, str, int, str, str, str, bool], _Shape] = {}
_RID_PREFIXES: dict[int, bytes] = {}
_IN, _OUT = "gen_ai.usage.input_tokens", "gen_ai.usage.output_tokens"
_TOKENS_IN = [otlp.attribute(_IN, n) for n in range(128)]
_TOKENS_OUT = [otlp.attribute(_OUT, n) for n in range(128)]
"""Token counts under 128 (one byte's varint), encoded: most answers' output, many
prompts."""


class _Shape:
    """What every one-attempt request of one kind, model, status, endpoint (and with or
    without a client's parent) shares, encoded: the root's name, kind, attributes and
    status and its length without the request id and tokens, the attempt's span head and
    fields, and the struct of the four children."""

    __slots__ = ("attempt_lead", "children", "root", "root_len")

    def __init__(self, root: bytes, parent: bool, attempt_head: bytes, attempt: bytes) -> None:
        self.root = root
        self.root_len = 18 + 10 + (10 if parent else 0) + _TIMES.size + len(root)
        self.attempt_lead = attempt_head + attempt + _SPAN_ID
        self.children = _children(len(self.attempt_lead))


def _shape(key: tuple[str, str, int, str, str, str, bool], at: _Attempt) -> _Shape:
    kind, model, status, endpoint, url, at_model, parent = key
    root = _ROOTS.get((kind, model, status, at.model)) or _root_fixed(kind, model, status, at)
    head, fixed = _OK_ATTEMPTS.get((endpoint, url, at_model, 1, "")) or _ok_attempt(
        (endpoint, url, at_model, 1, "")
    )
    shape = _Shape(root, parent, head, fixed)
    if len(_SHAPES) < 4096:
        _SHAPES[key] = shape
    return shape


def _rid_prefix(n: int) -> bytes:
    """The request id attribute's bytes before an id of `n` bytes."""
    whole = otlp.attribute("llmgw.request_id", "x" * n)
    prefix = whole[: len(whole) - n]
    if len(_RID_PREFIXES) < 4096:
        _RID_PREFIXES[n] = prefix
    return prefix


_CHILDREN: dict[int, struct.Struct] = {}


def _ok_attempt(key: tuple[str, str, str, int, str]) -> tuple[bytes, bytes]:
    """A first attempt that answered: its span's tag and length, and its fixed fields."""
    fixed = _ATTEMPTS.get(key) or _attempt_fixed(key)
    found = (otlp.length_delimited_span(bytes(_SHARED + 10 + len(fixed) + otlp.TIMES.size)), fixed)
    if len(_OK_ATTEMPTS) < 4096:
        _OK_ATTEMPTS[key] = found
    return found


def _children(attempt_lead: int) -> struct.Struct:
    """The struct of a one-attempt request's admission, first_token, completion and
    attempt spans, the attempt's fields before its id `attempt_lead` bytes long. Each
    span is written as what its kind of span always has (its tag and length, name, kind,
    the attempt's attributes, and the span id's tag), its id, the fields it shares with
    the request's other children (trace and parent ids, start time's tag) and its times:
    a protobuf message's fields may come in any order, and this one has the fewest parts
    to pack."""
    found = _CHILDREN.get(attempt_lead)
    if found is None:
        spans = [len(lead) for lead in (_ADMISSION_LEAD, _FIRST_TOKEN_LEAD, _COMPLETION_LEAD)]
        spans.append(attempt_lead)
        found = struct.Struct("<" + "".join(f"{n}s8s{_SHARED + 1}sQBQ" for n in spans))
        if len(_CHILDREN) < 64:
            _CHILDREN[attempt_lead] = found
    return found


_ROOTS: dict[tuple[str, str, int, str | None], bytes] = {}
_ATTEMPTS: dict[tuple[str, str, str, int, str], bytes] = {}


def _root_fixed(kind: str, model: str, status: int, answered: _Attempt | None) -> bytes:
    """The SERVER span's name, kind, GenAI attributes and status, shared by every request
    of one kind, model and status answered by one model."""
    op = tracing.operation(kind)
    attrs: tuple[tuple[str, str | int], ...] = (
        ("gen_ai.operation.name", op), ("gen_ai.request.model", model),
        ("http.response.status_code", status),
    )  # fmt: skip
    if answered is not None:
        attrs += (("gen_ai.response.model", answered.model),)
    fixed = otlp.named(f"{op} {model}", SPAN_SERVER) + otlp.repeated_attributes(attrs)
    if status >= 500:
        fixed += otlp.status_error(f"HTTP {status}")
    return otlp.keep(_ROOTS, (kind, model, status, answered.model if answered else None), fixed)


def _attempt_fixed(key: tuple[str, str, str, int, str]) -> bytes:
    """An attempt span's name, kind, attributes and status, shared by every attempt of its
    number on one endpoint for one model that ended the same way."""
    endpoint, url, model, number, error = key
    attrs: tuple[tuple[str, str | int], ...] = (
        ("llmgw.endpoint", endpoint), ("url.full", redaction.shown_url(url)),
        ("gen_ai.request.model", model), ("llmgw.attempt", number),
    )  # fmt: skip
    if error:
        attrs += (("error.type", error),)
    fixed = _ATTEMPT + otlp.repeated_attributes(attrs)
    if error:
        fixed += otlp.status_error(error)
    return otlp.keep(_ATTEMPTS, key, fixed)


_ADMISSION = otlp.PlainSpans("admission", SPAN_INTERNAL)
_QUEUE = otlp.PlainSpans("queue", SPAN_INTERNAL)
_FIRST_TOKEN = otlp.PlainSpans("first_token", SPAN_INTERNAL)
_COMPLETION = otlp.PlainSpans("completion", SPAN_INTERNAL)
_ATTEMPT = otlp.named("attempt", SPAN_CLIENT)


def _plain(spans: otlp.PlainSpans) -> bytes:
    """A child's tag and length, its name and kind, and its span_id's tag and length (the
    raw id follows), for `_children`."""
    head = otlp.length_delimited_span(bytes(_SHARED + spans.fixed))
    return head + spans.name_kind + otlp.span_id_field("01" * 8)[:2]


_ADMISSION_LEAD = _plain(_ADMISSION)
_FIRST_TOKEN_LEAD = _plain(_FIRST_TOKEN)
_COMPLETION_LEAD = _plain(_COMPLETION)
_TIMES = otlp.TIMES
_START_TAG, _END_TAG = otlp.START_TAG, otlp.END_TAG
_T2 = otlp.length_delimited_span(b"")[:1]
_TRACE_ID = otlp.trace_id_field("01" * 16)[:2]
_SPAN_ID = otlp.span_id_field("01" * 8)[:2]
_START_BYTE = bytes((_START_TAG,))
_PARENT_ID = otlp.parent_id_field("01" * 8)[:2]
_ZERO = bytes(8)
_ONE = bytes(7) + b"\x01"
"""The span id given for a random draw of zeros, which the spec forbids."""
