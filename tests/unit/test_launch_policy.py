"""The agent's launch policy: which engines, env names and engine options a StartShard may use.

An operator's model profile reaches every node; what it may make a node run is
bounded by that node's `launch` config. Properties over any env mapping and any
argv: only what is allowed passes, and every refusal names the setting to change.
"""

from __future__ import annotations

import posixpath
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw import config
from llmgw.agent import config as agent_config
from llmgw.agent.engines import allowlists
from llmgw.agent.engines import policy as launch_policy
from llmgw.agent.engines.policy import LaunchPolicy
from llmgw.agent.engines.validation import LaunchRefused, option_name
from llmgw.core.profile import Engine, LaunchSpec

SOURCE = "/etc/llmgw/agent.yaml"
ENGINES: tuple[Engine, ...] = ("vllm", "sglang", "llamacpp", "sim")


def spec(engine: Engine = "vllm", **over: object) -> LaunchSpec:
    return LaunchSpec(
        engine=engine,
        model="org/model",
        served_name="m",
        port=30000,
        gpus=(0,),
        **over,  # type: ignore[arg-type]
    )


def refusal(s: LaunchSpec, policy: LaunchPolicy = LaunchPolicy()) -> list[str]:
    try:
        launch_policy.check_policy(s, policy, source=SOURCE)
    except LaunchRefused as exc:
        return list(exc.reasons)
    return []


# ------------------------------------------------------------------ env


def test_ld_preload_is_refused_with_the_setting_to_change() -> None:
    reasons = refusal(spec(env={"LD_PRELOAD": "/tmp/evil.so", "VLLM_LOGGING_LEVEL": "INFO"}))
    assert reasons == [
        "env LD_PRELOAD is not allowed by this node's launch.env_allow "
        "(agent config /etc/llmgw/agent.yaml): add it there if this node should run it"
    ]


@pytest.mark.parametrize(
    "name",
    [
        "LD_PRELOAD",
        "LD_LIBRARY_PATH",
        "PYTHONPATH",
        "PYTHONSTARTUP",
        "PYTHONHOME",
        "BROWSER",
        "PATH",
        "CUDA_INJECTION64_PATH",
        "NCCL_NET_PLUGIN",
        "NCCL_TUNER_PLUGIN",
        "NCCL_DEBUG_FILE",
        "NCCL_TOPO_FILE",
        "VLLM_PLUGINS",
        "VLLM_LOGGING_CONFIG_PATH",
        "VLLM_ALLOW_INSECURE_SERIALIZATION",
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING",
        "VLLM_SERVER_DEV_MODE",
        "VLLM_API_KEY",
        "HF_HOME",
        "HF_MODULES_CACHE",
        "HF_HUB_TRUST_REMOTE_CODE",
        "LLAMA_ARG_CHAT_TEMPLATE_FILE",
        "HF_ENDPOINT",  # would take the node's Hugging Face token to another host
        "HF_HUB_ETAG_TIMEOUT_URL",
        "HTTPS_PROXY",
        "CUDA_MPS_PIPE_DIRECTORY",
        "VLLM_TUNED_CONFIG_FOLDER",
    ],
)
def test_code_or_file_loading_names_are_refused_by_default(name: str) -> None:
    engine: Engine = "llamacpp" if name.startswith("LLAMA") else "vllm"
    assert refusal(spec(engine, env={name: "x"})), name


@pytest.mark.parametrize(
    ("engine", "name"),
    [
        ("vllm", "VLLM_ATTENTION_BACKEND"),
        ("vllm", "NCCL_DEBUG"),
        ("vllm", "CUDA_LAUNCH_BLOCKING"),
        ("vllm", "VLLM_LOGGING_LEVEL"),
        ("vllm", "VLLM_LOGGING_PREFIX"),
        ("vllm", "HF_HUB_OFFLINE"),
        ("vllm", "OMP_NUM_THREADS"),
        ("sglang", "SGLANG_ENABLE_TORCH_COMPILE"),
        ("llamacpp", "GGML_CUDA_ENABLE_UNIFIED_MEMORY"),
        ("sim", "LLMGW_SIM__SEED"),
    ],
)
def test_the_engines_own_tuning_names_pass(engine: Engine, name: str) -> None:
    assert refusal(spec(engine, env={name: "1"})) == []


def test_another_engines_prefix_is_not_allowed() -> None:
    assert refusal(spec("sglang", env={"VLLM_ATTENTION_BACKEND": "x"}))
    assert refusal(spec("sim", env={"CUDA_LAUNCH_BLOCKING": "1"}))


def test_exact_names_in_the_config_are_admitted_patterns_never_admit_code() -> None:
    policy = LaunchPolicy(env_allow={"vllm": ("LD_PRELOAD", "MY_*"), "all": ("TEAM_FLAG",)})
    assert refusal(spec(env={"LD_PRELOAD": "/opt/lib.so"}), policy) == []
    assert refusal(spec(env={"MY_SETTING": "1", "TEAM_FLAG": "1"}), policy) == []
    assert refusal(spec("sglang", env={"TEAM_FLAG": "1"}), policy) == []
    assert refusal(spec(env={"MY_PLUGIN": "x"}), policy)  # a pattern never admits it
    assert refusal(spec("sglang", env={"LD_PRELOAD": "x"}), policy)  # listed for vllm only


@pytest.mark.parametrize("name", ["VLLM_X=1", "VLLM_A B", "NCCL_DEBUG\n", "CUDA_\u0130"])
def test_what_is_no_environment_name_is_refused_whatever_pattern_it_starts_with(
    name: str,
) -> None:
    policy = LaunchPolicy(env_allow={"all": ("HF_*",)})
    assert not launch_policy.env_allowed(policy, "vllm", name)
    [reason] = refusal(spec(env={name: "1"}), policy)
    assert "launch.env_allow" in reason


def test_a_nul_byte_in_an_allowed_value_is_refused() -> None:
    [reason] = refusal(spec(env={"VLLM_LOGGING_LEVEL": "IN\x00FO"}))
    assert "VLLM_LOGGING_LEVEL has a NUL byte" in reason


def test_without_defaults_only_the_listed_names_pass() -> None:
    policy = LaunchPolicy(defaults=False, env_allow={"vllm": ("VLLM_LOGGING_LEVEL",)})
    assert refusal(spec(env={"VLLM_LOGGING_LEVEL": "INFO"}), policy) == []
    assert refusal(spec(env={"VLLM_ATTENTION_BACKEND": "x"}), policy)
    assert refusal(spec(engine_args=("--max-num-seqs", "8")), policy)


_env_names = st.one_of(
    st.sampled_from(
        [
            "LD_PRELOAD",
            "PYTHONPATH",
            "VLLM_PLUGINS",
            "VLLM_ATTENTION_BACKEND",
            "NCCL_DEBUG",
            "NCCL_NET_PLUGIN",
            "CUDA_INJECTION64_PATH",
            "HF_TOKEN",
            "SGLANG_X",
            "GGML_CUDA_X",
            "LLMGW_SIM__SEED",
            "MY_VAR",
        ]
    ),
    st.text(min_size=0, max_size=20),
    st.from_regex(r"(CUDA|NCCL|VLLM|HF|SGLANG|GGML)_[A-Z_]{0,12}", fullmatch=True),
)


@settings(max_examples=300, deadline=None)
@given(
    engine=st.sampled_from(ENGINES),
    env=st.dictionaries(_env_names, st.text(max_size=8), max_size=6),
    extra=st.lists(_env_names, max_size=3),
)
def test_any_env_passes_only_allowed_names_or_is_refused_naming_the_setting(
    engine: Engine, env: dict[str, str], extra: list[str]
) -> None:
    policy = LaunchPolicy(env_allow={engine: tuple(e for e in extra if e.isidentifier())})
    reasons = refusal(spec(engine, env=env), policy)
    for name, value in env.items():
        ok = launch_policy.env_allowed(policy, engine, name)
        if ok:
            # What passes is exactly listed, or a pattern's match that loads no code.
            assert name in policy.env_allow.get(engine, ()) or not allowlists.loads_code(name)
            assert name.isidentifier()
            assert name.isascii()
        if not ok:
            assert any(
                f"env {name} is not allowed by this node's launch.env_allow" in r for r in reasons
            )
        elif "\x00" not in value:
            assert not any(r.startswith(f"env {name} ") for r in reasons)
    for r in reasons:
        assert SOURCE in r or "NUL" in r


# ------------------------------------------------------------------ engine arguments


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("vllm", ("--worker-extension-cls", "evil.Ext")),
        ("vllm", ("--worker-extension-cls=evil.Ext",)),
        ("vllm", ("--worker_extension_cls", "evil.Ext")),
        ("vllm", ("--worker-ext", "evil.Ext")),  # argparse's abbreviations
        ("vllm", ("--worker-cls", "evil.W")),
        ("vllm", ("--tool-parser-plugin", "/tmp/p.py")),
        ("vllm", ("--reasoning-parser-plugin", "/tmp/p.py")),
        ("vllm", ("--io-processor-plugin", "x")),
        ("vllm", ("--logits-processors", "evil:LP")),
        ("vllm", ("--middleware", "evil.mw")),
        ("vllm", ("--trust-remote-code",)),
        ("vllm", ("--model-class-overrides", '{"A": "evil:C"}')),
        ("vllm", ("--allowed-local-media-path", "/")),
        ("vllm", ("--config", "/tmp/opts.yaml")),
        ("vllm", ("--compilation-config.pass_config", "x")),
        ("vllm", ("--api-key", "k")),
        ("vllm", ("--port", "1")),
        ("vllm", ("-O3",)),
        ("vllm", ("@/tmp/args",)),
        ("vllm", ("other-model",)),
        ("vllm", ("--chat-template", "/etc/shadow")),
        ("vllm", ("--chat-template", "relative.jinja")),
        ("vllm", ("--chat-template=/etc/passwd",)),
        ("vllm", ("--tokenizer", "/home/x/tok")),
        ("vllm", ("--tokenizer", "../../tok")),
        ("sglang", ("--custom-weight-loader", "evil.load")),
        ("sglang", ("--forward-hooks", "[]")),
        ("sglang", ("--chat-template", "/tmp/t.jinja")),
        ("llamacpp", ("--chat-template-file", "/tmp/t.jinja")),
        ("llamacpp", ("--log-file", "/etc/cron.d/x")),
        ("llamacpp", ("--rpc", "10.0.0.1:50052")),
        ("llamacpp", ("--slot-save-path", "/tmp")),
        ("sim", ("--config", "/tmp/sim.yaml")),
    ],
)
def test_code_and_file_loading_options_are_refused(engine: Engine, args: tuple[str, ...]) -> None:
    reasons = refusal(spec(engine, engine_args=args))
    assert reasons, args
    assert all(SOURCE in r or "file" in r or "not an option" in r for r in reasons), reasons


def test_the_refusal_names_the_option_and_the_setting() -> None:
    assert refusal(spec(engine_args=("--worker-extension-cls", "evil.Ext"))) == [
        "engine argument --worker-extension-cls is not allowed by this node's "
        "launch.args_allow.vllm (agent config /etc/llmgw/agent.yaml): "
        "add it there if this node should run it"
    ]


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("vllm", ("--enable-prefix-caching", "--max-num-seqs", "256")),
        ("vllm", ("--gpu-memory-utilization=0.85", "--enforce-eager", "--seed", "-1")),
        ("vllm", ("--max_num_seqs", "8")),
        ("vllm", ("--chat-template", "{% for m in messages %}{{ m.content }}{% endfor %}")),
        ("vllm", ("--tokenizer", "meta-llama/Llama-3.1-8B-Instruct")),
        ("sglang", ("--mem-fraction-static", "0.8", "--chat-template", "chatml")),
        ("llamacpp", ("--threads", "8", "--flash-attn", "on", "--no-cont-batching")),
        ("sim", ("--decode-base-ms", "5", "--fail-status", "503")),
    ],
)
def test_tuning_options_pass(engine: Engine, args: tuple[str, ...]) -> None:
    assert refusal(spec(engine, engine_args=args)) == []


def test_files_are_read_only_from_the_configured_dirs() -> None:
    policy = LaunchPolicy(file_dirs=("/opt/templates",))
    ok = ("--chat-template", "/opt/templates/llama.jinja")
    assert refusal(spec(engine_args=ok), policy) == []
    assert refusal(spec("llamacpp", engine_args=("--chat-template-file", ok[1])), policy) == []
    escape = ("--chat-template", "/opt/templates/../../etc/shadow")
    [reason] = refusal(spec(engine_args=escape), policy)
    assert "'/etc/shadow'" in reason
    assert "launch.file_dirs" in reason
    assert SOURCE in reason
    assert refusal(spec(engine_args=("--chat-template", "/opt/templates-evil/x")), policy)


def test_options_added_in_the_config_pass() -> None:
    policy = LaunchPolicy(args_allow={"vllm": ("--worker-extension-cls",)})
    assert refusal(spec(engine_args=("--worker-extension-cls", "ours.Ext")), policy) == []
    assert refusal(spec("sglang", engine_args=("--worker-extension-cls", "x")), policy)


def test_an_engine_off_the_list_is_refused() -> None:
    policy = LaunchPolicy(engines=("sim",))
    assert refusal(spec("vllm"), policy) == [
        "engine vllm is not allowed by this node's launch.engines "
        "(agent config /etc/llmgw/agent.yaml): add it there if this node should run it"
    ]
    assert refusal(spec("sim"), policy) == []


_tokens = st.one_of(
    st.sampled_from(
        [
            "--max-num-seqs",
            "--enable-prefix-caching",
            "--worker-extension-cls",
            "--chat-template",
            "--chat-template-file",
            "--tokenizer",
            "--config",
            "--trust-remote-code",
            "--decode-base-ms",
            "--threads",
            "-O3",
            "-1",
            "@x",
            "/etc/shadow",
            "/opt/t/x.jinja",
            "org/name",
            "{{ x }}",
            "8",
        ]
    ),
    st.text(max_size=12),
)


@settings(max_examples=400, deadline=None)
@given(engine=st.sampled_from(ENGINES), args=st.lists(_tokens, max_size=8))
def test_any_argv_passes_only_allowed_options_or_is_refused_naming_the_setting(
    engine: Engine, args: list[str]
) -> None:
    policy = LaunchPolicy(file_dirs=("/opt/t",))
    reasons = refusal(spec(engine, engine_args=tuple(args)), policy)
    allowed = set(allowlists.DEFAULT_ARGS_ALLOW[engine])
    if not reasons:
        # Every option is on the list; every value follows an option; files stay in /opt/t.
        flag = ""
        for token in args:
            assert not token.startswith("@")
            assert "\x00" not in token
            if (
                token.startswith("-")
                and not token[1:2].isdigit()
                and token[1:2] != "."
                and token != "-"
            ):
                flag = option_name(token)
                assert flag in allowed
                value = token.split("=", 1)[1] if "=" in token else None
            else:
                assert flag, token
                value = token
            if value is not None and flag in allowlists.FILE_ARGS[engine]:
                assert value.startswith("/opt/t/") or not value.startswith("/")
                assert ".." not in value.split("/"), value
        # Every file option has its value: none is left for the engine to take the next
        # option (or nothing) for.
        for i, token in enumerate(args):
            if option_name(token) in allowlists.FILE_ARGS[engine] and "=" not in token:
                assert i + 1 < len(args), args
                assert not args[i + 1].startswith("--"), args
    for r in reasons:
        assert (
            f"launch.args_allow.{engine} ({'agent config ' + SOURCE})" in r
            or "launch.file_dirs" in r
            or "not an option" in r
            or "read arguments from a file" in r
            or "NUL" in r
            or "names no file: give its value right after it" in r
        ), r


# ------------------------------------------------------------------ the policy itself


def test_check_reports_a_bad_policy(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "node_id: gpu-01\nlaunch:\n  env_allow: {vllm: ['BAD-NAME', '*']}\n"
        "  args_allow: {sglang: [max-num-seqs, '--x=1']}\n  file_dirs: [relative/dir, /]\n"
    )
    with pytest.raises(config.ConfigError) as err:
        agent_config.load(path, environ={})
    text = str(err.value)
    assert "launch.env_allow.vllm: 'BAD-NAME'" in text
    assert "launch.env_allow.vllm: '*'" in text
    assert "launch.args_allow.sglang: 'max-num-seqs'" in text
    assert "launch.args_allow.sglang: '--x=1'" in text
    assert "launch.file_dirs: 'relative/dir'" in text
    assert "launch.file_dirs: '/'" in text


def test_check_refuses_an_unknown_engine_and_an_empty_list(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text("node_id: gpu-01\nlaunch: {engines: [vllm, tensorrt]}\n")
    with pytest.raises(config.ConfigError, match="tensorrt"):
        agent_config.load(path, environ={})
    path.write_text("node_id: gpu-01\nlaunch: {engines: []}\n")
    with pytest.raises(config.ConfigError, match=r"launch\.engines is empty"):
        agent_config.load(path, environ={})


def test_agent_check_prints_the_policy_and_refuses_a_bad_one(tmp_path: Path) -> None:
    path = tmp_path / "agent.yaml"
    path.write_text(
        "node_id: gpu-01\nlaunch:\n  engines: [vllm, sim]\n  env_allow: {all: [MY_*]}\n"
        "  file_dirs: [/opt/templates]\n"
    )
    run = [sys.executable, "-m", "llmgw", "agent", "--config", str(path), "--check"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "launch: engines vllm, sim" in done.stdout
    assert "files read from: /opt/templates" in done.stdout
    path.write_text("node_id: gpu-01\nlaunch: {args_allow: {vllm: [oops]}}\n")
    done = subprocess.run(run, capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 2
    assert "launch.args_allow.vllm: 'oops' is not an option name" in done.stderr


def test_the_example_fleet_configs_pass() -> None:
    root = Path(__file__).resolve().parents[2] / "deploy" / "fleet"
    for name in ("gpu-01.yaml", "gpu-02.yaml"):
        cfg = agent_config.load(root / name, environ={})
        assert cfg.launch.engines


# ------------------------------------------------------------------ attempts past the lists


@pytest.mark.parametrize(
    ("engine", "name"),
    [
        ("vllm", "VLLM_CONFIG_ROOT"),  # where vLLM reads its own configuration
        ("vllm", "VLLM_CACHE_ROOT"),
        ("vllm", "VLLM_TORCH_PROFILER_DIR"),  # the profiler writes traces there
        ("vllm", "VLLM_ASSETS_CACHE"),
        ("vllm", "HF_HUB_CACHE"),
        ("vllm", "VLLM_NCCL_SO_PATH"),  # the NCCL library vLLM loads
        ("sglang", "SGLANG_EXTERNAL_MODEL_PACKAGE"),  # imports the package named
        ("sglang", "SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"),
        ("sglang", "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"),  # where ranks meet
        ("vllm", "NCCL_COMM_ID"),
        ("vllm", "VLLM_USAGE_STATS_SERVER"),  # where vLLM reports the node's hardware
        ("vllm", "VLLM_HOST_IP"),
        ("vllm", "VLLM_DP_MASTER_IP"),
        ("vllm", "VLLM_NIXL_SIDE_CHANNEL_HOST"),
        ("vllm", "NCCL_RAS_ADDR"),
        ("vllm", "VLLM_DEBUG_LOG_API_SERVER_RESPONSE"),  # every answer in the engine's log
        ("vllm", "CUDA_COREDUMP_PIPE"),  # the engine's memory, prompts included
        ("vllm", "CUDA_ENABLE_COREDUMP_ON_EXCEPTION"),
        ("sglang", "CUDA_ENABLE_USER_TRIGGERED_COREDUMP"),
        ("vllm", "VLLM_TRACE_FUNCTION"),
        ("vllm", "VLLM_LOGGING_STREAM"),  # ext://module.attr imports the module
        ("vllm", "VLLM_LOGGING_CONFIG_PATH"),
        ("vllm", "VLLM_USE_MODELSCOPE"),  # another model hub
        ("sglang", "SGLANG_USE_MODELSCOPE"),
        ("vllm", "VLLM_HUMMING_W4A16_QUANT_CONFIG"),  # a file read from the path given
        # hf-xet's log: a file (or a folder it prunes) anywhere, and its name in the folder.
        ("vllm", "HF_XET_LOG_DEST"),
        ("sglang", "HF_XET_LOG_PREFIX"),
        ("vllm", "HF_XET_LOG_DIR_MAX_RETENTION_AGE"),
        ("llamacpp", "LLAMA_ARG_RPC"),  # llama-server's options by another name
        ("llamacpp", "LLAMA_ARG_HOST"),
    ],
)
def test_names_that_name_places_or_options_are_refused_by_default(
    engine: Engine, name: str
) -> None:
    assert refusal(spec(engine, env={name: "x"})), name


@pytest.mark.parametrize(
    "name",
    [
        "APP_PLUGIN",
        "APP_EXTRA_LIBRARY",
        "APP_MODULE",
        "APP_EXTENSION",
        "APP_HTTPS_PROXY",
        "APP_INJECTION",
        "APP_LIB",
        "APP_LIBS",
        "APP_CMD",
        "APP_COMMAND",
        "APP_ROOT",
        "APP_DIR",
        "APP_CACHE",
        "app_plugin",
        "App_Preload",
    ],
)
def test_a_configured_pattern_never_admits_a_name_that_loads_code_or_names_a_place(
    name: str,
) -> None:
    policy = LaunchPolicy(env_allow={"all": ("APP_*", "app_*", "App_*")})
    assert refusal(spec(env={"APP_WORKERS": "4"}), policy) == []
    assert refusal(spec(env={name: "x"}), policy), name


def test_a_pattern_matches_whole_prefixes_and_an_exact_name_only_itself() -> None:
    # Python 3.13's PYTHON_* settings are no licence for PYTHONPATH.
    policy = LaunchPolicy(env_allow={"all": ("PYTHON_*", "TEAM_FLAG")})
    assert refusal(spec(env={"PYTHON_GIL": "0", "TEAM_FLAG": "1"}), policy) == []
    for name in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "TEAM_FLAGS", "TEAM_FLA"):
        assert refusal(spec(env={name: "x"}), policy), name
    assert refusal(spec("llamacpp", env={"HF_TOKENIZER_X": "x"}))  # HF_TOKEN is exact
    assert refusal(spec(env={"CUDAX": "1"}))  # CUDA_* needs the underscore


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        # A value that is an engine's short option: vLLM's -tp, -asc, -O; llama.cpp's -m.
        ("vllm", ("--max-num-seqs", "8", "-tp", "8")),
        ("vllm", ("--seed", "-asc", "4")),
        ("vllm", ("--enforce-eager", "-O3")),
        ("llamacpp", ("--threads", "8", "-m", "/other.gguf")),
        # What the agent owns, in every spelling an engine's parser takes.
        ("vllm", ("--host", "0.0.0.0")),
        ("sglang", ("--host=0.0.0.0",)),
        ("vllm", ("--api-k", "mine")),  # vLLM's parser takes unique prefixes
        ("sglang", ("--served-model", "other")),
        ("vllm", ("\u2014trust-remote-code",)),  # an em dash: a value without an option
        # Arguments from a file, wherever they stand.
        ("vllm", ("--seed", "@/tmp/args")),
        # A NUL byte would end the engine's argument there (and fails the exec).
        ("vllm", ("--seed", "1\x00")),
        # `=` inside the file name: the file is everything after the first `=`.
        ("vllm", ("--chat-template=/opt/t/x=/../../../etc/shadow",)),
        ("vllm", ("--tokenizer", "org/name/../../etc")),
        ("vllm", ("--tokenizer", "org/name/more")),  # a relative path, not an id
        ("sglang", ("--tokenizer-path", "/etc")),
        ("sglang", ("--chat-template", "/srv/{x}.jinja")),  # SGLang reads no inline Jinja
        ("llamacpp", ("--chat-template-file", "templates/chat.jinja")),
        ("llamacpp", ("--chat-template-file", "")),
    ],
)
def test_values_that_are_options_or_files_off_the_dirs_are_refused(
    engine: Engine, args: tuple[str, ...]
) -> None:
    policy = LaunchPolicy(file_dirs=("/opt/t",))
    reasons = refusal(spec(engine, engine_args=args), policy)
    assert reasons, args
    for r in reasons:
        assert (
            SOURCE in r
            or "read arguments from a file" in r
            or "contains a NUL byte" in r
            or "is not an option" in r
        ), r


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        ("vllm", ("--chat-template", "{{ messages[0].content }}\n")),
        ("vllm", ("--chat-template", "system\nuser")),  # inline: a newline, no braces
        ("vllm", ("--tokenizer", "/opt/t")),  # the directory itself
        ("vllm", ("--chat-template=/opt/t/a=b.jinja",)),
        ("vllm", ("--response-role", "-")),  # `-` is a value, not an option
        ("sglang", ("--tokenizer-path", "/opt/t/tok")),
    ],
)
def test_inline_templates_and_files_in_the_dirs_pass(engine: Engine, args: tuple[str, ...]) -> None:
    assert refusal(spec(engine, engine_args=args), LaunchPolicy(file_dirs=("/opt/t",))) == []


def test_options_added_for_all_engines_pass_on_each() -> None:
    policy = LaunchPolicy(args_allow={"all": ("--enable-log-requests",)})
    for engine in ENGINES:
        assert refusal(spec(engine, engine_args=("--enable-log-requests",)), policy) == []
    assert refusal(spec(engine_args=("--enable-log-requests",)))


@pytest.mark.parametrize(
    ("policy", "error"),
    [
        (LaunchPolicy(file_dirs=("//",)), "launch.file_dirs: '//'"),
        (LaunchPolicy(file_dirs=("/opt/..",)), "launch.file_dirs: '/opt/..'"),
        (LaunchPolicy(args_allow={"vllm": ("--max-num-seqs ",)}), "'--max-num-seqs '"),
    ],
)
def test_a_policy_that_opens_the_whole_disk_or_matches_no_option_is_refused(
    policy: LaunchPolicy, error: str
) -> None:
    assert any(error in e for e in launch_policy.policy_errors(policy))


# ------------------------------------------------------------------ what the engines read


def _vllm_chat_template(value: str) -> str:
    """vLLM 0.33.0's `load_chat_template` for a --chat-template given on the command line:
    it opens the value as a file first, and only when that fails (and the value has `{`,
    `}` or a newline) takes it as the template itself."""
    try:
        with open(value) as f:
            return f.read()
    except OSError:
        if not any(c in value for c in "{}\n"):
            raise
        return value


def test_a_template_with_braces_that_is_also_a_path_is_read_only_from_the_dirs(
    tmp_path: Path,
) -> None:
    # A folder whose name has a brace (a model repository can hold one, and the engine
    # downloads it into its cache) makes any file on the node reachable through `..`.
    (tmp_path / "{x}").mkdir()
    (tmp_path / "secret").write_text("node secret")
    value = f"{tmp_path}/{{x}}/../secret"
    assert _vllm_chat_template(value) == "node secret"  # what vLLM would do with it
    policy = LaunchPolicy(file_dirs=("/opt/t",))
    [reason] = refusal(spec(engine_args=("--chat-template", value)), policy)
    assert "--chat-template" in reason
    assert "launch.file_dirs" in reason
    assert SOURCE in reason
    assert refusal(spec(engine_args=(f"--chat-template={value}",)), policy)


@pytest.mark.parametrize(
    "value",
    [
        "/srv/{x}.jinja",  # absolute: a file vLLM opens if it is there
        "{x}/../../../etc/shadow",  # relative, climbing out of the engine's folder
        "{%- for m in messages %}/../x{% endfor %}",
    ],
)
def test_a_template_that_could_name_a_file_outside_the_engines_folder_is_refused(
    value: str,
) -> None:
    policy = LaunchPolicy(file_dirs=("/opt/t",))
    [reason] = refusal(spec(engine_args=("--chat-template", value)), policy)
    assert "launch.file_dirs" in reason
    assert "opens a template as a file first" in reason


_template_chars = st.sampled_from(["{", "}", "\n", "/", "..", ".", "x", "{{ m }}", "/opt/t", "~"])


@settings(max_examples=300, deadline=None)
@given(parts=st.lists(_template_chars, min_size=1, max_size=8))
def test_a_template_that_passes_is_inline_in_the_engines_folder_or_under_the_dirs(
    parts: list[str],
) -> None:
    value = "".join(parts)
    if refusal(spec(engine_args=("--chat-template", value)), LaunchPolicy(file_dirs=("/opt/t",))):
        return
    # Read as a path, what passes either lies under /opt/t or stays inside the folder the
    # engine runs in (the agent's own): never absolute elsewhere, never climbing out.
    if value.startswith("/"):
        path = posixpath.normpath(value)
        assert path.startswith("/opt/t/") or path == "/opt/t", value
    else:
        assert ".." not in value.split("/"), value
        assert any(c in value for c in "{}\n"), value


@pytest.mark.parametrize(
    ("engine", "args"),
    [
        # llama-server takes the next argument as the value whatever it looks like.
        ("llamacpp", ("--chat-template-file", "--jinja")),
        ("llamacpp", ("--chat-template-file",)),
        ("vllm", ("--chat-template", "--enforce-eager")),
        ("sglang", ("--tokenizer-path",)),
    ],
)
def test_a_file_option_without_its_file_is_refused(engine: Engine, args: tuple[str, ...]) -> None:
    reasons = refusal(spec(engine, engine_args=args), LaunchPolicy(file_dirs=("/opt/t",)))
    assert any(f"{args[0]} names no file" in r for r in reasons), reasons


def test_llama_server_verbose_logging_of_prompts_and_answers_is_off_the_defaults() -> None:
    # llama-server at --verbose logs every request's and response's body: users' prompts
    # and answers in the engine's log, whose tail a failed shard reports to the fleet.
    [reason] = refusal(spec("llamacpp", engine_args=("--verbose",)))
    assert "launch.args_allow.llamacpp" in reason
    assert SOURCE in reason
    policy = LaunchPolicy(args_allow={"llamacpp": ("--verbose",)})
    assert refusal(spec("llamacpp", engine_args=("--verbose",)), policy) == []


@pytest.mark.parametrize(
    "name",
    [
        # The interpreter's own: a folder of modules (a model repository the engine
        # downloaded may hold a sitecustomize.py), its library, its bytecode, its start-up.
        "PYTHONPATH",
        "PYTHONHOME",
        "PYTHONPLATLIBDIR",
        "PYTHONUSERBASE",
        "PYTHONPYCACHEPREFIX",
        "PYTHONSTARTUP",
        "PYTHONBREAKPOINT",
        "PYTHONWARNINGS",
        "PYTHONINSPECT",
        "PYTHON_PRESITE",
        # The dynamic loader's: libraries it loads or audits, files it writes.
        "LD_AUDIT",
        "LD_PROFILE",
        "LD_DEBUG_OUTPUT",
        # Where programs, home and temporary files are; what a shell runs first.
        "PATH",
        "CPATH",
        "HOME",
        "TMPDIR",
        "BASH_ENV",
        "ENV",
    ],
)
def test_a_broad_configured_pattern_never_admits_the_interpreters_or_loaders_settings(
    name: str,
) -> None:
    patterns = ("PYTHON*", "LD_*", "P*", "C*", "H*", "T*", "B*", "E*")
    policy = LaunchPolicy(env_allow={"all": patterns})
    assert refusal(spec(env={"PYTHONUNBUFFERED": "1", "TEAM": "a"}), policy) == []
    [reason] = refusal(spec(env={name: "/srv/models/evil"}), policy)
    assert f"env {name} is not allowed" in reason
    # Listed exactly, the node's operator means it.
    assert refusal(spec(env={name: "x"}), LaunchPolicy(env_allow={"all": (name,)})) == []
