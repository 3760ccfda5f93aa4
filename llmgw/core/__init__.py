"""The pure core: events, state fold, placement, reconciliation and routing scores.

Nothing under this package performs I/O, reads a clock or draws random numbers:
time, identifiers and seeds are arguments. The shells (bus, control, agent,
router) publish what the core decides. tests/unit/test_core_purity.py enforces it.
"""
