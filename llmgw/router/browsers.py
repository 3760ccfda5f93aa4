"""Web pages and a router that serves without keys.

A router with `auth.allow_anonymous` is reachable from every page its operator's browser
opens: a page of any site may send it a "simple" request (a POST with `Content-Type:
text/plain` needs no preflight), which spends the fleet's GPUs and, with a model that
calls tools, drives them; and a page whose DNS name is rebound to 127.0.0.1 after it
loaded is the router's own origin to the browser, so it reads the answers too. A request
that carries no key the router knows is therefore refused (403) when

- it carries an `Origin` not listed in `auth.allowed_origins`: browsers send one with
  every POST, same-origin or not, and with every cross-origin request; other clients
  (curl, the OpenAI and Anthropic SDKs) send none. "null" (a sandboxed frame, a local
  file) is never listed;
- the router listens on loopback (or lists `auth.allowed_hosts`) and its `Host` names
  neither a loopback address (127.0.0.0/8, [::1], localhost) nor a listed name: a
  rebound name keeps its own name in `Host`. A request without `Host` is no browser's.

A request with a key is its key's: a browser never attaches one on its own. The pages of
a listed origin also get the CORS headers that let them read the answers
(llmgw.router.cors), with a key or without. The checks
cost a header lookup each; the `Host` values found good are remembered.
"""

from __future__ import annotations

from collections.abc import Mapping

from llmgw import listeners
from llmgw.router.config import AuthConfig
from llmgw.router.errors import Refusal

MAX_KNOWN_HOSTS = 64
"""`Host` values remembered as good; beyond them each is checked again (a few
microseconds), so a client sending many names cannot grow the set."""

QUOTED = 100
"""The most characters of a refused header's value the answer quotes."""


def quoted(value: str) -> str:
    """`value` quoted for an answer, at most QUOTED characters of it and of its quoting
    (escapes of control characters would make it four to ten times as long)."""
    text = repr(value[:QUOTED])
    return text if len(text) <= QUOTED + 2 else text[: QUOTED + 1] + "…"


class BrowserGuard:
    """The `Origin` and `Host` checks of one router's requests without a key."""

    __slots__ = ("allowed_hosts", "check_host", "known_hosts", "origins")

    def __init__(self, auth: AuthConfig, listen_host: str) -> None:
        self.origins = frozenset(auth.allowed_origins)
        self.allowed_hosts = frozenset(h.lower() for h in auth.allowed_hosts)
        self.check_host = listeners.loopback(listen_host) or bool(self.allowed_hosts)
        self.known_hosts: set[str] = set()

    def refusal(self, headers: Mapping[str, str]) -> Refusal | None:
        """Why a request without a key is refused; None when it is served."""
        origin = headers.get("Origin")
        if origin is not None and origin not in self.origins:
            return origin_refused(origin)
        if self.check_host:
            host = headers.get("Host")
            if host is not None and host not in self.known_hosts:
                if not self.host_allowed(host):
                    return host_refused(host)
                if len(self.known_hosts) < MAX_KNOWN_HOSTS:
                    self.known_hosts.add(host)
        return None

    def host_allowed(self, host: str) -> bool:
        """Whether a `Host` header names a loopback address or a listed name."""
        return (
            listeners.loopback_host_header(host)
            or listeners.host_header_name(host) in self.allowed_hosts
        )


def origin_refused(origin: str) -> Refusal:
    return Refusal(
        403,
        f"this router serves requests without an API key, and not to web pages: the origin"
        f" {quoted(origin)} is not in its auth.allowed_origins. Add it there if pages of"
        " that origin may use the router; other clients send no Origin header",
        "permission_error",
        "origin_not_allowed",
    )


def host_refused(host: str) -> Refusal:
    return Refusal(
        403,
        f"this router serves requests without an API key only for a Host of 127.0.0.1,"
        f" [::1], localhost or a name in its auth.allowed_hosts, not {quoted(host)} (a"
        " name rebound to this machine would be a web page's): use one of those addresses,"
        " or add the name to auth.allowed_hosts",
        "permission_error",
        "host_not_allowed",
    )
