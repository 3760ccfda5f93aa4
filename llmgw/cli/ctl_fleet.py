"""`llmgw ctl` fleet commands: see the fleet, change it, and travel through its history.

nodes, replicas, models, apply, explain-placement, cordon, uncordon, drain, events,
replay, status. Reads fold the log here (newest snapshot + tail, `llmgw.ctl.history`);
mutations are operator events published with the identity of the certificate; only
`status` asks a control plane's admin API, for what only the running service knows
(where its fold is, and whether it agrees with ctl's).
Exit codes: 0 ok, 1 operational failure (or, for `replay --verify`, differences
found), 2 bad input; every error is one line on stderr saying what to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import structlog
import typer

from llmgw import bus
from llmgw.control import verify as control_verify
from llmgw.core import events, placement, reconcile, state
from llmgw.ctl import (
    catalogfile,
    changes,
    eventlines,
    history,
    operations,
    render,
    settings,
    views,
)
from llmgw.ctl.errors import BadInput, CtlError, Failed
from llmgw.ctl.session import Session

T = TypeVar("T")

CONFIG = typer.Option(
    None, "--config", help=f"ctl settings YAML (default: ${settings.CONFIG_ENV}, else built-in)."
)
SERVER = typer.Option(None, "--server", "-s", help="NATS URL (repeat for a cluster).")
CA = typer.Option(None, "--ca", help="The fleet's CA certificate [nats/certs/ca.pem].")
CERT = typer.Option(
    None, "--cert", help="Your operator certificate [nats/certs/operator/admin.pem]."
)
KEY = typer.Option(None, "--key", help="Its key [beside the certificate, NAME-key.pem].")
JSON = typer.Option(False, "--json", help="Machine-readable JSON instead of a table.")


class Conn(msgspec.Struct, frozen=True):
    config: Path | None
    servers: list[str] | None
    ca: str | None
    cert: str | None
    key: str | None
    control_url: str | None = None

    def load(self) -> settings.CtlConfig:
        return settings.load(
            self.config,
            overrides={
                "servers": self.servers,
                "ca_file": self.ca,
                "cert_file": self.cert,
                "key_file": self.key,
                "control_url": self.control_url,
            },
        )


class _Stderr:
    """Whatever sys.stderr is when a line is logged (not when logging was configured)."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def _quiet_logs() -> None:
    """Library logs only when critical, on stderr: stdout carries the answer (`--json` must
    stay parseable), and what went wrong is ctl's own one-line error (a permission
    violation the bus logs is reported by `Session.publish` with what to do)."""
    structlog.configure(
        processors=[
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.dev.ConsoleRenderer(colors=False),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(logging.CRITICAL),
        logger_factory=structlog.PrintLoggerFactory(file=_Stderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    # asyncio warns "returning true from eof_received() has no effect when using ssl"
    # whenever a TLS connection to NATS closes: noise on an operator's terminal.
    logging.getLogger("asyncio").setLevel(logging.ERROR)


def _run(conn: Conn, body: Callable[[Session], Awaitable[int | None]]) -> None:
    """Connect, run `body`, close; CtlError -> one line on stderr and its exit code."""
    _quiet_logs()

    async def main() -> int:
        session = await Session.open(conn.load())
        try:
            return (await body(session)) or 0
        finally:
            await session.close()

    try:
        code = asyncio.run(main())
    except CtlError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(exc.exit_code) from None
    except KeyboardInterrupt:
        raise typer.Exit(130) from None
    if code:
        raise typer.Exit(code)


def _out(text: str) -> None:
    typer.echo(text)


def _colour() -> bool:
    return render.use_colour(sys.stdout)


async def _current(s: Session, *, progress: bool = True) -> history.Rebuilt:
    bar = render.ProgressBar(label="reading the log") if progress else None
    try:
        return await history.rebuild(s.nc, progress=bar)
    finally:
        if bar is not None:
            bar.close()


def _require_node(st: state.ClusterState, node: str) -> None:
    if node not in st.nodes:
        known = ", ".join(sorted(st.nodes)[:8]) or "none registered yet"
        raise BadInput(f"unknown node {node!r} (known: {known}): see `llmgw ctl nodes`")


def _require_model(st: state.ClusterState, model: str) -> None:
    if model not in st.models:
        known = ", ".join(sorted(st.models)[:8]) or "none declared"
        raise BadInput(
            f"unknown model {model!r} (declared: {known}): see `llmgw ctl models`, or declare "
            "it with `llmgw ctl apply -f models.yaml`"
        )


async def _publish_checked(
    s: Session, st: state.ClusterState, items: list[events.Event]
) -> list[dict[str, Any]]:
    """Publish operator events, then fold up to them: the fold's refusal is an error too."""
    results = []
    for event in items:
        published = await s.publish(event)
        results.append(
            {
                "seq": published.seq,
                "type": events.tag_of(type(event)),
                "operator": s.identity.name,
                "event": msgspec.to_builtins(event),
            }
        )
    last = max((r["seq"] for r in results), default=0)
    refused: dict[int, str] = {}
    async for batch in history.records(s.nc, after_seq=st.last_seq, to_seq=last):
        for rec in batch:
            reason = state.apply(st, rec.event, rec.seq, rec.time)
            if reason is not None:
                refused[rec.seq] = reason
    for r in results:
        if r["seq"] in refused:
            raise Failed(
                f"{r['type']} was written at seq {r['seq']} but the fold refused it: "
                f"{refused[r['seq']]}"
            )
    return results


# --------------------------------------------------------------------------- views


def nodes(
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Nodes: lifecycle, GPUs by class (free/used/unhealthy, why), fabrics, flags, heartbeat."""

    async def body(s: Session) -> None:
        r = await _current(s)
        rows = views.node_rows(r.state, time.time())
        _out(render.json_text(rows) if json_out else render.nodes_table(rows, colour=_colour()))

    _run(Conn(config, server, ca, cert, key), body)


def replicas(
    model: str | None = typer.Option(None, "--model", "-m", help="Only this model's replicas."),
    log_lines: int = typer.Option(5, "--log-lines", help="Engine log lines shown per shard."),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Replicas: shards, nodes and GPUs, phases, per-shard errors and engine log tails."""

    async def body(s: Session) -> None:
        r = await _current(s)
        if model is not None and not any(x.model == model for x in r.state.replicas.values()):
            _require_model(r.state, model)
        rows = views.replica_rows(r.state, model)
        if json_out:
            _out(render.json_text(rows))
        else:
            _out(render.replicas_table(rows, colour=_colour(), log_lines=log_lines))

    _run(Conn(config, server, ca, cert, key), body)


def models(
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Declared models: replicas serving / active / wanted, and why any cannot be placed."""

    async def body(s: Session) -> None:
        r = await _current(s)
        rows = views.model_rows(r.state, time.time())
        _out(render.json_text(rows) if json_out else render.models_table(rows))

    _run(Conn(config, server, ca, cert, key), body)


def explain_placement(
    model: str = typer.Argument(..., help="A declared model."),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Every candidate node for a new replica of MODEL: why it is rejected, or where it lands."""

    async def body(s: Session) -> None:
        r = await _current(s)
        _require_model(r.state, model)
        ex = placement.explain(r.state, model, time.time())
        if json_out:
            _out(render.json_text(ex))
        else:
            _out(ex.render())

    _run(Conn(config, server, ca, cert, key), body)


# --------------------------------------------------------------------------- mutations


def apply(
    file: Path = typer.Option(..., "--file", "-f", help="models.yaml: the desired catalog."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Apply without asking."),
    prune: bool = typer.Option(
        True, "--prune/--no-prune", help="Remove declared models the file does not list."
    ),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Declare, change or remove models to match a models.yaml; shows the diff first."""
    try:
        text = file.read_text()
    except OSError as exc:
        typer.echo(f"error: cannot read {file}: {exc.strerror}; check the path", err=True)
        raise typer.Exit(2) from None
    try:
        wanted = catalogfile.parse(text, str(file))
    except BadInput as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None

    async def body(s: Session) -> int:
        r = await _current(s)
        ops = catalogfile.plan(r.state.models, wanted, prune=prune)
        if not ops:
            if json_out:
                _out(render.json_text({"operations": [], "published": []}))
            else:
                _out(f"{file}: the declared models already match; nothing to do")
            return 0
        if not json_out:
            _out("\n".join(op.render() for op in ops))
        if not yes:
            if not sys.stdin.isatty():
                raise BadInput("not on a terminal, so not asking: pass --yes to apply")
            if not typer.confirm(f"apply these {len(ops)} changes?", default=False):
                _out("nothing applied")
                return 1
        batch: list[events.Event] = []
        for op in ops:
            common: dict[str, Any] = {"id": s.new_id(), "ts": s.now(), "operator": s.identity.name}
            if op.action == "remove":
                batch.append(events.ModelRemoved(name=op.name, **common))
            elif op.action == "declare":
                assert op.profile is not None
                batch.append(events.ModelDeclared(profile=op.profile, **common))
            else:
                assert op.profile is not None
                batch.append(events.ModelChanged(profile=op.profile, **common))
        published = await _publish_checked(s, r.state, batch)
        if json_out:
            _out(render.json_text({"operations": ops, "published": published}))
        else:
            _out(
                f"applied {len(published)} changes as {s.identity} (seq "
                f"{published[0]['seq']}-{published[-1]['seq']})"
            )
        return 0

    _run(Conn(config, server, ca, cert, key), body)


def cordon(
    node: str = typer.Argument(...),
    reason: str = typer.Option("", "--reason", help="Recorded in the log and shown by nodes."),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Stop placing new replicas on NODE (what runs there keeps running)."""

    async def body(s: Session) -> None:
        r = await _current(s, progress=False)
        _require_node(r.state, node)
        ev = events.NodeCordoned(
            id=s.new_id(), ts=s.now(), operator=s.identity.name, node=node, reason=reason
        )
        (pub,) = await _publish_checked(s, r.state, [ev])
        _out(
            render.json_text(pub)
            if json_out
            else f"{node} cordoned by {s.identity} (seq {pub['seq']})"
        )

    _run(Conn(config, server, ca, cert, key), body)


def uncordon(
    node: str = typer.Argument(...),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Let NODE receive new replicas again (also ends a drain)."""

    async def body(s: Session) -> None:
        r = await _current(s, progress=False)
        _require_node(r.state, node)
        ev = events.NodeUncordoned(id=s.new_id(), ts=s.now(), operator=s.identity.name, node=node)
        (pub,) = await _publish_checked(s, r.state, [ev])
        _out(
            render.json_text(pub)
            if json_out
            else f"{node} uncordoned by {s.identity} (seq {pub['seq']})"
        )

    _run(Conn(config, server, ca, cert, key), body)


async def _follow_drain(
    s: Session,
    st: state.ClusterState,
    node: str,
    originals: list[str],
    timeout_s: float,
) -> operations.DrainProgress:
    """Fold the log live until the drain is done (or `timeout_s`); progress on stderr."""
    deadline = time.monotonic() + timeout_s
    shown = ""
    progress = operations.drain_progress(st, node, originals, time.time())
    reader = bus.Reader(s.nc, after_seq=st.last_seq, follow=True, name="ctl", heartbeat_s=1.0)
    async with reader:
        batches = reader.batches().__aiter__()
        while True:
            progress = operations.drain_progress(st, node, originals, time.time())
            line = progress.render()
            if line != shown:
                typer.echo(line + "".join(f"\n    {x}" for x in progress.lines), err=True)
                shown = line
            if progress.done:
                return progress
            if not st.nodes[node].draining:
                raise Failed(
                    f"the drain of {node} was called off (uncordoned) before it finished "
                    f"({line}); see `llmgw ctl events --node {node}`"
                )
            left = deadline - time.monotonic()
            if left <= 0:
                raise Failed(
                    f"the drain of {node} did not finish within {timeout_s:g} s ({line}); "
                    "follow it with `llmgw ctl replicas`, or wait longer with --timeout"
                )
            with contextlib.suppress(TimeoutError):
                batch = await asyncio.wait_for(batches.__anext__(), timeout=min(left, 1.0))
                for rec in batch:
                    state.apply(st, rec.event, rec.seq, rec.time)


def drain(
    node: str = typer.Argument(...),
    grace: float = typer.Option(
        600.0, "--grace", help="Seconds after which its replicas stop even without a replacement."
    ),
    reason: str = typer.Option("", "--reason"),
    wait: bool = typer.Option(False, "--wait", help="Follow the drain to its end, with progress."),
    timeout: float | None = typer.Option(
        None, "--timeout", help="Give up waiting after this many seconds [grace + 120]."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would move where."),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """Move every replica off NODE (rolling: replacement serving first), then keep it empty."""
    if not grace >= 0:
        typer.echo("error: --grace must be 0 or more seconds", err=True)
        raise typer.Exit(2)

    async def body(s: Session) -> int:
        r = await _current(s, progress=False)
        _require_node(r.state, node)
        moves = operations.drain_plan(r.state, node, time.time())
        originals = [m.replica for m in moves]
        if not json_out:
            _out(
                f"draining {node} moves {len(moves)} replica(s):"
                if moves
                else f"{node} runs no replicas: nothing moves"
            )
            for m in moves:
                _out(m.render())
        if dry_run:
            if json_out:
                _out(render.json_text({"node": node, "moves": moves, "published": None}))
            return 0
        ev = events.NodeDrainRequested(
            id=s.new_id(),
            ts=s.now(),
            operator=s.identity.name,
            node=node,
            grace_s=grace,
            reason=reason,
        )
        (pub,) = await _publish_checked(s, r.state, [ev])
        if not json_out:
            _out(f"drain of {node} requested by {s.identity} (seq {pub['seq']})")
        result: operations.DrainProgress | None = None
        if wait:
            limit = timeout if timeout is not None else grace + 120.0
            result = await _follow_drain(s, r.state, node, originals, limit)
            if not json_out:
                _out(result.render() + (": done" if result.done else ""))
        if json_out:
            _out(
                render.json_text(
                    {"node": node, "moves": moves, "published": pub, "progress": result}
                )
            )
        return 0

    _run(Conn(config, server, ca, cert, key), body)


# --------------------------------------------------------------------------- the log


def _event_json(rec: bus.Record) -> dict[str, Any]:
    return {
        "seq": rec.seq,
        "time": rec.time,
        "subject": rec.subject,
        "type": events.tag_of(type(rec.event)),
        "event": msgspec.to_builtins(rec.event),
    }


def _event_line(rec: bus.Record, colour: bool) -> str:
    tag = events.tag_of(type(rec.event))
    fam = eventlines.family(rec.event)
    return (
        f"{rec.seq:>8}  {history.format_time(rec.time)}  "
        f"{render.paint(tag.ljust(28), render.FAMILY_COLOUR.get(fam), colour)} "
        f"{eventlines.summary(rec.event)}"
    )


def events_cmd(
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    since: str | None = typer.Option(None, "--since", help="From this time (ISO, @UNIX, 10m)."),
    seq: int | None = typer.Option(None, "--seq", help="From this sequence number."),
    node: str | None = typer.Option(None, "--node", help="Only events about this node."),
    type_: str | None = typer.Option(
        None, "--type", "-t", help="Only this type: node.shard, a family (operator), or shard."
    ),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line."),
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """The log decoded, one line per event (coloured on a terminal)."""
    if since is not None and seq is not None:
        typer.echo("error: give --since or --seq, not both", err=True)
        raise typer.Exit(2)
    if seq is not None and seq < 1:
        typer.echo("error: --seq counts from 1", err=True)
        raise typer.Exit(2)
    if type_ is not None and not any(eventlines.matches_tag(t, type_) for t in events.BY_TAG):
        tags = ", ".join(sorted(events.BY_TAG))
        typer.echo(f"error: no event type matches {type_!r}: use one of {tags}", err=True)
        raise typer.Exit(2)

    async def body(s: Session) -> None:
        start = history.parse_time(since, time.time()) if since is not None else None
        colour = _colour()
        async for batch in history.records(
            s.nc, after_seq=(seq - 1) if seq else 0, since=start, follow=follow
        ):
            lines = []
            for rec in batch:
                if node is not None and not eventlines.touches(rec.event, node, rec.subject):
                    continue
                if type_ is not None and not eventlines.matches(rec.event, type_):
                    continue
                lines.append(
                    render.json_text(_event_json(rec)) if json_out else _event_line(rec, colour)
                )
            if lines:
                _out("\n".join(lines))

    _run(Conn(config, server, ca, cert, key), body)


def _state_document(r: history.Rebuilt, view: str) -> dict[str, Any]:
    now = r.at if r.at is not None else time.time()
    doc: dict[str, Any] = {
        "seq": r.target_seq,
        "time": r.at,
        "snapshot_seq": r.snapshot_seq,
        "folded": r.folded,
        "elapsed_s": round(r.elapsed_s, 4),
        "digest": state.digest(r.state),
        "leader": r.state.leader,
        "epoch": r.state.epoch,
        "rejected": [{"seq": q, "reason": why} for q, why in r.rejected],
        "skipped": [msgspec.to_builtins(x) for x in r.skipped],
    }
    if view in ("all", "nodes"):
        doc["nodes"] = views.node_rows(r.state, now)
    if view in ("all", "replicas"):
        doc["replicas"] = views.replica_rows(r.state)
    if view in ("all", "models"):
        doc["models"] = views.model_rows(r.state, now)
    if view in ("all", "endpoints"):
        doc["endpoints"] = views.endpoint_rows(r.state)
    return doc


def _state_text(r: history.Rebuilt, doc: dict[str, Any], colour: bool) -> str:
    parts = [render.rebuilt_header(r)]
    if "nodes" in doc:
        parts.append(render.nodes_table(doc["nodes"], colour=colour))
    if "replicas" in doc:
        parts.append(render.replicas_table(doc["replicas"], colour=colour))
    if "models" in doc:
        parts.append(render.models_table(doc["models"]))
    if r.rejected:
        parts.append(
            "refused by the fold:\n" + "\n".join(f"  seq {q}: {why}" for q, why in r.rejected[-20:])
        )
    if r.skipped:
        parts.append(
            "undecodable, skipped:\n"
            + "\n".join(f"  seq {x.seq} {x.subject}: {x.error}" for x in r.skipped[-20:])
        )
    return "\n\n".join(parts)


async def _rebuild_point(s: Session, point: history.Point, *, snapshots: bool) -> history.Rebuilt:
    bar = render.ProgressBar()
    try:
        return await history.rebuild(
            s.nc, to_seq=point.seq, at=point.time, use_snapshots=snapshots, progress=bar
        )
    finally:
        bar.close()


async def _all_records(s: Session) -> list[bus.Record]:
    out: list[bus.Record] = []
    bar = render.ProgressBar(label="reading")
    total = (await history.bounds(s.nc)).last_seq
    try:
        async for batch in history.records(s.nc):
            out.extend(batch)
            bar(batch[-1].seq, total)
    finally:
        bar.close()
    return out


def _reconcile_config(path: Path | None) -> reconcile.ReconcileConfig:
    if path is None:
        return reconcile.ReconcileConfig()
    from llmgw import config as llmgw_config

    try:
        raw = llmgw_config.read_yaml(path)
    except llmgw_config.ConfigError as exc:
        raise BadInput(str(exc)) from None
    section = raw.get("reconcile", {}) if "reconcile" in raw else raw
    try:
        return msgspec.convert(section or {}, reconcile.ReconcileConfig)
    except msgspec.ValidationError as exc:
        raise BadInput(f"{path}: reconcile settings: {exc}") from None


def replay(
    to: int | None = typer.Option(None, "--to", help="Rebuild up to this sequence."),
    at: str | None = typer.Option(None, "--at", help="Rebuild as of this time (ISO, @UNIX, 10m)."),
    timeline: str | None = typer.Option(
        None, "--timeline", help="Every event that touched this node or replica."
    ),
    diff: tuple[str, str] | None = typer.Option(
        None, "--diff", help="What changed between two points (sequences or times)."
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Re-run today's reconciler at every decision the leader recorded; differences exit 1.",
    ),
    control_config: Path | None = typer.Option(
        None,
        "--control-config",
        help="For --verify: the control plane's config, whose reconcile timings it ran with.",
    ),
    view: str = typer.Option("all", "--view", help="nodes, replicas, models, endpoints or all."),
    snapshots: bool = typer.Option(
        True, "--snapshots/--no-snapshots", help="Start from the newest snapshot before the target."
    ),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """The cluster rebuilt as it was at a point of its history (or its timeline, diff, verify)."""
    modes = sum(x for x in (timeline is not None, diff is not None, verify))
    if modes > 1 or (modes and (to is not None or at is not None)):
        typer.echo("error: use one of --to/--at, --timeline, --diff, --verify", err=True)
        raise typer.Exit(2)
    if view not in ("all", "nodes", "replicas", "models", "endpoints"):
        typer.echo("error: --view is one of nodes, replicas, models, endpoints, all", err=True)
        raise typer.Exit(2)

    async def body(s: Session) -> int:
        colour = _colour()
        if timeline is not None:
            return await _timeline(s, timeline, json_out, colour)
        if diff is not None:
            return await _diff(s, diff, json_out, snapshots)
        if verify:
            return await _verify(
                s, _reconcile_config(control_config), json_out, defaults=control_config is None
            )
        now = time.time()
        point = history.Point(seq=to, time=history.parse_time(at, now) if at else None)
        r = await _rebuild_point(s, point, snapshots=snapshots)
        doc = _state_document(r, view)
        _out(render.json_text(doc) if json_out else _state_text(r, doc, colour))
        return 0

    _run(Conn(config, server, ca, cert, key), body)


async def _timeline(s: Session, target: str, json_out: bool, colour: bool) -> int:
    found: list[bus.Record] = []
    async for batch in history.records(s.nc):
        found.extend(r for r in batch if eventlines.touches(r.event, target, r.subject))
    if not found:
        raise BadInput(
            f"no node or replica {target!r} in the log: see `llmgw ctl nodes` and "
            "`llmgw ctl replicas` for names"
        )
    if json_out:
        _out(render.json_text([_event_json(r) for r in found]))
    else:
        _out("\n".join(_event_line(r, colour) for r in found))
    return 0


async def _diff(s: Session, points: tuple[str, str], json_out: bool, snapshots: bool) -> int:
    now = time.time()
    a, b = (history.parse_point(p, now) for p in points)
    ra = await _rebuild_point(s, a, snapshots=snapshots)
    rb = await _rebuild_point(s, b, snapshots=snapshots)
    found = changes.diff(ra.state, rb.state)
    if json_out:
        _out(
            render.json_text(
                {
                    "from": {"seq": ra.target_seq, "time": ra.at},
                    "to": {"seq": rb.target_seq, "time": rb.at},
                    "changes": found,
                }
            )
        )
    else:

        def where(point: history.Point, r: history.Rebuilt) -> str:
            return f"seq {r.target_seq}" + (f" ({point.describe()})" if point.time else "")

        head = f"from {where(a, ra)} to {where(b, rb)}: {len(found)} change(s)"
        _out("\n".join([head, *(c.render() for c in found)]))
    return 0


async def _verify(
    s: Session, cfg: reconcile.ReconcileConfig, json_out: bool, *, defaults: bool
) -> int:
    log = await _all_records(s)
    pairs = [(r.seq, r.event) for r in log]
    batches = {
        (e.epoch, e.basis_seq)
        for _, e in pairs
        if isinstance(e, events.ControlEvent)
        and not isinstance(e, (events.LeaderElected, *reconcile.OBSERVATIONS))
    }
    differences = control_verify.verify(pairs, config=cfg)
    if json_out:
        _out(
            render.json_text(
                {
                    "events": len(pairs),
                    "decision_batches": len(batches),
                    "differences": differences,
                    "ok": not differences,
                }
            )
        )
    elif differences:
        _out(
            f"{len(differences)} of {len(batches)} recorded decision batches would now be "
            "decided differently:"
        )
        _out("\n".join(f"  {d.detail}" for d in differences))
        if defaults:
            _out(
                "(checked with the default reconcile timings: pass --control-config with the "
                "leader's config file, whose timings also decide)"
            )
    else:
        _out(
            f"verified {len(batches)} recorded decision batches over {len(pairs):,} events: "
            "today's reconciler makes every one of them the same way"
        )
    return 1 if differences else 0


async def _leader_state(url: str) -> dict[str, Any]:
    """GET /v1/state of a control plane's admin API; Failed when it does not answer."""
    import aiohttp  # only `status` talks HTTP: keep it out of every other command's start

    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as http,
            http.get(f"{url.rstrip('/')}/v1/state") as resp,
        ):
            resp.raise_for_status()
            data: dict[str, Any] = await resp.json()
            return data
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        raise Failed(
            f"the control plane's admin API at {url} did not answer: "
            f"{str(exc) or type(exc).__name__}; check --control (its `admin` listener, "
            "http://127.0.0.1:9190 by default, is only reachable from its own host)"
        ) from None


def status(
    control: str | None = typer.Option(
        None, "--control", help="A control plane's admin API, e.g. http://127.0.0.1:9190."
    ),
    json_out: bool = JSON,
    config: Path | None = CONFIG,
    server: list[str] | None = SERVER,
    ca: str | None = CA,
    cert: str | None = CERT,
    key: str | None = KEY,
) -> None:
    """The log at a glance, and whether a control plane folded it to the same state as ctl."""

    async def body(s: Session) -> int:
        r = await _current(s)
        doc: dict[str, Any] = {
            "seq": r.target_seq,
            "first_seq": r.bounds.first_seq,
            "messages": r.bounds.messages,
            "digest": state.digest(r.state),
            "leader": r.state.leader,
            "epoch": r.state.epoch,
            "nodes": len(r.state.nodes),
            "replicas": len(r.state.active_replicas()),
            "models": len(r.state.models),
            "endpoints": len(r.state.endpoints),
            "snapshot_seq": r.snapshot_seq,
            "refused": len(r.rejected),
            "undecodable": len(r.skipped),
            "control": None,
        }
        code = 0
        if s.cfg.control_url:
            svc = await _leader_state(s.cfg.control_url)
            folded = int(svc.get("folded_seq", 0))
            mine = r if folded == r.target_seq else await history.rebuild(s.nc, to_seq=folded)
            agree = state.digest(mine.state) == svc.get("digest")
            doc["control"] = {
                "url": s.cfg.control_url,
                "instance": svc.get("instance"),
                "leading": svc.get("leading"),
                "folded_seq": folded,
                "lag": max(0, r.target_seq - folded),
                "digest": svc.get("digest"),
                "digest_agrees": agree,
            }
            code = 0 if agree else 1
        if json_out:
            _out(render.json_text(doc))
            return code
        _out(
            f"log: seq {doc['first_seq']}-{doc['seq']} ({doc['messages']:,} messages); "
            f"leader {doc['leader'] or '-'} (epoch {doc['epoch']}); {doc['nodes']} nodes, "
            f"{doc['models']} models, {doc['replicas']} replicas, {doc['endpoints']} endpoints"
        )
        _out(render.rebuilt_header(r))
        c = doc["control"]
        if c is not None:
            role = "leading" if c["leading"] else "standby"
            verdict = (
                "same state as this fold"
                if c["digest_agrees"]
                else f"DIFFERENT state: digest {str(c['digest'])[:12]}, this fold "
                f"{state.digest(mine.state)[:12]} at seq {c['folded_seq']}"
            )
            _out(
                f"control plane {c['instance']} ({role}) at seq {c['folded_seq']} "
                f"(lag {c['lag']}): {verdict}"
            )
        return code

    _run(Conn(config, server, ca, cert, key, control), body)


def register(app: typer.Typer) -> None:
    """Add the fleet commands to the `llmgw ctl` group."""
    app.command("nodes")(nodes)
    app.command("replicas")(replicas)
    app.command("models")(models)
    app.command("apply")(apply)
    app.command("explain-placement")(explain_placement)
    app.command("cordon")(cordon)
    app.command("uncordon")(uncordon)
    app.command("drain")(drain)
    app.command("events")(events_cmd)
    app.command("replay")(replay)
    app.command("status")(status)
