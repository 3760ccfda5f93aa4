"""Reading what an engine's HTTP port answers, bounded: the agent's probes and load
scrapes (llmgw.agent.probe, llmgw.agent.loads) and the router's prober
(llmgw.router.table). An engine, or whatever took its port, decides how much it sends;
not how much its reader holds.
"""

from __future__ import annotations

import aiohttp

MAX_METRICS_BYTES = 8 * 1024 * 1024
"""The most of an engine's Prometheus page read (vLLM's, histograms and all, is some
hundred KiB): a larger one is left out rather than held in memory."""


async def bounded_body(resp: aiohttp.ClientResponse, limit: int) -> bytes | None:
    """The body of `resp` if it is at most `limit` bytes; None (the rest unread) if larger."""
    if resp.content_length is not None and resp.content_length > limit:
        return None
    body = bytearray()
    async for chunk in resp.content.iter_chunked(64 * 1024):
        body += chunk
        if len(body) > limit:
            return None
    return bytes(body)
