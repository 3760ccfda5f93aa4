"""TCP listeners for the services' HTTP APIs, bound before serving so that a taken port is a
clear error naming the setting to change."""

from __future__ import annotations

import errno
import ipaddress
import socket
import urllib.parse

BIND_ERRORS = (OSError, OverflowError, ValueError, TypeError)
"""What binding raises for a bad address besides OSError (a taken port, an address or a name
not of this machine): OverflowError for a port outside 0-65535, UnicodeError (a ValueError)
for a name IDNA cannot encode (a label of 64 characters), TypeError for a name with a NUL."""

_PORT_ERRNOS = frozenset({errno.EADDRINUSE, errno.EACCES})


class ListenError(OSError):
    """An address that cannot be listened on; the message names the setting to change."""


def host_setting(port_setting: str) -> str:
    """The host's setting beside a port's: `admin.port` -> `admin.host`, `--port` -> `--host`."""
    return port_setting.replace("port", "host")


def refuse_empty_host(host: str, setting: str) -> None:
    """Raise ListenError for an empty host: the socket API reads it as every interface, and
    an unset variable (`--host "$HOST"`) would put a loopback service on the network."""
    if not host.strip():
        raise ListenError(
            f"{host_setting(setting)} is empty, which would listen on every interface: set it"
            " to 0.0.0.0 (or ::) if that is meant, else to an address of this machine"
        )


def bind(host: str, port: int, *, setting: str) -> socket.socket:
    """A listening, non-blocking socket on `host:port` (0: a free port); an OSError saying
    to change `setting` (the port's) or the host's setting when it cannot bind."""
    refuse_empty_host(host, setting)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except BIND_ERRORS as exc:
        sock.close()
        raise bind_error(exc, host, port, setting) from None
    sock.listen(128)
    sock.setblocking(False)
    return sock


def bind_error(exc: BaseException, host: str, port: int, setting: str) -> ListenError:
    """Why `host:port` cannot be listened on, naming the setting to change: `setting` for
    the port, the same name with `host` for the host (`admin.port` -> `admin.host`)."""
    where = f"{host[:64]}:{port}"
    if isinstance(exc, OverflowError):
        return ListenError(f"cannot listen on {where}: a port is 0 to 65535; set {setting} to one")
    if isinstance(exc, OSError) and exc.errno in _PORT_ERRNOS:
        return ListenError(
            f"cannot listen on {where}: {exc.strerror}; set {setting} to a free port (0 picks one)"
        )
    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return ListenError(
        f"cannot listen on {where}: {why}; set {host_setting(setting)} to an"
        " address of this machine (an IP, or a name it resolves)"
    )


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


_NOT_IN_A_HOST = frozenset("/?#@\\ \t%")
"""Characters no host of a `Host` header holds (a path, a query, user info, a zone)."""


def host_header_name(value: str) -> str | None:
    """The host a `Host` header (`host[:port]`, RFC 9110) names, in lower case, without its
    port (an IPv6 address keeps its brackets); None when the value is not of that form (a
    path, user info, a port that is not digits, a bare IPv6 address, a name not in ASCII:
    a browser sends an international name as punycode). Pure."""
    if value.startswith("["):
        inside, bracket, port = value[1:].partition("]")
        name = f"[{inside}]" if bracket else ""
    else:
        name, colon, digits = value.partition(":")
        port = colon + digits
    if port and not (port[0] == ":" and port[1:].isascii() and port[1:].isdigit()):
        return None
    if not name or not name.isascii() or any(c in _NOT_IN_A_HOST for c in name):
        return None
    return name.lower()


def loopback_host_header(value: str) -> bool:
    """Whether a `Host` header (`name[:port]`) names a loopback host by a literal, as a
    browser sends for 127.0.0.1 (any of 127.0.0.0/8), [::1] or localhost; a DNS name
    rebound to 127.0.0.1 keeps its own name. Pure; False for anything that is not a host."""
    name = host_header_name(value)
    if name is None:
        return False
    if name.startswith("["):
        try:
            return ipaddress.IPv6Address(name[1:-1]).is_loopback
        except ValueError:
            return False
    if name in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.IPv4Address(name).is_loopback
    except ValueError:
        return False
