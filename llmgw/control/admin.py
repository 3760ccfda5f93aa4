"""The control plane's read-only management API, on its admin listener (127.0.0.1 by default).

- `GET /v1/nodes`: nodes with liveness, operator flags, GPUs and what holds them;
- `GET /v1/replicas`: replicas with each shard's node, GPUs, phase, endpoint and error;
- `GET /v1/models`: declared models, wanted and active replica counts, and why
  missing replicas cannot be placed;
- `GET /v1/explain/<model>`: every node and whether a new replica could land there (the
  name percent-quoted, or with its `/` as they are); 404 for a model not declared;
- `GET /v1/state`: digest, folded sequence, leader, epoch, this instance's role, how many
  events the fold refused and how many messages did not decode;
- `GET /metrics`: Prometheus, the fleet's state included; `GET /health`: 200 once caught
  up with the log, else 503;
- `GET /v1/sd/prometheus`: Prometheus `http_sd_configs` targets: every engine with an
  endpoint (labelled with model, replica, shard, node, GPU class, engine, phase) and this
  control plane, so one scrape config follows the fleet as replicas move.

Plain HTTP on 127.0.0.1 by default, answering only requests whose `Host` names a
loopback address or localhost (421 otherwise: DNS rebinding); with `admin.cert_file`
set, HTTPS that requires a client certificate from the fleet's CA and answers 403
unless it is an operator's. Either way (a Prometheus elsewhere may reach it) a request
head must arrive within `admin.header_timeout_s` of the connect (a later one's of its first
byte), or the client gets a 408 and the connection closes, a malformed request gets a 400
that quotes nothing it sent, and a compressed body (never inflated) a 415 (llmgw.http_server).
Everything is read from the folded state (llmgw.control.service), shown with the same
rows as `llmgw ctl` (llmgw.core.views), and nothing is written: mutations go through
the log (`llmgw ctl`). JSON via msgspec. Used by operators, `llmgw ctl status`,
`llmgw up`'s live status, dashboards and the integration tests.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import msgspec
from aiohttp import web

from llmgw import http_server, listeners, logs, operator_https
from llmgw.core import placement, state, views

if TYPE_CHECKING:
    from llmgw.control.service import ControlService

log = logs.get("llmgw.control")

_encoder = msgspec.json.Encoder()
SERVICE: web.AppKey[ControlService] = web.AppKey("service")


def _json(data: Any, status: int = 200) -> web.Response:
    return web.Response(body=_encoder.encode(data), status=status, content_type="application/json")


def state_view(svc: ControlService) -> dict[str, Any]:
    st = svc.state
    return {
        "instance": svc.name,
        "leading": svc.leading,
        "leader": st.leader,
        "epoch": st.epoch,
        "digest": state.digest(st),
        "folded_seq": st.last_seq,
        "control_seq": svc.control_seq,
        "snapshot_seq": svc.snapshot_seq,
        "caught_up": svc.caught_up.is_set(),
        "rejected": svc.rejected,
        "undecodable": svc.folded.undecodable,
        "nodes": len(st.nodes),
        "replicas": len(st.replicas),
        "models": len(st.models),
    }


async def _nodes(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    return _json(views.node_rows(svc.state, svc.clock()))


async def _replicas(request: web.Request) -> web.Response:
    return _json(views.replica_rows(request.app[SERVICE].state))


async def _models(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    return _json(views.model_rows(svc.state, svc.clock(), why=svc.unplaceable))


async def _explain(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    model = request.match_info["model"]
    explanation = placement.explain(svc.state, model, svc.clock())
    status = 404 if model not in svc.state.models else 200
    return _json(
        {
            "model": explanation.model,
            "verdict": explanation.verdict,
            "placement": explanation.placement,
            "nodes": explanation.nodes,
            "text": explanation.render(),
        },
        status,
    )


async def _state(request: web.Request) -> web.Response:
    return _json(state_view(request.app[SERVICE]))


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[SERVICE].metrics.render()
    return web.Response(body=body, headers={"Content-Type": "text/plain; version=0.0.4"})


async def _prometheus_targets(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    control = svc.admin_url.partition("://")[2]
    routers = svc.scaler.router_targets(svc.clock())
    return _json(views.prometheus_targets(svc.state, control, svc.name, routers))


async def _health(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    ok = svc.caught_up.is_set()
    return _json(
        {
            "status": "ok" if ok else "replaying",
            "leading": svc.leading,
            "folded_seq": svc.state.last_seq,
        },
        200 if ok else 503,
    )


@web.middleware
async def _loopback_names_only(request: web.Request, handler: Any) -> web.StreamResponse:
    """On a plain-HTTP loopback listener: a page of another site whose DNS name was rebound
    to 127.0.0.1 reaches it from the operator's browser, with its own name in `Host`, and
    would read the whole fleet. A client without `Host` is no browser."""
    given = request.headers.get("Host")
    if given is not None and not listeners.loopback_host_header(given):
        return _json({"error": f"this admin API answers as 127.0.0.1, [::1] or localhost, not "
                      f"{given!r}: reach it by that address (admin.host)"}, 421)  # fmt: skip
    response: web.StreamResponse = await handler(request)
    return response


def build_app(svc: ControlService) -> web.Application:
    cfg = svc.cfg.admin
    local = not cfg.cert_file and listeners.loopback(cfg.host)
    guards = [operator_https.operators_only] + ([_loopback_names_only] if local else [])
    app = web.Application(middlewares=guards)
    app[SERVICE] = svc
    app.router.add_get("/v1/nodes", _nodes)
    app.router.add_get("/v1/replicas", _replicas)
    app.router.add_get("/v1/models", _models)
    # Any name: a model's may hold `/` (quoted as %2F or not) and braces, which the default
    # `{model}` pattern would refuse with a 404 of the router's own.
    app.router.add_get("/v1/explain/{model:.+}", _explain)
    app.router.add_get("/v1/state", _state)
    app.router.add_get("/metrics", _metrics)
    app.router.add_get("/v1/sd/prometheus", _prometheus_targets)
    app.router.add_get("/health", _health)
    return app


async def start(svc: ControlService) -> web.AppRunner:
    """Listen on the configured admin address; sets `svc.admin_url` (port 0 picks a free one)."""
    cfg = svc.cfg.admin
    rules = http_server.Rules(cfg.header_timeout_s, log)
    runner = http_server.app_runner(build_app(svc), rules=rules, access_log=None)
    await runner.setup()
    try:
        sock = listeners.bind(cfg.host, cfg.port, setting="admin.port")
    except OSError:
        await runner.cleanup()
        raise
    tls = (
        operator_https.server_tls(cfg.cert_file, cfg.key_file, cfg.ca_file)
        if cfg.cert_file
        else None
    )
    await http_server.start_site(runner, sock, rules=rules, ssl_context=tls)
    svc.admin_url = listeners.url("https" if tls else "http", sock)
    log.info("admin_listening", url=svc.admin_url)
    if tls is None and not listeners.loopback(cfg.host):
        # Allowed (a Prometheus elsewhere may need /metrics and /v1/sd/prometheus), but
        # every node, replica and model of the fleet is then readable by whoever reaches it.
        log.warning("admin_exposed", url=svc.admin_url,
                    action="set admin.cert_file, key_file and ca_file for HTTPS that admits "
                    "only operator certificates, or keep admin.host on 127.0.0.1")  # fmt: skip
    return runner
