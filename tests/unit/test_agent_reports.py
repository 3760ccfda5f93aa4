"""The events the agent will publish round-trip through the codec and land on its own subjects."""

from __future__ import annotations

from llmgw.agent import reports
from llmgw.agent.config import AgentConfig, launch_context
from llmgw.agent.discovery import simulated
from llmgw.agent.shards import ShardView
from llmgw.core import events, limits, placement
from llmgw.core.inventory import Fabric, Hca, Inventory


def test_registration_lists_only_live_shards() -> None:
    inventory = Inventory(
        gpus=simulated.parse_spec("2xh100-80g"),
        fabrics=(Fabric(name="ib-a", hcas=("mlx5_0",)),),
    )
    shards = [
        ShardView(replica_id="r1", generation=2, shard=0, phase="serving", gpus=(0,),
                  endpoint="http://n:20001"),
        ShardView(replica_id="r2", generation=1, shard=0, phase="failed", gpus=(1,)),
    ]  # fmt: skip
    event = reports.registered(
        node="node-a",
        address="10.0.0.7",
        inventory=inventory,
        shards=shards,
        agent_version="0.1.0",
        event_id="ev-1",
        ts=1.0,
    )
    assert events.subject_of(event) == "llmgw.events.node.node-a.registered"
    assert [s.replica_id for s in event.shards] == ["r1"]
    assert event.shards[0].endpoint == "http://n:20001"
    assert events.decode(events.encode(event)) == event


def test_heartbeat_carries_gpu_health() -> None:
    gpus = simulated.parse_spec("2xh100-80g")
    event = reports.heartbeat(node="node-a", seq=3, gpus=gpus, event_id="hb", ts=2.0)
    assert events.subject_of(event) == "llmgw.events.node.node-a.heartbeat"
    assert [h.index for h in event.gpus] == [0, 1]
    assert events.decode(events.encode(event)) == event


def test_shard_status_event() -> None:
    view = ShardView(
        replica_id="r1", generation=2, shard=1, phase="failed", error="boom",
        log_tail=("a", "b"), pid=42,
    )  # fmt: skip
    event = reports.status_event(view, node="node-a", event_id="s1", ts=3.0)
    assert events.subject_of(event) == "llmgw.events.node.node-a.shard"
    assert (event.log_tail, event.pid, event.shard) == (("a", "b"), 42, 1)


def test_launch_context_from_config() -> None:
    cfg = AgentConfig(
        node_id="n", engine_host="10.0.0.7", engine_commands={"vllm": ("/opt/vllm", "serve")}
    )
    inventory = Inventory(fabrics=(Fabric(name="ib-a", hcas=("mlx5_0",)),))
    context = launch_context(cfg, inventory)
    assert context.host == "10.0.0.7"
    assert context.port_range == (placement.PORT_BASE, placement.PORT_LIMIT - 1)
    assert context.command("vllm") == ("/opt/vllm", "serve")
    assert context.command("sglang")[1:] == ("-m", "sglang.launch_server")
    assert context.fabrics == inventory.fabrics


def test_an_over_long_failure_is_reported_cut_never_refused() -> None:
    """A traceback longer than the log's bound on a text: the readers would refuse the
    whole event, and the control plane would never learn that the shard failed."""
    error = "x" * (3 * limits.MAX_TEXT)
    view = ShardView(replica_id="r1", generation=2, shard=0, phase="failed", error=error)
    event = reports.status_event(view, node="node-a", event_id="s1", ts=3.0)
    decoded = events.decode(events.encode(event))
    assert isinstance(decoded, events.ShardStatus)
    assert decoded.error == error[: limits.MAX_TEXT]
    assert decoded.phase == "failed"


def test_a_serving_shards_status_carries_its_endpoint_and_key() -> None:
    view = ShardView(
        replica_id="r1", generation=2, shard=0, phase="serving",
        endpoint="http://10.0.0.7:20001", api_key="k" * 43,
    )  # fmt: skip
    event = reports.status_event(view, node="node-a", event_id="s2", ts=4.0)
    assert (event.endpoint, event.api_key) == ("http://10.0.0.7:20001", "k" * 43)


def test_registration_carries_the_adapters_and_the_metrics_address() -> None:
    hca = Hca(name="mlx5_0", port=1, state="ACTIVE", rate_gbps=400.0, link_layer="InfiniBand")
    inventory = Inventory(gpus=simulated.parse_spec("1xh100-80g"), hcas=(hca,))
    event = reports.registered(
        node="node-a", address="10.0.0.7", inventory=inventory, shards=[],
        agent_version="0.1.0", event_id="ev-2", ts=1.0, metrics="http://10.0.0.7:9400/metrics",
    )  # fmt: skip
    assert event.hcas == (hca,)
    assert event.metrics == "http://10.0.0.7:9400/metrics"
