"""A real fleet (tests/e2e/fleet_kit.py) with `llmgw console` beside it as a subprocess,
as an operator; its GPUs come from a simulated inventory in which GPU 1 of every node
has uncorrected ECC errors, so the page has an unhealthy GPU to show from the start.
Used by tests/e2e/test_console*.py and tests/bench/bench_console.py."""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import yaml

from llmgw.cli import console as console_cli
from llmgw.pki.identity import Identity
from tests.e2e.fleet_kit import Fleet, Service, sim_model
from tests.harness import TestNatsServer

PY = sys.executable


def faulty_inventory(tmp: Path) -> Path:
    """Two H100s per node, GPU 1 with uncorrected ECC errors."""
    gpus = [
        {"index": i, "uuid": f"GPU-sim-{i}", "name": "NVIDIA H100 80GB HBM3",
         "gpu_class": "h100-80g", "memory_mib": 81559, "compute_capability": "9.0",
         "nvlink_domain": 0, "ecc_uncorrected": 3 if i == 1 else 0}
        for i in range(2)
    ]  # fmt: skip
    path = tmp / "inventory.yaml"
    path.write_text(yaml.safe_dump({"gpus": gpus}))
    return path


def fleet(server: TestNatsServer, tmp: Path) -> Fleet:
    """node-a and node-b, one replica of m1 (1 GPU)."""
    return Fleet(server, tmp, models=(sim_model("m1", replicas=1),),
                 gpus=str(faulty_inventory(tmp)))  # fmt: skip


TOKENS: dict[str, str] = {}
"""Each started console's token, by its URL: `call` presents it."""


def console_argv(server: TestNatsServer, *extra: str, name: str = "alice") -> list[str]:
    """`llmgw console` on a free port as operator `name` (issued if need be), with `extra`."""
    server.pki.client_tls("operator", name)
    certs = server.pki.certs
    return [PY, "-m", "llmgw", "console", "--port", "0", "--server", server.url,
            "--ca", str(certs.ca_cert), "--cert", str(certs.cert(Identity("operator", name))),
            *extra]  # fmt: skip


def start_console(server: TestNatsServer, tmp: Path, name: str = "alice") -> tuple[Service, str]:
    """`llmgw console` on a free port as operator `name`: the service and its URL (its
    token in `TOKENS`; `opening(url)` is the address a browser opens)."""
    console = Service(
        "console",
        console_argv(server, name=name),
        tmp / "console.log",
        r"llmgw console at (http://\S+) as \S+: open \S+#token=(\S+)",
    )
    found = console.start()
    TOKENS[found.group(1)] = found.group(2)
    return console, found.group(1)


def opening(url: str) -> str:
    """The address `llmgw console` prints for a browser to open: the page takes the token
    from its fragment."""
    return console_cli.opening_address(url, TOKENS[url])


def bearer(url: str) -> dict[str, str]:
    """The header a script presents to the console whose address begins `url`."""
    for base, token in TOKENS.items():
        if url.startswith(base):
            return {"Authorization": f"Bearer {token}"}
    return {}


def call(url: str, *, body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """GET (or POST `body` as JSON with the console's write header): status and JSON."""
    data = None if body is None else json.dumps(body).encode()
    hdrs = {"Content-Type": "application/json", "X-Llmgw-Console": "1"} if body is not None else {}
    req = urllib.request.Request(url, data=data, headers={**bearer(url), **hdrs, **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def holder(view: dict[str, Any], replica_model: str = "m1") -> dict[str, int]:
    """node -> GPUs holding a live replica of the model, in a fleet view."""
    ids = {r["id"] for r in view["replicas"] if r["model"] == replica_model and not r["retired"]}
    return {
        n["name"]: sum(1 for g in n["gpus"] if g["replica"] in ids)
        for n in view["nodes"]
        if any(g["replica"] in ids for g in n["gpus"])
    }
