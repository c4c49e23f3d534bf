"""Hugging Face transformers adapter for the switchable fp32 attention backward.

``install_hf_attention(model)`` registers ``hf_attention_forward`` through transformers'
attention interface (``AttentionInterface.register``) and switches the model to it with
``model.set_attn_implementation`` (and registers transformers' SDPA mask builder under the same
name, since masks are dispatched on it too). The function follows
``transformers.integrations.sdpa_attention.sdpa_attention_forward`` (same signature, same GQA,
mask and ``is_causal`` handling, same (B, L, H, D) output), so with the switch off the model
computes exactly what the ``"sdpa"`` implementation computes; with the switch on for a layer,
that layer's backward runs in fp32. No model surgery: the attention modules stay as they are.

The layer name the switch sees is the attention module's name in the model
(``"model.layers.3.self_attn"``), recorded at install time; a module installed some other way
falls back to ``"layer{module.layer_idx}"``, then to ``None`` (only the global switch applies).

transformers is imported only inside ``install_hf_attention``; this module imports without it.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn.functional as F

from remediations.attention_switch import AttentionPrecisionSwitch, attention_precision
from remediations.fp32_attention import AttentionKernel, scaled_dot_product_attention

HF_ATTENTION_NAME = "mechwatch_fp32_backward"

# attention module -> its name in the model, filled by install_hf_attention (weak: a model that
# is deleted takes its entries with it).
_module_names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# The switch and the forward kernel used by hf_attention_forward (set by install_hf_attention).
_config: dict[str, Any] = {
    "switch": attention_precision,
    "fallback": F.scaled_dot_product_attention,
}


def layer_name(module: torch.nn.Module) -> str | None:
    """The switch's name for an attention module (see the module docstring)."""
    name = _module_names.get(module)
    if name is not None:
        return name
    idx = getattr(module, "layer_idx", None)
    return None if idx is None else f"layer{idx}"


def _repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H_kv * n_rep, S, D), KV head g serving query heads g*n_rep.."""
    if n_rep == 1:
        return hidden
    b, h_kv, s, d = hidden.shape
    return hidden[:, :, None, :, :].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (B, H, L, D), key/value (B, H_kv, S, D), mask
    broadcastable to (B, H, L, S) -> ((B, L, H, D) contiguous, None)."""
    gqa = False
    n_rep = getattr(module, "num_key_value_groups", None)
    if n_rep is not None:
        if attention_mask is None:  # as transformers: native GQA only without a mask
            gqa = key.shape[1] != query.shape[1]
        else:
            key = _repeat_kv(key, int(n_rep))
            value = _repeat_kv(value, int(n_rep))
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Causal only when there is more than one query and no explicit mask (as transformers).
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    out = scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=gqa,
        layer=layer_name(module),
        fallback=_config["fallback"],
        switch=_config["switch"],
    )  # (B, H, L, D)
    return out.transpose(1, 2).contiguous(), None


def register_module_names(model: torch.nn.Module) -> int:
    """Record the name of every module of ``model`` for ``layer_name``; returns how many."""
    count = 0
    for name, module in model.named_modules():
        if name:
            _module_names[module] = name
            count += 1
    return count


def install_hf_attention(
    model: torch.nn.Module,
    *,
    switch: AttentionPrecisionSwitch = attention_precision,
    fallback: AttentionKernel = F.scaled_dot_product_attention,
    name: str = HF_ATTENTION_NAME,
) -> str | None:
    """Route ``model``'s attention through ``hf_attention_forward``. Returns the attention
    implementation it replaced (pass it to ``model.set_attn_implementation`` to undo)."""
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "install_hf_attention needs Hugging Face transformers (with AttentionInterface, "
            "4.48 or later); it is not importable here"
        ) from exc
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"install_hf_attention: {type(model).__name__} has no .config; "
            "expected a transformers PreTrainedModel"
        )
    previous = getattr(config, "_attn_implementation", None)
    register_module_names(model)
    _config["switch"], _config["fallback"] = switch, fallback
    AttentionInterface.register(name, hf_attention_forward)
    try:  # masks dispatch on the same name; an unregistered one would get no causal mask
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers: masks do not go through a registry
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # older transformers: the config attribute is what the attention layers read
        config._attn_implementation = name
    return previous
