"""TLS failures no retry mends: the NATS server's certificate does not verify with the CA
this client trusts, or the server refused this client's certificate.

Either stays so until someone changes a certificate or a setting, so `llmgw ctl` stops
at the first one and says which (llmgw.ctl.session), while the services keep retrying
(the server may come back with a certificate of their CA) and log each as `tls_refused`
with what to change (llmgw.bus.connection). Pure: `refusal` only reads the exception.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from typing import Literal

Kind = Literal["server_untrusted", "server_name", "server_dates", "server_other", "client_refused"]

# OpenSSL's X509_V_ERR_* codes (ssl.SSLCertVerificationError.verify_code).
_NOT_SIGNED_BY_THE_CA = frozenset({2, 7, 18, 19, 20, 21})
"""Unable to get the issuer (locally or at all), a bad signature, self-signed (alone or in
the chain), unable to verify the first certificate: no chain to a CA this client trusts."""
_DATES = frozenset({9, 10})
"""Not yet valid, expired."""
_NAME = frozenset({62, 64})
"""The host name, the IP address, that was dialled is not in the certificate."""

_CERTIFICATE_ALERTS = frozenset(
    {
        "TLSV1_ALERT_UNKNOWN_CA",
        "TLSV1_ALERT_ACCESS_DENIED",
        "TLSV13_ALERT_CERTIFICATE_REQUIRED",
        "SSLV3_ALERT_BAD_CERTIFICATE",
        "SSLV3_ALERT_UNSUPPORTED_CERTIFICATE",
        "SSLV3_ALERT_CERTIFICATE_REVOKED",
        "SSLV3_ALERT_CERTIFICATE_EXPIRED",
        "SSLV3_ALERT_CERTIFICATE_UNKNOWN",
    }
)
"""The alerts a server sends when it will not take the client's certificate."""


@dataclass(frozen=True, slots=True)
class Refusal:
    """Which TLS failure, and OpenSSL's words for it."""

    kind: Kind
    detail: str
    """OpenSSL's reason: "unable to get local issuer certificate", "TLSV1_ALERT_UNKNOWN_CA"."""

    @property
    def problem(self) -> str:
        """What is wrong, in a sentence naming no file (the caller knows which it used)."""
        return _PROBLEMS[self.kind]


_PROBLEMS: dict[Kind, str] = {
    "server_untrusted": "the server's certificate is not signed by the CA this client trusts",
    "server_name": "the server's certificate does not list the name or address dialled",
    "server_dates": "the server's certificate has expired or is not valid yet",
    "server_other": "the server's certificate does not verify with the CA this client trusts",
    "client_refused": "the server refused this client's certificate",
}


def refusal(exc: BaseException) -> Refusal | None:
    """The TLS refusal `exc` is, or None for anything else (a reset, a timeout, a TLS
    error a retry may mend)."""
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        detail = exc.verify_message or str(exc)
        if code in _NOT_SIGNED_BY_THE_CA:
            return Refusal("server_untrusted", detail)
        if code in _NAME:
            return Refusal("server_name", detail)
        if code in _DATES:
            return Refusal("server_dates", detail)
        return Refusal("server_other", detail)
    # OpenSSL sets `reason`; an SSLError made elsewhere may lack it.
    reason = getattr(exc, "reason", None) if isinstance(exc, ssl.SSLError) else None
    if reason in _CERTIFICATE_ALERTS:
        return Refusal("client_refused", str(reason))
    return None


class TlsRefused(Exception):
    """The first connection to `server` met `refusal` (`bus.connect(fail_on_tls_refusal=True)`)."""

    def __init__(self, server: str, refusal: Refusal) -> None:
        super().__init__(f"{server}: {refusal.problem} ({refusal.detail})")
        self.server = server
        self.refusal = refusal
