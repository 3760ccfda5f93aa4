"""deploy/ ships systemd units that systemd itself accepts, and whose sandboxes let each
service write where it writes."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path, PurePosixPath

import pytest
import yaml

from llmgw import natsconf, natsd

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy" / "systemd"
UNITS = sorted(DEPLOY.glob("*.service"))


def test_every_service_has_a_unit() -> None:
    names = {u.name for u in UNITS}
    assert {
        "llmgw-nats.service",
        "llmgw-control.service",
        "llmgw-agent.service",
        "llmgw-router.service",
    } <= names


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_units_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    # The units name /opt/llmgw/venv; point them at this interpreter's bin folder, which
    # holds the same two executables (llmgw, nats-server), so verify can check ExecStart.
    bindir = Path(sys.executable).parent
    assert (bindir / "nats-server").exists()
    for unit in UNITS:
        text = unit.read_text().replace("/opt/llmgw/venv/bin", str(bindir))
        (tmp_path / unit.name).write_text(text)
    result = subprocess.run(
        ["systemd-analyze", "verify", *[str(tmp_path / u.name) for u in UNITS]],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert result.stderr.strip() == "", result.stderr


# Where the README installs each configuration a unit names, and the file in deploy/ it is.
INSTALLED = {
    "/etc/llmgw/nats/llmgw.conf": REPO / "deploy" / "nats" / "llmgw.conf",
    "/etc/llmgw/agent.yaml": REPO / "deploy" / "fleet" / "gpu-01.yaml",
    "/etc/llmgw/control.yaml": REPO / "deploy" / "fleet" / "control.yaml",
    "/etc/llmgw/router.yaml": REPO / "deploy" / "fleet" / "router.yaml",
}


def service_section(unit: Path) -> dict[str, list[str]]:
    """The [Service] settings of a unit, each key with all its values in order."""
    settings: dict[str, list[str]] = {}
    section = ""
    for raw in unit.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line
            continue
        if section == "[Service]":
            key, _, value = line.partition("=")
            settings.setdefault(key.strip(), []).append(value.strip())
    return settings


def writable(settings: dict[str, list[str]], path: PurePosixPath) -> bool:
    """Whether a service may write `path` under its sandbox (systemd.exec(5)'s rules for
    ProtectSystem, ReadWritePaths, the *Directory= settings and PrivateTmp)."""
    protect = (settings.get("ProtectSystem") or ["no"])[-1]
    allowed = [
        PurePosixPath(p.lstrip("-+")) for v in settings.get("ReadWritePaths", []) for p in v.split()
    ]
    for key, base in (
        ("StateDirectory", "/var/lib"),
        ("RuntimeDirectory", "/run"),
        ("LogsDirectory", "/var/log"),
        ("CacheDirectory", "/var/cache"),
    ):
        allowed += [PurePosixPath(base) / d for v in settings.get(key, []) for d in v.split()]
    if (settings.get("PrivateTmp") or ["no"])[-1] in ("yes", "true", "1"):
        allowed += [PurePosixPath("/tmp"), PurePosixPath("/var/tmp")]
    if any(path.is_relative_to(a) for a in allowed):
        return True
    read_only = {
        "strict": ["/"],
        "full": ["/usr", "/boot", "/efi", "/etc"],
        "yes": ["/usr", "/boot", "/efi"],
        "true": ["/usr", "/boot", "/efi"],
    }.get(protect, [])
    return not any(path.is_relative_to(r) for r in read_only)


def written_paths(settings: dict[str, list[str]]) -> list[PurePosixPath]:
    """Every path the service's program writes, read from the configuration it is given."""
    argv = settings["ExecStart"][-1].split()
    program = PurePosixPath(argv[0]).name
    cwd = PurePosixPath((settings.get("WorkingDirectory") or ["/"])[-1])
    if program == "nats-server":
        conf = INSTALLED[argv[argv.index("-c") + 1]].read_text()
        found = re.findall(r'^\s*(?:store_dir|pid_file):\s*"([^"]+)"', conf, flags=re.M)
        assert len(found) == 2, "expected a store_dir and a pid_file"
        return [cwd / p for p in found]  # nats-server resolves relative paths against cwd
    assert program == "llmgw", f"no rule for what {program} writes: add one here"
    command = argv[1]
    cfg = yaml.safe_load(INSTALLED[argv[argv.index("--config") + 1]].read_text())
    if command == "agent":
        return [cwd / cfg["state_dir"]]  # the outbox, the ledger, engines' pid files and logs
    if command == "router":
        # With workers > 1: metrics and rate limits in a tempfile.mkdtemp folder.
        env = dict(v.split("=", 1) for e in settings.get("Environment", []) for v in e.split())
        tmp = PurePosixPath(env.get("TMPDIR", "/tmp"))
        return [tmp / "llmgw-router-metrics-x"] if cfg.get("workers", 1) > 1 else []
    assert command == "control", f"no rule for what `llmgw {command}` writes: add one here"
    return []  # state is the log; it writes no file


@pytest.mark.parametrize("unit", UNITS, ids=[u.name for u in UNITS])
def test_every_path_a_service_writes_is_writable_in_its_sandbox(unit: Path) -> None:
    """Before: llmgw-nats ran in /etc/llmgw under ProtectSystem=strict with nats/llmgw.conf's
    relative store_dir and pid_file (read-only there), and the router's workers wrote a
    temporary folder in a read-only /tmp."""
    settings = service_section(unit)
    blocked = [str(p) for p in written_paths(settings) if not writable(settings, p)]
    assert blocked == [], f"{unit.name} writes where its sandbox forbids: {blocked}"


def test_the_sandbox_rules_match_systemd() -> None:
    strict = {"ProtectSystem": ["strict"], "ReadWritePaths": ["-/var/lib/llmgw /srv/x"]}
    assert writable(strict, PurePosixPath("/var/lib/llmgw/nats/jetstream"))
    assert writable(strict, PurePosixPath("/srv/x/y"))
    assert not writable(strict, PurePosixPath("/etc/llmgw/nats/jetstream"))
    assert not writable(strict, PurePosixPath("/tmp/a"))
    assert writable(strict | {"PrivateTmp": ["yes"]}, PurePosixPath("/tmp/a"))
    assert writable(
        {"ProtectSystem": ["strict"], "StateDirectory": ["llmgw"]},
        PurePosixPath("/var/lib/llmgw/a"),
    )
    assert not writable({"ProtectSystem": ["full"]}, PurePosixPath("/etc/llmgw/a"))
    assert writable({"ProtectSystem": ["full"]}, PurePosixPath("/var/lib/a"))
    assert writable({}, PurePosixPath("/etc/llmgw/a"))


def test_the_deployed_nats_config_is_rendered() -> None:
    rendered = natsconf.render_config(natsconf.SYSTEMD_CONFIG, natsconf.SYSTEMD_HEADER)
    assert (REPO / natsconf.SYSTEMD_CONFIG_PATH).read_text() == rendered, (
        "deploy/nats/llmgw.conf drifted from llmgw.natsconf.SYSTEMD_CONFIG: regenerate it with "
        "render_config(SYSTEMD_CONFIG, SYSTEMD_HEADER)"
    )


def test_reloading_the_nats_unit_admits_a_new_identity() -> None:
    """`systemctl reload llmgw-nats` after `llmgw ctl cert issue`: an account that a reload
    adds answers requests only after the next reload (llmgw.natsd.RELOAD_ROUNDS), so the
    unit signals as often as llmgw does, pausing between signals (one that arrives while
    a reload is applied is merged into it). Before: one SIGHUP, and the new identity's
    JetStream requests found no responders."""
    reload = service_section(DEPLOY / "llmgw-nats.service")["ExecReload"]
    signals = [c for c in reload if c.split()[1:] == ["-HUP", "$MAINPID"]]
    assert len(signals) == natsd.RELOAD_ROUNDS, reload
    pauses = [c.split() for c in reload if PurePosixPath(c.split()[0]).name == "sleep"]
    assert len(pauses) == natsd.RELOAD_ROUNDS - 1, reload
    assert all(float(p[1]) >= natsd.RELOAD_GAP_S for p in pauses), reload
    order = [PurePosixPath(c.split()[0]).name for c in reload]
    assert order == ["kill"] + ["sleep", "kill"] * (natsd.RELOAD_ROUNDS - 1), reload
