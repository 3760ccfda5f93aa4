"""The agent: the only part of llmgw that touches GPUs.

One agent runs on every GPU node. It discovers what the node has
(`llmgw.agent.discovery`), turns a StartShard into an engine command line
(`llmgw.agent.engines`), and supervises the engine processes
(`llmgw.agent.supervisor`). The service (`llmgw.agent.service`, run by
`llmgw agent --config FILE`) drives these pieces over NATS: it registers the
node, publishes every transition through an on-disk outbox
(`llmgw.agent.outbox`), and applies its commands once each (`llmgw.agent.applier`,
recorded in `llmgw.agent.ledger`), none from an epoch beyond the leader lease's
(`llmgw.agent.lease_bound`); `llmgw agent inventory` shows what discovery finds.
"""
