"""Who the operator API and the console take a certificate for (llmgw.operator_https): the
organizational unit decides whether it is an operator's, whatever its common name; the
common name says which person asked, for the log's record of what the console did."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from llmgw import operator_https


def certificate(common: str, unit: str) -> dict[str, Any]:
    """A peer certificate as ssl.getpeercert() returns it."""
    return {"subject": ((("commonName", common),), (("organizationalUnitName", unit),))}


def test_only_the_unit_makes_an_operator_not_a_node_named_operator() -> None:
    assert operator_https.peer_units(certificate("alice", "operator")) == {"operator"}
    assert "operator" not in operator_https.peer_units(certificate("operator", "node"))
    assert operator_https.peer_units(None) == set()


def test_the_person_who_asked_is_the_certificates_common_name() -> None:
    cert = certificate("alice", "operator")
    transport = SimpleNamespace(get_extra_info=lambda name: cert if name == "peercert" else None)
    request: Any = SimpleNamespace(transport=transport)
    assert operator_https.peer_name(request) == "alice"
    assert operator_https.peer_name(SimpleNamespace(transport=None)) == ""  # type: ignore[arg-type]
