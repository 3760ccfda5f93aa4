"""The simulated engine's scheduler, driven by hand with time passed in (no sleeping)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from llmgw.core import simtokens as tokens
from llmgw.sim.config import LatencyModel, SimConfig
from llmgw.sim.engine import Engine, Request


def make(**kw: object) -> Engine:
    base: dict[str, object] = {"block_size": 4, "num_blocks": 64, "max_model_len": 256}
    base.update(kw)
    return Engine(SimConfig(**base))  # type: ignore[arg-type]


def prompt(n: int, tag: str = "p") -> list[str]:
    return [f" {tag}{i}" for i in range(n)]


def req(p: list[str], max_tokens: int = 4, rid: str = "r", seed: int = 1, **kw: object) -> Request:
    return Request(rid, list(p), max_tokens=max_tokens, arrival=0.0, seed=seed, **kw)  # type: ignore[arg-type]


def run(engine: Engine, now: float = 0.0, limit: int = 10_000) -> float:
    """Step until idle; returns the time it ended."""
    for _ in range(limit):
        if not engine.has_work:
            return now
        now += engine.step(now)
    raise AssertionError("engine did not finish")


def test_a_request_generates_max_tokens_and_frees_its_blocks() -> None:
    e = make()
    r = req(prompt(10), max_tokens=5)
    e.add(r)
    run(e)
    assert r.finished
    assert r.finish_reason == "length"
    assert r.num_generated == 5
    assert len(r.pieces) == 5
    assert e.pool.num_used == 0
    assert e.stats.generation_tokens == 5
    assert e.stats.prompt_tokens == 10
    assert e.stats.request_success["length"] == 1
    e.pool.check()


def test_natural_end_finishes_with_stop() -> None:
    e = make()
    r = req(prompt(3), max_tokens=50, eos_at=7)
    e.add(r)
    run(e)
    assert (r.finish_reason, r.num_generated) == ("stop", 7)


def test_same_seed_gives_the_same_text_and_another_seed_does_not() -> None:
    texts = []
    for seed in (5, 5, 6):
        e = make()
        r = req(prompt(3), max_tokens=20, seed=seed)
        e.add(r)
        run(e)
        texts.append("".join(r.pieces))
    assert texts[0] == texts[1]
    assert texts[0] != texts[2]


def test_batch_size_is_bounded_and_the_rest_waits() -> None:
    e = make(max_num_seqs=2)
    rs = [req(prompt(3, f"q{i}"), max_tokens=3, rid=str(i)) for i in range(5)]
    for r in rs:
        e.add(r)
    e.step(0.0)
    assert len(e.running) == 2
    assert len(e.waiting) == 3
    run(e)
    assert all(r.finished for r in rs)
    # Continuous batching: the third request started as soon as a slot freed up.
    assert rs[2].first_scheduled is not None


def test_decode_latency_grows_with_the_batch() -> None:
    lat = LatencyModel(decode_base_ms=2.0, decode_per_seq_ms=1.0)
    e = make(latency=lat)
    e.add(req(prompt(3, "a"), max_tokens=10, rid="a"))
    e.step(0.0)
    one = e.step(1.0)
    for i in range(3):
        e.add(req(prompt(3, f"b{i}"), max_tokens=10, rid=f"b{i}"))
    e.step(2.0)
    four = e.step(3.0)
    assert one == 0.003
    assert four == 0.006


def test_prefix_cache_hit_skips_prefill_time() -> None:
    lat = LatencyModel(prefill_per_token_ms=1.0)
    e = make(latency=lat)
    p = prompt(41)
    first = req(p, max_tokens=1, rid="1")
    e.add(first)
    d1 = e.step(0.0)
    run(e, d1)
    second = req(p, max_tokens=1, rid="2")
    e.add(second)
    d2 = e.step(10.0)
    assert first.cached_tokens == 0
    # 41 tokens in blocks of 4: 10 full blocks, all cached; the 41st token is computed.
    assert second.cached_tokens == 40
    assert d1 == 0.041
    assert abs(d2 - 0.001) < 1e-12
    assert e.stats.prefix_cache_queries == 82
    assert e.stats.prefix_cache_hits == 40


def test_a_fully_cached_prompt_still_computes_its_last_block() -> None:
    e = make()
    p = prompt(16)
    for rid in ("1", "2"):
        r = req(p, max_tokens=1, rid=rid)
        e.add(r)
        run(e)
    assert r.cached_tokens == 12  # vLLM: at least one token is always computed


def test_a_different_first_block_means_no_hit_even_when_later_blocks_match() -> None:
    e = make()
    p = prompt(40)
    e.add(req(p, max_tokens=1, rid="1"))
    run(e)
    other = [" different", *p[1:]]
    r = req(other, max_tokens=1, rid="2")
    e.add(r)
    run(e)
    assert r.cached_tokens == 0


def test_lru_evicts_old_prefixes_under_pressure() -> None:
    e = make(num_blocks=16, max_model_len=64)
    old = prompt(24, "old")
    e.add(req(old, max_tokens=1, rid="old"))
    run(e)
    # Unrelated traffic that needs every block evicts the old prefix.
    for i in range(3):
        e.add(req(prompt(40, f"n{i}"), max_tokens=1, rid=f"n{i}"))
        run(e)
    again = req(old, max_tokens=1, rid="again")
    e.add(again)
    run(e)
    assert again.cached_tokens == 0
    assert e.pool.evictions > 0
    e.pool.check()


def test_recently_used_prefix_survives_eviction() -> None:
    e = make(num_blocks=16, max_model_len=64)
    hot = prompt(12, "hot")
    for i in range(3):
        e.add(req(hot, max_tokens=1, rid=f"hot{i}"))
        run(e)
        # Each unrelated request needs 7 blocks: the 9 other free ones (the LRU end) go first.
        e.add(req(prompt(24, f"n{i}"), max_tokens=1, rid=f"n{i}"))
        run(e)
    last = req(hot, max_tokens=1, rid="last")
    e.add(last)
    run(e)
    assert last.cached_tokens == 8


def test_head_of_line_blocking_when_blocks_run_out() -> None:
    # 8 blocks of 4 tokens = 32 token slots.
    e = make(num_blocks=8, max_model_len=32)
    big = req(prompt(20, "big"), max_tokens=8, rid="big")  # 6 blocks at admission
    e.add(big)
    e.step(0.0)
    blocker = req(prompt(12, "b"), max_tokens=2, rid="blocker")  # needs 4 blocks: waits
    small = req(prompt(2, "s"), max_tokens=2, rid="small")  # would fit, but queues behind
    e.add(blocker)
    e.add(small)
    e.step(1.0)
    assert [r.rid for r in e.waiting] == ["blocker", "small"]
    assert e.running == [big]
    run(e, 2.0)
    assert blocker.finished
    assert small.finished
    assert big.finished
    assert blocker.first_scheduled is not None
    assert small.first_scheduled is not None
    assert blocker.first_scheduled <= small.first_scheduled
    assert e.pool.num_used == 0


def test_preemption_when_decode_runs_out_of_blocks() -> None:
    e = make(num_blocks=8, max_model_len=32)
    a = req(prompt(6, "a"), max_tokens=20, rid="a", eos_at=None)
    b = req(prompt(6, "b"), max_tokens=20, rid="b", eos_at=None)
    e.add(a)
    e.add(b)
    run(e)
    assert a.finished
    assert b.finished
    assert a.num_generated == b.num_generated == 20
    assert e.stats.preemptions >= 1
    assert b.preemptions >= 1  # the later request is the victim
    assert e.pool.num_used == 0
    e.pool.check()


def test_abort_frees_blocks_at_once_from_the_batch_and_the_queue() -> None:
    e = make(num_blocks=8, max_model_len=32, max_num_seqs=1)
    a = req(prompt(10, "a"), max_tokens=10, rid="a")
    b = req(prompt(10, "b"), max_tokens=10, rid="b")
    e.add(a)
    e.add(b)
    e.step(0.0)
    assert e.pool.num_used > 0
    e.abort(b, 0.5)
    e.abort(a, 0.5)
    assert e.pool.num_used == 0
    assert not e.has_work
    assert e.stats.request_success["abort"] == 2
    e.abort(a, 0.6)  # a second abort is harmless
    assert e.stats.request_success["abort"] == 2


def test_stop_string_truncates_and_holds_back_a_possible_prefix() -> None:
    e = make()
    probe = req(prompt(3), max_tokens=30, seed=9)
    e.add(probe)
    run(e)
    words = probe.pieces
    stop = words[5] + words[6]  # spans two tokens
    r = req(prompt(3), max_tokens=30, seed=9, stops=(stop,))
    e.add(r)
    seen_emits = []
    now = 0.0
    while e.has_work:
        now += e.step(now)
        seen_emits.append("".join(r.pieces[: r.emit]))
    assert r.finish_reason == "stop"
    assert "".join(r.pieces) == "".join(words[:5])
    assert r.num_generated == 7  # usage counts the tokens the stop string cut
    assert all(stop not in s for s in seen_emits)


def test_ttft_and_itl_are_measured_on_the_engine_clock() -> None:
    lat = LatencyModel(decode_base_ms=10.0)
    e = make(latency=lat)
    r = req(prompt(3), max_tokens=3)
    e.add(r)
    run(e)
    assert r.first_token_at == 0.01
    assert e.stats.ttft.count == 1
    assert e.stats.itl.count == 2
    assert abs(e.stats.itl.sum - 0.02) < 1e-9


@settings(max_examples=150, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "add", "step", "step", "step", "abort"]),
            st.integers(1, 40),
            st.integers(0, 3),
        ),
        max_size=120,
    )
)
def test_any_workload_keeps_blocks_exact_and_ends_with_none_in_use(
    ops: list[tuple[str, int, int]],
) -> None:
    e = make(num_blocks=16, max_model_len=64, max_num_seqs=3)
    live: list[Request] = []
    now = 0.0
    for i, (op, n, k) in enumerate(ops):
        if op == "add":
            # Few distinct prefixes, so the prefix cache gets hits and shared blocks.
            p = prompt(min(n, 50), f"t{k}")
            r = req(p, max_tokens=min(64 - len(p), 1 + n % 13), rid=str(i), seed=k)
            e.add(r)
            live.append(r)
        elif op == "step":
            now += e.step(now) + 0.001
        elif live:
            e.abort(live.pop(n % len(live)), now)
        e.pool.check()
        held = sum(len(r.blocks) for r in e.running)
        # Shared prefix blocks count once in the pool, once per holder here.
        assert e.pool.num_used <= held
        assert all(not r.blocks for r in e.waiting)
        assert len(e.running) <= 3
    run(e, now)
    assert e.pool.num_used == 0
    assert all(r.finished for r in live)
    s = e.stats
    assert sum(s.request_success.values()) == len([op for op, _, _ in ops if op == "add"])


def test_tokenizer_is_lossless_and_generated_words_are_single_tokens() -> None:
    text = "Hello,  world!\n\tInternationalization — ok?"
    assert "".join(tokens.tokenize(text)) == text
    g = tokens.Generator(3)
    out = "".join(g.next_token() for _ in range(50))
    assert tokens.count(out) == 50


@given(st.text())
def test_tokenizer_round_trips_any_text(text: str) -> None:
    assert "".join(tokens.tokenize(text)) == text
