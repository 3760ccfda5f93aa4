"""The agent's configuration: YAML + LLMGW_AGENT__ overrides, node id and fabric validation."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmgw import config
from llmgw.agent import config as agent_config
from llmgw.core.inventory import Hca, Inventory


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "agent.yaml"
    path.write_text(text)
    return path


def test_defaults_take_the_short_hostname() -> None:
    cfg = agent_config.load(environ={}, hostname="gpu-node-07")
    assert cfg.node_id == "gpu-node-07"
    assert cfg.address == "gpu-node-07"
    assert cfg.fabrics == ()


def test_yaml_then_environment(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "node_id: node-a\naddress: 10.0.0.7\nfabrics:\n"
        "  - {name: ib-a, hcas: [mlx5_0, mlx5_1]}\n"
        "nats: {servers: ['tls://nats-1:4222']}\n",
    )
    cfg = agent_config.load(
        path,
        environ={
            "LLMGW_AGENT__ENGINE_PORTS__FIRST": "31000",
            "LLMGW_AGENT__ENGINE_PORTS__LAST": "31999",
            "LLMGW_AGENT__NODE_ID": "node-b",
        },
    )
    assert cfg.node_id == "node-b"
    assert cfg.address == "10.0.0.7"
    assert cfg.engine_ports.first == 31000
    assert cfg.fabrics[0].hcas == ("mlx5_0", "mlx5_1")
    assert cfg.nats.servers == ("tls://nats-1:4222",)


@pytest.mark.parametrize(
    ("node_id", "hostname"), [("gpu.example.com", "x"), ("", "gpu node"), ("a>b", "x")]
)
def test_node_id_must_be_a_subject_token(node_id: str, hostname: str) -> None:
    with pytest.raises(config.ConfigError, match=r"node_id: .*cannot be used in a NATS subject"):
        agent_config.load(overrides={"node_id": node_id}, environ={}, hostname=hostname)


def test_a_node_id_no_certificate_can_name_is_refused() -> None:
    # A subject token may run to 128 characters, a certificate's name to 64: such a node
    # could never connect, whatever the operator issued.
    assert agent_config.load(overrides={"node_id": "n" * 64}, environ={}).node_id == "n" * 64
    with pytest.raises(config.ConfigError, match=r"node_id: .* 65 characters.* at most 64"):
        agent_config.load(overrides={"node_id": "n" * 65}, environ={})


def test_fqdn_hostname_is_shortened(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.gethostname", lambda: "gpu-node-07.example.com")
    assert agent_config.load(environ={}).node_id == "gpu-node-07"


@pytest.mark.parametrize(
    ("fabrics", "message"),
    [
        ([{"hcas": ["mlx5_0"]}], r"fabrics\[0\] has no name: give it the label"),
        ([{"name": "  ", "hcas": ["mlx5_0"]}], r"fabrics\[0\] has no name"),
        (
            [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-a", "hcas": ["mlx5_1"]}],
            r'fabric "ib-a" is declared twice \(fabrics\[0\] and fabrics\[1\]\): merge',
        ),
        (
            [{"name": "ib-a", "hcas": []}],
            r'fabric "ib-a" lists no HCAs: add its adapters under fabrics\[0\].hcas',
        ),
        (
            [{"name": "ib-a", "hcas": ["mlx5_0"]}, {"name": "ib-b", "hcas": ["mlx5_1", "mlx5_0"]}],
            r'HCA "mlx5_0" is claimed by both fabric "ib-a" and "ib-b"',
        ),
        ([{"name": "ib.a", "hcas": ["mlx5_0"]}], r"fabrics\[0\]: fabric name 'ib.a' cannot"),
    ],
)
def test_each_bad_fabric_gets_its_own_message(fabrics: list[object], message: str) -> None:
    with pytest.raises(config.ConfigError, match=message):
        agent_config.load(overrides={"fabrics": fabrics}, environ={}, hostname="n")


def test_unknown_key_names_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "node_id: a\nfabric: []\n")
    with pytest.raises(config.ConfigError, match=r"agent.yaml: .*fabric"):
        agent_config.load(path, environ={})


def test_bad_port_range() -> None:
    with pytest.raises(config.ConfigError, match="engine_ports 9-1 is not a port range"):
        agent_config.load(
            overrides={"engine_ports": {"first": 9, "last": 1}}, environ={}, hostname="n"
        )


def test_the_admin_listener_needs_a_head_deadline() -> None:
    cfg = agent_config.load(overrides={"admin": {"port": 0}}, environ={}, hostname="n")
    assert cfg.admin is not None
    assert cfg.admin.header_timeout_s == 10.0
    with pytest.raises(config.ConfigError, match=r"admin.header_timeout_s must be above 0"):
        agent_config.load(overrides={"admin": {"header_timeout_s": -1}}, environ={}, hostname="n")


def test_hca_that_discovery_does_not_see_is_a_warning() -> None:
    cfg = agent_config.load(
        overrides={"fabrics": [{"name": "ib-a", "hcas": ["mlx5_0", "mlx5_9"]}]},
        environ={},
        hostname="n",
    )
    warnings = agent_config.unseen_hcas(cfg.fabrics, [Hca(name="mlx5_0")])
    assert len(warnings) == 1
    assert 'lists HCA "mlx5_9", which /sys/class/infiniband does not show' in warnings[0]


def test_engine_commands() -> None:
    cfg = agent_config.load(
        overrides={"engine_commands": {"vllm": ["/opt/vllm/bin/vllm", "serve"]}},
        environ={},
        hostname="n",
    )
    assert cfg.engine_commands == {"vllm": ("/opt/vllm/bin/vllm", "serve")}
    with pytest.raises(config.ConfigError, match=r"engine_commands\.sglang is empty"):
        agent_config.load(overrides={"engine_commands": {"sglang": []}}, environ={}, hostname="n")
    with pytest.raises(config.ConfigError, match="engine_commands"):
        agent_config.load(overrides={"engine_commands": {"vlm": ["x"]}}, environ={}, hostname="n")


def test_fabric_warnings_from_discovery() -> None:
    fabrics = (
        agent_config.FabricConfig(name="ib-a", hcas=("mlx5_0", "mlx5_1", "mlx5_bond_0")),
        agent_config.FabricConfig(name="ib-b", hcas=("mlx5_2",)),
    )
    seen = [
        Hca(name="mlx5_0", state="ACTIVE"),
        Hca(name="mlx5_1", state="DOWN"),
        Hca(name="mlx5_bond_0", link_layer="Ethernet"),
        Hca(name="mlx5_2", state="ACTIVE"),
    ]
    warnings = agent_config.fabric_warnings(fabrics, seen)
    assert warnings == [
        'fabric "ib-a": mlx5_1 port 1 is DOWN, not ACTIVE: check its cable and subnet manager '
        "(`ibstat`)",
        'fabric "ib-a" mixes InfiniBand and RoCE ports: NCCL cannot cross between them; list '
        "only adapters of one kind",
    ]


@pytest.mark.parametrize(
    "collector", ["otel", "otel:", ":4317", "otel:99999", "http://otel:4317/v1", "otel:port"]
)
def test_a_traces_collector_must_be_host_and_port(collector: str) -> None:
    with pytest.raises(config.ConfigError, match=r"traces.collector .* is not host:port"):
        agent_config.load(overrides={"traces": {"collector": collector}}, environ={}, hostname="n")


def test_a_traces_collector_reaches_the_launch_context() -> None:
    cfg = agent_config.load(
        overrides={"traces": {"collector": "otel.example.internal:4317", "insecure": False}},
        environ={},
        hostname="gpu-01",
    )
    context = agent_config.launch_context(cfg, Inventory())
    assert context.traces == "otel.example.internal:4317"
    assert context.traces_insecure is False
    plain = agent_config.load(environ={}, hostname="gpu-01")
    assert agent_config.launch_context(plain, Inventory()).traces == ""


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"engine_commands": {"vllm": [" ", "serve"]}}, r"engine_commands\.vllm is empty"),
        ({"log_tail_lines": 0}, "log_tail_lines >= 1"),
        ({"heartbeat_s": 30.0, "heartbeat_ttl_s": 20.0}, "at least heartbeat_s"),
        ({"outbox_max_bytes": 4095}, "outbox_max_bytes >= 4096"),
        ({"traces": {"collector": "otel/x:4317"}}, "is not host:port"),
        ({"traces": {"collector": "otel:0"}}, "is not host:port"),
        ({"launch": {"file_dirs": ["//"]}}, r"launch\.file_dirs: '//'"),
    ],
)
def test_settings_the_agent_cannot_work_with_are_refused(
    overrides: dict[str, object], message: str
) -> None:
    with pytest.raises(config.ConfigError, match=message):
        agent_config.load(overrides=overrides, environ={}, hostname="n")


def test_a_quoted_number_in_the_file_is_text_not_a_number(tmp_path: Path) -> None:
    # Variables are read as their setting's type; the file is YAML, where "100" is text.
    path = tmp_path / "agent.yaml"
    path.write_text('node_id: gpu-01\nlog_tail_lines: "100"\n')
    with pytest.raises(
        config.ConfigError, match=r"Expected `int`, got `str` - at `\$.log_tail_lines`"
    ):
        agent_config.load(path, environ={})


def test_a_port_active_in_any_case_is_no_warning() -> None:
    fabric = agent_config.FabricConfig(name="ib-a", hcas=("mlx5_0",))
    assert agent_config.fabric_warnings([fabric], [Hca(name="mlx5_0", state="Active")]) == []
    [warning] = agent_config.fabric_warnings([fabric], [Hca(name="mlx5_0", state="DOWN")])
    assert "mlx5_0 port 1 is DOWN, not ACTIVE" in warning
