"""The proving ground: a small MoE transformer on CPU with honest fault injection.

See docs/testbed.md. Submodules are imported on demand (``agent.testbed.runner`` pulls in torch
and the monitors); this package itself imports nothing.
"""
