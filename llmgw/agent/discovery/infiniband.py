"""RDMA adapters (InfiniBand and RoCE) read from `/sys/class/infiniband`.

One `Hca` per adapter port: state, rate and link layer, which tells native
InfiniBand ("InfiniBand") from RoCE ("Ethernet"). A node without the folder
has no RDMA: it is a single-node island, not an error. The root is an argument
so that tests feed recorded sysfs trees. Used by `llmgw.agent.discovery`.
"""

from __future__ import annotations

import re
from pathlib import Path

from llmgw.core.inventory import Hca

DEFAULT_ROOT = Path("/sys/class/infiniband")

_RATE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*Gb/sec")


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace").strip()
    except OSError:
        return ""


def parse_state(text: str) -> str:
    """'4: ACTIVE' -> 'ACTIVE' (the kernel prints the numeric code first)."""
    return text.partition(":")[2].strip() if ":" in text else text.strip()


def parse_rate(text: str) -> float:
    """'100 Gb/sec (4X EDR)' -> 100.0; unreadable -> 0.0."""
    match = _RATE.match(text)
    return float(match.group(1)) if match else 0.0


def read_hcas(root: str | Path = DEFAULT_ROOT) -> tuple[Hca, ...]:
    """Every port of every RDMA adapter under `root`, sorted by adapter and port."""
    base = Path(root)
    if not base.is_dir():
        return ()
    hcas: list[Hca] = []
    for device in sorted(base.iterdir(), key=lambda p: p.name):
        ports = device / "ports"
        if not ports.is_dir():
            continue
        for port in sorted(ports.iterdir(), key=lambda p: (len(p.name), p.name)):
            if not port.name.isdigit():
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
