"""How a service reaches NATS: the servers and its client certificate.

One Struct for the `nats:` section of the control plane's and the agents' configs and
the router's `log:` section, so that the settings and their TLS context are built one
way everywhere.
"""

from __future__ import annotations

import ssl
from pathlib import Path

import msgspec

from llmgw.bus.keys import Keys
from llmgw.pki import tls


class NatsConnection(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    servers: tuple[str, ...] = ("tls://127.0.0.1:4222",)
    """NATS URLs; list several members of a cluster."""
    ca_file: str = ""
    """The fleet's CA certificate (`ca.pem` from `llmgw ctl cert init`)."""
    cert_file: str = ""
    """This service's client certificate (`llmgw ctl cert issue KIND NAME`)."""
    key_file: str = ""
    accept_unsigned_before: int = 0
    """Accept unsigned events up to this stream sequence (a log written before events
    were signed); 0, the default, accepts none. Signed events are always checked."""

    def problems(self, section: str, unset_hint: str) -> list[str]:
        """What is missing, each naming `section.field`; `unset_hint` says where the
        certificate files come from for this service."""
        out = []
        if not self.servers:
            out.append(f"{section}.servers is empty: list at least one tls://host:port")
        for field in ("ca_file", "cert_file", "key_file"):
            if not getattr(self, field):
                out.append(f"{section}.{field} is not set: {unset_hint}")
        return out

    def file_problems(self, section: str) -> list[str]:
        """What is wrong with the certificate files themselves (missing, unreadable, a
        key that does not match its certificate), each naming `section.field`; for
        `--check`, which must not say ok when the service could not connect."""
        out = []
        for field in ("ca_file", "cert_file", "key_file"):
            path = getattr(self, field)
            if path:
                out += file_problem(f"{section}.{field}", path)
        if out or not all((self.ca_file, self.cert_file, self.key_file)):
            return out
        try:
            self.tls_context()
        except (ssl.SSLError, ValueError) as exc:
            out.append(
                f"{section}: cannot use {self.cert_file} and {self.key_file} with"
                f" {self.ca_file} ({exc}): check that the key is the certificate's own"
                " and the CA is the fleet's"
            )
        return out

    def tls_context(self) -> ssl.SSLContext:
        """The client context: trusts only the fleet's CA, presents this certificate."""
        return tls.client_context(
            ca_file=self.ca_file, cert_file=self.cert_file, key_file=self.key_file
        )

    def keys(self) -> Keys:
        """This service's signer (its certificate and key) and the CA's verifier."""
        return Keys.load(
            ca_file=self.ca_file,
            cert_file=self.cert_file or None,
            key_file=self.key_file or None,
            accept_unsigned_before=self.accept_unsigned_before,
        )


def file_problem(setting: str, path: str) -> list[str]:
    """[] when `path` is a readable file, else one problem naming `setting`."""
    p = Path(path)
    if not p.exists():
        return [f"{setting}: {path} does not exist: fix the path or copy the file there"]
    if not p.is_file():
        return [f"{setting}: {path} is not a file: point it at the file itself"]
    try:
        with p.open("rb"):
            pass
    except OSError as exc:
        return [f"{setting}: cannot read {path} ({exc.strerror}): check its owner and mode"]
    return []
