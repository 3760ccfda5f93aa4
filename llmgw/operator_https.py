"""HTTPS for operators: a listener that requires a client certificate from the fleet's CA
and admits operator certificates only (OU=operator). The control plane's admin API and
the console use it: a node's or router's certificate is issued by the same CA, but the
whole fleet's state, and changing it, are an operator's business."""

from __future__ import annotations

import ssl
from typing import Any

from aiohttp import web


def server_tls(cert_file: str, key_file: str, ca_file: str) -> ssl.SSLContext:
    """HTTPS that requires a client certificate issued by the fleet's CA."""
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca_file)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def peer_units(peercert: Any) -> set[str]:
    """The OU values of a peer certificate as ssl.getpeercert() returns it. Pure."""
    out: set[str] = set()
    for rdn in (peercert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "organizationalUnitName":
                out.add(value)
    return out


def peer_name(request: web.Request) -> str:
    """The CN of the request's client certificate ("" without one: plain HTTP)."""
    transport = request.transport
    cert = transport.get_extra_info("peercert") if transport is not None else None
    for rdn in (cert or {}).get("subject", ()):
        for key, value in rdn:
            if key == "commonName":
                return str(value)
    return ""


@web.middleware
async def operators_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """Over HTTPS, only operator certificates: a node's or router's certificate is from
    the same CA, but reading the whole fleet's state is an operator's business."""
    transport = request.transport
    if transport is not None and transport.get_extra_info("sslcontext") is not None:
        units = peer_units(transport.get_extra_info("peercert"))
        if "operator" not in units:
            return web.json_response(
                {"error": "this API admits operator certificates only (OU=operator): issue one "
                 "with `llmgw ctl cert issue operator <name>`"},
                status=403,
            )  # fmt: skip
    response: web.StreamResponse = await handler(request)
    return response
