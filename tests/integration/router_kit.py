"""Real processes for router tests: `llmgw sim` engines and `llmgw router`, on free ports.

Each is a subprocess started the way an operator would start it, announced by
its one stdout line, stopped by SIGTERM (SIGKILL to simulate a crash). Also
used by tests/bench/bench_router.py.
"""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from llmgw.sim.testing import SimProcess, wait_for_line
from tests.kit.processes import Proc

PY = sys.executable
LINE = re.compile(r"listening on (http://[^\s]+)(?: admin (http://[^\s]+))?")


class Sim(Proc):
    """One `llmgw sim` engine, started by the package's own test helper."""

    def __init__(self, sim: SimProcess) -> None:
        super().__init__(sim.proc)
        self.url = sim.url
        self.sim = sim

    @classmethod
    def start(cls, name: str = "m", *args: str, log: Path | None = None) -> Sim:
        return cls(SimProcess.start(*args, model=name, timeout=30, log=log))

    def stop(self, timeout: float = 10.0) -> int | None:
        self.sim.stop(timeout)
        return self.sim.proc.returncode

    def get(self, path: str) -> bytes:
        with urllib.request.urlopen(self.url + path, timeout=5) as r:
            data: bytes = r.read()
            return data

    def metrics(self) -> dict[str, float]:
        """Metric name (labels dropped, summed) -> value."""
        out: dict[str, float] = {}
        for line in self.sim.metrics_text().splitlines():
            if not line or line.startswith("#"):
                continue
            name = re.split(r"[{ ]", line, maxsplit=1)[0]
            with contextlib.suppress(ValueError):
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
        return out

    def faults(self, **faults: Any) -> None:
        assert faults, "clear_faults() clears the plan"
        self.sim.faults(**faults)

    def clear_faults(self) -> None:
        self.sim.faults()


def admin_metrics(admin: str) -> dict[str, float]:
    """A router's samples, keyed by their full line name with labels: `name{a="b"}` -> value."""
    with urllib.request.urlopen(admin + "/metrics", timeout=5) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


class Router(Proc):
    """One `llmgw router --config ...` with a generated config."""

    url: str
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
        feed: dict[str, Any] | None = None,
        **settings: Any,
    ) -> Router:
        """`sims` maps endpoint id -> sim (or URL); every endpoint serves model `m`
        unless `endpoint_models` says otherwise. `feed`: the config's `log` section (the
        NATS server it follows; `log` is this process's log file)."""
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
        if feed is not None:
            cfg["log"] = feed
        cfg.setdefault("auth", {"allow_anonymous": True})
        for key, value in settings.items():
            cfg[key] = value
        path = tmp / f"router-{len(list(tmp.glob('router-*.yaml')))}.yaml"
        # Each router following a log its own spool folder unless a test shares one (a
        # restarted router's); a router without one opens none (and an older router, a
        # benchmark's baseline, knows no such field).
        if "log" in cfg:
            cfg.setdefault("state_dir", str(path.with_suffix(".state")))
        path.write_text(yaml.safe_dump(cfg))
        log_path = log or path.with_suffix(".log")
        with open(log_path, "ab") as stderr:
            proc = subprocess.Popen(
                [PY, "-m", "llmgw", "router", "--config", str(path)],
                stdout=subprocess.PIPE,
                stderr=stderr,
                env={**os.environ, **(env or {})},
            )
        try:
            m = wait_for_line(proc, LINE, "llmgw router", 60)
        except RuntimeError as exc:
            proc.kill()
            proc.wait()
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{exc} stderr={tail}") from None
        r = cls(proc, log_path)
        r.url, r.admin = m.group(1), m.group(2)
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
        return admin_metrics(self.admin)

    def endpoint_requests(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for key, v in self.metrics().items():
            m = re.match(r'llmgw_router_endpoint_requests_total\{endpoint="([^"]+)"\}', key)
            if m:
                out[m.group(1)] = v
        return out
