"""An engine's load as its Prometheus page says it: requests queued, requests running and
KV-cache usage, under the names vLLM, SGLang and llama.cpp use. Read by the router's probes
(llmgw.router.table) and the agent's (llmgw.agent.loads). Purely computational."""

from __future__ import annotations

import math

MAX_FIGURE = 1e9
"""The most requests queued or running that a page is read as saying: the bound of the load
reports that carry the figures (llmgw.core.loadreport, `Amount`). More is a broken engine."""

QUEUE_METRICS = frozenset(
    {"vllm:num_requests_waiting", "llamacpp:requests_deferred", "sglang:num_queue_reqs"}
)
RUNNING_METRICS = frozenset(
    {"vllm:num_requests_running", "llamacpp:requests_processing", "sglang:num_running_reqs"}
)
KV_METRICS = frozenset(
    {"vllm:kv_cache_usage_perc", "llamacpp:kv_cache_usage_ratio", "sglang:token_usage"}
)
_WANTED = tuple(sorted(QUEUE_METRICS | RUNNING_METRICS | KV_METRICS))
MAX_LINES = 1024
"""The most places a page names one of the figures that are looked at (an honest page names
each once per model or engine it lists): past them the rest of the page is not read."""


def parse_engine_metrics(text: str) -> tuple[float | None, float | None, float | None]:
    """(queue depth, running, KV usage) from a Prometheus text page; None where absent.

    Sums over label sets (one engine may list several model names). Every figure is finite
    and within 0..`MAX_FIGURE` (KV usage 0..1): the engine decides its page, and one +Inf
    (or +Inf and -Inf summed: NaN, or a figure past the reports' bounds) in a router's or an
    agent's load report made the whole report, about every endpoint and model it covers,
    one its readers refuse, and turned the routing scores of the engine's peers into NaN.
    Purely computational.
    """
    queue: float | None = None
    running: float | None = None
    kv: float | None = None
    for name in _WANTED:
        for value in _values(text, name):
            if name in QUEUE_METRICS:
                queue = (queue or 0.0) + value
            elif name in RUNNING_METRICS:
                running = (running or 0.0) + value
            else:
                kv = value if kv is None else max(kv, value)
    return _bounded(queue, MAX_FIGURE), _bounded(running, MAX_FIGURE), _bounded(kv, 1.0)


def _values(text: str, name: str) -> list[float]:
    """The finite values of the lines of metric `name` in `text` (`name value`, or
    `name{labels} value`; the value is the line's last field).

    The name is searched for (in C), not every line read: the prober reads a page on the
    router's event loop every round, and 8 MiB of short lines read one by one held it for
    half a second, every request to every model waiting. At most `MAX_LINES` places the
    name stands are looked at, so a page naming it everywhere costs no more."""
    found: list[float] = []
    pos = 0
    for _ in range(MAX_LINES):
        at = text.find(name, pos)
        if at < 0:
            break
        end = text.find("\n", at)
        pos = end = len(text) if end < 0 else end
        if at > 0 and text[at - 1] not in "\n\r":
            continue  # within a line: a comment's, another metric's
        line = text[at:end]
        after = line[len(name) : len(name) + 1]
        if after != "{" and (after != " " or "{" in line):
            continue  # another metric whose name begins with this one
        try:
            value = float(line.rsplit(" ", 1)[-1])
        except ValueError:
            continue
        if math.isfinite(value):  # NaN (nothing to report yet) or a broken engine's inf
            found.append(value)
    return found


def _bounded(value: float | None, most: float) -> float | None:
    # A sum of finite figures can still overflow to +-inf (1e308 twice), never to NaN.
    return None if value is None else min(max(value, 0.0), most)
