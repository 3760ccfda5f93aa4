"""`llmgw control --check`, `llmgw agent --check` and `llmgw router check` look at the
certificate files too: missing, unreadable or mismatched files are refused (exit 2)
naming the setting."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from llmgw.pki.identity import Identity
from tests.harness import TestPki


def _files(pki: TestPki, kind: str, name: str) -> dict[str, str]:
    identity = Identity(kind, name)  # type: ignore[arg-type]
    pki.client_tls(kind, name)
    return {
        "ca_file": str(pki.certs.ca_cert),
        "cert_file": str(pki.certs.cert(identity)),
        "key_file": str(pki.certs.key(identity)),
    }


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "llmgw", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={k: v for k, v in os.environ.items() if not k.startswith("LLMGW_")},
    )


def _control(tmp_path: Path, nats: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "control.yaml"
    path.write_text(yaml.safe_dump({"name": "c1", "nats": nats}))
    return _run("control", "--config", str(path), "--check")


def test_control_check_passes_with_real_files(pki: TestPki, tmp_path: Path) -> None:
    done = _control(tmp_path, _files(pki, "control", "c1"))
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


@pytest.mark.parametrize("field", ["ca_file", "cert_file", "key_file"])
def test_control_check_refuses_a_missing_file(pki: TestPki, tmp_path: Path, field: str) -> None:
    nats = {**_files(pki, "control", "c1"), field: str(tmp_path / "gone.pem")}
    done = _control(tmp_path, nats)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"nats.{field}: {tmp_path / 'gone.pem'} does not exist" in done.stderr
    assert "ok" not in done.stdout


def test_control_check_refuses_a_key_of_another_certificate(pki: TestPki, tmp_path: Path) -> None:
    nats = {**_files(pki, "control", "c1"), "key_file": _files(pki, "control", "c2")["key_file"]}
    done = _control(tmp_path, nats)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "nats: cannot use" in done.stderr


def test_control_check_refuses_missing_admin_files(pki: TestPki, tmp_path: Path) -> None:
    path = tmp_path / "control.yaml"
    missing = str(tmp_path / "admin.pem")
    path.write_text(
        yaml.safe_dump(
            {
                "name": "c1",
                "nats": _files(pki, "control", "c1"),
                "admin": {"cert_file": missing, "key_file": missing, "ca_file": missing},
            }
        )
    )
    done = _run("control", "--config", str(path), "--check")
    assert done.returncode == 2
    assert f"admin.cert_file: {missing} does not exist" in done.stderr


def test_router_check_refuses_missing_log_files(pki: TestPki, tmp_path: Path) -> None:
    path = tmp_path / "router.yaml"
    cfg = {"auth": {"allow_anonymous": True}, "log": {"name": "r1", **_files(pki, "router", "r1")}}
    path.write_text(yaml.safe_dump(cfg))
    done = _run("router", "check", "--config", str(path))
    assert done.returncode == 0, done.stderr
    cfg["log"]["cert_file"] = str(tmp_path / "gone.pem")  # type: ignore[index]
    path.write_text(yaml.safe_dump(cfg))
    done = _run("router", "check", "--config", str(path))
    assert done.returncode == 2
    assert "log.cert_file" in done.stderr
    assert "does not exist" in done.stderr


def _agent(tmp_path: Path, nats: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / "agent.yaml"
    cfg = {"node_id": "n1", "state_dir": str(tmp_path / "state"), "nats": nats}
    path.write_text(yaml.safe_dump(cfg))
    return _run("agent", "--config", str(path), "--check")


def test_agent_check_passes_with_real_files(pki: TestPki, tmp_path: Path) -> None:
    done = _agent(tmp_path, _files(pki, "node", "n1"))
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


@pytest.mark.parametrize("field", ["ca_file", "cert_file", "key_file"])
def test_agent_check_refuses_a_missing_file(pki: TestPki, tmp_path: Path, field: str) -> None:
    done = _agent(tmp_path, {**_files(pki, "node", "n1"), field: str(tmp_path / "gone.pem")})
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"nats.{field}: {tmp_path / 'gone.pem'} does not exist" in done.stderr
    assert "ok" not in done.stdout


def test_agent_check_refuses_a_key_of_another_certificate(pki: TestPki, tmp_path: Path) -> None:
    nats = {**_files(pki, "node", "n1"), "key_file": _files(pki, "node", "n2")["key_file"]}
    done = _agent(tmp_path, nats)
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert "nats: cannot use" in done.stderr
