"""How much of a GPU's memory belongs to someone else: the rule NVML and nvidia-smi share.

A process list shows only the processes the agent can see. An engine in another
container (without the host's pid namespace), or a vGPU guest on this board,
holds memory that no listed process accounts for; only the driver's `used`
figure shows it. Purely computational, no side effects; used by
`llmgw.agent.discovery.nvml` and `llmgw.agent.discovery.smi`.
"""

from __future__ import annotations

from collections.abc import Iterable

# Memory the driver may report used with no process to show for it, on a GPU
# nobody else uses: the recordings in tests/fixtures/hw show 0-59 MiB on data
# center boards and up to 797 MiB on a workstation card driving a desktop (its
# display server is a graphics process, not in the compute list). Unseen memory
# above this is another tenant's: it would make an engine fail its memory plan.
UNSEEN_ALLOWANCE_MIB = 1024


def foreign_mib(
    *,
    used_mib: float | None,
    processes: Iterable[tuple[int, int]],
    own_pids: frozenset[int],
    ours: bool,
    seen_elsewhere_mib: int = 0,
) -> int:
    """MiB held by others: listed processes that are not ours, plus unseen memory.

    `processes` are the listed compute processes as (pid, MiB); `seen_elsewhere_mib`
    is memory of visible processes that are nobody's job (graphics). On a GPU one
    of our engines holds (`ours`), unseen memory is not counted: our own engine,
    in a container, is invisible too, and calling it foreign would make the
    control plane move the replica off a healthy GPU. `used_mib` None: not reported.
    """
    listed = list(processes)
    foreign = sum(used for pid, used in listed if pid not in own_pids)
    if ours or used_mib is None:
        return foreign
    unseen = int(used_mib) - sum(used for _, used in listed) - seen_elsewhere_mib
    return foreign + (unseen if unseen > UNSEEN_ALLOWANCE_MIB else 0)
