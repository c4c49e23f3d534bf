"""What a training loop hands to ``agent.step``: checked (or reduced) at the call.

``agent.step(step, loss=..., grad_norm=...)`` must never let one bad value stop the agent for
the rest of a run. Each value is turned here, on the training thread and without a host sync,
into what the measurement buffers hold: a 0-dim device tensor or a Python float, or nothing.

- ``None``: nothing recorded.
- a Python / NumPy real number (``bool`` excluded): a float.
- a tensor with one element: that element (detached, reshaped to 0-dim).
- a real tensor with several elements (per-sample losses, a loss per micro-batch): its mean,
  with a note: "reduced" (the rules see one number per step).
- anything else (an empty tensor, a complex tensor, a string, a list): rejected, with a note.

Non-finite values are legitimate measurements (the ``loss_nonfinite`` rule watches them).
The step must be an integer (``int`` or a NumPy integer; ``bool`` is refused).
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch

Scalar = torch.Tensor | float  # a 0-dim tensor on the caller's device, or a host float


@dataclass(frozen=True)
class Checked:
    """A value as the buffers hold it (None: nothing to record) and what was wrong with it."""

    value: Scalar | None
    problem: str | None = None  # "rejected ..." or "reduced ..." (None: the value was fine)


def check_scalar(name: str, value: object) -> Checked:
    """``value`` given as ``agent.step(..., name=value)``, checked (see the module docstring)."""
    if value is None:
        return Checked(None)
    if isinstance(value, torch.Tensor):
        return _check_tensor(name, value)
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return Checked(
            None, f"rejected {name}: expected a number or a tensor, got {type(value).__name__}"
        )
    return Checked(float(value))


def _check_tensor(name: str, value: torch.Tensor) -> Checked:
    if value.dim() == 0 and value.is_floating_point():  # the usual case, in two calls
        return Checked(value.detach())
    if value.is_complex() or value.dtype == torch.bool:
        return Checked(
            None, f"rejected {name}: a tensor of dtype {value.dtype} is not a real number"
        )
    if value.numel() == 0:
        return Checked(None, f"rejected {name}: an empty tensor (shape {tuple(value.shape)})")
    if value.numel() == 1:
        return Checked(value.detach().reshape(()))
    reduced = value.detach().float().mean()  # on the device: no host synchronization
    return Checked(
        reduced,
        f"reduced {name}: a tensor of shape {tuple(value.shape)}; the agent "
        "records its mean (pass a scalar to silence this)",
    )


def check_step(step: object) -> int:
    """The step as an int; ``TypeError`` naming the type otherwise."""
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"agent.step: step must be an integer, got {type(step).__name__}")
    return int(step)
