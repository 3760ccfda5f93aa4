"""systemd readiness: `READY=1` on `$NOTIFY_SOCKET`, so units can be `Type=notify`.

A long-running service says it is ready once it serves (the control plane caught up and
listening, the router listening, the agent registered), at the moment it prints its one
announcement line. Outside systemd (no `NOTIFY_SOCKET`) nothing is sent. The protocol is
one datagram on a unix socket, a path or an abstract name (`@...`); see sd_notify(3). A
failure to notify is logged, never raised: the service serves either way.
"""

from __future__ import annotations

import os
import socket

from llmgw import logs

log = logs.get("llmgw.sdnotify")


def notify(message: str) -> bool:
    """Send `message` (e.g. "READY=1") to the service manager; True if one was told."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):
        address = "\0" + address[1:]
    elif not address.startswith("/"):
        log.warning("notify_socket_unusable", address=address, why="neither a path nor @name")
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
            sock.connect(address)
            sock.sendall(message.encode())
    except OSError as exc:
        log.warning("notify_failed", message=message, error=str(exc))
        return False
    return True


def ready() -> bool:
    return notify("READY=1")
