"""How the heads of an attention layer sit in the rows of its Q/K projection weights.

Given H (query heads) and whatever H_kv and d_h are declared, the solvers fix the rest from the
weight shapes and raise :class:`DiscoveryError` (naming the override that fixes it) when the
declared counts do not fit:

- separate projections: q_out = H * d_h, k_out = H_kv * d_h;
- gated queries (Qwen3-Next, Qwen3.5): q_proj holds [q_h | gate_h] per head, q_out = 2 H d_h,
  recognized when H and d_h are declared and the module's forward views the projection as
  (..., H, 2 d_h) chunks; an override of num_heads that would read gate rows as query heads is
  refused;
- fused projections: width = (H + 2 H_kv) * d_h, in one of three row layouts: ``concat``
  (all q | all k | all v), ``per_head`` ([q_h | k_h | v_h] per head: GPT-NeoX, Bloom,
  Persimmon, multi-head Falcon and BigCode) or ``grouped`` (per KV group its query heads, then
  k, then v: Falcon-40B, Megatron-Core's ``linear_qkv``). The layout is a property of the
  model family (and of Megatron's child name), not of the name in general.
"""

from __future__ import annotations

import inspect
import re

from torch import nn

from agent.discovery.errors import DiscoveryError, describe, override_hint
from agent.discovery.model_config import (
    HEAD_DIM_KEYS,
    NUM_HEADS_KEYS,
    head_count_sources,
    lookup,
    lookup_flag,
    read_field,
)
from agent.discovery.overrides import AttentionOverride
from agent.discovery.projections import Projection

# The row layout of a fused projection is a property of the model family, not of the name.
_PER_HEAD_FAMILIES = ("gpt_neox", "gptneox", "bloom", "persimmon")


def solve_separate(
    where: str,
    name: str,
    num_heads: int,
    kv_declared: int | None,
    dh_declared: int | None,
    q: Projection,
    k: Projection,
    gated: bool = False,
) -> tuple[int, int]:
    """H is known; q_out = H * d_h (2 H d_h with a gate per head) and k_out = H_kv * d_h fix
    the rest."""
    q_out = q.out_features // 2 if gated else q.out_features
    if dh_declared is not None:
        head_dim = dh_declared
        if q_out == 2 * num_heads * head_dim:
            raise DiscoveryError(
                f"{where}: {q.path} has 2 * num_heads * head_dim = {q_out} outputs: queries with "
                "an output gate each (Qwen3-Next style), but the module's code does not show "
                "which rows are queries. Overriding num_heads would read gate rows as query "
                f"heads; `exclude` {name!r} instead"
            )
        if q_out != num_heads * head_dim:
            raise DiscoveryError(
                f"{where}: {q.path} has {q_out} outputs but num_heads * head_dim = "
                f"{num_heads} * {head_dim}. {override_hint(name, 'num_heads/head_dim')}"
            )
    else:
        if q_out % num_heads:
            raise DiscoveryError(
                f"{where}: {q.path} has {q_out} outputs, not divisible by "
                f"num_heads = {num_heads}. {override_hint(name, 'num_heads/head_dim')}"
            )
        head_dim = q_out // num_heads
    if k.out_features % head_dim:
        raise DiscoveryError(
            f"{where}: {k.path} has {k.out_features} outputs, not a multiple of head_dim = "
            f"{head_dim}. {override_hint(name, 'head_dim')}"
        )
    num_kv_heads = k.out_features // head_dim
    if kv_declared is not None and kv_declared != num_kv_heads:
        raise DiscoveryError(
            f"{where}: {kv_declared} key/value heads are declared but {k.path} has "
            f"{k.out_features} = {num_kv_heads} * {head_dim} outputs. "
            f"{override_hint(name, 'num_kv_heads')}"
        )
    _check_groups(where, name, num_heads, num_kv_heads)
    return num_kv_heads, head_dim


def solve_fused(
    where: str,
    name: str,
    layout: str,
    num_heads: int,
    kv_declared: int | None,
    dh_declared: int | None,
    width: int,
) -> tuple[int, int]:
    """H is known; width = (H + 2 H_kv) d_h (v heads as wide as k heads). With neither H_kv
    nor d_h declared, H_kv = H (multi-head attention, the convention of model configs)."""
    if layout == "per_head":
        if kv_declared is not None and kv_declared != num_heads:
            raise DiscoveryError(
                f"{where}: the per-head fused layout needs num_kv_heads == num_heads, got "
                f"{kv_declared} and {num_heads}. {override_hint(name, 'qkv_layout')}"
            )
        kv_declared = num_heads
    if dh_declared is not None:
        head_dim = dh_declared
        units, rest = divmod(width, head_dim)
        num_kv_heads, odd = divmod(units - num_heads, 2)
        if rest or odd or num_kv_heads < 1:
            raise DiscoveryError(
                f"{where}: fused width {width} is not (num_heads + 2 * num_kv_heads) * head_dim "
                f"for num_heads = {num_heads}, head_dim = {head_dim}. "
                f"{override_hint(name, 'num_heads/head_dim')}"
            )
        if kv_declared is not None and kv_declared != num_kv_heads:
            raise DiscoveryError(
                f"{where}: {kv_declared} key/value heads are declared but fused width {width} "
                f"with head_dim {head_dim} holds {num_kv_heads}. "
                f"{override_hint(name, 'num_kv_heads')}"
            )
    else:
        num_kv_heads = num_heads if kv_declared is None else kv_declared
        units = num_heads + 2 * num_kv_heads
        if width % units:
            raise DiscoveryError(
                f"{where}: fused width {width} is not a multiple of num_heads + 2 * num_kv_heads "
                f"= {units}. {override_hint(name, 'num_kv_heads/head_dim')}"
            )
        head_dim = width // units
    _check_groups(where, name, num_heads, num_kv_heads)
    return num_kv_heads, head_dim


def _check_groups(where: str, name: str, num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise DiscoveryError(
            f"{where}: num_heads = {num_heads} is not a multiple of num_kv_heads = "
            f"{num_kv_heads}. {override_hint(name, 'num_kv_heads')}"
        )


def head_starts(
    layout: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """First output row of each query head's and each KV head's d_h block."""
    group = num_heads // num_kv_heads
    if layout == "separate":
        q = [h * head_dim for h in range(num_heads)]
        k = [g * head_dim for g in range(num_kv_heads)]
    elif layout == "gated":  # q_proj: [q_h | gate_h] for each head; k_proj as separate
        q = [2 * h * head_dim for h in range(num_heads)]
        k = [g * head_dim for g in range(num_kv_heads)]
    elif layout == "concat":  # q_0..q_{H-1} | k_0..k_{H_kv-1} | v...
        q = [h * head_dim for h in range(num_heads)]
        k = [(num_heads + g) * head_dim for g in range(num_kv_heads)]
    elif layout == "per_head":  # [q_h | k_h | v_h] for each head
        q = [3 * h * head_dim for h in range(num_heads)]
        k = [(3 * g + 1) * head_dim for g in range(num_kv_heads)]
    elif layout == "grouped":  # per KV group g: q_{g*r}..q_{g*r+r-1} | k_g | v_g
        q = [((h // group) * (group + 2) + h % group) * head_dim for h in range(num_heads)]
        k = [(g * (group + 2) + group) * head_dim for g in range(num_kv_heads)]
    else:
        raise AssertionError(layout)
    return tuple(q), tuple(k)


def fused_layout(
    name: str,
    module: nn.Module,
    model: nn.Module,
    override: AttentionOverride | None,
    child: str,
) -> str:
    """The row layout of fused child ``child`` of ``module``: the override's, else the one its
    model family uses; raises :class:`DiscoveryError` for a ``query_key_value`` (or CodeGen)
    projection of an unknown family."""
    if override is not None and override.qkv_layout is not None:
        return override.qkv_layout
    if isinstance(module, nn.MultiheadAttention):
        return "concat"
    if child == "linear_qkv":  # Megatron-Core: per query group its heads, then k, then v
        return "grouped"
    family = _family(module, model)
    sources = head_count_sources(module, model, None)
    if any(tag in family for tag in _PER_HEAD_FAMILIES):
        return "per_head"
    if "falcon" in family:
        if lookup_flag(sources, "new_decoder_architecture"):
            return "grouped"
        return "concat" if lookup_flag(sources, "multi_query") else "per_head"
    if "bigcode" in family:
        return "concat" if lookup_flag(sources, "multi_query") else "per_head"
    if "codegen" in family or child == "query_key_value":
        raise DiscoveryError(
            f"{describe(name, module)}: the row layout of fused projection {child!r} depends on "
            f"the model family and is not known for {family!r}. "
            f"{override_hint(name, 'qkv_layout')} (one of 'concat', 'per_head', 'grouped')"
        )
    return "concat"


def _family(module: nn.Module, model: nn.Module) -> str:
    parts = [type(module).__name__.lower()]
    for owner in (module, model):
        model_type = read_field(read_field(owner, "config"), "model_type")
        if isinstance(model_type, str):
            parts.append(model_type.lower())
    return " ".join(parts)


def gated_queries(
    where: str,
    module: nn.Module,
    model: nn.Module,
    override: AttentionOverride | None,
    q: Projection,
) -> bool:
    """Whether ``q`` holds an output gate after each query head (module docstring). Raises
    :class:`DiscoveryError` when the override's num_heads would read the gates as heads."""
    declared = head_count_sources(module, model, None)
    heads, head_dim = lookup(declared, NUM_HEADS_KEYS), lookup(declared, HEAD_DIM_KEYS)
    if heads is None or head_dim is None or q.out_features != 2 * heads[0] * head_dim[0]:
        return False
    if not _views_query_gates(type(module)):
        return False
    if override is not None and override.num_heads not in (None, heads[0]):
        raise DiscoveryError(
            f"{where}: the override's num_heads = {override.num_heads} would read the output-gate "
            f"rows of {q.path} as query heads: it holds {heads[0]} query heads of {head_dim[0]} "
            "rows, each followed by its gate; drop num_heads from the override"
        )
    return True


def _views_query_gates(cls: type) -> bool:
    """The forward splits q_proj's output per head into a query and a gate of d_h each."""
    try:
        source = inspect.getsource(cls.forward)
    except (OSError, TypeError):
        return False
    return bool(re.search(r"head_dim\s*\*\s*2", source)) and "chunk" in source
