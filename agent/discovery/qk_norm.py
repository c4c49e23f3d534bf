"""QK-norm scales to fold into the per-head Q/K factors (DESIGN.md 1d).

A norm applied to each head's query (or key) after the projection multiplies the head's output
features by a learned scale, a diagonal that folds into the factor: W_q^h diag(g). The scale
has d_h entries (shared by all heads) or n_heads * d_h. Whether the norm multiplies by
``weight`` or by ``1 + weight`` (Gemma) is measured by running the norm, not guessed from its
class. The per-token 1 / rms is a scalar per token, outside the bilinear form.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from agent.discovery.errors import DiscoveryError, join
from agent.discovery.overrides import AttentionOverride

_Q_NORM_NAMES = ("q_norm", "q_layernorm", "query_layernorm", "q_ln", "query_norm")
_K_NORM_NAMES = ("k_norm", "k_layernorm", "key_layernorm", "k_ln", "key_norm")


@dataclass
class FoldedNorm:
    """A QK-norm scale to fold into one projection's factors."""

    name: str  # qualified parameter name of the scale
    weight: torch.Tensor  # [d_h], [n_heads * d_h] or [n_heads, d_h]
    offset: float  # 1.0 when the norm multiplies by (1 + weight), else 0.0


def find_qk_norm(
    where: str,
    name: str,
    module: nn.Module,
    override: AttentionOverride | None,
    which: str,
    n_heads: int,
    head_dim: int,
    param_names: Mapping[int, str],
    fold: bool,
) -> FoldedNorm | None:
    """The learned scale of the ``which`` ("q" or "k") norm of attention ``module``, None when
    folding is off, there is no such norm, or it has no learned scale. Raises
    :class:`DiscoveryError` when the scale does not fit the heads or cannot be folded."""
    if not fold:
        return None
    explicit = None if override is None else (override.q_norm if which == "q" else override.k_norm)
    if explicit is not None:
        try:
            norm = module.get_submodule(explicit)
        except AttributeError:
            raise DiscoveryError(
                f"attention override for {name!r}: {join(name, explicit)!r} is not a module "
                "of the model"
            ) from None
        path = join(name, explicit)
    else:
        names = _Q_NORM_NAMES if which == "q" else _K_NORM_NAMES
        child = next((n for n in names if n in module._modules), None)
        if child is None:
            return None
        norm, path = module._modules[child], join(name, child)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or id(weight) not in param_names:
        return None  # a norm without a learned scale: nothing to fold
    if weight.numel() not in (head_dim, n_heads * head_dim):
        raise DiscoveryError(
            f"{where}: {path} has a scale of shape {tuple(weight.shape)}; expected {head_dim} "
            f"(per head dim) or {n_heads * head_dim} (per head). Set fold_qk_norm: false in "
            f"the override for {name!r} to skip folding"
        )
    offset = norm_scale_offset(where, path, norm, weight)
    return FoldedNorm(param_names[id(weight)], weight, offset)


def norm_scale_offset(where: str, path: str, norm: nn.Module, weight: torch.Tensor) -> float:
    """0.0 when the norm multiplies by its weight, 1.0 when by (1 + weight) (Gemma).

    Measured, not guessed from the class: a float64 copy of the norm is run on inputs with zero
    mean and unit RMS along the last dim, where out(x) - out(-x) = 2 * scale * x / sqrt(1 + eps)
    for both RMSNorm and LayerNorm (a LayerNorm bias cancels).
    """
    try:
        probe = copy.deepcopy(norm).to(device="cpu", dtype=torch.float64)
        generator = torch.Generator().manual_seed(0)
        x = torch.randn((2, *weight.shape), generator=generator, dtype=torch.float64)
        x = x - x.mean(-1, keepdim=True)
        x = x / x.pow(2).mean(-1, keepdim=True).sqrt()  # (2, *weight.shape), unit RMS rows
        with torch.no_grad():
            scale = (probe(x) - probe(-x)) / (2 * x)  # (2, *weight.shape)
        w = weight.detach().to(device="cpu", dtype=torch.float64)
    except Exception as exc:  # a norm that cannot run on CPU (fused kernels, meta tensors)
        offset = 1.0 if "gemma" in type(norm).__name__.lower() else 0.0
        warnings.warn(
            f"mechwatch discovery: could not probe {path} ({type(exc).__name__}: {exc}); "
            f"assuming it scales by {'1 + weight' if offset else 'weight'}",
            stacklevel=4,
        )
        return offset
    for offset in (0.0, 1.0):
        if torch.allclose(scale, (w + offset).expand_as(scale), rtol=1e-3, atol=1e-4):
            return offset
    raise DiscoveryError(
        f"{where}: {path} scales by neither its weight nor 1 + weight, so it cannot be folded "
        "into the factors; set fold_qk_norm: false in its attention override"
    )
