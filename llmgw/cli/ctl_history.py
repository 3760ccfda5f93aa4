"""`llmgw ctl` history commands: the log decoded, the cluster at any past point, and checks.

`events` prints the log one line per event (or JSON lines), following it with
`--follow`; `replay` rebuilds the state at a sequence or a time and shows it with
the same views as `nodes` / `replicas`, lists a node's or replica's `--timeline`,
`--diff`s two points, and `--verify`s that today's reconciler makes every decision
the leader recorded (llmgw.control.verify). `replay --verify` exits 1 when it finds
differences. `status` is llmgw.cli.ctl_status.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import typer

from llmgw import bus, wording
from llmgw.cli import ctl_common as common
from llmgw.control import verify as control_verify
from llmgw.core import events, reconcile, state, views
from llmgw.ctl import changes, eventlines, history, render
from llmgw.ctl.errors import BadInput
from llmgw.ctl.session import Session

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


_MAX_SEQ = 2**64 - 1
"""A JetStream stream's sequences are 64-bit."""


def events_cmd(
    follow: bool = typer.Option(False, "--follow", "-f", help="Keep printing new events."),
    since: str | None = typer.Option(
        None, "--since", help="From this time (ISO, 03:12 UTC, @UNIX, 10m)."
    ),
    seq: int | None = typer.Option(None, "--seq", help="From this sequence number."),
    node: str | None = typer.Option(None, "--node", help="Only events about this node."),
    type_: str | None = typer.Option(
        None, "--type", "-t", help="Only this type: node.shard, a family (operator), or shard."
    ),
    json_out: bool = typer.Option(False, "--json", help="One JSON object per line."),
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """The log decoded, one line per event (coloured on a terminal)."""
    if since is not None and seq is not None:
        typer.echo("error: give --since or --seq, not both", err=True)
        raise typer.Exit(2)
    if seq is not None and seq < 1:
        typer.echo("error: --seq counts from 1", err=True)
        raise typer.Exit(2)
    if seq is not None and seq > _MAX_SEQ:
        # The server refuses it as JSON it cannot read, which ctl reported as a stream to
        # provision.
        typer.echo(f"error: --seq {seq} is beyond any log: it is at most {_MAX_SEQ}", err=True)
        raise typer.Exit(2)
    if type_ is not None and not any(eventlines.matches_tag(t, type_) for t in events.BY_TAG):
        tags = ", ".join(sorted(events.BY_TAG))
        typer.echo(f"error: no event type matches {type_!r}: use one of {tags}", err=True)
        raise typer.Exit(2)

    async def body(s: Session) -> None:
        start = history.parse_time(since, time.time()) if since is not None else None
        colour = common.colour()
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
                common.out("\n".join(lines))

    common.run(common.Conn(config, server, ca, cert, key), body)


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
    if "heartbeats_expired_before" in doc:
        horizon = doc["heartbeats_expired_before"]
        since = f"before {history.format_time(horizon)} " if horizon is not None else ""
        parts.append(
            f"heartbeats {since}have expired from the log (per-message TTL): the heartbeat "
            "ages of that moment are unknown"
        )
    if "nodes" in doc:
        parts.append(render.nodes_table(doc["nodes"], colour=colour))
    if "replicas" in doc:
        parts.append(render.replicas_table(doc["replicas"], colour=colour))
    if "models" in doc:
        parts.append(render.models_table(doc["models"]))
    # Both quote what a node wrote: the fold's reasons name its fields, and a message
    # that is no event has its subject and the decoder's words on it.
    if r.rejected:
        parts.append(
            "refused by the fold:\n"
            + "\n".join(f"  seq {q}: {eventlines.clean(why)}" for q, why in r.rejected[-20:])
        )
    if r.skipped:
        parts.append(
            "undecodable, skipped:\n"
            + "\n".join(
                f"  seq {x.seq} {eventlines.clean(f'{x.subject}: {x.error}')}"
                for x in r.skipped[-20:]
            )
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
    at: str | None = typer.Option(
        None, "--at", help="Rebuild as of this time (ISO, 03:12 UTC, @UNIX, 10m)."
    ),
    timeline: str | None = typer.Option(
        None,
        "--timeline",
        help="Every event that touched this node, replica or model (its scaling included).",
    ),
    diff: tuple[str, str] | None = typer.Option(
        None, "--diff", help="What changed between two points (sequences or times)."
    ),
    verify: bool = typer.Option(
        False,
        "--verify",
        help="Re-run today's reconciler at every decision the leader recorded, with the timings "
        "it recorded; differences exit 1.",
    ),
    control_config: Path | None = typer.Option(
        None,
        "--control-config",
        help="For --verify of a log from an older llmgw, whose leaders recorded no reconcile "
        "timings: the control plane's config (newer leaders record theirs in the log).",
    ),
    view: str = typer.Option("all", "--view", help="nodes, replicas, models, endpoints or all."),
    snapshots: bool = typer.Option(
        True, "--snapshots/--no-snapshots", help="Start from the newest snapshot before the target."
    ),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
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
        colour = common.colour()
        if timeline is not None:
            return await _timeline(s, timeline, json_out, colour)
        if diff is not None:
            return await _diff(s, diff, json_out, snapshots)
        if verify:
            return await _verify(
                s, _reconcile_config(control_config), json_out, fallback_from=control_config
            )
        point = history.Point(seq=to, time=history.parse_time(at, time.time()) if at else None)
        return await _show_state(s, point, view, snapshots=snapshots, json_out=json_out)

    common.run(common.Conn(config, server, ca, cert, key), body)


async def _show_state(
    s: Session, point: history.Point, view: str, *, snapshots: bool, json_out: bool
) -> int:
    r = await _rebuild_point(s, point, snapshots=snapshots)
    doc = _state_document(r, view)
    if "nodes" in doc and r.target_seq < r.bounds.last_seq:
        # A past moment: its heartbeats may have expired from the log since.
        horizon = await history.oldest_heartbeat(s.nc, r.bounds.first_seq)
        if history.without_expired_heartbeats(doc["nodes"], horizon):
            doc["heartbeats_expired_before"] = horizon
    common.out(render.json_text(doc) if json_out else _state_text(r, doc, common.colour()))
    return 0


async def _timeline(s: Session, target: str, json_out: bool, colour: bool) -> int:
    found: list[bus.Record] = []
    timeline = eventlines.Timeline(target)
    async for batch in history.records(s.nc):
        found.extend(r for r in batch if timeline.touches(r.event, r.subject))
    if not found:
        raise BadInput(
            f"no node, replica or model {target!r} in the log: see `llmgw ctl nodes`, "
            "`llmgw ctl replicas` and `llmgw ctl models` for names"
        )
    if json_out:
        common.out(render.json_text([_event_json(r) for r in found]))
    else:
        common.out("\n".join(_event_line(r, colour) for r in found))
    return 0


async def _diff(s: Session, points: tuple[str, str], json_out: bool, snapshots: bool) -> int:
    now = time.time()
    a, b = (history.parse_point(p, now) for p in points)
    ra = await _rebuild_point(s, a, snapshots=snapshots)
    rb = await _rebuild_point(s, b, snapshots=snapshots)
    found = changes.diff(ra.state, rb.state)
    if json_out:
        common.out(
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

        head = f"from {where(a, ra)} to {where(b, rb)}: {wording.count(len(found), 'change')}"
        common.out("\n".join([head, *(c.render() for c in found)]))
    return 0


async def _verify(
    s: Session, fallback: reconcile.ReconcileConfig, json_out: bool, *, fallback_from: Path | None
) -> int:
    log = await _all_records(s)
    pairs = [(r.seq, r.event) for r in log]
    batches = {
        (e.epoch, e.basis_seq)
        for _, e in pairs
        if isinstance(e, events.ControlEvent)
        and not isinstance(e, (events.LeaderElected, *reconcile.OBSERVATIONS))
    }
    scalings = sum(1 for _, e in pairs if isinstance(e, events.ScaleDecided))
    timings = control_verify.recorded_timings(pairs)
    differences = control_verify.verify(pairs, config=fallback)
    source = str(fallback_from) if fallback_from is not None else "the defaults"
    if json_out:
        doc = {
            "events": len(pairs),
            "decision_batches": len(batches),
            "scaling_decisions": scalings,
            "timings": {
                "recorded_epochs": sorted(timings.by_epoch),
                "unrecorded_epochs": list(timings.unrecorded),
                "unrecorded_from": source if timings.unrecorded else None,
            },
            "differences": differences,
            "ok": not differences,
        }
        common.out(render.json_text(doc))
    else:
        common.out(_verdict(len(pairs), len(batches), differences, scalings))
        for line in _timings_notes(timings, source, fallback_from):
            common.out(line)
    return 1 if differences else 0


def _verdict(
    events_n: int, batches: int, differences: list[control_verify.Difference], scalings: int = 0
) -> str:
    if not differences:
        scaled = f" and {wording.count(scalings, 'scaling decision')}" if scalings else ""
        return (
            f"verified {batches} recorded decision batches{scaled} over {events_n:,} events: "
            "today's reconciler makes every one of them the same way"
        )
    return "\n".join(
        [
            f"{len(differences)} of {batches} recorded decision batches would now be "
            "decided differently:",
            # A decision's JSON quotes what nodes wrote (their names, endpoints' URLs),
            # which msgspec leaves raw but for C0.
            *(f"  {eventlines.clean(d.detail)}" for d in differences),
        ]
    )


def _timings_notes(
    timings: control_verify.Timings, source: str, fallback_from: Path | None
) -> list[str]:
    """Which reconcile timings the check used: those the leaders recorded, or `source`."""
    notes = []
    if timings.by_epoch:
        notes.append(
            "with the reconcile timings each leader recorded in the log (epochs "
            f"{_epochs(sorted(timings.by_epoch))})"
            + (
                " (--control-config applies only to epochs that recorded none)"
                if fallback_from is not None and not timings.unrecorded
                else ""
            )
        )
    if timings.unrecorded:
        hint = (
            ""
            if fallback_from is not None
            else ": pass --control-config with that leader's config file if its timings differ"
        )
        notes.append(
            f"epochs {_epochs(list(timings.unrecorded))} recorded no timings (a log from an "
            f"older llmgw): checked with {source}{hint}"
        )
    return notes


def _epochs(epochs: list[int]) -> str:
    return ", ".join(str(e) for e in epochs[:10]) + (" ..." if len(epochs) > 10 else "")


def register(app: typer.Typer) -> None:
    """Add the history commands to the `llmgw ctl` group."""
    app.command("events")(events_cmd)
    app.command("replay")(replay)
