"""Catalog rules: every refusal names the field and says what to change."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.core import catalog
from llmgw.core.profile import Deadlines, ModelProfile

from .strategies import profiles


def mk(**kw: Any) -> ModelProfile:
    kw.setdefault("name", "llama-3.1-8b")
    return ModelProfile(**kw)


REFUSED = [
    ("negative replicas", mk(replicas=-1), "replicas is -1: use 0"),
    ("zero tensor parallel", mk(tensor_parallel=0), "tensor_parallel is 0: use 1 or more"),
    ("zero nodes", mk(nodes=0), "nodes is 0"),
    (
        "GPUs not divisible by nodes",
        mk(tensor_parallel=6, nodes=4),
        "6 GPUs cannot be split evenly over 4 nodes: make it a multiple of nodes "
        "(e.g. tensor_parallel: 8)",
    ),
    (
        "fp8 below compute capability 8.9",
        mk(dtype="fp8", gpu_class="a100-80g"),
        "dtype fp8 needs compute capability 8.9 or newer, and a100-80g has 8.0: use dtype bfloat16",
    ),
    ("fp8 on a T4", mk(dtype="fp8", gpu_class="t4-15g"), "t4-15g has 7.5"),
    (
        "llama.cpp across nodes",
        mk(engine="llamacpp", nodes=2, tensor_parallel=2),
        "engine llamacpp cannot run one replica on several nodes",
    ),
    ("a GPU class that is a product name", mk(gpu_class="H100"), "e.g. h100-80g"),
    ("zero context", mk(max_model_len=0), "max_model_len is 0"),
    ("zero start timeout", mk(start_timeout_s=0), "start_timeout_s is 0"),
    ("zero idle deadline", mk(deadlines=Deadlines(idle_s=0)), "deadlines.idle_s is 0"),
    ("NCCL_IB_HCA in env", mk(env={"NCCL_IB_HCA": "mlx5"}), "env sets NCCL_IB_HCA"),
    (
        "CUDA_VISIBLE_DEVICES in env",
        mk(env={"CUDA_VISIBLE_DEVICES": "0"}),
        "env sets CUDA_VISIBLE_DEVICES",
    ),
    ("--port in engine args", mk(engine_args=("--port=9000",)), "engine_args sets --port"),
    (
        "--tensor-parallel-size in engine args",
        mk(engine_args=("--tensor-parallel-size", "8")),
        "use tensor_parallel",
    ),
    ("alias equal to name", mk(aliases=("llama-3.1-8b",)), "repeats the model's own name"),
    ("alias twice", mk(aliases=("l", "l")), "alias 'l' is listed twice"),
    ("fallback to itself", mk(fallbacks=("llama-3.1-8b",)), "fallbacks lists the model itself"),
    ("whitespace in name", mk(name="llama 3"), "without whitespace"),
]


@pytest.mark.parametrize(("case", "profile", "message"), REFUSED, ids=[c[0] for c in REFUSED])
def test_each_rule_refuses_with_what_to_change(
    case: str, profile: ModelProfile, message: str
) -> None:
    found = catalog.problems(profile)
    assert any(message in p for p in found), found
    with pytest.raises(catalog.CatalogError, match="llama"):
        catalog.check(profile)


ACCEPTED = [
    ("defaults", mk()),
    ("fp8 on h100", mk(dtype="fp8", gpu_class="h100-80g")),
    ("fp8 on l40s", mk(dtype="fp8", gpu_class="l40s-45g")),
    ("fp8 on an unknown family is left to placement", mk(dtype="fp8", gpu_class="zz9-80g")),
    ("two nodes x 8", mk(tensor_parallel=8, pipeline_parallel=2, nodes=2)),
    ("sixteen over two nodes", mk(tensor_parallel=16, nodes=2)),
    ("zero replicas: declared, stopped", mk(replicas=0)),
    ("aliases", mk(aliases=("llama", "llama-8b"))),
    ("sim engine multi-node", mk(engine="sim", tensor_parallel=2, nodes=2)),
]


@pytest.mark.parametrize(("case", "profile"), ACCEPTED, ids=[c[0] for c in ACCEPTED])
def test_valid_profiles_pass(case: str, profile: ModelProfile) -> None:
    assert catalog.problems(profile) == []


def test_an_alias_colliding_with_another_models_name_is_refused() -> None:
    other = mk(name="qwen", aliases=("chat",))
    found = catalog.problems(mk(aliases=("chat",)), [other])
    assert found == [
        "'chat' is already a name or alias of model 'qwen': requests would be routed "
        "ambiguously, pick another alias"
    ]
    assert catalog.problems(mk(name="qwen", aliases=("x",)), [mk(aliases=("qwen",))])
    # A model is not compared with its own previous version.
    assert catalog.problems(mk(aliases=("a",)), [mk(aliases=("a",))]) == []


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        ({"name": "m", "engine": "tgi"}, "engine 'tgi' is not supported: use one of vllm"),
        ({"name": "m", "dtype": "int3"}, "dtype 'int3' is not supported"),
        ({"name": "m", "replicas": "two"}, "fix or remove that field"),
        ({"name": "m", "colour": "blue"}, "fix or remove that field"),
        ({"name": "m", "replicas": -2}, "replicas is -2"),
    ],
)
def test_parse_explains_bad_config_mappings(raw: dict[str, Any], message: str) -> None:
    with pytest.raises(catalog.CatalogError) as info:
        catalog.parse(raw)
    assert message in str(info.value)


def test_parse_accepts_a_good_mapping() -> None:
    prof = catalog.parse({"name": "m", "engine": "sim", "replicas": 2})
    assert prof.replicas == 2
    assert prof.engine == "sim"


def test_capabilities() -> None:
    assert catalog.capability("8.9") == (8, 9)
    assert catalog.capability("nope") is None
    assert catalog.fp8_capable("9.0")
    assert not catalog.fp8_capable("8.6")
    assert not catalog.fp8_capable("")
    assert catalog.class_capability("l40s-45g") == (8, 9)
    assert catalog.class_capability("unknown-1g") is None


def test_launch_relevant_changes() -> None:
    base = mk(replicas=1)
    assert not catalog.launch_relevant(base, mk(replicas=5, aliases=("x",)))
    assert catalog.launch_relevant(base, mk(tensor_parallel=2))
    assert catalog.launch_relevant(base, mk(engine_args=("--enforce-eager",)))


@given(profiles, st.lists(profiles, max_size=3))
def test_problems_never_raise_on_any_profile(
    profile: ModelProfile, others: list[ModelProfile]
) -> None:
    found = catalog.problems(profile, others)
    assert all(isinstance(p, str) and p for p in found)


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"name": "-m"}, "not beginning with - or @"),
        ({"aliases": ("--trust-remote-code",)}, "not beginning with - or @"),
        ({"aliases": ("@args",)}, "not beginning with - or @"),
        ({"model": "--trust-remote-code"}, "model '--trust-remote-code' begins with '-'"),
        ({"tokenizer": "@/etc/x"}, "tokenizer '@/etc/x' begins with '@'"),
    ],
)
def test_names_and_paths_an_engine_would_read_as_options_are_refused(
    fields: dict[str, Any], says: str
) -> None:
    assert any(says in p for p in catalog.problems(mk(**fields))), catalog.problems(mk(**fields))
