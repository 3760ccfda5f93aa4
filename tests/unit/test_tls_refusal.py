"""Which connect failures are TLS refusals (llmgw.bus.tlsrefusal), and what `llmgw ctl`
says for each: a server certificate that does not verify is always the server's side,
a certificate alert always this client's, anything else (a reset, a timeout, another TLS
error) none, so it is retried."""

from __future__ import annotations

import ssl

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw import bus
from llmgw.bus import tlsrefusal
from llmgw.ctl import session
from llmgw.ctl.settings import CtlConfig
from llmgw.pki.identity import Identity

SERVER_SIDE = {"server_untrusted", "server_name", "server_dates", "server_other"}


def verify_failure(code: int, message: str) -> ssl.SSLCertVerificationError:
    exc = ssl.SSLCertVerificationError(1, f"certificate verify failed: {message}")
    exc.verify_code = code
    exc.verify_message = message
    return exc


def alert(reason: str) -> ssl.SSLError:
    exc = ssl.SSLError(1, f"[SSL: {reason}]")
    exc.reason = reason
    return exc


@given(code=st.integers(min_value=0, max_value=200), message=st.text(max_size=40))
def test_a_server_certificate_that_does_not_verify_is_always_the_servers_side(
    code: int, message: str
) -> None:
    refused = tlsrefusal.refusal(verify_failure(code, message))
    assert refused is not None
    assert refused.kind in SERVER_SIDE
    assert refused.problem.startswith("the server's certificate")


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (20, "server_untrusted"),  # unable to get local issuer certificate: another CA
        (19, "server_untrusted"),  # self-signed certificate in the chain
        (62, "server_name"),  # the name dialled is not in it
        (64, "server_name"),  # nor the address
        (10, "server_dates"),  # expired
        (9, "server_dates"),  # not yet valid
        (24, "server_other"),  # invalid CA certificate
    ],
)
def test_what_a_verify_code_says(code: int, kind: str) -> None:
    refused = tlsrefusal.refusal(verify_failure(code, "openssl's words"))
    assert refused == tlsrefusal.Refusal(kind, "openssl's words")  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "reason",
    ["TLSV1_ALERT_UNKNOWN_CA", "SSLV3_ALERT_BAD_CERTIFICATE", "TLSV13_ALERT_CERTIFICATE_REQUIRED"],
)
def test_a_certificate_alert_is_this_clients_certificate_refused(reason: str) -> None:
    assert tlsrefusal.refusal(alert(reason)) == tlsrefusal.Refusal("client_refused", reason)


@given(
    exc=st.one_of(
        st.builds(alert, st.sampled_from(["WRONG_VERSION_NUMBER", "UNEXPECTED_EOF_WHILE_READING"])),
        st.builds(ConnectionResetError, st.just("Connection lost")),
        st.builds(ssl.SSLError, st.integers(0, 9), st.text(max_size=20)),
        st.builds(TimeoutError),
        st.builds(OSError, st.integers(0, 200), st.text(max_size=20)),
        st.builds(ValueError, st.text(max_size=20)),
    )
)
def test_anything_else_is_no_refusal(exc: Exception) -> None:
    assert tlsrefusal.refusal(exc) is None


CFG = CtlConfig(
    servers=("tls://10.0.0.1:4222",), ca_file="/etc/llmgw/ca.pem", cert_file="/home/a/alice.pem"
)
ALICE = Identity("operator", "alice")


@pytest.mark.parametrize(
    ("kind", "says", "to_do"),
    [
        ("server_untrusted", "is not signed by the CA in /etc/llmgw/ca.pem", "with --ca"),
        ("server_name", "does not list the name or address dialled", "--server"),
        ("server_dates", "is not valid now", "llmgw ctl cert server"),
        ("server_other", "does not verify with /etc/llmgw/ca.pem", "with --ca"),
        ("client_refused", "refused this identity's certificate, /home/a/alice.pem", "--cert"),
    ],
)
def test_ctl_names_the_server_the_file_and_what_to_pass(kind: str, says: str, to_do: str) -> None:
    refused = bus.Refusal(kind, "why")  # type: ignore[arg-type]
    text = session._refusal(CFG, ALICE, "tls://10.0.0.1:4222", refused)
    assert "tls://10.0.0.1:4222" in text
    assert says in text
    assert to_do in text
    assert "(why)" in text


def test_a_refusal_met_on_the_last_try_is_said_the_same_way() -> None:
    """Where the refusal ends the tries rather than the first one (nats-py's stock client,
    outside the versions llmgw's overrides know), ctl says the same."""
    text = session._connect_failure(CFG, ALICE, verify_failure(20, "unable to get issuer"))
    assert "the server's certificate at tls://10.0.0.1:4222 is not signed by the CA in" in text
    assert text.endswith("pass the fleet's CA with --ca")


@pytest.mark.parametrize("exc", [OSError("no servers available for connection"), TimeoutError()])
def test_a_failure_to_connect_quotes_no_password_of_a_server_url(exc: Exception) -> None:
    # An error reaches terminals and the logs of scripts that run ctl.
    cfg = CtlConfig(servers=("tls://ops:hunter2@10.0.0.1:4222", "tls://10.0.0.2:4222"))
    text = session._connect_failure(cfg, ALICE, exc)
    assert "hunter2" not in text
    assert "tls://ops:***@10.0.0.1:4222" in text
    assert "tls://10.0.0.2:4222" in text
