"""Routing logits: computed from a router's input, or taken out of what it returns.

The router probe computes the logits itself, z = x W^T + b, from the router's *input* x
(``router_input``) and its [E, d] weight (``router_logits``): what routers return differs too
much to be trusted (Mixtral returns ``(logits, scores, indices)``, Llama 4 ``(scores, logits)``
with sigmoid scores first, LongcatFlash's weight-holding ``classifier`` is never called at all).
The one output it takes is that of a router that is exactly ``nn.Linear``: z by definition.
``router_logits`` works at the input's precision (the weight is cast to it), as an
``nn.Linear`` router under autocast does; a router that upcasts to fp32 itself differs by the
input precision's rounding of the logits.

``extract_router_logits`` remains for callers that only have outputs: it takes the first
floating tensor whose last dimension is E.

All of this runs inside forward hooks, once per router per forward: no host-device sync.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F


def router_input(
    args: Sequence[object], kwargs: Mapping[str, object], d_model: int
) -> torch.Tensor | None:
    """The router's input x (..., d): the first floating tensor among the positional, then the
    keyword arguments whose last dimension is ``d_model``; None when there is none."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and _is_input(value, d_model):
            return value
    return None


@torch.no_grad()
def router_logits(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """z = x W^T + b, (tokens, E) for x (..., d), W [E, d], b [E], at x's precision."""
    w = weight.detach().to(x.dtype)
    b = None if bias is None else bias.detach().to(x.dtype)
    return F.linear(x.detach().reshape(-1, x.shape[-1]), w, b)


def extract_router_logits(output: object, num_experts: int) -> torch.Tensor | None:
    """Return the routing logits in a router's ``output``, or None when there are none.

    The logits are a floating-point tensor whose last dimension is ``num_experts``: the output
    itself when it is such a tensor, else the first such tensor of a tuple or list output
    (Mixtral's ``(logits, scores, indices)``). Beware outputs whose first such tensor is not the
    logits (Llama 4's ``(scores, logits)``): the probe uses ``router_logits`` instead.
    """
    if isinstance(output, torch.Tensor):
        return output if _is_logits(output, num_experts) else None
    if isinstance(output, (tuple, list)):
        for item in output:
            if isinstance(item, torch.Tensor) and _is_logits(item, num_experts):
                return item
    return None


def _is_logits(tensor: torch.Tensor, num_experts: int) -> bool:
    return tensor.is_floating_point() and tensor.dim() >= 1 and tensor.shape[-1] == num_experts


def _is_input(tensor: torch.Tensor, d_model: int) -> bool:
    return tensor.is_floating_point() and tensor.dim() >= 1 and tensor.shape[-1] == d_model
