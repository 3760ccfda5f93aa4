"""What the fleet's CA issues (llmgw.pki.ca): a CA that may sign leaves only, and leaves
that may never act as a CA, valid from a little before they were made (clocks differ)
for their span. An attacker holding a leaf key must not be able to mint
certificates the fleet's servers would accept."""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509

from llmgw.pki.ca import (
    BACKDATE,
    CLIENT_VALIDITY,
    SERVER_VALIDITY,
    CertificateAuthority,
)
from llmgw.pki.identity import Identity

NOW = dt.datetime(2026, 11, 29, 12, 0, tzinfo=dt.UTC)


@pytest.fixture(scope="module")
def ca() -> CertificateAuthority:
    return CertificateAuthority.create(now=NOW)


def test_the_ca_may_sign_leaves_but_no_intermediate_ca(ca: CertificateAuthority) -> None:
    bc = ca.cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    assert bc.path_length == 0


def _leaves(ca: CertificateAuthority) -> dict[str, x509.Certificate]:
    issued = {
        "server": ca.issue_server(["127.0.0.1"], now=NOW),
        "route": ca.issue_route(["127.0.0.1"], now=NOW),
        "client": ca.issue_client(Identity("operator", "alice"), now=NOW),
    }
    return {k: x509.load_pem_x509_certificate(v.cert_pem) for k, v in issued.items()}


def test_no_leaf_may_sign_certificates_or_revocation_lists(ca: CertificateAuthority) -> None:
    for kind, cert in _leaves(ca).items():
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
        assert bc.critical, kind
        assert not bc.value.ca, kind
        usage = cert.extensions.get_extension_for_class(x509.KeyUsage)
        assert usage.critical, kind
        assert not usage.value.key_cert_sign, kind
        assert not usage.value.crl_sign, kind
        assert usage.value.digital_signature, kind


def test_leaves_are_valid_from_a_little_before_now_for_their_span(
    ca: CertificateAuthority,
) -> None:
    leaves = _leaves(ca)
    spans = {"server": SERVER_VALIDITY, "route": SERVER_VALIDITY, "client": CLIENT_VALIDITY}
    for kind, cert in leaves.items():
        assert cert.not_valid_before_utc == NOW - BACKDATE, kind
        assert cert.not_valid_after_utc == NOW + spans[kind], kind
    assert dt.timedelta(days=825) == SERVER_VALIDITY  # what browsers and TLS stacks accept
    assert dt.timedelta(days=365) == CLIENT_VALIDITY
