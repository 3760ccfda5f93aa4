"""Every id the control plane writes is unpredictable, and replay --verify still verifies."""

from __future__ import annotations

import re

import msgspec

from llmgw.agent import service as agent_service
from llmgw.control import ids, models
from llmgw.core import events, reconcile, state
from llmgw.ctl.session import Session
from llmgw.pki.identity import Identity

from .scenarios import Sim, profile

RANDOM = re.compile(r"-[0-9a-f]{32}$")


class RandomIdSim(Sim):
    """A Sim whose leader writes ids as the control service does."""

    def __init__(self, **kw: object) -> None:
        super().__init__(**kw)  # type: ignore[arg-type]
        self.ids = ids.DecisionIds()

    def leader(self, now: float | None = None) -> list[events.Event]:
        if now is not None and now > self.now:
            self.now = now
            self.heartbeats()
        decisions = reconcile.reconcile(
            self.state,
            self.now,
            epoch=self.epoch,
            basis_seq=self.state.last_seq,
            config=self.config,
            ids=self.ids,
        )
        for d in decisions:
            assert self.append(d) is None
        return list(decisions)


def test_decision_ids_carry_128_random_bits_after_their_base() -> None:
    sim = RandomIdSim()
    sim.register("a")
    sim.declare(profile("llama", replicas=2))
    decisions = sim.leader()
    assert decisions
    basis = decisions[0].basis_seq
    for i, d in enumerate(decisions):
        assert d.id.startswith(f"1-{basis}-{i}-")
        assert RANDOM.search(d.id)
    assert len({d.id for d in decisions}) == len(decisions)
    # Replica ids stay derived from the base: a replay reproduces them.
    placed = [d for d in decisions if isinstance(d, events.ReplicaPlaced)]
    assert [p.replica_id for p in placed] == [f"r1-{basis}-0", f"r1-{basis}-2"]


def test_the_same_base_keeps_its_random_part_while_the_basis_stands() -> None:
    f = ids.DecisionIds()
    a, b = f("1-7-0"), f("1-7-1")
    assert f("1-7-0") == a
    assert f("1-7-1") == b
    c = f("1-8-0")
    assert c != a
    assert RANDOM.search(c)
    assert f("1-7-0") != a  # the basis moved on: a fresh random part
    assert ids.unique("x") != ids.unique("x")


def test_replay_verify_compares_decisions_without_their_ids() -> None:
    sim = RandomIdSim()
    sim.register("a")
    sim.register("b")
    sim.declare(profile("llama", replicas=2))
    sim.settle()
    sim.drain("a", grace_s=60)
    sim.settle(now=sim.now + 1)
    report = reconcile.verify(sim.durable_records())
    assert report.ok, report.mismatches
    assert report.batches >= 3
    assert report.matched == report.batches
    # A real difference is still found: a recorded StartShard on another port.
    records = sim.durable_records()
    i = next(n for n, (_s, ev) in enumerate(records) if isinstance(ev, events.StartShard))
    seq, start = records[i]
    assert isinstance(start, events.StartShard)
    launch = msgspec.structs.replace(start.launch, port=9999)
    records[i] = (seq, msgspec.structs.replace(start, launch=launch))
    assert not reconcile.verify(records).ok


def test_config_model_events_get_random_ids_and_stay_recognised_as_managed() -> None:
    st = state.ClusterState()
    out = models.diff(
        [profile("llama")], st, set(), operator="control-1", now=1.0, basis_seq=5, ids=ids.unique
    )
    (declared,) = out
    assert declared.id.startswith("config-control-1-5-0-")
    assert RANDOM.search(declared.id)
    assert models.managed(out) == {"llama"}


def test_agent_and_ctl_ids_are_random_too() -> None:
    agent_ids = {agent_service._new_id() for _ in range(100)}
    assert len(agent_ids) == 100
    assert all(re.fullmatch(r"[0-9a-f]{32}", i) for i in agent_ids)

    session = Session.__new__(Session)
    session.identity = Identity("operator", "alice")
    op_ids = {session.new_id() for _ in range(100)}
    assert len(op_ids) == 100
    assert all(re.fullmatch(r"op-alice-[0-9a-f]{32}", i) for i in op_ids)
