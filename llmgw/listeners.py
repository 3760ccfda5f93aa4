"""TCP listeners for the services' HTTP APIs, bound before serving so that a taken port is a
clear error naming the setting to change."""

from __future__ import annotations

import ipaddress
import socket
import urllib.parse


def bind(host: str, port: int, *, setting: str) -> socket.socket:
    """A listening, non-blocking socket on `host:port` (0: a free port); an OSError saying
    to change `setting` when it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(
            f"cannot listen on {host}:{port}: {exc.strerror}; set {setting} to a free port "
            "(0 picks one)"
        ) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def url(scheme: str, sock: socket.socket) -> str:
    """`scheme://host:port` of a bound socket (IPv6 hosts in brackets)."""
    host, port = sock.getsockname()[:2]
    return (
        f"{scheme}://[{host}]:{port}"
        if sock.family == socket.AF_INET6
        else f"{scheme}://{host}:{port}"
    )


WILDCARDS = frozenset({"0.0.0.0", "::", ""})


def scrape_target(url: str, reachable_as: str) -> str:
    """The `host:port` Prometheus scrapes the listener at `url` (`http://host:port`) at, ""
    for no URL: a wildcard bind is reached at `reachable_as` (the machine's name or
    address)."""
    if not url:
        return ""
    where = urllib.parse.urlsplit(url)
    host = where.hostname or ""
    host = reachable_as if host in WILDCARDS else host
    return f"[{host}]:{where.port}" if ":" in host else f"{host}:{where.port}"


def loopback(host: str) -> bool:
    """Whether `host` (an address or a name) stays on this machine: a loopback address, or
    "localhost". Pure; a name other than localhost is not resolved and counts as exposed."""
    if host.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def loopback_host_header(value: str) -> bool:
    """Whether a `Host` header (`name[:port]`) names a loopback host, as a browser sends
    for 127.0.0.1, [::1] or localhost; a DNS name rebound to 127.0.0.1 keeps its own name.
    Pure; False for anything that is not a host."""
    try:
        name = urllib.parse.urlsplit("//" + value).hostname or ""
    except ValueError:
        return False
    return loopback(name)
