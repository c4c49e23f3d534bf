"""Find attention Q/K projections (with their head layout) and MoE routers in a model.

The spectral monitors need, for every attention layer and query head h, the factor pair
W_q^h, W_k^g(h) in R^{d x d_h} (DESIGN.md 1a); the router monitors need every module that
turns a token into routing logits through an [E, d] weight (DESIGN.md 1b). This module reads
them out of real model code:

- attention: separate ``q_proj``/``k_proj``-style projections (Llama, Mistral, Qwen, Mixtral,
  OLMoE, BERT, T5, CLIP, Meta-Llama ``wq``/``wk``, ...), fused QKV projections (``qkv``,
  ``qkv_proj``, ``Wqkv``, ``W_pack``, ``c_attn`` incl. GPT-2's transposed ``Conv1D``,
  ``query_key_value`` with its per-family row layout) and ``nn.MultiheadAttention``;
  grouped- and multi-query attention; QK-norm scales folded into the factors.
- routers: ``nn.Linear`` gates and custom router modules with a ``weight`` [E, d], confirmed
  against the experts container or a declared expert count.

Head counts come from the attention module's attributes, its ``config``, or the model's
``config``. When a count cannot be determined, or the declared counts do not fit the weight
shapes, discovery raises :class:`DiscoveryError` naming the module and the override that fixes
it (:class:`DiscoveryOverrides`, meant to be filled from the agent's YAML config).

Factor convention: a query projection computes q = x @ W^T (+ b) for x of shape (..., d), and
head h of q is q[..., h*d_h:(h+1)*d_h] (for the separate layout). The factor of head h is
W_q^h = W[h*d_h:(h+1)*d_h].T, shape (d, d_h), so that x @ W_q^h is that head's query (minus
bias). Query head h pairs with KV head g(h) = h // (H / H_kv), as in Hugging Face's
``repeat_kv``.
"""

from __future__ import annotations

import copy
import difflib
import operator
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Literal, TypeVar

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import nn

from agent.router_output import extract_router_logits

__all__ = [
    "AttentionOverride",
    "AttentionSite",
    "DiscoveryError",
    "DiscoveryOverrides",
    "HeadSlices",
    "RouterOverride",
    "RouterSite",
    "extract_router_logits",
    "find_attention",
    "find_routers",
]

QKVLayout = Literal["concat", "per_head", "grouped"]
_T = TypeVar("_T")

# Attribute / config names, tried in this order on each source.
_NUM_HEADS_KEYS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "nh", "heads")
_NUM_KV_HEADS_KEYS = (
    "num_key_value_heads",
    "num_kv_heads",
    "n_kv_heads",
    "n_kv_head",
    "num_heads_kv",
    "kv_n_heads",
    "kv_heads",
    "num_query_groups",
)
_KV_GROUPS_KEYS = ("num_key_value_groups",)  # H / H_kv
_HEAD_DIM_KEYS = (
    "head_dim",
    "head_size",
    "attention_head_size",
    "d_head",
    "dim_head",
    "key_value_proj_dim",
    "d_kv",
    "kv_channels",
)
_NUM_EXPERTS_KEYS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "n_experts",
    "moe_num_experts",
    "num_expert",
    "n_expert",
)
_TOP_K_MODULE_KEYS = (
    "top_k",
    "num_experts_per_tok",
    "topk",
    "moe_top_k",
    "num_selected_experts",
    "router_topk",
    "k",
)
_TOP_K_CONFIG_KEYS = (
    "num_experts_per_tok",
    "top_k",
    "moe_top_k",
    "num_selected_experts",
    "moe_router_topk",
)

# Child names of separate query/key projections, as (query, key) pairs.
_QK_PAIRS = (
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
_FUSED_NAMES = ("qkv_proj", "qkv", "Wqkv", "W_pack", "c_attn", "to_qkv", "query_key_value")
_Q_NORM_NAMES = ("q_norm", "q_layernorm", "query_layernorm", "q_ln", "query_norm")
_K_NORM_NAMES = ("k_norm", "k_layernorm", "key_layernorm", "k_ln", "key_norm")
# Multi-head latent attention (DeepSeek-V2/V3): low-rank Q/K with a decoupled RoPE part.
_MLA_MARKERS = ("kv_a_proj_with_mqa", "q_a_proj")

# A router is named like this (the local module name) ...
_ROUTER_NAMES = frozenset({"gate", "router", "gating", "moe_gate", "router_gate"})
# ... or is a child named like this of a module named like a router (``router.layer`` in
# DBRX / Granite-MoE / JetMoE, ``router.classifier`` in Switch, ``gate.wg`` in DeepSpeed).
_ROUTER_CHILD_NAMES = frozenset({"layer", "classifier", "wg", "linear", "proj"})

# The row layout of a fused projection is a property of the model family, not of the name.
_PER_HEAD_FAMILIES = ("gpt_neox", "gptneox", "bloom", "persimmon")


class DiscoveryError(ValueError):
    """Discovery could not find or could not interpret a module; the message says which and
    which override fixes it."""


# --------------------------------------------------------------------------------- overrides


class AttentionOverride(BaseModel):
    """What discovery cannot infer about one attention module (or each module a pattern
    matches). Unset fields are inferred as usual."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q: str | None = Field(None, description="child module holding the query projection")
    k: str | None = Field(None, description="child module holding the key projection")
    qkv: str | None = Field(None, description="child module holding a fused QKV projection")
    qkv_layout: QKVLayout | None = Field(
        None,
        description="row layout of the fused projection: 'concat' (all q, all k, all v), "
        "'per_head' ([q_h, k_h, v_h] per head, GPT-NeoX/Bloom), 'grouped' (per KV group: its "
        "query heads, then k, then v; Falcon-40B)",
    )
    num_heads: int | None = Field(None, ge=1, description="number of query heads H")
    num_kv_heads: int | None = Field(None, ge=1, description="number of key/value heads H_kv")
    head_dim: int | None = Field(None, ge=1, description="per-head dimension d_h")
    q_norm: str | None = Field(None, description="child module of the query QK-norm")
    k_norm: str | None = Field(None, description="child module of the key QK-norm")
    fold_qk_norm: bool = Field(True, description="fold QK-norm scales into the factors")

    @model_validator(mode="after")
    def _one_projection_form(self) -> AttentionOverride:
        if self.qkv is not None and (self.q is not None or self.k is not None):
            raise ValueError("set either q and k, or qkv, not both")
        if (self.q is None) != (self.k is None):
            raise ValueError("q and k must be set together")
        return self


class RouterOverride(BaseModel):
    """Marks a module as a router (it must hold a ``weight`` of shape [E, d])."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    num_experts: int | None = Field(None, ge=2, description="E; must equal weight.shape[0]")
    top_k: int | None = Field(None, ge=1, description="experts chosen per token")


class DiscoveryOverrides(BaseModel):
    """Explicit answers for what discovery cannot infer. Keys are module names as in
    ``model.named_modules()``, or fnmatch patterns (``*`` also crosses dots); an exact name
    wins over patterns, else the first matching pattern applies."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    attention: dict[str, AttentionOverride] = Field(
        default_factory=dict, description="attention module name or pattern -> override"
    )
    routers: dict[str, RouterOverride] = Field(
        default_factory=dict, description="router module name or pattern -> override"
    )
    exclude: list[str] = Field(
        default_factory=list, description="fnmatch patterns of module names to ignore"
    )


# ------------------------------------------------------------------------------------ sites


@dataclass(frozen=True)
class HeadSlices:
    """Where each head of one projection (query or key) lives inside a weight."""

    weight_name: str  # qualified parameter name, as in model.named_parameters()
    weight_shape: tuple[int, int]
    input_major: bool  # weight stored [d, out] (GPT-2 Conv1D) instead of [out, d]
    starts: tuple[int, ...]  # first output feature of each head's d_h block
    norm_name: str | None = None  # qualified name of the QK-norm scale folded in, if any
    norm_numel: int = 0  # d_h (one scale shared by all heads) or n_heads * d_h
    norm_offset: float = 0.0  # 1.0 when the norm multiplies by (1 + weight) (Gemma), else 0.0


@dataclass(frozen=True)
class AttentionSite:
    """One attention layer: its head layout and how to read per-head Q/K factors."""

    name: str  # module name, used as the "layer" label
    num_heads: int  # H
    num_kv_heads: int  # H_kv (H for MHA, 1 for MQA)
    head_dim: int  # d_h
    d_model: int  # d, the input width of the projections
    layout: str  # "separate", "concat", "per_head" or "grouped"
    q: HeadSlices
    k: HeadSlices
    module: nn.Module = field(compare=False, repr=False)
    live_parameters: Mapping[str, nn.Parameter] = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert len(self.q.starts) == self.num_heads and len(self.k.starts) == self.num_kv_heads

    @property
    def group_size(self) -> int:
        """Query heads per KV head, H / H_kv."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self, h: int) -> int:
        """The KV head g(h) that query head ``h`` attends with."""
        h = _head_index(h, self.num_heads, f"{self.name}: query head")
        return h // self.group_size

    def parameters_to_snapshot(self) -> dict[str, nn.Parameter]:
        """The live parameters (projection weights, QK-norm scales) the factors are read from,
        keyed by qualified parameter name. Cloning these (e.g. to fp32) is a full snapshot."""
        return dict(self.live_parameters)

    def factors(
        self,
        params: Mapping[str, torch.Tensor] | None = None,
        heads: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head factor pairs from ``params`` (a snapshot keyed like
        :meth:`parameters_to_snapshot`, or any state dict holding those keys; the live
        parameters when None).

        Returns ``(wq, wk)``, both (n_sel, d, d_h) in ``dtype``, fresh tensors: wq[i] is
        W_q^h for the i-th selected query head h (all heads in order when ``heads`` is None)
        and wk[i] is W_k^g(h), its KV head's factor.
        """
        q_heads = self._select(heads, self.num_heads, "query head")
        wq = self._head_factors(self.q, params, q_heads, dtype)
        wk = self._head_factors(self.k, params, [h // self.group_size for h in q_heads], dtype)
        return wq, wk

    def factors_kv(
        self,
        params: Mapping[str, torch.Tensor] | None = None,
        kv_heads: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The distinct key factors W_k^g, (n_sel, d, d_h) (all H_kv in order when
        ``kv_heads`` is None), for the dW_k spectra."""
        selected = self._select(kv_heads, self.num_kv_heads, "KV head")
        return self._head_factors(self.k, params, selected, dtype)

    def _select(self, heads: Sequence[int] | None, count: int, what: str) -> list[int]:
        if heads is None:
            return list(range(count))
        return [_head_index(h, count, f"{self.name}: {what}") for h in heads]

    def _tensor(
        self, key: str, params: Mapping[str, torch.Tensor] | None, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``params[key]`` (live when None), checked against ``shape``; a 1-D ``shape`` only
        fixes the element count (QK-norm scales may be [d_h], [H * d_h] or [H, d_h])."""
        source = self.live_parameters if params is None else params
        try:
            tensor = source[key]
        except KeyError:
            raise ValueError(
                f"{self.name}: params has no entry {key!r}; pass the mapping returned by "
                "parameters_to_snapshot() (or a clone of it)"
            ) from None
        fits = tensor.numel() == shape[0] if len(shape) == 1 else tuple(tensor.shape) == shape
        if not fits:
            raise ValueError(
                f"{self.name}: params[{key!r}] has shape {tuple(tensor.shape)}, expected {shape}"
            )
        return tensor.detach()

    def _head_factors(
        self,
        spec: HeadSlices,
        params: Mapping[str, torch.Tensor] | None,
        indices: Sequence[int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        d, d_h = self.d_model, self.head_dim
        weight = self._tensor(spec.weight_name, params, spec.weight_shape)  # [out, d] or [d, out]
        out = torch.empty((len(indices), d, d_h), dtype=dtype, device=weight.device)
        for i, head in enumerate(indices):
            start = spec.starts[head]
            if spec.input_major:
                out[i].copy_(weight[:, start : start + d_h])  # (d, d_h)
            else:
                out[i].copy_(weight[start : start + d_h].T)  # (d, d_h)
        if spec.norm_name is not None:
            scale = self._tensor(spec.norm_name, params, (spec.norm_numel,))
            scale = scale.to(device=weight.device, dtype=dtype).reshape(-1, d_h)  # (1|n, d_h)
            if spec.norm_offset:
                scale = scale + spec.norm_offset
            rows = scale.expand(len(indices), d_h) if scale.shape[0] == 1 else scale[indices]
            out.mul_(rows[:, None, :])  # scales the columns of each head's factor
        return out


@dataclass(frozen=True)
class RouterSite:
    """One MoE router: a module whose [E, d] weight produces the routing logits."""

    name: str  # module name, used as the "router" label
    module: nn.Module = field(compare=False, repr=False)
    num_experts: int  # E
    d_model: int  # d
    top_k: int | None  # experts chosen per token, when declared
    weight_name: str  # qualified parameter name of the [E, d] weight

    def weight(self) -> torch.Tensor:
        """The live router weight [E, d]."""
        return self.module.weight

    def bias(self) -> torch.Tensor | None:
        """The live logit bias [E] (an ``nn.Linear`` gate with bias), else None."""
        bias = getattr(self.module, "bias", None)
        if isinstance(bias, torch.Tensor) and tuple(bias.shape) == (self.num_experts,):
            return bias
        return None


# --------------------------------------------------------------------------- find_attention


@dataclass
class _Projection:
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
class _QKLocation:
    q: _Projection | None = None
    k: _Projection | None = None
    qkv: _Projection | None = None
    qkv_child: str = ""  # local name of the fused child (for the layout rules)
    unsupported: str = ""  # why an attention-looking module cannot be read


def find_attention(
    model: nn.Module, overrides: DiscoveryOverrides | None = None
) -> list[AttentionSite]:
    """Every attention layer of ``model`` with its Q/K projections and head layout, in
    ``named_modules()`` order.

    Raises :class:`DiscoveryError` when a layer's head counts cannot be determined or do not
    fit its weights, or when an override names a module that does not exist. Attention-looking
    modules of an unsupported kind (DeepSeek's multi-head latent attention, GPT-2
    cross-attention, ``nn.MultiheadAttention`` with ``kdim != embed_dim``) are skipped with one
    warning.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"find_attention expects an nn.Module, got {type(model).__name__}")
    overrides = overrides or DiscoveryOverrides()
    modules = dict(model.named_modules())
    _check_override_keys("attention", overrides.attention, modules, overrides.exclude)
    param_names = {id(p): n for n, p in model.named_parameters()}
    sites: list[AttentionSite] = []
    skipped: list[str] = []
    for name, module in modules.items():
        if _excluded(name, overrides.exclude):
            continue
        override = _override_for(name, overrides.attention)
        location = _locate_qk(name, module, override, param_names)
        if location is None:
            if override is not None and name in overrides.attention:
                raise DiscoveryError(
                    f"{_describe(name, module)}: an attention override names it but it has no "
                    "recognizable Q/K projections; set `q` and `k`, or `qkv`, in its override"
                )
            continue
        if location.q is not None and location.k is not None and override is None:
            if location.q.in_features != location.k.in_features:
                location.unsupported = "queries and keys read inputs of different widths"
        if location.unsupported:
            skipped.append(f"{_describe(name, module)} ({location.unsupported})")
            continue
        sites.append(_build_site(name, module, model, override, location, param_names))
    if skipped:
        warnings.warn(
            "mechwatch discovery skipped attention modules it cannot read: "
            + "; ".join(skipped)
            + ". Add them to `exclude` to silence this.",
            stacklevel=2,
        )
    return sites


def _locate_qk(
    name: str,
    module: nn.Module,
    override: AttentionOverride | None,
    param_names: Mapping[int, str],
) -> _QKLocation | None:
    if override is not None and override.q is not None:
        assert override.k is not None
        return _QKLocation(
            q=_child_projection(name, module, override.q, param_names, required=True),
            k=_child_projection(name, module, override.k, param_names, required=True),
        )
    if override is not None and override.qkv is not None:
        qkv = _child_projection(name, module, override.qkv, param_names, required=True)
        return _QKLocation(qkv=qkv, qkv_child=override.qkv.rsplit(".", 1)[-1])
    if isinstance(module, nn.MultiheadAttention):
        return _locate_torch_mha(name, module, param_names)
    children = module._modules
    for q_child, k_child in _QK_PAIRS:
        if q_child in children and k_child in children:
            q = _child_projection(name, module, q_child, param_names, required=False)
            k = _child_projection(name, module, k_child, param_names, required=False)
            if q is not None and k is not None:
                return _QKLocation(q=q, k=k)
    for fused_child in _FUSED_NAMES:
        if fused_child in children:
            qkv = _child_projection(name, module, fused_child, param_names, required=False)
            if qkv is None:
                continue
            if fused_child == "c_attn" and "q_attn" in children:
                return _QKLocation(unsupported="cross-attention: queries and keys differ")
            return _QKLocation(qkv=qkv, qkv_child=fused_child)
    if any(marker in children for marker in _MLA_MARKERS):
        return _QKLocation(unsupported="multi-head latent attention")
    return None


def _locate_torch_mha(
    name: str, module: nn.MultiheadAttention, param_names: Mapping[int, str]
) -> _QKLocation:
    def param(attr: str) -> _Projection:
        weight = getattr(module, attr)
        return _Projection(_join(name, attr), weight, param_names[id(weight)], False)

    if module.in_proj_weight is not None:  # [3d, d], rows q | k | v
        return _QKLocation(qkv=param("in_proj_weight"), qkv_child="in_proj")
    return _QKLocation(q=param("q_proj_weight"), k=param("k_proj_weight"))


def _child_projection(
    name: str,
    module: nn.Module,
    child: str,
    param_names: Mapping[int, str],
    required: bool,
) -> _Projection | None:
    path = _join(name, child)
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
                f"{_describe(path, sub)}: expected a projection with a 2-D `weight` parameter"
            )
        return None
    input_major = type(sub).__name__ == "Conv1D" or (
        not isinstance(sub, nn.Linear) and getattr(sub, "nf", None) == weight.shape[1]
    )
    return _Projection(path, weight, weight_name, input_major)


def _build_site(
    name: str,
    module: nn.Module,
    model: nn.Module,
    override: AttentionOverride | None,
    location: _QKLocation,
    param_names: Mapping[int, str],
) -> AttentionSite:
    where = _describe(name, module)
    sources = _sources(module, model, override)
    heads = _lookup(sources, _NUM_HEADS_KEYS)
    if heads is None:
        raise DiscoveryError(
            f"{where}: cannot determine the number of query heads: none of "
            f"{', '.join(_NUM_HEADS_KEYS)} is set on the module, its `config`, or the model's "
            f"`config`. {_override_hint(name, 'num_heads')}"
        )
    num_heads = heads[0]
    kv_declared = _declared_kv_heads(sources, num_heads)
    dh_found = _lookup(sources, _HEAD_DIM_KEYS)
    dh_declared = dh_found[0] if dh_found is not None else None

    if location.qkv is not None:
        qkv = location.qkv
        layout = _fused_layout(name, module, model, override, location.qkv_child)
        num_kv_heads, head_dim = _solve_fused(
            where, name, layout, num_heads, kv_declared, dh_declared, qkv.out_features
        )
        q_proj = k_proj = qkv
    else:
        assert location.q is not None and location.k is not None
        q_proj, k_proj = location.q, location.k
        layout = "separate"
        if q_proj.in_features != k_proj.in_features:
            raise DiscoveryError(
                f"{where}: query input width {q_proj.in_features} differs from key input width "
                f"{k_proj.in_features}; attention between inputs of different widths is not "
                "supported"
            )
        num_kv_heads, head_dim = _solve_separate(
            where, name, num_heads, kv_declared, dh_declared, q_proj, k_proj
        )
    q_starts, k_starts = _head_starts(layout, num_heads, num_kv_heads, head_dim)

    fold = override is None or override.fold_qk_norm
    q_norm = _qk_norm(where, name, module, override, "q", num_heads, head_dim, param_names, fold)
    k_norm = _qk_norm(where, name, module, override, "k", num_kv_heads, head_dim, param_names, fold)
    live: dict[str, nn.Parameter] = {
        q_proj.weight_name: q_proj.weight,
        k_proj.weight_name: k_proj.weight,
    }
    q_slices = _slices(q_proj, q_starts, q_norm, live)
    k_slices = _slices(k_proj, k_starts, k_norm, live)
    return AttentionSite(
        name=name,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        d_model=q_proj.in_features,
        layout=layout,
        q=q_slices,
        k=k_slices,
        module=module,
        live_parameters=live,
    )


@dataclass
class _Norm:
    name: str
    weight: torch.Tensor
    offset: float


def _slices(
    projection: _Projection,
    starts: tuple[int, ...],
    norm: _Norm | None,
    live: dict[str, nn.Parameter],
) -> HeadSlices:
    if norm is not None:
        live[norm.name] = norm.weight
    return HeadSlices(
        weight_name=projection.weight_name,
        weight_shape=tuple(projection.weight.shape),
        input_major=projection.input_major,
        starts=starts,
        norm_name=None if norm is None else norm.name,
        norm_numel=0 if norm is None else norm.weight.numel(),
        norm_offset=0.0 if norm is None else norm.offset,
    )


def _solve_separate(
    where: str,
    name: str,
    num_heads: int,
    kv_declared: int | None,
    dh_declared: int | None,
    q: _Projection,
    k: _Projection,
) -> tuple[int, int]:
    """H is known; q_out = H * d_h and k_out = H_kv * d_h fix the rest."""
    if dh_declared is not None:
        head_dim = dh_declared
        if q.out_features != num_heads * head_dim:
            raise DiscoveryError(
                f"{where}: {q.path} has {q.out_features} outputs but num_heads * head_dim = "
                f"{num_heads} * {head_dim}. {_override_hint(name, 'num_heads/head_dim')}"
            )
    else:
        if q.out_features % num_heads:
            raise DiscoveryError(
                f"{where}: {q.path} has {q.out_features} outputs, not divisible by "
                f"num_heads = {num_heads}. {_override_hint(name, 'num_heads/head_dim')}"
            )
        head_dim = q.out_features // num_heads
    if k.out_features % head_dim:
        raise DiscoveryError(
            f"{where}: {k.path} has {k.out_features} outputs, not a multiple of head_dim = "
            f"{head_dim}. {_override_hint(name, 'head_dim')}"
        )
    num_kv_heads = k.out_features // head_dim
    if kv_declared is not None and kv_declared != num_kv_heads:
        raise DiscoveryError(
            f"{where}: {kv_declared} key/value heads are declared but {k.path} has "
            f"{k.out_features} = {num_kv_heads} * {head_dim} outputs. "
            f"{_override_hint(name, 'num_kv_heads')}"
        )
    _check_groups(where, name, num_heads, num_kv_heads)
    return num_kv_heads, head_dim


def _solve_fused(
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
                f"{kv_declared} and {num_heads}. {_override_hint(name, 'qkv_layout')}"
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
                f"{_override_hint(name, 'num_heads/head_dim')}"
            )
        if kv_declared is not None and kv_declared != num_kv_heads:
            raise DiscoveryError(
                f"{where}: {kv_declared} key/value heads are declared but fused width {width} "
                f"with head_dim {head_dim} holds {num_kv_heads}. "
                f"{_override_hint(name, 'num_kv_heads')}"
            )
    else:
        num_kv_heads = num_heads if kv_declared is None else kv_declared
        units = num_heads + 2 * num_kv_heads
        if width % units:
            raise DiscoveryError(
                f"{where}: fused width {width} is not a multiple of num_heads + 2 * num_kv_heads "
                f"= {units}. {_override_hint(name, 'num_kv_heads/head_dim')}"
            )
        head_dim = width // units
    _check_groups(where, name, num_heads, num_kv_heads)
    return num_kv_heads, head_dim


def _check_groups(where: str, name: str, num_heads: int, num_kv_heads: int) -> None:
    if num_heads % num_kv_heads:
        raise DiscoveryError(
            f"{where}: num_heads = {num_heads} is not a multiple of num_kv_heads = "
            f"{num_kv_heads}. {_override_hint(name, 'num_kv_heads')}"
        )


def _head_starts(
    layout: str, num_heads: int, num_kv_heads: int, head_dim: int
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """First output row of each query head's and each KV head's d_h block."""
    group = num_heads // num_kv_heads
    if layout == "separate":
        q = [h * head_dim for h in range(num_heads)]
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


def _fused_layout(
    name: str,
    module: nn.Module,
    model: nn.Module,
    override: AttentionOverride | None,
    child: str,
) -> str:
    if override is not None and override.qkv_layout is not None:
        return override.qkv_layout
    if isinstance(module, nn.MultiheadAttention):
        return "concat"
    family = _family(module, model)
    sources = _sources(module, model, None)
    if any(tag in family for tag in _PER_HEAD_FAMILIES):
        return "per_head"
    if "falcon" in family:
        if _lookup_flag(sources, "new_decoder_architecture"):
            return "grouped"
        return "concat" if _lookup_flag(sources, "multi_query") else "per_head"
    if "bigcode" in family:
        return "concat" if _lookup_flag(sources, "multi_query") else "per_head"
    if "codegen" in family or child == "query_key_value":
        raise DiscoveryError(
            f"{_describe(name, module)}: the row layout of fused projection {child!r} depends on "
            f"the model family and is not known for {family!r}. "
            f"{_override_hint(name, 'qkv_layout')} (one of 'concat', 'per_head', 'grouped')"
        )
    return "concat"


def _family(module: nn.Module, model: nn.Module) -> str:
    parts = [type(module).__name__.lower()]
    for owner in (module, model):
        model_type = _get(_get(owner, "config"), "model_type")
        if isinstance(model_type, str):
            parts.append(model_type.lower())
    return " ".join(parts)


def _qk_norm(
    where: str,
    name: str,
    module: nn.Module,
    override: AttentionOverride | None,
    which: str,
    n_heads: int,
    head_dim: int,
    param_names: Mapping[int, str],
    fold: bool,
) -> _Norm | None:
    if not fold:
        return None
    explicit = None if override is None else (override.q_norm if which == "q" else override.k_norm)
    if explicit is not None:
        try:
            norm = module.get_submodule(explicit)
        except AttributeError:
            raise DiscoveryError(
                f"attention override for {name!r}: {_join(name, explicit)!r} is not a module "
                "of the model"
            ) from None
        path = _join(name, explicit)
    else:
        names = _Q_NORM_NAMES if which == "q" else _K_NORM_NAMES
        child = next((n for n in names if n in module._modules), None)
        if child is None:
            return None
        norm, path = module._modules[child], _join(name, child)
    weight = getattr(norm, "weight", None)
    if not isinstance(weight, torch.Tensor) or id(weight) not in param_names:
        return None  # a norm without a learned scale: nothing to fold
    if weight.numel() not in (head_dim, n_heads * head_dim):
        raise DiscoveryError(
            f"{where}: {path} has a scale of shape {tuple(weight.shape)}; expected {head_dim} "
            f"(per head dim) or {n_heads * head_dim} (per head). Set fold_qk_norm: false in "
            f"the override for {name!r} to skip folding"
        )
    return _Norm(param_names[id(weight)], weight, _norm_scale_offset(where, path, norm, weight))


def _norm_scale_offset(where: str, path: str, norm: nn.Module, weight: torch.Tensor) -> float:
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


# ----------------------------------------------------------------------------- find_routers


def find_routers(model: nn.Module, overrides: DiscoveryOverrides | None = None) -> list[RouterSite]:
    """Every MoE router of ``model``, in ``named_modules()`` order.

    A router is a module named ``gate``/``router``/``gating`` (or a ``layer``/``classifier``/
    ``wg``/``linear``/``proj`` child of one) that holds a ``weight`` [E, d] with E >= 2, where
    E is confirmed by the number of sibling ``experts``, or by an expert count declared on the
    router, its MoE block, their ``config`` or the model's ``config``. ``gate_proj`` and
    ``shared_expert_gate`` never match. A candidate whose E disagrees with every declared count
    is skipped with a warning; one with no declared count at all is not a router. Modules
    named in ``overrides.routers`` are routers regardless of name.
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"find_routers expects an nn.Module, got {type(model).__name__}")
    overrides = overrides or DiscoveryOverrides()
    modules = dict(model.named_modules())
    _check_override_keys("routers", overrides.routers, modules, overrides.exclude)
    param_names = {id(p): n for n, p in model.named_parameters()}
    sites: list[RouterSite] = []
    mismatched: list[str] = []
    for name, module in modules.items():
        if _excluded(name, overrides.exclude):
            continue
        override = _override_for(name, overrides.routers)
        weight = module._parameters.get("weight")
        if override is not None:
            sites.append(
                _override_router(name, module, weight, override, model, modules, param_names)
            )
            continue
        holders, block = _router_context(name, modules)
        if not holders or weight is None or weight.dim() != 2 or weight.shape[0] < 2:
            continue
        num_experts = weight.shape[0]
        declared = _declared_num_experts(holders, block, model)
        if not declared:
            continue
        if num_experts not in declared:
            mismatched.append(
                f"{_describe(name, module)}: weight has {num_experts} rows, declared "
                f"{sorted(declared)}"
            )
            continue
        sites.append(
            RouterSite(
                name=name,
                module=module,
                num_experts=num_experts,
                d_model=weight.shape[1],
                top_k=_top_k(holders, block, model, num_experts),
                weight_name=param_names[id(weight)],
            )
        )
    if mismatched:
        warnings.warn(
            "mechwatch discovery skipped router-like modules whose expert count does not match: "
            + "; ".join(mismatched)
            + ". Name them in the `routers` override if they are routers.",
            stacklevel=2,
        )
    return sites


def _override_router(
    name: str,
    module: nn.Module,
    weight: torch.Tensor | None,
    override: RouterOverride,
    model: nn.Module,
    modules: Mapping[str, nn.Module],
    param_names: Mapping[int, str],
) -> RouterSite:
    where = _describe(name, module)
    if weight is None or weight.dim() != 2 or id(weight) not in param_names:
        raise DiscoveryError(
            f"{where}: named in the routers override but has no 2-D `weight` [E, d]; name the "
            "module that holds the router weight"
        )
    num_experts = weight.shape[0]
    if override.num_experts is not None and override.num_experts != num_experts:
        raise DiscoveryError(
            f"{where}: the routers override says num_experts = {override.num_experts} but the "
            f"weight has {num_experts} rows"
        )
    top_k = override.top_k
    if top_k is None:
        holders, block = _router_context(name, modules)
        top_k = _top_k(holders or [module], block, model, num_experts)
    elif top_k > num_experts:
        raise DiscoveryError(f"{where}: top_k = {top_k} exceeds num_experts = {num_experts}")
    return RouterSite(name, module, num_experts, weight.shape[1], top_k, param_names[id(weight)])


def _router_context(
    name: str, modules: Mapping[str, nn.Module]
) -> tuple[list[nn.Module], nn.Module | None]:
    """The router-ish modules (the candidate and a router-named parent) and the MoE block that
    contains them; no holders when the name does not look like a router."""
    parts = name.split(".") if name else []
    if not parts:
        return [], None
    local = parts[-1]
    parent_local = parts[-2] if len(parts) >= 2 else ""
    holders = [modules[name]]
    if local in _ROUTER_NAMES:
        block_parts = parts[:-1]
        if parent_local in _ROUTER_NAMES:  # e.g. router.gate
            holders.append(modules[".".join(parts[:-1])])
            block_parts = parts[:-2]
    elif local in _ROUTER_CHILD_NAMES and parent_local in _ROUTER_NAMES:
        holders.append(modules[".".join(parts[:-1])])
        block_parts = parts[:-2]
    else:
        return [], None
    return holders, modules.get(".".join(block_parts))


def _declared_num_experts(
    holders: Sequence[nn.Module], block: nn.Module | None, model: nn.Module
) -> set[int]:
    declared: set[int] = set()
    owners = [*holders, *([block] if block is not None else [])]
    for owner in owners:
        for source in (owner, _get(owner, "config")):
            for key in _NUM_EXPERTS_KEYS:
                value = _as_count(_get(source, key))
                if value is not None:
                    declared.add(value)
    if block is not None:
        count = _experts_count(block)
        if count is not None:
            declared.add(count)
    for _, config in _model_configs(model):
        for key in _NUM_EXPERTS_KEYS:
            value = _as_count(_get(config, key))
            if value is not None:
                declared.add(value)
    return declared


def _experts_count(block: nn.Module) -> int | None:
    """Experts in ``block.experts``: a container's length, a declared count, or the leading
    dim of fused [E, ...] expert weights (transformers v5 ``MixtralExperts``)."""
    experts = _get(block, "experts")
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return len(experts)
    if not isinstance(experts, nn.Module):
        return None
    found = _lookup([("experts", experts)], _NUM_EXPERTS_KEYS)
    if found is not None:
        return found[0]
    leading = {p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3}
    return leading.pop() if len(leading) == 1 else None


def _top_k(
    holders: Sequence[nn.Module], block: nn.Module | None, model: nn.Module, num_experts: int
) -> int | None:
    owners = [*holders, *([block] if block is not None else [])]
    sources = [("", owner) for owner in owners]
    found = _lookup(sources, _TOP_K_MODULE_KEYS, upper=num_experts)
    if found is None:
        configs = [("", _get(owner, "config")) for owner in owners] + _model_configs(model)
        found = _lookup(configs, _TOP_K_CONFIG_KEYS, upper=num_experts)
    return None if found is None else found[0]


# ---------------------------------------------------------------------------------- helpers


def _head_index(h: object, count: int, what: str) -> int:
    try:
        index = operator.index(h)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {h!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"{what} {index} is out of range [0, {count})")
    return index


def _join(prefix: str, child: str) -> str:
    return f"{prefix}.{child}" if prefix else child


def _describe(name: str, module: nn.Module) -> str:
    return f"{name or '<root>'} ({type(module).__name__})"


def _override_hint(name: str, what: str) -> str:
    return (
        f"Pass {what} as an override: DiscoveryOverrides(attention={{{name!r}: "
        f"AttentionOverride({what.split('/')[0]}=...)}}) (keys may be fnmatch patterns)"
    )


def _get(obj: object, key: str) -> object:
    if obj is None:
        return None
    if isinstance(obj, Mapping):
        return obj.get(key)
    try:
        return getattr(obj, key, None)
    except Exception:  # a property that raises is as good as absent
        return None


def _as_count(value: object) -> int | None:
    if value is None or isinstance(value, bool):
        return None
    if isinstance(value, torch.Tensor):  # a registered buffer is not a declared count
        return None
    try:
        count = operator.index(value)
    except TypeError:
        return None
    return count if count > 0 else None


def _lookup(
    sources: Sequence[tuple[str, object]], keys: Sequence[str], upper: int | None = None
) -> tuple[int, str] | None:
    """First positive int among ``keys`` over ``sources`` (in order); ``upper`` bounds it."""
    for label, source in sources:
        for key in keys:
            value = _as_count(_get(source, key))
            if value is not None and (upper is None or value <= upper):
                return value, f"{label}.{key}"
    return None


def _lookup_flag(sources: Sequence[tuple[str, object]], key: str) -> bool:
    for _, source in sources:
        value = _get(source, key)
        if isinstance(value, bool):
            return value
    return False


def _model_configs(model: nn.Module) -> list[tuple[str, object]]:
    config = _get(model, "config")
    if config is None:
        return []
    configs: list[tuple[str, object]] = [("the model's config", config)]
    get_text_config = _get(config, "get_text_config")
    if callable(get_text_config):
        try:
            text_config = get_text_config()
        except Exception:
            text_config = None
        if text_config is not None and text_config is not config:
            configs.append(("the model's text config", text_config))
    return configs


def _sources(
    module: nn.Module, model: nn.Module, override: AttentionOverride | None
) -> list[tuple[str, object]]:
    """Where head counts are read from, in priority order."""
    sources: list[tuple[str, object]] = []
    if override is not None:
        sources.append(("the override", override.model_dump()))
    sources.append(("the module", module))
    module_config = _get(module, "config")
    if module_config is not None:
        sources.append(("the module's config", module_config))
    sources.extend(c for c in _model_configs(model) if c[1] is not module_config)
    return sources


def _declared_kv_heads(sources: Sequence[tuple[str, object]], num_heads: int) -> int | None:
    for _, source in sources:
        found = _lookup([("", source)], _NUM_KV_HEADS_KEYS)
        if found is not None:
            return found[0]
        groups = _lookup([("", source)], _KV_GROUPS_KEYS)
        if groups is not None and num_heads % groups[0] == 0:
            return num_heads // groups[0]
        if _get(source, "multi_query") is True:
            return 1
    return None


def _is_pattern(key: str) -> bool:
    return any(c in key for c in "*?[")


def _excluded(name: str, patterns: Sequence[str]) -> bool:
    return any(fnmatchcase(name, pattern) for pattern in patterns)


def _override_for(name: str, table: Mapping[str, _T]) -> _T | None:
    if name in table:
        return table[name]
    for key, value in table.items():
        if _is_pattern(key) and fnmatchcase(name, key):
            return value
    return None


def _check_override_keys(
    kind: str, table: Mapping[str, object], modules: Mapping[str, nn.Module], exclude: list[str]
) -> None:
    for key in table:
        if _is_pattern(key):
            if not any(fnmatchcase(name, key) for name in modules):
                raise DiscoveryError(
                    f"discovery override {kind}[{key!r}]: the pattern matches no module"
                )
        elif key not in modules:
            close = difflib.get_close_matches(key, list(modules), n=3)
            hint = f"; did you mean {', '.join(map(repr, close))}?" if close else ""
            raise DiscoveryError(
                f"discovery override {kind}[{key!r}]: no module of that name in the model{hint}"
            )
        elif _excluded(key, exclude):
            raise DiscoveryError(
                f"discovery override {kind}[{key!r}]: the module is also matched by `exclude`"
            )
