"""Settings of `llmgw sim`, the simulated OpenAI-compatible engine.

`SimConfig` is what the CLI flags, a YAML file and `LLMGW_SIM__*` environment
variables all fill in (see `llmgw.config.load`); `llmgw.sim.server` runs it. The
latency model and the fault plan are nested Structs so that a test can describe
a slow or broken engine in one place.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from llmgw import otlp
from llmgw.config import LogLevel, Port
from llmgw.core.kvblocks import MAX_BLOCK_SIZE

MAX_NUM_BLOCKS = 1 << 20
"""The most KV-cache blocks: each is an object made at start (a million take about 200 MiB
and two seconds), and 16,384-token blocks of them hold more than any GPU does."""
MAX_EMBEDDING_DIM = 65_536
"""The longest embedding: each input's is a list of this many floats, made per request."""

StallAt = Literal["headers", "first_token", "mid_stream"]


class LatencyModel(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """How long one engine step takes, in milliseconds.

    A step runs one forward pass over the batch: every running sequence gains one
    token, and newly admitted requests are prefilled. Its duration is
    `decode_base_ms + decode_per_seq_ms * sequences + prefill_per_token_ms *
    uncached prompt tokens`, so decoding slows as the batch grows and prefill
    costs only what the prefix cache did not already hold. All zero (the default)
    is an infinitely fast engine, which benchmarks of the router use.
    """

    decode_base_ms: float = 0.0
    decode_per_seq_ms: float = 0.0
    prefill_per_token_ms: float = 0.0

    def step_s(self, sequences: int, prefill_tokens: int) -> float:
        """Duration of one step in seconds. Purely computational."""
        ms = (
            self.decode_base_ms
            + self.decode_per_seq_ms * sequences
            + self.prefill_per_token_ms * prefill_tokens
        )
        return ms / 1000.0

    @property
    def zero(self) -> bool:
        return not (self.decode_base_ms or self.decode_per_seq_ms or self.prefill_per_token_ms)


class Faults(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Misbehaviour on demand, for testing what a router does with a broken engine.

    Set by CLI flags at start or at run time by `POST /sim/faults` with this
    object as JSON; `DELETE /sim/faults` clears it. It applies to the inference
    requests (`/v1/chat/completions`, `/v1/completions`, `/v1/embeddings`) that
    follow and pass validation, `count` of them (None: all of them). Requests the
    sim refuses as malformed get their 4xx as usual and do not use up the count.
    """

    stall_at: StallAt | None = None
    """Where to stall: before the response headers, before the first token, or
    after `after_tokens` tokens."""
    stall_s: float = 3600.0
    """How long the stall lasts; the default outlasts any sane client deadline."""
    fail_status: int | None = None
    """Answer with this HTTP status and an OpenAI-shaped error instead of serving."""
    die_mid_stream: bool = False
    """Abort the TCP connection (RST) after `after_tokens` tokens, with no final chunk."""
    after_tokens: int = 1
    count: int | None = None

    @property
    def active(self) -> bool:
        return self.stall_at is not None or self.fail_status is not None or self.die_mid_stream

    def problem(self) -> str | None:
        """What is wrong with this fault plan, said so a person can fix it; None if usable."""
        if self.fail_status is not None and not 400 <= self.fail_status <= 599:
            return f"fail_status must be an HTTP error status (400-599), not {self.fail_status}"
        if self.stall_s < 0:
            return f"stall_s must be >= 0 seconds, not {self.stall_s}"
        if self.after_tokens < 0:
            return f"after_tokens must be >= 0, not {self.after_tokens}"
        if self.count is not None and self.count < 1:
            return f"count must be >= 1 (or null for every request), not {self.count}"
        return None


class KvEventsConfig(msgspec.Struct, frozen=True, kw_only=True):
    """vLLM's `--kv-events-config` (the same JSON): publish the KV cache's block events.

    With `publisher: zmq` the sim binds a ZMQ PUB socket at `endpoint` and, given
    `replay_endpoint`, a ROUTER socket that answers replay requests from the last
    `buffer_steps` batches (llmgw.sim.kvevents). Fields of vLLM's that the sim does not
    use are accepted and ignored, so one config line serves both.
    """

    enable_kv_cache_events: bool = False
    publisher: str = "null"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    def problem(self) -> str | None:
        if self.publisher not in ("null", "zmq"):
            return f"publisher {self.publisher!r} is not one the sim has: use zmq or null"
        if min(self.buffer_steps, self.hwm, self.max_queue_size) < 1:
            return "buffer_steps, hwm and max_queue_size must be >= 1"
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                return f"{name} {value!r} is not a ZMQ address (tcp://HOST:PORT, ipc://PATH)"
        return None


class SimConfig(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """One simulated engine: where it listens, what it serves, and how it behaves."""

    host: str = "127.0.0.1"
    port: Port = 8000
    """0 picks a free port; the start-up line says which."""
    served_model_names: tuple[str, ...] = ("sim",)
    """The first name labels the metrics (`model_name`); the others are aliases."""
    max_model_len: int = 4096
    """Longest prompt plus output, in tokens."""
    block_size: int = 16
    """Tokens per KV-cache block."""
    num_blocks: int = 4096
    """KV-cache blocks in the whole (simulated) GPU memory."""
    max_num_seqs: int = 256
    """Largest batch: requests running at once; the rest wait."""
    seed: int = 0
    """Seeds generated text for requests that bring no `seed` of their own (with the
    request's arrival index, so a restarted sim replays the same texts in order); a
    request's own `seed` with its prompt always gives the same text."""
    eos_min_tokens: int = 32
    eos_max_tokens: int = 512
    """A request's natural length (where the model would emit end-of-sequence) is
    drawn between these; `max_tokens` below it ends the request with `length`."""
    embedding_dim: int = 256
    latency: LatencyModel = LatencyModel()
    faults: Faults = Faults()
    shutdown_timeout_s: float = 2.0
    """On SIGTERM, how long requests in flight may finish before connections close."""
    load_s: float = 0.0
    """Seconds before the sim listens, as an engine loading its weights does (vLLM's
    server opens its port only once the model is loaded): until then connections are
    refused and a supervisor sees it starting."""
    log_level: LogLevel = "info"
    kv_events_config: KvEventsConfig | None = None
    """Publish KV block events as vLLM does (`--kv-events-config JSON`)."""
    otlp_traces_endpoint: str = ""
    """Export each request's span (`llm_request`, continuing its `traceparent`, as vLLM
    does) to this OTLP/HTTP collector, `http://host:4318`; none when empty."""
    api_key: str = ""
    """With a key, every /v1 route, /sim/* and /reset_prefix_cache answer 401 without
    `Authorization: Bearer <key>`; /health and /metrics stay open, as in vLLM."""

    @property
    def kv_events(self) -> KvEventsConfig | None:
        """The KV event publishing in effect: enabled, with a real publisher; else None."""
        kv = self.kv_events_config
        if kv is None or not kv.enable_kv_cache_events or kv.publisher == "null":
            return None
        return kv

    def problems(self) -> list[str]:
        """Everything wrong with this configuration, each said with what to change."""
        out: list[str] = []
        if not self.served_model_names or any(not n for n in self.served_model_names):
            out.append("served_model_names needs at least one non-empty name (--served-model-name)")
        if not 0 <= self.port <= 65535:
            out.append(f"port {self.port} is not a TCP port: use 0-65535 (0 picks a free one)")
        for name in ("max_model_len", "block_size", "num_blocks", "max_num_seqs", "embedding_dim"):
            if getattr(self, name) < 1:
                out.append(f"{name} must be >= 1, not {getattr(self, name)}")
        for name, most, flag in (
            ("num_blocks", MAX_NUM_BLOCKS, "--num-blocks"),
            ("embedding_dim", MAX_EMBEDDING_DIM, "--embedding-dim"),
        ):
            if getattr(self, name) > most:
                out.append(
                    f"{name} must be at most {most:,}, not {getattr(self, name):,}: lower {flag}"
                )
        if self.block_size > MAX_BLOCK_SIZE:
            out.append(
                f"block_size {self.block_size} is over {MAX_BLOCK_SIZE}, more than any engine "
                "uses (agents refuse the KV events of larger blocks): lower --block-size"
            )
        if self.block_size >= 1 and self.num_blocks >= 1:
            capacity = self.block_size * self.num_blocks
            # One request may use up to max_model_len tokens; if the cache cannot hold
            # it, such a request would wait forever (vLLM refuses to start, too).
            if self.max_model_len > capacity:
                out.append(
                    f"the KV cache holds {capacity} tokens ({self.num_blocks} blocks of "
                    f"{self.block_size}), less than max_model_len {self.max_model_len}: "
                    "raise --num-blocks or lower --max-model-len"
                )
        if not 1 <= self.eos_min_tokens <= self.eos_max_tokens:
            out.append(
                f"need 1 <= eos_min_tokens ({self.eos_min_tokens}) <= eos_max_tokens "
                f"({self.eos_max_tokens})"
            )
        if not 0 <= self.load_s <= 3600:
            out.append(f"load_s must be 0-3600 seconds, not {self.load_s}")
        if not 0 <= self.shutdown_timeout_s <= 3600:  # NaN too
            out.append(
                f"shutdown_timeout_s must be 0-3600 seconds, not {self.shutdown_timeout_s}: "
                "set --shutdown-timeout-s"
            )
        lat = self.latency
        if min(lat.decode_base_ms, lat.decode_per_seq_ms, lat.prefill_per_token_ms) < 0:
            out.append("latency values must be >= 0 milliseconds")
        kv = self.kv_events_config
        kv_problem = kv.problem() if kv is not None else None
        if kv_problem:
            out.append(f"kv_events_config: {kv_problem}")
        if self.otlp_traces_endpoint:
            bad = otlp.endpoint_problem(self.otlp_traces_endpoint)
            if bad is not None:
                out.append(f"otlp_traces_endpoint {bad} (the sim does not speak OTLP/gRPC)")
        fault = self.faults.problem()
        if fault:
            out.append(f"faults: {fault}")
        return out
