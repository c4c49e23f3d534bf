"""Take the routing logits out of whatever a router module returns.

Routers differ in what their ``forward`` returns: a plain ``nn.Linear`` gate returns the
logits ``[tokens, E]``; Hugging Face's ``MixtralTopKRouter`` (and its Qwen2-MoE / OLMoE
siblings) return ``(router_logits [tokens, E], top_k_scores [tokens, k], top_k_indices)``.
A forward hook calls :func:`extract_router_logits` on the output to get the logits tensor.

This runs inside a forward hook, once per router per forward: it only inspects shapes and
dtypes (no host-device sync, no allocation).
"""

from __future__ import annotations

import torch


def extract_router_logits(output: object, num_experts: int) -> torch.Tensor | None:
    """Return the routing logits in a router's ``output``, or None when there are none.

    The logits are a floating-point tensor whose last dimension is ``num_experts``: the output
    itself when it is such a tensor, else the first such tensor of a tuple or list output
    (Mixtral's ``(logits, scores, indices)``: the logits come first, and the integer indices
    never match). Anything else (top-k scores only, an unrelated object) gives None.
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
