"""Where `llmgw ctl` finds the log and which certificate it presents.

Defaults follow `llmgw ctl cert init`'s layout (run from the repository root):
NATS at tls://127.0.0.1:4222, the CA at nats/certs/ca.pem and the first operator's
certificate at nats/certs/operator/admin.pem. A YAML file (`--config`, or the
environment variable LLMGW_CTL_CONFIG) and `LLMGW_CTL__<FIELD>` variables override
them, and command-line flags override both. `control_url` names a control plane's
admin API, for the one thing ctl asks the service rather than the log (`ctl status`).

Who the operator is comes from the certificate itself (its CN and OU), never from a
flag: the NATS server maps the same certificate to the same user, so the identity
recorded in an operator event is the one the server admitted.
"""

from __future__ import annotations

import datetime as dt
import os
from pathlib import Path
from typing import Any

import msgspec
from cryptography import x509
from cryptography.x509.oid import NameOID

from llmgw import config
from llmgw.ctl.errors import BadInput
from llmgw.pki.identity import KINDS, Identity

CONFIG_ENV = "LLMGW_CTL_CONFIG"


class CtlConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """`llmgw ctl`'s connection settings (file, then LLMGW_CTL__* variables, then flags)."""

    servers: tuple[str, ...] = ("tls://127.0.0.1:4222",)
    ca_file: str = "nats/certs/ca.pem"
    cert_file: str = "nats/certs/operator/admin.pem"
    """The operator's certificate (`llmgw ctl cert issue operator NAME`)."""
    key_file: str = ""
    """Default: beside cert_file, `<name>-key.pem` as `llmgw ctl cert` writes it."""
    connect_timeout_s: float = 5.0
    accept_unsigned_before: int = 0
    """Accept unsigned events up to this stream sequence (a log written before events
    were signed, e.g. `LLMGW_CTL__ACCEPT_UNSIGNED_BEFORE=SEQ`); 0 accepts none."""
    control_url: str = ""
    """A control plane's admin API (its `admin` listener, e.g. http://127.0.0.1:9190), asked
    by `llmgw ctl status` for what only the running service knows; empty: not asked."""

    @property
    def key_path(self) -> str:
        if self.key_file:
            return self.key_file
        cert = Path(self.cert_file)
        return str(cert.with_name(f"{cert.stem}-key.pem"))


def load(
    path: str | Path | None = None,
    *,
    overrides: dict[str, Any] | None = None,
    environ: dict[str, str] | None = None,
) -> CtlConfig:
    """Settings from `path` (or $LLMGW_CTL_CONFIG), the environment and `overrides` (flags)."""
    env = os.environ if environ is None else environ
    from_env = path is None and bool(env.get(CONFIG_ENV))
    if from_env:
        path = env[CONFIG_ENV]
    flags = {k: v for k, v in (overrides or {}).items() if v not in (None, (), [])}
    if "servers" in flags and isinstance(flags["servers"], str):
        flags["servers"] = [flags["servers"]]
    try:
        cfg = config.load(CtlConfig, path, section="CTL", overrides=flags, environ=dict(env))
    except config.ConfigError as exc:
        message = str(exc)
        if from_env and str(path) in message:
            # A variable set long ago (by `llmgw up`'s hint) names a file nobody gave here.
            message += (
                f" ({CONFIG_ENV} names this file: fix it, point the variable at a ctl config,"
                " or unset it)"
            )
        raise BadInput(message) from None
    if not cfg.servers:
        raise BadInput("no NATS server configured: pass --server tls://HOST:PORT")
    return cfg


def identity_of(cert_file: str | Path) -> Identity:
    """The identity a certificate speaks for: OU = kind, CN = name (as nats-server maps it)."""
    path = Path(cert_file)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise BadInput(
            f"certificate {path} not found: issue one with `llmgw ctl cert issue operator NAME` "
            "and pass --cert (or set cert_file in the ctl config)"
        ) from None
    except OSError as exc:
        raise BadInput(f"cannot read certificate {path}: {exc.strerror}") from None
    try:
        cert = x509.load_pem_x509_certificate(data)
    except ValueError:
        raise BadInput(f"{path} is not a PEM certificate: pass the .pem, not the key") from None
    cns = cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    ous = cert.subject.get_attributes_for_oid(NameOID.ORGANIZATIONAL_UNIT_NAME)
    cn = str(cns[0].value) if cns else ""
    ou = str(ous[0].value) if ous else ""
    if ou not in KINDS:
        raise BadInput(
            f"{path} (subject {cert.subject.rfc4514_string()}) is not an llmgw identity: "
            "use a certificate from `llmgw ctl cert issue operator NAME`"
        )
    try:
        identity = Identity(ou, cn)
    except ValueError as exc:
        raise BadInput(f"{path}: {exc}") from None
    # The server refuses it in the TLS handshake, and nats-py retries that until the connect
    # timeout, which said only "TimeoutError".
    now = dt.datetime.now(dt.UTC)
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        when = (
            f"expired on {cert.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"
            if now > cert.not_valid_after_utc
            else f"is valid only from {cert.not_valid_before_utc:%Y-%m-%d %H:%M} UTC"
        )
        raise BadInput(
            f"certificate {path} ({identity}) {when}: issue a new one with `llmgw ctl cert issue"
            f" {identity.kind} {identity.name}` (or check this machine's clock)"
        )
    return identity
