"""The supervisor: starts engine processes, watches them become ready, stops them, adopts orphans.

Each engine runs in its own process group (engines fork workers that hold GPU
memory and outlive a signal sent only to the leader), writes its output to a
file whose tail ships with `failed`, and goes through starting -> loading ->
serving. Readiness is two questions: is the engine up (its port accepts
connections or `/health` answers: loading), then has it loaded (`/health` is
200 and `/v1/models` lists the served name: serving); routing on /health
alone sends traffic into a loading model. vLLM binds its port before loading
and stalls HTTP until loaded, so an accepted connection already means loading.
Stop is SIGTERM to the group, then SIGKILL after a grace period. A pid file
per shard, fingerprinted with start time and command line, lets a restarted
agent adopt its running engines and never an unrelated process that reused a
pid. Shard 0 of each generation gets its own API key (`secrets.token_urlsafe`), kept
in the pid file (mode 0600) so an adopting agent still knows it, and reported with
serving for routers to present; no log line carries it.

Driven by the agent service through an async API: `start`, `stop`,
`mark_draining`, `adopt`, and an `on_change` callback receiving a `ShardView`
on every transition (`status_event` turns it into a ShardStatus).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import secrets
import time
from pathlib import Path

import msgspec

from llmgw import logs, pidfiles, processes
from llmgw.agent import engines, logtail, stopping
from llmgw.agent.engines.common import Launch
from llmgw.agent.probe import Prober, Startup
from llmgw.agent.shards import LIVE, OnChange, ShardView
from llmgw.core.events import ShardPhase
from llmgw.core.profile import LaunchSpec

log = logs.get("llmgw.agent.supervisor")


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    state_dir: str
    address: str = "127.0.0.1"
    """Host in the endpoint URL routers use (`http://address:port`)."""
    stop_grace_s: float = 30.0
    tail_lines: int = 100
    poll_s: float = 0.5
    probe_timeout_s: float = 2.0
    headless_settle_s: float = 2.0
    """A headless multi-node worker serves no HTTP: alive this long counts as serving."""
    max_log_bytes: int = 16 * 1024 * 1024
    keep_log_bytes: int = 1024 * 1024


class AdoptionResult(msgspec.Struct, frozen=True, kw_only=True):
    replica_id: str
    shard: int
    adopted: bool
    reason: str = ""
    pid: int | None = None


def _remove(path: str) -> None:
    """Delete a small local file (microseconds: not worth a thread)."""
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


async def _spawn(launch: Launch, output: int, cwd: Path) -> asyncio.subprocess.Process:
    """Start the engine in its own process group, its output going to the file `output`.

    In `cwd`, a folder of the agent's own: the launch policy admits `org/name` as a Hugging
    Face id, which an engine opens as a file if it exists relative to its working folder,
    and the agent's is `/` under systemd (launch.file_dirs would not bound what it reads).
    """
    return await asyncio.create_subprocess_exec(
        *launch.argv,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=output,
        stderr=asyncio.subprocess.STDOUT,
        env={**os.environ, **launch.env},
        start_new_session=True,
        cwd=cwd,
    )


class _Shard:
    """The mutable runtime state of one supervised shard (only the supervisor touches it)."""

    def __init__(self, record: pidfiles.ShardRecord, *, adopted: bool) -> None:
        self.record = record
        self.phase: ShardPhase = record.phase if adopted else "starting"
        self.error = ""
        self.log_tail: tuple[str, ...] = ()
        self.adopted = adopted
        self.proc: asyncio.subprocess.Process | None = None
        self.returncode: int | None = None
        self.exited = asyncio.Event()
        self.stopping = False
        self.task: asyncio.Task[None] | None = None
        self.spawned_perf = 0.0

    @property
    def key(self) -> tuple[str, int]:
        return (self.record.replica_id, self.record.shard)

    @property
    def pid(self) -> int:
        return self.record.process.pid


class Supervisor:
    """Engine processes of one node. Not thread-safe: use from one event loop."""

    def __init__(self, settings: Settings, on_change: OnChange | None = None) -> None:
        self.settings = settings
        self.state_dir = Path(settings.state_dir)
        self.on_change = on_change
        self._shards: dict[tuple[str, int], _Shard] = {}
        self._prober = Prober()
        self.probes: collections.Counter[str] = collections.Counter()
        """Startup probes of engines so far, by result (the agent's metrics)."""

    # ------------------------------------------------------------------ queries

    def view(self, replica_id: str, shard: int = 0) -> ShardView | None:
        sh = self._shards.get((replica_id, shard))
        return self._view(sh) if sh else None

    def views(self) -> list[ShardView]:
        return [self._view(sh) for sh in self._shards.values()]

    def busy_gpus(self) -> frozenset[int]:
        """GPUs held by live shards: what validation must not hand out again."""
        return frozenset(
            g for sh in self._shards.values() if sh.phase in LIVE for g in sh.record.spec.gpus
        )

    def own_pids(self) -> frozenset[int]:
        """Every process of every live engine group: their GPU memory is not foreign."""
        return frozenset(
            pid
            for sh in self._shards.values()
            if sh.phase in LIVE
            for pid in processes.group_members(sh.record.pgid)
        )

    def _view(self, sh: _Shard) -> ShardView:
        spec = sh.record.launch
        endpoint = ""
        if sh.phase in ("serving", "draining") and spec.http:
            endpoint = f"http://{self.settings.address}:{spec.port}"
        return ShardView(
            replica_id=sh.record.replica_id,
            generation=sh.record.generation,
            shard=sh.record.shard,
            phase=sh.phase,
            endpoint=endpoint,
            error=sh.error,
            log_tail=sh.log_tail,
            pid=sh.pid or None,
            gpus=sh.record.spec.gpus,
            adopted=sh.adopted,
            api_key=spec.api_key if endpoint else "",
            model=spec.served_name,
            kv_events=spec.kv_events,
            kv_replay=spec.kv_replay,
        )

    # ------------------------------------------------------------------ commands

    async def start(
        self, replica_id: str, generation: int, shard: int, spec: LaunchSpec, launch: Launch
    ) -> ShardView:
        """Spawn the engine and return at once; transitions arrive through `on_change`.

        Idempotent by replica id and generation: a live shard of the same or a
        newer generation is left alone; an older one is stopped first.
        """
        began = time.perf_counter()
        if launch.http and spec.node_rank == 0 and not launch.api_key:
            # Routers present it; no other node can read this node's events, so an engine
            # reachable on the node network still answers only the routers.
            launch = engines.keyed(spec, launch, secrets.token_urlsafe(32))
        key = (replica_id, shard)
        existing = self._shards.get(key)
        if existing is not None and existing.phase in LIVE:
            if existing.record.generation >= generation:
                return self._view(existing)
            await self.stop(replica_id, shard, reason=f"superseded by generation {generation}")
        log_path, fd = self._open_log(replica_id, shard, generation)
        try:
            proc = await _spawn(launch, fd, self.state_dir / "engines")
        except OSError as exc:
            # Nothing ran: the output file holds nothing, and no record would name it
            # for `forget` to delete.
            log_path.unlink(missing_ok=True)
            return await self._refuse_spawn(replica_id, generation, shard, spec, launch, exc)
        finally:
            os.close(fd)
        spawned = time.perf_counter()
        fingerprint = processes.fingerprint(proc.pid) or processes.Fingerprint(
            pid=proc.pid, start_time=-1, boot_id=processes.boot_id(), cmdline=launch.argv
        )
        record = pidfiles.ShardRecord(
            replica_id=replica_id,
            generation=generation,
            shard=shard,
            spec=spec,
            launch=launch,
            process=fingerprint,
            pgid=proc.pid,
            log_path=str(log_path),
            started_at=time.time(),
        )
        pidfiles.keep(self.state_dir, record)
        sh = _Shard(record, adopted=False)
        sh.proc = proc
        sh.spawned_perf = spawned - began
        self._shards[key] = sh
        log.info(
            "engine_spawned",
            replica_id=replica_id,
            generation=generation,
            shard=shard,
            pid=proc.pid,
            spawn_ms=round(sh.spawned_perf * 1000, 2),
        )
        sh.task = asyncio.create_task(self._watch(sh), name=f"shard-{replica_id}-{shard}")
        await self._emit(sh)
        return self._view(sh)

    def _open_log(self, replica_id: str, shard: int, generation: int) -> tuple[Path, int]:
        """A new generation's output file, opened; earlier generations' files are deleted."""
        log_path = pidfiles.log_path_for(self.state_dir, replica_id, shard, generation)
        log_path.parent.mkdir(parents=True, exist_ok=True)
        (self.state_dir / "engines").mkdir(exist_ok=True)  # their working folder (_spawn)
        # Earlier generations' output is history once a new one starts: keep disk bounded.
        stem = pidfiles.path_for(self.state_dir, replica_id, shard).stem
        for old_log in log_path.parent.glob(f"{stem}.g*.log"):
            old_log.unlink(missing_ok=True)
        # O_APPEND: the engine always writes at the end, so trimming the file stays safe.
        # 0600: an engine may print its arguments, and SGLang's include its API key.
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_APPEND
        return log_path, os.open(log_path, flags, 0o600)

    async def _refuse_spawn(
        self,
        replica_id: str,
        generation: int,
        shard: int,
        spec: LaunchSpec,
        launch: Launch,
        exc: OSError,
    ) -> ShardView:
        record = pidfiles.ShardRecord(
            replica_id=replica_id,
            generation=generation,
            shard=shard,
            spec=spec,
            launch=launch,
            process=processes.Fingerprint(pid=0, start_time=-1, boot_id="", cmdline=launch.argv),
            pgid=0,
            log_path="",
        )
        sh = _Shard(record, adopted=False)
        sh.phase = "failed"
        sh.error = (
            f"cannot start {launch.argv[0]!r}: {exc.strerror or exc}; install the engine "
            "or set its command in the agent config"
        )
        self._shards[sh.key] = sh
        await self._emit(sh)
        return self._view(sh)

    async def stop(
        self, replica_id: str, shard: int = 0, *, grace_s: float | None = None, reason: str = ""
    ) -> ShardView | None:
        """SIGTERM to the engine's group, SIGKILL after the grace; returns once none is left."""
        sh = self._shards.get((replica_id, shard))
        if sh is None:
            return None
        if sh.phase not in LIVE:
            return self._view(sh)
        sh.stopping = True
        grace = self.settings.stop_grace_s if grace_s is None else grace_s
        await self._terminate(sh, grace)
        if sh.task is not None:
            sh.task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await sh.task
        sh.phase = "stopped"
        sh.error = reason
        pidfiles.remove(self.state_dir, replica_id, shard)
        _remove(sh.record.log_path)
        await self._emit(sh)
        return self._view(sh)

    async def mark_draining(self, replica_id: str, shard: int = 0) -> ShardView | None:
        """DrainShard: the engine keeps serving what it has while routers stop sending more."""
        sh = self._shards.get((replica_id, shard))
        if sh is None or sh.phase != "serving":
            return self._view(sh) if sh else None
        await self._set_phase(sh, "draining")
        return self._view(sh)

    def forget(self, replica_id: str, shard: int = 0) -> None:
        """Drop a stopped or failed shard from the table once its status was delivered."""
        sh = self._shards.get((replica_id, shard))
        if sh is not None and sh.phase not in LIVE:
            del self._shards[(replica_id, shard)]
            _remove(sh.record.log_path)

    async def stop_all(self, *, grace_s: float | None = None) -> None:
        await asyncio.gather(
            *(
                self.stop(sh.record.replica_id, sh.record.shard, grace_s=grace_s)
                for sh in list(self._shards.values())
                if sh.phase in LIVE
            )
        )

    async def adopt(self) -> list[AdoptionResult]:
        """Take over engines a previous agent left running; clear pid files that lie."""
        results = []
        for path, record in pidfiles.load_all(self.state_dir):
            if record is None:
                pidfiles.set_aside(path)
                unreadable = AdoptionResult(
                    replica_id=path.stem, shard=-1, adopted=False, reason="unreadable"
                )
                results.append(unreadable)
            elif (record.replica_id, record.shard) not in self._shards:
                results.append(self._adopt(path, record))
        return results

    def _adopt(self, path: Path, record: pidfiles.ShardRecord) -> AdoptionResult:
        """Watch the engine a pid file names, or delete the file if its process is another."""
        # The reason may quote a command line, and SGLang's carries its key.
        lie = processes.mismatch(record.process) or pidfiles.foreign_group(record)
        (why,) = logtail.redact((lie,), record.launch.api_key)
        result = AdoptionResult(
            replica_id=record.replica_id,
            shard=record.shard,
            adopted=not why,
            reason=why,
            pid=record.process.pid,
        )
        if why:
            # Adopting an unrelated process is worse than leaking the original: an
            # engine we lost still shows up as foreign GPU memory and is not reused.
            path.unlink(missing_ok=True)
            log.warning("not_adopted", replica_id=record.replica_id, reason=why)
            return result
        sh = _Shard(pidfiles.with_own_log(self.state_dir, record), adopted=True)
        self._shards[sh.key] = sh
        sh.task = asyncio.create_task(self._watch(sh), name=f"adopted-{record.replica_id}")
        log.info("engine_adopted", replica_id=record.replica_id, pid=record.process.pid)
        return result

    async def close(self) -> None:
        """Stop watching. Engines keep running: serving survives the agent."""
        for sh in self._shards.values():
            if sh.task is not None:
                sh.task.cancel()
        for sh in self._shards.values():
            if sh.task is not None:
                with contextlib.suppress(asyncio.CancelledError):
                    await sh.task
        await self._prober.close()

    # ------------------------------------------------------------------ internals

    async def _emit(self, sh: _Shard) -> None:
        if self.on_change is None:
            return
        try:
            await self.on_change(self._view(sh))
        except Exception:
            log.exception("on_change_failed", replica_id=sh.record.replica_id)

    async def _set_phase(self, sh: _Shard, phase: ShardPhase) -> None:
        sh.phase = phase
        current = processes.fingerprint(sh.pid)
        process = sh.record.process
        # Engines may retitle themselves while loading (setproctitle): re-record the
        # command line of the same process (same start time) so adoption still matches.
        if current is not None and current.start_time == process.start_time:
            process = current
        sh.record = msgspec.structs.replace(sh.record, phase=phase, process=process)
        pidfiles.keep(self.state_dir, sh.record)
        log.info("shard_phase", replica_id=sh.record.replica_id, shard=sh.record.shard, phase=phase)
        await self._emit(sh)

    async def _fail(self, sh: _Shard, error: str) -> None:
        sh.stopping = True
        # A failed shard must give its GPUs back: workers may outlive the leader.
        await self._terminate(sh, min(self.settings.stop_grace_s, 5.0))
        sh.phase = "failed"
        sh.error = error
        sh.log_tail = logtail.tail(
            Path(sh.record.log_path), self.settings.tail_lines, sh.record.launch.api_key
        )
        pidfiles.remove(self.state_dir, sh.record.replica_id, sh.record.shard)
        log.warning("shard_failed", replica_id=sh.record.replica_id, error=error)
        await self._emit(sh)

    async def _terminate(self, sh: _Shard, grace_s: float) -> None:
        await stopping.terminate(sh.record.pgid, sh.proc, grace_s, sh.record.replica_id)

    def _alive(self, sh: _Shard) -> bool:
        if sh.proc is not None:
            return sh.proc.returncode is None
        return not processes.mismatch(sh.record.process)

    async def _watch(self, sh: _Shard) -> None:
        """Drive one shard through its phases until it serves, then watch that it stays alive."""
        reaper = self._reaper(sh)
        startup = Startup(sh.record.launch, sh.record.spec, time.monotonic())
        announced = not sh.adopted
        last_trim = startup.began
        try:
            while True:
                if not self._alive(sh):
                    if not sh.stopping:
                        code = sh.returncode
                        how = f"exited with code {code}" if code is not None else "disappeared"
                        await self._fail(sh, f"engine {how} while {sh.phase}")
                    return
                now = time.monotonic()
                if sh.phase in ("starting", "loading"):
                    announced = await self._step_startup(sh, startup, now, announced)
                    overdue = startup.overdue(sh.phase, now)
                    if overdue:
                        await self._fail(sh, overdue)
                        return
                elif not announced:
                    announced = True
                    await self._emit(sh)
                if now - last_trim > 10.0:
                    last_trim = now
                    logtail.trim(
                        Path(sh.record.log_path),
                        self.settings.max_log_bytes,
                        self.settings.keep_log_bytes,
                        sh.record.launch.api_key,
                    )
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(sh.exited.wait(), self.settings.poll_s)
        finally:
            if reaper is not None and not reaper.done() and not sh.stopping:
                reaper.cancel()

    def _reaper(self, sh: _Shard) -> asyncio.Task[None] | None:
        """A task noting a spawned engine's exit; None for an adopted one (not our child)."""
        if sh.proc is None:
            return None
        proc = sh.proc

        async def reap() -> None:
            sh.returncode = await proc.wait()
            sh.exited.set()

        return asyncio.create_task(reap())

    async def _step_startup(
        self, sh: _Shard, startup: Startup, now: float, announced: bool
    ) -> bool:
        """Move a starting or loading shard on as its probe says; whether it was announced."""
        launch = sh.record.launch
        if not launch.http:
            if now - startup.began >= self.settings.headless_settle_s:
                await self._set_phase(sh, "serving")
            return announced
        probe = await self._prober.probe(launch, self.settings.probe_timeout_s)
        self.probes[probe] += 1
        if probe != "down" and startup.up_since is None:
            startup.up_since = time.monotonic()
        target: ShardPhase = sh.phase
        if probe == "ready":
            target = "serving"
        elif probe == "up":
            target = "loading"
        if target != sh.phase or not announced:
            await self._set_phase(sh, target)
            return True
        return announced
