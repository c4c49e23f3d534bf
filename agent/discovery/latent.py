"""Multi-head latent attention (MLA: DeepSeek-V2/V3, GLM-4-MoE-Lite, Kimi, LongcatFlash, ...).

MLA reads queries and keys through low-rank latents (DESIGN.md 1d). Hugging Face names are
used below; torchtitan (``wq_a``/``q_norm``/``wq_b`` or ``wq``, ``wkv_a``/``kv_norm``/``wkv_b``)
and Megatron-Core (``linear_q_down_proj``/``q_layernorm``/``linear_q_up_proj`` or
``linear_q_proj``, ``linear_kv_down_proj``/``kv_layernorm``/``linear_kv_up_proj``, with
``qk_head_dim`` and ``qk_pos_emb_head_dim`` for n and r) are read the same way:

- queries: x -> ``q_a_proj`` [r_q, d] -> RMSNorm(g_q) -> ``q_b_proj`` [H (n + r), r_q]
  (or one ``q_proj`` [H (n + r), d]); per head the first n = ``qk_nope_head_dim`` rows are the
  content part, the last r = ``qk_rope_head_dim`` rows the RoPE part;
- keys: x -> ``kv_a_proj_with_mqa`` [r_kv + r, d]: rows [0, r_kv) are the latent, the last r
  rows the RoPE key (one, shared by all heads); latent -> RMSNorm(g_kv) -> ``kv_b_proj``
  [H (n + v), r_kv], per head n key rows then v = ``v_head_dim`` value rows.

The content (NoPE) part of head h is the bilinear form of
W_q,eff,h = W_qa^T diag(g_q) W_qb,h[nope]^T and W_k,eff,h = W_kva[:r_kv]^T diag(g_kv)
W_kvb,h[k_nope]^T, both (d, n): the site built here returns those as its factors (H query heads,
H key heads, d_h = n), so every QK monitor works unchanged. The norms' per-token 1 / rms is a
scalar per token, outside the bilinear form; LongcatFlash's constant latent scales
(``mla_scale_q_lora``, ``mla_scale_kv_lora``) are folded in. The decoupled RoPE part is not in
these factors: its key is shared by all heads and rotates with position (docs/architectures.md
says what that means for the monitors).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from agent.discovery.errors import DiscoveryError, describe, join
from agent.discovery.model_config import NUM_HEADS_KEYS, head_count_sources, lookup
from agent.discovery.qk_norm import norm_scale_offset
from agent.discovery.sites import AttentionSite, HeadSlices, LatentInput


@dataclass(frozen=True)
class _Names:
    """What one framework calls MLA's parts."""

    kv_down: str  # [r_kv + r, d]
    kv_up: str  # [H (n + v), r_kv]
    kv_norm: str
    q_down: str  # [r_q, d]
    q_up: str  # [H (n + r), r_q]
    q_norm: str
    q_full: str  # [H (n + r), d], without a query latent
    nope: str  # config key of n
    rope: str  # config key of r


_LAYOUTS = (
    _Names(  # Hugging Face transformers
        "kv_a_proj_with_mqa",
        "kv_b_proj",
        "kv_a_layernorm",
        "q_a_proj",
        "q_b_proj",
        "q_a_layernorm",
        "q_proj",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
    ),
    _Names(  # torchtitan
        "wkv_a",
        "wkv_b",
        "kv_norm",
        "wq_a",
        "wq_b",
        "q_norm",
        "wq",
        "qk_nope_head_dim",
        "qk_rope_head_dim",
    ),
    _Names(  # Megatron-Core MLASelfAttention
        "linear_kv_down_proj",
        "linear_kv_up_proj",
        "kv_layernorm",
        "linear_q_down_proj",
        "linear_q_up_proj",
        "q_layernorm",
        "linear_q_proj",
        "qk_head_dim",
        "qk_pos_emb_head_dim",
    ),
)


def _layout(module: nn.Module) -> _Names | None:
    children = module._modules
    for names in _LAYOUTS:
        if children.get(names.kv_down) is not None and children.get(names.kv_up) is not None:
            return names
    return None


def is_latent_attention(module: nn.Module) -> bool:
    """Whether ``module`` has MLA's key path (a KV down and up projection, by any of the
    Hugging Face, torchtitan or Megatron-Core names)."""
    return _layout(module) is not None


def build_latent_site(
    name: str, module: nn.Module, model: nn.Module, param_names: Mapping[int, str]
) -> AttentionSite:
    """The content-part site of MLA module ``module`` (module docstring)."""
    where = describe(name, module)
    names = _layout(module)
    assert names is not None, where
    sources = head_count_sources(module, model, None)
    found = lookup(sources, NUM_HEADS_KEYS)
    keys = (names.nope, names.rope, "v_head_dim", "kv_lora_rank")
    dims = {key: lookup(sources, (key,)) for key in keys}
    missing = [key for key, value in dims.items() if value is None]
    if found is None or missing:
        raise DiscoveryError(
            f"{where}: multi-head latent attention needs num_heads and {', '.join(keys)} on "
            f"the module or its config; missing: {', '.join(missing or ['num_heads'])}. Add "
            "them, or `exclude` the module"
        )
    heads = found[0]
    nope, rope, v_dim, rank = (dims[key][0] for key in keys)  # type: ignore[index]
    live: dict[str, nn.Parameter] = {}
    kv_down = _weight(where, name, module, names.kv_down, (rank + rope, None), param_names, live)
    d_model = kv_down.shape[1]
    kv_up_shape = (heads * (nope + v_dim), rank)
    kv_up = _weight(where, name, module, names.kv_up, kv_up_shape, param_names, live)
    q_rows = heads * (nope + rope)
    if module._modules.get(names.q_down) is not None:
        q_rank = module._modules[names.q_down].weight.shape[0]
        q_down = _weight(where, name, module, names.q_down, (q_rank, d_model), param_names, live)
        q_up = _weight(where, name, module, names.q_up, (q_rows, q_rank), param_names, live)
        q_norm = (names.q_norm, names.q_up)
        q_latent = _latent(where, name, module, q_down, q_rank, q_norm, param_names, live)
    else:
        q_up = _weight(where, name, module, names.q_full, (q_rows, d_model), param_names, live)
        q_latent = None
    kv_norm = (names.kv_norm, names.kv_up)
    k_latent = _latent(where, name, module, kv_down, rank, kv_norm, param_names, live)
    q_scale = _scalar(module, "mla_scale_q_lora") if q_latent is not None else 1.0
    q = _heads(q_up, nope + rope, heads, q_latent, q_scale, param_names)
    k_scale = _scalar(module, "mla_scale_kv_lora")
    k = _heads(kv_up, nope + v_dim, heads, k_latent, k_scale, param_names)
    return AttentionSite(
        name=name,
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope,
        d_model=d_model,
        layout="latent",
        q=q,
        k=k,
        module=module,
        live_parameters=live,
    )


def _heads(
    weight: torch.Tensor,
    stride: int,
    heads: int,
    latent: LatentInput | None,
    scale: float,
    param_names: Mapping[int, str],
) -> HeadSlices:
    """Head h's content rows start at h * ``stride`` of the up projection ``weight``."""
    return HeadSlices(
        weight_name=param_names[id(weight)],
        weight_shape=tuple(weight.shape),
        input_major=False,
        starts=tuple(h * stride for h in range(heads)),
        latent=latent,
        scale=scale,
    )


def _weight(
    where: str,
    name: str,
    module: nn.Module,
    child: str,
    shape: tuple[int, int | None],
    param_names: Mapping[int, str],
    live: dict[str, nn.Parameter],
) -> torch.Tensor:
    """The 2-D ``weight`` of ``module.<child>``, checked against ``shape`` (None: any)."""
    sub = module._modules.get(child)
    weight = getattr(sub, "weight", None)
    if not isinstance(weight, torch.Tensor) or id(weight) not in param_names or weight.dim() != 2:
        raise DiscoveryError(f"{where}: {join(name, child)} has no 2-D `weight` parameter")
    rows, cols = shape
    if weight.shape[0] != rows or (cols is not None and weight.shape[1] != cols):
        want = f"[{rows}, {'d' if cols is None else cols}]"
        raise DiscoveryError(
            f"{where}: {join(name, child)} has weight {list(weight.shape)}, expected {want} from "
            "num_heads, qk_nope_head_dim, qk_rope_head_dim, v_head_dim and the LoRA ranks"
        )
    live[param_names[id(weight)]] = weight
    return weight


def _latent(
    where: str,
    name: str,
    module: nn.Module,
    weight: torch.Tensor,
    rank: int,
    children: tuple[str, str],
    param_names: Mapping[int, str],
    live: dict[str, nn.Parameter],
) -> LatentInput:
    """The first stage W_a (rows [0, rank)) and its RMSNorm (``children``: the norm and the up
    projection that reads the latent), whose scale is recorded in ``live``."""
    norm_child, up_child = children
    norm = module._modules.get(norm_child)
    scale = getattr(norm, "weight", None)
    fused = getattr(module._modules.get(up_child), "layer_norm_weight", None)
    if norm is None and isinstance(fused, torch.Tensor):
        raise DiscoveryError(
            f"{where}: {join(name, up_child)} fuses the latent's layer norm "
            "(`layer_norm_weight`, Transformer Engine), which discovery cannot run to check; "
            "build the layer with a separate norm, or `exclude` it"
        )
    if norm is None or not isinstance(scale, torch.Tensor) or id(scale) not in param_names:
        norm_name, offset = None, 0.0
    else:
        path = join(name, norm_child)
        if scale.numel() != rank:
            raise DiscoveryError(f"{where}: {path} has {scale.numel()} scales, expected {rank}")
        offset = norm_scale_offset(where, path, norm, scale)
        _check_rms(where, path, norm, scale, offset)
        norm_name = param_names[id(scale)]
        live[norm_name] = scale
    return LatentInput(
        weight_name=param_names[id(weight)],
        weight_shape=tuple(weight.shape),
        rank=rank,
        norm_name=norm_name,
        norm_offset=offset,
    )


def _check_rms(where: str, path: str, norm: nn.Module, scale: torch.Tensor, offset: float) -> None:
    """The latent norm must be RMS-like (no centring, no bias): out = (g + offset) x / rms(x)."""
    probe = copy.deepcopy(norm).to(device="cpu", dtype=torch.float64)
    x = torch.randn(
        (3, scale.numel()), generator=torch.Generator().manual_seed(1), dtype=torch.float64
    )
    x = x + 1.0  # a mean that a LayerNorm would remove
    with torch.no_grad():
        got = probe(x)
    g = scale.detach().to(device="cpu", dtype=torch.float64) + offset
    rms = x.pow(2).mean(-1, keepdim=True).sqrt()
    if not torch.allclose(got, g * x / rms, rtol=1e-3, atol=1e-4):
        raise DiscoveryError(
            f"{where}: {path} is not an RMS norm (it centres or shifts its input), so its latent "
            "cannot be folded into bilinear factors; `exclude` the module"
        )


def _scalar(module: nn.Module, attr: str) -> float:
    value = getattr(module, attr, None)
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 1.0
