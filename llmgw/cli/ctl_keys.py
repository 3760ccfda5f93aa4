"""`llmgw ctl key`: tenants' API keys as operator events.

`create` and `rotate` print the new secret once; the log holds only its SHA-256 and the
key's settings, and every router that follows the log admits by them within a second
(llmgw.router.feed). Flags are checked before anything connects (exit 2 with what to
write instead); the fold's refusal (a name taken, an unknown key) is exit 2 too.
"""

from __future__ import annotations

from pathlib import Path

import typer

from llmgw.bus import counters
from llmgw.cli import ctl_common as common
from llmgw.core import events, subjects
from llmgw.core.state import ClusterState
from llmgw.ctl import keys as keys_view
from llmgw.ctl import render
from llmgw.ctl import usage as usage_view
from llmgw.ctl.errors import BadInput, Failed
from llmgw.ctl.session import Session
from llmgw.router import auth

app = typer.Typer(
    help="Tenants' API keys: create, list, show, update, rotate, revoke.",
    no_args_is_help=True,
)

TEAM = typer.Option(None, "--team", help="The team it bills to (metrics and usage group by it).")
MODELS = typer.Option(
    None, "--model", "-m", help="A model (or alias) it may use; repeat. Default: every model."
)
RPS = typer.Option(None, "--rps", help="Requests per second, fleet-wide (0: no limit).")
TPM = typer.Option(None, "--tpm", help="Tokens per minute, fleet-wide (0: no limit).")
BUDGET = typer.Option(
    None, "--budget-tokens", help="Tokens per day or month, e.g. 2M/day (0: no budget)."
)
EXPIRES = typer.Option(
    None, "--expires", help="A date (2027-01-31), date-time, +30d, or never (the default)."
)
PRIORITY = typer.Option(None, "--priority", help="high, normal or low: its class in queues.")


def _flags(
    team: str | None,
    models: list[str] | None,
    rps: str | None,
    tpm: str | None,
    budget: str | None,
    expires: str | None,
    priority: str | None,
) -> keys_view.Flags:
    return keys_view.Flags(
        team=team,
        models=tuple(models) if models else None,
        rps=rps,
        tpm=tpm,
        budget=budget,
        expires=expires,
        priority=priority,
    )


def _bad(exc: BadInput) -> typer.Exit:
    typer.echo(f"error: {exc}", err=True)
    return typer.Exit(2)


async def _publish(s: Session, ev: events.Event) -> tuple[dict[str, object], ClusterState]:
    """Publish `ev`; what was published, and the state folded up to it (the key as it is
    now: a state read before the publish still has it as it was)."""
    r = await common.current(s, progress=False)
    try:
        (pub,) = await common.publish_checked(s, r.state, [ev])
    except Failed as exc:
        # The fold refused it (a taken name, an unknown key): the operator's to fix.
        raise BadInput(str(exc)) from None
    return pub, r.state


@app.command("create")
def create(
    name: str = typer.Option(..., "--name", help="Its name: letters, digits, '_' or '-'."),
    team: str | None = TEAM,
    models: list[str] | None = MODELS,
    rps: str | None = RPS,
    tpm: str | None = TPM,
    budget: str | None = BUDGET,
    expires: str | None = EXPIRES,
    priority: str | None = PRIORITY,
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Make a key; print its secret once (the log keeps only its digest)."""
    try:
        settings = keys_view.settings(
            name, _flags(team, models, rps, tpm, budget, expires, priority), Session.now()
        )
    except BadInput as exc:
        raise _bad(exc) from None
    secret = auth.new_key()

    async def body(s: Session) -> None:
        ev = events.KeyCreated(
            id=s.new_id(), ts=s.now(), operator=s.identity.name, key=settings,
            sha256=auth.digest(secret),
        )  # fmt: skip
        pub, _ = await _publish(s, ev)
        if json_out:
            common.out(render.json_text({"name": name, "key": secret, "seq": pub["seq"]}))
        else:
            common.out(secret)
            typer.echo(
                f"key {name} created by {s.identity} (seq {pub['seq']}): the line above is"
                " its secret, shown only now",
                err=True,
            )

    common.run(common.Conn(config, server, ca, cert, key), body)


@app.command("update")
def update(
    name: str = typer.Argument(..., help="The key."),
    team: str | None = TEAM,
    models: list[str] | None = MODELS,
    rps: str | None = RPS,
    tpm: str | None = TPM,
    budget: str | None = BUDGET,
    expires: str | None = EXPIRES,
    priority: str | None = PRIORITY,
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Change a key's settings (those given; the rest stay); its secret stays."""
    flags = _flags(team, models, rps, tpm, budget, expires, priority)
    try:
        keys_view.settings(name, flags, Session.now())
    except BadInput as exc:
        raise _bad(exc) from None

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        old = keys_view.require(r.state.keys, name)
        new = keys_view.settings(name, flags, s.now(), base=old.settings)
        ev = events.KeyChanged(id=s.new_id(), ts=s.now(), operator=s.identity.name, key=new)
        pub, after = await _publish(s, ev)
        common.out(
            render.json_text(keys_view.row(after.keys[name], s.now()))
            if json_out
            else f"key {name} updated by {s.identity} (seq {pub['seq']})"
        )

    common.run(common.Conn(config, server, ca, cert, key), body)


@app.command("rotate")
def rotate(
    name: str = typer.Argument(..., help="The key."),
    overlap: str = typer.Option(
        "1h", "--overlap", help="How long the old secret stays valid: 0, 90s, 30m, 1h, 2d."
    ),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Give a key a new secret (printed once); the old one works for --overlap more."""
    try:
        overlap_s = keys_view.duration(overlap, "--overlap")
    except BadInput as exc:
        raise _bad(exc) from None
    secret = auth.new_key()

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        keys_view.require(r.state.keys, name)
        ev = events.KeyRotated(
            id=s.new_id(), ts=s.now(), operator=s.identity.name, name=name,
            sha256=auth.digest(secret), overlap_s=overlap_s,
        )  # fmt: skip
        pub, _ = await _publish(s, ev)
        if json_out:
            common.out(render.json_text({"name": name, "key": secret, "seq": pub["seq"]}))
        else:
            common.out(secret)
            typer.echo(
                f"key {name} rotated by {s.identity} (seq {pub['seq']}); the old secret works"
                f" for {overlap} more. The line above is the new secret, shown only now",
                err=True,
            )

    common.run(common.Conn(config, server, ca, cert, key), body)


@app.command("revoke")
def revoke(
    name: str = typer.Argument(..., help="The key."),
    reason: str = typer.Option("", "--reason", help="Recorded in the log."),
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Refuse a key from now on, on every router."""

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        keys_view.require(r.state.keys, name)
        ev = events.KeyRevoked(
            id=s.new_id(), ts=s.now(), operator=s.identity.name, name=name, reason=reason
        )
        pub, _ = await _publish(s, ev)
        common.out(f"key {name} revoked by {s.identity} (seq {pub['seq']})")

    common.run(common.Conn(config, server, ca, cert, key), body)


@app.command("list")
def list_(
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """Every key in force: its team, models, limits and expiry (never a secret)."""

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        now = s.now()
        if json_out:
            common.out(render.json_text([keys_view.row(k, now) for _, k in
                                         sorted(r.state.keys.items())]))  # fmt: skip
        else:
            common.out(render.table(keys_view.HEADERS, keys_view.table_rows(r.state.keys, now)))

    common.run(common.Conn(config, server, ca, cert, key), body)


@app.command("show")
def show(
    name: str = typer.Argument(..., help="The key."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = common.KEY,
) -> None:
    """One key: its settings, who made and changed it, a rotation's overlap."""

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        k = keys_view.require(r.state.keys, name)
        now = s.now()
        common.out(
            render.json_text(keys_view.row(k, now))
            if json_out
            else "\n".join(keys_view.show_lines(k, now))
        )

    common.run(common.Conn(config, server, ca, cert, key), body)


def usage(
    key_name: str | None = typer.Option(None, "--key", help="Only this key."),
    since: str = typer.Option("1d", "--since", help="How far back: 1h, 12h, 1d, 30d."),
    json_out: bool = common.JSON,
    config: Path | None = common.CONFIG,
    server: list[str] | None = common.SERVER,
    ca: str | None = common.CA,
    cert: str | None = common.CERT,
    key: str | None = typer.Option(
        None, "--cert-key", help="Your certificate's key (--key names the API key here)."
    ),
) -> None:
    """Requests and tokens per key and model over the whole fleet, from the routers' usage
    counters (by the hour), and each budget's use of its current period."""
    try:
        span_s = keys_view.duration(since, "--since", most_s=400 * 86_400.0)
        if key_name is not None:
            subjects.check_token(key_name, "key name")
    except (BadInput, subjects.SubjectTokenError) as exc:
        raise _bad(BadInput(str(exc))) from None

    async def body(s: Session) -> None:
        r = await common.current(s, progress=False)
        now = s.now()
        which = key_name or "*"
        try:
            hourly = await counters.totals(s.nc, subjects.USAGE_STREAM,
                                           f"{subjects.USAGE_ROOT}.{which}.h.>")  # fmt: skip
            budgeted = await counters.totals(s.nc, subjects.USAGE_STREAM,
                                             f"{subjects.USAGE_ROOT}.{which}.b.*")  # fmt: skip
        except counters.CounterError as exc:
            hint = "check that NATS is up and the control plane has started (it makes the stream)"
            raise Failed(f"{exc}; {hint}") from None
        keys = r.state.keys if key_name is None else {
            k: v for k, v in r.state.keys.items() if k == key_name}  # fmt: skip
        rows = usage_view.rows(hourly, keys, int((now - span_s) // 3600))
        budgets = usage_view.budgets(budgeted, keys, now)
        if json_out:
            common.out(render.json_text({"since_s": span_s, "usage": rows, "budgets": budgets}))
            return
        common.out(render.table(
            ("KEY", "TEAM", "MODEL", "REQUESTS", "TOKENS IN", "TOKENS OUT"),
            [[u["key"], u["team"] or "-", u["model"], str(u["requests"]), str(u["tokens_in"]),
              str(u["tokens_out"])] for u in rows],
        ))  # fmt: skip
        for b in budgets:
            common.out(f"budget {b['key']}: {b['used']} of {b['budget']} tokens used in"
                       f" {b['period']} ({b['left']} left)")  # fmt: skip

    common.run(common.Conn(config, server, ca, cert, key), body)


def register(parent: typer.Typer) -> None:
    parent.add_typer(app, name="key")
    parent.command("usage")(usage)
