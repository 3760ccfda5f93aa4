"""The private certificate authority of an llmgw fleet: it signs the NATS server's certificate
and one client certificate per identity.

Nothing here touches the file system or reads the clock: the current time is an argument and
certificates come back as PEM bytes (`Issued`). `llmgw.pki.store` writes them where
nats-server and the clients find them; `llmgw ctl cert` and the test harness drive both.

Keys are EC P-256: signing and handshakes are fast, and a test session issues a dozen of them
in milliseconds. Client certificates carry only the clientAuth EKU and the server's only
serverAuth, so a stolen node certificate cannot impersonate the server.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmgw.pki.identity import ORGANIZATION, Identity

CA_VALIDITY = dt.timedelta(days=3650)
SERVER_VALIDITY = dt.timedelta(days=825)
CLIENT_VALIDITY = dt.timedelta(days=365)
# Certificates start a little in the past so that a host whose clock lags the CA's by a few
# minutes does not reject a certificate issued just now as "not yet valid".
BACKDATE = dt.timedelta(minutes=5)


# The one subject every cluster route certificate carries (see issue_route).
ROUTE_NAME = "route"
ROUTE_UNIT = "route"
ROUTE_DN = f"CN={ROUTE_NAME},OU={ROUTE_UNIT},O={ORGANIZATION}"


class PkiError(ValueError):
    """A certificate operation that cannot be done; the message says what to do."""


class PkiInputError(PkiError):
    """The operation was asked wrongly (a bad host, a key it would replace without
    --force, no CA where it was told to look): `llmgw ctl cert` exits 2 on these."""


@dataclass(frozen=True)
class Issued:
    """A certificate and its private key, both PEM encoded."""

    cert_pem: bytes
    key_pem: bytes

    @property
    def cert(self) -> x509.Certificate:
        return x509.load_pem_x509_certificate(self.cert_pem)


def new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


MAX_CN = 64
"""The longest CN (RFC 5280's ub-common-name): identities are their certificates' CNs."""
MAX_HOST = 253
"""The longest DNS name, in labels of at most 63 characters (RFC 1035)."""


def subject_name(common_name: str, unit: str, organization: str = ORGANIZATION) -> x509.Name:
    """`CN=<common_name>,OU=<unit>,O=<organization>` in RFC 2253 order.

    The attributes are added most-general first (O, OU, CN) so that the RFC 2253 string
    nats-server builds for `verify_and_map` reads `CN=...,OU=...,O=...`.
    """
    if len(common_name) > MAX_CN:  # cryptography's ValueError otherwise, a traceback
        raise PkiInputError(
            f"{unit} name {common_name[:24]!r}... is {len(common_name)} characters: a"
            f" certificate's name (CN) holds at most {MAX_CN}; use a shorter name"
        )
    return x509.Name(
        [
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
            x509.NameAttribute(NameOID.ORGANIZATIONAL_UNIT_NAME, unit),
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        ]
    )


def identity_name(identity: Identity) -> x509.Name:
    return subject_name(identity.name, identity.kind)


def san_entries(hosts: Iterable[str]) -> list[x509.GeneralName]:
    """Subject alternative names for the hosts clients dial: IP SANs for bare addresses
    (TLS hostname checks never fall back to the CN, and an IP written as a DNS name does
    not match), DNS SANs for names. Duplicates are dropped, order kept."""
    out: list[x509.GeneralName] = []
    seen: set[str] = set()
    for raw in hosts:
        host = raw.strip().strip("[]")
        if not host or host in seen:
            continue
        seen.add(host)
        try:
            out.append(x509.IPAddress(ipaddress.ip_address(host)))
        except ValueError:
            if any(c.isspace() or c in "/:@" for c in host):
                raise PkiInputError(
                    f"{raw!r} is neither an IP address nor a host name: give names such as "
                    "'nats.example.com' or addresses such as '10.0.0.5'"
                ) from None
            if len(host) > MAX_HOST or any(len(label) > 63 for label in host.split(".")):
                raise PkiInputError(
                    f"{host[:24]!r}... is not a host name: a name has at most {MAX_HOST}"
                    " characters, in parts of at most 63 between the dots"
                ) from None
            out.append(x509.DNSName(host.lower()))
    return out


class CertificateAuthority:
    """A CA key and its self-signed certificate, able to issue server and client certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        if cert.public_key() != key.public_key():
            raise PkiError("the CA key does not belong to the CA certificate: check the files")
        self.key = key
        self.cert = cert

    @classmethod
    def create(
        cls,
        *,
        now: dt.datetime,
        name: str = "llmgw CA",
        organization: str = ORGANIZATION,
        validity: dt.timedelta = CA_VALIDITY,
    ) -> CertificateAuthority:
        key = new_key()
        subject = x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, organization),
                x509.NameAttribute(NameOID.COMMON_NAME, name),
            ]
        )
        ski = x509.SubjectKeyIdentifier.from_public_key(key.public_key())
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE)
            .not_valid_after(now + validity)
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(ski, critical=False)
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, cert_pem: bytes, key_pem_bytes: bytes) -> CertificateAuthority:
        try:
            cert = x509.load_pem_x509_certificate(cert_pem)
            key = serialization.load_pem_private_key(key_pem_bytes, password=None)
        except ValueError as exc:
            raise PkiError(f"cannot read the CA certificate or key ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise PkiError(
                "the CA key is not an EC key: recreate the CA with `llmgw ctl cert init`"
            )
        return cls(key, cert)

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def key_pem(self) -> bytes:
        return key_pem(self.key)

    def issue_server(
        self,
        hosts: Iterable[str],
        *,
        now: dt.datetime,
        validity: dt.timedelta = SERVER_VALIDITY,
    ) -> Issued:
        """The NATS server's certificate, valid for every host and IP in `hosts`."""
        sans = san_entries(hosts)
        if not sans:
            raise PkiInputError(
                "the server certificate needs at least one host or IP that clients dial, "
                "e.g. --host 127.0.0.1 --host nats.example.com"
            )
        # The CN only labels a server certificate (clients check the SANs): the first
        # host that fits in one, as a name of 253 characters does not.
        fitting = [str(n.value) for n in sans if len(str(n.value)) <= MAX_CN]
        return self._issue(
            subject_name(fitting[0] if fitting else "nats-server", "server"),
            sans=sans,
            usages=[ExtendedKeyUsageOID.SERVER_AUTH],
            not_before=now - BACKDATE,
            not_after=now + validity,
        )

    def issue_route(
        self,
        hosts: Iterable[str],
        *,
        now: dt.datetime,
        validity: dt.timedelta = SERVER_VALIDITY,
    ) -> Issued:
        """A cluster route certificate: the servers of a NATS cluster dial each other with it,
        so it is both a server and a client certificate. Every route certificate has the
        same subject, `ROUTE_DN`, which the cluster's `verify_and_map` authorization demands:
        a client certificate from the same CA cannot join the cluster as a route."""
        sans = san_entries(hosts)
        if not sans:
            raise PkiInputError(
                "a route certificate needs the host or IP the other servers dial for routes, "
                "e.g. --host 10.0.0.5 --host nats-2.example.com"
            )
        return self._issue(
            subject_name(ROUTE_NAME, ROUTE_UNIT),
            sans=sans,
            usages=[ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
            not_before=now - BACKDATE,
            not_after=now + validity,
        )

    def issue_client(
        self,
        who: Identity | x509.Name,
        *,
        now: dt.datetime,
        validity: dt.timedelta = CLIENT_VALIDITY,
        not_before: dt.datetime | None = None,
    ) -> Issued:
        """A client certificate for `who` (an identity, or any DN for test-only users).

        `not_before` overrides the start of validity; with a negative `validity` it makes
        an already expired certificate, which tests use to show the server refuses it.
        """
        name = identity_name(who) if isinstance(who, Identity) else who
        start = now - BACKDATE if not_before is None else not_before
        return self._issue(
            name,
            sans=[],
            usages=[ExtendedKeyUsageOID.CLIENT_AUTH],
            not_before=start,
            not_after=now + validity,
        )

    def _issue(
        self,
        subject: x509.Name,
        *,
        sans: list[x509.GeneralName],
        usages: list[x509.ObjectIdentifier],
        not_before: dt.datetime,
        not_after: dt.datetime,
    ) -> Issued:
        # A certificate is valid only while its issuer is: one dated past the CA's end
        # would fail then, whatever it says, so it says when it really ends.
        not_after = min(not_after, self.cert.not_valid_after_utc)
        if not_after <= not_before:
            # Allowed only so tests can build expired certificates; keep the order valid.
            not_before = not_after - dt.timedelta(minutes=1)
        key = new_key()
        builder = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(not_before)
            .not_valid_after(not_after)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=True,
                    key_cert_sign=False,
                    crl_sign=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
        )
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Issued(cert.public_bytes(serialization.Encoding.PEM), key_pem(key))
