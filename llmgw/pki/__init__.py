"""Private CA, certificates, TLS contexts and NATS authorization for llmgw identities."""
