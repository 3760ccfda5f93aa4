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


def _config(service: str, tmp_path: Path, nats: dict[str, str]) -> dict[str, object]:
    if service == "control":
        return {"name": "c1", "nats": nats}
    return {"node_id": "n1", "state_dir": str(tmp_path / "state"), "nats": nats}


# Each service's command: the kind of identity it runs as and its name's prefix (c1, n1).
SERVICES = {"control": ("control", "c"), "agent": ("node", "n")}


def _check(service: str, tmp_path: Path, nats: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = tmp_path / f"{service}.yaml"
    path.write_text(yaml.safe_dump(_config(service, tmp_path, nats)))
    return _run(service, "--config", str(path), "--check")


def _own(pki: TestPki, service: str, name: str = "1") -> dict[str, str]:
    kind, prefix = SERVICES[service]
    return _files(pki, kind, prefix + name)


@pytest.mark.parametrize("service", SERVICES)
def test_check_passes_with_real_files(pki: TestPki, tmp_path: Path, service: str) -> None:
    done = _check(service, tmp_path, _own(pki, service))
    assert done.returncode == 0, done.stderr
    assert "ok" in done.stdout


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("field", ["ca_file", "cert_file", "key_file"])
def test_check_refuses_a_missing_file(
    pki: TestPki, tmp_path: Path, service: str, field: str
) -> None:
    done = _check(service, tmp_path, {**_own(pki, service), field: str(tmp_path / "gone.pem")})
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert f"nats.{field}: {tmp_path / 'gone.pem'} does not exist" in done.stderr
    assert "ok" not in done.stdout


@pytest.mark.parametrize("service", SERVICES)
def test_check_refuses_a_key_of_another_certificate(
    pki: TestPki, tmp_path: Path, service: str
) -> None:
    nats = {**_own(pki, service), "key_file": _own(pki, service, "2")["key_file"]}
    done = _check(service, tmp_path, nats)
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


@pytest.mark.parametrize("under", [False, True])
def test_agent_refuses_a_state_dir_it_cannot_make(
    pki: TestPki, tmp_path: Path, under: bool
) -> None:
    # `--check` said ok for a state_dir naming a file (or a path under one), and the agent
    # then ended in a FileExistsError / NotADirectoryError traceback from mkdir.
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file\n")
    state = blocker / "agent" if under else blocker
    path = tmp_path / "agent.yaml"
    cfg = {"node_id": "n1", "state_dir": str(state), "sim_gpus": "1xh100-80g",
           "nats": {**_own(pki, "agent"), "servers": ["tls://127.0.0.1:1"]}}  # fmt: skip
    path.write_text(yaml.safe_dump(cfg))
    for args in (["--check"], []):
        done = _run("agent", "--config", str(path), *args)
        assert done.returncode == 2, (args, done.stderr[-2000:])
        assert f"state_dir: {state}" in done.stderr
        assert "Traceback" not in done.stderr
    assert blocker.read_text() == "a file\n"
