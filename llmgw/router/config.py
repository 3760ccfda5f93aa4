"""The router's configuration: listeners, models, endpoints, weights, deadlines, keys.

Models are `llmgw.core.profile.ModelProfile`s — the same description operators
declare in the log — of which the router uses the name, aliases, fallbacks and
deadlines. The static `endpoints` list serves router-only deployments; in a
fleet the endpoint table is fed by EndpointUp / EndpointDown events instead.
Loaded by `llmgw router` through `llmgw.config.load(..., section="ROUTER")`,
so `LLMGW_ROUTER__LISTEN__PORT=9000` overrides `listen.port`.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit

import msgspec

from llmgw import config, listeners, otlp
from llmgw.bus.settings import NatsConnection
from llmgw.core import redaction, subjects
from llmgw.core.breaker import BreakerPolicy
from llmgw.core.profile import ModelProfile
from llmgw.core.routing import CostModel, Weights
from llmgw.core.tenancy import CacheIsolation


class Listener(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    host: str = "127.0.0.1"
    port: config.Port = 8080


class EndpointConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One engine the router may send requests to."""

    id: str
    url: str
    """Base URL of the engine's OpenAI API, without /v1: `http://10.0.0.5:8000`."""
    models: tuple[str, ...]
    """Model names (declared under `models`) this engine serves."""
    node: str = ""
    """The node whose agent relays this engine's KV events (llmgw.agent.kvrelay): only
    that node's updates are believed for it. Empty: no events are used for it."""


DEFAULT_MAX_TOKENS = 4096
"""What `auth.default_max_tokens` is unless set."""
MAX_FLEET_ROUTERS = 10_000


class AuthConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Who may call. A router with a `log` admits the log's keys (`llmgw ctl key`), and the
    keys file's beside them; one without admits the keys file's."""

    keys_file: str = ""
    """YAML file of hashed API keys (see `llmgw router hash-key`)."""
    allow_anonymous: bool = False
    """Serve without keys. Must be said explicitly: an open router is an open GPU bill."""
    allowed_origins: tuple[str, ...] = ()
    """Web origins (`https://app.example`, as browsers send them in `Origin`) whose pages
    may call the router: their preflights are answered and every answer to them carries
    CORS headers naming them (llmgw.router.cors), and on a router without keys they may
    send requests without one (llmgw.router.browsers). Any other page gets no CORS
    header, and its requests without a key are refused."""
    default_max_tokens: Annotated[int, msgspec.Meta(ge=1)] = DEFAULT_MAX_TOKENS
    """The completion tokens a request naming no max_tokens is held to against its key's
    tokens/min and budget (at most the key's limit; what it uses beyond is charged after)."""
    fleet_routers: Annotated[int, msgspec.Meta(ge=1, le=MAX_FLEET_ROUTERS)] = 1
    """How many routers serve the fleet. While the fleet's counters cannot be reached, each
    router process (of `fleet_routers` times `workers`) may spend of a key's budget only an
    equal share of what it last read to be left; fewer than there are lets the fleet spend
    that many times what was left."""
    allowed_hosts: tuple[str, ...] = ()
    """Names (no port) besides 127.0.0.1, [::1] and localhost a request without a key may
    name in `Host` when the router listens on loopback; listing any checks `Host` on any
    listen address."""


class PrefixConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    block_chars: int = 256
    """Characters per prefix block (~64 tokens): near an engine's KV block of 16 tokens x 4."""
    max_blocks: int = 128
    """Prompt blocks hashed per request: bounds the work on very long prompts."""
    capacity: int = 200_000
    """Block hashes remembered (LRU)."""


class CacheConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Routing to the engines' KV caches (llmgw.router.kvroute).

    For models whose tokens the router can compute (sim models, and models with a
    tokenizer: `tokenizer` in the model profile), requests are ranked by `cost`: the
    prefill each endpoint would still have to do, from the fleet's KV events (read from
    the log's server when `log` is set), plus its load. Other models are ranked by
    `weights`."""

    enabled: bool = True
    events: bool = True
    """Follow the engines' KV events on the log's server (needs `log`)."""
    cost: CostModel = CostModel()
    recent_s: float = 2.0
    """How long this router's own routes count as cached before the engine reports them."""
    stale_after_s: float = 15.0
    """An endpoint whose KV updates stop this long is predicted nothing from its events."""
    max_prompt_chars: int = 32_768
    """Characters of a prompt the router tokenizes and keys, from its beginning (about 8,000
    tokens of English; the text index's reach too): tokenizing takes about a microsecond a
    token on the router's loop, so a body of megabytes would hold every other request for
    seconds. A longer prompt's cache is predicted on that beginning, its length estimated."""


class TenancyConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How far tenants are kept apart on the engines they share."""

    cache_isolation: CacheIsolation = "shared"
    """Whose requests may share an engine's prefix cache (a cached prefix answers sooner
    and says so in `cached_tokens`, which tells one tenant another's prompts): `shared`,
    every request's; `team`, a team's keys' (a key without a team is its own); `key`, one
    key's. Isolated, every request gets a `cache_salt` of its tenant (a client's own is
    replaced), and models on llama.cpp, which has no salt, are served with
    `cache_prompt: false`. Every router in front of the same engines sets the same."""


class LogSource(NatsConnection, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where a router reads the log (llmgw.router.feed): its certificate has CN = `name`,
    OU = router, and may only read."""

    name: str = "router"
    """The router's identity: the CN of its certificate."""


class TracesConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Where the router sends its spans (OTLP/HTTP), and how many requests it records."""

    endpoint: str
    """The collector's OTLP/HTTP address, `http://host:4318` (spans go to /v1/traces)."""
    sample_ratio: float = 1.0
    """Share of requests without a client's trace context that are recorded; a request
    with one follows the client's sampled flag (see `client_sampling`)."""
    client_sampling: bool = True
    """Whether a client's sampled flag decides for its request (OpenTelemetry's
    ParentBased sampler, the default). False: the ratio decides for every request, on the
    client's trace id where it sent one (the trace is still continued), so that clients
    cannot make the router record, and fill its export buffer with, all they send."""
    service_name: str = "llmgw-router"


class RouterConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    listen: Listener = Listener(port=8080)
    admin: Listener = Listener(port=9090)
    """Prometheus /metrics and /health, on its own port so it can stay private."""
    workers: int = 1
    """Processes sharing the listen port (SO_REUSEPORT), at most 1024
    (llmgw.core.subjects.MAX_ROUTER_WORKERS)."""
    models: tuple[ModelProfile, ...] = ()
    endpoints: tuple[EndpointConfig, ...] = ()
    log: LogSource | None = None
    """Follow the fleet's log: models and endpoints come from the control plane's events
    (besides the static ones above). None: a router-only deployment."""
    state_dir: str = "/var/lib/llmgw/router"
    """Where each router process keeps what it owes the fleet's budgets and usage counters
    while they cannot be reached (llmgw.router.spool), so that spending is not lost if it
    stops before they answer again: one folder per router on a host."""
    weights: Weights = Weights()
    breaker: BreakerPolicy = BreakerPolicy()
    prefix: PrefixConfig = PrefixConfig()
    cache: CacheConfig = CacheConfig()
    auth: AuthConfig = AuthConfig()
    tenancy: TenancyConfig = TenancyConfig()
    session_header: str = "x-session-id"
    """Requests carrying the same value of this header prefer the same endpoint."""
    max_attempts: int = 3
    """Endpoints tried per model before falling back or giving up (only before the first byte)."""
    max_body_bytes: int = 8 * 1024 * 1024
    max_answer_bytes: int = 256 * 1024 * 1024
    """The most of an engine's whole (not streamed) answer the router reads; more is a 502.
    It holds such an answer to count its usage, so an engine sending without end would
    fill its memory; 256 MiB holds 2,048 embeddings of 4,096 dimensions as JSON."""
    body_timeout_s: float = 30.0
    """Longest wait for a request's whole body once its headers are in; a client that
    sends it slower (or stops half-way) gets 408 and its connection is closed."""
    header_timeout_s: float = 10.0
    """Longest wait for a request's line and headers: a connection's first request's from its
    connect, a later one's from its first byte; a client that sends them slower gets 408
    and its connection is closed (one that sends nothing: closed unanswered)."""
    keepalive_s: float = 0.0
    """Send an SSE comment every this many seconds before the first token (0: never);
    for load balancers that cut idle connections during a long prefill."""
    count_stream_tokens: bool = True
    """Ask engines for a usage chunk on streams (dropped again unless the client asked):
    token metrics, tokens/min limits and budgets need it. Off, a stream is charged only
    where its client asked for its usage; one nobody asked for is charged nothing, whole
    or cut (a cut one is estimated only where its usage was asked for)."""
    probe_interval_s: float = 1.0
    """How often each engine's /health and /metrics are read."""
    upstream_connections: int = 4096
    seed: int | None = None
    """Seed of the tie-breaking random generator; None draws one at start."""
    log_level: config.LogLevel = "info"
    access_log: bool = False
    """A line per request (`request`, at info): its API, model, key, status, duration and
    tokens, and where it went: the endpoint and node of its last attempt, how many
    endpoints it was sent to, the fallback model that served it, the prompt tokens
    predicted cached there. Off, `log_level: debug` still writes it (at debug)."""
    traces: TracesConfig | None = None
    """Record requests' spans and export them (llmgw.router.tracing); none when unset."""


def validate(cfg: RouterConfig, *, where: str = "router config") -> list[str]:
    """Every problem with `cfg`, each saying what to change; empty when it is usable.

    Duplicate endpoint ids and aliases that shadow a model would misroute silently
    at request time, so they are refused here instead.
    """
    problems: list[str] = []
    names = _model_names(cfg, problems)
    problems += _model_problems(cfg, names)
    problems += _endpoint_problems(cfg, names)
    problems += _setting_problems(cfg)
    problems += _state_dir_problems(cfg.state_dir)
    return [f"{where}: {p}" for p in problems]


def _model_names(cfg: RouterConfig, problems: list[str]) -> dict[str, str]:
    """Every name a request may use (models and aliases) to the model it means; a name
    or alias declared twice is a problem."""
    names: dict[str, str] = {}
    for i, m in enumerate(cfg.models):
        if not m.name:
            problems.append(f"models[{i}] has no name: set models[{i}].name")
            continue
        if m.name in names:
            problems.append(
                f"model {m.name!r} is declared twice (models[{i}]): merge the two entries"
            )
        names[m.name] = m.name
    for i, m in enumerate(cfg.models):
        for alias in m.aliases:
            if alias in names and names[alias] == alias:
                problems.append(
                    f"alias {alias!r} of model {m.name!r} shadows the model of that name:"
                    f" rename the alias or remove it from models[{i}].aliases"
                )
            elif alias in names:
                problems.append(
                    f"alias {alias!r} is claimed by both {names[alias]!r} and {m.name!r}:"
                    f" keep it on one model only"
                )
            else:
                names[alias] = m.name
    return names


def _model_problems(cfg: RouterConfig, names: dict[str, str]) -> list[str]:
    """Fallbacks that name no model or the model itself, and deadlines that are not positive."""
    problems: list[str] = []
    for m in cfg.models:
        for fb in m.fallbacks:
            if fb not in names:
                problems.append(
                    f"model {m.name!r} falls back to {fb!r}, which is not declared:"
                    f" declare it under models or remove it from fallbacks"
                )
            elif names[fb] == m.name:
                problems.append(f"model {m.name!r} lists itself as a fallback: remove it")
        d = m.deadlines
        for field in ("connect_s", "headers_s", "first_token_s", "idle_s", "total_s"):
            if getattr(d, field) <= 0:
                problems.append(f"model {m.name!r}: deadlines.{field} must be above 0 seconds")
    return problems


def _endpoint_problems(cfg: RouterConfig, names: dict[str, str]) -> list[str]:
    """Endpoint ids used twice, URLs that are none, and models no endpoint may serve."""
    problems: list[str] = []
    canonical = {m.name for m in cfg.models}
    ids: set[str] = set()
    for i, ep in enumerate(cfg.endpoints):
        if ep.id in ids:
            problems.append(
                f"endpoint id {ep.id!r} is used twice (endpoints[{i}]):"
                " give each endpoint its own id"
            )
        ids.add(ep.id)
        if not _engine_url(ep.url):
            # Quoted without its password: the problem reaches terminals and logs.
            shown = redaction.shown_url(ep.url)
            problems.append(f"endpoint {ep.id!r}: url {shown!r} must look like http://host:port")
        if not ep.models:
            problems.append(f"endpoint {ep.id!r} serves no models: list them in its models")
        for model in ep.models:
            if model not in canonical:
                hint = (
                    f"use the model's name {names[model]!r}, not its alias"
                    if model in names
                    else "declare it under models or fix the name"
                )
                problems.append(
                    f"endpoint {ep.id!r} serves {model!r}, which is not a declared model: {hint}"
                )
    return problems


def _engine_url(url: str) -> bool:
    """Whether `url` is an engine's base URL the router can send to: http(s), a host, and a
    port from 1 to 65535 if it has one (urllib refuses a malformed port only when it is
    read: the first request would fail)."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:  # an unbalanced [ or a port that is none
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname) and port != 0


def _observing_problems(cfg: RouterConfig) -> list[str]:
    """What the router reads and writes beside requests: the log connection, the traces'
    collector, the access log."""
    problems: list[str] = []
    if cfg.log is not None:
        problems += cfg.log.problems(
            "log",
            "point it at the router's files from "
            "`llmgw ctl cert issue router NAME` (and the fleet's ca.pem)",
        )
    if cfg.traces is not None:
        bad = otlp.endpoint_problem(cfg.traces.endpoint)
        if bad is not None:
            problems.append(f"traces.endpoint {bad}")
        if not 0.0 <= cfg.traces.sample_ratio <= 1.0:
            problems.append("traces.sample_ratio must be between 0 and 1 (1: every request)")
        if not cfg.traces.service_name:
            problems.append("traces.service_name must not be empty")
    if cfg.access_log and cfg.log_level.lower() not in ("debug", "info"):
        problems.append(
            f"access_log writes at info, which log_level {cfg.log_level!r} hides:"
            " set log_level to info, or access_log to false"
        )
    return problems


def _setting_problems(cfg: RouterConfig) -> list[str]:
    """The router's own settings: those of `_observing_problems`, limits, timeouts,
    authentication."""
    problems = _observing_problems(cfg)
    if not 1 <= cfg.workers <= subjects.MAX_ROUTER_WORKERS:
        problems.append(f"workers must be between 1 and {subjects.MAX_ROUTER_WORKERS}")
    if cfg.max_attempts < 1:
        problems.append("max_attempts must be at least 1")
    if cfg.max_body_bytes < 1024:
        problems.append("max_body_bytes must be at least 1024")
    if cfg.max_answer_bytes < 1024:
        problems.append("max_answer_bytes must be at least 1024")
    if cfg.body_timeout_s <= 0:
        problems.append("body_timeout_s must be above 0")
    if cfg.header_timeout_s <= 0:
        problems.append("header_timeout_s must be above 0")
    if cfg.prefix.block_chars < 1 or cfg.prefix.max_blocks < 0 or cfg.prefix.capacity < 1:
        problems.append("prefix: block_chars and capacity must be at least 1, max_blocks >= 0")
    if cfg.probe_interval_s <= 0:
        problems.append("probe_interval_s must be above 0")
    problems += [f"cache.{p}" for p in cfg.cache.cost.problems()]
    if cfg.cache.recent_s < 0 or cfg.cache.stale_after_s <= 0:
        problems.append("cache: recent_s must be >= 0 and stale_after_s above 0")
    if cfg.cache.max_prompt_chars < 1024:
        problems.append(
            "cache.max_prompt_chars must be at least 1024 (a prompt's first characters are "
            "what its cache is predicted on)"
        )
    if cfg.breaker.failures_to_open < 1:
        problems.append("breaker.failures_to_open must be at least 1")
    if cfg.breaker.open_s < 0:
        problems.append("breaker.open_s must be 0 or more seconds")
    for field in msgspec.structs.fields(cfg.weights):
        # A negative weight does not turn a scorer off: it prefers what the scorer avoids.
        if getattr(cfg.weights, field.name) < 0:
            problems.append(f"weights.{field.name} must be 0 or more (0 turns that scorer off)")
    if cfg.upstream_connections < 0:
        problems.append("upstream_connections must be 0 or more (idle connections kept)")
    if not cfg.auth.keys_file and not cfg.auth.allow_anonymous and cfg.log is None:
        problems.append(
            "no API keys: set log (the fleet's keys, made with `llmgw ctl key create`), or"
            " auth.keys_file to a keys file (entries from `llmgw router hash-key`), or"
            " auth.allow_anonymous: true to serve without keys"
        )
    if cfg.auth.keys_file and cfg.auth.allow_anonymous:
        problems.append("auth.keys_file and auth.allow_anonymous are both set: choose one")
    return problems + _origin_problems(cfg.auth) + _host_problems(cfg.auth)


def _state_dir_problems(state_dir: str) -> list[str]:
    if state_dir.strip():
        return []
    return ["state_dir is empty: give a folder the router may write (what it owes the"
            " fleet's budgets through an outage is kept there)"]  # fmt: skip


def _origin_problems(auth: AuthConfig) -> list[str]:
    """Origins a browser never sends as written (it would be refused), and "null"."""
    problems: list[str] = []
    for i, origin in enumerate(auth.allowed_origins):
        where = f"auth.allowed_origins[{i}] {origin!r}"
        written = web_origin(origin)
        if origin == "null":
            problems.append(
                f"{where} is the origin of sandboxed frames and local files, which any page"
                " can take: list the origins of the pages that may use the router"
            )
        elif written is None:
            problems.append(f"{where} is no origin: write scheme://host[:port], no path")
        elif written != origin:
            problems.append(f"{where}: write it as browsers send it, {written!r}")
    return problems


_ORIGIN_HOST = re.compile(r"[a-z0-9_.-]+")
"""A host as an origin names it, after IDNA: letters, digits, `-`, `_` and dots."""


def web_origin(value: str) -> str | None:
    """`value` as browsers write an origin (lower case, no default port, no slash); None
    when it is not `scheme://host[:port]`."""
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError:
        return None
    host = parts.hostname
    if not parts.scheme or not host or "@" in parts.netloc or parts.path not in ("", "/"):
        return None
    if parts.query or parts.fragment or value.endswith(("?", "#")):
        return None
    if ":" in host:
        host = f"[{host}]"
    else:
        try:
            # A name in other letters is sent in its ASCII (punycode) form.
            host = host.encode("idna").decode("ascii")
        except UnicodeError:
            return None
        if not _ORIGIN_HOST.fullmatch(host):
            return None
    default = {"http": 80, "https": 443}.get(parts.scheme)
    shown = "" if port is None or port == default else f":{port}"
    return f"{parts.scheme}://{host}{shown}"


def _host_problems(auth: AuthConfig) -> list[str]:
    """Host names a `Host` header's name can never be."""
    return [
        f"auth.allowed_hosts[{i}] {name!r} is no host name: write a name or an address"
        " without a port (an IPv6 address in brackets), one entry per name, no wildcard"
        for i, name in enumerate(auth.allowed_hosts)
        if "*" in name or listeners.host_header_name(name) != name.lower()
    ]


def load(path: str | Path | None) -> RouterConfig:
    """Load and validate; raises `config.ConfigError` listing every problem."""
    cfg = config.load(RouterConfig, path, section="ROUTER")
    where = str(path) if path else "router config"
    problems = validate(cfg, where=where)
    if problems:
        named = config.name_variables(problems, "ROUTER", where=where)
        raise config.ConfigError("\n".join(named))
    return cfg


def model_names(cfg: RouterConfig) -> dict[str, ModelProfile]:
    """Every name a client may ask for (models and aliases) -> its profile."""
    out: dict[str, ModelProfile] = {}
    for m in cfg.models:
        out[m.name] = m
        for alias in m.aliases:
            out[alias] = m
    return out
