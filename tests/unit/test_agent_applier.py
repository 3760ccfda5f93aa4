"""The agent's applier (llmgw.agent.applier) on a supervisor that runs nothing: a command
whose effect is a status (a start this node refuses, a stop of what does not run here)
is applied once, a redelivery of it reports nothing more, and the ledger on disk says so
for the agent that restarts."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from llmgw.agent import engines, ledger
from llmgw.agent.applier import Applier
from llmgw.agent.shards import ShardView
from llmgw.core import events

from .test_agent_ledger import start, stop


class NothingRuns:
    """A supervisor with no shard: every view is None, every GPU free."""

    def view(self, replica_id: str, shard: int = 0) -> ShardView | None:
        return None

    def busy_gpus(self) -> frozenset[int]:
        return frozenset()

    async def start(self, *args: Any) -> None:
        raise AssertionError("nothing is to start here")


def applier(tmp_path: Path, plans: list[events.StartShard]) -> tuple[Applier, list[ShardView]]:
    said: list[ShardView] = []

    def refuse(cmd: events.StartShard, busy: frozenset[int]) -> engines.Launch:
        plans.append(cmd)
        raise engines.LaunchRefused("GPU 0 is not this node's")

    applied = Applier(
        node="n",
        supervisor=NothingRuns(),  # type: ignore[arg-type]
        book=ledger.Ledger(),
        state_dir=tmp_path,
        clock=lambda: 0.0,
        status=said.append,
        plan=refuse,
    )
    return applied, said


def test_a_start_the_node_refuses_is_reported_once_and_kept(tmp_path: Path) -> None:
    """Refused once, as failed: redelivered, it is neither planned nor reported again, and
    the ledger on disk keeps it so (a restarted agent that re-read it would start it if
    the node could by then, after the control plane gave its slot up)."""
    plans: list[events.StartShard] = []
    a, said = applier(tmp_path, plans)
    asyncio.run(a.apply(1, start(2), skip=False))
    asyncio.run(a.apply(2, start(2), skip=False))
    assert [(s.phase, s.generation) for s in said] == [("failed", 2)]
    assert len(plans) == 1
    assert ledger.decide(start(2), ledger.load(tmp_path), None).action == "ignore"


def test_a_stop_of_what_does_not_run_here_is_reported_once(tmp_path: Path) -> None:
    a, said = applier(tmp_path, [])
    asyncio.run(a.apply(1, stop(2), skip=False))
    asyncio.run(a.apply(2, stop(2), skip=False))
    assert [(s.phase, s.generation) for s in said] == [("stopped", 2)]
    assert ledger.load(tmp_path).shards[ledger.key("r", 0)].ended == 2
