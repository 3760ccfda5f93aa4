"""RDMA adapters (InfiniBand and RoCE) read from `/sys/class/infiniband`.

One `Hca` per adapter port: state, rate and link layer, which tells native
InfiniBand ("InfiniBand") from RoCE ("Ethernet"). A node without the folder
has no RDMA: it is a single-node island, not an error. The root is an argument
so that tests feed recorded sysfs trees. Used by `llmgw.agent.discovery`.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.core import limits
from llmgw.core.inventory import Hca

DEFAULT_ROOT = Path("/sys/class/infiniband")

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")
_PORT = re.compile(r"[0-9]{1,3}")
_NAME = re.compile(limits.HCA_NAME)
"""The names a registration may carry: a device named otherwise (Linux gives none) is left
out, where it would have the whole registration refused."""
MAX_RATE_GBPS = 10.0**7
"""The log's bound on a link rate (llmgw.core.limits.Rate)."""


def _read(path: Path) -> str:
    """The file's text, cut to the log's bound on a name: a file of garbage must not make
    every reader refuse the node's registration (they decode it with those bounds)."""
    try:
        return path.read_text(errors="replace").strip()[: limits.MAX_NAME]
    except OSError:
        return ""


def parse_state(text: str) -> str:
    """'4: ACTIVE' -> 'ACTIVE' (the kernel prints the numeric code first)."""
    return text.partition(":")[2].strip() if ":" in text else text.strip()


def parse_rate(text: str) -> float:
    """'100 Gb/sec (4X EDR)' -> 100.0; unreadable -> 0.0."""
    match = _RATE.match(text)
    rate = float(match.group(1)) if match else 0.0
    return rate if rate <= MAX_RATE_GBPS else 0.0


def _entries(folder: Path) -> list[Path]:
    """What `folder` holds, or nothing once it is gone: a driver reload removes an adapter's
    folder between the listing and the read, and the refresh runs in the heartbeat loop."""
    try:
        return list(folder.iterdir())
    except OSError:
        return []


def read_hcas(root: str | Path = DEFAULT_ROOT) -> tuple[Hca, ...]:
    """Every port of every RDMA adapter under `root`, sorted by adapter and port."""
    base = Path(root)
    if not base.is_dir():
        return ()
    hcas: list[Hca] = []
    for device in sorted(_entries(base), key=lambda p: p.name):
        ports = device / "ports"
        if not _NAME.match(device.name) or not ports.is_dir():
            continue
        for port in sorted(_entries(ports), key=lambda p: (len(p.name), p.name)):
            # ASCII digits, and a number the log carries: str.isdigit() admits "²",
            # which int() refuses, and the refresh runs in the heartbeat loop.
            if not _PORT.fullmatch(port.name) or int(port.name) > limits.MAX_LIST:
                continue
            hcas.append(
                Hca(
                    name=device.name,
                    port=int(port.name),
                    state=parse_state(_read(port / "state")) or "UNKNOWN",
                    rate_gbps=parse_rate(_read(port / "rate")),
                    # Older kernels have no link_layer file: those only spoke InfiniBand.
                    link_layer=_read(port / "link_layer") or "InfiniBand",
                )
            )
    return tuple(hcas)
