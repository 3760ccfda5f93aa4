"""What an engine relay (llmgw.agent.kvrelay) tells routers: a restarted engine is started
over however few batches it sent before, a malformed batch number is refused, and the
deltas and full updates carry exactly what the engine holds. No sockets: batches are fed
as the engine's frames, updates collected from the relay's `send`."""

from __future__ import annotations

import pytest

from llmgw.agent.kvrelay import EngineRelay, KvRelays
from llmgw.agent.shards import ShardView
from llmgw.core import kvblocks
from llmgw.sim import kvevents

BS = 4


def _stored(block: int, parent: int | None = None) -> dict[str, object]:
    return {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": parent,
            "token_ids": [block % 50_000] * BS, "block_size": BS, "lora_id": None,
            "medium": "GPU", "lora_name": None}  # fmt: skip


def _removed(block: int) -> dict[str, object]:
    return {"type": "BlockRemoved", "block_hashes": [block], "medium": "GPU"}


def _frames(seq: int, *wire: dict[str, object]) -> list[bytes]:
    return [b"kv", seq.to_bytes(8, "big", signed=True), kvevents.encode_batch(1.0, list(wire))]


class Sent:
    def __init__(self) -> None:
        self.updates: list[kvblocks.KvUpdate] = []

    async def __call__(self, update: kvblocks.KvUpdate) -> None:
        self.updates.append(update)


def _relay(sent: Sent | None = None) -> EngineRelay:
    return EngineRelay(endpoint="e", model="m", events_addr="ipc:///nonexistent",
                       replay_addr="", send=sent or Sent())  # fmt: skip


async def test_an_engine_restarted_after_two_batches_is_started_over() -> None:
    relay = _relay()
    await relay._on_frames(_frames(0, _stored(1)))
    await relay._on_frames(_frames(1, _stored(2, 1)))
    first = relay.instance
    await relay._on_frames(_frames(0, _stored(7)))  # a new engine counts from 0 again
    assert relay.instance != first
    assert relay.last_engine_seq == 0
    assert len(relay.blocks) == 1  # only what the new engine stored


async def test_a_batch_number_not_of_8_bytes_is_a_bad_batch() -> None:
    relay = _relay()
    await relay._on_frames(_frames(0, _stored(1)))
    short = [b"kv", (1).to_bytes(4, "big"), kvevents.encode_batch(1.0, [_stored(2, 1)])]
    await relay._on_frames(short)
    assert relay.bad_batches == 1
    assert (relay.last_engine_seq, len(relay.blocks)) == (0, 1)


async def test_a_gap_of_one_batch_is_counted() -> None:
    relay = _relay()  # no replay socket: the missing batch cannot be had
    await relay._on_frames(_frames(0, _stored(1)))
    await relay._on_frames(_frames(2, _stored(3)))
    assert (relay.gaps, relay.last_engine_seq) == (1, 2)


def _keys(relay: EngineRelay) -> list[int]:
    return list(relay.blocks.held)


async def test_a_block_stored_then_removed_between_two_deltas_is_in_neither() -> None:
    sent = Sent()
    relay = _relay(sent)
    await relay._on_frames(_frames(0, _stored(1)))
    await relay._publish_full()
    await relay._on_frames(_frames(1, _stored(2, 1)))
    (k2,) = [k for k in _keys(relay) if k != sent.updates[0].stored[0]]
    await relay._on_frames(_frames(2, _removed(2)))
    await relay._flush()
    assert len(sent.updates) == 1  # nothing changed for routers: no delta at all
    # Removed, then stored again: a delta that stores it, and does not remove it.
    await relay._on_frames(_frames(3, _stored(2, 1)))
    await relay._flush()
    await relay._on_frames(_frames(4, _removed(2)))
    await relay._on_frames(_frames(5, _stored(2, 1)))
    await relay._flush()
    last = sent.updates[-1]
    assert (last.full, last.stored, last.removed) == (False, [k2], [])


async def test_a_delta_of_removals_only_is_sent() -> None:
    sent = Sent()
    relay = _relay(sent)
    await relay._on_frames(_frames(0, _stored(1), _stored(2, 1)))
    await relay._publish_full()
    held = set(sent.updates[0].stored)
    await relay._on_frames(_frames(1, _removed(2)))
    await relay._flush()
    (delta,) = sent.updates[1:]
    assert delta.stored == []
    assert len(delta.removed) == 1
    assert set(delta.removed) == held - set(_keys(relay))


async def test_updates_carry_the_engines_block_size_and_the_families_it_begins() -> None:
    sent = Sent()
    relay = _relay(sent)
    await relay._on_frames(_frames(0, _stored(1), _stored(2, 1), _stored(9)))
    await relay._publish_full()
    (full,) = sent.updates
    assert full.block_size == BS
    assert full.full
    assert sorted(full.roots) == sorted(relay.blocks.roots)
    assert len(full.roots) == 2  # blocks 1 and 9 begin prompts; 2 follows 1
    assert set(full.roots) < set(full.stored)


async def test_everything_cleared_makes_the_next_update_a_full_one() -> None:
    relay = _relay()
    await relay._on_frames(_frames(0, _stored(1)))
    await relay._publish_full()
    assert not relay._full_due
    await relay._on_frames(_frames(1, {"type": "AllBlocksCleared"}))
    assert relay._full_due
    assert len(relay.blocks) == 0


async def test_a_full_set_larger_than_one_update_goes_in_chunks_the_first_full(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(kvblocks, "MAX_KEYS_PER_UPDATE", 2)
    sent = Sent()
    relay = _relay(sent)
    chain = [_stored(1)] + [_stored(b, b - 1) for b in range(2, 6)]  # 5 blocks
    await relay._on_frames(_frames(0, *chain))
    await relay._publish_full()
    assert [(u.full, len(u.stored)) for u in sent.updates] == [(True, 2), (False, 2), (False, 1)]
    assert sorted(k for u in sent.updates for k in u.stored) == sorted(_keys(relay))
    assert [u.seq for u in sent.updates] == [1, 2, 3]  # consecutive: a router follows them


async def test_a_stopped_engine_is_told_to_routers_as_an_empty_full_update() -> None:
    sent = Sent()
    relay = _relay(sent)
    await relay._on_frames(_frames(0, _stored(1)))
    await relay._publish_full()
    await relay.stop()
    last = sent.updates[-1]
    assert (last.full, last.stored, last.removed) == (True, [], [])
    # An agent closing leaves its engines running: it tells routers nothing.
    quiet = Sent()
    other = _relay(quiet)
    await other._on_frames(_frames(0, _stored(1)))
    await other.stop(tell=False)
    assert quiet.updates == []


async def test_each_generation_of_an_engine_has_its_relay_and_a_stopped_one_tells_routers() -> None:
    relays = KvRelays()  # not bound: what it would send is counted as dropped

    def view(generation: int, phase: str) -> ShardView:
        return ShardView(replica_id="r1", generation=generation, shard=0, phase=phase,  # type: ignore[arg-type]
                         model="m", kv_events="ipc:///nonexistent/e", kv_replay="")  # fmt: skip

    try:
        await relays.observe(view(1, "serving"))
        await relays.observe(view(2, "starting"))  # the replacement, beside it
        assert set(relays.relays) == {("r1", 1), ("r1", 2)}
        relays.relays[("r1", 1)].block_size = BS  # it had told routers of its blocks
        await relays.observe(view(1, "stopped"))
        assert set(relays.relays) == {("r1", 2)}
        assert relays.dropped == 1  # the empty full update of the stopped engine
    finally:
        await relays.close()
    assert relays.dropped == 1  # an agent closing tells routers nothing
