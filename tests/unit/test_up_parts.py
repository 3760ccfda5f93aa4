"""`llmgw up`'s parts without processes: the configs it writes load through each service's
own loader, node addresses never collide, status parsing survives any input."""

from __future__ import annotations

import ipaddress
import shutil
from pathlib import Path
from typing import Any

import msgspec
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from llmgw.agent import config as agent_config
from llmgw.cli.main import app
from llmgw.control import config as control_config
from llmgw.core import catalog
from llmgw.ctl import catalogfile
from llmgw.ctl import settings as ctl_settings
from llmgw.ctl.errors import BadInput
from llmgw.pki.store import CertDir
from llmgw.router import config as router_config
from llmgw.up import children, locating, render, running, status
from llmgw.up.layout import Layout
from llmgw.up.render import Plan

URL = "tls://127.0.0.1:4222"


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.parametrize("engine", ["sim", "llamacpp"])
def test_every_rendered_config_passes_its_services_loader(tmp_path: Path, engine: str) -> None:
    plan = Plan(
        layout=Layout(tmp_path),
        nodes=3,
        replicas=2,
        engine="llamacpp" if engine == "llamacpp" else "sim",
        model_file="/models/x.gguf" if engine == "llamacpp" else "",
        llama_server="/opt/llama-server" if engine == "llamacpp" else "",
    )
    ctrl = control_config.load(write(tmp_path / "c.yaml", render.control(plan, URL)))
    assert ctrl.name == "control-1"
    # The model is declared with `llmgw ctl apply` once the nodes registered, not at start.
    assert ctrl.models == ()
    catalog = catalogfile.parse(yaml.safe_dump(render.models(plan)), "models.yaml")
    assert [m.name for m in catalog] == ["demo"]
    assert catalog[0].engine == engine
    assert catalog[0].replicas == 2
    for i, node in enumerate(plan.node_ids, start=1):
        agent = agent_config.load(
            write(tmp_path / f"{node}.yaml", render.agent(plan, URL, node, i))
        )
        assert agent.node_id == node
        assert agent.address == agent.engine_host == render.node_address(tmp_path, i)
        assert agent.nats.cert_file.endswith(f"node/{node}.pem")
        if engine == "llamacpp":
            assert agent.engine_commands["llamacpp"] == ("/opt/llama-server",)
    rendered = render.router(plan, URL, str(tmp_path / "state"))
    routed = router_config.load(write(tmp_path / "r.yaml", rendered))
    assert routed.listen.port == 8080
    assert routed.state_dir == str(tmp_path / "state")  # what it owes budgets, kept there
    assert routed.auth.allow_anonymous
    # One description of the model: the router takes it, and the endpoints, from the log.
    assert routed.models == ()
    assert routed.endpoints == ()
    assert routed.log is not None
    assert routed.log.servers == (URL,)
    assert routed.log.name == "router-1"
    assert routed.log.cert_file.endswith("router/router-1.pem")
    ctl = ctl_settings.load(write(tmp_path / "ctl.yaml", render.ctl(plan, URL)))
    assert ctl.servers == (URL,)
    assert Path(ctl.key_path).name == "admin-key.pem"
    # Every certificate a config names is one `up` issues (nats-server admits only those).
    issued = {str(CertDir(plan.layout.certs).cert(i)) for i in plan.identities}
    named = {ctrl.nats.cert_file, routed.log.cert_file, ctl.cert_file, agent.nats.cert_file}
    assert named <= issued
    # The router listens where asked; the admin APIs (no authentication) on loopback only.
    assert routed.listen.host == plan.host
    assert ctrl.admin.host == routed.admin.host == "127.0.0.1"


def test_a_bad_model_name_is_refused_by_the_loader_not_silently_served(tmp_path: Path) -> None:
    plan = Plan(layout=Layout(tmp_path), model="has space")
    assert catalog.problems(render.profile(plan)), "llmgw up refuses it before starting"
    with pytest.raises(BadInput):
        catalogfile.parse(yaml.safe_dump(render.models(plan)), "models.yaml")


@given(root=st.text(min_size=1, max_size=200))
def test_node_addresses_are_loopback_and_distinct(root: str) -> None:
    addresses = [render.node_address(Path("/" + root), i) for i in range(1, 201)]
    assert len(set(addresses)) == len(addresses)
    for a in addresses:
        assert ipaddress.IPv4Address(a).is_loopback


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(max_examples=300)
@given(nodes=json_values, replicas=json_values, models=json_values, metrics=st.text() | st.none())
def test_status_parse_never_crashes_on_any_answer(
    nodes: Any, replicas: Any, models: Any, metrics: str | None
) -> None:
    reading = status.parse(nodes, replicas, models, metrics)
    assert status.render(reading, None)


def test_status_from_real_shaped_answers() -> None:
    nodes = [
        {"name": "node-1", "liveness": "ready"},
        {"name": "node-2", "liveness": "lost"},
        {"name": "node-3", "liveness": "unreachable"},  # not ready either
    ]
    replicas = [
        {
            "id": "a",
            "endpoint": "http://x:1",
            "retired": False,
            "shards": [{"phase": "serving", "node": "node-1"}],
        },
        {"id": "b", "endpoint": None, "retired": False, "shards": [{"phase": "loading"}]},
        {"id": "c", "endpoint": None, "retired": True, "shards": [{"phase": "stopped"}]},
    ]
    models = [{"name": "demo", "replicas_wanted": 2, "unplaceable": None}]
    metrics = (
        "# TYPE llmgw_router_requests_total counter\n"
        'llmgw_router_requests_total{model="demo",status="200"} 7.0\n'
        'llmgw_router_requests_total{model="demo",status="503"} 2.0\n'
        'llmgw_router_requests_created{model="demo",status="200"} 1.7e9\n'
    )
    reading = status.parse(nodes, replicas, models, metrics)
    assert (reading.nodes_ready, reading.nodes_total) == (1, 3)
    assert reading.endpoints == {"a": "http://x:1"}
    assert (reading.replicas_serving, reading.replicas_wanted) == (1, 2)
    assert reading.phases == {"serving": 1, "loading": 1}
    assert reading.requests_total == 9.0
    assert status.render(reading, 2.5) == [
        "nodes 1/3 ready | replicas 1/2 serving (1 loading) | 2.5 req/s | 9 requests",
        "engines: http://x:1 (node-1)",
    ]


def test_ready_means_the_router_lists_the_model_and_counts_a_ready_endpoint() -> None:
    """`llmgw up` says "ready" from the router's own answers: /v1/models lists the model by
    id, and /ready counts at least one ready endpoint of it (none is not ready)."""
    listed = b'{"object": "list", "data": [{"id": "demo", "object": "model", "owned_by": "x"}]}'
    assert status.models_listed(listed) == {"demo"}
    for unanswered in (None, b"", b"not json", b'{"data": "x"}', b'{"data": [{"name": "demo"}]}'):
        assert status.models_listed(unanswered) == set()
    ready = b'{"ready": true, "ready_endpoints": {"demo": 0, "other": 2, "odd": "1"}}'
    assert status.ready_models(ready) == {"other"}
    assert status.ready_models(b"garbage") == set()


@given(data=st.binary(max_size=300))
def test_a_garbage_pid_file_names_no_process(
    tmp_path_factory: pytest.TempPathFactory, data: bytes
) -> None:
    path = tmp_path_factory.mktemp("run") / "x.json"
    path.write_bytes(data)
    assert children.recorded(path) is None
    assert children.stop_recorded(path) is None
    assert not path.exists()


def test_a_pid_file_of_a_reused_pid_is_not_signalled(tmp_path: Path) -> None:
    import os

    from llmgw import processes

    me = processes.fingerprint(os.getpid())
    assert me is not None
    path = tmp_path / "x.json"
    # Same pid, another start time: a different process that got the pid.
    path.write_bytes(msgspec.json.encode(msgspec.structs.replace(me, start_time=me.start_time + 1)))
    # Had it been signalled, SIGTERM would have ended this very test process.
    assert children.stop_recorded(path) is None
    assert children.recorded(path) is None


@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_a_state_dir_that_cannot_be_a_folder_is_refused_in_one_line(
    tmp_path: Path, where: str
) -> None:
    # `--state-dir` naming a file ended in a FileExistsError traceback from mkdir.
    blocker = tmp_path / "notes.txt"
    blocker.write_text("not a folder\n")
    state_dir = blocker if where == "a file" else blocker / "fleet"
    result = CliRunner().invoke(app, ["up", "--state-dir", str(state_dir)])
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    line = result.output.strip()
    assert len(line.splitlines()) == 1, line
    assert f"--state-dir {state_dir}" in line
    assert "give a folder" in line
    assert blocker.read_text() == "not a folder\n"


@pytest.mark.parametrize("host", ["nonexistent.invalid", "a" * 300])
def test_a_host_that_is_no_address_here_is_blamed_not_the_port(tmp_path: Path, host: str) -> None:
    # `llmgw up --host` naming no address of this machine said to stop what listens on the
    # port, or pick another --port.
    result = CliRunner().invoke(
        app, ["up", "--state-dir", str(tmp_path / "fleet"), "--host", host, "--port", "18089"]
    )
    assert isinstance(result.exception, SystemExit), result.exception
    assert result.exit_code == 1
    line = result.output.strip()
    assert len(line.splitlines()) == 1, line
    assert "set --host to an address of this machine" in line


def test_the_command_line_becomes_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plans: list[Plan] = []

    def run(plan: Plan) -> int:
        plans.append(plan)
        return 0

    monkeypatch.setattr(running, "run", run)
    # Relative, as the default .llmgw is: the services run in it, so it is made absolute.
    monkeypatch.chdir(tmp_path)
    common = ["up", "--state-dir", "fleet", "--port", "18090"]
    result = CliRunner().invoke(app, [*common, "--nodes", "3", "--model", "m1"])
    assert result.exit_code == 0, result.output
    [plan] = plans
    assert (plan.nodes, plan.model, plan.port, plan.engine) == (3, "m1", 18090, "sim")
    assert plan.replicas == 3  # one per simulated node unless --replicas says otherwise
    assert plan.layout.root == (tmp_path / "fleet").resolve()
    assert plan.layout.root.is_absolute()
    for wrong, said in (
        (["--model-file", str(tmp_path / "x.gguf")], "--model-file is for --engine llamacpp"),
        (["--engine", "vllm"], "--engine 'vllm' is not one of sim, llamacpp"),
    ):
        refused = CliRunner().invoke(app, [*common, *wrong])
        assert refused.exit_code == 2
        assert said in refused.output
    assert len(plans) == 1


def test_the_files_up_finds_for_llamacpp_exist(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    env = {"LLMGW_LLAMA_SERVER": str(binary), "LLMGW_CACHE": str(tmp_path / "no-cache")}
    # Not executable: not it (PATH's, if any, instead).
    assert locating.find_llama_server(env) in (None, shutil.which("llama-server"))
    binary.chmod(0o755)
    assert locating.find_llama_server(env) == str(binary)
    gguf = tmp_path / "m.gguf"
    assert locating.find_smollm2({"LLMGW_SMOLLM2_GGUF": str(gguf)}) != str(gguf)  # missing
    gguf.write_bytes(b"GGUF")
    assert locating.find_smollm2({"LLMGW_SMOLLM2_GGUF": str(gguf)}) == str(gguf)
