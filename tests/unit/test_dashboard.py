"""The Grafana dashboard queries only metrics and labels that llmgw really exports."""

from __future__ import annotations

import json
import re
from pathlib import Path

from prometheus_client import CollectorRegistry

from llmgw.control import metrics as control_metrics
from llmgw.core import fleet_metrics, state
from llmgw.router import metrics as router_metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "llmgw.json"
SUFFIXES = ("_bucket", "_total", "_count", "_sum")


def _exported(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Metric family name -> label names, as Prometheus would scrape them."""
    out: dict[str, set[str]] = {}
    for family in registry.collect():
        labels: set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels) - {"le"}
        out[family.name] = labels
    return out


def _metrics() -> dict[str, set[str]]:
    # The control plane uses prometheus_client; the router its own lightweight metrics
    # (llmgw.router.metrics), whose objects carry their name and label names.
    control = control_metrics.Metrics()
    out = _exported(control.registry)
    # The fleet's families (computed at each scrape), with their label names.
    for family in fleet_metrics.families(state.ClusterState(), {}):
        out[family.name] = set(family.labels)
    for metric in vars(control).values():
        names = getattr(metric, "_labelnames", None)
        name = getattr(metric, "_name", None)
        if names is not None and name is not None:
            out.setdefault(name, set()).update(names)
    for metric in vars(router_metrics.Metrics()).values():
        if hasattr(metric, "kind") and hasattr(metric, "labels"):
            out[metric.name] = set(metric.labels)
    return out


def test_every_query_names_an_exported_metric_and_its_labels() -> None:
    exported = _metrics()
    dashboard = json.loads(DASHBOARD.read_text())
    checked = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for name in re.findall(r"\b(llmgw_[a-z_]+)", expr):
                base = name
                for suffix in SUFFIXES:
                    base = base.removesuffix(suffix)
                assert base in exported, f"{panel['title']}: {name} is not exported"
                for group in re.findall(r"by \(([^)]*)\)", expr):
                    wanted = {g.strip() for g in group.split(",")} - {"le", "instance"}
                    assert wanted <= exported[base], (
                        f"{panel['title']}: {name} has no label(s) {wanted - exported[base]}"
                    )
                checked += 1
    assert checked >= 20


def test_every_variable_a_query_filters_on_is_declared_and_a_label_of_its_metric() -> None:
    """`{model=~"$model"}`: the variable exists in the dashboard's templating, and the label
    is one the metric it filters has."""
    exported = _metrics()
    dashboard = json.loads(DASHBOARD.read_text())
    variables = {v["name"] for v in dashboard["templating"]["list"]}
    filtered = 0
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name, label, var in re.findall(
                r"\b(llmgw_[a-z_]+)\{([a-z_]+)=~\"\$([a-z_]+)\"\}", target["expr"]
            ):
                base = name
                for suffix in SUFFIXES:
                    base = base.removesuffix(suffix)
                assert var in variables, f"{panel['title']}: ${var} is not a variable"
                assert label in exported[base], f"{panel['title']}: {name} has no {label}"
                filtered += 1
    assert filtered >= 10
    (model,) = [v for v in dashboard["templating"]["list"] if v["name"] == "model"]
    source = re.search(r"label_values\((llmgw_[a-z_]+), model\)", model["definition"])
    assert source is not None
    assert "model" in exported[source.group(1)]
