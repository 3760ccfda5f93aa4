"""Each engine's API key: where every adapter puts it, and what a model may not set itself."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from llmgw.agent import config as agent_config
from llmgw.agent import engines
from llmgw.agent.discovery import simulated
from llmgw.agent.engines import LaunchContext, LaunchRefused
from llmgw.core.inventory import Inventory
from llmgw.core.profile import LaunchSpec
from tests.unit.test_engines import CONTEXT as GOLDEN_CONTEXT
from tests.unit.test_engines import GOLDEN, known_flags

H100 = Inventory(gpus=simulated.parse_spec("8xh100-80g"))
CONTEXT = LaunchContext(host="10.0.0.7")
KEY = "k3y-Only_For-This-Engine"


def spec(engine: str = "vllm", **fields: object) -> LaunchSpec:
    base: dict[str, object] = {
        "engine": engine,
        "model": "/models/m",
        "served_name": "m",
        "port": 8100,
        "gpus": (0,),
    }
    return LaunchSpec(**(base | fields))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("engine", "variable"),
    [("vllm", "VLLM_API_KEY"), ("llamacpp", "LLAMA_API_KEY"), ("sim", "LLMGW_SIM_API_KEY")],
)
def test_the_key_goes_in_the_environment_where_the_engine_reads_it(
    engine: str, variable: str
) -> None:
    s = spec(engine)
    plain = engines.plan(s, H100, CONTEXT)
    launch = engines.keyed(s, plain, KEY)
    assert launch.env == plain.env | {variable: KEY}
    assert launch.argv == plain.argv  # not on the command line: `ps` shows that to everyone
    assert KEY not in " ".join(launch.argv)
    assert launch.api_key == KEY
    assert plain.api_key == ""


def test_sglang_reads_no_key_variable_so_it_gets_the_flag_last() -> None:
    s = spec("sglang", engine_args=("--mem-fraction-static", "0.8"))
    plain = engines.plan(s, H100, CONTEXT)
    launch = engines.keyed(s, plain, KEY)
    assert launch.argv == (*plain.argv, "--api-key", KEY)
    assert launch.argv[-4:-2] == ("--mem-fraction-static", "0.8")
    assert "--api-key" in known_flags("sglang")
    assert launch.env == plain.env


@pytest.mark.parametrize(
    ("case", "launch_spec"),
    [(g[0], g[1]) for g in GOLDEN],
    ids=[g[0] for g in GOLDEN],
)
def test_every_golden_launch_keyed_keeps_its_flags_and_adds_only_the_key(
    case: str, launch_spec: LaunchSpec
) -> None:
    plain = engines.plan(launch_spec, H100, GOLDEN_CONTEXT)
    launch = engines.keyed(launch_spec, plain, KEY)
    added_env = {k: v for k, v in launch.env.items() if plain.env.get(k) != v}
    added_argv = launch.argv[len(plain.argv) :]
    assert launch.argv[: len(plain.argv)] == plain.argv
    assert (added_env, added_argv) in (
        ({engines.API_KEY_ENV.get(launch_spec.engine, ""): KEY}, ()),
        ({}, ("--api-key", KEY)),
    )


def test_engines_bind_the_contexts_address() -> None:
    for engine in ("vllm", "sglang", "llamacpp", "sim"):
        argv = engines.plan(spec(engine), H100, CONTEXT).argv
        assert argv[argv.index("--host") + 1] == "10.0.0.7"
    assert engines.plan(spec("sim"), H100, CONTEXT).probe_host == "10.0.0.7"


@pytest.mark.parametrize("bind", ["", "0.0.0.0", "::", "[::]"])
def test_an_engine_bound_to_every_interface_is_probed_on_loopback(bind: str) -> None:
    assert engines.probe_host(bind) == "127.0.0.1"


def test_the_agent_binds_its_serving_address_unless_told_every_interface() -> None:
    cfg = agent_config.complete(agent_config.AgentConfig(address="10.0.0.7"), hostname="gpu-01")
    assert agent_config.launch_context(cfg, H100).host == "10.0.0.7"
    named = agent_config.complete(agent_config.AgentConfig(), hostname="gpu-01")
    assert agent_config.launch_context(named, H100).host == "gpu-01"  # the registered address
    wildcard = replace(cfg, engine_host="0.0.0.0")
    context = agent_config.launch_context(wildcard, H100)
    assert context.host == "0.0.0.0"
    assert engines.plan(spec("sim"), H100, context).probe_host == "127.0.0.1"
    assert LaunchContext().host == "127.0.0.1"


@pytest.mark.parametrize(
    "fields",
    [
        {"engine_args": ("--api-key", "mine")},
        {"engine_args": ("--api-key=mine",)},
        # vLLM and llama.cpp read `_` as `-` in option names.
        {"engine_args": ("--api_key", "mine")},
        {"engine": "llamacpp", "engine_args": ("--api_key_file", "/etc/keys")},
        {"engine": "llamacpp", "engine_args": ("--api-key-file", "/etc/keys")},
        {"env": {"VLLM_API_KEY": "mine"}},
        {"engine": "llamacpp", "env": {"LLAMA_API_KEY": "mine"}},
        {"engine": "sim", "env": {"LLMGW_SIM_API_KEY": "mine"}},
    ],
)
def test_a_model_may_not_set_the_engines_key(fields: dict[str, object]) -> None:
    with pytest.raises(LaunchRefused) as info:
        engines.plan(spec(**fields), H100, CONTEXT)
    assert "the agent sets each engine's API key itself" in str(info.value)


@settings(max_examples=100, deadline=None)
@given(
    engine=st.sampled_from(["vllm", "sglang", "sim", "llamacpp"]),
    key=st.text(st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=64),
)
def test_keyed_is_the_plain_launch_plus_exactly_the_key(engine: str, key: str) -> None:
    s = spec(engine)
    plain = engines.plan(s, H100, CONTEXT)
    launch = engines.keyed(s, plain, key)
    assert launch.api_key == key
    assert replace(launch, argv=plain.argv, env=plain.env, api_key="") == plain
    in_env = [v for k, v in launch.env.items() if k not in plain.env]
    in_argv = list(launch.argv[len(plain.argv) :])
    assert in_env + in_argv in ([key], ["--api-key", key])
