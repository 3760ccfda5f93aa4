"""Every launch the leader can decide fits the bounds its readers check, and one message.

A StartShard carries the profile's engine arguments, environment and aliases, plus what
placement adds (NCCL_IB_HCA from the node's fabric, the head's address). A command that a
reader refuses at decode is never folded as sent, so the next pass sends it again: every
pass, for as long as the replica holds its GPUs. The catalog therefore refuses a profile
that leaves no room for what placement adds, and nodes' HCA names are bounded at decode.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import pytest

from llmgw.core import events, limits
from llmgw.core.inventory import Fabric

from .scenarios import Sim, cluster, profile, registered

MESSAGE = 1024 * 1024
"""What the log's stream takes in one message (bus/provisioning.py)."""


def _decisions_fit(decisions: list[events.Event]) -> None:
    starts = [d for d in decisions if isinstance(d, events.StartShard)]
    assert starts
    for d in decisions:
        data = events.encode(d)
        assert len(data) <= MESSAGE - 16 * 1024
        assert events.decode(data) == d


def _wide_fleet(sim: Sim, hcas: int = limits.MAX_LIST) -> None:
    """Two nodes whose fabric lists as many HCAs, with names as long, as a reader takes."""
    long = [f"mlx5_{i}".ljust(limits.MAX_HCA_NAME, "x") for i in range(hcas)]
    for name in ("node-a", "node-b"):
        fab = Fabric(name="f" * limits.MAX_NAME, hcas=tuple(long))
        reg = registered(name, fabrics=[fab], ts=sim.now)
        reg = msgspec.structs.replace(reg, address="a" * limits.MAX_NAME)
        assert sim.append(events.decode(events.encode(reg))) is None


def test_a_multi_node_model_leaves_room_for_nccl_ib_hca_in_its_env() -> None:
    sim = Sim()
    _wide_fleet(sim)
    full = {f"V{i}": "1" for i in range(limits.MAX_ENV)}
    reason = sim.declare(profile("wide", tensor_parallel=16, nodes=2, env=full))
    assert reason is not None
    assert "NCCL_IB_HCA" in reason
    assert f"at most {limits.MAX_ENV - 1}" in reason
    # A replica on one node gets nothing added: all of them may be set.
    assert sim.declare(profile("one", tensor_parallel=8, env=full)) is None
    fits = dict(list(full.items())[:-1])
    sim.append(events.ModelRemoved(id="rm", ts=sim.now, operator="alice", name="one"))
    assert sim.declare(profile("wide", tensor_parallel=16, nodes=2, env=fits)) is None
    _decisions_fit(sim.leader())


def _args(total: int) -> tuple[str, ...]:
    each = limits.MAX_TEXT - 8
    return tuple("--a=" + "x" * (each - 4) for _ in range(total // each))


def test_a_profile_too_large_for_one_launch_command_is_refused() -> None:
    sim = Sim()
    _wide_fleet(sim)
    big = profile("big", tensor_parallel=16, nodes=2, engine_args=_args(MESSAGE - 8 * 1024))
    declared = events.ModelDeclared(id="d", ts=sim.now, operator="alice", profile=big)
    assert len(events.encode(declared)) < MESSAGE  # the declaration itself fits
    reason = sim.declare(big)
    assert reason is not None
    assert "shorten engine_args, env or aliases" in reason
    fits = profile("big", tensor_parallel=16, nodes=2, engine_args=_args(MESSAGE - 96 * 1024))
    assert sim.declare(fits) is None
    _decisions_fit(sim.leader())


@pytest.mark.parametrize(
    "name", ["m" * (limits.MAX_HCA_NAME + 1), "mlx5\u00010", 'mlx5"0', "mlx5 0", ""]
)
def test_an_hca_name_linux_would_not_give_is_refused_at_decode(name: str) -> None:
    fab = Fabric(name="ib", hcas=(name,))
    raw: Any = json.loads(events.encode(registered("n", fabrics=[fab])))
    with pytest.raises(events.DecodeError):
        events.decode(json.dumps(raw).encode())
    raw["fabrics"][0]["hcas"] = []
    with pytest.raises(events.DecodeError):
        events.decode(json.dumps(raw).encode())  # the Hca listed under `hcas` too


def test_a_fleet_at_every_bound_gets_launches_its_nodes_can_read() -> None:
    sim = Sim()
    sim.extend(cluster(2, ts=sim.now))
    _wide_fleet(sim)
    assert sim.declare(profile("m", tensor_parallel=16, nodes=2)) is None
    _decisions_fit(sim.leader())
