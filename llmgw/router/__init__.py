"""The OpenAI-compatible router: `llmgw router`.

app (HTTP handlers, dispatch, streaming relay), table (catalog, endpoint table,
probes), auth (hashed keys, limits), requests (body decoding, error shape),
metrics (Prometheus), config (the YAML settings), server (listeners, workers).
Endpoint selection itself is pure and lives in `llmgw.core.routing`.
"""
