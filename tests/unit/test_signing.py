"""Signatures on events, the lease and snapshots (llmgw.pki.signing), without a server.

The property at the heart of it: for any event, any signing identity and any subject,
a reader accepts the message exactly when the signer owns the subject and the bytes
are the ones signed. Ownership is stated here independently of `owner_allows` (each
generated subject comes with the identities that own it), so the test checks the rule
rather than restating it.
"""

from __future__ import annotations

import base64
import datetime as dt
import time

import msgspec
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus import headers, lease, reader, snapshots
from llmgw.core import events
from llmgw.pki import signing
from llmgw.pki.ca import CertificateAuthority, identity_name
from llmgw.pki.identity import Identity

NOW = dt.datetime.now(dt.UTC)
CA = CertificateAuthority.create(now=NOW, name="unit CA")
OTHER_CA = CertificateAuthority.create(now=NOW, name="someone else's CA")
VERIFIER = signing.Verifier(CA.cert)

NAMES = ("a", "b", "control")
IDENTITIES = [
    Identity(kind, name)  # type: ignore[arg-type]
    for kind in ("node", "router", "operator", "control")
    for name in NAMES
]


def signer_for(identity: Identity, ca: CertificateAuthority = CA) -> signing.Signer:
    issued = ca.issue_client(identity, now=NOW)
    return signing.Signer.from_pem(issued.cert_pem, issued.key_pem)


SIGNERS = {identity: signer_for(identity) for identity in IDENTITIES}
ANY_CONTROL = frozenset(i for i in IDENTITIES if i.kind == "control")


def sample_events() -> list[events.Event]:
    return [
        events.Heartbeat(id="hb-1", ts=1.0, node="a", seq=1),
        events.ShardStatus(
            id="st-1", ts=2.0, node="a", replica_id="r1", generation=1, phase="serving"
        ),
        events.ReplicaRetired(id="rt-1", ts=3.0, replica_id="r1"),
        events.NodeCordoned(id="co-1", ts=4.0, operator="a", node="b"),
    ]


def subjects_and_owners() -> st.SearchStrategy[tuple[str, frozenset[Identity]]]:
    name = st.sampled_from(NAMES)
    kind = st.sampled_from(("heartbeat", "shard", "registered", "model_declared"))

    def node(n: str, k: str) -> tuple[str, frozenset[Identity]]:
        return f"llmgw.events.node.{n}.{k}", frozenset({Identity("node", n)})

    def operator(n: str, k: str) -> tuple[str, frozenset[Identity]]:
        return f"llmgw.events.operator.{n}.{k}", frozenset({Identity("operator", n)})

    def config_models(n: str, k: str) -> tuple[str, frozenset[Identity]]:
        return f"llmgw.events.operator.control.{n}.{k}", frozenset({Identity("control", n)})

    def legacy_operator(k: str) -> tuple[str, frozenset[Identity]]:
        owners = frozenset(i for i in IDENTITIES if i.kind in ("operator", "control"))
        return f"llmgw.events.operator.{k}", owners

    def own_kv_blocks(n: str) -> tuple[str, frozenset[Identity]]:
        return f"llmgw.kv.{n}.engine-1", frozenset({Identity("node", n)})

    def own_load_reports(kind: str, n: str) -> tuple[str, frozenset[Identity]]:
        worker = ".w0" if kind == "router" else ""
        return f"llmgw.signals.{kind}.{n}{worker}", frozenset({Identity(kind, n)})  # type: ignore[arg-type]

    def nobody(tail: str) -> tuple[str, frozenset[Identity]]:
        return tail, frozenset()

    return st.one_of(
        st.builds(node, name, kind),
        kind.map(lambda k: (f"llmgw.events.control.{k}", ANY_CONTROL)),
        name.map(lambda n: (f"llmgw.cmd.{n}", ANY_CONTROL)),
        st.builds(own_kv_blocks, name),
        st.builds(own_load_reports, st.sampled_from(("node", "router")), name),
        st.builds(operator, name, kind),
        st.builds(config_models, name, kind),
        kind.map(legacy_operator),
        st.sampled_from(
            (
                "llmgw.events.router.a.x",
                "llmgw.events.node.a",
                "llmgw.events.node.a.b.c",
                "llmgw.cmd.a.b",
                "llmgw.events.control",
                "llmgw.events.operator.a.b.c.d",
                "other.events.node.a.heartbeat",
                "llmgw..node.a.heartbeat",
                "llmgw.events.control.",
                "llmgw.cmd.",
                "llmgw.kv.a.",
                "llmgw.signals.node.",
            )
        ).map(nobody),
    )


def refusal(
    subject: str, msg_id: bytes, payload: bytes, sig: bytes, cert: bytes, seq: int = 7
) -> str | None:
    return VERIFIER.event_refusal(
        subject, msg_id, payload, sig, cert, seq=seq, when=NOW.timestamp()
    )


def flip(data: bytes, at: int) -> bytes:
    i = at % len(data)
    return data[:i] + bytes([data[i] ^ 0x01]) + data[i + 1 :]


@settings(max_examples=300, deadline=None)
@given(
    event=st.sampled_from(sample_events()),
    signer_identity=st.sampled_from(IDENTITIES),
    target=subjects_and_owners(),
    tamper=st.sampled_from(("none", "payload", "subject", "id", "signature")),
    at=st.integers(0, 10_000),
)
def test_accepted_exactly_when_the_signer_owns_the_subject_and_the_bytes_are_signed(
    event: events.Event,
    signer_identity: Identity,
    target: tuple[str, frozenset[Identity]],
    tamper: str,
    at: int,
) -> None:
    subject, owners = target
    signer = SIGNERS[signer_identity]
    payload = events.encode(event)
    headers = signer.event_headers(subject, event.id, payload)
    sig, cert = headers[signing.SIG_HEADER].encode(), headers[signing.CERT_HEADER].encode()
    msg_id = event.id.encode()
    assert signing.owner_allows(subject, signer_identity) == (signer_identity in owners)
    if tamper == "payload":
        payload = flip(payload, at)
    elif tamper == "subject":
        subject = flip(subject.encode(), at).decode(errors="replace")
    elif tamper == "id":
        msg_id = flip(msg_id, at)
    elif tamper == "signature":
        raw = base64.b64decode(sig)
        sig = base64.b64encode(flip(raw, at))
    verdict = refusal(subject, msg_id, payload, sig, cert)
    if tamper == "none" and signer_identity in owners:
        assert verdict is None
    else:
        assert verdict is not None


def test_ownership_rule() -> None:
    node_a, control_x, alice = (
        Identity("node", "a"),
        Identity("control", "x"),
        Identity("operator", "alice"),
    )
    assert signing.owner_allows("llmgw.events.node.a.heartbeat", node_a)
    assert not signing.owner_allows("llmgw.events.node.b.heartbeat", node_a)
    assert not signing.owner_allows("llmgw.cmd.a", node_a)
    assert signing.owner_allows("llmgw.cmd.a", control_x)
    assert signing.owner_allows("llmgw.events.control.replica_placed", control_x)
    assert not signing.owner_allows("llmgw.events.control.replica_placed", alice)
    assert signing.owner_allows("llmgw.events.operator.alice.node_cordoned", alice)
    assert not signing.owner_allows("llmgw.events.operator.bob.node_cordoned", alice)
    assert signing.owner_allows("llmgw.events.operator.control.x.model_declared", control_x)
    assert not signing.owner_allows("llmgw.events.operator.control.y.model_declared", control_x)
    assert signing.owner_allows("llmgw.events.operator.model_declared", alice)
    assert signing.owner_allows("llmgw.events.operator.model_declared", control_x)
    assert not signing.owner_allows("llmgw.events.operator.model_declared", node_a)
    assert not signing.owner_allows("llmgw.events.node.a.heartbeat", Identity("router", "a"))


def signed_parts(
    signer: signing.Signer, subject: str = "llmgw.events.node.a.heartbeat"
) -> tuple[str, bytes, bytes, bytes, bytes]:
    event = events.Heartbeat(id="hb-9", ts=1.0, node="a", seq=9)
    payload = events.encode(event)
    headers = signer.event_headers(subject, event.id, payload)
    return (
        subject,
        event.id.encode(),
        payload,
        headers[signing.SIG_HEADER].encode(),
        headers[signing.CERT_HEADER].encode(),
    )


def test_a_certificate_of_another_ca_is_refused() -> None:
    stranger = signer_for(Identity("node", "a"), OTHER_CA)
    verdict = refusal(*signed_parts(stranger))
    assert verdict is not None
    assert "not issued by the fleet's CA" in verdict


def test_the_server_certificate_does_not_sign_events() -> None:
    issued = CA.issue_server(["127.0.0.1"], now=NOW)
    cert = base64.b64encode(issued.cert.public_bytes(serialization.Encoding.DER))
    subject, msg_id, payload, sig, _ = signed_parts(SIGNERS[Identity("node", "a")])
    verdict = refusal(subject, msg_id, payload, sig, cert)
    assert verdict is not None


def test_a_message_outside_its_certificates_validity_is_refused() -> None:
    subject, msg_id, payload, sig, cert = signed_parts(SIGNERS[Identity("node", "a")])
    later = NOW.timestamp() + 400 * 86400  # client certificates last 365 days
    earlier = NOW.timestamp() - 86400  # stored before the certificate was issued
    for when in (later, earlier):
        verdict = VERIFIER.event_refusal(subject, msg_id, payload, sig, cert, seq=1, when=when)
        assert verdict is not None
        assert "not valid at" in verdict


def issued_by_the_fleet_ca(
    identity: Identity, *, ca: bool, usages: list[x509.ObjectIdentifier]
) -> signing.Signer:
    """A signer whose certificate the fleet's CA signed, names an llmgw identity and is
    otherwise as given: what `llmgw ctl cert` never issues, but a stolen CA key could."""
    key = ec.generate_private_key(ec.SECP256R1())
    cert = (
        x509.CertificateBuilder()
        .subject_name(identity_name(identity))
        .issuer_name(CA.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(hours=1))
        .not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .sign(CA.key, hashes.SHA256())
    )
    return signing.Signer(key, cert)


def test_only_a_client_certificate_that_is_no_ca_signs_events() -> None:
    node_a = Identity("node", "a")
    client = [ExtendedKeyUsageOID.CLIENT_AUTH]
    a_ca = issued_by_the_fleet_ca(node_a, ca=True, usages=client)
    verdict = refusal(*signed_parts(a_ca))
    assert verdict is not None
    assert "a CA certificate does not sign" in verdict
    a_server = issued_by_the_fleet_ca(node_a, ca=False, usages=[ExtendedKeyUsageOID.SERVER_AUTH])
    verdict = refusal(*signed_parts(a_server))
    assert verdict is not None
    assert "no clientAuth usage" in verdict
    # The same certificate as a client's signs.
    assert refusal(*signed_parts(issued_by_the_fleet_ca(node_a, ca=False, usages=client))) is None


def test_a_signing_key_of_another_certificate_is_refused_naming_the_files() -> None:
    a, b = (
        CA.issue_client(Identity("node", "a"), now=NOW),
        CA.issue_client(Identity("node", "b"), now=NOW),
    )
    with pytest.raises(ValueError, match="does not belong to the certificate"):
        signing.Signer.from_pem(a.cert_pem, b.key_pem)


def test_unsigned_events_are_accepted_only_up_to_the_cut_over() -> None:
    payload = events.encode(events.Heartbeat(id="hb-1", ts=1.0, node="a", seq=1))
    subject = "llmgw.events.node.a.heartbeat"
    legacy = signing.Verifier(CA.cert, accept_unsigned_before=100)
    assert legacy.event_refusal(subject, b"hb-1", payload, None, None, seq=100, when=1.0) is None
    assert legacy.event_refusal(subject, b"hb-1", payload, None, None, seq=101, when=1.0)
    assert VERIFIER.event_refusal(subject, b"hb-1", payload, None, None, seq=1, when=1.0)
    # A signature that is there is checked whatever the sequence.
    parts = signed_parts(SIGNERS[Identity("node", "b")])
    assert legacy.event_refusal(*parts, seq=1, when=NOW.timestamp())


def test_lease_and_snapshot_signatures_bind_what_they_cover() -> None:
    control = SIGNERS[Identity("control", "a")]
    sig = control.sign(signing.lease_message("a", 41, 1e9))
    assert VERIFIER.verify(signing.lease_message("a", 41, 1e9), sig, control.cert_b64, time.time())
    with pytest.raises(signing.SignatureRefused):
        VERIFIER.verify(signing.lease_message("a", 42, 1e9), sig, control.cert_b64, time.time())
    snap = control.sign(signing.snapshot_message(10, b"state"))
    with pytest.raises(signing.SignatureRefused):
        VERIFIER.verify(signing.snapshot_message(10, b"stat3"), snap, control.cert_b64, time.time())
    with pytest.raises(signing.SignatureRefused):
        VERIFIER.verify(signing.snapshot_message(11, b"state"), snap, control.cert_b64, time.time())


# --------------------------------------------------------------------------- reader intake


class _NoClient:
    """Stands in for the connection: intake tests never touch the network."""


def ack(seq: int, cseq: int, pending: int) -> bytes:
    ts = int(NOW.timestamp() * 1e9)
    return f"$JS.ACK.llmgw-events.reader-x.1.{seq}.{cseq}.{ts}.{pending}".encode()


def block(fields: dict[str, str]) -> bytes:
    return headers.header_block(fields)


async def test_intake_folds_signed_events_and_refuses_the_rest_with_their_sequence() -> None:
    r = reader.Reader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    r._outstanding = 10
    node_a, node_b = SIGNERS[Identity("node", "a")], SIGNERS[Identity("node", "b")]
    subject = "llmgw.events.node.a.heartbeat"
    event = events.Heartbeat(id="hb-1", ts=1.0, node="a", seq=1)
    payload = events.encode(event)
    good = {
        "Nats-Msg-Id": "hb-1",
        "Nats-TTL": "60s",
        **node_a.event_headers(subject, "hb-1", payload),
    }
    wrong = {"Nats-Msg-Id": "hb-1", **node_b.event_headers(subject, "hb-1", payload)}
    twice = block(good)[:-2] + f"{signing.SIG_HEADER}: {good[signing.SIG_HEADER]}\r\n\r\n".encode()
    r._on_raw(subject.encode(), ack(1, 1, 4), payload, block(good))
    r._on_raw(subject.encode(), ack(2, 2, 3), payload, block(wrong))
    r._on_raw(subject.encode(), ack(3, 3, 2), payload, b"")
    r._on_raw(subject.encode(), ack(4, 4, 1), payload, twice)
    r._on_raw(subject.encode(), ack(5, 5, 0), payload + b" ", block(good))
    assert [rec.seq for rec in r._buf] == [1]
    assert [s.seq for s in r.skipped] == [2, 3, 4, 5]
    assert r.refused == r.undecodable == 4
    assert "node/b, who does not own" in r.skipped[0].error
    assert r.caught_up.is_set()


def test_a_reader_without_a_verifier_cannot_be_made() -> None:
    with pytest.raises(reader.ReaderError, match="Verifier"):
        reader.Reader(_NoClient())  # type: ignore[arg-type]


def test_verification_costs_one_ecdsa_check_per_event() -> None:
    # Not a benchmark: a guard that certificates are cached (parsing and chain checks
    # per event would cost about ten times more).
    signer = SIGNERS[Identity("node", "a")]
    parts = signed_parts(signer)
    VERIFIER.event_refusal(*parts, seq=1, when=NOW.timestamp())
    started = time.process_time()
    for _ in range(200):
        assert VERIFIER.event_refusal(*parts, seq=1, when=NOW.timestamp()) is None
    assert (time.process_time() - started) / 200 < 0.002


def test_signature_headers_parse() -> None:
    raw = b"NATS/1.0\r\nNats-Msg-Id: x\r\nLlmgw-Sig: s\r\nLlmgw-Cert: c\r\nNats-TTL: 5s\r\n\r\n"
    assert headers.message_headers(raw) == (b"x", b"s", b"c", b"5s")
    # The server reads `Nats-TTL` as written: `nats-ttl` is no TTL (the message stays).
    assert headers.message_headers(b"NATS/1.0\r\nnats-ttl: 1s\r\n\r\n") == (None,) * 4
    assert headers.message_headers(b"NATS/1.0\r\n Nats-TTL : 1s\r\n\r\n") == (None,) * 3 + (b"1s",)
    assert headers.message_headers(b"") == (None, None, None, None)
    assert headers.message_headers(raw + b"Nats-Msg-Id: y\r\n") is None


# --------------------------------------------------------------------------- lease, snapshots


def lease_value(signer: signing.Signer, holder: str, epoch: int, until: float) -> bytes:
    sig = signer.sign(signing.lease_message(holder, epoch, until))
    return msgspec.json.encode(
        {"holder": holder, "epoch": epoch, "until": until, "sig": sig, "cert": signer.cert_b64}
    )


def test_a_lease_value_counts_only_signed_by_its_holder_and_until_it_runs_out() -> None:
    now = time.time()
    control_a = SIGNERS[Identity("control", "a")]
    good = lease.verified_value(VERIFIER, lease_value(control_a, "a", 7, now + 3), now, 3.0)
    assert not isinstance(good, str)
    assert (good.holder, good.epoch) == ("a", 7)
    # Another control plane's signature naming "a", a node's, none, garbage, a stale one.
    by_b = lease_value(SIGNERS[Identity("control", "b")], "a", 7, now + 3)
    by_node = lease_value(SIGNERS[Identity("node", "a")], "a", 7, now + 3)
    unsigned = msgspec.json.encode({"holder": "a", "epoch": 7})
    stale = lease_value(control_a, "a", 7, now - 10)
    for raw in (by_b, by_node, unsigned, b"\xff", stale):
        assert isinstance(lease.verified_value(VERIFIER, raw, now, 3.0), str)
    # Changing the epoch or the time under a genuine signature breaks it.
    tampered = msgspec.json.decode(lease_value(control_a, "a", 7, now + 3))
    tampered["epoch"] = 8
    assert isinstance(lease.verified_value(VERIFIER, msgspec.json.encode(tampered), now, 3.0), str)


def test_a_snapshot_opens_only_under_a_control_seal_for_its_own_sequence() -> None:
    now = time.time()
    control_a = SIGNERS[Identity("control", "a")]
    sealed = snapshots.seal(control_a, 10, b"state bytes")
    assert snapshots.unseal(VERIFIER, 10, sealed, now) == b"state bytes"
    refused = [
        (11, sealed),  # moved to another sequence's name
        (10, sealed[:-1] + b"!"),  # data altered
        (10, b"state bytes"),  # unsigned (saved before signing)
        (10, snapshots.seal(SIGNERS[Identity("operator", "a")], 10, b"state bytes")),
        (10, snapshots.seal(signer_for(Identity("control", "a"), OTHER_CA), 10, b"state bytes")),
    ]
    for seq, raw in refused:
        with pytest.raises(signing.SignatureRefused):
            snapshots.unseal(VERIFIER, seq, raw, now)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**40))
def test_unsealing_any_bytes_refuses_or_opens_never_crashes(raw: bytes, seq: int) -> None:
    prefixed = b"llmgw-snapshot-signed/v1\n" + raw
    for candidate in (raw, prefixed):
        with pytest.raises(signing.SignatureRefused):
            snapshots.unseal(VERIFIER, seq, candidate, time.time())


async def test_a_connection_signs_only_as_the_identity_it_connects_as() -> None:
    from llmgw import bus

    keys = bus.Keys(SIGNERS[Identity("node", "a")], VERIFIER)
    with pytest.raises(ValueError, match="node/a's, not node/b's"):
        await bus.connect(
            "tls://127.0.0.1:1", tls=None, identity=Identity("node", "b"), name="x", keys=keys
        )
