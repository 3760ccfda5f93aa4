"""`llmgw ctl explain-scaling` and `llmgw ctl scale`: see and steer the autoscaler."""

from __future__ import annotations

import time
from pathlib import Path

import typer

from llmgw import bus
from llmgw.bus import signals as signals_
from llmgw.cli import ctl_common as common
from llmgw.core import events, loadreport, subjects
from llmgw.ctl import render
from llmgw.ctl import scaling as scaling_view
from llmgw.ctl.errors import BadInput
from llmgw.ctl.session import Session


async def _reports(s: Session) -> dict[str, loadreport.LoadReport]:
    """Each router process's and node agent's latest load report of the last seconds by its
    subject, as the leader holds them (none where the stream is absent)."""
    latest: dict[str, loadreport.LoadReport] = {}
    try:
        reader = signals_.SignalsReader(s.nc, follow=False, name="ctl-signals")
        async with reader:
            async for batch in reader.batches():
                for r in batch:
                    report = signals_.report_of(r)
                    if loadreport.supersedes(report, latest.get(r.subject)):
                        latest[r.subject] = report
    except bus.ReaderError:
        return {}
    return latest


async def _decisions(s: Session, model: str) -> list[events.ScaleDecided]:
    subject = subjects.control_event("scale_decided")
    reader = bus.Reader(s.nc, subjects_filter=(subject,), follow=False, name="ctl-scaling")
    found: list[events.ScaleDecided] = []
    async with reader:
        async for batch in reader.batches():
            found.extend(
                r.event
                for r in batch
                if isinstance(r.event, events.ScaleDecided) and r.event.model == model
            )
    return found


def explain_scaling(
    model: str = typer.Argument(..., help="An autoscaled model."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """MODEL's signals now, its targets, what the autoscaler will do next and why, and its
    last scaling decisions."""

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        common.require_model(r.state, model)
        reports = await _reports(s)
        decided = await _decisions(s, model)
        try:
            doc = scaling_view.explain(r.state, model, reports, decided, time.time())
        except ValueError as exc:
            raise BadInput(str(exc)) from None
        common.out(render.json_text(doc) if json_out else scaling_view.render(doc))

    common.run(common.Conn(config, server, ca, cert, key), body)


def scale(
    model: str = typer.Argument(..., help="An autoscaled model."),
    replicas: int | None = typer.Option(
        None, "--replicas", help="Pin MODEL at this many replicas: the autoscaler waits."
    ),
    release: bool = typer.Option(False, "--release", help="Give MODEL back to its autoscaler."),
    reason: str = typer.Option("", "--reason", help="Recorded in the log with the pin."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Pin an autoscaled MODEL's replica count by hand (--replicas N), or release it."""
    if (replicas is None) == (not release):
        raise typer.BadParameter("give --replicas N to pin, or --release to release")
    if replicas is not None and replicas < 0:
        raise typer.BadParameter("--replicas must be 0 or more")

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        common.require_model(r.state, model)
        who, at = s.identity.name, s.now()
        ev: events.Event = (
            events.ScaleReleased(id=s.new_id(), ts=at, operator=who, model=model)
            if release
            else events.ScalePinned(
                id=s.new_id(),
                ts=at,
                operator=who,
                model=model,
                replicas=replicas or 0,
                reason=reason,
            )
        )
        (pub,) = await common.publish_checked(s, r.state, [ev])
        what = "released to its autoscaler" if release else f"pinned at {replicas} replicas"
        common.out(
            render.json_text(pub)
            if json_out
            else f"{model} {what} by {s.identity} (seq {pub['seq']})"
        )

    common.run(common.Conn(config, server, ca, cert, key), body)


def register(app: typer.Typer) -> None:
    app.command("explain-scaling")(explain_scaling)
    app.command("scale")(scale)
