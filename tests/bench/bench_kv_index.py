"""What routing to the cache costs per request, and what the fleet KV index costs in memory.

    .venv/bin/python tests/bench/bench_kv_index.py

Per request (a chat request with a 1,200-token system prompt and a 40-token question):
tokenizing it as the sim does, from scratch and with the system prompt seen before (a new
question each call, as on the shared-prefix workload; llmgw.core.promptkeys), and with a
Hugging Face BPE tokenizer (trained here, in-process, with a chat template), keying its
blocks (llmgw.core.kvblocks.block_keys), and matching the keys against the index
(llmgw.core.kvindex) with 3, 100 and 1,000 endpoints holding blocks; the whole plan
(llmgw.router.kvroute) for 3 endpoints, from scratch and with the system prompt seen; the
text index's hashes (llmgw.core.prefix), likewise. Then
the index's memory per million resident blocks (tracemalloc), and the cost of folding one
agent's update.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from llmgw.core import kvblocks, routing  # noqa: E402
from llmgw.core.kvindex import KvIndex  # noqa: E402
from llmgw.core.prefix import ChatHashes, block_hashes  # noqa: E402
from llmgw.core.profile import ModelProfile  # noqa: E402
from llmgw.router import prompts  # noqa: E402
from llmgw.router.kvroute import KvRouting  # noqa: E402
from llmgw.router.requests import parse  # noqa: E402

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def per_call_us(fn: Callable[[], object], n: int) -> float:
    fn()
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def hf_tokenizer(folder: Path, corpus: list[str]) -> prompts.HfPrompts:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel()
    tok.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=8000, special_tokens=["</s>", "[UNK]"])
    )
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    return prompts.HfPrompts.load(folder)


def main() -> None:
    rng = random.Random(1)
    words = [f"w{i:04d}" for i in range(5000)]
    system = "".join(" " + rng.choice(words) for _ in range(1200))
    question = "".join(" " + rng.choice(words) for _ in range(40))
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    body = json.dumps({"model": "m", "messages": messages})
    parsed = parse("chat", body.encode(), want_text=True)
    sim = prompts.for_profile(ModelProfile(name="m", engine="sim"))
    assert sim is not None
    ids = list(sim.ids(parsed) or [])
    print(f"request: {len(ids)} tokens (sim tokenizer), {len(body):,} bytes of JSON")
    # The same system prompt with a new question each call, as on the shared-prefix
    # workload: what the router has seen before is the system prompt, not the request.
    asked = iter(
        [
            parse("chat", json.dumps({"model": "m", "messages": [messages[0], {
                "role": "user", "content": "".join(" " + rng.choice(words) for _ in range(40))
            }]}).encode(), want_text=True)
            for _ in range(4000)
        ]
    )  # fmt: skip
    rows: list[tuple[str, str]] = []
    cold = per_call_us(lambda: prompts.SimPrompts().ids(parsed), 200)
    rows.append(("tokenize, sim tokenizer, nothing seen before", f"{cold:,.0f} µs"))
    seen = per_call_us(lambda: sim.ids(next(asked)), 200)
    rows.append(("tokenize, sim tokenizer, system prompt seen, new question", f"{seen:,.0f} µs"))
    with tempfile.TemporaryDirectory() as tmp:
        hf = hf_tokenizer(Path(tmp), [system, question] * 20)
        hf_ids = hf.ids(parsed) or []
        rows.append((f"tokenize, BPE + chat template ({len(hf_ids)} tokens)",
                     f"{per_call_us(lambda: hf.ids(parsed), 200):,.0f} µs"))  # fmt: skip
    rows.append(("block keys, 16-token blocks, nothing keyed before",
                 f"{per_call_us(lambda: kvblocks.block_keys(ids, 16), 500):,.0f} µs"))  # fmt: skip

    def seen_keys() -> object:
        got = sim.tokens(next(asked))
        assert got is not None
        return got.keys(16)

    rows.append(("tokenize and key, system prompt seen and keyed, new question",
                 f"{per_call_us(seen_keys, 200):,.0f} µs"))  # fmt: skip
    keys = kvblocks.block_keys(ids, 16)
    for n_eps in (3, 100, 1000):
        index = KvIndex()
        for e in range(n_eps):
            held = keys if e == 0 else kvblocks.block_keys([e, *ids[1:]], 16)
            update = kvblocks.KvUpdate(endpoint=f"e{e}", model="m", block_size=16,
                                       instance="i", seq=1, full=True, stored=held)  # fmt: skip
            index.apply(update, f"n{e}", 0.0)
        cands = [(f"e{e}", f"n{e}") for e in range(n_eps)]

        def match(index: KvIndex = index, cands: list[tuple[str, str]] = cands) -> object:
            return index.match(lambda _s: keys, cands, 1.0)

        rows.append(
            (f"match against the index, {n_eps} endpoints", f"{per_call_us(match, 200):,.1f} µs")
        )
    kv = KvRouting()
    eps = [routing.EndpointState(id=f"e{i}", url="u", models=frozenset({"m"}), ready=True,
                                 node=f"n{i}") for i in range(3)]  # fmt: skip
    for i in range(3):
        held = keys if i == 0 else []
        full = kvblocks.KvUpdate(
            endpoint=f"e{i}", model="m", block_size=16, instance="i", seq=1, full=True, stored=held
        )
        kv.index.apply(full, f"n{i}", time.time())
    profile = ModelProfile(name="m", engine="sim")

    assert isinstance(sim, prompts.SimPrompts)

    def cold_plan() -> object:
        sim.cache = prompts.SimPrompts().cache  # forget every prompt seen
        return kv.plan(parsed, profile, eps)

    rows.append(("whole plan (tokenize, key, match, recent, families), 3 endpoints, "
                 "nothing seen before", f"{per_call_us(cold_plan, 200):,.0f} µs"))  # fmt: skip
    seen = per_call_us(lambda: kv.plan(next(asked), profile, eps), 200)
    rows.append(("whole plan, 3 endpoints, system prompt seen, new question", f"{seen:,.0f} µs"))
    # The text index's hashes (llmgw.core.prefix), which the router computes too.
    text_cold = per_call_us(lambda: block_hashes(parsed.text, 256, 128), 500)
    rows.append(("text index hashes (256-char blocks), from scratch", f"{text_cold:,.0f} µs"))
    chat_hashes = ChatHashes()

    def text_seen() -> object:
        p = next(asked)
        return chat_hashes.hashes(p.chat, p.text, 256, 128)

    text_warm = per_call_us(text_seen, 200)
    rows.append(("text index hashes, system prompt seen, new question", f"{text_warm:,.0f} µs"))

    # Memory: 1,000,000 resident blocks over 100 endpoints, half of them shared by two.
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = KvIndex()
    per = 10_000
    for e in range(100):
        base = (e // 2) * per * 2
        stored = list(range(base + (e % 2) * per // 2, base + (e % 2) * per // 2 + per))
        for i in range(0, per, kvblocks.MAX_KEYS_PER_UPDATE):
            index.apply(kvblocks.KvUpdate(endpoint=f"e{e}", model="m", block_size=16,
                                          instance="i", seq=1 + i // kvblocks.MAX_KEYS_PER_UPDATE,
                                          full=i == 0,
                                          stored=[k * 2654435761 % (1 << 64) for k in
                                                  stored[i:i + kvblocks.MAX_KEYS_PER_UPDATE]]),
                        f"n{e}", 0.0)  # fmt: skip
    resident = sum(len(ep.keys) for ep in index.endpoints.values())
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    per_million = used / resident * 1e6 / 2**20
    rows.append((f"index memory, {resident:,} resident blocks ({len(index):,} distinct keys)",
                 f"{per_million:,.0f} MiB per million resident blocks"))  # fmt: skip

    # Folding one update: a delta of 8 stored and 8 removed keys, decoded from msgpack.
    index = KvIndex()
    index.apply(kvblocks.KvUpdate(endpoint="e", model="m", block_size=16, instance="i", seq=1,
                                  full=True, stored=list(range(50_000))), "n", 0.0)  # fmt: skip
    seq = [1]

    def fold_one() -> None:
        seq[0] += 1
        k = seq[0] * 8
        stored = list(range(10**6 + k, 10**6 + k + 8))
        removed = list(range(k - 8, k))
        update = kvblocks.KvUpdate(endpoint="e", model="m", block_size=16, instance="i",
                                   seq=seq[0], stored=stored, removed=removed)  # fmt: skip
        payload = kvblocks.encode_update(update)
        index.apply(kvblocks.decode_update(payload), "n", 0.0)

    rows.append(("fold one relayed update (8 stored, 8 removed; encode + decode + apply)",
                 f"{per_call_us(fold_one, 2000):,.1f} µs"))  # fmt: skip
    width = max(len(r[0]) for r in rows)
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")


if __name__ == "__main__":
    main()
