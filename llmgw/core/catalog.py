"""The model catalog's rules: which ModelProfiles the fleet accepts, and why not.

A profile is declared by an operator (`llmgw ctl`) or by the control plane's
config file and lands in the log as ModelDeclared / ModelChanged. The fold
(`llmgw.core.state`) refuses an invalid one with these messages, the control
service validates its config file with them before writing anything, and
placement reuses `fp8_capable`. Each message says what to change, because an
engine that refuses a profile does so after minutes of loading.

Purely computational: no I/O.
"""

from __future__ import annotations

import re
import reprlib
from collections.abc import Iterable, Mapping
from typing import Any, get_args

import msgspec

from llmgw.core.profile import Dtype, Engine, ModelProfile

ENGINES: tuple[str, ...] = get_args(Engine)
DTYPES: tuple[str, ...] = get_args(Dtype)

# FP8 tensor cores arrived with Ada (8.9) and Hopper (9.0). Below that vLLM
# falls back to a weight-only path that is slower than bf16, so an fp8 profile
# on an A100 is refused rather than silently slow.
FP8_MIN_CAPABILITY = (8, 9)

# Compute capability by GPU family (the part of a class before "-<GiB>g"), so
# the catalog can refuse fp8 on a class before any node of it registers.
# Placement checks each GPU's own reported capability as well.
FAMILY_CAPABILITY: dict[str, tuple[int, int]] = {
    "p100": (6, 0),
    "v100": (7, 0),
    "titanv": (7, 0),
    "t4": (7, 5),
    "rtx2080super": (7, 5),
    "a100": (8, 0),
    "a30": (8, 0),
    "a10": (8, 6),
    "a10g": (8, 6),
    "a40": (8, 6),
    "rtxa5000": (8, 6),
    "rtxa6000": (8, 6),
    "rtx3090": (8, 6),
    "rtx3080": (8, 6),
    "l4": (8, 9),
    "l40": (8, 9),
    "l40s": (8, 9),
    "rtx4090": (8, 9),
    "rtx4080super": (8, 9),
    "rtx6000ada": (8, 9),
    "h100": (9, 0),
    "h200": (9, 0),
    "gh200": (9, 0),
    "b200": (10, 0),
}

_CLASS = re.compile(r"[a-z0-9]+-\d+g")
_NAME = re.compile(r"[^\s@-][^\s]{0,255}")
"""A model's name or alias: no whitespace, and no leading - or @ (engines read those on
their command line as an option or a file of arguments)."""

# Settings the control plane decides per shard; a profile that sets them would
# fight the placement (a fixed port collides with the next replica on the node,
# an open NCCL_IB_HCA lets NCCL pick an adapter whose peer is unreachable).
_OWNED_ENV = {
    "NCCL_IB_HCA": "derived from the fabric placement chooses",
    "CUDA_VISIBLE_DEVICES": "set to the GPUs placement chooses",
}
_OWNED_ARGS = {
    "--port": "the control plane allocates a port per shard",
    "--host": "the agent binds engines itself",
    "--served-model-name": "use the profile's name and aliases",
    "--tensor-parallel-size": "use tensor_parallel",
    "--tp-size": "use tensor_parallel",
    "--pipeline-parallel-size": "use pipeline_parallel",
    "--pp-size": "use pipeline_parallel",
    "--nnodes": "use nodes",
    "--node-rank": "placement decides each shard's rank",
    "--master-addr": "placement decides the head node",
    "--master-port": "placement decides the head port",
    "--dist-init-addr": "placement decides the head node",
    "--max-model-len": "use max_model_len",
    "--dtype": "use dtype",
}


class CatalogError(ValueError):
    """A profile the fleet cannot run; `problems` lists every reason with its fix."""

    def __init__(self, name: str, problems: list[str]) -> None:
        self.problems = problems
        super().__init__(f"model {name[:80]!r}: " + "; ".join(problems))


def capability(value: str) -> tuple[int, int] | None:
    """'8.9' -> (8, 9); None when the string is not a compute capability."""
    major, _, minor = value.strip().partition(".")
    if not major.isdigit() or not (minor or "0").isdigit():
        return None
    return int(major), int(minor or "0")


def fp8_capable(compute_capability: str) -> bool:
    cc = capability(compute_capability)
    return cc is not None and cc >= FP8_MIN_CAPABILITY


def class_capability(gpu_class: str) -> tuple[int, int] | None:
    """The compute capability of a GPU class's family, when the catalog knows it."""
    family = gpu_class.rpartition("-")[0] if _CLASS.fullmatch(gpu_class) else gpu_class
    return FAMILY_CAPABILITY.get(family)


def names_of(profile: ModelProfile) -> tuple[str, ...]:
    """Every name a client may ask for to reach this model."""
    return (profile.name, *profile.aliases)


def sharing(names: Iterable[str], owners: Mapping[str, ModelProfile]) -> list[ModelProfile]:
    """The models `owners` (each name and alias -> its model) holds under any of `names`,
    once each: the `others` to check a model of those names against, found without going
    through every model (a list of thousands checked entry by entry was quadratic)."""
    found = {id(p): p for n in names if (p := owners.get(n)) is not None}
    return list(found.values())


def problems(profile: ModelProfile, others: Iterable[ModelProfile] = ()) -> list[str]:
    """Everything wrong with `profile`, each with what to change; empty when it is valid.

    `others` are the other declared models: aliases must not shadow their names.
    """
    return [
        *_shape_problems(profile),
        *_limit_problems(profile),
        *_owned_problems(profile),
        *_name_problems(profile, others),
    ]


def _shape_problems(p: ModelProfile) -> list[str]:
    """The engine, the parallelism and the GPUs it asks for."""
    out: list[str] = []
    if not _NAME.fullmatch(p.name):
        out.append(
            "name must be 1-256 characters without whitespace, not beginning with - or @, "
            "e.g. llama-3.1-8b"
        )
    if p.engine not in ENGINES:
        out.append(f"engine {p.engine!r} is not supported: use one of {', '.join(ENGINES)}")
    if p.replicas < 0:
        out.append(f"replicas is {p.replicas}: use 0 (declared but stopped) or more")
    for field, text in (("model", p.model), ("tokenizer", p.tokenizer)):
        if text[:1] in ("-", "@"):
            out.append(
                f"{field} {text[:80]!r} begins with {text[0]!r}, which an engine reads as an "
                "option: give a path or a Hugging Face id"
            )
    if p.autoscale is not None:
        out.extend(p.autoscale.problems(p.replicas))
    for field, value in (
        ("tensor_parallel", p.tensor_parallel),
        ("pipeline_parallel", p.pipeline_parallel),
        ("nodes", p.nodes),
    ):
        if value < 1:
            out.append(f"{field} is {value}: use 1 or more")
    if p.nodes >= 1 and p.gpus_per_replica >= 1 and p.gpus_per_replica % p.nodes:
        out.append(
            f"tensor_parallel × pipeline_parallel = {p.gpus_per_replica} GPUs cannot be split "
            f"evenly over {p.nodes} nodes: make it a multiple of nodes (e.g. tensor_parallel: "
            f"{p.nodes * max(1, -(-p.gpus_per_replica // p.nodes))})"
        )
    if p.nodes > 1 and p.engine == "llamacpp":
        out.append(
            "engine llamacpp cannot run one replica on several nodes (it has no NCCL): "
            "set nodes: 1, or use vllm or sglang"
        )
    if p.gpu_class and not _CLASS.fullmatch(p.gpu_class):
        out.append(
            f"gpu_class {p.gpu_class!r} is not a GPU class: use the family and the memory in "
            "GiB as `llmgw agent inventory` reports it, e.g. h100-80g or l40s-45g"
        )
    if p.dtype == "fp8" and p.gpu_class:
        cc = class_capability(p.gpu_class)
        if cc is not None and cc < FP8_MIN_CAPABILITY:
            out.append(
                f"dtype fp8 needs compute capability 8.9 or newer, and {p.gpu_class} has "
                f"{cc[0]}.{cc[1]}: use dtype bfloat16, or a gpu_class such as h100-80g or l40s-45g"
            )
    return out


def _limit_problems(p: ModelProfile) -> list[str]:
    """Lengths, timeouts and deadlines."""
    out: list[str] = []
    if p.max_model_len is not None and p.max_model_len < 1:
        out.append(f"max_model_len is {p.max_model_len}: remove it or use a positive length")
    for field, seconds in (
        ("start_timeout_s", p.start_timeout_s),
        ("load_timeout_s", p.load_timeout_s),
    ):
        if not seconds > 0:
            out.append(f"{field} is {seconds}: use a positive number of seconds")
    d = p.deadlines
    for field in ("connect_s", "headers_s", "first_token_s", "idle_s", "total_s"):
        value = getattr(d, field)
        if not value > 0:
            out.append(f"deadlines.{field} is {value}: use a positive number of seconds")
    out.extend(p.queue.problems())
    return out


def _owned_problems(p: ModelProfile) -> list[str]:
    """Settings the control plane decides per shard."""
    out: list[str] = []
    for key, why in _OWNED_ENV.items():
        if key in p.env:
            out.append(f"env sets {key}, which is {why}: remove it")
    for arg in p.engine_args:
        flag = arg.split("=", 1)[0]
        if flag in _OWNED_ARGS:
            out.append(f"engine_args sets {flag}: remove it ({_OWNED_ARGS[flag]})")
    return out


def _name_problems(p: ModelProfile, others: Iterable[ModelProfile]) -> list[str]:
    """Aliases and fallbacks, and names other models already use."""
    out: list[str] = []
    seen: set[str] = set()
    for alias in p.aliases:
        if alias == p.name:
            out.append(f"alias {alias!r} repeats the model's own name: remove it")
        elif alias in seen:
            out.append(f"alias {alias!r} is listed twice: remove one")
        elif not _NAME.fullmatch(alias):
            out.append(
                f"alias {alias!r} must be 1-256 characters without whitespace, not beginning "
                "with - or @"
            )
        seen.add(alias)
    if p.name in p.fallbacks:
        out.append("fallbacks lists the model itself: remove it")
    mine = set(names_of(p))
    for other in others:
        if other.name == p.name:
            continue
        clash = sorted(mine & set(names_of(other)))
        if clash:
            out.append(
                f"{', '.join(repr(c) for c in clash)} is already a name or alias of model "
                f"{other.name!r}: requests would be routed ambiguously, pick another alias"
            )
    return out


def check(profile: ModelProfile, others: Iterable[ModelProfile] = ()) -> ModelProfile:
    """Return `profile` if it is valid, else raise CatalogError with every problem."""
    found = problems(profile, others)
    if found:
        raise CatalogError(profile.name, found)
    return profile


def parse(raw: Mapping[str, Any], others: Iterable[ModelProfile] = ()) -> ModelProfile:
    """Build and check a profile from a config mapping (YAML, JSON); CatalogError when wrong.

    msgspec's own messages name the field; this adds what to do about the common ones.
    """
    name = str(raw.get("name", "?"))
    # reprlib: a file's value may be a megabyte of text, or a long list; quoted, shortened.
    engine = raw.get("engine")
    if engine is not None and engine not in ENGINES:
        raise CatalogError(
            name,
            [f"engine {reprlib.repr(engine)} is not supported: use one of {', '.join(ENGINES)}"],
        )
    dtype = raw.get("dtype")
    if dtype is not None and dtype not in DTYPES:
        raise CatalogError(
            name, [f"dtype {reprlib.repr(dtype)} is not supported: use one of {DTYPES}"]
        )
    try:
        profile = msgspec.convert(raw, ModelProfile)
    except msgspec.ValidationError as exc:
        raise CatalogError(name, [f"{exc}: fix or remove that field"]) from None
    return check(profile, others)


def launch_relevant(a: ModelProfile, b: ModelProfile) -> bool:
    """True when replicas of `a` must be replaced to run as `b` (not only re-counted/routed)."""
    strip = {"replicas": 0, "aliases": (), "fallbacks": (), "deadlines": a.deadlines,
             "autoscale": None, "queue": a.queue}  # fmt: skip
    return msgspec.structs.replace(a, **strip) != msgspec.structs.replace(b, **strip)
