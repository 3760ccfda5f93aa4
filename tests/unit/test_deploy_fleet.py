"""deploy/fleet/ is a two-node fleet on one InfiniBand fabric: every file loads with its
service's own loader, and the catalog it ships places as its comments promise."""

from __future__ import annotations

from pathlib import Path

import msgspec
import yaml

from llmgw.agent import config as agent_config
from llmgw.control import config as control_config
from llmgw.core import events, placement, reconcile, state
from llmgw.core.inventory import Fabric
from llmgw.ctl import catalogfile
from llmgw.router import config as router_config
from tests.unit import scenarios

FLEET = Path(__file__).resolve().parents[2] / "deploy" / "fleet"


def test_every_file_loads_and_the_nodes_share_one_fabric() -> None:
    control = control_config.load(FLEET / "control.yaml")
    assert control.name == "control-1"
    nodes = [agent_config.load(FLEET / f"gpu-0{i}.yaml", environ={}) for i in (1, 2)]
    assert [n.node_id for n in nodes] == ["gpu-01", "gpu-02"]
    assert {n.fabrics[0].name for n in nodes} == {"ib-pod-a"}
    router = msgspec.convert(
        yaml.safe_load((FLEET / "router.yaml").read_text()), router_config.RouterConfig
    )
    assert router_config.validate(router) == []
    assert router.log is not None
    assert router.log.name == "router-1"


def test_the_catalog_places_one_replica_per_node_and_the_big_one_across_both() -> None:
    models = catalogfile.parse((FLEET / "models.yaml").read_text(), "models.yaml")
    nodes = [agent_config.load(FLEET / f"gpu-0{i}.yaml", environ={}) for i in (1, 2)]
    cluster = state.ClusterState()
    seq = 0
    for node in nodes:
        fabric = Fabric(name=node.fabrics[0].name, hcas=node.fabrics[0].hcas)
        seq += 1
        assert (
            state.apply(cluster, scenarios.registered(node.node_id, fabrics=[fabric]), seq) is None
        )

    by_name = {m.name: m for m in models}
    big = placement.place(cluster, by_name["llama-3.1-405b"])
    assert isinstance(big, placement.Placement), big
    assert sorted(s.node for s in big.shards) == ["gpu-01", "gpu-02"]
    assert all(len(s.gpus) == 8 for s in big.shards)

    for model in models:
        seq += 1
        declared = events.ModelDeclared(id=f"d{seq}", ts=1.0, operator="t", profile=model)
        assert state.apply(cluster, declared, seq) is None
    decisions = reconcile.reconcile(cluster, 2.0, epoch=1)
    starts = [d for d in decisions if isinstance(d, events.StartShard)]
    multi = [s for s in starts if s.launch.nnodes == 2]
    assert len(multi) == 2
    # NCCL may use exactly the fabric's adapters, nothing else.
    assert {s.launch.env["NCCL_IB_HCA"] for s in multi} == {"=mlx5_0,mlx5_1,mlx5_2,mlx5_3"}
