"""What one node can make every router hold and compute with its KV updates: the names an
update carries are bounded as the log's are, and a refused update never reaches the index."""

from __future__ import annotations

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.bus import kvlog
from llmgw.core import kvblocks, subjects
from llmgw.core.kvindex import KvIndex
from llmgw.core.limits import MAX_NAME
from llmgw.pki.identity import Identity
from llmgw.router.config import LogSource
from llmgw.router.kvfeed import KvFeed
from tests.unit.test_reader_intake import feed, signed_as
from tests.unit.test_signing import VERIFIER, _NoClient

NAMED = ("endpoint", "model", "instance")


def update_with(field: str, value: str, **more: object) -> bytes:
    """A KV update's msgpack with `field` set to `value` (encoded as a map, as an agent
    sends it, without the Struct's own checks)."""
    base: dict[str, object] = {"endpoint": "e1", "model": "m", "block_size": 16,
                               "instance": "i", "seq": 1, **more}  # fmt: skip
    return msgspec.msgpack.encode({**base, field: value})


lengths = st.integers(0, 3 * MAX_NAME).map(lambda n: "é" * n)  # characters, not bytes


@settings(max_examples=200)
@given(field=st.sampled_from(NAMED), name=st.text(max_size=2 * MAX_NAME) | lengths)
def test_an_updates_names_are_accepted_exactly_within_the_bound(field: str, name: str) -> None:
    payload = update_with(field, name)
    if len(name) <= MAX_NAME:
        assert getattr(kvblocks.decode_update(payload), field) == name
    else:
        with pytest.raises(ValueError, match=rf"length <= {MAX_NAME} - at `\$\.{field}`"):
            kvblocks.decode_update(payload)


def test_a_refused_update_leaves_the_routers_index_unchanged() -> None:
    keys = kvblocks.block_keys(list(range(64)), 16)
    good = kvblocks.KvUpdate(endpoint="e1", model="m", block_size=16, instance="i", seq=1,
                             full=True, stored=keys)  # fmt: skip
    long_name = "m" * (MAX_NAME + 1)
    node_a = Identity("node", "a")
    e1, e2 = subjects.kv_updates("a", "e1"), subjects.kv_updates("a", "e2")
    reader = kvlog.KvReader(_NoClient(), verifier=VERIFIER)  # type: ignore[arg-type]
    feed(reader, [
        signed_as(node_a, e1, kvblocks.encode_update(good)),
        # Each would change the index were it folded: e1 emptied, e2 added.
        signed_as(node_a, e1, update_with("model", long_name, full=True, seq=2)),
        signed_as(node_a, e2, update_with("instance", long_name, endpoint="e2", full=True)),
    ])  # fmt: skip
    router = KvFeed(LogSource(servers=("nats://127.0.0.1:1",), name="r1"), KvIndex())
    router.apply(reader._buf)
    assert list(router.index.endpoints) == [("a", "e1")]
    assert router.index.endpoints[("a", "e1")].keys == set(keys)
    assert router.index.endpoints[("a", "e1")].model == "m"
    assert router.index.holders.keys() == set(keys)
    # Counted and logged as every undecodable KV update is, with why.
    assert reader.undecodable == 2
    assert [s.seq for s in reader.skipped] == [2, 3]
    assert "$.model" in reader.skipped[0].error
    assert "$.instance" in reader.skipped[1].error
