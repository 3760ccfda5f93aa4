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
        raise engines.LaunchRefused(["GPU 0 is not this node's"])

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


class OneShard:
    """A supervisor holding one live shard (or none), recording what it is asked to do."""

    def __init__(self, live: ShardView | None) -> None:
        self.live = live
        self.calls: list[tuple[Any, ...]] = []

    def view(self, replica_id: str, shard: int = 0) -> ShardView | None:
        return self.live

    def busy_gpus(self) -> frozenset[int]:
        return frozenset(self.live.gpus) if self.live else frozenset()

    async def start(self, *args: Any) -> None:
        self.calls.append(("start", *args[:3]))

    async def stop(self, replica_id: str, shard: int, **kw: Any) -> None:
        self.calls.append(("stop", replica_id, shard, kw))

    async def mark_draining(self, replica_id: str, shard: int) -> None:
        self.calls.append(("drain", replica_id, shard))


def running(g: int, gpus: tuple[int, ...] = (0, 1)) -> ShardView:
    return ShardView(replica_id="r", generation=g, shard=0, phase="serving", gpus=gpus)


def on(
    tmp_path: Path, sup: OneShard, busy_seen: list[frozenset[int]] | None = None
) -> tuple[Applier, list[ShardView]]:
    said: list[ShardView] = []

    def plan(cmd: events.StartShard, busy: frozenset[int]) -> engines.Launch:
        if busy_seen is not None:
            busy_seen.append(busy)
        return engines.Launch(argv=("sleep", "1"), env={}, port=cmd.launch.port)

    applied = Applier(
        node="n",
        supervisor=sup,  # type: ignore[arg-type]
        book=ledger.Ledger(),
        state_dir=tmp_path,
        clock=lambda: 5.0,
        status=said.append,
        plan=plan,
    )
    return applied, said


def test_a_superseded_start_is_recorded_not_run_and_only_starts_are_skipped(
    tmp_path: Path,
) -> None:
    sup = OneShard(running(1))
    a, _ = on(tmp_path, sup)
    asyncio.run(a.apply(1, start(2), skip=True))
    assert sup.calls == []
    assert a.applied == 0
    # Recorded as started: redelivered without its successor, it is not run either.
    assert ledger.decide(start(2), a.book, None).action == "ignore"
    asyncio.run(a.apply(2, stop(1), skip=True))  # `skip` is for starts: a stop still stops
    assert [c[0] for c in sup.calls] == ["stop"]
    assert a.applied == 1


def test_a_stop_passes_its_grace_and_says_why(tmp_path: Path) -> None:
    sup = OneShard(running(1))
    a, _ = on(tmp_path, sup)
    timed = events.StopShard(
        id="s", ts=0.0, epoch=1, node="n", replica_id="r", generation=1, grace_s=7.5
    )
    asyncio.run(a.apply(1, timed, skip=False))
    assert sup.calls == [("stop", "r", 0, {"grace_s": 7.5, "reason": "stopped by command"})]


def test_a_newer_generation_plans_on_the_gpus_the_older_one_gives_back(tmp_path: Path) -> None:
    seen: list[frozenset[int]] = []
    sup = OneShard(running(1, gpus=(0, 1)))
    a, _ = on(tmp_path, sup, seen)
    asyncio.run(a.apply(1, start(2), skip=False))
    assert seen == [frozenset()]
    assert sup.calls == [("start", "r", 2, 0)]
    assert ledger.load(tmp_path).shards[ledger.key("r", 0)].started == 2  # saved at once


def test_a_refused_start_says_its_gpus_and_a_later_stop_of_it_says_nothing(
    tmp_path: Path,
) -> None:
    a, said = applier(tmp_path, [])
    asyncio.run(a.apply(1, start(2), skip=False))
    asyncio.run(a.apply(2, stop(2), skip=False))
    assert [(s.phase, s.gpus) for s in said] == [("failed", (0,))]
    assert "refused the shard: GPU 0 is not this node's" in said[0].error


def test_a_stop_of_what_does_not_run_here_says_so(tmp_path: Path) -> None:
    a, said = applier(tmp_path, [])
    asyncio.run(a.apply(1, stop(2), skip=False))
    assert [s.error for s in said] == ["not running on this node"]
