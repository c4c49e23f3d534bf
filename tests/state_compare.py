"""Bit-for-bit comparison of training state, shared by the checkpoint and rollback tests."""

from __future__ import annotations

from typing import Any

import torch


def tensors_of(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor in a nested state, keyed by its path."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, torch.Tensor):
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors_of(v, f"{prefix}/{k}"))
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            out.update(tensors_of(v, f"{prefix}/{i}"))
    return out


def snapshot(run: Any) -> dict[str, torch.Tensor]:
    """Clones of every model and optimizer tensor of a run (``.model``, ``.optimizer``)."""
    state = {"model": run.model.state_dict(), "optimizer": run.optimizer.state_dict()}
    return {k: v.clone() for k, v in tensors_of(state).items()}


def assert_bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype, k
        assert torch.equal(a[k], b[k]), k
