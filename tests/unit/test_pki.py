"""The private CA and its files: SANs, key usages, validity, key modes, refusal to overwrite."""

from __future__ import annotations

import datetime as dt
import ipaddress
import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.pki.ca import CertificateAuthority, Issued, PkiError, san_entries
from llmgw.pki.identity import Identity
from llmgw.pki.store import CertDir, KeyExistsError

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.create(now=NOW)


def eku(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def test_ca_is_a_ca_that_signs_only_certificates(ca: CertificateAuthority) -> None:
    bc = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical
    assert bc.value.ca
    usage = ca.cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign
    assert usage.crl_sign
    assert ca.cert.not_valid_after_utc - NOW >= dt.timedelta(days=3650)


def test_server_certificate_lists_ips_as_ip_sans_and_names_as_dns(
    ca: CertificateAuthority,
) -> None:
    issued = ca.issue_server(
        ["127.0.0.1", "::1", "localhost", "NATS.example.com", "10.0.0.5", "[fd00::1]"], now=NOW
    )
    cert = issued.cert
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    ips = sans.get_values_for_type(x509.IPAddress)
    dns = sans.get_values_for_type(x509.DNSName)
    assert ips == [
        ipaddress.ip_address("127.0.0.1"),
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("10.0.0.5"),
        ipaddress.ip_address("fd00::1"),
    ]
    # An address written as a DNS name would never match: hostname checks compare IPs
    # against IP SANs only.
    assert dns == ["localhost", "nats.example.com"]
    assert eku(cert) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    cert.verify_directly_issued_by(ca.cert)


def test_server_certificate_needs_a_host(ca: CertificateAuthority) -> None:
    with pytest.raises(PkiError, match="at least one host"):
        ca.issue_server([], now=NOW)


@pytest.mark.parametrize("bad", ["nats example.com", "http://nats", "user@host", "a/b"])
def test_a_host_that_is_neither_name_nor_address_is_refused(bad: str) -> None:
    with pytest.raises(PkiError, match="neither an IP address nor a host name"):
        san_entries([bad])


def test_san_entries_drop_duplicates_and_blanks() -> None:
    assert len(san_entries(["127.0.0.1", " 127.0.0.1 ", "", "localhost", "localhost"])) == 2


def test_client_certificate_names_the_identity_for_verify_and_map(
    ca: CertificateAuthority,
) -> None:
    identity = Identity("node", "gpu-07")
    cert = ca.issue_client(identity, now=NOW).cert
    # nats-server maps the RFC 2253 form of the subject to the configured user.
    assert cert.subject.rfc4514_string() == identity.dn == "CN=gpu-07,OU=node,O=llmgw"
    assert cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value == "gpu-07"
    assert eku(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert not cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert cert.not_valid_after_utc - NOW == dt.timedelta(days=365)
    # Backdated a little, so a host whose clock lags accepts it at once.
    assert dt.timedelta(0) < NOW - cert.not_valid_before_utc <= dt.timedelta(minutes=10)
    assert cert.issuer == ca.cert.subject
    cert.verify_directly_issued_by(ca.cert)


def test_an_expired_certificate_can_be_made_for_tests(ca: CertificateAuthority) -> None:
    cert = ca.issue_client(
        Identity("node", "old"),
        now=NOW,
        validity=dt.timedelta(days=-1),
        not_before=NOW - dt.timedelta(days=30),
    ).cert
    assert cert.not_valid_after_utc < NOW
    assert cert.not_valid_before_utc < cert.not_valid_after_utc


def test_no_certificate_outlives_the_ca_that_signs_it() -> None:
    # A client certificate of a year from a CA with a month left said it was valid for a
    # year; every server refuses it once the CA has expired.
    short = CertificateAuthority.create(now=NOW, validity=dt.timedelta(days=30))
    ca_end = short.cert.not_valid_after_utc
    client = short.issue_client(Identity("node", "n1"), now=NOW).cert
    server = short.issue_server(["127.0.0.1"], now=NOW).cert
    assert client.not_valid_after_utc == ca_end
    assert server.not_valid_after_utc == ca_end
    brief = short.issue_client(Identity("node", "n2"), now=NOW, validity=dt.timedelta(days=1))
    assert brief.cert.not_valid_after_utc == NOW + dt.timedelta(days=1)


def test_keys_are_ec_p256_and_match_their_certificates(ca: CertificateAuthority) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    issued = ca.issue_client(Identity("router", "r1"), now=NOW)
    key = serialization.load_pem_private_key(issued.key_pem, password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"
    assert key.public_key() == issued.cert.public_key()


def test_ca_round_trips_through_pem_and_refuses_a_foreign_key(ca: CertificateAuthority) -> None:
    again = CertificateAuthority.load(ca.cert_pem, ca.key_pem)
    assert again.cert == ca.cert
    other = CertificateAuthority.create(now=NOW)
    with pytest.raises(PkiError, match="does not belong"):
        CertificateAuthority.load(ca.cert_pem, other.key_pem)
    with pytest.raises(PkiError, match="cannot read"):
        CertificateAuthority.load(b"not a certificate", ca.key_pem)


# -- files ----------------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_keys_are_written_0600_and_certificates_0644(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    certs = CertDir(tmp_path / "certs")
    certs.save_ca(ca)
    certs.save_server(ca.issue_server(["127.0.0.1"], now=NOW))
    identity = Identity("control", "control-1")
    certs.save_client(identity, ca.issue_client(identity, now=NOW))
    for key in (certs.ca_key, certs.server_key, certs.key(identity)):
        assert mode(key) == 0o600, key
    for cert in (certs.ca_cert, certs.server_cert, certs.cert(identity)):
        assert mode(cert) == 0o644, cert
    assert certs.load_ca().cert == ca.cert


def test_an_existing_key_is_never_overwritten_without_force(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    certs = CertDir(tmp_path)
    identity = Identity("node", "gpu-1")
    first = ca.issue_client(identity, now=NOW)
    certs.save_client(identity, first)
    second = ca.issue_client(identity, now=NOW)
    with pytest.raises(KeyExistsError, match="--force"):
        certs.save_client(identity, second)
    assert certs.key(identity).read_bytes() == first.key_pem
    assert certs.cert(identity).read_bytes() == first.cert_pem

    certs.save_client(identity, second, force=True)
    assert certs.key(identity).read_bytes() == second.key_pem
    assert certs.cert(identity).read_bytes() == second.cert_pem
    assert mode(certs.key(identity)) == 0o600
    # No temporary files left behind by the atomic replace.
    assert sorted(p.name for p in certs.key(identity).parent.iterdir()) == [
        "gpu-1-key.pem",
        "gpu-1.pem",
    ]


def test_the_ca_is_not_replaced_without_force(ca: CertificateAuthority, tmp_path: Path) -> None:
    certs = CertDir(tmp_path)
    certs.save_ca(ca)
    with pytest.raises(KeyExistsError):
        certs.save_ca(CertificateAuthority.create(now=NOW))
    assert certs.load_ca().cert == ca.cert


def test_a_missing_ca_says_to_run_init(tmp_path: Path) -> None:
    with pytest.raises(PkiError, match="llmgw ctl cert init"):
        CertDir(tmp_path).load_ca()


def test_identities_are_the_client_certificates_present(
    ca: CertificateAuthority, tmp_path: Path
) -> None:
    certs = CertDir(tmp_path)
    for identity in (Identity("node", "b"), Identity("node", "a"), Identity("router", "r")):
        certs.save_client(identity, ca.issue_client(identity, now=NOW))
    (tmp_path / "node" / "not a.name.pem").write_text("junk")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "x.pem").write_text("junk")
    assert certs.identities() == [
        Identity("node", "a"),
        Identity("node", "b"),
        Identity("router", "r"),
    ]


def test_issued_is_plain_pem(ca: CertificateAuthority) -> None:
    issued = ca.issue_client(Identity("operator", "alice"), now=NOW)
    assert isinstance(issued, Issued)
    assert issued.cert_pem.startswith(b"-----BEGIN CERTIFICATE-----")
    assert issued.key_pem.startswith(b"-----BEGIN PRIVATE KEY-----")


def test_route_certificates_serve_and_dial_under_one_subject(ca: CertificateAuthority) -> None:
    from llmgw.pki.ca import ROUTE_DN

    a = ca.issue_route(["10.0.0.1", "nats-1.example.com"], now=NOW).cert
    b = ca.issue_route(["10.0.0.2"], now=NOW).cert
    # Servers dial each other with it: both usages. One subject for all, so the cluster's
    # verify_and_map can demand exactly it (a client certificate never matches).
    assert eku(a) == [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    assert a.subject.rfc4514_string() == b.subject.rfc4514_string() == ROUTE_DN
    sans = a.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["nats-1.example.com"]
    with pytest.raises(PkiError, match="route certificate needs"):
        ca.issue_route([], now=NOW)
