"""deploy/prometheus/llmgw-alerts.yml: promtool accepts it and its unit tests pass, and every
metric and label its expressions use is one llmgw exports."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.kit import tools
from tests.unit.test_dashboard import SUFFIXES, _metrics

RULES = Path(__file__).resolve().parents[2] / "deploy" / "prometheus" / "llmgw-alerts.yml"
# Labels Prometheus adds at scrape time, and the histogram bucket label.
SCRAPE_LABELS = {"instance", "job", "le"}


@pytest.mark.parametrize(
    "args",
    [
        ["check", "rules", RULES.name],
        ["test", "rules", "llmgw-alerts.test.yml"],
        ["check", "config", "prometheus.yml"],  # the example scrape config, with its rules
    ],
)
def test_promtool_checks_and_tests_the_rules(args: list[str]) -> None:
    out = subprocess.run(
        [tools.required("promtool", "apt-get install prometheus"), *args],
        cwd=RULES.parent,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_rule_names_exported_metrics_and_labels() -> None:
    exported = _metrics()
    rules = [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]]
    assert len(rules) >= 10
    for rule in rules:
        expr = rule["expr"]
        names = re.findall(r"\b(llmgw_[a-z_]+)", expr)
        assert names, rule["alert"]
        for name in names:
            base = name
            for suffix in SUFFIXES:
                base = base.removesuffix(suffix)
            assert base in exported, f"{rule['alert']}: {name} is not exported"
        wanted = set()
        for group in re.findall(r"by \(([^)]*)\)", expr):
            wanted |= {g.strip() for g in group.split(",")}
        wanted |= set(re.findall(r"\{([a-z_]+)=", expr))
        known = set().union(*(exported[n] for n in exported if n in expr)) | SCRAPE_LABELS
        assert wanted <= known, f"{rule['alert']}: no label(s) {wanted - known}"
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
