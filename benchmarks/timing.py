"""What several benchmarks share: timing that waits for a device, and the Q/K projections of
one attention layer (Llama layout) for the agent's discovery to find."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
from torch import nn


def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on a CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(
    fn: Callable[[], object],
    repeats: int,
    device: torch.device | None = None,
    *,
    warmup: bool = True,
) -> float:
    """Median wall seconds of ``fn`` over ``repeats`` calls (after one warm-up call), each
    call synchronized with ``device`` before and after."""
    device = device or torch.device("cpu")
    if warmup:
        fn()
        sync(device)
    times = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class QKLayer(nn.Module):
    """Separate Q/K projections of one attention layer (Llama layout), nothing else."""

    def __init__(self, d: int, heads: int, kv_heads: int, dh: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, dh
        self.q_proj = nn.Linear(d, heads * dh, bias=False)  # [H d_h, d]
        self.k_proj = nn.Linear(d, kv_heads * dh, bias=False)  # [H_kv d_h, d]
