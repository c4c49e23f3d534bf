"""The global RNG states a checkpoint saves: python ``random``, numpy's global generator,
torch CPU and, when CUDA is in use, every CUDA device's generator.

``capture_rng_state`` returns plain containers and tensors (loadable with
``torch.load(weights_only=True)``); ``restore_rng_state`` sets them back and returns warnings
for what it could not restore (CUDA states saved for another number of devices).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch

from agent.checkpoints.format import RNG_CUDA, RNG_NUMPY, RNG_PYTHON, RNG_TORCH


def capture_rng_state() -> dict[str, Any]:
    """The global RNG states as plain containers and tensors (loadable with weights_only)."""
    kind, keys, pos, has_gauss, cached_gaussian = np.random.get_state(legacy=True)
    state: dict[str, Any] = {
        RNG_PYTHON: random.getstate(),  # (version, tuple of 625 ints, gauss_next)
        RNG_NUMPY: {
            "kind": str(kind),
            "keys": [int(k) for k in keys],  # 624 uint32 words of MT19937
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached_gaussian": float(cached_gaussian),
        },
        RNG_TORCH: torch.get_rng_state(),  # uint8 tensor
    }
    # Only when CUDA is in use: reading the CUDA generators would otherwise initialize CUDA.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[RNG_CUDA] = torch.cuda.get_rng_state_all()  # one uint8 tensor per device
    return state


def restore_rng_state(state: dict[str, Any]) -> list[str]:
    """Set the global RNG states from ``capture_rng_state``'s dict; returns warnings."""
    warnings: list[str] = []
    version, internal, gauss_next = state[RNG_PYTHON]
    random.setstate((version, tuple(internal), gauss_next))
    np_state = state[RNG_NUMPY]
    np.random.set_state(
        (
            np_state["kind"],
            np.asarray(np_state["keys"], dtype=np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    torch.set_rng_state(state[RNG_TORCH])
    cuda_states = state.get(RNG_CUDA)
    if cuda_states is not None:
        if torch.cuda.is_available() and torch.cuda.device_count() == len(cuda_states):
            torch.cuda.set_rng_state_all(cuda_states)
        else:
            warnings.append(
                f"CUDA RNG states for {len(cuda_states)} devices not restored: "
                f"{torch.cuda.device_count() if torch.cuda.is_available() else 0} visible"
            )
    return warnings
