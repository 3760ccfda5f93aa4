"""Golden argv/env per engine and profile, every flag checked against the engines' real parsers."""

from __future__ import annotations

import json
import re
import sys
from functools import cache
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.engines import LaunchContext, LaunchRefused, validation
from llmgw.core.inventory import Fabric, Gpu, Inventory
from llmgw.core.profile import LaunchSpec

REFERENCE = Path(__file__).resolve().parents[1] / "fixtures" / "engines"
H100 = Inventory(gpus=simulated.parse_spec("8xh100-80g"))
FABRIC = Fabric(name="ib-a", kind="infiniband", hcas=("mlx5_0", "mlx5_1", "mlx5_4", "mlx5_5"))
CONTEXT = LaunchContext(host="0.0.0.0", fabrics=(FABRIC,))


def spec(engine: str = "vllm", **fields: object) -> LaunchSpec:
    base: dict[str, object] = {
        "engine": engine,
        "model": "meta-llama/Llama-3.1-8B-Instruct",
        "served_name": "llama-8b",
        "port": 20001,
        "gpus": (0,),
    }
    return LaunchSpec(**(base | fields))  # type: ignore[arg-type]


def multi_node(engine: str, rank: int) -> LaunchSpec:
    return spec(
        engine,
        model="/models/llama-405b",
        served_name="llama-405b",
        gpus=tuple(range(8)),
        tensor_parallel=8,
        pipeline_parallel=2,
        nnodes=2,
        node_rank=rank,
        head_address="10.0.0.1",
        head_port=29501,
        fabric="ib-a",
    )


TP8 = {"gpus": tuple(range(8)), "tensor_parallel": 8, "max_model_len": 32768, "dtype": "bfloat16"}
GPU_ENV = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0"}
ALL_GPUS = {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}
NCCL = {"NCCL_IB_HCA": "=mlx5_0,mlx5_1,mlx5_4,mlx5_5"}

GOLDEN: list[tuple[str, LaunchSpec, tuple[str, ...], dict[str, str]]] = [
    (
        "vllm single GPU",
        spec("vllm", aliases=("llama",)),
        (
            "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
            "--served-model-name", "llama-8b", "llama",
            "--host", "0.0.0.0", "--port", "20001",
            "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
        ),
        GPU_ENV,
    ),
    (
        "vllm TP 8",
        spec("vllm", **TP8),
        (
            "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
            "--served-model-name", "llama-8b",
            "--host", "0.0.0.0", "--port", "20001",
            "--tensor-parallel-size", "8", "--pipeline-parallel-size", "1",
            "--dtype", "bfloat16", "--max-model-len", "32768",
        ),
        ALL_GPUS,
    ),
    (
        "vllm multi-node head",
        multi_node("vllm", 0),
        (
            "vllm", "serve", "/models/llama-405b",
            "--served-model-name", "llama-405b",
            "--host", "0.0.0.0", "--port", "20001",
            "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
            "--nnodes", "2", "--node-rank", "0",
            "--master-addr", "10.0.0.1", "--master-port", "29501",
        ),
        ALL_GPUS | NCCL,
    ),
    (
        "vllm multi-node worker",
        multi_node("vllm", 1),
        (
            "vllm", "serve", "/models/llama-405b",
            "--tensor-parallel-size", "8", "--pipeline-parallel-size", "2",
            "--nnodes", "2", "--node-rank", "1",
            "--master-addr", "10.0.0.1", "--master-port", "29501",
            "--headless",
        ),
        ALL_GPUS | NCCL,
    ),
    (
        "vllm fp8 on H100",
        spec("vllm", dtype="fp8", engine_args=("--gpu-memory-utilization", "0.85")),
        (
            "vllm", "serve", "meta-llama/Llama-3.1-8B-Instruct",
            "--served-model-name", "llama-8b",
            "--host", "0.0.0.0", "--port", "20001",
            "--tensor-parallel-size", "1", "--pipeline-parallel-size", "1",
            "--quantization", "fp8",
            "--gpu-memory-utilization", "0.85",
        ),
        GPU_ENV,
    ),
    (
        "sglang single GPU",
        spec("sglang", aliases=("llama",), env={"HF_HOME": "/models/hf"}),
        (
            "python3", "-m", "sglang.launch_server",
            "--model-path", "meta-llama/Llama-3.1-8B-Instruct",
            "--tp-size", "1", "--pp-size", "1",
            "--host", "0.0.0.0", "--port", "20001",
            "--served-model-name", "llama-8b", "--enable-metrics",
        ),
        GPU_ENV | {"HF_HOME": "/models/hf"},
    ),
    (
        "sglang TP 8",
        spec("sglang", **TP8),
        (
            "python3", "-m", "sglang.launch_server",
            "--model-path", "meta-llama/Llama-3.1-8B-Instruct",
            "--tp-size", "8", "--pp-size", "1",
            "--dtype", "bfloat16", "--context-length", "32768",
            "--host", "0.0.0.0", "--port", "20001",
            "--served-model-name", "llama-8b", "--enable-metrics",
        ),
        ALL_GPUS,
    ),
    (
        "sglang multi-node head",
        multi_node("sglang", 0),
        (
            "python3", "-m", "sglang.launch_server",
            "--model-path", "/models/llama-405b",
            "--tp-size", "8", "--pp-size", "2",
            "--host", "0.0.0.0", "--port", "20001",
            "--served-model-name", "llama-405b", "--enable-metrics",
            "--nnodes", "2", "--node-rank", "0", "--dist-init-addr", "10.0.0.1:29501",
        ),
        ALL_GPUS | NCCL,
    ),
    (
        "sglang multi-node worker",
        multi_node("sglang", 1),
        (
            "python3", "-m", "sglang.launch_server",
            "--model-path", "/models/llama-405b",
            "--tp-size", "8", "--pp-size", "2",
            "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", "10.0.0.1:29501",
        ),
        ALL_GPUS | NCCL,
    ),
    (
        "llamacpp single GPU",
        spec("llamacpp", model="/models/smollm2.gguf", aliases=("small",), max_model_len=4096),
        (
            "llama-server", "--model", "/models/smollm2.gguf", "--alias", "llama-8b,small",
            "--host", "0.0.0.0", "--port", "20001", "--metrics", "--no-webui",
            "--ctx-size", "4096", "--gpu-layers", "all",
        ),
        GPU_ENV,
    ),
    (
        "llamacpp layer split over 2 GPUs",
        spec("llamacpp", model="/m.gguf", gpus=(2, 3), pipeline_parallel=2),
        (
            "llama-server", "--model", "/m.gguf", "--alias", "llama-8b",
            "--host", "0.0.0.0", "--port", "20001", "--metrics", "--no-webui",
            "--gpu-layers", "all", "--split-mode", "layer",
        ),
        {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "2,3"},
    ),
    (
        "llamacpp on CPU",
        spec("llamacpp", model="/m.gguf", gpus=()),
        (
            "llama-server", "--model", "/m.gguf", "--alias", "llama-8b",
            "--host", "0.0.0.0", "--port", "20001", "--metrics", "--no-webui",
        ),
        {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": ""},
    ),
    (
        "sim",
        spec("sim", aliases=("llama",), max_model_len=8192),
        (
            sys.executable, "-m", "llmgw", "sim", "--host", "0.0.0.0", "--port", "20001",
            "--served-model-name", "llama-8b", "--served-model-name", "llama",
            "--max-model-len", "8192",
        ),
        GPU_ENV,
    ),
]  # fmt: skip


@pytest.mark.parametrize(("case", "launch_spec", "argv", "env"), GOLDEN, ids=[g[0] for g in GOLDEN])
def test_golden(
    case: str, launch_spec: LaunchSpec, argv: tuple[str, ...], env: dict[str, str]
) -> None:
    launch = engines.plan(launch_spec, H100, CONTEXT)
    assert launch.argv == argv
    assert launch.env == env
    assert launch.port == 20001
    headless_worker = launch_spec.node_rank > 0 and launch_spec.engine in ("vllm", "sglang")
    assert launch.http is not headless_worker


@cache
def known_flags(engine: str) -> frozenset[str]:
    """Every spelling each engine's real parser accepts, from the generated reference files."""
    name = {"vllm": "vllm-serve", "sglang": "sglang-server", "llamacpp": "llama-server"}[engine]
    flags: set[str] = set()
    for line in (REFERENCE / f"{name}-flags.txt").read_text().splitlines():
        if line.startswith("-"):
            head, _, rest = line.partition(" | ")
            flags.add(head.split()[0])
            aliases = rest.partition(" | ")[0]
            flags.update(re.findall(r"(--?[\w-]+)", aliases))
    return frozenset(flags)


@pytest.mark.parametrize(
    ("case", "launch_spec"),
    [(g[0], g[1]) for g in GOLDEN if g[1].engine != "sim"],
    ids=[g[0] for g in GOLDEN if g[1].engine != "sim"],
)
def test_every_flag_exists_in_the_engines_parser(case: str, launch_spec: LaunchSpec) -> None:
    launch = engines.plan(launch_spec, H100, CONTEXT)
    emitted = [a for a in launch.argv if a.startswith("--")]
    unknown = [a for a in emitted if a not in known_flags(launch_spec.engine)]
    assert not unknown, f"{case}: {unknown} not accepted by {launch_spec.engine}"


def test_the_agents_gpu_and_nccl_pinning_wins_over_the_spec() -> None:
    env = {"NCCL_IB_HCA": "mlx5", "CUDA_VISIBLE_DEVICES": "7", "NCCL_DEBUG": "INFO"}
    launch = engines.plan(replace(multi_node("vllm", 0), env=env), H100, CONTEXT)
    assert launch.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_4,mlx5_5"
    assert launch.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert launch.env["NCCL_DEBUG"] == "INFO"


TRACED = replace(CONTEXT, traces="otel.example.internal:4317")


@pytest.mark.parametrize(
    ("engine", "flags"),
    [
        ("vllm", ["--otlp-traces-endpoint", "grpc://otel.example.internal:4317"]),
        ("sglang", ["--enable-trace", "--otlp-traces-endpoint", "otel.example.internal:4317"]),
    ],
)
def test_a_fleet_collector_makes_tracing_engines_export_to_it(
    engine: str, flags: list[str]
) -> None:
    launch = engines.plan(spec(engine), H100, TRACED)
    joined = " ".join(launch.argv)
    assert " ".join(flags) in joined
    assert all(f in known_flags(engine) for f in flags if f.startswith("--"))
    assert launch.env["OTEL_SERVICE_NAME"] == engine
    assert launch.env["OTEL_EXPORTER_OTLP_TRACES_INSECURE"] == "true"
    # Without a collector, none of it; a headless worker rank serves nothing to trace.
    assert "--otlp-traces-endpoint" not in engines.plan(spec(engine), H100, CONTEXT).argv
    assert "--otlp-traces-endpoint" not in engines.plan(multi_node(engine, 1), H100, TRACED).argv
    secure = engines.plan(spec(engine), H100, replace(TRACED, traces_insecure=False))
    assert "OTEL_EXPORTER_OTLP_TRACES_INSECURE" not in secure.env
    named = engines.plan(replace(spec(engine), env={"OTEL_SERVICE_NAME": "m"}), H100, TRACED)
    assert named.env["OTEL_SERVICE_NAME"] == "m"


def test_engines_that_do_not_trace_get_no_tracing_settings() -> None:
    for engine in ("llamacpp", "sim"):
        launch = engines.plan(spec(engine), H100, TRACED)
        assert "otel" not in " ".join(launch.argv)
        assert not any(k.startswith("OTEL_") for k in launch.env)


def test_engine_command_from_the_config() -> None:
    context = LaunchContext(commands={"vllm": ("/opt/vllm/bin/vllm", "serve")})
    assert engines.plan(spec(), H100, context).argv[:3] == (
        "/opt/vllm/bin/vllm",
        "serve",
        "meta-llama/Llama-3.1-8B-Instruct",
    )


# --------------------------------------------------------------------------- refusals


def refused(launch_spec: LaunchSpec, inventory: Inventory = H100, **kw: object) -> str:
    with pytest.raises(LaunchRefused) as info:
        engines.plan(launch_spec, inventory, CONTEXT, **kw)  # type: ignore[arg-type]
    return str(info.value)


def test_fp8_refused_below_compute_capability_8_9() -> None:
    a100 = Inventory(gpus=simulated.parse_spec("8xa100-80g"))
    message = refused(spec("vllm", dtype="fp8"), a100)
    assert "fp8 needs compute capability 8.9 or newer" in message
    assert "has 8.0: use dtype bfloat16" in message
    assert engines.plan(
        spec("vllm", dtype="fp8"), Inventory(gpus=simulated.parse_spec("1xl40s-45g")), CONTEXT
    )


def test_fp8_refused_when_capability_is_unknown() -> None:
    gpu = Gpu(
        index=0,
        uuid="u",
        name="NVIDIA A10G",
        gpu_class="a10g-22g",
        memory_mib=23028,
        compute_capability="",
    )
    assert "has unknown" in refused(spec("sglang", dtype="fp8"), Inventory(gpus=(gpu,)))


def test_mixed_gpu_classes_refused() -> None:
    mixed = Inventory(gpus=simulated.parse_spec("1xrtx4080super-16g,1xrtx3090-24g"))
    message = refused(spec("vllm", gpus=(0, 1), tensor_parallel=2), mixed)
    assert "GPUs of different classes in one shard (rtx3090-24g, rtx4080super-16g)" in message


def test_requested_class_must_match() -> None:
    assert "asks for l40s-45g" in refused(spec(gpu_class="l40s-45g"))


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"gpus": (0, 1), "tensor_parallel": 4}, "this shard has 2 GPUs but tensor_parallel 4"),
        ({"gpus": (0,) * 2, "tensor_parallel": 2}, "GPU indices repeat"),
        ({"tensor_parallel": 3, "nnodes": 2, "head_address": "h", "head_port": 1, "fabric": "ib-a"},
         "3 GPUs cannot be split evenly over 2 nodes"),
        ({"tensor_parallel": 0}, "must be >= 1"),
        ({"node_rank": 2}, "node_rank 2 is outside 0..0"),
        ({"node_rank": 1}, "node_rank 1 is outside 0..0"),
    ],
)  # fmt: skip
def test_arithmetic_must_add_up(fields: dict[str, object], message: str) -> None:
    assert message in refused(spec(**fields))


def test_multi_node_needs_head_and_fabric() -> None:
    message = refused(spec(gpus=(0,), tensor_parallel=2, nnodes=2))
    assert "needs head_address" in message
    assert "head_port 0 is not a port" in message
    assert "needs a fabric" in message


def test_unknown_fabric_refused() -> None:
    s = multi_node("vllm", 0)
    message = refused(replace(s, fabric="ib-b"))
    assert 'this node is not on fabric "ib-b"' in message


def test_gpus_must_exist_be_healthy_and_free() -> None:
    gpus = list(simulated.parse_spec("4xh100-80g"))
    gpus[1] = replace(gpus[1], ecc_uncorrected=1)
    gpus[2] = replace(gpus[2], foreign_memory_mib=20322)
    inventory = Inventory(gpus=tuple(gpus))
    message = refused(
        spec(gpus=(1, 2, 3, 9), tensor_parallel=4), inventory, busy_gpus=frozenset({3})
    )
    assert "GPU 9 does not exist on this node (it has [0, 1, 2, 3])" in message
    assert "GPU 1 is unhealthy: uncorrected ECC errors (1)" in message
    assert "GPU 2 is unhealthy: 20322 MiB held by a foreign process" in message
    assert "GPU 3 is already used by another shard" in message


def test_llamacpp_limits() -> None:
    message = refused(spec("llamacpp", gpus=(0, 1), tensor_parallel=2, dtype="fp8"))
    assert "llama.cpp has no tensor parallelism" in message
    assert "llama.cpp has no fp8" in message
    assert "cannot run one replica over several nodes" in refused(multi_node("llamacpp", 0))


def test_port_outside_range_and_empty_names() -> None:
    context = LaunchContext(port_range=(30000, 30099))
    with pytest.raises(LaunchRefused) as info:
        engines.plan(spec(port=20001, model=" ", served_name=""), H100, context)
    assert len(info.value.reasons) == 3
    assert "port 20001 is outside this agent's engine ports 30000-30099" in info.value.reasons


@settings(max_examples=300, deadline=None)
@given(
    engine=st.sampled_from(["vllm", "sglang", "sim", "llamacpp"]),
    gpus=st.lists(st.integers(-2, 10), max_size=10).map(tuple),
    tp=st.integers(-1, 9),
    pp=st.integers(-1, 3),
    nnodes=st.integers(-1, 4),
    rank=st.integers(-1, 4),
    dtype=st.sampled_from(["auto", "bfloat16", "fp8"]),
    fabric=st.sampled_from(["", "ib-a", "nope"]),
    port=st.integers(-5, 70000),
)
def test_any_spec_is_refused_cleanly_or_pins_exactly_its_gpus(
    engine: str, gpus: tuple[int, ...], tp: int, pp: int, nnodes: int, rank: int,
    dtype: str, fabric: str, port: int,
) -> None:  # fmt: skip
    s = spec(
        engine, gpus=gpus, tensor_parallel=tp, pipeline_parallel=pp, nnodes=nnodes,
        node_rank=rank, dtype=dtype, fabric=fabric, port=port, head_address="h", head_port=1,
    )  # fmt: skip
    try:
        launch = engines.plan(s, H100, CONTEXT)
    except LaunchRefused as exc:
        refusal_reasons = exc.reasons
        assert refusal_reasons
        return
    assert launch.env["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, gpus))
    assert all(0 <= g < 8 for g in gpus)
    assert len(set(gpus)) == len(gpus)
    assert 1 <= port <= 65535
    if nnodes > 1:
        assert launch.env["NCCL_IB_HCA"] == "=mlx5_0,mlx5_1,mlx5_4,mlx5_5"


@pytest.mark.parametrize("engine", ["vllm", "sglang", "sim"])
def test_engines_with_kv_events_publish_them_on_node_local_sockets(engine: str) -> None:
    launch = engines.kv_evented(spec(engine), engines.plan(spec(engine), H100, CONTEXT), "/run/kv")
    at = launch.argv.index("--kv-events-config")
    config = json.loads(launch.argv[at + 1])
    assert config == {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": launch.kv_events,
        "replay_endpoint": launch.kv_replay,
        "topic": "kv",
    }
    assert launch.kv_events.startswith("ipc:///run/kv/")  # never a TCP port off the node
    assert launch.kv_replay.startswith("ipc:///run/kv/")
    if engine != "sim":
        assert "--kv-events-config" in known_flags(engine)


def test_kv_events_are_left_to_the_operator_and_off_where_they_cannot_be_read() -> None:
    # llama.cpp publishes none; a headless worker rank serves no requests; an operator who
    # configured them in the engine arguments keeps their own.
    for launch_spec in (spec("llamacpp"), multi_node("vllm", 1)):
        launch = engines.plan(launch_spec, H100, CONTEXT)
        assert engines.kv_evented(launch_spec, launch, "/run/kv") == launch
    own = replace(spec("vllm"), engine_args=("--kv-events-config", '{"publisher": "null"}'))
    launch = engines.plan(own, H100, CONTEXT)
    assert engines.kv_evented(own, launch, "/run/kv") == launch


@pytest.mark.parametrize("engine", ["vllm", "sglang", "llamacpp", "sim"])
@pytest.mark.parametrize(
    "fields",
    [
        {"aliases": ("m2", "--trust-remote-code")},
        {"aliases": ("--allowed-local-media-path=/",)},
        {"model": "--trust-remote-code"},
        {"model": "@/etc/args"},
        {"served_name": "-m"},
    ],
)
def test_a_name_or_model_an_engine_would_read_as_an_option_is_refused(
    engine: str, fields: dict[str, object]
) -> None:
    # Names and the model go on the command line as values, past the node's launch policy
    # (which checks env and engine_args): a leading - or @ would make them options.
    message = refused(spec(engine, **fields))
    assert "which the engine would read as an option" in message


def test_a_simulated_engine_serves_http_on_every_rank_and_kv_events_on_rank_0_only() -> None:
    # The simulator has no headless workers: each rank answers on its port, and only the
    # rank routers reach publishes KV events (one relay per replica).
    first, worker = multi_node("sim", 0), multi_node("sim", 1)
    assert engines.plan(worker, H100, CONTEXT).http
    launch = engines.plan(worker, H100, CONTEXT)
    assert engines.kv_evented(worker, launch, "/run/kv") == launch
    assert engines.kv_evented(first, engines.plan(first, H100, CONTEXT), "/run/kv").kv_events


def test_a_capability_without_minor_is_its_major_point_zero() -> None:
    assert validation.capability("8") == (8, 0)
    assert validation.capability(" 9.0 ") == (9, 0)
    assert validation.capability("8.x") is None
    gpu = Gpu(
        index=0, uuid="u", name="NVIDIA A100", gpu_class="a100-80g", memory_mib=81920,
        compute_capability="8",
    )  # fmt: skip
    assert "GPU 0 (a100-80g) has 8" in refused(spec("vllm", dtype="fp8"), Inventory(gpus=(gpu,)))


def test_kv_events_configured_in_the_equals_form_are_the_operators_too() -> None:
    own = replace(spec("vllm"), engine_args=('--kv-events-config={"publisher": "null"}',))
    launch = engines.plan(own, H100, CONTEXT)
    assert engines.kv_evented(own, launch, "/run/kv") == launch


def test_only_sglang_opens_its_port_after_loading() -> None:
    for engine in ("vllm", "llamacpp", "sim"):
        assert engines.plan(spec(engine), H100, CONTEXT).listens_before_loading, engine
    assert not engines.plan(spec("sglang"), H100, CONTEXT).listens_before_loading
