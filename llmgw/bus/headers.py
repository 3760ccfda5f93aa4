"""Message headers as the server sends them: the raw header block of a NATS message.

The reader gets each message's header block as bytes (`BusClient.fast_subscribe`) and
reads the few headers it checks in one pass, on every message of a replay. Pure.
"""

from __future__ import annotations

_MSG_ID = b"Nats-Msg-Id"
_SIG = b"Llmgw-Sig"
_CERT = b"Llmgw-Cert"
_TTL = b"Nats-TTL"
"""As the server reads it: a `nats-ttl` header is no TTL to it (the message never expires)."""


Found = tuple[bytes | None, bytes | None, bytes | None, bytes | None]


def message_headers(raw: bytes) -> Found | None:
    """(Nats-Msg-Id, Llmgw-Sig, Llmgw-Cert, Nats-TTL) from a raw header block in one pass,
    each None when absent; None altogether when a signature header appears twice (never
    trusted). The TTL header's name is matched as written, and its first value counts,
    as the server reads it. Pure; on every message of a replay, hence written flat.

    Nearly every event's block is exactly what llmgw's publisher writes (the id, the
    signature, the certificate, in that order): that shape is read without a loop, with
    the same result as the general reading (tests/unit/test_headers.py)."""
    lines = raw.split(b"\r\n")
    if len(lines) == 6 and not lines[4] and not lines[5]:
        msg_id, sig, cert = lines[1], lines[2], lines[3]
        if (
            msg_id.startswith(b"Nats-Msg-Id:")
            and sig.startswith(b"Llmgw-Sig:")
            and cert.startswith(b"Llmgw-Cert:")
        ):
            return msg_id[12:].strip(), sig[10:].strip(), cert[11:].strip(), None
    return _general(lines)


def _general(lines: list[bytes]) -> Found | None:
    """`message_headers` for any block, from its lines."""
    msg_id = sig = cert = ttl = None
    if lines == [b""]:
        return None, None, None, None
    for line in lines[1:]:
        key, sep, value = line.partition(b":")
        if not sep:
            continue
        key = key.strip()
        if key == _MSG_ID:
            if msg_id is not None:
                return None
            msg_id = value.strip()
        elif key == _SIG:
            if sig is not None:
                return None
            sig = value.strip()
        elif key == _CERT:
            if cert is not None:
                return None
            cert = value.strip()
        elif ttl is None and key == _TTL:
            ttl = value.strip()
    return msg_id, sig, cert, ttl


def header_block(headers: dict[str, str] | None) -> bytes:
    """A raw header block (as the server sends it) from nats-py's parsed headers. Pure."""
    if not headers:
        return b""
    lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
    return f"NATS/1.0\r\n{lines}\r\n".encode()
