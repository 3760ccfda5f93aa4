"""Hypothesis strategies that build valid llmgw events, shared by the property tests."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

from llmgw.core import events
from llmgw.core.inventory import Fabric, Gpu
from llmgw.core.profile import Deadlines, LaunchSpec, ModelProfile

tokens = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,15}", fullmatch=True)
texts = st.text(max_size=20)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
small = st.integers(min_value=0, max_value=64)

gpus = st.builds(
    Gpu,
    index=small,
    uuid=texts,
    name=texts,
    gpu_class=tokens,
    memory_mib=st.integers(0, 200_000),
    compute_capability=st.sampled_from(["8.0", "8.9", "9.0"]),
    nvlink_domain=st.none() | small,
    ecc_uncorrected=small,
    foreign_memory_mib=small,
)
fabrics = st.builds(
    Fabric, name=tokens, kind=st.sampled_from(["infiniband", "roce"]), hcas=st.tuples(tokens)
)
profiles = st.builds(
    ModelProfile,
    name=tokens,
    engine=st.sampled_from(["vllm", "sglang", "sim", "llamacpp"]),
    aliases=st.lists(tokens, max_size=2).map(tuple),
    replicas=small,
    tensor_parallel=st.integers(1, 8),
    env=st.dictionaries(tokens, texts, max_size=2),
    deadlines=st.builds(Deadlines, idle_s=st.floats(0.1, 100)),
)
launches = st.builds(
    LaunchSpec,
    engine=st.sampled_from(["vllm", "sglang", "sim", "llamacpp"]),
    model=texts,
    served_name=tokens,
    port=st.integers(1, 65535),
    gpus=st.lists(small, max_size=8).map(tuple),
    env=st.dictionaries(tokens, texts, max_size=3),
)


def event_strategy(cls: type[events.Event]) -> st.SearchStrategy[Any]:
    """Any instance of one event class, with subject-safe identifiers."""
    # Every float field is a time: NaN or infinity would not survive JSON (null).
    overrides: dict[str, st.SearchStrategy[Any]] = {
        "id": tokens,
        "ts": times,
        "last_heartbeat": times,
    }
    for name in ("node", "replica_id", "model", "operator", "leader", "name"):
        overrides[name] = tokens
    overrides.update(
        gpus=st.lists(gpus, max_size=3).map(tuple),
        fabrics=st.lists(fabrics, max_size=2).map(tuple),
        profile=profiles,
        launch=launches,
    )
    if cls in (events.Heartbeat, events.GpuHealthChanged):
        overrides["gpus"] = st.lists(st.builds(events.GpuHealth, index=small), max_size=3).map(
            tuple
        )
    fields = {f.name for f in __import__("msgspec").structs.fields(cls)}
    return st.builds(cls, **{k: v for k, v in overrides.items() if k in fields})


any_event = st.one_of([event_strategy(cls) for cls in events.EVENT_TYPES])
