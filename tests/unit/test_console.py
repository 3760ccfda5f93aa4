"""The console's pure parts: the event list's filters and a write's fields (Hypothesis:
whatever a page or an attacker sends, a valid tuple or a BadInput, nothing else)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmgw.ctl.console import server, views
from llmgw.ctl.errors import BadInput

names = st.sampled_from(["node-a", "node-b", "r1", "r2", "m1", "m2", ""])
rows = st.lists(
    st.fixed_dictionaries(
        {
            "seq": st.integers(1, 10_000),
            "type": st.sampled_from(
                [
                    "node.registered",
                    "node.shard",
                    "control.replica_placed",
                    "operator.node_cordoned",
                ]
            ),
            "family": st.just("node"),
            "nodes": st.lists(st.sampled_from(["node-a", "node-b"]), max_size=2, unique=True),
            "replicas": st.lists(st.sampled_from(["r1", "r2"]), max_size=2, unique=True),
            "model": st.sampled_from(["", "m1", "m2"]),
        }
    ),
    max_size=30,
)


@given(
    rows,
    names,
    names,
    names,
    st.sampled_from(["", "node", "shard", "control", "operator.node_cordoned", "x"]),
)
def test_the_filters_keep_exactly_the_rows_that_match_every_one(
    found: list[dict[str, Any]], node: str, model: str, replica: str, kind: str
) -> None:
    kept = views.matching(found, node=node, model=model, replica=replica, type_filter=kind)

    def ok(r: dict[str, Any]) -> bool:
        family, _, rest = r["type"].partition(".")
        return (
            (not node or node in r["nodes"])
            and (not model or r["model"] == model)
            and (not replica or replica in r["replicas"])
            and (not kind or kind in (r["type"], family, rest))
        )

    assert kept == [r for r in found if ok(r)]


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=600),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


@given(st.dictionaries(st.sampled_from(["reason", "grace_s", "dry_run", "other"]), json_values))
def test_a_writes_fields_are_valid_or_a_bad_input(body: dict[str, Any]) -> None:
    try:
        reason, grace, dry_run = server._action_fields(body)
    except BadInput as exc:
        said = str(exc)  # a sentence for the page, never an empty message
        assert said.split()[0] in ("reason", "grace_s", "dry_run"), said
        return
    assert isinstance(reason, str)
    assert len(reason) <= 500
    assert 0 <= grace <= server.MAX_GRACE_S
    assert isinstance(dry_run, bool)


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({"grace_s": float("nan")}, "grace_s"),
        ({"grace_s": float("inf")}, "grace_s"),
        ({"grace_s": "600"}, "grace_s"),
        ({"dry_run": 1}, "dry_run"),
        ({"reason": None}, "reason"),
    ],
)
def test_values_a_page_would_never_send_are_refused(body: dict[str, Any], said: str) -> None:
    with pytest.raises(BadInput, match=said):
        server._action_fields(body)
