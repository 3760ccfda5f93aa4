"""Running the router: uvloop, the listeners, and `--workers N` processes sharing one port.

Each worker is a whole router (its own event loop, endpoint table, breakers
and prefix index) bound to the same address with SO_REUSEPORT, so the kernel
spreads connections across them. The parent reserves the port first (port 0
becomes a real port every worker shares), starts the workers, prints one line
`llmgw router listening on http://HOST:PORT admin http://HOST:PORT` once all
of them accept connections, and forwards SIGTERM / SIGINT (stop) and SIGHUP (re-read
the keys file). With several
workers, each writes metric snapshots to a shared folder so any worker's admin
listener reports the whole router, and API keys' rate limits live in one file
that all workers map (`auth.SharedLimits`). Used by `llmgw router`.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import multiprocessing
import multiprocessing.connection
import multiprocessing.process
import os
import shutil
import signal
import socket
import sys
import tempfile
from typing import Any

import msgspec
import uvloop
from aiohttp import web

from llmgw import logs
from llmgw.router.auth import SharedLimits
from llmgw.router.config import RouterConfig
from llmgw.router.metrics import METRICS_DIR_ENV

log = logs.get("llmgw.router")


def listening_socket(host: str, port: int, *, backlog: int = 4096) -> socket.socket:
    """A TCP listener with SO_REUSEPORT (workers share it) and TCP_NODELAY.

    TCP_NODELAY on the listener is inherited by accepted sockets on Linux; uvloop
    sets it on every TCP transport as well. Without it Nagle's algorithm holds the
    first SSE chunk behind the headers until the client's delayed ACK: +40 ms
    time to first token on reused keep-alive connections (docs/design.md).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    sock.setblocking(False)
    return sock


async def serve(
    cfg: RouterConfig,
    *,
    worker: int = 0,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    limits: SharedLimits | None = None,
) -> None:
    """Serve until `stop` is set (or SIGTERM / SIGINT when `stop` is None)."""
    from llmgw.router.app import Router, build_admin_app, build_server

    router = Router(cfg, worker=worker, limits=limits)
    await router.start()
    runner = web.ServerRunner(build_server(router))
    admin_runner = web.AppRunner(build_admin_app(router), access_log=None)
    await runner.setup()
    await admin_runner.setup()
    sock = listening_socket(cfg.listen.host, cfg.listen.port)
    admin_sock = listening_socket(cfg.admin.host, cfg.admin.port, backlog=128)
    await web.SockSite(runner, sock).start()
    await web.SockSite(admin_runner, admin_sock).start()
    # Start-up objects (config, modules, tables) never die: keep them out of every
    # collection. Requests make few reference cycles, so collect young objects less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    port = sock.getsockname()[1]
    admin_port = admin_sock.getsockname()[1]
    log.info("router_worker_started", worker=worker, port=port, admin_port=admin_port)
    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        # SIGHUP re-reads the keys file: keys are added and revoked without a restart.
        loop.add_signal_handler(signal.SIGHUP, router.reload_keys)
    if ready is not None:
        ready.send((port, admin_port))
        ready.close()
    else:
        _announce(cfg.listen.host, port, cfg.admin.host, admin_port)
    await stop.wait()
    log.info("router_worker_stopping", worker=worker)
    await runner.cleanup()
    await admin_runner.cleanup()
    await router.stop()


def _announce(host: str, port: int, admin_host: str, admin_port: int) -> None:
    sys.stdout.write(
        f"llmgw router listening on http://{host}:{port} admin http://{admin_host}:{admin_port}\n"
    )
    sys.stdout.flush()


def _worker_main(cfg_bytes: bytes, worker: int, ready: Any, limits_path: str, lock: Any) -> None:
    cfg = msgspec.json.decode(cfg_bytes, type=RouterConfig)
    logs.setup(cfg.log_level)
    limits = SharedLimits(limits_path, lock)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(cfg, worker=worker, ready=ready, limits=limits))


def run(cfg: RouterConfig) -> None:
    """Run the router in the foreground until SIGTERM / SIGINT."""
    if cfg.workers <= 1:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(cfg))
        return
    _run_workers(cfg)


def _run_workers(cfg: RouterConfig) -> None:
    # Reserve the ports so that port 0 becomes one real port all workers share; the
    # reservation only binds (no listen), so the kernel never hands it a connection.
    holds = []
    ports = []
    for lst in (cfg.listen, cfg.admin):
        family = socket.AF_INET6 if ":" in lst.host else socket.AF_INET
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind((lst.host, lst.port))
        holds.append(s)
        ports.append(s.getsockname()[1])
    cfg = msgspec.structs.replace(
        cfg,
        listen=msgspec.structs.replace(cfg.listen, port=ports[0]),
        admin=msgspec.structs.replace(cfg.admin, port=ports[1]),
    )
    mpdir = tempfile.mkdtemp(prefix="llmgw-router-metrics-")
    os.environ[METRICS_DIR_ENV] = mpdir
    ctx = multiprocessing.get_context("spawn")
    # API keys' rate limits: one set of buckets for all workers.
    limits_path = os.path.join(mpdir, "limits")
    SharedLimits.create(limits_path)
    limits_lock = ctx.Lock()
    procs: list[multiprocessing.process.BaseProcess] = []
    pipes: list[multiprocessing.connection.Connection] = []
    cfg_bytes = msgspec.json.encode(cfg)
    stopping = False

    def on_signal(signum: int, _frame: Any) -> None:
        nonlocal stopping
        stopping = True
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGTERM)

    def on_hup(signum: int, _frame: Any) -> None:
        for p in procs:
            if p.pid is not None and p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGHUP)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        for i in range(cfg.workers):
            recv, send = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker_main,
                args=(cfg_bytes, i, send, limits_path, limits_lock),
                name=f"router-{i}",
            )
            proc.start()
            send.close()
            procs.append(proc)
            pipes.append(recv)
        for p, recv in zip(procs, pipes, strict=True):
            while not recv.poll(0.2):
                if not p.is_alive():
                    raise SystemExit(
                        f"router worker {p.name} exited during start (code {p.exitcode})"
                    )
            recv.recv()
        for s in holds:
            s.close()
        _announce(cfg.listen.host, ports[0], cfg.admin.host, ports[1])
        while not stopping:
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=1.0)
            dead = [p for p in procs if not p.is_alive()]
            if dead and not stopping:
                log.error("router_worker_died", worker=dead[0].name, code=dead[0].exitcode)
                on_signal(signal.SIGTERM, None)
                raise SystemExit(1)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(mpdir, ignore_errors=True)
