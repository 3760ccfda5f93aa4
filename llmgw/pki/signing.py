"""End-to-end signatures on what others act on: log events, the leader lease, snapshots.

NATS decides which identity may write which subject, but a reader cannot see who wrote
a stored message, and a message the server stored on the wrong subject (or any bytes a
superuser stored) looks like any other. So every writer signs what it writes with the
private key of its client certificate (the same files it connects with), and every
reader checks, before it folds or obeys anything:

- the signature (ECDSA P-256 with SHA-256) over a domain-separated encoding of what
  the message is: for an event its subject, its `Nats-Msg-Id` and its payload bytes;
- that the certificate travelling with it was issued by the fleet's CA, is a client
  certificate (clientAuth, not a CA) and was valid when the message was stored;
- that the certificate's identity (`CN=<name>,OU=<kind>,O=llmgw`) owns the subject
  (`owner_allows`, the one place the rule lives).

Certificates are checked once and cached by their bytes; after that an event costs one
ECDSA verification. Nothing here does I/O or reads the clock: times are arguments, keys
and certificates are loaded by `Signer.load` / `Verifier.load` (file reads only).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import struct
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.pki.identity import ORGANIZATION, Identity

SIG_HEADER = "Llmgw-Sig"
"""Header carrying the base64 DER ECDSA signature of an event."""
CERT_HEADER = "Llmgw-Cert"
"""Header carrying the signer's certificate, base64 DER (self-authenticating: CA-signed)."""

EVENT_DOMAIN = b"llmgw/event/v1\x00"
LEASE_DOMAIN = b"llmgw/lease/v1\x00"
SNAPSHOT_DOMAIN = b"llmgw/snapshot/v1\x00"

_ECDSA = ec.ECDSA(hashes.SHA256())
_MAX_CACHED_CERTS = 10_000
_MAX_CACHED_CERT_BYTES = 8192
"""Longest certificate header whose verdict is kept: the fleet's are about 1 KiB; a
writer's header may be 64 KiB, checked each time rather than kept."""


class SignatureRefused(ValueError):
    """A signed object that does not verify; the message says why."""


# --------------------------------------------------------------------------- ownership


def owner_allows(subject: str, identity: Identity) -> bool:
    """True when `identity` may author a message stored on `subject`. Pure.

    - `llmgw.events.node.<n>.<kind>` and `llmgw.kv.<n>.<endpoint>`: node/<n>
    - `llmgw.signals.router.<r>.<worker>`: router/<r>; `llmgw.signals.node.<n>`: node/<n>
      (load reports)
    - `llmgw.events.control.<kind>` and `llmgw.cmd.<node>`: any control/*
    - `llmgw.events.operator.<name>.<kind>`: operator/<name>
    - `llmgw.events.operator.control.<name>.<kind>`: control/<name> (the models of a
      control plane's config file)
    - `llmgw.events.operator.<kind>` (the older, shared operator subject): any operator
      or control
    Anything else: nobody (routers own no subject of the log).
    """
    parts = subject.split(".")
    if len(parts) < 3 or parts[0] != "llmgw" or any(not p for p in parts):
        return False
    kind, name = identity.kind, identity.name
    if parts[1] == "kv":
        return len(parts) == 4 and kind == "node" and parts[2] == name
    if parts[1] == "cmd":
        return len(parts) == 3 and kind == "control"
    if parts[1] == "signals":
        if len(parts) == 5 and parts[2] == "router":
            return kind == "router" and parts[3] == name
        return len(parts) == 4 and parts[2] == "node" and kind == "node" and parts[3] == name
    if parts[1] != "events" or len(parts) < 4:
        return False
    area = parts[2]
    if area == "node":
        return len(parts) == 5 and kind == "node" and parts[3] == name
    if area == "control":
        return len(parts) == 4 and kind == "control"
    if area == "operator":
        if len(parts) == 4:
            return kind in ("operator", "control")
        if len(parts) == 5:
            return kind == "operator" and parts[3] == name
        if len(parts) == 6 and parts[3] == "control":
            return kind == "control" and parts[4] == name
    return False


# --------------------------------------------------------------------------- encodings


def _field(value: bytes) -> bytes:
    return struct.pack(">I", len(value)) + value


def event_message(subject: str, msg_id: str | bytes, payload: bytes) -> bytes:
    """What an event's signature covers: domain, subject, message id, payload. Pure."""
    mid = msg_id.encode() if isinstance(msg_id, str) else msg_id
    return EVENT_DOMAIN + _field(subject.encode()) + _field(mid) + payload


def lease_message(holder: str, epoch: int, until: float) -> bytes:
    """What a lease value's signature covers: holder, epoch, and the time it runs out. Pure."""
    return LEASE_DOMAIN + _field(holder.encode()) + struct.pack(">qd", epoch, until)


def snapshot_message(seq: int, data: bytes) -> bytes:
    """What a snapshot's signature covers: its sequence and the digest of its data. Pure."""
    return SNAPSHOT_DOMAIN + struct.pack(">q", seq) + hashlib.sha256(data).digest()


# --------------------------------------------------------------------------- signing


class Signer:
    """Signs as one identity, with the key of that identity's client certificate."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        if cert.public_key() != key.public_key():
            raise ValueError("the signing key does not belong to the certificate: check the files")
        self._key = key
        self.identity = identity_of_cert(cert)
        self.cert_b64 = base64.b64encode(cert.public_bytes(serialization.Encoding.DER)).decode()

    @classmethod
    def from_pem(cls, cert_pem: bytes, key_pem: bytes) -> Signer:
        key = serialization.load_pem_private_key(key_pem, password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError("llmgw keys are EC P-256: this key is of another type")
        return cls(key, x509.load_pem_x509_certificate(cert_pem))

    @classmethod
    def load(cls, cert_file: str | Path, key_file: str | Path) -> Signer:
        """The signer of the client certificate `cert_file` with its key `key_file`."""
        return cls.from_pem(Path(cert_file).read_bytes(), Path(key_file).read_bytes())

    def sign(self, message: bytes) -> str:
        """Base64 DER signature of `message`."""
        return base64.b64encode(self._key.sign(message, _ECDSA)).decode()

    def event_headers(self, subject: str, msg_id: str, payload: bytes) -> dict[str, str]:
        """The headers that authenticate one event."""
        return {
            SIG_HEADER: self.sign(event_message(subject, msg_id, payload)),
            CERT_HEADER: self.cert_b64,
        }


def identity_of_cert(cert: x509.Certificate) -> Identity:
    """The llmgw identity a client certificate names; ValueError if it names none."""
    subject = cert.subject

    def one(oid: x509.ObjectIdentifier) -> str:
        values = subject.get_attributes_for_oid(oid)
        if len(values) != 1:
            raise ValueError(f"the certificate subject {subject.rfc4514_string()} is not llmgw's")
        value = values[0].value
        return value if isinstance(value, str) else value.decode()

    if one(NameOID.ORGANIZATION_NAME) != ORGANIZATION:
        raise ValueError(f"the certificate subject {subject.rfc4514_string()} is not llmgw's")
    return Identity(one(NameOID.ORGANIZATIONAL_UNIT_NAME), one(NameOID.COMMON_NAME))  # type: ignore[arg-type]


# --------------------------------------------------------------------------- verifying


@dataclass(frozen=True)
class _Known:
    identity: Identity
    key: ec.EllipticCurvePublicKey
    not_before: float
    not_after: float


class Verifier:
    """Checks signatures against the fleet's CA.

    `accept_unsigned_before`: events with a stream sequence at or below it that carry no
    signature at all are accepted (a log written before signing existed); 0, the
    default, accepts none. A signed event is always checked, whatever its sequence.
    """

    def __init__(self, ca: x509.Certificate, *, accept_unsigned_before: int = 0) -> None:
        if accept_unsigned_before < 0:
            raise ValueError("accept_unsigned_before is a stream sequence, >= 0")
        self._ca = ca
        self.accept_unsigned_before = accept_unsigned_before
        self._known: dict[bytes, _Known | str] = {}

    @classmethod
    def load(cls, ca_file: str | Path, *, accept_unsigned_before: int = 0) -> Verifier:
        return cls(
            x509.load_pem_x509_certificate(Path(ca_file).read_bytes()),
            accept_unsigned_before=accept_unsigned_before,
        )

    def certificate(self, cert_b64: bytes | str) -> _Known:
        """The checked certificate (cached by its bytes); SignatureRefused if not ours."""
        raw = cert_b64.encode() if isinstance(cert_b64, str) else cert_b64
        known = self._known.get(raw)
        if known is None:
            known = self._check_certificate(raw)
            if len(raw) <= _MAX_CACHED_CERT_BYTES:
                if len(self._known) >= _MAX_CACHED_CERTS:
                    self._known.clear()
                self._known[raw] = known
        if isinstance(known, str):
            raise SignatureRefused(known)
        return known

    def _check_certificate(self, raw: bytes) -> _Known | str:
        try:
            cert = x509.load_der_x509_certificate(base64.b64decode(raw, validate=True))
        except (ValueError, binascii.Error) as exc:
            return f"the certificate does not parse: {exc}"
        try:
            cert.verify_directly_issued_by(self._ca)
        except (ValueError, TypeError, InvalidSignature):
            return f"certificate {cert.subject.rfc4514_string()} was not issued by the fleet's CA"
        try:
            constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
            if constraints.ca:
                return "a CA certificate does not sign llmgw messages"
            usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        except x509.ExtensionNotFound:
            return "the certificate is not an llmgw client certificate (no client usage)"
        if ExtendedKeyUsageOID.CLIENT_AUTH not in usage:
            return "the certificate is not a client certificate (no clientAuth usage)"
        try:
            identity = identity_of_cert(cert)
        except ValueError as exc:
            return str(exc)
        key = cert.public_key()
        if not isinstance(key, ec.EllipticCurvePublicKey):
            return "the certificate's key is not an EC key"
        return _Known(
            identity,
            key,
            cert.not_valid_before_utc.timestamp(),
            cert.not_valid_after_utc.timestamp(),
        )

    def verify(
        self, message: bytes, sig_b64: bytes | str, cert_b64: bytes | str, when: float
    ) -> Identity:
        """The identity that signed `message` at time `when`; SignatureRefused otherwise."""
        known = self.certificate(cert_b64)
        if not known.not_before <= when <= known.not_after:
            raise SignatureRefused(
                f"the certificate of {known.identity} was not valid at {when:.0f} "
                f"(valid {known.not_before:.0f} to {known.not_after:.0f})"
            )
        try:
            known.key.verify(base64.b64decode(sig_b64, validate=True), message, _ECDSA)
        except (InvalidSignature, ValueError, binascii.Error):
            raise SignatureRefused(f"the signature of {known.identity} does not verify") from None
        return known.identity

    def event_refusal(
        self,
        subject: str,
        msg_id: bytes | None,
        payload: bytes,
        sig_b64: bytes | None,
        cert_b64: bytes | None,
        *,
        seq: int,
        when: float,
    ) -> str | None:
        """Why the event stored at `seq` on `subject` must not be trusted, or None."""
        if sig_b64 is None and cert_b64 is None:
            if seq <= self.accept_unsigned_before:
                return None
            return "unsigned (no Llmgw-Sig): not accepted"
        if sig_b64 is None or cert_b64 is None or msg_id is None:
            return "incomplete signature headers (Llmgw-Sig, Llmgw-Cert and Nats-Msg-Id needed)"
        try:
            identity = self.verify(event_message(subject, msg_id, payload), sig_b64, cert_b64, when)
        except SignatureRefused as exc:
            return str(exc)
        if not owner_allows(subject, identity):
            return f"signed by {identity}, who does not own {subject}"
        return None
