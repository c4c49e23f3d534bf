"""Find attention Q/K projections (with their head layout) and MoE routers in a model.

The spectral monitors need, for every attention layer and query head h, the factor pair
W_q^h, W_k^g(h) in R^{d x d_h} (DESIGN.md 1a); the router monitors need every module that
turns a token into routing logits through an [E, d] weight (DESIGN.md 1b). This package reads
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

The names below are the public API; the modules are:

- ``overrides``: the override models and how their keys are matched to modules;
- ``sites``: :class:`AttentionSite`, :class:`HeadSlices`, :class:`RouterSite` (what monitors
  consume);
- ``model_config``: counts read from module attributes and configs;
- ``projections``, ``head_layout``, ``qk_norm``, ``attention``: :func:`find_attention`;
- ``routers``: :func:`find_routers`;
- ``errors``: :class:`DiscoveryError` and how messages name modules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.lazy_exports import lazy_exports

# Lazy (PEP 562): a process that only needs the sites (the monitor worker, ``agent.probes``)
# does not import the override models and their pydantic (~0.2 s of CPU at its start).
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "AttentionOverride": ".overrides",
        "AttentionSite": ".sites",
        "DiscoveryError": ".errors",
        "DiscoveryOverrides": ".overrides",
        "HeadSlices": ".sites",
        "RouterOverride": ".overrides",
        "RouterSite": ".sites",
        "extract_router_logits": "agent.router_output",
        "find_attention": ".attention",
        "find_routers": ".routers",
    },
)

if TYPE_CHECKING:
    from agent.discovery.attention import find_attention as find_attention
    from agent.discovery.errors import DiscoveryError as DiscoveryError
    from agent.discovery.overrides import AttentionOverride as AttentionOverride
    from agent.discovery.overrides import DiscoveryOverrides as DiscoveryOverrides
    from agent.discovery.overrides import RouterOverride as RouterOverride
    from agent.discovery.routers import find_routers as find_routers
    from agent.discovery.sites import AttentionSite as AttentionSite
    from agent.discovery.sites import HeadSlices as HeadSlices
    from agent.discovery.sites import RouterSite as RouterSite
    from agent.router_output import extract_router_logits as extract_router_logits
