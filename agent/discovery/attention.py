"""``find_attention``: every attention layer of a model as an :class:`AttentionSite`.

For each module: locate its Q/K projections (``projections``), read H from the override, the
module, its ``config`` or the model's ``config`` (``model_config``), solve H_kv, d_h and the
row of each head (``head_layout``), and fold any QK-norm scale (``qk_norm``).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping

from torch import nn

from agent.discovery.errors import DiscoveryError, describe, override_hint
from agent.discovery.head_layout import (
    fused_layout,
    gated_queries,
    head_starts,
    solve_fused,
    solve_separate,
)
from agent.discovery.latent import build_latent_site, is_latent_attention
from agent.discovery.model_config import (
    HEAD_DIM_KEYS,
    NUM_HEADS_KEYS,
    declared_kv_heads,
    head_count_sources,
    lookup,
)
from agent.discovery.overrides import AttentionOverride, DiscoveryOverrides, scan_model
from agent.discovery.projections import QK_PAIRS, Projection, QKLocation, locate_qk
from agent.discovery.qk_norm import FoldedNorm, find_qk_norm
from agent.discovery.sites import AttentionSite, HeadSlices
from agent.discovery.unread import LINEAR_ATTENTION, is_linear_attention, related, unread_kind


def find_attention(
    model: nn.Module, overrides: DiscoveryOverrides | None = None
) -> list[AttentionSite]:
    """Every attention layer of ``model`` with its Q/K projections and head layout, in
    ``named_modules()`` order.

    Raises :class:`DiscoveryError` when a layer's head counts cannot be determined or do not
    fit its weights, or when an override names a module that does not exist. Multi-head latent
    attention gives its content-part site (``latent``). Attention-like modules that cannot be
    read (linear attention, per-expert queries, custom projections, GPT-2 cross-attention,
    ``nn.MultiheadAttention`` with ``kdim != embed_dim``, ...) are named, with their kind, in
    one warning (``unread``).
    """
    overrides = overrides or DiscoveryOverrides()
    scan = scan_model("find_attention", model, "attention", overrides.attention, overrides.exclude)
    sites: list[AttentionSite] = []
    skipped: list[tuple[str, nn.Module, str]] = []  # (name, module, why)
    unread: list[tuple[str, nn.Module]] = []  # no Q/K projections found: attention-like?
    for name, module, override in scan.candidates():
        explicit = override is not None and (override.q or override.qkv) is not None
        if not explicit and is_linear_attention(module):
            skipped.append((name, module, LINEAR_ATTENTION))
            continue
        if not explicit and is_latent_attention(module):
            sites.append(build_latent_site(name, module, model, scan.param_names))
            continue
        location = locate_qk(name, module, override, scan.param_names)
        if location is None:
            if override is not None and name in overrides.attention:
                raise DiscoveryError(
                    f"{describe(name, module)}: an attention override names it but it has no "
                    "recognizable Q/K projections; set `q` and `k`, or `qkv`, in its override"
                )
            unread.append((name, module))
            continue
        if location.q is not None and location.k is not None and override is None:
            if location.q.in_features != location.k.in_features:
                location.unsupported = "queries and keys read inputs of different widths"
        if location.unsupported:
            skipped.append((name, module, location.unsupported))
            continue
        sites.append(_build_site(name, module, model, override, location, scan.param_names))
    read = [site.name for site in sites]
    for name, module in unread:
        kind = None if related(name, read) else unread_kind(module, QK_PAIRS)
        if kind is not None:
            skipped.append((name, module, kind))
    _warn_skipped(skipped)
    return sites


def _warn_skipped(skipped: list[tuple[str, nn.Module, str]]) -> None:
    """One warning naming every skipped module and its kind (a container of another skipped
    module, e.g. Jamba's Mamba decoder layer around its mixer, is not named twice)."""
    names = [name for name, _, _ in skipped]
    shown = [
        f"{describe(name, module)} ({why})"
        for name, module, why in skipped
        if not any(other.startswith(name + ".") for other in names if name)
    ]
    if shown:
        warnings.warn(
            "mechwatch discovery skipped attention modules it cannot read: "
            + "; ".join(shown)
            + ". Add them to `exclude` to silence this.",
            stacklevel=3,
        )


def _build_site(
    name: str,
    module: nn.Module,
    model: nn.Module,
    override: AttentionOverride | None,
    location: QKLocation,
    param_names: Mapping[int, str],
) -> AttentionSite:
    where = describe(name, module)
    sources = head_count_sources(module, model, override)
    heads = lookup(sources, NUM_HEADS_KEYS)
    if heads is None:
        raise DiscoveryError(
            f"{where}: cannot determine the number of query heads: none of "
            f"{', '.join(NUM_HEADS_KEYS)} is set on the module, its `config`, or the model's "
            f"`config`. {override_hint(name, 'num_heads')}"
        )
    num_heads = heads[0]
    kv_declared = declared_kv_heads(sources, num_heads)
    dh_found = lookup(sources, HEAD_DIM_KEYS)
    dh_declared = dh_found[0] if dh_found is not None else None

    if location.qkv is not None:
        qkv = location.qkv
        layout = fused_layout(name, module, model, override, location.qkv_child)
        num_kv_heads, head_dim = solve_fused(
            where, name, layout, num_heads, kv_declared, dh_declared, qkv.out_features
        )
        q_proj = k_proj = qkv
    else:
        assert location.q is not None and location.k is not None
        q_proj, k_proj = location.q, location.k
        gated = gated_queries(where, module, model, override, q_proj)
        layout = "gated" if gated else "separate"
        if q_proj.in_features != k_proj.in_features:
            raise DiscoveryError(
                f"{where}: query input width {q_proj.in_features} differs from key input width "
                f"{k_proj.in_features}; attention between inputs of different widths is not "
                "supported"
            )
        num_kv_heads, head_dim = solve_separate(
            where, name, num_heads, kv_declared, dh_declared, q_proj, k_proj, gated
        )
    q_starts, k_starts = head_starts(layout, num_heads, num_kv_heads, head_dim)

    fold = override is None or override.fold_qk_norm
    q_norm = find_qk_norm(
        where, name, module, override, "q", num_heads, head_dim, param_names, fold
    )
    k_norm = find_qk_norm(
        where, name, module, override, "k", num_kv_heads, head_dim, param_names, fold
    )
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


def _slices(
    projection: Projection,
    starts: tuple[int, ...],
    norm: FoldedNorm | None,
    live: dict[str, nn.Parameter],
) -> HeadSlices:
    """The head slices of one projection; records the folded norm's scale in ``live``."""
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
