"""Real processes for router tests: `llmgw sim` engines and `llmgw router`, on free ports.

Each is a subprocess started the way an operator would start it, announced by
its one stdout line, stopped by SIGTERM (SIGKILL to simulate a crash). Also
used by tests/bench/bench_router.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import select
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

PY = sys.executable
LINE = re.compile(rb"listening on (http://[^\s]+)(?: admin (http://[^\s]+))?")


def _read_announce(proc: subprocess.Popen[bytes], what: str, timeout: float) -> re.Match[bytes]:
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    buf = b""
    while time.monotonic() < deadline:
        ready, _, _ = select.select([proc.stdout], [], [], 0.1)
        if ready:
            line = proc.stdout.readline()
            if not line:
                break
            buf += line
            m = LINE.search(line)
            if m:
                return m
        elif proc.poll() is not None:
            break
    proc.kill()
    err = proc.stderr.read().decode(errors="replace")[-3000:] if proc.stderr else ""
    raise RuntimeError(f"{what} did not announce itself: stdout={buf!r} stderr={err}")


class Proc:
    def __init__(self, proc: subprocess.Popen[bytes], url: str) -> None:
        self.proc = proc
        self.url = url

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self, timeout: float = 10.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


class Sim(Proc):
    """One `llmgw sim` engine."""

    @classmethod
    def start(cls, name: str = "m", *args: str, log: Path | None = None) -> Sim:
        cmd = [PY, "-m", "llmgw", "sim", "--host", "127.0.0.1", "--port", "0"]
        cmd += ["--served-model-name", name, *args]
        stderr = open(log, "ab") if log else subprocess.DEVNULL  # noqa: SIM115
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr)
        m = _read_announce(proc, "llmgw sim", 30)
        return cls(proc, m.group(1).decode())

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            data: bytes = r.read()
            return data

    def metrics(self) -> dict[str, float]:
        """Metric name (labels dropped, summed) -> value."""
        out: dict[str, float] = {}
        for line in self.get("/metrics").decode().splitlines():
            if not line or line.startswith("#"):
                continue
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def faults(self, **faults: Any) -> None:
        import json

        req = urllib.request.Request(
            self.url + "/sim/faults",
            data=json.dumps(faults).encode(),
            method="POST",
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=5) as r:
            assert r.status in (200, 204), r.status

    def clear_faults(self) -> None:
        _delete(self.url + "/sim/faults")


def _delete(url: str) -> None:
    req = urllib.request.Request(url, method="DELETE")
    with urllib.request.urlopen(req, timeout=5) as r:
        assert r.status in (200, 204), r.status


class Router(Proc):
    """One `llmgw router --config ...` with a generated config."""

    admin: str

    @classmethod
    def start(
        cls,
        tmp: Path,
        sims: dict[str, Sim | str],
        *,
        models: list[dict[str, Any]] | None = None,
        endpoint_models: dict[str, list[str]] | None = None,
        workers: int = 1,
        log: Path | None = None,
        env: dict[str, str] | None = None,
        **settings: Any,
    ) -> Router:
        """`sims` maps endpoint id -> sim (or URL); every endpoint serves model `m`
        unless `endpoint_models` says otherwise."""
        cfg: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "workers": workers,
            "models": models or [{"name": "m"}],
            "endpoints": [
                {
                    "id": ep_id,
                    "url": s.url if isinstance(s, Sim) else s,
                    "models": (endpoint_models or {}).get(ep_id, ["m"]),
                }
                for ep_id, s in sims.items()
            ],
            "probe_interval_s": 0.2,
            "seed": 7,
            "log_level": "info",
        }
        cfg.setdefault("auth", {"allow_anonymous": True})
        for key, value in settings.items():
            cfg[key] = value
        path = tmp / f"router-{len(list(tmp.glob('router-*.yaml')))}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        stderr = open(log or path.with_suffix(".log"), "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [PY, "-m", "llmgw", "router", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=stderr,
            env={**os.environ, **(env or {})},
        )
        m = _read_announce(proc, "llmgw router", 60)
        r = cls(proc, m.group(1).decode())
        r.admin = m.group(2).decode()
        r.wait_ready()
        return r

    def wait_ready(self, timeout: float = 15.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(self.url + "/ready", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.05)
        raise RuntimeError("router never became ready")

    def metrics(self) -> dict[str, float]:
        """Samples keyed by their full line name with labels: `name{a="b"}` -> value."""
        with urllib.request.urlopen(self.admin + "/metrics", timeout=5) as r:
            text = r.read().decode()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                out[key] = float(value)
        return out

    def endpoint_requests(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, v in self.metrics().items():
            m = re.match(r'llmgw_router_endpoint_requests_total\{endpoint="([^"]+)"\}', key)
            if m:
                out[m.group(1)] = v
        return out
