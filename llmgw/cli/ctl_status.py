"""`llmgw ctl status`: the log at a glance, who leads, and whether a control plane folded
the log to the same state as ctl (the one question ctl asks the service, through its
admin API). Exits 1 when the digests differ.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec
import typer

from llmgw import wording
from llmgw.cli import ctl_common as common
from llmgw.core import events, state
from llmgw.ctl import history, render
from llmgw.ctl.errors import Failed
from llmgw.ctl.leadership import LeaseSeen, leader_status
from llmgw.ctl.session import Session


async def _read_lease(s: Session) -> LeaseSeen | None:
    """The lease key's last write, or None when there is none (never taken, or expired)."""
    import nats.errors
    import nats.js.errors

    from llmgw.bus import lease as lease_
    from llmgw.bus.provisioning import LEASE_BUCKET

    try:
        # Not a direct get: the bucket is created without allow_direct.
        msg = await s.js.get_msg(f"KV_{LEASE_BUCKET}", subject=f"$KV.{LEASE_BUCKET}.{lease_.KEY}")
    except nats.js.errors.NotFoundError:
        return None
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
        raise Failed(
            f"cannot read the leader lease ({LEASE_BUCKET}): {str(exc) or type(exc).__name__}"
        ) from None
    headers = msg.headers or {}
    seen = LeaseSeen(written=msg.time.timestamp() if msg.time is not None else None)
    ttl = str(headers.get("Nats-TTL", "")).strip()
    if ttl.endswith("s") and ttl[:-1].isdigit():
        seen.ttl_s = float(ttl[:-1])
    if headers.get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
        seen.released = True
        return seen
    try:
        value = msgspec.json.decode(msg.data)
    except msgspec.DecodeError:
        return seen
    if isinstance(value, dict):
        seen.holder = str(value.get("holder", ""))[:256]
        epoch = value.get("epoch")
        seen.epoch = epoch if isinstance(epoch, int) and epoch > 0 else int(msg.seq or 0)
    return seen


async def _last_elected_at(s: Session, epoch: int) -> float | None:
    """Producer time of the log's last LeaderElected, if it is the one of `epoch`."""
    import nats.errors
    import nats.js.errors

    from llmgw.core import subjects

    try:
        msg = await s.js.get_msg(
            subjects.STREAM, subject=subjects.control_event("leader_elected"), direct=True
        )
        event = events.decode(msg.data or b"")
    except (nats.errors.Error, nats.js.errors.Error, TimeoutError, events.DecodeError):
        return None
    if isinstance(event, events.LeaderElected) and event.epoch == epoch:
        return float(event.ts)
    return None


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
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """The log at a glance, and whether a control plane folded it to the same state as ctl."""

    async def body(s: Session) -> int:
        r = await common.current(s)
        lease = await _read_lease(s)
        elected_at = await _last_elected_at(s, r.state.epoch) if r.state.leader else None
        leading = leader_status(
            lease,
            leader=r.state.leader,
            epoch=r.state.epoch,
            elected_at=elected_at,
            now=time.time(),
        )
        doc = _status_document(r, lease, leading)
        code = 0
        mine = r
        if s.cfg.control_url:
            doc["control"], mine = await _compare_with_control(s, s.cfg.control_url, r)
            code = 0 if doc["control"]["digest_agrees"] else 1
        if json_out:
            common.out(render.json_text(doc))
        else:
            common.out(_status_text(doc, r, mine, leading["text"]))
        return code

    common.run(common.Conn(config, server, ca, cert, key, control), body)


def _status_document(
    r: history.Rebuilt, lease: LeaseSeen | None, leading: dict[str, Any]
) -> dict[str, Any]:
    """What `status --json` prints, but for the control plane's side (`control`)."""
    return {
        "seq": r.target_seq,
        "first_seq": r.bounds.first_seq,
        "messages": r.bounds.messages,
        "digest": state.digest(r.state),
        "leader": r.state.leader,
        "epoch": r.state.epoch,
        "leader_state": leading["state"],
        "leader_since": leading["since"],
        "lease": None if lease is None else msgspec.to_builtins(lease),
        "nodes": len(r.state.nodes),
        "replicas": len(r.state.active_replicas()),
        "models": len(r.state.models),
        "endpoints": len(r.state.endpoints),
        "snapshot_seq": r.snapshot_seq,
        "refused": len(r.rejected),
        "undecodable": len(r.skipped),
        "control": None,
    }


async def _compare_with_control(
    s: Session, url: str, r: history.Rebuilt
) -> tuple[dict[str, Any], history.Rebuilt]:
    """The control plane's fold against ctl's at the same sequence, and ctl's fold there."""
    svc = await _leader_state(url)
    folded = int(svc.get("folded_seq", 0))
    mine = r if folded == r.target_seq else await history.rebuild(s.nc, to_seq=folded)
    control = {
        "url": url,
        "instance": svc.get("instance"),
        "leading": svc.get("leading"),
        "folded_seq": folded,
        "lag": max(0, r.target_seq - folded),
        "digest": svc.get("digest"),
        "digest_agrees": state.digest(mine.state) == svc.get("digest"),
    }
    return control, mine


def _status_text(
    doc: dict[str, Any], r: history.Rebuilt, mine: history.Rebuilt, leading: str
) -> str:
    lines = [
        f"log: seq {doc['first_seq']}-{doc['seq']} "
        f"({wording.count(doc['messages'], 'message')}); "
        + ", ".join(
            wording.count(doc[k], k[:-1]) for k in ("nodes", "models", "replicas", "endpoints")
        ),
        leading,
        render.rebuilt_header(r),
    ]
    c = doc["control"]
    if c is not None:
        role = "leading" if c["leading"] else "standby"
        verdict = (
            "same state as this fold"
            if c["digest_agrees"]
            else f"DIFFERENT state: digest {str(c['digest'])[:12]}, this fold "
            f"{state.digest(mine.state)[:12]} at seq {c['folded_seq']}"
        )
        lines.append(
            f"control plane {c['instance']} ({role}) at seq {c['folded_seq']} "
            f"(lag {c['lag']}): {verdict}"
        )
    return "\n".join(lines)


def register(app: typer.Typer) -> None:
    """Add `status` to the `llmgw ctl` group."""
    app.command("status")(status)
