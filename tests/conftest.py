"""Test-wide settings."""

from __future__ import annotations

import torch

# One intra-op thread: the suite's training loops are tiny, and OpenMP barriers with two
# threads on a loaded two-core machine can stall a step for seconds. The agent's monitor thread
# then has the other core to itself, as it would beside a GPU training loop.
torch.set_num_threads(1)
