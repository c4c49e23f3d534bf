"""Which ``agent.step`` calls followed an optimizer step that did not happen.

A ``torch.amp.GradScaler`` skips ``optimizer.step()`` when the scaled gradients overflowed
(fp16 training: during its first calibration steps, then about once per growth interval).
Such a step changes no weight, and its gradient norm, given or the agent's own, is inf or NaN
(``scaler.step`` unscales the gradients in place), which is not a fault of the run: the
symptom rules would page it as one. The agent therefore counts the optimizer's real steps with
a step post-hook (a host integer: no device synchronization) and, at each ``agent.step``,
asks whether one happened since the previous call.

Trusted only where torch runs the hooks on every real step: an optimizer whose class ``step``
torch has wrapped (``torch.optim.Optimizer.__init__`` does it; the wrapped function carries
``hooked``). A wrapper that is not one but holds one as ``.optimizer`` (accelerate's
``AcceleratedOptimizer``, which the Hugging Face Trainer hands its callbacks: its scaler steps
the inner optimizer, or skips it) is counted on the inner one. Elsewhere ``skipped()`` is None:
unknown, and the agent keeps every gradient norm, as before.
"""

from __future__ import annotations

from typing import Any

import torch


class OptimizerSteps:
    """Counts ``optimizer``'s real steps; ``skipped()`` once per ``agent.step``."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        inner = getattr(optimizer, "optimizer", None)
        if not _hooked(optimizer) and _hooked(inner):
            optimizer = inner  # a wrapper (accelerate): the scaler steps the inner optimizer
        self.trusted = _hooked(optimizer)
        self._count = 0  # real optimizer steps so far
        self._seen = 0  # the count at the previous skipped() call
        self._handle = optimizer.register_step_post_hook(self._hook) if self.trusted else None

    def _hook(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._count += 1

    def skipped(self) -> bool | None:
        """Whether no optimizer step ran since the previous call (None: cannot tell)."""
        if not self.trusted:
            return None
        skipped = self._count == self._seen
        self._seen = self._count
        return skipped

    def close(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None


def _hooked(optimizer: object) -> bool:
    """Whether torch runs ``optimizer``'s step hooks on each of its steps."""
    step = getattr(type(optimizer), "step", None)
    return bool(getattr(step, "hooked", False)) and hasattr(optimizer, "register_step_post_hook")
