"""Who may use `llmgw console`: loopback unless told otherwise, and beyond it HTTPS that
admits operator certificates of the fleet's CA only, for reads and writes alike; a write
is the console's event, and names the operator whose certificate asked for it when that
is not the console's own. The console runs as a real process over a real nats-server with
mTLS."""

from __future__ import annotations

import asyncio
import json
import ssl
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.e2e.console_kit import console_argv
from tests.e2e.fleet_kit import Service
from tests.harness import TestNatsServer
from tests.integration.ctl_kit import node_a_registered

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("--host", "0.0.0.0"), "would show the fleet to anyone"),
        (("--host", "10.1.2.3"), "--tls-cert and --tls-key"),
        (("--tls-cert", "/nonexistent.pem"), "give --tls-cert and --tls-key together"),
        (("--header-timeout-s", "0"), "--header-timeout-s must be a number of seconds above 0"),
    ],
)
def test_a_listener_without_its_guards_is_refused(
    nats_server: TestNatsServer, extra: tuple[str, ...], said: str
) -> None:
    nats_server.pki.client_tls("operator", "alice")
    out = subprocess.run(console_argv(nats_server, *extra), capture_output=True, text=True,
                         timeout=120, check=False)  # fmt: skip
    assert out.returncode == 2, out
    assert said in out.stderr
    assert "Traceback" not in out.stderr


async def test_over_https_only_operator_certificates_read_or_write(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    async with node_a_registered(nats_server):
        await _only_operators(nats_server, tmp_path)


async def _only_operators(nats_server: TestNatsServer, tmp_path: Path) -> None:
    pki = nats_server.pki
    operator_tls = pki.client_tls("operator", "alice")
    bob_tls = pki.client_tls("operator", "bob")
    node_tls = pki.client_tls("node", "node-a")
    router_tls = pki.client_tls("router", "r1")
    console = Service(
        "console",
        console_argv(
            nats_server,
            "--tls-cert",
            str(pki.certs.server_cert),
            "--tls-key",
            str(pki.certs.server_key),
        ),
        tmp_path / "console.log",
        r"llmgw console at (https://\S+)",
    )
    base = (await asyncio.to_thread(console.start)).group(1)
    try:
        async with aiohttp.ClientSession() as http:

            async def answer(tls: ssl.SSLContext, path: str, body: Any = None) -> tuple[int, Any]:
                headers = {"X-Llmgw-Console": "1"}
                call = http.get(base + path, ssl=tls) if body is None else \
                    http.post(base + path, json=body, headers=headers, ssl=tls)  # fmt: skip
                async with call as resp:
                    data = await resp.read()
                    is_json = resp.content_type == "application/json"
                    return resp.status, json.loads(data) if is_json else None

            async def status(tls: ssl.SSLContext, path: str, post: bool = False) -> int:
                return (await answer(tls, path, {} if post else None))[0]

            async def ready() -> bool:
                code, view = await answer(operator_tls, "/api/fleet")
                return code == 200 and [n["name"] for n in view["nodes"]] == ["node-a"]

            for _ in range(120):
                if await ready():
                    break
                await asyncio.sleep(0.5)
            assert await ready()
            assert await status(operator_tls, "/") == 200
            for other in (node_tls, router_tls):
                assert await status(other, "/api/fleet") == 403
                assert await status(other, "/") == 403
                assert await status(other, "/api/nodes/node-a/cordon", post=True) == 403
            # An operator's write reaches the checks (no such node: a 400, not a 403).
            assert await status(operator_tls, "/api/nodes/ghost/cordon", post=True) == 400
            # Bob's cordon is the console's (alice's) event, and says that bob asked.
            code, done = await answer(bob_tls, "/api/nodes/node-a/cordon", {"reason": "fans"})
            assert code == 200, done
            assert (done["published"]["type"], done["published"]["operator"]) == (
                "operator.node_cordoned", "alice"
            )  # fmt: skip
            assert done["published"]["event"]["reason"] == "fans (by bob through the console)"
            code, done = await answer(operator_tls, "/api/nodes/node-a/uncordon", {})
            assert code == 200, done
            assert done["published"]["type"] == "operator.node_uncordoned"
            code, done = await answer(operator_tls, "/api/nodes/node-a/cordon", {"reason": "x"})
            assert code == 200, done
            assert done["published"]["event"]["reason"] == "x"  # alice is the console
            with pytest.raises(aiohttp.ClientError):
                await status(pki.anonymous_tls(), "/api/fleet")
            # Another site's `<img>` of a timeline: the browser presents alice's certificate
            # too, and says whose page asked; refused before any scan of the log.
            img = {"Sec-Fetch-Site": "cross-site", "Sec-Fetch-Mode": "no-cors"}
            async with http.get(base + "/api/timeline?target=node-a", headers=img,
                                ssl=operator_tls) as resp:  # fmt: skip
                assert resp.status == 403
                assert "another site" in (await resp.json())["error"]
    finally:
        console.terminate()
