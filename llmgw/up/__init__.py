"""`llmgw up`: the whole fleet on one machine from one command (the embedded default).

A private nats-server with a throwaway CA and mutual TLS, the control plane, N agents
with simulated GPUs whose engines are `llmgw sim` (or a real `llama-server` on the CPU),
and the router, each a real subprocess with its config and log in a state directory.
Modules: `layout` (the state directory), `render` (every process's config), `children`
(starting and stopping processes, leftovers of a previous run), `status` (live status),
`locating` (llama-server and a model file), `running` (the orchestration).
Used by `llmgw.cli.up`.
"""
