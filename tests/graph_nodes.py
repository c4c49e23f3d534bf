"""Which autograd nodes a result came through (to tell which attention path ran)."""

from __future__ import annotations

import torch


def uses_node(out: torch.Tensor, node_name: str) -> bool:
    """Whether the autograd graph of ``out`` holds a node whose class name contains
    ``node_name`` (e.g. ``"FP32BackwardAttention"``, ``"FP32Recompute"``)."""
    todo, seen = [out.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if node_name in type(node).__name__:
            return True
        todo.extend(n for n, _ in node.next_functions)
    return False
