"""`llmgw sim`: a simulated OpenAI-compatible inference engine.

It behaves like vLLM where a router or an operator can see it — continuous
batching, a paged KV cache with prefix caching, queueing, cancellation, vLLM's
metrics — without a GPU. The agent launches it as an engine (`python -m llmgw
sim ...`); router and end-to-end tests run it directly. The engine model
(`engine`, `kvcache`, `tokens`, `stats`, `api`) is free of I/O and takes time as
an argument; `server` is the aiohttp shell around it.
"""
