"""An engine's load as its Prometheus page says it: requests queued, requests running and
KV-cache usage, under the names vLLM, SGLang and llama.cpp use. Read by the router's probes
(llmgw.router.table) and the agent's (llmgw.agent.loads). Purely computational."""

from __future__ import annotations

QUEUE_METRICS = frozenset(
    {"vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs"}
)
RUNNING_METRICS = frozenset(
    {"vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs"}
)
KV_METRICS = frozenset(
    {"vllm:kv_cache_usage_perc", "llamacpp:kv_cache_usage_ratio", "sglang:token_usage"}
)
_WANTED = QUEUE_METRICS | RUNNING_METRICS | KV_METRICS


def parse_engine_metrics(text: str) -> tuple[float | None, float | None, float | None]:
    """(queue depth, running, KV usage) from a Prometheus text page; None where absent.

    Sums over label sets (one engine may list several model names). Purely computational.
    """
    queue: float | None = None
    running: float | None = None
    kv: float | None = None
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        cut = line.find("{")
        if cut < 0:
            cut = line.find(" ")
        name = line[:cut]
        if name not in _WANTED:
            continue
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        if value != value:  # NaN: an engine with nothing to report yet
            continue
        if name in QUEUE_METRICS:
            queue = (queue or 0.0) + value
        elif name in RUNNING_METRICS:
            running = (running or 0.0) + value
        else:
            kv = value if kv is None else max(kv, value)
    return queue, running, kv
