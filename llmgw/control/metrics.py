"""The control plane's Prometheus metrics, served at /metrics on its admin listener.

Events applied and rejected by the fold, fold position and lag, decisions
published by kind, leader status and epoch, fenced writes refused, placement
failures by reason, snapshots; and the fleet's state (llmgw.core.fleet_metrics: nodes by
liveness and flag, GPUs by class and state, replicas by model and phase, desired against
serving replicas, unplaceable models), computed from the folded state at each scrape, as
are the autoscaler's signals (from the leader's fresh observations of the catalog's
models: a removed model's, or a stale one's, leave the page). One registry per service
instance, so tests can run several control planes in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from llmgw.core import autoscale, fleet_metrics, state

FleetSource = Callable[[], tuple[state.ClusterState, Mapping[str, str]]]
"""The folded state now and each unplaceable model's refusal code."""
AutoscaleSource = Callable[[], Mapping[str, autoscale.Observation]]
"""The leader's fresh observation of each autoscaled model in the catalog."""
RECONCILE_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
"""A pass over a small fleet takes well under a millisecond, 1,000 nodes tens of them."""
PLACEMENT_BUCKETS = (1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0)
"""A sim starts in a second, vLLM with a large model loads for minutes."""


class Metrics:
    # One declaration per metric family, in the order /metrics lists them: the list a
    # reader of the dashboard looks for, which groups of helpers would only scatter.
    # long: a flat list of metric declarations
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        p = "llmgw_control_"
        self.applied = Counter(p + "events_applied", "Events the fold applied.", registry=r)
        self.rejected = Counter(
            p + "events_rejected",
            "Events the fold refused (logged with their sequence as control.rejected).",
            registry=r,
        )
        self.undecodable = Counter(
            p + "events_undecodable", "Messages of the log that are not llmgw events.", registry=r
        )
        self.folded_seq = Gauge(p + "folded_seq", "Last stream sequence folded.", registry=r)
        self.fold_lag = Gauge(
            p + "fold_lag_seconds",
            "Wall-clock age of the last event folded when it was folded (server store time).",
            registry=r,
        )
        self.decisions = Counter(
            p + "decisions", "Decisions and commands published, by kind.", ["kind"], registry=r
        )
        self.leader = Gauge(p + "leader", "1 while this instance leads, else 0.", registry=r)
        self.clock_offset = Gauge(
            p + "clock_offset_seconds",
            "The NATS server's clock less this host's, measured every few seconds "
            "(0 until measured).",
            registry=r,
        )
        self.epoch = Gauge(p + "epoch", "Leader epoch in the folded state.", registry=r)
        self.fence_refused = Counter(
            p + "fence_refused",
            "Fenced writes the server refused (another leader wrote first).",
            registry=r,
        )
        self.placement_failures = Counter(
            p + "placement_failures",
            "Reconcile passes in which a model's missing replicas could not be placed, by the "
            "most common reason.",
            ["model", "reason"],
            registry=r,
        )
        self.unplaceable = Gauge(
            p + "unplaceable_models", "Models with replicas that cannot be placed now.", registry=r
        )
        self.reconcile_seconds = Gauge(
            p + "reconcile_seconds", "Duration of the last reconcile pass.", registry=r
        )
        self.reconcile_duration = Histogram(
            p + "reconcile_duration_seconds",
            "Duration of each reconcile pass (folded state to decisions, placement included).",
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.placement_seconds = Histogram(
            p + "placement_seconds",
            "From a replica's placement to all its shards serving (engine start and model "
            "load included), per replica this instance saw begin serving.",
            buckets=PLACEMENT_BUCKETS,
            registry=r,
        )
        self.snapshots = Counter(p + "snapshots", "Snapshots saved.", registry=r)
        self.snapshot_seq = Gauge(
            p + "snapshot_seq", "Sequence of the last snapshot saved or loaded.", registry=r
        )

        self.quarantine_ignored = Counter(
            p + "quarantine_ignored",
            "Events of quarantined nodes the fold ignored (registered and shard).",
            registry=r,
        )
        self.quarantine_deleted = Counter(
            p + "quarantine_deleted",
            "Messages of quarantined nodes this leader deleted from the log.",
            registry=r,
        )
        self.ttl_deleted = Counter(
            p + "ttl_refused_deleted",
            "Messages refused for their TTL (only heartbeats expire) this leader deleted.",
            registry=r,
        )
        self.quarantine_delete_failed = Counter(
            p + "quarantine_delete_failed",
            "Deletions of quarantined nodes' messages that failed (retried).",
            registry=r,
        )
        self.quarantined_nodes = Gauge(
            p + "quarantined_nodes", "Nodes quarantined in the folded state.", registry=r
        )

    def export_fleet(self, source: FleetSource) -> None:
        """Export the fleet's state from `source`, called at each scrape."""
        self.registry.register(_Families(lambda: fleet_metrics.families(*source())))

    def export_autoscale(self, source: AutoscaleSource) -> None:
        """Export the autoscaler's signals from `source`, called at each scrape."""
        self.registry.register(_Families(lambda: [autoscale_family(source())]))

    def render(self) -> bytes:
        return generate_latest(self.registry)


def autoscale_family(observations: Mapping[str, autoscale.Observation]) -> fleet_metrics.Family:
    """The autoscaler's signals of each observed model, and the replicas they recommend."""
    samples: fleet_metrics.Samples = []
    for model, obs in sorted(observations.items()):
        s = obs.signals
        for signal, value in (("waiting", s.waiting), ("running", s.running),
                              ("kv_usage", s.kv_usage), ("ttft_p90_s", s.ttft_p90_s),
                              ("itl_p90_s", s.itl_p90_s), ("requests", s.requests),
                              ("recommended", obs.recommended)):  # fmt: skip
            samples.append(((model, signal), float(value)))
    return fleet_metrics.Family(
        "llmgw_control_autoscale_signal",
        "An autoscaled model's signals as the leader last aggregated them from the routers'"
        " load reports (waiting, running, kv_usage, ttft_p90_s, itl_p90_s, requests), and"
        " the replicas they recommend (recommended); only while fresh, and only for models"
        " in the catalog.",
        ("model", "signal"),
        samples,
    )


class _Families(Collector):
    """Gauge families computed at each scrape."""

    def __init__(self, source: Callable[[], Iterable[fleet_metrics.Family]]) -> None:
        self._source = source

    def describe(self) -> list[GaugeMetricFamily]:
        # Described as nothing: the registry would otherwise call collect() on register.
        return []

    def collect(self) -> Iterator[GaugeMetricFamily]:
        for family in self._source():
            out = GaugeMetricFamily(family.name, family.help, labels=family.labels)
            for labels, value in family.samples:
                out.add_metric(labels, value)
            yield out
