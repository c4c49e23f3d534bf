"""The agent's own gradient norm, for loops that do not pass ``grad_norm`` to ``agent.step``.

The global L2 norm over every parameter's gradient, as ``torch.nn.utils.clip_grad_norm_``
computes it (before clipping: the agent reads it after the optimizer step), on the device
(no host synchronization). The parameter list is taken once and again every
``REFRESH_CALLS`` calls: walking ``model.parameters()`` costs more than the norm on a small
model (0.2 ms on the test bed against about 0.05 ms), and a parameter added to the model
later is counted from the next refresh on.

A loop that clears the gradients before calling ``agent.step``
(``optimizer.zero_grad(set_to_none=True)``) leaves nothing to measure: ``measure`` then
returns None and ``problem`` says what happened and what to do, so the agent can report it
once instead of keeping a silently empty series. Gradients zeroed in place
(``set_to_none=False``) read as an exact 0: the read-out's caller checks that
(``ZEROED``).
"""

from __future__ import annotations

import torch

REFRESH_CALLS = 100  # calls between two walks of model.parameters()

NO_GRADIENTS = (
    "no parameter has a gradient when agent.step runs (the loop cleared them first, e.g. "
    "optimizer.zero_grad(set_to_none=True) before agent.step): the grad_norm series stays "
    "empty and the rules on it cannot fire; pass grad_norm= to agent.step, or call agent.step "
    "before zero_grad"
)
ZEROED = (
    "the agent's own grad norm read exactly 0 (the gradients were zeroed before agent.step, "
    "e.g. optimizer.zero_grad(set_to_none=False)): the grad_norm series is wrong; pass "
    "grad_norm= to agent.step, or call agent.step before zero_grad"
)


class OwnGradNorm:
    """The global gradient norm of ``model``'s parameters, measured by the agent."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._params: list[torch.nn.Parameter] = []
        self._calls = 0
        self.problem: str | None = None  # set when a call found no gradient at all

    def measure(self) -> torch.Tensor | None:
        """() float32 on the parameters' device, or None when no parameter has a gradient."""
        if self._calls % REFRESH_CALLS == 0:
            self._params = list(self.model.parameters())
        self._calls += 1
        grads = [p.grad for p in self._params if p.grad is not None]
        if not grads:
            self.problem = NO_GRADIENTS
            return None
        norms = torch._foreach_norm(grads)  # one () tensor per gradient, its dtype
        device = norms[0].device  # gradients on several devices: summed on the first
        return torch.linalg.vector_norm(torch.stack([n.float().to(device) for n in norms]))
