"""The agent: the only part of llmgw that touches GPUs.

One agent runs on every GPU node. It discovers what the node has
(`llmgw.agent.discovery`), turns a StartShard into an engine command line
(`llmgw.agent.engines`), and supervises the engine processes
(`llmgw.agent.supervisor`). The NATS service that registers the node and
consumes its commands drives these pieces; `llmgw agent inventory` shows what
discovery finds.
"""
