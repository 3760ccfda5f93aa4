"""llmgw: an event-sourced control plane and OpenAI-compatible router for GPU fleets."""

__version__ = "0.1.0"
