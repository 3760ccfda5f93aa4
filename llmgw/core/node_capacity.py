"""What one usable node offers placement now: its free healthy GPUs per class and NVLink
domain, and its free ports. Built once per node per reconcile pass (llmgw.core.placement
`Capacity`) and updated as the pass reserves GPUs and ports.

Purely computational.
"""

from __future__ import annotations

from llmgw.core.state import NodeState

PORT_BASE = 8100
PORT_LIMIT = 9100
"""Each shard takes two ports from [PORT_BASE, PORT_LIMIT): its HTTP port and, on a
multi-node head, the next one for the distributed init (--master-port)."""


class NodeCapacity:
    """Free healthy GPUs of one usable node, per class, plus its free ports."""

    __slots__ = ("_port", "by_class", "domains", "name", "picks", "ports", "problems")

    def __init__(self, node: NodeState) -> None:
        self.name = node.name
        by_class: dict[str, list[int]] = {}
        domains: dict[str, dict[int | None, list[int]]] = {}
        self.problems: list[str] = []
        self.picks: dict[tuple[str, int], tuple[tuple[int, ...], bool] | None] = {}
        held = node.holders
        orphaned = {g for orphan in node.orphans for g in orphan.gpus} if node.orphans else ()
        gpus = node.gpus
        # Hot: runs for every node on every pass that places something.
        for index in sorted(gpus):
            if index in held or index in orphaned:
                continue
            gpu = gpus[index]
            if (
                gpu.ecc_uncorrected
                or gpu.foreign_memory_mib
                or gpu.remap_pending
                or gpu.remap_failed
            ):
                self.problems.append(f"GPU {index} unhealthy: {', '.join(gpu.health_problems)}")
                continue
            cls = gpu.gpu_class
            free = by_class.get(cls)
            if free is None:
                by_class[cls] = [index]
                domains[cls] = {gpu.nvlink_domain: [index]}
                continue
            free.append(index)
            members = domains[cls].get(gpu.nvlink_domain)
            if members is None:
                domains[cls][gpu.nvlink_domain] = [index]
            else:
                members.append(index)
        self.by_class = by_class
        self.domains = domains
        """Free healthy GPUs per class and NVLink domain (None: PCIe only)."""
        self.ports = set(node.ports)
        self._port: int | None = None

    def pick(self, gpu_class: str, count: int) -> tuple[tuple[int, ...], bool] | None:
        """`count` free GPUs of a class, one NVLink domain where one fits (best fit).

        Cached until the node's capacity changes: a pass asks the same node the
        same question once per model.
        """
        cache_key = (gpu_class, count)
        if cache_key in self.picks:
            return self.picks[cache_key]
        result = self._pick(gpu_class, count)
        self.picks[cache_key] = result
        return result

    def _pick(self, gpu_class: str, count: int) -> tuple[tuple[int, ...], bool] | None:
        free = self.by_class.get(gpu_class, ())
        if len(free) < count:
            return None
        best: tuple[int, int] | None = None
        for d, members in self.domains.get(gpu_class, {}).items():
            if (
                d is not None
                and len(members) >= count
                and (best is None or (len(members), d) < best)
            ):
                best = (len(members), d)
        if best is not None:
            return tuple(self.domains[gpu_class][best[1]][:count]), True
        return tuple(free[:count]), count == 1

    def take(self, gpu_class: str, gpus: tuple[int, ...]) -> None:
        taken = set(gpus)
        self.by_class[gpu_class] = [g for g in self.by_class[gpu_class] if g not in taken]
        for d, members in self.domains[gpu_class].items():
            self.domains[gpu_class][d] = [g for g in members if g not in taken]
        self.picks.clear()

    def port(self) -> int | None:
        """The lowest free (port, port + 1) pair; cached until `take_port`."""
        if self._port is None:
            self._port = next(
                (
                    p
                    for p in range(PORT_BASE, PORT_LIMIT, 2)
                    if p not in self.ports and p + 1 not in self.ports
                ),
                0,
            )
        return self._port or None

    def take_port(self, port: int) -> None:
        self.ports.update((port, port + 1))
        self._port = None
