"""Attention-like modules discovery cannot read, and what kind of layer each one is.

``find_attention`` never skips an attention-like module silently: every module named like
attention (or holding a state-space layer's ``A_log`` / ``dt_bias``) that yields no site is
named in one warning with its kind:

- linear attention or a state-space mixer (Kimi's delta attention, Qwen3-Next's gated DeltaNet,
  Mamba, RetNet, RWKV): no softmax QK bilinear form to monitor, even when it has ``q_proj`` and
  ``k_proj`` (it is recognized before the projections are looked for);
- per-expert queries (JetMoE's mixture of attention heads: queries from experts, a fused
  ``kv_proj``);
- custom projections (``q``/``k``-named children without a 2-D ``weight`` parameter: quantized
  or wrapped layers);
- anything else with parameters and no recognizable Q/K projections.

Containers of attention modules that were read (``BertAttention`` around ``BertSelfAttention``)
and modules inside them are not reported.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from torch import nn

LINEAR_ATTENTION = "linear attention or a state-space mixer: no softmax QK form to monitor"
PER_EXPERT_QUERIES = "per-expert queries (a mixture of attention heads) with a fused kv_proj"
CUSTOM_PROJECTIONS = "custom projections: its q/k children hold no 2-D `weight` parameter"
NO_PROJECTIONS = "no recognizable Q/K projections"

_ATTENTION_NAME = re.compile(r"attention|attn", re.IGNORECASE)
_LINEAR_NAME = re.compile(r"delta|mamba|retention|rwkv|ssm\b|lightning", re.IGNORECASE)
_STATE_SPACE_PARAMS = ("A_log", "dt_bias")


def is_linear_attention(module: nn.Module) -> bool:
    """A linear-attention or state-space layer, by class name or by its decay parameters."""
    if _LINEAR_NAME.search(type(module).__name__):
        return True
    return any(p in module._parameters for p in _STATE_SPACE_PARAMS)


def unread_kind(module: nn.Module, qk_pairs: Iterable[tuple[str, str]]) -> str | None:
    """Why attention-like ``module`` gave no site; None when it is not attention-like."""
    if is_linear_attention(module):
        return LINEAR_ATTENTION
    if not _ATTENTION_NAME.search(type(module).__name__):
        return None
    children = module._modules
    if "experts" in children and "kv_proj" in children:
        return PER_EXPERT_QUERIES
    if any(q in children and k in children for q, k in qk_pairs):
        return CUSTOM_PROJECTIONS
    if next(module.parameters(), None) is None:
        return None  # a mask helper or a rotary embedding named like attention
    return NO_PROJECTIONS


def related(name: str, others: Iterable[str]) -> bool:
    """``name`` is one of ``others``, contains one or sits inside one."""
    for other in others:
        if name == other or name.startswith(other + ".") or other.startswith(name + "."):
            return True
    return False
