"""Control weights: what a healthy change moves and a biased attention backward does not.

A biased low-precision attention backward enters through dS, so only dW_q and dW_k carry it
(DESIGN.md 1c). A data shift, a learning-rate change or a phase transition moves every weight.
So each attention layer gets a few *control* matrices, measured the same way as Q/K (their
update over the same ``qk.delta`` steps): the attention module's other 2-D weights (values,
output projection) first, then the 2-D weights of the enclosing block outside the attention
module (the MLP, or the first experts of an MoE), in module order, without the routers (they
have monitors of their own) and without any weight that holds Q or K rows (a fused QKV weight).

The enclosing block is the attention module's parent (``model.layers.3`` for
``model.layers.3.self_attn``); a model without one (attention at the top level) has only the
attention module's own controls.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from agent.discovery.sites import AttentionSite, RouterSite


def find_controls(
    model: nn.Module,
    site: AttentionSite,
    routers: Sequence[RouterSite] = (),
    limit: int = 4,
) -> dict[str, nn.Parameter]:
    """Up to ``limit`` control matrices of ``site``, keyed by qualified parameter name."""
    if limit <= 0:
        return {}
    excluded = set(site.parameters_to_snapshot()) | {r.weight_name for r in routers}
    excluded_ids = {id(p) for p in site.parameters_to_snapshot().values()}
    excluded_ids |= {id(r.weight()) for r in routers}
    names = dict(model.named_modules())
    block_name = site.name.rpartition(".")[0]
    block = names.get(block_name) if block_name else None
    scopes = [(site.name, site.module)]
    if block is not None:
        scopes.append((block_name, block))
    out: dict[str, nn.Parameter] = {}
    for prefix, module in scopes:
        for local, param in module.named_parameters():
            name = f"{prefix}.{local}"
            if len(out) >= limit:
                return out
            if param.dim() != 2 or name in out or name in excluded or id(param) in excluded_ids:
                continue
            out[name] = param
    return out


def control_label(site: AttentionSite, parameter_name: str) -> str:
    """The ``param`` label of a control: its name relative to the enclosing block."""
    block = site.name.rpartition(".")[0]
    return parameter_name[len(block) + 1 :] if block else parameter_name
