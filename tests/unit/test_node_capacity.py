"""What one node offers placement (llmgw.core.node_capacity): a replica gets exactly the
GPUs it asks for, distinct and free, however the node's NVLink domains are laid out; a
shard gets a pair of ports that are both free (its HTTP port and the next one), whatever
ports the node's replicas hold, and a node with no such pair gets nothing."""

from __future__ import annotations

import msgspec
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import placement
from llmgw.core.node_capacity import PORT_BASE, PORT_LIMIT, NodeCapacity
from llmgw.core.state import NodeState

from .scenarios import Sim, gpus, profile

DOMAINS = st.lists(st.sampled_from([None, 0, 1, 2]), min_size=1, max_size=8)


def node_of(domains: list[int | None]) -> NodeState:
    """A registered node whose GPU i is in NVLink domain `domains[i]` (None: PCIe only)."""
    laid = tuple(
        msgspec.structs.replace(g, nvlink_domain=d)
        for g, d in zip(gpus(count=len(domains), node="a"), domains, strict=True)
    )
    sim = Sim()
    assert sim.register("a", gpu_list=laid) is None
    return sim.state.nodes["a"]


@settings(max_examples=200, deadline=None)
@given(DOMAINS, st.integers(1, 8))
def test_a_replica_gets_exactly_the_gpus_it_asks_for_whatever_the_domains(
    domains: list[int | None], count: int
) -> None:
    node = node_of(domains)
    picked = NodeCapacity(node).pick("h100-80g", count)
    if count > len(domains):
        assert picked is None
        return
    assert picked is not None
    chosen, fits = picked
    assert len(chosen) == count
    assert len(set(chosen)) == count
    if fits and count > 1:  # said to fit one domain: it does
        assert len({domains[g] for g in chosen}) == 1
        assert domains[chosen[0]] is not None


@settings(max_examples=200, deadline=None)
@given(st.sets(st.integers(PORT_BASE, PORT_BASE + 24)))
def test_a_shards_port_and_the_next_are_both_free(used: set[int]) -> None:
    """Ports a replica placed at an odd port holds (8101 and 8102) leave 8100 unusable:
    its next port is taken."""
    node = node_of([0])
    node.ports = {p: "r" for p in used}
    port = NodeCapacity(node).port()
    assert port is not None
    assert port not in used
    assert port + 1 not in used
    assert port < PORT_LIMIT - 1


def test_a_node_with_no_free_pair_of_ports_gets_nothing_and_says_why() -> None:
    sim = Sim()
    assert sim.register("a") is None
    node = sim.state.nodes["a"]
    node.ports = {p: "r" for p in range(PORT_BASE + 1, PORT_LIMIT, 2)}  # every second port
    result = placement.place(sim.state, profile("m"))
    assert isinstance(result, placement.Unplaceable)
    assert "no free port" in result.nodes["a"]
