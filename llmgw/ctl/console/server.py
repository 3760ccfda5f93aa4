"""The console's HTTP side: one page and the JSON API it reads (docs/design.md, "The
console").

- `GET /`: the page (llmgw/ctl/console/page.html: plain HTML and JavaScript, no build step);
- `GET /api/fleet[?at=POINT]`: the fleet now (the live fold), or at POINT (a sequence,
  or a time as `llmgw ctl replay --at` reads it), rebuilt from the newest snapshot at
  or before it plus the tail;
- `GET /api/diff?from=POINT&to=POINT`: what changed between two points;
- `GET /api/events?node=&model=&replica=&type=&limit=`: the recent events, filtered;
- `GET /api/timeline?target=NAME&limit=`: the events of the whole log that touched a
  node, replica or model, the last `limit` of them (5,000 unless given, at most
  50,000), with how many there were in `X-Llmgw-Timeline-Total`;
- `GET /api/explain/MODEL[?at=POINT]`: where a replica of MODEL could go, and why not;
- `GET /api/stream`: server-sent events, one `events` message per batch folded;
- `POST /api/nodes/NODE/{cordon,uncordon,drain}` (JSON: `reason`, `grace_s`,
  `dry_run`): the operator events `llmgw ctl` publishes, as the console's identity.

Bad input is a 400 with `{"error": ...}` saying what to do; anything unexpected a 500
with one line, never a stack trace. A write must carry the header
`X-Llmgw-Console: 1` with a JSON body (a page of another site cannot send either without
the browser asking first, which the console never allows), and on plain HTTP every
request must name the console's own address in `Host` (a DNS name an attacker controls,
rebound to 127.0.0.1, does not; over HTTPS such a name fails the certificate check).
A request a browser says another page made (`Sec-Fetch-Site`) is refused, but for a link
opening the page: over HTTPS the browser presents the operator's certificate to any
page's requests. No answer may be shown in another site's frame, and the page runs only
its own script and style (`GUARDS`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import hmac
import json
import re
import time
from collections import deque
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import msgspec
from aiohttp import web

from llmgw import bus, logs, operator_https
from llmgw.core import events, placement
from llmgw.ctl import changes, eventlines, history, operations
from llmgw.ctl import session as session_
from llmgw.ctl.console import views
from llmgw.ctl.console.live import LiveFleet
from llmgw.ctl.errors import BadInput, CtlError

log = logs.get("llmgw.ctl.console")

LIVE: web.AppKey[LiveFleet] = web.AppKey("live")
HOSTS: web.AppKey[set[str]] = web.AppKey("hosts")
SCANS: web.AppKey[asyncio.Semaphore] = web.AppKey("scans")
TOKEN: web.AppKey[str] = web.AppKey("token")
WRITE_HEADER = "X-Llmgw-Console"
MAX_GRACE_S = 7 * 86400.0
_encoder = msgspec.json.Encoder()


PAGE = resources.files("llmgw.ctl.console").joinpath("page.html").read_bytes()


def inline_sources(page: bytes, tag: str) -> str:
    """The Content-Security-Policy sources allowing exactly the page's inline `<tag>`
    elements: one SHA-256 of each element's text."""
    found = re.finditer(rf"<{tag}(?:\s[^>]*)?>(.*?)</{tag}>".encode(), page, re.DOTALL)
    hashes = [base64.b64encode(hashlib.sha256(m[1]).digest()).decode() for m in found]
    return " ".join(f"'sha256-{h}'" for h in hashes) or "'none'"


POLICY = "; ".join(
    [
        "default-src 'none'",
        f"script-src {inline_sources(PAGE, 'script')}",
        f"style-src {inline_sources(PAGE, 'style')}",
        "connect-src 'self'",
        "img-src 'self' data:",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    ]
)
"""The page's own script and style and requests to the console itself, nothing else: the
fleet's names and reasons come from the log's writers, and a bug that let one of them
into the page as markup would still run nothing and send nothing elsewhere."""

GUARDS = {
    "X-Frame-Options": "DENY",
    "Content-Security-Policy": POLICY,
    "X-Content-Type-Options": "nosniff",
}
"""On every answer: no page of another site may frame the console (over HTTPS the browser
presents the operator's certificate to a frame too, and a framed page could be made to
take the operator's click on its drain), the page runs only its own script (`POLICY`),
and no answer is read as another type than it says."""


async def _guarded(request: web.Request, response: web.StreamResponse) -> None:
    for name, value in GUARDS.items():
        response.headers.setdefault(name, value)
    if request.path.startswith("/api/"):
        # The fleet as it is now: never kept on the operator's disk, never shown stale.
        response.headers.setdefault("Cache-Control", "no-store")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(data), status=status, content_type="application/json")


def _error(message: str, status: int) -> web.Response:
    return _json({"error": message}, status)


@web.middleware
async def _token_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """On loopback, where no certificate says who is asking, every request but the page's
    own carries the token `llmgw console` printed, as `Authorization: Bearer TOKEN` (the
    page sends it, as a script does). Another user of the same machine reaches 127.0.0.1
    too and must not read the fleet or act as this console's operator. Never a cookie: a
    browser sends a host's cookies to every port of it, so the token would reach whatever
    other server on 127.0.0.1 the operator's browser opens. The page (the same for all,
    nothing of the fleet in it) takes it from the printed address's fragment, which no
    server is sent, and keeps it in its tab's storage, which is its own origin's."""
    token = request.app[TOKEN]  # empty over HTTPS: operator certificates decide there
    if token and not (request.path == "/" and request.method in ("GET", "HEAD")):
        bearer = request.headers.get("Authorization", "")
        if not _is_token(bearer.removeprefix("Bearer ").strip(), token):
            return _error(
                "open the address `llmgw console` printed (it carries the console's token), "
                "or send Authorization: Bearer TOKEN",
                401,
            )
    response: web.StreamResponse = await handler(request)
    return response


def _is_token(given: str, token: str) -> bool:
    """Whether `given` is `token`, in constant time. aiohttp hands a header's bytes that are
    not UTF-8 over as surrogates, which a strict encode refuses (a 500 for anyone who
    sends them): they are encoded as they are, and compare unequal."""
    return hmac.compare_digest(given.encode("utf-8", "surrogatepass"), token.encode())


@web.middleware
async def _guard(request: web.Request, handler: Any) -> web.StreamResponse:
    """Host and write checks first; errors as one JSON line, never a trace."""
    hosts = request.app[HOSTS]
    if hosts and request.host not in hosts:
        return _error(
            f"this console answers as {', '.join(sorted(hosts))}, not {request.host!r}: open it"
            " at the address `llmgw console` printed",
            421,
        )
    if _from_another_site(request):
        return _error(
            "a page of another site asked for this: the console answers its own page, the"
            " addresses you type and clients that send no Sec-Fetch-Site; open the console"
            " and use it from there",
            403,
        )
    if request.method not in ("GET", "HEAD") and (
        request.headers.get(WRITE_HEADER) != "1" or request.content_type != "application/json"
    ):
        return _error(f"a change needs the header {WRITE_HEADER}: 1 and a JSON body", 403)
    try:
        response: web.StreamResponse = await handler(request)
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return _error(
            f"{exc.reason}: {request.method} {request.path} is not part of the console", exc.status
        )
    except CtlError as exc:
        return _error(str(exc), 400 if isinstance(exc, BadInput) else 502)
    except _Busy:
        return _error(
            f"the console is reading the log for {MAX_SCANS} other requests: retry in a moment",
            429,
        )
    except (OSError, TimeoutError) as exc:
        return _error(f"the log cannot be read now ({exc or type(exc).__name__}): retry", 503)
    except Exception as exc:
        log.exception("console_request_failed", path=request.path)
        return _error(f"the console failed on {request.path}: {type(exc).__name__}", 500)


_OWN_REQUESTS = frozenset({"same-origin", "none"})
"""`Sec-Fetch-Site` of the console's own page's requests and of an address typed or
bookmarked; a browser sends `same-site` or `cross-site` for any other page's."""


def _from_another_site(request: web.Request) -> bool:
    """Whether a browser says another page made this request. Over HTTPS it presents the
    operator's certificate to every page's requests (an `<img>` of another site's
    included), so such a GET would run with the operator's authority: a scan of the whole
    log each. A link elsewhere may still open the page itself (nothing of the fleet in
    it); clients other than browsers send no `Sec-Fetch-Site`."""
    site = request.headers.get("Sec-Fetch-Site")
    if site is None or site in _OWN_REQUESTS:
        return False
    return not (request.path == "/" and request.headers.get("Sec-Fetch-Mode") == "navigate")


def _point(request: web.Request, name: str) -> history.Point | None:
    text = request.query.get(name, "").strip()
    if not text:
        return None
    return history.parse_point(text, time.time())


MAX_SCANS = 2
"""Requests reading the log at once (a point in the past, a diff, a timeline): each may
fold the whole log on the console's one loop, so more wait their turn in the client, not
here (429), and the live view keeps moving."""


class _Busy(Exception):
    """Every scan slot is taken."""


@contextlib.asynccontextmanager
async def _scanning(request: web.Request) -> AsyncIterator[None]:
    scans = request.app[SCANS]
    if scans.locked():
        raise _Busy
    async with scans:
        yield


async def _rebuild(request: web.Request, point: history.Point) -> history.Rebuilt:
    live = request.app[LIVE]
    async with _scanning(request):
        return await history.rebuild(live.session.nc, to_seq=point.seq, at=point.time,
                                     attested=live.attested)  # fmt: skip


async def _page(_: web.Request) -> web.Response:
    return web.Response(body=PAGE, content_type="text/html", charset="utf-8")


async def _fleet(request: web.Request) -> web.Response:
    live = request.app[LIVE]
    point = _point(request, "at")
    now = time.time()
    if point is None:
        if not live.ready.is_set():
            return _error("still reading the log: retry in a moment", 503)
        view = views.fleet(live.state, now, at=live.last_time, live=True, why=None)
    else:
        r = await _rebuild(request, point)
        view = views.fleet(r.state, r.at or now, at=r.at, live=False, why=None)
        view["rebuilt"] = {"snapshot_seq": r.snapshot_seq, "folded": r.folded,
                           "elapsed_s": round(r.elapsed_s, 4)}  # fmt: skip
    try:
        live.bounds = await history.bounds(live.session.nc)
    except (CtlError, OSError, TimeoutError):
        if point is not None or live.bounds is None:
            raise
        # NATS is away: the live view is what was folded, the slider what was known.
    view["bounds"] = views.bounds(live.bounds)
    view["following"] = live.following
    return _json(view)


async def _diff(request: web.Request) -> web.Response:
    a, b = _point(request, "from"), _point(request, "to")
    if a is None or b is None:
        raise BadInput("give both points: /api/diff?from=SEQ-OR-TIME&to=SEQ-OR-TIME")
    ra, rb = await _rebuild(request, a), await _rebuild(request, b)
    return _json(views.diff(ra, rb, changes.diff(ra.state, rb.state)))


def _limit(request: web.Request, default: int, most: int) -> int:
    """The request's `limit`, clamped to 1..`most`."""
    text = request.query.get("limit", str(default))
    try:
        return max(1, min(int(text), most))
    except ValueError:
        raise BadInput(f"limit {text!r} is not a number: give 1 to {most}") from None


TIMELINE_ROWS = 5_000
TIMELINE_MOST = 50_000
"""Rows a timeline answers with, unless asked, and at most: a model's replicas over a long
log touch far more events than a page shows, and the console keeps what it answers."""


async def _events(request: web.Request) -> web.Response:
    q = request.query
    limit = _limit(request, 200, 5000)
    rows = views.matching(
        request.app[LIVE].recent, node=q.get("node", ""), model=q.get("model", ""),
        replica=q.get("replica", ""), type_filter=q.get("type", ""),
    )  # fmt: skip
    return _json(rows[-limit:])


async def _timeline(request: web.Request) -> web.Response:
    target = request.query.get("target", "").strip()
    if not target:
        raise BadInput("name a node, replica or model: /api/timeline?target=NAME")
    limit = _limit(request, TIMELINE_ROWS, TIMELINE_MOST)
    timeline = eventlines.Timeline(target)
    found: deque[bus.Record] = deque(maxlen=limit)
    total = 0
    async with _scanning(request):
        async for batch in history.records(request.app[LIVE].session.nc):
            for r in batch:
                if timeline.touches(r.event, r.subject):
                    total += 1
                    found.append(r)
    if not total:
        raise BadInput(f"no node, replica or model {target!r} in the log")
    response = _json([views.event_row(r) for r in found])
    response.headers["X-Llmgw-Timeline-Total"] = str(total)
    return response


async def _explain(request: web.Request) -> web.Response:
    live = request.app[LIVE]
    model = request.match_info["model"]
    point = _point(request, "at")
    st = live.state if point is None else (await _rebuild(request, point)).state
    if model not in st.models:
        known = ", ".join(sorted(st.models)[:8]) or "none declared"
        raise BadInput(f"unknown model {model!r} (declared: {known})")
    e = placement.explain(st, model, time.time())
    return _json({"model": e.model, "verdict": e.verdict, "text": e.render()})


async def _stream(request: web.Request) -> web.StreamResponse:
    live = request.app[LIVE]
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                           "Cache-Control": "no-cache"})  # fmt: skip
    await response.prepare(request)
    await response.write(
        f"event: hello\ndata: {json.dumps({'seq': live.state.last_seq})}\n\n".encode()
    )
    async for rows in live.watch():
        await response.write(b"event: events\ndata: " + _encoder.encode(rows) + b"\n\n")
    return response


async def _node_action(request: web.Request) -> web.Response:
    live = request.app[LIVE]
    node, action = request.match_info["node"], request.match_info["action"]
    try:
        body = await request.json()
    except (ValueError, LookupError, RecursionError):  # not JSON, an unknown charset, too deep
        raise BadInput('the body is not JSON: send {} or {"reason": "..."}') from None
    if not isinstance(body, dict):
        raise BadInput("the body must be a JSON object")
    reason, grace, dry_run = _action_fields(body)
    s = live.session
    user = operator_https.peer_name(request)
    if user and user != s.identity.name:
        # The event carries the console's identity (NATS allows it no other); the person
        # whose certificate asked is recorded in the log with it.
        reason = f"{reason} (by {user} through the console)".strip()
    st = history.copy_state(live.state)
    operations.require_node(st, node)
    if action == "drain":
        moves = views.drain_moves(st, node, time.time())
        if dry_run:
            return _json({"node": node, "moves": moves, "published": None})
    else:
        moves = []
    ev = _event(action, s, node, reason, grace)
    (published,) = await session_.publish_checked(s, st, [ev])
    log.info("console_action", action=action, node=node, operator=s.identity.name,
             user=user, seq=published["seq"])  # fmt: skip
    return _json({"node": node, "moves": moves, "published": published})


def _action_fields(body: dict[str, Any]) -> tuple[str, float, bool]:
    reason = body.get("reason", "")
    grace = body.get("grace_s", 600.0)
    dry_run = body.get("dry_run", False)
    if not isinstance(reason, str) or len(reason) > 500:
        raise BadInput("reason must be text of at most 500 characters")
    if (
        isinstance(grace, bool)
        or not isinstance(grace, (int, float))
        or not 0 <= grace <= MAX_GRACE_S
    ):
        raise BadInput(f"grace_s must be seconds from 0 to {MAX_GRACE_S:.0f}")
    if not isinstance(dry_run, bool):
        raise BadInput("dry_run must be true or false")
    return reason, float(grace), dry_run


def _event(action: str, s: session_.Session, node: str, reason: str, grace: float) -> events.Event:
    ident, ts, who = s.new_id(), s.now(), s.identity.name
    if action == "cordon":
        return events.NodeCordoned(id=ident, ts=ts, operator=who, node=node, reason=reason)
    if action == "uncordon":
        return events.NodeUncordoned(id=ident, ts=ts, operator=who, node=node)
    return events.NodeDrainRequested(
        id=ident, ts=ts, operator=who, node=node, grace_s=grace, reason=reason
    )


def build_app(live: LiveFleet, hosts: set[str], token: str = "") -> web.Application:
    """The console's app; `token`, when not empty, is required of every request
    (`_token_only`: the loopback listener, where no certificate says who asks)."""
    app = web.Application(middlewares=[operator_https.operators_only, _guard, _token_only],
                          client_max_size=64 * 1024)  # fmt: skip
    app[TOKEN] = token
    app[LIVE] = live
    app[HOSTS] = hosts
    app[SCANS] = asyncio.Semaphore(MAX_SCANS)
    app.on_response_prepare.append(_guarded)
    app.router.add_get("/", _page)
    app.router.add_get("/api/fleet", _fleet)
    app.router.add_get("/api/diff", _diff)
    app.router.add_get("/api/events", _events)
    app.router.add_get("/api/timeline", _timeline)
    # Any name: a model's may hold `/` (quoted as %2F or not) and braces, which the default
    # `{model}` pattern would refuse with a 404 of the router's own.
    app.router.add_get("/api/explain/{model:.+}", _explain)
    app.router.add_get("/api/stream", _stream)
    app.router.add_post("/api/nodes/{node}/{action:cordon|uncordon|drain}", _node_action)
    return app
