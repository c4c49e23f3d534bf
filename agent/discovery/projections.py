"""Where an attention module keeps its query and key projections.

:func:`locate_qk` recognizes separate ``q_proj``/``k_proj``-style children (Llama, BERT, T5,
CLIP, Meta-Llama ``wq``/``wk``, ...), fused QKV children (``qkv``, ``qkv_proj``, ``Wqkv``,
``W_pack``, ``c_attn`` incl. GPT-2's transposed ``Conv1D``, ``query_key_value``,
Megatron-Core's ``linear_qkv``) and
``nn.MultiheadAttention``, or takes the children an :class:`AttentionOverride` names. It says
nothing about heads: see ``head_layout``.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from agent.discovery.errors import DiscoveryError, describe, join
from agent.discovery.overrides import AttentionOverride

# Child names of separate query/key projections, as (query, key) pairs.
QK_PAIRS = (
    ("q_proj", "k_proj"),
    ("query", "key"),
    ("q", "k"),
    ("wq", "wk"),
    ("q_lin", "k_lin"),
    ("query_proj", "key_proj"),
    ("to_q", "to_k"),
    ("q_linear", "k_linear"),
)
# Child names of fused QKV projections.
_FUSED_NAMES = (
    "qkv_proj",
    "qkv",
    "Wqkv",
    "W_pack",
    "c_attn",
    "to_qkv",
    "query_key_value",
    "linear_qkv",  # Megatron-Core, grouped per KV head
)
# Multi-head latent attention (DeepSeek-V2/V3): low-rank Q/K with a decoupled RoPE part.
_MLA_MARKERS = ("kv_a_proj_with_mqa", "q_a_proj")


@dataclass
class Projection:
    """One projection weight as found in the model."""

    path: str  # qualified module (or parameter) name, for messages
    weight: torch.Tensor
    weight_name: str
    input_major: bool

    @property
    def in_features(self) -> int:
        return self.weight.shape[0] if self.input_major else self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[1] if self.input_major else self.weight.shape[0]


@dataclass
class QKLocation:
    q: Projection | None = None
    k: Projection | None = None
    qkv: Projection | None = None
    qkv_child: str = ""  # local name of the fused child (for the layout rules)
    unsupported: str = ""  # why an attention-looking module cannot be read


def locate_qk(
    name: str,
    module: nn.Module,
    override: AttentionOverride | None,
    param_names: Mapping[int, str],
) -> QKLocation | None:
    """The Q/K projections of ``module`` (named ``name``), None when it is not attention.

    Raises :class:`DiscoveryError` when a child the override names is missing or holds no
    2-D weight parameter.
    """
    if override is not None and override.q is not None:
        assert override.k is not None
        return QKLocation(
            q=_child_projection(name, module, override.q, param_names, required=True),
            k=_child_projection(name, module, override.k, param_names, required=True),
        )
    if override is not None and override.qkv is not None:
        qkv = _child_projection(name, module, override.qkv, param_names, required=True)
        return QKLocation(qkv=qkv, qkv_child=override.qkv.rsplit(".", 1)[-1])
    if isinstance(module, nn.MultiheadAttention):
        return _locate_torch_mha(name, module, param_names)
    children = module._modules
    for q_child, k_child in QK_PAIRS:
        if q_child in children and k_child in children:
            q = _child_projection(name, module, q_child, param_names, required=False)
            k = _child_projection(name, module, k_child, param_names, required=False)
            if q is not None and k is not None:
                return QKLocation(q=q, k=k)
    for fused_child in _FUSED_NAMES:
        if fused_child in children:
            qkv = _child_projection(name, module, fused_child, param_names, required=False)
            if qkv is None:
                continue
            if fused_child == "c_attn" and "q_attn" in children:
                return QKLocation(unsupported="cross-attention: queries and keys differ")
            return QKLocation(qkv=qkv, qkv_child=fused_child)
    if any(marker in children for marker in _MLA_MARKERS):
        return QKLocation(unsupported="multi-head latent attention")
    return None


def _locate_torch_mha(
    name: str, module: nn.MultiheadAttention, param_names: Mapping[int, str]
) -> QKLocation:
    def param(attr: str) -> Projection:
        weight = getattr(module, attr)
        return Projection(join(name, attr), weight, param_names[id(weight)], False)

    if module.in_proj_weight is not None:  # [3d, d], rows q | k | v
        return QKLocation(qkv=param("in_proj_weight"), qkv_child="in_proj")
    return QKLocation(q=param("q_proj_weight"), k=param("k_proj_weight"))


def _child_projection(
    name: str,
    module: nn.Module,
    child: str,
    param_names: Mapping[int, str],
    required: bool,
) -> Projection | None:
    path = join(name, child)
    try:
        sub = module.get_submodule(child)
    except AttributeError:
        if required:
            raise DiscoveryError(
                f"attention override for {name!r}: {path!r} is not a module of the model"
            ) from None
        return None
    weight = getattr(sub, "weight", None)
    weight_name = param_names.get(id(weight)) if isinstance(weight, torch.Tensor) else None
    if weight_name is None or weight.dim() != 2:
        if required:
            raise DiscoveryError(
                f"{describe(path, sub)}: expected a projection with a 2-D `weight` parameter"
            )
        return None
    input_major = type(sub).__name__ == "Conv1D" or (
        not isinstance(sub, nn.Linear) and getattr(sub, "nf", None) == weight.shape[1]
    )
    return Projection(path, weight, weight_name, input_major)
