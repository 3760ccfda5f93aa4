"""The agent's metrics (llmgw.agent.metrics): transitions, phase durations and live gauges."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from llmgw.agent.metrics import AgentMetrics, Live
from llmgw.agent.shards import ShardView
from llmgw.core.phases import SHARD_PHASES


def view(phase: str, generation: int = 1, replica: str = "r1") -> ShardView:
    return ShardView(replica_id=replica, generation=generation, shard=0, phase=phase)  # type: ignore[arg-type]


def sample(m: AgentMetrics, name: str, **labels: str) -> float:
    value = m.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_phases_are_timed_from_one_change_to_the_next() -> None:
    m = AgentMetrics(lambda: Live(started=True, connected=True, outbox_events=3, outbox_bytes=9))
    m.observe(view("starting"), 100.0)
    m.observe(view("starting"), 101.0)  # announced again: no change
    m.observe(view("loading"), 104.0)
    m.observe(view("serving"), 110.0)
    m.observe(view("failed"), 170.0)
    assert sample(m, "llmgw_agent_shard_transitions_total", phase="starting") == 1
    assert sample(m, "llmgw_agent_shard_transitions_total", phase="failed") == 1
    assert sample(m, "llmgw_agent_shard_phase_seconds_sum", phase="starting") == 4.0
    assert sample(m, "llmgw_agent_shard_phase_seconds_sum", phase="loading") == 6.0
    assert sample(m, "llmgw_agent_shard_phase_seconds_sum", phase="serving") == 60.0
    # A new generation starts its own clock; nothing of the ended one is kept.
    m.observe(view("starting", generation=2), 200.0)
    assert sample(m, "llmgw_agent_shard_phase_seconds_count", phase="failed") == 0
    assert sample(m, "llmgw_agent_outbox_events") == 3
    assert sample(m, "llmgw_agent_nats_connected") == 1


def test_live_gauges_list_every_phase_and_probe_result() -> None:
    shards = [view("serving"), view("serving", replica="r2"), view("loading", replica="r3")]
    m = AgentMetrics(
        lambda: Live(
            started=False,
            connected=False,
            outbox_events=0,
            outbox_bytes=0,
            shards=shards,
            probes={"down": 4, "ready": 2},
        )
    )
    assert sample(m, "llmgw_agent_shards", phase="serving") == 2
    assert sample(m, "llmgw_agent_shards", phase="loading") == 1
    assert m.registry.get_sample_value("llmgw_agent_shards", {"phase": "failed"}) == 0
    assert m.registry.get_sample_value("llmgw_agent_startup_probes", {"result": "up"}) == 0
    assert sample(m, "llmgw_agent_startup_probes", result="down") == 4
    assert sample(m, "llmgw_agent_started") == 0


@given(st.lists(st.tuples(st.sampled_from(SHARD_PHASES), st.floats(0, 1e3)), max_size=30))
def test_every_phase_change_is_counted_once_and_every_duration_is_non_negative(
    steps: list[tuple[str, float]],
) -> None:
    m = AgentMetrics(lambda: Live(started=True, connected=True, outbox_events=0, outbox_bytes=0))
    now, changes, current = 0.0, 0, None
    for phase, dt in steps:
        now += dt
        m.observe(view(phase), now)
        if phase != current:
            changes += 1
        current = None if phase in ("stopped", "failed") else phase
    counted = sum(sample(m, "llmgw_agent_shard_transitions_total", phase=p) for p in SHARD_PHASES)
    assert counted == changes
    for p in SHARD_PHASES:
        assert sample(m, "llmgw_agent_shard_phase_seconds_sum", phase=p) >= 0
