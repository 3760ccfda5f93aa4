"""The NATS wire protocol's message frames, parsed without regular expressions.

A replay is one `HMSG` frame per event, and nats-py's parser spends more on each frame
than the reader spends checking and decoding the event inside it: it tries the `MSG`
pattern, then the `HMSG` pattern, on the whole buffer, keeps the arguments in a dict,
and awaits a coroutine per message. `FrameParser` reads `MSG` and `HMSG` frames with
`bytes.find` and `split`, hands those of a fast subscription (`BusClient.fast_subscribe`)
to its handler inline, and leaves everything else (PING, PONG, INFO, -ERR, a frame
split across reads, anything it does not recognise) to nats-py's own parser, whose
state it shares. What it may change is pinned by tests/unit/test_wire.py, which feeds
the same random protocol streams, cut at random points, to both parsers and requires
the same deliveries in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

from llmgw import logs

log = logs.get("llmgw.bus")

_MSG = b"MSG "
_HMSG = b"HMSG "
_CRLF = b"\r\n"
# The server's limit on a control line: beyond it, nats-py's parser decides.
_MAX_CONTROL_LINE = 4096

# (subject, reply, payload, raw header block or b"") of one message, called inline.
FastHandler = Callable[[bytes, bytes, bytes, bytes], None]


class FrameParser(Parser):
    """nats-py's `Parser` with a fast path for message frames.

    `nc` is the client: `nc._fast` maps subscription ids to inline handlers, the rest
    go to `nc._process_msg` as with the stock parser.
    """

    async def parse(self, data: bytes = b"") -> None:
        buf = self.buf
        buf.extend(data)
        if self.state != AWAITING_CONTROL_LINE:
            await super().parse()
            return
        nc: Any = self.nc
        fast: dict[int, FastHandler] = nc._fast
        stats: dict[str, int] = nc.stats
        # One copy of the buffer per read: slices of bytes are one copy each, of a
        # bytearray two.
        view = bytes(buf)
        pos = 0
        end = len(view)
        # Whether what is left is the start of a frame that a later read completes (kept
        # for this parser) rather than something for nats-py's parser.
        partial = False
        while pos < end:
            if view.startswith(_HMSG, pos):
                skip, with_headers = 5, True
            elif view.startswith(_MSG, pos):
                skip, with_headers = 4, False
            else:
                tail = view[pos:]
                partial = len(tail) < 5 and (_HMSG.startswith(tail) or _MSG.startswith(tail))
                break
            eol = view.find(_CRLF, pos, pos + _MAX_CONTROL_LINE)
            if eol < 0:
                partial = end - pos < _MAX_CONTROL_LINE
                break
            args = view[pos + skip : eol].split()
            try:
                if with_headers:
                    if len(args) == 5:
                        subject, sid_b, reply, hsize_b, size_b = args
                    elif len(args) == 4:
                        subject, sid_b, hsize_b, size_b = args
                        reply = b""
                    else:
                        break
                    hsize = int(hsize_b)
                else:
                    if len(args) == 4:
                        subject, sid_b, reply, size_b = args
                    elif len(args) == 3:
                        subject, sid_b, size_b = args
                        reply = b""
                    else:
                        break
                    hsize = 0
                sid, size = int(sid_b), int(size_b)
            except ValueError:
                break  # nats-py's parser reports it
            if not 0 <= hsize <= size:
                break
            start = eol + 2
            if end < start + size + 2:
                partial = True  # the rest of this frame is in a later read
                break
            headers = view[start : start + hsize]
            payload = view[start + hsize : start + size]
            pos = start + size + 2
            handler = fast.get(sid)
            if handler is not None:
                stats["in_msgs"] += 1
                stats["in_bytes"] += len(payload)
                try:
                    handler(subject, reply, payload, headers)
                except Exception as exc:  # a handler bug must not kill the connection's reader
                    log.error("bus.fast_handler_failed", error=repr(exc))
                continue
            await nc._process_msg(sid, subject, reply, payload, headers or None)
            if self.buf is not buf:
                return  # the client reset the parser (a reconnect) while it was delivering
        del buf[:pos]
        if buf and not partial:
            await super().parse()
