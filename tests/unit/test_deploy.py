"""deploy/ ships systemd units that systemd itself accepts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "systemd"
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
