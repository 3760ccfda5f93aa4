"""Hypothesis strategies that build valid llmgw events, shared by the property tests."""

from __future__ import annotations

from typing import Any

import msgspec
from hypothesis import strategies as st

from llmgw.core import events, limits
from llmgw.core.inventory import Fabric, Gpu
from llmgw.core.profile import Deadlines, LaunchSpec, ModelProfile


def _whole(pattern: str) -> str:
    """A whole-value pattern's body, for `from_regex(..., fullmatch=True)`."""
    return pattern.removeprefix("^").removesuffix(limits.WHOLE_END).removesuffix("$")


def from_type_info(t: Any) -> st.SearchStrategy[Any]:
    """Values of one msgspec type within its declared constraints (llmgw/core/limits.py).

    Hypothesis's own inference ignores msgspec.Meta bounds; this keeps strings and
    collections short, as the hand-made strategies below do.
    """
    ti = msgspec.inspect
    if isinstance(t, ti.IntType):
        lo = t.ge if t.ge is not None else (t.gt + 1 if t.gt is not None else -(2**53))
        hi = t.le if t.le is not None else (t.lt - 1 if t.lt is not None else 2**53)
        return st.integers(lo, hi)
    if isinstance(t, ti.FloatType):
        return st.floats(
            min_value=t.ge if t.ge is not None else t.gt if t.gt is not None else -1e12,
            max_value=t.le if t.le is not None else 1e12,
            exclude_min=t.ge is None and t.gt is not None,
            allow_nan=False,
            allow_infinity=False,
        )
    if isinstance(t, ti.StrType) and t.pattern:
        return st.from_regex(_whole(t.pattern), fullmatch=True).filter(
            lambda s: len(s) <= (t.max_length or 10**9)
        )
    if isinstance(t, ti.StrType):
        return st.text(max_size=min(t.max_length or 20, 20))
    if isinstance(t, ti.BoolType):
        return st.booleans()
    if isinstance(t, ti.NoneType):
        return st.none()
    if isinstance(t, ti.LiteralType):
        return st.sampled_from(t.values)
    if isinstance(t, ti.UnionType):
        return st.one_of([from_type_info(x) for x in t.types])
    if isinstance(t, ti.VarTupleType | ti.ListType):
        items = st.lists(from_type_info(t.item_type), max_size=min(t.max_length or 3, 3))
        return items.map(tuple) if isinstance(t, ti.VarTupleType) else items
    if isinstance(t, ti.DictType):
        return st.dictionaries(from_type_info(t.key_type), from_type_info(t.value_type), max_size=2)
    if isinstance(t, ti.StructType):
        return builds(t.cls)
    raise TypeError(f"no strategy for {t!r}")


def builds(cls: type[Any], **overrides: st.SearchStrategy[Any]) -> st.SearchStrategy[Any]:
    """st.builds for a msgspec Struct: required fields within their bounds, `overrides` as given."""
    fields = {
        f.name: from_type_info(f.type)
        for f in msgspec.inspect.type_info(cls).fields  # type: ignore[attr-defined]
        if f.required
    }
    fields.update(overrides)
    return st.builds(cls, **fields)


tokens = st.from_regex(r"[a-z0-9][a-z0-9_-]{0,15}", fullmatch=True)
texts = st.text(max_size=20)
times = st.floats(min_value=0, max_value=4e9, allow_nan=False)
small = st.integers(min_value=0, max_value=64)

gpus = builds(
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
fabrics = builds(
    Fabric, name=tokens, kind=st.sampled_from(["infiniband", "roce"]), hcas=st.tuples(tokens)
)
profiles = builds(
    ModelProfile,
    name=tokens,
    engine=st.sampled_from(["vllm", "sglang", "sim", "llamacpp"]),
    aliases=st.lists(tokens, max_size=2).map(tuple),
    replicas=small,
    tensor_parallel=st.integers(1, 8),
    env=st.dictionaries(tokens, texts, max_size=2),
    deadlines=builds(Deadlines, idle_s=st.floats(0.1, 100)),
)
launches = builds(
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
        overrides["gpus"] = st.lists(builds(events.GpuHealth, index=small), max_size=3).map(tuple)
    fields = {f.name for f in msgspec.structs.fields(cls)}
    return builds(cls, **{k: v for k, v in overrides.items() if k in fields})


any_event = st.one_of([event_strategy(cls) for cls in events.EVENT_TYPES])
