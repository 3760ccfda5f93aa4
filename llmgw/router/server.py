"""Running the router: uvloop, the listeners, and `--workers N` processes sharing one port.

Each worker is a whole router (its own event loop, endpoint table, breakers
and prefix index) with its own listening socket on the same address, shared
with SO_REUSEPORT, so the kernel spreads connections across them. The parent
makes every worker's sockets itself (port 0 becomes one real port they share)
and refuses to start when any other process listens on the port: SO_REUSEPORT
would otherwise let a second router, started by mistake, take half of the
first one's connections. It then starts the workers, prints one line
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
import errno
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

from llmgw import listeners, logs, sdnotify
from llmgw.router.auth import SharedLimits
from llmgw.router.config import Listener, RouterConfig
from llmgw.router.metrics import METRICS_DIR_ENV

log = logs.get("llmgw.router")


class PortTaken(OSError):
    """Another process listens on a port the router was told to use; the message says
    which and what to do."""


def _socket(host: str, *, reuseport: bool) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    # SO_REUSEADDR: a restart binds at once despite the last run's TIME_WAIT connections;
    # on Linux it never lets a second socket bind a port someone listens on.
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuseport:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    # Inherited by accepted sockets on Linux; uvloop sets it on every TCP transport as
    # well. Without it Nagle's algorithm holds the first SSE chunk behind the headers
    # until the client's delayed ACK: +40 ms time to first token (docs/design.md).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


API_BACKLOG = 4096
"""Connections the API listener's kernel queue holds before the router accepts them: a
thousand clients connecting at once overflowed 128, and some of their requests were reset
after they were sent."""
ADMIN_BACKLOG = 128


def listening_sockets(
    lst: Listener, count: int, *, setting: str, backlog: int = API_BACKLOG
) -> list[socket.socket]:
    """`count` TCP listeners on `lst`, one per worker, sharing the port only among
    themselves; raises PortTaken when another process listens there.

    One socket needs no SO_REUSEPORT, so the kernel itself refuses a taken port.
    Several must all set it, and so would any stranger's that set it too: before
    they listen, a socket without SO_REUSEPORT probes the port, and its bind fails
    exactly when some socket already listens on it (ours only bind until then). Two
    routers started within the same few microseconds could still both pass; anything
    started later, with or without SO_REUSEPORT, is refused.
    """
    listeners.refuse_empty_host(lst.host, setting)
    socks: list[socket.socket] = []
    try:
        port = lst.port
        for _ in range(count):
            s = _socket(lst.host, reuseport=count > 1)
            socks.append(s)
            s.bind((lst.host, port))
            port = s.getsockname()[1]
        if count > 1:
            with _socket(lst.host, reuseport=False) as probe:
                probe.bind((lst.host, port))
        for s in socks:
            s.listen(backlog)
            s.setblocking(False)
    except listeners.BIND_ERRORS as exc:
        for s in socks:
            s.close()
        if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE:
            raise PortTaken(
                f"{lst.host}:{lst.port} ({setting}) is taken by another process: stop that"
                f" process, or set {setting} to a free port",
            ) from None
        raise listeners.bind_error(exc, lst.host, lst.port, setting) from None
    return socks


def claim(cfg: RouterConfig) -> tuple[list[socket.socket], list[socket.socket]]:
    """Every worker's API and admin listeners; raises PortTaken (or OSError) saying why not."""
    count = max(cfg.workers, 1)
    api = listening_sockets(cfg.listen, count, setting="listen.port")
    try:
        admin = listening_sockets(cfg.admin, count, setting="admin.port", backlog=ADMIN_BACKLOG)
    except OSError:
        for s in api:
            s.close()
        raise
    return api, admin


async def serve(
    cfg: RouterConfig,
    sock: socket.socket,
    admin_sock: socket.socket,
    *,
    worker: int = 0,
    ready: Any = None,
    stop: asyncio.Event | None = None,
    limits: SharedLimits | None = None,
) -> None:
    """Serve until `stop` is set (or SIGTERM / SIGINT when `stop` is None)."""
    from llmgw.router.admin import build_admin_server
    from llmgw.router.app import Router
    from llmgw.router.front import build_server

    router = Router(cfg, worker=worker, limits=limits)
    router.admin_url = listeners.url("http", admin_sock)  # its load reports name it
    await router.start()
    runner = web.ServerRunner(build_server(router))
    admin_runner = web.ServerRunner(build_admin_server(router))
    await runner.setup()
    await admin_runner.setup()
    # A site listens again as it starts, with its own backlog (aiohttp's 128 unless told).
    await web.SockSite(runner, sock, backlog=API_BACKLOG).start()
    await web.SockSite(admin_runner, admin_sock, backlog=ADMIN_BACKLOG).start()
    # Start-up objects (config, modules, tables) never die: keep them out of every
    # collection. Requests make few reference cycles, so collect young objects less often.
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 20, 20)
    port = sock.getsockname()[1]
    admin_port = admin_sock.getsockname()[1]
    log.info("worker_started", worker=worker, port=port, admin_port=admin_port)
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
    log.info("worker_stopping", worker=worker)
    await runner.cleanup()
    await admin_runner.cleanup()
    await router.stop()


def _announce(host: str, port: int, admin_host: str, admin_port: int) -> None:
    sys.stdout.write(
        f"llmgw router listening on http://{host}:{port} admin http://{admin_host}:{admin_port}\n"
    )
    sys.stdout.flush()
    sdnotify.ready()


def _worker_main(
    cfg_bytes: bytes,
    worker: int,
    ready: Any,
    limits_path: str,
    lock: Any,
    sock: socket.socket,
    admin_sock: socket.socket,
) -> None:
    cfg = msgspec.json.decode(cfg_bytes, type=RouterConfig)
    logs.setup(cfg.log_level)
    limits = SharedLimits(limits_path, lock)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(serve(cfg, sock, admin_sock, worker=worker, ready=ready, limits=limits))


def run(
    cfg: RouterConfig,
    claimed: tuple[list[socket.socket], list[socket.socket]] | None = None,
) -> None:
    """Run the router in the foreground until SIGTERM / SIGINT, on the listeners of
    `claim(cfg)` (claimed here when not given)."""
    api, admin = claimed if claimed is not None else claim(cfg)
    if cfg.workers <= 1:
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(serve(cfg, api[0], admin[0]))
        return
    _run_workers(cfg, api, admin)


def _run_workers(cfg: RouterConfig, api: list[socket.socket], admin: list[socket.socket]) -> None:
    ports = [api[0].getsockname()[1], admin[0].getsockname()[1]]
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
        _signal_all(procs, signal.SIGTERM)

    def on_hup(signum: int, _frame: Any) -> None:
        _signal_all(procs, signal.SIGHUP)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGHUP, on_hup)
    try:
        for i in range(cfg.workers):
            proc, recv = _start_worker(ctx, i, (cfg_bytes, limits_path, limits_lock), api, admin)
            procs.append(proc)
            pipes.append(recv)
        _wait_started(procs, pipes)
        _announce(cfg.listen.host, ports[0], cfg.admin.host, ports[1])
        while not stopping:
            multiprocessing.connection.wait([p.sentinel for p in procs], timeout=1.0)
            dead = [p for p in procs if not p.is_alive()]
            if dead and not stopping:
                log.error("worker_died", worker=dead[0].name, code=dead[0].exitcode)
                on_signal(signal.SIGTERM, None)
                raise SystemExit(1)
    finally:
        for sock in (*api, *admin):
            sock.close()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
        shutil.rmtree(mpdir, ignore_errors=True)


def _start_worker(
    ctx: multiprocessing.context.SpawnContext,
    i: int,
    shared: tuple[bytes, str, Any],
    api: list[socket.socket],
    admin: list[socket.socket],
) -> tuple[multiprocessing.process.BaseProcess, multiprocessing.connection.Connection]:
    """Start worker `i` on its sockets; its process and the pipe it says it listens on.
    `shared`: the encoded config, the rate limits' file and their lock."""
    cfg_bytes, limits_path, limits_lock = shared
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(
        target=_worker_main,
        # The sockets travel as file descriptors the child inherits.
        args=(cfg_bytes, i, send, limits_path, limits_lock, api[i], admin[i]),
        name=f"router-{i}",
    )
    proc.start()
    send.close()
    # The worker has its own copies now; a dead worker's queue must not linger here.
    api[i].close()
    admin[i].close()
    return proc, recv


def _signal_all(procs: list[multiprocessing.process.BaseProcess], sig: int) -> None:
    """Send `sig` to every worker still alive."""
    for p in procs:
        if p.pid is not None and p.is_alive():
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)


def _wait_started(
    procs: list[multiprocessing.process.BaseProcess],
    pipes: list[multiprocessing.connection.Connection],
) -> None:
    """Wait for every worker's word that it listens; if one dies first, stop the others and
    exit saying which. A worker that dies closes its end of the pipe: the wait ends with
    nothing to read (EOFError), not a word."""
    for p, recv in zip(procs, pipes, strict=True):
        while not recv.poll(0.2):
            if not p.is_alive():
                break
        try:
            recv.recv()
        except EOFError:
            p.join(5)
            _signal_all(procs, signal.SIGTERM)
            raise SystemExit(
                f"router worker {p.name} exited during start (code {p.exitcode})"
            ) from None
