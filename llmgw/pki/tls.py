"""TLS contexts for llmgw's NATS clients (agents, routers, the control plane, `llmgw ctl`).

The client trusts only the fleet's private CA (not the system store: a public certificate
for some other host must not pass as our NATS server) and presents its own certificate,
which nats-server maps to a user with `verify_and_map`. Hostname checking stays on, which
is why the server certificate lists every name and IP clients dial.
"""

from __future__ import annotations

import ssl
from pathlib import Path


def client_context(
    *, ca_file: str | Path, cert_file: str | Path | None, key_file: str | Path | None
) -> ssl.SSLContext:
    """A client context trusting `ca_file` and presenting `cert_file`/`key_file`, if given."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_verify_locations(cafile=str(ca_file))
    except FileNotFoundError:
        raise FileNotFoundError(
            f"CA certificate {ca_file} not found: run `llmgw ctl cert init`, or point the "
            "config's tls.ca_file at the fleet's ca.pem"
        ) from None
    if cert_file is not None:
        try:
            ctx.load_cert_chain(
                certfile=str(cert_file), keyfile=None if key_file is None else str(key_file)
            )
        except FileNotFoundError:
            raise FileNotFoundError(
                f"client certificate {cert_file} or key {key_file} not found: issue one with "
                "`llmgw ctl cert issue <kind> <name>` and copy both files to this host"
            ) from None
    return ctx
