"""Counts a model declares about itself: heads, KV heads, head dim, experts, top-k.

Counts are read from module attributes, a module's ``config``, and the model's ``config`` (and
its text config for multimodal models), trying the key names below in order on each source.
A count is a positive int: booleans, tensors (registered buffers) and properties that raise
count as absent. Nothing here raises; the callers decide what a missing count means.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence

import torch
from torch import nn

from agent.discovery.overrides import AttentionOverride

# Attribute / config names, tried in this order on each source.
NUM_HEADS_KEYS = ("num_heads", "num_attention_heads", "n_head", "n_heads", "nh", "heads")
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
HEAD_DIM_KEYS = (
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
    "num_moe_experts",  # Megatron-Core
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

Sources = Sequence[tuple[str, object]]  # (label for messages, object or mapping to read)


def read_field(obj: object, key: str) -> object:
    """``obj[key]`` for a mapping, else ``obj.key``; None when absent (or when it raises)."""
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


def lookup(
    sources: Sources, keys: Sequence[str], upper: int | None = None
) -> tuple[int, str] | None:
    """First positive int among ``keys`` over ``sources`` (in order); ``upper`` bounds it."""
    for label, source in sources:
        for key in keys:
            value = _as_count(read_field(source, key))
            if value is not None and (upper is None or value <= upper):
                return value, f"{label}.{key}"
    return None


def lookup_flag(sources: Sources, key: str) -> bool:
    """The first boolean ``key`` over ``sources``; False when none declares it."""
    for _, source in sources:
        value = read_field(source, key)
        if isinstance(value, bool):
            return value
    return False


def _model_configs(model: nn.Module) -> list[tuple[str, object]]:
    config = read_field(model, "config")
    if config is None:
        return []
    configs: list[tuple[str, object]] = [("the model's config", config)]
    get_text_config = read_field(config, "get_text_config")
    if callable(get_text_config):
        try:
            text_config = get_text_config()
        except Exception:
            text_config = None
        if text_config is not None and text_config is not config:
            configs.append(("the model's text config", text_config))
    return configs


def head_count_sources(
    module: nn.Module, model: nn.Module, override: AttentionOverride | None
) -> list[tuple[str, object]]:
    """Where head counts are read from, in priority order."""
    found: list[tuple[str, object]] = []
    if override is not None:
        found.append(("the override", override.model_dump()))
    found.append(("the module", module))
    module_config = read_field(module, "config")
    if module_config is not None:
        found.append(("the module's config", module_config))
    found.extend(c for c in _model_configs(model) if c[1] is not module_config)
    return found


def declared_kv_heads(sources: Sources, num_heads: int) -> int | None:
    """H_kv from the first source that declares it (directly, as H / H_kv groups, or as
    ``multi_query``)."""
    for _, source in sources:
        found = lookup([("", source)], _NUM_KV_HEADS_KEYS)
        if found is not None:
            return found[0]
        groups = lookup([("", source)], _KV_GROUPS_KEYS)
        if groups is not None and num_heads % groups[0] == 0:
            return num_heads // groups[0]
        if read_field(source, "multi_query") is True:
            return 1
    return None


def declared_num_experts(
    holders: Sequence[nn.Module], block: nn.Module | None, model: nn.Module
) -> set[int]:
    """Every expert count declared on the router ``holders``, their MoE ``block`` (including
    the size of ``block.experts``), their configs and the model's configs."""
    declared: set[int] = set()
    owners = [*holders, *([block] if block is not None else [])]
    for owner in owners:
        for source in (owner, read_field(owner, "config")):
            for key in _NUM_EXPERTS_KEYS:
                value = _as_count(read_field(source, key))
                if value is not None:
                    declared.add(value)
    if block is not None:
        count = _experts_count(block)
        if count is not None:
            declared.add(count)
    for _, config in _model_configs(model):
        for key in _NUM_EXPERTS_KEYS:
            value = _as_count(read_field(config, key))
            if value is not None:
                declared.add(value)
    return declared


def _experts_count(block: nn.Module) -> int | None:
    """Experts in ``block.experts``: a container's length, a declared count, or the leading
    dim of fused [E, ...] expert weights (transformers v5 ``MixtralExperts``)."""
    experts = read_field(block, "experts")
    if isinstance(experts, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return len(experts)
    if not isinstance(experts, nn.Module):
        return None
    found = lookup([("experts", experts)], _NUM_EXPERTS_KEYS)
    if found is not None:
        return found[0]
    leading = {p.shape[0] for p in experts.parameters(recurse=False) if p.dim() == 3}
    return leading.pop() if len(leading) == 1 else None


def declared_top_k(
    holders: Sequence[nn.Module], block: nn.Module | None, model: nn.Module, num_experts: int
) -> int | None:
    """Experts chosen per token, declared on the router modules first, then on the configs;
    a value above ``num_experts`` is not a top-k."""
    owners = [*holders, *([block] if block is not None else [])]
    module_sources = [("", owner) for owner in owners]
    found = lookup(module_sources, _TOP_K_MODULE_KEYS, upper=num_experts)
    if found is None:
        configs = [("", read_field(owner, "config")) for owner in owners] + _model_configs(model)
        found = lookup(configs, _TOP_K_CONFIG_KEYS, upper=num_experts)
    return None if found is None else found[0]
