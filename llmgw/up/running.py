"""Running the embedded fleet: start every process in order, watch it, stop it all.

`run(plan)` is `llmgw up`: stop whatever a previous run on the same state directory left
behind, then start nats-server (private CA, mutual TLS), the control plane, one agent per
simulated node and the router (which follows the log: the model and its endpoints come
from the control plane's events), each a real subprocess with its config and log in the
state directory; print what runs where and how to use it; redraw the live status until
SIGINT or SIGTERM; then stop the router, the agents, the engines the agents leave running
on purpose, the control plane and nats-server, in that order, leaving no process behind.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import msgspec
import yaml

from llmgw import listeners, natsd, processes, wording
from llmgw.up import children, render, status
from llmgw.up.children import Child, UpError
from llmgw.up.layout import Layout
from llmgw.up.render import Plan

PY = (sys.executable, "-m", "llmgw")
CONTROL_READY = r"^llmgw control \S+ admin (http://\S+)$"
ROUTER_READY = r"^llmgw router listening on (http://\S+) admin (http://\S+)$"
STATUS_EVERY_S = 0.5
PLAIN_STATUS_EVERY_S = 10.0


def _write_yaml(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(
        "# Written by `llmgw up` at every start: edits here do not last.\n"
        + yaml.safe_dump(data, sort_keys=False)
    )
    os.replace(tmp, path)


def check_port_free(host: str, port: int) -> None:
    """Fail early, saying what to do, when the router's port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except listeners.BIND_ERRORS as exc:
            if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
                raise UpError(
                    f"port {port} on {host} is not available ({exc.strerror}): stop what listens"
                    f" there (`ss -ltnp 'sport = :{port}'` shows it) or pick another with --port"
                ) from None
            # A host that is no address of this machine is not the port's fault.
            raise UpError(str(listeners.bind_error(exc, host, port, "--port"))) from None


def _wait_nats(child: Child, host: str, port: int, timeout_s: float) -> None:
    """nats-server sends its INFO line to a new connection before the TLS handshake."""
    deadline = time.monotonic() + timeout_s
    while True:
        with (
            contextlib.suppress(OSError),
            socket.create_connection((host, port), timeout=1.0) as s,
        ):
            if s.recv(5).startswith(b"INFO"):
                return
        if not child.running:
            raise UpError(
                f"nats-server exited while starting (log {child.log_path}):\n"
                + children.log_tail(child.log_path)
            )
        if time.monotonic() > deadline:
            raise UpError(
                f"nats-server did not accept connections on {host}:{port} within "
                f"{timeout_s:.0f} s (log {child.log_path}):\n" + children.log_tail(child.log_path)
            )
        time.sleep(0.02)


class Fleet:
    """The processes of one `llmgw up`, started and stopped in order."""

    def __init__(self, plan: Plan, out: TextIO, *, tty: bool) -> None:
        self.plan = plan
        self.layout = plan.layout
        self.out = out
        self.tty = tty
        self.stopping = False
        self.nats: Child | None = None
        self.nats_url = ""
        self.control: Child | None = None
        self.control_admin = ""
        self.agents: list[Child] = []
        self.router: Child | None = None
        self.router_admin = ""
        self._status_lines = 0
        # Services run from the state directory, which is not on their sys.path either.
        self.python_env = children.python_env(os.environ)

    @property
    def started_anything(self) -> bool:
        return any(c is not None for c in (self.nats, self.control, self.router, *self.agents))

    # ------------------------------------------------------------------ output

    def say(self, text: str = "") -> None:
        self.out.write(text + "\n")
        self.out.flush()
        # Text printed below the status block: redraw the block below it, not over it.
        self._status_lines = 0

    # ------------------------------------------------------------------ start

    def clean_up_previous(self) -> None:
        """Stop what a previous run left (it was killed, or the machine lost power)."""
        run = self.layout.run
        left = []
        for pid_file in sorted(run.glob("*.json")) if run.is_dir() else ():
            if pid_file == self.layout.up_pid_file:
                continue
            pid = children.stop_recorded(pid_file)
            if pid is not None:
                left.append(f"{pid_file.stem} (pid {pid})")
        states = [d / "state" for d in sorted(self.layout.agents.glob("*")) if d.is_dir()]
        for pid in children.stop_engines(states):
            left.append(f"engine (pid {pid})")
        if left:
            self.say(f"stopped what a previous run left running: {', '.join(left)}")

    def start_nats(self) -> None:
        local = natsd.LocalNats(self.layout.nats)
        local.prepare(self.plan.identities)
        try:
            binary = natsd.binary()
        except natsd.NatsServerError as exc:
            raise UpError(str(exc)) from None
        self.nats = Child(
            "nats-server",
            [binary, "-c", str(local.config_path)],
            log_path=self.layout.log("nats"),
            pid_file=self.layout.pid_file("nats"),
        )
        self.nats.start()
        _wait_nats(self.nats, local.host, local.port, 15.0)
        self.nats_url = local.url
        _write_yaml(self.layout.ctl_config, render.ctl(self.plan, self.nats_url))

    def start_control(self) -> None:
        _write_yaml(self.layout.control_config, render.control(self.plan, self.nats_url))
        self.control = Child(
            "control plane",
            [*PY, "control", "--config", str(self.layout.control_config)],
            log_path=self.layout.log("control"),
            pid_file=self.layout.pid_file("control"),
            env=self.python_env,
            cwd=self.layout.root,
        )
        self.control.start()
        found = self.control.wait_for(CONTROL_READY, 30.0, lambda: self.stopping)
        self.control_admin = found.group(1)

    def start_agents(self) -> None:
        for i, node in enumerate(self.plan.node_ids, start=1):
            path = self.layout.agent_config(node)
            _write_yaml(path, render.agent(self.plan, self.nats_url, node, i))
            child = Child(
                f"agent {node}",
                [*PY, "agent", "--config", str(path)],
                log_path=self.layout.log(f"agent-{node}"),
                pid_file=self.layout.pid_file(f"agent-{node}"),
                env=self.python_env,
                cwd=self.layout.root,
            )
            child.start()
            self.agents.append(child)
        for child, node in zip(self.agents, self.plan.node_ids, strict=True):
            child.wait_for(rf"^llmgw agent {node} started$", 30.0, lambda: self.stopping)

    def declare_model(self, timeout_s: float = 30.0) -> None:
        """Once every node has registered, declare the model as an operator would."""
        want = len(self.plan.node_ids)
        deadline = time.monotonic() + timeout_s
        while not self.stopping:
            nodes = status.read(self.control_admin, "").nodes_total or 0
            if nodes >= want or time.monotonic() >= deadline:
                break
            time.sleep(0.1)
        if self.stopping:
            return
        _write_yaml(self.layout.models_file, render.models(self.plan))
        done = subprocess.run(
            [*PY, "ctl", "apply", "-f", str(self.layout.models_file), "--yes"],
            env={**self.python_env, "LLMGW_CTL_CONFIG": str(self.layout.ctl_config)},
            cwd=self.layout.root,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if done.returncode != 0:
            raise UpError(
                f"declaring the model failed: {(done.stderr or done.stdout).strip()} "
                f"(see {self.layout.log('control')})"
            )

    def start_router(self) -> None:
        state = str(self.layout.router_state)
        _write_yaml(self.layout.router_config, render.router(self.plan, self.nats_url, state))
        self.router = Child(
            "router",
            [*PY, "router", "--config", str(self.layout.router_config)],
            log_path=self.layout.log("router"),
            pid_file=self.layout.pid_file("router"),
            env=self.python_env,
            cwd=self.layout.root,
        )
        self.router.start()

    def wait_router(self) -> None:
        assert self.router is not None
        found = self.router.wait_for(ROUTER_READY, 30.0, lambda: self.stopping)
        self.router_admin = found.group(2)

    def wait_router_ready(self, timeout_s: float) -> bool:
        """Until the router answers the model: /v1/models lists it and (with replicas to
        serve) /ready counts a healthy endpoint of it. One look when `timeout_s` is 0.

        "ready" is what a user acts on at once, so it is the router's own answer that
        decides, for this model, not the fleet's progress in general."""
        deadline = time.monotonic() + timeout_s
        while not self.stopping:
            if self.router_serves_model():
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.1)
        return False

    def router_serves_model(self) -> bool:
        base = f"http://{self._dial_host}:{self.plan.port}"
        listed = status.models_listed(status.fetch(f"{base}/v1/models", 1.0))
        if self.plan.model not in listed:
            return False
        if self.plan.replicas == 0:
            return True
        ready = status.fetch(f"{base}/ready", 1.0)
        return ready is not None and self.plan.model in status.ready_models(ready)

    def announce(self, started: float) -> None:
        self.clear_status()
        self.describe()
        self.say(
            f"llmgw up: ready in {time.monotonic() - started:.1f} s: "
            f"model {self.plan.model!r} at http://{self._dial_host}:{self.plan.port}/v1"
        )

    @property
    def _dial_host(self) -> str:
        return "127.0.0.1" if self.plan.host in ("0.0.0.0", "") else self.plan.host

    # ------------------------------------------------------------------ print

    def describe(self) -> None:
        p, lay = self.plan, self.layout
        base = f"http://{self._dial_host}:{p.port}/v1"
        engine = "llmgw sim" if p.engine == "sim" else f"llama-server ({p.model_file})"
        self.say(f"llmgw up: state in {lay.root}")
        rows: list[tuple[str, Child | None, str, str]] = [
            ("nats-server", self.nats, f"{self.nats_url} (mutual TLS, JetStream)", "nats"),
            (
                "control",
                self.control,
                f"admin {self.control_admin}, config {lay.control_config}",
                "control",
            ),
        ]
        for i, (agent, node) in enumerate(zip(self.agents, p.node_ids, strict=True), start=1):
            engines_at = render.node_address(lay.root, i)
            rows.append(
                (
                    f"agent {node}",
                    agent,
                    f"{p.gpus} simulated, engines on {engines_at}",
                    f"agent-{node}",
                )
            )
        rows.append(("router", self.router, f"{base} admin {self.router_admin}", "router"))
        for name, child, where, log in rows:
            pid = child.pid if child is not None else "-"
            self.say(f"  {name:<14} pid {pid!s:<8} {where}  (log {lay.log(log)})")
        self.say(f"  model {p.model!r}: {wording.count(p.replicas, 'replica')} of {engine}")
        if not self._dial_host.startswith("127.") and self._dial_host not in ("::1", "localhost"):
            self.say(
                f"  the router answers on {p.host} without API keys: anyone who reaches it can "
                "use it (for a shared router, run `llmgw router` with auth.keys_file)"
            )
        self.say()
        self.say("Try it:")
        self.say(
            f"  curl -sN {base}/chat/completions -H 'Content-Type: application/json' \\\n"
            f'    -d \'{{"model": "{p.model}", "stream": true, '
            '"messages": [{"role": "user", "content": "Hello!"}]}\''
        )
        self.say("  # with the openai package (pip install openai):")
        self.say(
            "  python -c 'from openai import OpenAI\n"
            f'c = OpenAI(base_url="{base}", api_key="none")\n'
            f'for k in c.chat.completions.create(model="{p.model}", stream=True, '
            'messages=[{"role": "user", "content": "Hello!"}]):\n'
            '    print(k.choices[0].delta.content or "" if k.choices else "", end="", flush=True)\''
        )
        self.say("Operate it:")
        self.say(f"  export LLMGW_CTL_CONFIG={lay.ctl_config}")
        self.say("  llmgw ctl nodes; llmgw ctl replicas; llmgw ctl events")
        self.say("Ctrl-C stops everything.")
        self.say()

    def clear_status(self) -> None:
        """Erase the status block drawn while starting: the banner replaces it, and a
        status from before "ready" left above the banner reads as the current one."""
        if self.tty and self._status_lines:
            self.out.write(f"\x1b[{self._status_lines}F\x1b[J")
            self.out.flush()
            self._status_lines = 0

    def show(self, lines: list[str]) -> None:
        if self.tty:
            if self._status_lines:
                # Up to the first status line, then clear to the end of the screen.
                self.out.write(f"\x1b[{self._status_lines}F\x1b[J")
            self.out.write("".join(line + "\n" for line in lines))
            self.out.flush()
            self._status_lines = len(lines)
        else:
            for line in lines:
                self.say(f"status: {line}")

    # ------------------------------------------------------------------ stop

    def stop(self) -> None:
        """Router, agents, their engines, control, nats: nothing is left running."""
        self.stopping = True
        if self.router is not None:
            self.router.stop(10.0)
        for agent in self.agents:
            if agent.running and agent.pid is not None:
                processes.signal_group(agent.pid, signal.SIGTERM)
        for agent in self.agents:
            agent.stop(15.0)
        if self.agents:
            # Only engines of agents this run started: a run that stopped early (another
            # `up` owns the directory) must not touch the other run's engines.
            children.stop_engines([self.layout.agent_state(n) for n in self.plan.node_ids])
        if self.control is not None:
            self.control.stop(10.0)
        if self.nats is not None:
            self.nats.stop(10.0)


def _claim(layout: Layout) -> int:
    """Refuse to share a state directory with another running `llmgw up`.

    An exclusive flock on <state>/run/up.lock, held for the whole run: the kernel drops it
    when `up` dies however it dies, so a crashed run never blocks the next one. Returns
    the lock's file descriptor.
    """
    fd = os.open(layout.run / "up.lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        other = children.recorded(layout.up_pid_file)
        who = f"pid {other.pid}" if other is not None else "see run/up.json"
        kill = f"`kill {other.pid}`" if other is not None else "kill it"
        raise UpError(
            f"another llmgw up ({who}) runs on {layout.root}: stop it (Ctrl-C there, or "
            f"{kill}), or give this one its own --state-dir"
        ) from None
    mine = processes.fingerprint(os.getpid())
    if mine is not None:
        layout.up_pid_file.write_bytes(msgspec.json.encode(mine))
    return fd


def run(plan: Plan, *, out: TextIO | None = None, tty: bool | None = None) -> int:
    """`llmgw up`: returns the exit status (0 after a clean stop by a signal)."""
    out = out if out is not None else sys.stdout
    tty = out.isatty() if tty is None else tty
    fleet = Fleet(plan, out, tty=tty)
    layout = plan.layout
    started = time.monotonic()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        fleet.stopping = True

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    lock: int | None = None
    try:
        try:
            layout.make()
        except OSError as exc:  # a file in the way, a folder it may not write
            raise UpError(
                f"--state-dir {layout.root}: cannot make {exc.filename}: {exc.strerror}; give a"
                " folder llmgw up may create and write"
            ) from None
        lock = _claim(layout)
        fleet.clean_up_previous()
        check_port_free(plan.host, plan.port)
        fleet.start_nats()
        fleet.start_control()
        # The router needs only NATS: it starts while the agents do, and follows the log.
        fleet.start_router()
        fleet.start_agents()
        fleet.declare_model()
        fleet.wait_router()
        _watch(fleet, started)
        return 0
    except UpError as exc:
        if fleet.stopping:
            return 0
        sys.stderr.write(f"llmgw up: {exc}\n")
        sys.stderr.flush()
        return 1
    finally:
        if fleet.started_anything:
            fleet.say("\nllmgw up: stopping (router, agents, engines, control, nats)...")
        fleet.stop()
        if lock is not None:
            with contextlib.suppress(FileNotFoundError):
                layout.up_pid_file.unlink()
            os.close(lock)
        if fleet.started_anything:
            fleet.say("llmgw up: stopped")
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _watch(fleet: Fleet, started: float) -> None:
    """Announce readiness once the router can route, then show the status until stopped."""
    announced = False
    last_total: float | None = None
    last_at = time.monotonic()
    last_plain = ""
    last_plain_at = 0.0
    while not fleet.stopping:
        for child in [fleet.nats, fleet.control, *fleet.agents, fleet.router]:
            if child is not None and not child.running:
                raise UpError(
                    f"{child.name} exited (log {child.log_path}):\n"
                    + children.log_tail(child.log_path)
                )
        if not announced and fleet.wait_router_ready(0.0):
            fleet.announce(started)
            announced = True
        # Read after the banner, so that the first status below it is current.
        reading = status.read(fleet.control_admin, fleet.router_admin)
        now = time.monotonic()
        rate = None
        if reading.requests_total is not None and last_total is not None and now > last_at:
            rate = max(0.0, reading.requests_total - last_total) / (now - last_at)
        if reading.requests_total is not None:
            last_total, last_at = reading.requests_total, now
        lines = status.render(reading, rate)
        if fleet.tty:
            fleet.show(lines)
        elif announced or now - started > PLAIN_STATUS_EVERY_S:
            # Plain output (a log, a pipe): a line when something other than the rate
            # changed, and otherwise every PLAIN_STATUS_EVERY_S; before the banner only
            # when starting takes long, so that a log does not open with a stale status.
            key = "\n".join(status.render(dataclasses.replace(reading, requests_total=None), None))
            if key != last_plain or now - last_plain_at > PLAIN_STATUS_EVERY_S:
                fleet.show(lines)
                last_plain, last_plain_at = key, now
        _sleep(STATUS_EVERY_S, lambda: fleet.stopping)


def _sleep(seconds: float, stop: Callable[[], bool]) -> None:
    deadline = time.monotonic() + seconds
    while not stop() and time.monotonic() < deadline:
        time.sleep(min(0.05, max(0.0, deadline - time.monotonic())))
