"""`llmgw ctl usage`'s arithmetic: the fleet's hourly usage counters summed per key and model.

Pure: llmgw.cli.ctl_keys reads the counters (llmgw.bus.counters.totals) and prints.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from llmgw.core import subjects, tenancy
from llmgw.core.state import KeyState


def rows(
    totals: Mapping[str, int], keys: Mapping[str, KeyState], since_hour: int
) -> list[dict[str, Any]]:
    """One row per (key, model) with usage in hours >= `since_hour`, sorted by key, model;
    a key no longer in the log keeps its rows (team unknown)."""
    sums: dict[tuple[str, str], dict[str, int]] = {}
    for subject, n in totals.items():
        parts = subjects.usage_parts(subject)
        if parts is None:
            continue
        key, hour, model, what = parts
        if hour < since_hour:
            continue
        row = sums.setdefault((key, model), {"in": 0, "out": 0, "req": 0})
        row[what] += n
    out = []
    for (key, model), c in sorted(sums.items()):
        state = keys.get(key)
        out.append({
            "key": key, "team": state.settings.team if state is not None else "",
            "model": model, "requests": c["req"], "tokens_in": c["in"], "tokens_out": c["out"],
        })  # fmt: skip
    return out


def budgets(
    totals: Mapping[str, int], keys: Mapping[str, KeyState], now: float
) -> list[dict[str, Any]]:
    """Each budgeted key's use of its current period."""
    out = []
    for name in sorted(keys):
        s = keys[name].settings
        if not s.budget_tokens:
            continue
        period = tenancy.period_of(now, s.budget_period)
        used = totals.get(subjects.budget_counter(name, period), 0)
        out.append({
            "key": name, "period": period, "used": used, "budget": s.budget_tokens,
            "left": max(0, s.budget_tokens - used),
            "renews_at": tenancy.period_end(now, s.budget_period),
        })  # fmt: skip
    return out
