"""``find_routers``: every MoE router of a model as a :class:`RouterSite`.

A router is found by its name (``gate``/``router``/... or a ``layer``/``classifier``/... child
of one) and confirmed by an expert count declared around it (``model_config``); the routers
override marks any module holding an [E, d] weight as a router. When the router's parent
applies the weight functionally (``F.linear(x, self.classifier.weight)``), the parent is the
router's ``owner``: its input is the router's input (``RouterSite.owner``).
"""

from __future__ import annotations

import inspect
import re
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from agent.discovery.errors import DiscoveryError, describe
from agent.discovery.model_config import declared_num_experts, declared_top_k
from agent.discovery.overrides import DiscoveryOverrides, RouterOverride, scan_model
from agent.discovery.sites import RouterSite

# A router is named like this (the local module name) ...
_ROUTER_NAMES = frozenset({"gate", "router", "gating", "moe_gate", "router_gate"})
# ... or is a child named like this of a module named like a router (``router.layer`` in
# DBRX / Granite-MoE / JetMoE, ``router.classifier`` in Switch, ``gate.wg`` in DeepSpeed).
_ROUTER_CHILD_NAMES = frozenset({"layer", "classifier", "wg", "linear", "proj"})


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
    overrides = overrides or DiscoveryOverrides()
    scan = scan_model("find_routers", model, "routers", overrides.routers, overrides.exclude)
    modules, param_names = scan.modules, scan.param_names
    sites: list[RouterSite] = []
    mismatched: list[str] = []
    for name, module, override in scan.candidates():
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
        declared = declared_num_experts(holders, block, model)
        if not declared:
            continue
        if num_experts not in declared:
            mismatched.append(
                f"{describe(name, module)}: weight has {num_experts} rows, declared "
                f"{sorted(declared)}"
            )
            continue
        owner_name = functional_owner(name, modules)
        sites.append(
            RouterSite(
                name=name,
                module=module,
                num_experts=num_experts,
                d_model=weight.shape[1],
                top_k=declared_top_k(holders, block, model, num_experts),
                weight_name=param_names[id(weight)],
                owner=None if owner_name is None else modules[owner_name],
                owner_name=owner_name,
                **_block_of(block, modules),
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
    where = describe(name, module)
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
        top_k = declared_top_k(holders or [module], block, model, num_experts)
    elif top_k > num_experts:
        raise DiscoveryError(f"{where}: top_k = {top_k} exceeds num_experts = {num_experts}")
    owner_name = functional_owner(name, modules)
    return RouterSite(
        name,
        module,
        num_experts,
        weight.shape[1],
        top_k,
        param_names[id(weight)],
        owner=None if owner_name is None else modules[owner_name],
        owner_name=owner_name,
        **_block_of(_router_context(name, modules)[1], modules),
    )


def _block_of(block: nn.Module | None, modules: Mapping[str, nn.Module]) -> dict[str, Any]:
    """``RouterSite``'s ``block`` and ``block_name`` for the MoE block ``block`` (or none)."""
    if block is None:
        return {}
    name = next((n for n, m in modules.items() if m is block), None)
    return {"block": block, "block_name": name}


def functional_owner(name: str, modules: Mapping[str, nn.Module]) -> str | None:
    """The parent of router ``name`` when the parent's forward applies ``<child>.weight``
    itself (``F.linear(x, self.classifier.weight)``), else None."""
    parent, _, local = name.rpartition(".")
    if not local or parent not in modules:
        return None
    forward = getattr(type(modules[parent]), "forward", None)
    try:
        source = inspect.getsource(forward) if forward is not None else ""
    except (OSError, TypeError):
        return None
    return parent if re.search(rf"\bself\.{re.escape(local)}\.weight\b", source) else None


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
