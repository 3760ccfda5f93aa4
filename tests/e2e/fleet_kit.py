"""The whole fleet as real processes, for the failure scenarios of tests/e2e/test_fleet_*.py.

`Fleet` runs, against a harness nats-server (or a 3-server cluster): `llmgw agent` x N
whose replicas are real `llmgw sim` engines, `llmgw control`, and `llmgw router` fed by
the log (its `log:` section, as its `router` identity); each a subprocess started the way
an operator starts it, announced by its one stdout line, logged to a file under the
test's tmp dir. Timings are short (heartbeat 0.5 s, unreachable 2 s, lost 4 s, lease
2 s) so that each scenario fits in well under a minute on a loaded 2-core machine.

`Load` is the steady client: N concurrent streaming chat completions in a loop through
the router (aiohttp), each checked to the end (status 200, content, a finish_reason,
`data: [DONE]`): anything else is recorded as a failure with when and why.

Helpers read the control plane's admin API (/v1/state, /v1/replicas, /v1/nodes), the
router's per-endpoint counters, and the log itself (as the test-only admin).
Every wait polls a condition with a deadline; the only waits on the clock are the
outages a scenario decides to last (a stopped nats-server).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import nats
import yaml
from nats.aio.client import Client

from llmgw import bus
from llmgw.bus import keys as bus_keys
from llmgw.control.config import (
    AdminListener,
    ControlConfig,
    NatsConfig,
    SnapshotConfig,
)
from llmgw.core import events, state
from llmgw.core.profile import ModelProfile
from llmgw.core.reconcile import ReconcileConfig
from llmgw.pki.identity import Identity
from llmgw.sim.testing import wait_for_line
from tests.harness import ADMIN_KEY, TestNatsCluster, TestNatsServer, wait_for
from tests.integration import agent_kit
from tests.kit.processes import Proc, killpg
from tests.kit.timings import FAST_FLEET, HEARTBEAT_S

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable

# Engines with a step time, so streams are in flight when things fail (16 tokens ~ 0.1 s).
SIM_ARGS = ("--decode-base-ms", "5")

Server = TestNatsServer | TestNatsCluster


def sim_model(name: str = "m1", replicas: int = 2, **fields: Any) -> ModelProfile:
    fields.setdefault("engine_args", SIM_ARGS)
    return ModelProfile(
        name=name,
        engine="sim",
        replicas=replicas,
        start_timeout_s=30.0,
        load_timeout_s=30.0,
        **fields,
    )


# --------------------------------------------------------------------------- processes


class Service(Proc):
    """One llmgw service subprocess: ready when its announce line matches `ready`.

    stdout is read until that line, then copied to the log by a thread, so that the
    child never blocks on a full pipe; stderr (structlog) goes straight to the log.
    Its own session: signals to the test's group do not reach it, and a kill -9 of
    the service can take its whole group with it.
    """

    log_path: Path

    def __init__(self, name: str, argv: Sequence[str], log_path: Path, ready: str) -> None:
        super().__init__(None, log_path)
        self.name = name
        self.argv = list(argv)
        self.ready = re.compile(ready)
        self.match: re.Match[str] | None = None

    def start(self, timeout_s: float = 60.0) -> re.Match[str]:
        log = open(self.log_path, "ab")  # noqa: SIM115 (handed to the child)
        self.proc = subprocess.Popen(
            self.argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log,
            cwd=ROOT,
            start_new_session=True,
        )
        log.close()
        try:
            found = wait_for_line(self.proc, self.ready, self.name, timeout_s)
        except RuntimeError as exc:
            self.kill9()
            raise AssertionError(f"{exc}\nlog {self.log_path}:\n{self.log_tail()}") from None
        self.match = found
        threading.Thread(target=self._copy_stdout, daemon=True).start()
        return found

    def _copy_stdout(self) -> None:
        assert self.proc is not None
        assert self.proc.stdout is not None
        with contextlib.suppress(Exception), open(self.log_path, "ab") as log:
            for line in self.proc.stdout:
                log.write(line)

    def kill9(self) -> None:
        """SIGKILL the service and anything left in its process group."""
        if self.proc is not None:
            killpg(self.proc)

    def terminate(self, timeout_s: float = 15.0) -> None:
        """SIGTERM, then (at once if it exited, after `timeout_s` if not) SIGKILL to the
        group: nothing it started outlives the test."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout_s)
        self.kill9()


def loopback_base(tmp: Path) -> str:
    """127.A.B: the nodes' addresses for this test (127.A.B.10 + i), from its tmp dir.

    Placement gives every node the same ports (8100...), so each node binds its own
    loopback address, as on separate hosts; deriving it from the tmp dir keeps two
    test runs on one machine off each other's addresses.
    """
    digest = zlib.crc32(str(tmp).encode())
    return f"127.{1 + digest % 254}.{1 + (digest // 254) % 254}"


@dataclass
class Fleet:
    """nats (given) + agents + control + router, as real processes; see the module doc."""

    server: Server
    tmp: Path
    models: tuple[ModelProfile, ...] = (sim_model(),)
    nodes: tuple[str, ...] = ("node-a", "node-b")
    gpus: str = "2xh100-80g"
    stream_replicas: int = 1
    control_name: str = "control-1"
    router_name: str = "router-1"
    reconcile: ReconcileConfig = FAST_FLEET
    control: Service | None = None
    agents: dict[str, Service] = field(default_factory=dict)
    router: Service | None = None
    control_admin: str = ""
    router_url: str = ""
    router_admin: str = ""
    addresses: dict[str, str] = field(default_factory=dict)

    # ------------------------------------------------------------------ configs

    @property
    def urls(self) -> list[str]:
        return list(self.server.urls)

    def _tls_files(self, kind: str, name: str) -> dict[str, str]:
        pki = self.server.pki
        pki.client_tls(kind, name)  # issues the certificate, re-renders, reloads the servers
        identity = Identity(kind, name)  # type: ignore[arg-type]
        return {
            "ca_file": str(pki.certs.ca_cert),
            "cert_file": str(pki.certs.cert(identity)),
            "key_file": str(pki.certs.key(identity)),
        }

    def control_config(self) -> Path:
        cfg = ControlConfig(
            name=self.control_name,
            nats=NatsConfig(
                servers=tuple(self.urls),
                stream_replicas=self.stream_replicas,
                **self._tls_files("control", self.control_name),
            ),
            lease_ttl_s=2.0,
            reconcile_interval_s=0.2,
            reconcile=self.reconcile,
            snapshot=SnapshotConfig(every_events=0, every_s=0),
            models=self.models,
            admin=AdminListener(host="127.0.0.1", port=0),
            log_level="info",
        )
        path = self.tmp / "control.yaml"
        path.write_text(yaml.safe_dump(msgspec.to_builtins(cfg)))
        return path

    def agent_config(self, node: str, index: int) -> Path:
        address = f"{loopback_base(self.tmp)}.{10 + index}"
        self.addresses[node] = address
        settings: dict[str, Any] = {
            "node_id": node,
            "address": address,
            "nats": {"servers": self.urls, **self._tls_files("node", node)},
            "state_dir": str(self.state_dir(node)),
            "sim_gpus": self.gpus,
            "engine_host": address,
            "admin": {"host": address, "port": 0},
            "heartbeat_s": HEARTBEAT_S,
            "heartbeat_ttl_s": 60,
            "engine_poll_s": 0.2,
            "stop_grace_s": 2,
            "log_level": "info",
        }
        path = self.tmp / f"{node}.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    def router_config(self) -> Path:
        settings: dict[str, Any] = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "admin": {"host": "127.0.0.1", "port": 0},
            "workers": 1,
            "log": {
                "servers": self.urls,
                "name": self.router_name,
                **self._tls_files("router", self.router_name),
            },
            "auth": {"allow_anonymous": True},
            "probe_interval_s": 0.5,
            "seed": 7,
            "log_level": "info",
            "state_dir": str(self.tmp / "router-state"),
        }
        path = self.tmp / "router.yaml"
        path.write_text(yaml.safe_dump(settings))
        return path

    def state_dir(self, node: str) -> Path:
        return self.tmp / node / "state"

    # ------------------------------------------------------------------ lifecycle

    async def provision(self) -> None:
        """The stream first, so agents started before the control plane register at once
        (and the first placement sees every node: replicas spread across them)."""
        nc = await self.admin()
        try:
            await bus.provision(nc.jetstream(timeout=10), replicas=self.stream_replicas)
        finally:
            await close(nc)

    def start_agent(self, node: str) -> Service:
        index = self.nodes.index(node) + 1
        path = self.agent_config(node, index)
        agent = Service(
            f"agent {node}",
            [PY, "-m", "llmgw", "agent", "--config", str(path)],
            self.tmp / f"agent-{node}.log",
            rf"^llmgw agent {node} started",
        )
        self.agents[node] = agent
        agent.start()
        return agent

    def start_control(self) -> Service:
        path = self.control_config()
        control = Service(
            "control",
            [PY, "-m", "llmgw", "control", "--config", str(path)],
            self.tmp / "control.log",
            r"^llmgw control \S+ admin (http://\S+)",
        )
        self.control = control
        self.control_admin = control.start().group(1)
        return control

    def start_router(self) -> Service:
        path = self.router_config()
        router = Service(
            "router",
            [PY, "-m", "llmgw", "router", "--config", str(path)],
            self.tmp / "router.log",
            r"listening on (http://\S+) admin (http://\S+)",
        )
        self.router = router
        found = router.start()
        self.router_url, self.router_admin = found.group(1), found.group(2)
        return router

    async def start(
        self,
        *,
        serving: int | None = None,
        within_s: float = 60.0,
        first: Sequence[str] | None = None,
    ) -> None:
        """Everything, then wait until `serving` replicas (default: every model's count)
        serve and the router routes to each of them. `first`: only these nodes' agents
        (the rest join later with `join`), so that every replica lands on them."""
        # Every certificate first, one after the other: each issue re-renders the
        # authorization and reloads the servers.
        pki = self.server.pki
        identities = [("control", self.control_name), ("router", self.router_name)]
        for kind, name in [*identities, *(("node", n) for n in self.nodes)]:
            await asyncio.to_thread(pki.client_tls, kind, name)
        await self.provision()
        starting = list(self.nodes if first is None else first)
        await asyncio.gather(*(asyncio.to_thread(self.start_agent, n) for n in starting))
        await wait_for(
            lambda: self._registered(starting), 30, f"{', '.join(starting)} registered in the log"
        )
        await asyncio.gather(
            asyncio.to_thread(self.start_control), asyncio.to_thread(self.start_router)
        )
        want = serving if serving is not None else sum(m.replicas for m in self.models)
        await self.wait_routable(want, within_s)

    async def join(self, node: str) -> None:
        """Start a node left out of `start(first=...)`; until the log has its registration."""
        await asyncio.to_thread(self.start_agent, node)
        await wait_for(lambda: self._registered([node]), 30, f"{node} registered in the log")

    async def _registered(self, nodes: Sequence[str]) -> bool:
        records = await self.read_log()
        seen = {r.event.node for r in records if isinstance(r.event, events.NodeRegistered)}
        return seen >= set(nodes)

    async def wait_routable(self, count: int, within_s: float = 60.0) -> list[dict[str, Any]]:
        """Until `count` replicas serve and the router has a ready endpoint for each."""
        rows: list[dict[str, Any]] = []

        async def check() -> bool:
            nonlocal rows
            rows = [r for r in await self.replicas() if serving(r)]
            if len(rows) != count:
                return False
            ready = await self.router_ready()
            return all(ready.get(r["id"]) == 1.0 for r in rows)

        await wait_for(check, within_s, f"{count} replicas serving and routed", every_s=0.2)
        return rows

    def kill_node(self, node: str) -> None:
        """A lost node: kill -9 its agent and every engine's process group it recorded."""
        self.agents[node].kill9()
        agent_kit.kill_engines(self.state_dir(node))

    async def stop(self) -> None:
        if self.router is not None:
            await asyncio.to_thread(self.router.terminate)
        await asyncio.gather(*(asyncio.to_thread(a.terminate) for a in self.agents.values()))
        if self.control is not None:
            await asyncio.to_thread(self.control.terminate)
        for node in self.nodes:
            agent_kit.kill_engines(self.state_dir(node))

    def logs(self) -> str:
        """Every service's log tail, for a failing assertion's message."""
        parts = []
        for svc in [self.control, self.router, *self.agents.values()]:
            if svc is not None:
                parts.append(f"---- {svc.name} ({svc.log_path})\n{svc.log_tail(25)}")
        return "\n".join(parts)

    # ------------------------------------------------------------------ reads

    async def get_json(self, url: str) -> Any:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
            http.get(url) as resp,
        ):
            resp.raise_for_status()
            return await resp.json()

    async def control_state(self) -> dict[str, Any]:
        doc: dict[str, Any] = await self.get_json(f"{self.control_admin}/v1/state")
        return doc

    async def replicas(self) -> list[dict[str, Any]]:
        try:
            rows: list[dict[str, Any]] = await self.get_json(f"{self.control_admin}/v1/replicas")
        except (aiohttp.ClientError, TimeoutError):
            return []  # the control plane restarts, or is busy: the caller polls again
        return rows

    async def nodes_view(self) -> dict[str, dict[str, Any]]:
        rows = await self.get_json(f"{self.control_admin}/v1/nodes")
        return {n["name"]: n for n in rows}

    async def router_metrics(self) -> dict[str, float]:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
            http.get(f"{self.router_admin}/metrics") as resp,
        ):
            text = await resp.text()
        out: dict[str, float] = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.rpartition(" ")
                with contextlib.suppress(ValueError):
                    out[key] = float(value)
        return out

    async def _per_endpoint(self, metric: str) -> dict[str, float]:
        try:
            samples = await self.router_metrics()
        except (aiohttp.ClientError, TimeoutError):
            return {}
        pattern = re.compile(rf'{metric}\{{endpoint="([^"]+)"\}}')
        out: dict[str, float] = {}
        for key, value in samples.items():
            found = pattern.fullmatch(key)
            if found:
                out[found.group(1)] = value
        return out

    async def router_ready(self) -> dict[str, float]:
        """Endpoint id -> 1.0 when the router's last probe of it succeeded."""
        return await self._per_endpoint("llmgw_router_endpoint_ready")

    async def router_sent(self) -> dict[str, float]:
        """Endpoint id -> attempts the router sent it (retries included)."""
        return await self._per_endpoint("llmgw_router_endpoint_requests_total")

    async def admin(self) -> Client:
        pki = self.server.pki
        nc = await nats.connect(
            servers=self.urls,
            tls=pki.admin_tls(),
            inbox_prefix="_INBOX.admin",
            name=f"{ADMIN_KEY[0]}/fleet-test",
            connect_timeout=5,
            reconnect_time_wait=0.1,
            max_reconnect_attempts=50,
        )
        bus_keys.bind(nc, bus.Keys(None, pki.verifier()))  # reads; signs nothing
        return nc

    async def publish(self, event: events.Event) -> bus.Published:
        """Publish `event` through the test-only admin's connection (an operator's intent,
        say), signed by the identity that owns its subject."""
        nc = await self.admin()
        signer = await asyncio.to_thread(self.server.pki.owner_signer, event)
        try:
            return await bus.Publisher(nc.jetstream(timeout=10), signer=signer).publish(event)
        finally:
            await close(nc)

    async def read_log(self) -> list[bus.Record]:
        """Everything in the log now, in order (the test-only admin reads it)."""
        nc = await self.admin()
        try:
            out: list[bus.Record] = []
            async with bus.Reader(nc, follow=False, name="fleet-test", heartbeat_s=0.5) as reader:
                async for batch in reader.batches():
                    out.extend(batch)
            return out
        finally:
            await close(nc)


async def close(nc: Client) -> None:
    """Close a test client, bounded: nats-py's close() can wait on a reconnect loop forever
    when its server is gone (seen in tests/integration/test_cert_cli.py)."""
    with contextlib.suppress(Exception):
        await asyncio.wait_for(nc.close(), 5)


def outbox(state_dir: Path) -> tuple[int, list[dict[str, Any]]]:
    """An agent's outbox on disk: the cursor (last entry the server acknowledged) and the
    entries still in pending.jsonl (`n`, `event` as JSON), acknowledged or not."""
    folder = state_dir / "outbox"
    cursor_path = folder / "cursor"
    cursor = int(cursor_path.read_text().strip() or 0) if cursor_path.exists() else 0
    entries = []
    pending = folder / "pending.jsonl"
    if pending.exists():
        for line in pending.read_text().splitlines():
            with contextlib.suppress(ValueError):
                entries.append(json.loads(line))
    return cursor, entries


def serving(row: dict[str, Any]) -> bool:
    """A /v1/replicas row whose every shard serves, with an endpoint."""
    return (
        not row["retired"]
        and bool(row["endpoint"])
        and all(s["phase"] == "serving" for s in row["shards"])
    )


def fold(records: Sequence[bus.Record]) -> state.ClusterState:
    """A fresh fold of the log, as any reader would compute it."""
    st, _ = state.fold_records((r.seq, r.event) for r in records)
    return st


def on_node(row: dict[str, Any], node: str) -> bool:
    return any(s["node"] == node for s in row["shards"])


# --------------------------------------------------------------------------- load


@dataclass
class Outcome:
    started: float
    """time.monotonic() when the request was sent."""
    at: float
    """time.monotonic() when it ended."""
    ok: bool
    detail: str = ""


class Load:
    """`clients` concurrent streaming chat completions in a loop through the router.

    Each response is read to its end and checked: status 200, at least one content
    delta, a finish_reason and the final `data: [DONE]`. A truncated stream, an error
    status or a connection error is a failure, recorded with its time and reason.
    """

    def __init__(self, url: str, model: str = "m1", *, clients: int = 4, max_tokens: int = 16):
        self.url = url.rstrip("/") + "/v1/chat/completions"
        self.model = model
        self.clients = clients
        self.max_tokens = max_tokens
        self.outcomes: list[Outcome] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._session: aiohttp.ClientSession | None = None

    @property
    def ok(self) -> int:
        return sum(1 for o in self.outcomes if o.ok)

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if not o.ok]

    def ok_since(self, t: float) -> int:
        return sum(1 for o in self.outcomes if o.ok and o.at >= t)

    def start(self) -> Load:
        # Generous deadlines: a failure here must be the fleet's, not a slow shared machine's.
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))
        self._tasks = [asyncio.create_task(self._client(i)) for i in range(self.clients)]
        return self

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> Load:
        return self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def wait_ok(self, count: int, within_s: float = 30.0) -> None:
        """Until `count` more requests succeeded from now on."""
        since = time.monotonic()
        await wait_for(
            lambda: self.ok_since(since) >= count,
            within_s,
            f"{count} successful requests (failures: {self.summary()})",
        )

    def failed_since(self, t: float) -> list[Outcome]:
        """Failures of requests sent at or after `t`."""
        return [o for o in self.outcomes if not o.ok and o.started >= t]

    def summary(self) -> str:
        fails = self.failures
        text = f"{self.ok} ok, {len(fails)} failed"
        if fails:
            text += "; first failures: " + "; ".join(f.detail for f in fails[:5])
        return text

    async def _client(self, i: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            started = time.monotonic()
            ok, detail = await self.one(f"client {i} request {n}")
            self.outcomes.append(Outcome(started, time.monotonic(), ok, detail))

    async def one(self, what: str) -> tuple[bool, str]:
        assert self._session is not None
        body = {
            "model": self.model,
            "stream": True,
            "max_tokens": self.max_tokens,
            "messages": [{"role": "user", "content": what}],
        }
        content = 0
        finish = None
        done = False
        try:
            async with self._session.post(self.url, json=body) as resp:
                if resp.status != 200:
                    return False, f"{what}: status {resp.status}: {(await resp.text())[:200]}"
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        done = True
                        continue
                    chunk = json.loads(data)
                    if "error" in chunk:
                        return False, f"{what}: error chunk {data[:200]}"
                    for choice in chunk.get("choices") or ():
                        if (choice.get("delta") or {}).get("content"):
                            content += 1
                        finish = choice.get("finish_reason") or finish
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            return False, f"{what}: {type(exc).__name__}: {exc}"
        if not (done and finish and content):
            return False, f"{what}: truncated (content={content} finish={finish} done={done})"
        return True, ""


def openai_stream(base_url: str, model: str = "m1") -> str:
    """One streamed chat completion through the real openai SDK (blocking: run it in a
    thread); the text it streamed."""
    from openai import OpenAI

    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none", timeout=30)
    parts = []
    for chunk in client.chat.completions.create(
        model=model,
        stream=True,
        max_tokens=16,
        messages=[{"role": "user", "content": "Hello!"}],
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    return "".join(parts)
