"""Provisioning of the JetStream resources llmgw needs: the log, the lease bucket, the snapshots.

The control plane calls `provision` at start-up (its certificate is the one allowed
to manage streams). It is idempotent: resources that exist with the configuration
llmgw needs are left alone. A stream that exists with a *different* configuration
is never silently changed (that could drop history or break another tenant of the
server): `provision` refuses with a `ProvisionConflict` naming every field that
differs and what to do about it.
"""

from __future__ import annotations

from typing import Any

import msgspec
import nats.js.errors
from nats.js import JetStreamContext, api

from llmgw import logs
from llmgw.core import subjects

log = logs.get("llmgw.bus")

LEASE_BUCKET = "llmgw-lease"
SNAPSHOT_BUCKET = "llmgw-snapshots"


class ProvisionConflict(RuntimeError):
    """An existing JetStream resource whose configuration llmgw cannot use as it is."""


class StreamSettings(msgspec.Struct, frozen=True, kw_only=True):
    """What is configurable about the log; everything else is fixed by llmgw's design."""

    replicas: int = 1
    """1 for one server; 3 or 5 across failure domains in production (see docs/design.md)."""
    duplicate_window_s: float = 120.0
    """How long JetStream remembers event ids to drop duplicate publishes."""


class Provisioned(msgspec.Struct, frozen=True):
    """What `provision` did: names of resources it created and of those that already existed."""

    created: tuple[str, ...]
    existing: tuple[str, ...]


def stream_config(settings: StreamSettings) -> api.StreamConfig:
    """The configuration of `llmgw-events`. Purely computational."""
    return api.StreamConfig(
        name=subjects.STREAM,
        description="llmgw event log: the only source of truth of the cluster",
        subjects=list(subjects.STREAM_SUBJECTS),
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.FILE,
        discard=api.DiscardPolicy.OLD,
        num_replicas=settings.replicas,
        duplicate_window=settings.duplicate_window_s,
        max_age=0,
        max_msgs=-1,
        max_bytes=-1,
        max_msgs_per_subject=-1,
        # Direct get lets readers fetch single messages without a consumer.
        allow_direct=True,
        # Heartbeats carry a per-message TTL so the log does not grow with them.
        allow_msg_ttl=True,
    )


KV_MAX_AGE_S = 60.0
"""How long the engines' KV updates stay in `llmgw-kv`: several of each engine's full
updates (llmgw.agent.kvrelay sends one every few seconds), so a router that starts reads
one for every engine, and nothing older is needed."""
KV_MAX_BYTES = 512 * 1024 * 1024


def kv_stream_config(settings: StreamSettings) -> api.StreamConfig:
    """The configuration of `llmgw-kv`, the engines' KV blocks. Purely computational.

    In memory and bounded by age and size: the content is derived (every engine's agent
    sends its whole resident set again every few seconds), high-volume and worthless after
    a minute, and a server restart that loses it costs routers a few seconds of warm-up."""
    return _derived_stream_config(
        settings,
        subjects.KV_STREAM,
        "llmgw: engines' KV-cache blocks, relayed by their agents (derived data)",
        subjects.KV_SUBJECTS,
        KV_MAX_AGE_S,
        KV_MAX_BYTES,
    )


SIGNALS_MAX_AGE_S = 30.0
"""How long the routers' load reports stay in `llmgw-signals`: a new leader reads the
last seconds of them, and what a decision was made on is in the log beside it."""
SIGNALS_MAX_BYTES = 64 * 1024 * 1024
SIGNALS_PER_SUBJECT = 1
"""Reports kept per subject: every reader keeps only each subject's latest, and without
this bound a node publishing its largest reports on its own subject pushed everyone
else's out of the stream (oldest dropped) within a second."""


def signals_stream_config(settings: StreamSettings) -> api.StreamConfig:
    """The configuration of `llmgw-signals`, the routers' load reports. Purely computational.

    In memory and bounded like `llmgw-kv`: every router sends its report again every
    second, and the autoscaler records in the log what it decided on. Only each subject's
    latest report is kept (`SIGNALS_PER_SUBJECT`)."""
    cfg = _derived_stream_config(
        settings,
        subjects.SIGNALS_STREAM,
        "llmgw: routers' load reports for the autoscaler (derived data)",
        subjects.SIGNALS_SUBJECTS,
        SIGNALS_MAX_AGE_S,
        SIGNALS_MAX_BYTES,
    )
    cfg.max_msgs_per_subject = SIGNALS_PER_SUBJECT
    return cfg


LIMITS_MAX_AGE_S = 600.0
"""How long a key's rate-window counters stay in `llmgw-limits`: windows last a second
(requests) or a minute (tokens); older ones are only history."""
LIMITS_MAX_BYTES = 256 * 1024 * 1024
USAGE_MAX_AGE_S = 400 * 86_400.0
"""How long `llmgw-usage` keeps a key's hourly usage: a year and a month, for `ctl usage`."""
USAGE_MAX_BYTES = 8 * 1024**3


def limits_stream_config(settings: StreamSettings) -> api.StreamConfig:
    """`llmgw-limits`: JetStream counters of each key's requests and tokens per window, in
    memory (a restart that loses them forgives the current window, nothing more)."""
    cfg = _derived_stream_config(
        settings,
        subjects.LIMITS_STREAM,
        "llmgw: tenants' fleet-wide rate counters (derived data)",
        subjects.LIMITS_SUBJECTS,
        LIMITS_MAX_AGE_S,
        LIMITS_MAX_BYTES,
    )
    return _counters(cfg)


def usage_stream_config(settings: StreamSettings) -> api.StreamConfig:
    """`llmgw-usage`: JetStream counters of each key's tokens and requests per hour and per
    budget period, on file (budgets and `ctl usage` outlive a server restart)."""
    cfg = _derived_stream_config(
        settings,
        subjects.USAGE_STREAM,
        "llmgw: tenants' usage by hour and budget period (counters)",
        subjects.USAGE_SUBJECTS,
        USAGE_MAX_AGE_S,
        USAGE_MAX_BYTES,
    )
    cfg.storage = api.StorageType.FILE
    return _counters(cfg)


def _counters(cfg: api.StreamConfig) -> api.StreamConfig:
    # Each message holds its subject's total (the server adds `Nats-Incr` to the last one),
    # so only the last per subject is kept; direct gets read a total in one request.
    cfg.allow_msg_counter = True
    cfg.allow_direct = True
    cfg.max_msgs_per_subject = 1
    cfg.max_msg_size = 1024
    return cfg


def _derived_stream_config(
    settings: StreamSettings,
    name: str,
    description: str,
    subject_list: tuple[str, ...],
    max_age_s: float,
    max_bytes: int,
) -> api.StreamConfig:
    return api.StreamConfig(
        name=name,
        description=description,
        subjects=list(subject_list),
        retention=api.RetentionPolicy.LIMITS,
        storage=api.StorageType.MEMORY,
        discard=api.DiscardPolicy.OLD,
        num_replicas=settings.replicas,
        duplicate_window=10.0,
        max_age=max_age_s,
        max_msgs=-1,
        max_bytes=max_bytes,
        max_msg_size=1024 * 1024,
        max_msgs_per_subject=-1,
    )


def _enum_value(value: Any) -> Any:
    return getattr(value, "value", value)


def stream_conflicts(existing: api.StreamConfig, wanted: api.StreamConfig) -> list[str]:
    """Human-readable differences that make `existing` unusable as llmgw's log. Pure."""
    problems: list[str] = []
    have_subjects = sorted(existing.subjects or [])
    want_subjects = sorted(wanted.subjects or [])
    if have_subjects != want_subjects:
        problems.append(f"subjects are {have_subjects} (llmgw needs exactly {want_subjects})")
    for field in ("storage", "retention", "discard"):
        have, want = _enum_value(getattr(existing, field)), _enum_value(getattr(wanted, field))
        if have != want:
            problems.append(f"{field} is {have!r} (llmgw needs {want!r})")
    if (existing.num_replicas or 1) != (wanted.num_replicas or 1):
        problems.append(
            f"replicas is {existing.num_replicas or 1} (configured: {wanted.num_replicas or 1})"
        )
    if abs((existing.duplicate_window or 0) - (wanted.duplicate_window or 0)) > 1e-3:
        problems.append(
            f"duplicate_window is {existing.duplicate_window or 0:g}s "
            f"(configured: {wanted.duplicate_window or 0:g}s)"
        )
    for field in ("allow_direct", "allow_msg_ttl"):
        if bool(getattr(existing, field)) != bool(getattr(wanted, field)):
            problems.append(f"{field} is {bool(getattr(existing, field))} (llmgw needs True)")
    if existing.max_age:
        problems.append(
            f"max_age is {existing.max_age:g}s: the log would lose history (llmgw needs 0)"
        )
    for field in ("max_msgs", "max_bytes", "max_msgs_per_subject"):
        have = getattr(existing, field)
        if have is not None and have > 0:
            problems.append(f"{field} is {have}: the log would lose history (llmgw needs -1)")
    if existing.sealed:
        problems.append("the stream is sealed: nothing can be written to it")
    return problems


def _conflict_message(name: str, problems: list[str]) -> str:
    return (
        f"stream {name} exists with a configuration llmgw cannot use: "
        + "; ".join(problems)
        + ". To fix: change the stream to match (e.g. `nats stream edit "
        + name
        + "`), or set the bus settings (replicas, duplicate_window_s) to what the stream has; "
        "storage, retention and a subject set cannot be changed in place: back the stream up "
        "(`nats stream backup`), delete it and let llmgw create it again."
    )


async def _ensure_stream(js: JetStreamContext, wanted: api.StreamConfig) -> bool:
    """Create the stream if absent; return True when created. Raises ProvisionConflict."""
    assert wanted.name is not None
    try:
        info = await js.stream_info(wanted.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(wanted)
        except nats.js.errors.APIError as exc:
            # Another control plane created it a moment ago: compare with that one.
            if exc.err_code != 10058:  # stream name already in use
                raise ProvisionConflict(
                    f"the server refused to create stream {wanted.name}: {exc.description} "
                    f"(code {exc.err_code}). With replicas > 1 the server must be part of a "
                    "cluster with at least that many JetStream servers; otherwise check the "
                    "server's JetStream limits (max_file_store)."
                ) from None
        else:
            return True
        info = await js.stream_info(wanted.name)
    problems = stream_conflicts(info.config, wanted)
    if problems:
        raise ProvisionConflict(_conflict_message(wanted.name, problems))
    return False


async def _ensure_derived_stream(js: JetStreamContext, wanted: api.StreamConfig) -> bool:
    """Create a stream of derived data (`llmgw-kv`, `llmgw-signals`, the counters) if
    absent. One that exists is used as it is unless its subjects differ (or it lacks the
    counters llmgw needs): its limits only decide how long derived data stays."""
    assert wanted.name is not None
    try:
        info = await js.stream_info(wanted.name)
    except nats.js.errors.NotFoundError:
        try:
            await js.add_stream(wanted)
        except nats.js.errors.APIError as exc:
            if exc.err_code != 10058:
                raise ProvisionConflict(
                    f"the server refused to create stream {wanted.name}: {exc.description} "
                    f"(code {exc.err_code}); check the server's JetStream memory limit "
                    "(max_memory_store)"
                ) from None
            return False
        return True
    if sorted(info.config.subjects or []) != sorted(wanted.subjects or []):
        raise ProvisionConflict(
            f"stream {wanted.name} exists with subjects {info.config.subjects} (llmgw needs "
            f"exactly {wanted.subjects}): delete it (`nats stream rm {wanted.name}`; it holds "
            "only derived data) and let llmgw create it again"
        )
    if wanted.allow_msg_counter and not info.config.allow_msg_counter:
        raise ProvisionConflict(
            f"stream {wanted.name} exists without counters (allow_msg_counter), which llmgw "
            f"needs: delete it (`nats stream rm {wanted.name}`) and let llmgw create it again"
        )
    bound, kept = wanted.max_msgs_per_subject or 0, info.config.max_msgs_per_subject or 0
    if bound > 0 and not 0 < kept <= bound:
        # Used as it is (its limits are the operator's), but not without saying what it costs.
        log.warning(
            "stream_unbounded_per_subject",
            stream=wanted.name,
            max_msgs_per_subject=kept,
            wanted=bound,
            risk="one writer's flood can push every other writer's messages out of it",
            action=f"delete it (`nats stream rm {wanted.name}`, derived data only) and let "
            "llmgw create it again",
        )
    return False


async def _ensure_lease_bucket(js: JetStreamContext, replicas: int) -> bool:
    stream = f"KV_{LEASE_BUCKET}"
    try:
        info = await js.stream_info(stream)
    except nats.js.errors.NotFoundError:
        await js.create_key_value(
            bucket=LEASE_BUCKET,
            description="llmgw control-plane leader lease",
            history=1,
            replicas=replicas,
            storage=api.StorageType.FILE,
        )
        return True
    if not info.config.allow_msg_ttl:
        raise ProvisionConflict(
            f"KV bucket {LEASE_BUCKET} exists without per-message TTL (allow_msg_ttl): the lease "
            f"could never expire. Delete it (`nats kv del {LEASE_BUCKET}`) and let llmgw create it."
        )
    return False


async def _ensure_snapshot_store(js: JetStreamContext, replicas: int) -> bool:
    try:
        await js.object_store(SNAPSHOT_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        await js.create_object_store(
            bucket=SNAPSHOT_BUCKET,
            config=api.ObjectStoreConfig(
                bucket=SNAPSHOT_BUCKET,
                description="llmgw folded-state snapshots, named by the sequence they include",
                replicas=replicas,
                storage=api.StorageType.FILE,
            ),
        )
        return True
    return False


async def provision(
    js: JetStreamContext,
    *,
    replicas: int = 1,
    duplicate_window_s: float = 120.0,
    lease: bool = True,
    snapshots: bool = True,
    kv: bool = True,
    signals: bool = True,
    tenancy: bool = True,
) -> Provisioned:
    """Ensure the stream `llmgw-events` (and `llmgw-kv`, `llmgw-signals`, the tenants'
    counters `llmgw-limits` and `llmgw-usage`, the lease bucket and snapshot store) exist.

    Idempotent; raises ProvisionConflict, saying what differs and what to do, when
    the stream exists with a configuration llmgw cannot use.
    """
    settings = StreamSettings(replicas=replicas, duplicate_window_s=duplicate_window_s)
    created: list[str] = []
    existing: list[str] = []

    def note(name: str, was_created: bool) -> None:
        (created if was_created else existing).append(name)

    note(subjects.STREAM, await _ensure_stream(js, stream_config(settings)))
    if kv:
        note(subjects.KV_STREAM, await _ensure_derived_stream(js, kv_stream_config(settings)))
    if signals:
        wanted = signals_stream_config(settings)
        note(subjects.SIGNALS_STREAM, await _ensure_derived_stream(js, wanted))
    if tenancy:
        for wanted in (limits_stream_config(settings), usage_stream_config(settings)):
            assert wanted.name is not None
            try:
                note(wanted.name, await _ensure_derived_stream(js, wanted))
            except ProvisionConflict as exc:
                # Routers then limit keys each by itself (llmgw.router.quotas): a fleet
                # without fleet-wide limits still runs (nats-server before 2.12 has no
                # counters).
                log.warning("tenancy_stream_unavailable", stream=wanted.name, error=str(exc))
    if lease:
        note(LEASE_BUCKET, await _ensure_lease_bucket(js, replicas))
    if snapshots:
        note(SNAPSHOT_BUCKET, await _ensure_snapshot_store(js, replicas))
    if created:
        log.info("provisioned", created=created, existing=existing)
    return Provisioned(created=tuple(created), existing=tuple(existing))
