"""`llmgw ctl` fleet commands: see the fleet and change it.

nodes, replicas, models, explain-placement read the state by folding the log here
(newest snapshot + tail, `llmgw.ctl.history`); apply, cordon, uncordon and drain
publish operator events carrying the identity of the certificate, then fold up to
them so that an event the fold refuses is reported too. The log's own tools (events,
replay, status) are in llmgw.cli.ctl_history and llmgw.cli.ctl_status.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from pathlib import Path
from typing import Any

import typer

from llmgw import bus, wording
from llmgw.cli import ctl_common as common
from llmgw.core import events, limits, placement, state, views
from llmgw.core.profile import ModelProfile
from llmgw.ctl import catalogfile, operations, render
from llmgw.ctl.errors import BadInput, Failed
from llmgw.ctl.session import Session

# --------------------------------------------------------------------------- views


def nodes(
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Nodes: lifecycle, GPUs by class (free/used/unhealthy, why), fabrics, flags, heartbeat."""

    async def body(s: Session) -> None:
        r = await common.current(s)
        rows = views.node_rows(r.state, time.time())
        common.out(
            render.json_text(rows) if json_out else render.nodes_table(rows, colour=common.colour())
        )

    common.run(common.Conn(config, server, ca, cert, key), body)


def replicas(
    model: str | None = typer.Option(None, "--model", "-m", help="Only this model's replicas."),
    log_lines: int = typer.Option(5, "--log-lines", help="Engine log lines shown per shard."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Replicas: shards, nodes and GPUs, phases, per-shard errors and engine log tails."""

    async def body(s: Session) -> None:
        r = await common.current(s)
        if model is not None and not any(x.model == model for x in r.state.replicas.values()):
            common.require_model(r.state, model)
        rows = views.replica_rows(r.state, model)
        if json_out:
            common.out(render.json_text(rows))
        else:
            common.out(render.replicas_table(rows, colour=common.colour(), log_lines=log_lines))

    common.run(common.Conn(config, server, ca, cert, key), body)


def models(
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Declared models: replicas serving / active / wanted, and why any cannot be placed."""

    async def body(s: Session) -> None:
        r = await common.current(s)
        rows = views.model_rows(r.state, time.time())
        common.out(render.json_text(rows) if json_out else render.models_table(rows))

    common.run(common.Conn(config, server, ca, cert, key), body)


def explain_placement(
    model: str = typer.Argument(..., help="A declared model."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Every candidate node for a new replica of MODEL: why it is rejected, or where it lands."""

    async def body(s: Session) -> None:
        r = await common.current(s)
        common.require_model(r.state, model)
        ex = placement.explain(r.state, model, time.time())
        if json_out:
            common.out(render.json_text(ex))
        else:
            common.out(ex.render())

    common.run(common.Conn(config, server, ca, cert, key), body)


# --------------------------------------------------------------------------- mutations


def apply(
    file: Path = typer.Option(..., "--file", "-f", help="models.yaml: the desired catalog."),
    yes: bool = typer.Option(False, "--yes", "-y", help="Apply without asking."),
    prune: bool = typer.Option(
        True, "--prune/--no-prune", help="Remove declared models the file does not list."
    ),
    allow_empty: bool = typer.Option(
        False,
        "--allow-empty",
        help="Let a file that lists no models remove every declared model (with pruning).",
    ),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Declare, change or remove models to match a models.yaml; shows the diff first."""
    wanted = _wanted_models(file, prune=prune, allow_empty=allow_empty)

    async def body(s: Session) -> int:
        r = await common.current(s)
        ops = catalogfile.plan(r.state.models, wanted, prune=prune)
        if not ops:
            if json_out:
                common.out(render.json_text({"operations": [], "published": []}))
            else:
                common.out(f"{file}: the declared models already match; nothing to do")
            return 0
        if not json_out:
            common.out("\n".join(op.render() for op in ops))
        if not yes:
            if not sys.stdin.isatty():
                raise BadInput("not on a terminal, so not asking: pass --yes to apply")
            if not typer.confirm(f"apply {wording.count(len(ops), 'change')}?", default=False):
                common.out("nothing applied")
                return 1
        published = await common.publish_checked(s, r.state, _catalog_events(s, ops))
        if json_out:
            common.out(render.json_text({"operations": ops, "published": published}))
        else:
            common.out(
                f"applied {wording.count(len(published), 'change')} as {s.identity} (seq "
                f"{published[0]['seq']}-{published[-1]['seq']})"
            )
        return 0

    common.run(common.Conn(config, server, ca, cert, key), body)


def _wanted_models(file: Path, *, prune: bool, allow_empty: bool) -> list[ModelProfile]:
    """The models a models.yaml lists; exit 2 for a file that is unreadable, invalid, or
    empty where applying it would remove every declared model."""
    try:
        wanted = catalogfile.read(file)
    except BadInput as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(2) from None
    if prune and not wanted and not allow_empty:
        # An empty file is more often a truncated or wrong one than a wish to stop serving:
        # --yes alone must not remove the whole catalog.
        typer.echo(
            f"error: {file} lists no models, so applying it would remove every declared model:"
            " pass --allow-empty if that is what you want, or --no-prune to remove nothing",
            err=True,
        )
        raise typer.Exit(2)
    return wanted


def _catalog_events(s: Session, ops: list[catalogfile.ModelOp]) -> list[events.Event]:
    """The operator events that carry out a catalog plan, as this operator, now."""
    batch: list[events.Event] = []
    for op in ops:
        fields: dict[str, Any] = {"id": s.new_id(), "ts": s.now(), "operator": s.identity.name}
        if op.action == "remove":
            batch.append(events.ModelRemoved(name=op.name, **fields))
        elif op.action == "declare":
            assert op.profile is not None
            batch.append(events.ModelDeclared(profile=op.profile, **fields))
        else:
            assert op.profile is not None
            batch.append(events.ModelChanged(profile=op.profile, **fields))
    return batch


def cordon(
    node: str = typer.Argument(...),
    reason: str = typer.Option("", "--reason", help="Recorded in the log and shown by nodes."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Stop placing new replicas on NODE (what runs there keeps running)."""

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        common.require_node(r.state, node)
        ev = events.NodeCordoned(
            id=s.new_id(), ts=s.now(), operator=s.identity.name, node=node, reason=reason
        )
        (pub,) = await common.publish_checked(s, r.state, [ev])
        common.out(
            render.json_text(pub)
            if json_out
            else f"{node} cordoned by {s.identity} (seq {pub['seq']})"
        )

    common.run(common.Conn(config, server, ca, cert, key), body)


def uncordon(
    node: str = typer.Argument(...),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Let NODE receive new replicas again (also ends a drain)."""

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        common.require_node(r.state, node)
        ev = events.NodeUncordoned(id=s.new_id(), ts=s.now(), operator=s.identity.name, node=node)
        (pub,) = await common.publish_checked(s, r.state, [ev])
        common.out(
            render.json_text(pub)
            if json_out
            else f"{node} uncordoned by {s.identity} (seq {pub['seq']})"
        )

    common.run(common.Conn(config, server, ca, cert, key), body)


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
        # One pending read, kept across quiet seconds: cancelling a read on a timeout
        # (asyncio.wait_for) would end the generator, and the next read would raise
        # StopAsyncIteration although the log goes on.
        pending: asyncio.Future[list[bus.Record]] | None = None
        try:
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
                if pending is None:
                    pending = asyncio.ensure_future(batches.__anext__())
                # Wake at least once a second: the grace period ends on the clock.
                done, _ = await asyncio.wait({pending}, timeout=min(left, 1.0))
                if not done:
                    continue
                got, pending = pending, None
                try:
                    batch = got.result()
                except StopAsyncIteration:
                    raise Failed(
                        f"the log stopped being readable while following the drain of {node} "
                        f"({line}); follow it with `llmgw ctl replicas`"
                    ) from None
                for rec in batch:
                    state.apply(st, rec.event, rec.seq, rec.time)
        finally:
            if pending is not None:
                pending.cancel()
                with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                    await pending


def drain(
    node: str = typer.Argument(...),
    grace: float = typer.Option(
        600.0, "--grace", help="Seconds after which its replicas stop even without a replacement."
    ),
    reason: str = typer.Option(
        "", "--reason", help="Why: recorded in the log with the drain, shown by nodes."
    ),
    wait: bool = typer.Option(False, "--wait", help="Follow the drain to its end, with progress."),
    timeout: float | None = typer.Option(
        None, "--timeout", help="Give up waiting after this many seconds (default: grace + 120)."
    ),
    dry_run: bool = typer.Option(False, "--dry-run", help="Only show what would move where."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Move every replica off NODE (rolling: replacement serving first), then keep it empty."""
    _check_drain_flags(grace, timeout)

    async def body(s: Session) -> int:
        r = await common.current(s, progress=False)
        common.require_node(r.state, node)
        moves = operations.drain_plan(r.state, node, time.time())
        originals = [m.replica for m in moves]
        if not json_out:
            common.out(_moves_text(node, moves))
        if dry_run:
            if json_out:
                common.out(render.json_text({"node": node, "moves": moves, "published": None}))
            return 0
        pub = await _request_drain(s, r.state, node, grace, reason)
        if not json_out:
            common.out(f"drain of {node} requested by {s.identity} (seq {pub['seq']})")
        result: operations.DrainProgress | None = None
        if wait:
            limit = timeout if timeout is not None else grace + 120.0
            result = await _follow_drain(s, r.state, node, originals, limit)
            if not json_out:
                common.out(result.render() + (": done" if result.done else ""))
        if json_out:
            common.out(
                render.json_text(
                    {"node": node, "moves": moves, "published": pub, "progress": result}
                )
            )
        return 0

    common.run(common.Conn(config, server, ca, cert, key), body)


def _check_drain_flags(grace: float, timeout: float | None) -> None:
    """Exit 2, before connecting, for a grace or timeout out of range (NaN too: a NaN
    timeout made the wait spin)."""
    if not 0 <= grace <= limits.MAX_SECONDS:
        problem = f"--grace must be 0 to {limits.MAX_SECONDS:.0f} seconds (about 115 days)"
    elif timeout is not None and not 0 < timeout <= limits.MAX_SECONDS:
        problem = f"--timeout must be above 0 and at most {limits.MAX_SECONDS:.0f} seconds"
    else:
        return
    typer.echo(f"error: {problem}", err=True)
    raise typer.Exit(2)


async def _request_drain(
    s: Session, st: state.ClusterState, node: str, grace: float, reason: str
) -> dict[str, Any]:
    """Publish NodeDrainRequested as this operator; what `publish_checked` says of it."""
    ev = events.NodeDrainRequested(
        id=s.new_id(),
        ts=s.now(),
        operator=s.identity.name,
        node=node,
        grace_s=grace,
        reason=reason,
    )
    (pub,) = await common.publish_checked(s, st, [ev])
    return pub


def _moves_text(node: str, moves: list[operations.Move]) -> str:
    head = (
        f"draining {node} moves {len(moves)} replica(s):"
        if moves
        else f"{node} runs no replicas: nothing moves"
    )
    return "\n".join([head, *(m.render() for m in moves)])


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
