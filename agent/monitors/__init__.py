"""Mechanism monitors: exact, batched tensor functions (DESIGN.md 1a-1b)."""

from __future__ import annotations

from agent.monitors.batched import BatchedQKSpectra, qk_monitor_spectra_batched
from agent.monitors.router import (
    RoutingEntropy,
    RoutingLoad,
    router_conditioning_ratio,
    router_similarity,
    routing_entropy,
    routing_load,
    routing_stats,
)
from agent.monitors.spectrum import (
    QKSpectra,
    SpectrumStats,
    qk_delta2_direction,
    qk_increment_spectrum,
    qk_monitor_spectra,
    spectrum_stats,
    update_spectrum,
)

__all__ = [
    "BatchedQKSpectra",
    "RoutingEntropy",
    "QKSpectra",
    "RoutingLoad",
    "SpectrumStats",
    "qk_delta2_direction",
    "qk_increment_spectrum",
    "qk_monitor_spectra",
    "qk_monitor_spectra_batched",
    "router_conditioning_ratio",
    "router_similarity",
    "routing_entropy",
    "routing_load",
    "routing_stats",
    "spectrum_stats",
    "update_spectrum",
]
