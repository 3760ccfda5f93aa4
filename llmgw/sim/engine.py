"""The simulated engine: a continuous-batching scheduler over the KV block pool.

`Engine.step(now)` is one forward pass. Running sequences each get room for one
more token (a sequence that cannot get a block preempts the most recently
admitted one, as vLLM does: its blocks are freed and it waits again at the head
of the queue, to be prefilled anew — often straight from the prefix cache).
Then, unless something was preempted, waiting requests are admitted in arrival
order while the batch has room (`max_num_seqs`) and the pool has blocks for the
whole prompt: the first request that does not fit blocks those behind it
(head-of-line), exactly the behaviour a router has to see. Admission finds the
longest cached prefix; only the rest of the prompt costs prefill time. The step's
duration comes from the latency model; every scheduled sequence gains one token
stamped with the step's end, and sequences that are done release their blocks.

Time is an argument and nothing here sleeps or does I/O: `llmgw.sim.server`
drives the engine from its event loop, unit tests drive it by hand.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from llmgw.core import simtokens as tokens
from llmgw.sim.config import SimConfig
from llmgw.sim.kvcache import Block, BlockPool
from llmgw.sim.stats import Stats

WAITING, RUNNING, FINISHED = 0, 1, 2


class Request:
    """One generation request as the engine sees it.

    `pieces[:emit]` is the output text that may be sent to the client: with stop
    strings, the last few characters are held back until it is clear they do not
    begin a stop string (vLLM does the same). `num_generated` counts every token
    the model produced, including any a stop string cut from the text; that is
    what `usage.completion_tokens` and the metrics report.
    """

    __slots__ = (
        "arrival",
        "blocks",
        "cached_tokens",
        "emit",
        "emit_chars",
        "eos_at",
        "finish_reason",
        "finished_at",
        "first_scheduled",
        "first_token_at",
        "gen",
        "hashes",
        "last_token_at",
        "max_tokens",
        "num_generated",
        "num_prompt",
        "pieces",
        "preemptions",
        "rid",
        "root",
        "salt",
        "state",
        "stop_hold",
        "stops",
        "text",
        "tokens",
        "told_waiting",
        "touched",
        "waiter",
    )

    def __init__(
        self,
        rid: str,
        prompt: list[str],
        *,
        max_tokens: int,
        arrival: float,
        seed: int,
        eos_at: int | None = None,
        stops: tuple[str, ...] = (),
        salt: str | None = None,
    ) -> None:
        self.rid = rid
        self.salt = salt
        self.root = tokens.salt_root(salt)
        self.tokens = prompt
        """Prompt tokens followed by generated ones (the KV cache's content)."""
        self.num_prompt = len(prompt)
        self.max_tokens = max_tokens
        self.eos_at = eos_at
        self.stops = stops
        self.stop_hold = max((len(s) for s in stops), default=1) - 1
        self.gen = tokens.Generator(seed)
        self.arrival = arrival
        self.state = WAITING
        self.blocks: list[Block] = []
        self.hashes: list[int] = []
        self.pieces: list[str] = []
        self.emit = 0
        self.emit_chars = 0
        self.text = ""
        self.num_generated = 0
        self.cached_tokens: int | None = None
        self.preemptions = 0
        self.finish_reason: str | None = None
        self.first_scheduled: float | None = None
        self.first_token_at: float | None = None
        self.last_token_at = 0.0
        self.finished_at: float | None = None
        self.touched = False
        self.told_waiting = False
        self.waiter: Any = None
        """The shell's wake-up handle (an asyncio future); the engine never looks at it."""

    @property
    def finished(self) -> bool:
        return self.state == FINISHED


class Engine:
    """Scheduler, KV cache and counters of one simulated engine."""

    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.block_size = cfg.block_size
        self.max_num_seqs = cfg.max_num_seqs
        self.latency = cfg.latency
        self.pool = BlockPool(cfg.num_blocks, record_events=cfg.kv_events is not None)
        self.stats = Stats(cfg.max_model_len)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.touched: list[Request] = []
        """Requests with new output since the shell last looked (each listed once)."""

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def add(self, req: Request) -> None:
        """Queue a request; it is admitted at the next step that has room for it."""
        self.waiting.append(req)
        self.stats.request_max_tokens.observe(req.max_tokens)

    def abort(self, req: Request, now: float) -> None:
        """Drop a request (its client went away): out of the queue or the batch, its
        blocks freed at once. A finished request is left alone."""
        if req.state == FINISHED:
            return
        if req.state == WAITING:
            self.waiting.remove(req)
        else:
            self.running.remove(req)
        self._finish(req, "abort", now)

    def drain_touched(self) -> list[Request]:
        out = self.touched
        self.touched = []
        for r in out:
            r.touched = False
        return out

    def step(self, now: float) -> float:
        """Run one step starting at `now`; returns its duration in seconds. Tokens it
        produces are stamped `now + duration`: the shell delivers them then."""
        bs = self.block_size
        pool = self.pool
        running = self.running
        preempted = False
        i = 0
        while i < len(running):
            r = running[i]
            if len(r.tokens) + 1 > len(r.blocks) * bs:
                if not pool.free:
                    victim = running.pop()
                    self._preempt(victim)
                    preempted = True
                    continue  # retry r, unless r itself was the victim (then the loop ends)
                r.blocks.extend(pool.allocate(1))
            i += 1

        prefill = 0
        if not preempted:
            prefill = self._admit(now)
        if self.waiting:
            self._tell_waiting()

        duration = self.latency.step_s(len(running), prefill) if running else 0.0
        end = now + duration
        done = False
        for r in running:
            done = self._generate(r, end) or done
        if done:
            self.running = [r for r in running if r.state == RUNNING]
        return duration

    def _admit(self, now: float) -> int:
        bs = self.block_size
        pool = self.pool
        stats = self.stats
        running = self.running
        waiting = self.waiting
        prefill = 0
        while waiting and len(running) < self.max_num_seqs:
            r = waiting[0]
            n = len(r.tokens)
            full = n // bs
            if len(r.hashes) < full:
                tokens.block_hashes(r.tokens, bs, len(r.hashes), r.hashes, r.root)
            # At least one token is always computed (vLLM: the last prompt token's
            # logits are needed), so a fully cached prompt still leaves its last block.
            hits = pool.lookup(r.hashes, (n - 1) // bs)
            need = -(-(n + 1) // bs) - len(hits)  # room for the prompt and the first token
            if pool.cost(hits, need) > pool.num_free:
                break  # head-of-line: nothing behind it is admitted either
            waiting.popleft()
            pool.touch(hits)
            r.blocks = hits + pool.allocate(need)
            for j in range(len(hits), full):
                self._cache_block(r, j)
            hit_tokens = len(hits) * bs
            stats.prefix_cache_queries += n
            stats.prefix_cache_hits += hit_tokens
            if r.cached_tokens is None:
                r.cached_tokens = hit_tokens
                r.first_scheduled = now
                stats.prompt_tokens += r.num_prompt
                stats.prompt_tokens_cached += hit_tokens
            prefill += n - hit_tokens
            r.state = RUNNING
            running.append(r)
        return prefill

    def _cache_block(self, r: Request, j: int) -> None:
        """Make block `j` of `r` findable; with KV events, its BlockStored says its parent
        hash and token ids."""
        pool = self.pool
        if not pool.record_events:
            pool.cache(r.blocks[j], r.hashes[j])
            return
        bs = self.block_size
        ids = tokens.token_ids(r.tokens[j * bs : (j + 1) * bs])
        pool.cache(r.blocks[j], r.hashes[j], r.hashes[j - 1] if j else None, ids,
                   None if j else r.salt)  # fmt: skip

    def _tell_waiting(self) -> None:
        """Touch each request the first time a step leaves it waiting, so that the
        shell can show its client that it is queued (send the response headers)."""
        for r in self.waiting:
            if not r.told_waiting:
                r.told_waiting = True
                if not r.touched:
                    r.touched = True
                    self.touched.append(r)

    def _preempt(self, r: Request) -> None:
        self.pool.release(r.blocks)
        r.blocks = []
        r.state = WAITING
        r.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(r)

    def _generate(self, r: Request, t: float) -> bool:
        """Append one generated token to `r` at time `t`; True when `r` finished."""
        piece = r.gen.next_token()
        toks = r.tokens
        toks.append(piece)
        r.num_generated += 1
        bs = self.block_size
        n = len(toks)
        if n % bs == 0:
            # A block just filled: make it findable, so a conversation's next turn
            # (which repeats this output in its prompt) hits the cache.
            tokens.block_hashes(toks, bs, len(r.hashes), r.hashes, r.root)
            self._cache_block(r, n // bs - 1)
        stats = self.stats
        stats.generation_tokens += 1
        if r.first_token_at is None:
            r.first_token_at = t
            stats.ttft.observe(t - r.arrival)
        else:
            stats.itl.observe(t - r.last_token_at)
        r.last_token_at = t
        if not r.touched:
            r.touched = True
            self.touched.append(r)

        reason: str | None = None
        r.pieces.append(piece)
        if r.stops:
            before = len(r.text)
            r.text += piece
            cut = -1
            for s in r.stops:
                at = r.text.find(s, max(0, before - len(s) + 1))
                if at >= 0 and (cut < 0 or at < cut):
                    cut = at
            if cut >= 0:
                self._truncate(r, cut)
                reason = "stop"
            else:
                # Release the pieces that lie wholly before the held-back tail.
                safe = len(r.text) - r.stop_hold
                pieces = r.pieces
                while r.emit < len(pieces) and r.emit_chars + len(pieces[r.emit]) <= safe:
                    r.emit_chars += len(pieces[r.emit])
                    r.emit += 1
        else:
            r.emit += 1
        if reason is None:
            if r.num_generated == r.eos_at:
                reason = "stop"
            elif r.num_generated >= r.max_tokens:
                reason = "length"
        if reason is None:
            return False
        r.emit = len(r.pieces)
        self._finish(r, reason, t)
        return True

    @staticmethod
    def _truncate(r: Request, cut: int) -> None:
        """Cut the output text at character `cut` (where a stop string begins)."""
        out: list[str] = []
        used = 0
        for p in r.pieces:
            if used + len(p) <= cut:
                out.append(p)
                used += len(p)
            else:
                if cut > used:
                    out.append(p[: cut - used])
                break
        r.pieces = out
        r.text = r.text[:cut]

    def _finish(self, r: Request, reason: str, t: float) -> None:
        self.pool.release(r.blocks)
        r.blocks = []
        r.state = FINISHED
        r.finish_reason = reason
        r.finished_at = t
        stats = self.stats
        stats.request_success[reason] += 1
        if not r.touched:
            r.touched = True
            self.touched.append(r)
        if reason == "abort" or r.first_scheduled is None or r.first_token_at is None:
            return
        stats.e2e.observe(t - r.arrival)
        stats.queue_time.observe(r.first_scheduled - r.arrival)
        stats.inference_time.observe(t - r.first_scheduled)
        stats.prefill_time.observe(r.first_token_at - r.first_scheduled)
        stats.decode_time.observe(t - r.first_token_at)
        if r.num_generated > 1:
            stats.tpot.observe((t - r.first_token_at) / (r.num_generated - 1))
        stats.request_prompt_tokens.observe(r.num_prompt)
        stats.request_generation_tokens.observe(r.num_generated)
