"""Who may use `llmgw console`: loopback unless told otherwise, and beyond it HTTPS that
admits operator certificates of the fleet's CA only, for reads and writes alike. The
console runs as a real process over a real nats-server with mTLS."""

from __future__ import annotations

import asyncio
import ssl
import subprocess
from pathlib import Path

import aiohttp
import pytest

from llmgw import bus
from tests.e2e.console_kit import console_argv
from tests.e2e.fleet_kit import Service
from tests.harness import TestNatsServer, connect_as

pytestmark = pytest.mark.slow


@pytest.mark.parametrize(
    ("extra", "said"),
    [
        (("--host", "0.0.0.0"), "would show the fleet to anyone"),
        (("--host", "10.1.2.3"), "--tls-cert and --tls-key"),
        (("--tls-cert", "/nonexistent.pem"), "give --tls-cert and --tls-key together"),
    ],
)
def test_listening_beyond_loopback_without_https_is_refused(
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
    control = await connect_as(nats_server, "control", "control-a")
    await bus.provision(control.jetstream())
    await control.close()
    pki = nats_server.pki
    operator_tls = pki.client_tls("operator", "alice")
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

            async def status(tls: ssl.SSLContext, path: str, post: bool = False) -> int:
                headers = {"X-Llmgw-Console": "1"}
                call = http.post(base + path, json={}, headers=headers, ssl=tls) if post else \
                    http.get(base + path, ssl=tls)  # fmt: skip
                async with call as resp:
                    await resp.read()
                    return resp.status

            async def ready() -> bool:
                return await status(operator_tls, "/api/fleet") == 200

            for _ in range(120):
                if await ready():
                    break
                await asyncio.sleep(0.5)
            assert await status(operator_tls, "/") == 200
            for other in (node_tls, router_tls):
                assert await status(other, "/api/fleet") == 403
                assert await status(other, "/") == 403
                assert await status(other, "/api/nodes/node-a/cordon", post=True) == 403
            # An operator's write reaches the checks (no such node: a 400, not a 403).
            assert await status(operator_tls, "/api/nodes/node-a/cordon", post=True) == 400
            with pytest.raises(aiohttp.ClientError):
                await status(pki.anonymous_tls(), "/api/fleet")
    finally:
        console.terminate()
