"""Two real `llmgw control` processes against one nats-server: one leads, the other takes over.

- exactly one leads; kill -9 the leader and the follower takes over within the lease
  TTL, with no duplicate placement;
- a leader paused past its lease (SIGSTOP) is deposed: nothing it writes after its
  successor's election is accepted, and a write fenced on what it had folded is refused
  by the server.
Simulated agents are test code publishing as node identities (control_kit.SimAgent).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from llmgw import bus
from llmgw.core import events, subjects
from llmgw.sim.testing import wait_for_line
from tests.harness import TestNatsServer, connect_as, wait_for
from tests.integration.control_kit import SimAgent, control_config, model, read_log, write_config

pytestmark = pytest.mark.slow

TTL = 2.0
ANNOUNCE = re.compile(r"llmgw control (\S+) admin (http://\S+)")


class ControlProc:
    def __init__(
        self,
        server: TestNatsServer,
        name: str,
        folder: Path,
        env: dict[str, str] | None = None,
        **over: Any,
    ) -> None:
        cfg = control_config(server, name, models=(model("m1", replicas=2),), **over)
        path = write_config(cfg, folder / f"{name}.yaml")
        self.name = name
        self.stderr_path = folder / f"{name}.log"
        self._stderr = self.stderr_path.open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "llmgw", "control", "--config", str(path)],
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        self.url = self._announced(20.0)

    def _announced(self, timeout: float) -> str:
        try:
            return wait_for_line(self.proc, ANNOUNCE, self.name, timeout).group(2)
        except RuntimeError as exc:
            self.proc.kill()
            raise RuntimeError(f"{exc}: {self.stderr_path.read_text()[-3000:]}") from None

    def state(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"{self.url}/v1/state", timeout=2) as resp:
            data: dict[str, Any] = json.load(resp)
            return data

    async def astate(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.state)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)  # a paused process must run to handle SIGTERM
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._stderr.close()

    def log_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def fleet_metrics(self) -> list[str]:
        """The fleet-state lines of its /metrics (llmgw.core.fleet_metrics)."""
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=2) as resp:
            text = resp.read().decode()
        return sorted(line for line in text.splitlines() if line.startswith("llmgw_fleet_"))


@pytest.fixture
def planes(nats_server: TestNatsServer, tmp_path: Path) -> Iterator[list[ControlProc]]:
    started: list[ControlProc] = []
    try:
        for name in ("control-a", "control-b"):
            started.append(ControlProc(nats_server, name, tmp_path, lease_ttl_s=TTL))
        yield started
    finally:
        for p in started:
            p.stop()


async def leaders(planes: list[ControlProc]) -> list[ControlProc]:
    states = [await p.astate() for p in planes]
    return [p for p, s in zip(planes, states, strict=True) if s["leading"]]


async def start_fleet(server: TestNatsServer, planes: list[ControlProc]) -> list[SimAgent]:
    async def one_leads() -> bool:
        return len(await leaders(planes)) == 1

    await wait_for(one_leads, 15, "one control plane leading", every_s=0.1)
    agents = [await SimAgent(server, n, gpus=2).start() for n in ("node-a", "node-b")]

    async def both_serving() -> bool:
        st = [await p.astate() for p in planes]
        return all(s["replicas"] == 2 for s in st) and all(s["leader"] for s in st)

    await wait_for(both_serving, 20, "two replicas placed, seen by both", every_s=0.2)
    return agents


async def test_one_leads_and_the_follower_takes_over_within_the_ttl_without_duplicates(
    nats_server: TestNatsServer, planes: list[ControlProc]
) -> None:
    agents = await start_fleet(nats_server, planes)
    try:
        # Exactly one leads, and keeps leading.
        for _ in range(5):
            assert len(await leaders(planes)) == 1
            await asyncio.sleep(0.2)
        (leader,) = await leaders(planes)
        (follower,) = [p for p in planes if p is not leader]
        before = await leader.astate()

        # The follower exports the fleet's state as the leader does, from its own fold.
        async def same_fleet_metrics() -> bool:
            ours, theirs = await asyncio.gather(
                asyncio.to_thread(leader.fleet_metrics), asyncio.to_thread(follower.fleet_metrics)
            )
            return ours == theirs and 'llmgw_fleet_nodes{liveness="ready"} 2.0' in ours

        await wait_for(same_fleet_metrics, 15, "the same fleet metrics from both", every_s=0.2)

        leader.proc.kill()  # kill -9: no lease release
        killed = time.monotonic()

        async def took_over() -> bool:
            s = await follower.astate()
            return bool(s["leading"]) and s["leader"] == follower.name

        await wait_for(took_over, TTL + 5, "the follower leading", every_s=0.05)
        takeover_s = time.monotonic() - killed
        print(f"takeover after kill -9: {takeover_s:.2f} s (lease TTL {TTL} s)")
        assert takeover_s <= TTL + 1.0, f"takeover took {takeover_s:.2f} s"
        after = await follower.astate()
        assert after["epoch"] > before["epoch"]
        await asyncio.sleep(1.0)  # a few reconcile passes of the new leader
        nc = await connect_as(nats_server, "router", "r1")
        log = await read_log(nc)
        await bus.close(nc)
        placed = [r.event for r in log if isinstance(r.event, events.ReplicaPlaced)]
        assert len(placed) == 2, [p.replica_id for p in placed]
        assert len({(s.node, g) for p in placed for s in p.shards for g in s.gpus}) == 2
        elected = [r.event for r in log if isinstance(r.event, events.LeaderElected)]
        assert [e.leader for e in elected] == [leader.name, follower.name]
        final = await follower.astate()
        assert final["replicas"] == 2
        assert final["rejected"] == 0
    finally:
        for agent in agents:
            await agent.close()


async def test_a_deposed_leaders_writes_are_refused_by_the_server(
    nats_server: TestNatsServer, planes: list[ControlProc]
) -> None:
    agents = await start_fleet(nats_server, planes)
    try:
        (old,) = await leaders(planes)
        (new,) = [p for p in planes if p is not old]
        stale = await old.astate()
        old.proc.send_signal(signal.SIGSTOP)  # paused past its lease: it still believes it leads

        async def new_leads() -> bool:
            s = await new.astate()
            return bool(s["leading"]) and s["leader"] == new.name

        await wait_for(new_leads, TTL + 5, "the standby leading", every_s=0.1)
        # The old leader's fenced write, as it would make it from what it had folded:
        # the server refuses it, whatever its lease believes.
        nc = await connect_as(nats_server, "control", old.name)
        pub = bus.Publisher(nc.jetstream())
        with pytest.raises(bus.FenceRefused):
            await pub.publish(
                events.NodeUnreachable(
                    id="stale-1",
                    ts=time.time(),
                    node="node-a",
                    last_heartbeat=time.time() - 10,
                    epoch=stale["epoch"],
                ),
                fence=bus.Fence(subjects.CONTROL_EVENTS_ALL, stale["control_seq"]),
            )
        old.proc.send_signal(signal.SIGCONT)

        async def stepped_down() -> bool:
            s = await old.astate()
            return not s["leading"] and s["leader"] == new.name

        await wait_for(stepped_down, 10, "the old leader a follower", every_s=0.1)
        await asyncio.sleep(1.0)
        log = await read_log(nc)
        await bus.close(nc)
        elected_at = next(
            r.seq
            for r in log
            if isinstance(r.event, events.LeaderElected) and r.event.leader == new.name
        )
        late = [
            r.event
            for r in log
            if r.seq > elected_at
            and isinstance(r.event, events.ControlEvent)
            and r.event.epoch == stale["epoch"]
        ]
        assert late == [], "a deposed leader's decision was stored after its successor's"
        text = old.log_text()
        how = [w for w in ("fence_refused", "step_down") if w in text]
        print(f"the deposed leader noticed through: {how}")
        assert how
    finally:
        for agent in agents:
            await agent.close()


async def test_sigterm_releases_the_lease_and_the_standby_takes_over_at_once(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    ttl = 10.0  # long, so that a takeover well under it can only come from the release
    planes = [
        ControlProc(nats_server, n, tmp_path, lease_ttl_s=ttl) for n in ("control-a", "control-b")
    ]
    try:

        async def one_leads() -> bool:
            return len(await leaders(planes)) == 1

        await wait_for(one_leads, 15, "one control plane leading", every_s=0.1)
        (leader,) = await leaders(planes)
        (standby,) = [p for p in planes if p is not leader]
        leader.proc.send_signal(signal.SIGTERM)
        stopped = time.monotonic()
        assert leader.proc.wait(10) == 0

        async def took_over() -> bool:
            return bool((await standby.astate())["leading"])

        await wait_for(took_over, ttl, "the standby leading", every_s=0.05)
        assert time.monotonic() - stopped < 2.0
        assert "lease_released" in leader.log_text()
    finally:
        for p in planes:
            p.stop()


async def test_a_hangup_signal_leaves_the_control_plane_leading(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    """SIGHUP (what `systemctl reload`, or habit, sends a daemon) ended the control plane,
    and with it the fleet's decisions: it has nothing to reload, so it says so and leads on."""
    plane = ControlProc(nats_server, "control-a", tmp_path, lease_ttl_s=TTL)
    try:

        async def leading() -> bool:
            return bool((await plane.astate())["leading"])

        await wait_for(leading, 15, "the control plane leading", every_s=0.1)
        plane.proc.send_signal(signal.SIGHUP)
        await wait_for(
            lambda: "hangup_ignored" in plane.log_text() or plane.proc.poll() is not None,
            15,
            "the hangup heard",
        )
        assert plane.proc.poll() is None, plane.log_text()[-2000:]
        assert await leading()
    finally:
        plane.stop()
    assert plane.proc.returncode == 0


def test_sigterm_ends_a_control_plane_still_waiting_for_nats(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    cfg = control_config(nats_server, "control-a")
    nats_server.stop()  # nobody listens there now: it waits, reconnecting
    path = write_config(cfg, tmp_path / "c.yaml")
    proc = subprocess.Popen(
        [sys.executable, "-m", "llmgw", "control", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        # Its first failed connect is logged after its signal handlers are installed: from
        # then on a SIGTERM must end it, however long the start took on a busy machine.
        wait_for_line(proc, re.compile("connect_failed"), "llmgw control", 120)
        assert proc.poll() is None, "it must wait for the server, not give up"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)


async def test_the_control_plane_tells_systemd_it_is_ready_once_it_serves(
    nats_server: TestNatsServer, tmp_path: Path
) -> None:
    """`Type=notify` units: READY=1 on $NOTIFY_SOCKET when the announcement line is out (the
    log folded, the admin API listening), as systemd's sd_notify protocol has it."""
    path = tmp_path / "notify.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.bind(str(path))
        sock.settimeout(20)
        plane = ControlProc(nats_server, "control-n", tmp_path, env={"NOTIFY_SOCKET": str(path)})
        try:
            message = await asyncio.to_thread(sock.recv, 4096)
            assert message == b"READY=1"
            assert (await plane.astate())["folded_seq"] >= 0
        finally:
            plane.stop()
