"""The signing keys that go with a connection: a connection speaks for one identity.

`bus.connect(..., keys=Keys.load(...))` binds them to the client; a `Publisher` on that
connection then signs every event with its `signer`, and a `Reader`, `Lease` or
`SnapshotStore` on it checks what it reads with its `verifier` (llmgw.pki.signing).
Either can also be passed to those classes directly. A connection with no verifier
cannot read (ReaderError), one with no signer cannot publish: nothing falls back to
trusting the server.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from pathlib import Path

from nats.aio.client import Client
from nats.js import JetStreamContext

from llmgw.pki.signing import Signer, Verifier


@dataclass(frozen=True)
class Keys:
    """Who this process signs as (None: it publishes nothing) and how it checks others."""

    signer: Signer | None
    verifier: Verifier | None

    @classmethod
    def load(
        cls,
        *,
        ca_file: str | Path,
        cert_file: str | Path | None = None,
        key_file: str | Path | None = None,
        accept_unsigned_before: int = 0,
    ) -> Keys:
        """The verifier of `ca_file` and, given a certificate and key, their signer."""
        signer = None
        if cert_file and key_file:
            signer = Signer.load(cert_file, key_file)
        verifier = Verifier.load(ca_file, accept_unsigned_before=accept_unsigned_before)
        return cls(signer, verifier)


_BOUND: weakref.WeakKeyDictionary[Client, Keys] = weakref.WeakKeyDictionary()


def bind(nc: Client, keys: Keys) -> None:
    """Make `keys` the signer and verifier of everything built on `nc`."""
    _BOUND[nc] = keys


def client_of(conn: Client | JetStreamContext) -> Client | None:
    """The connection of `conn` (itself, or a JetStream context's)."""
    if isinstance(conn, JetStreamContext):
        nc = getattr(conn, "_nc", None)
        return nc if isinstance(nc, Client) else None
    return conn


def bound(conn: Client | JetStreamContext) -> Keys | None:
    """The keys bound to a connection (or to the connection of a JetStream context)."""
    nc = client_of(conn)
    if nc is None:
        return None
    try:
        return _BOUND.get(nc)
    except TypeError:  # not weak-referenceable (a test double): nothing bound
        return None


def signer_of(conn: Client | JetStreamContext) -> Signer | None:
    keys = bound(conn)
    return keys.signer if keys is not None else None


def verifier_of(conn: Client | JetStreamContext) -> Verifier | None:
    keys = bound(conn)
    return keys.verifier if keys is not None else None
