"""A call of transformers' SDPA attention function, restated as a call of the eager function.

The FP32 backward of an SDPA layer recomputes the model's eager attention function
(``remediations.fp32_recompute``). The two agree on the math but not on how they receive it:

- SDPA takes a boolean mask (True = attend), an additive float mask, or no mask with
  ``is_causal``; eager adds a float mask to the scores and is causal only through its mask.
  A boolean mask becomes 0 / finfo.min, a missing causal mask is built (top-left aligned, as
  torch's ``is_causal``; with more keys than queries SDPA keeps only the first L keys, and so
  does this translation), and -inf becomes finfo.min (no NaN in fully masked rows). The fill
  value is fp32's finfo.min whatever the dtype: eager functions softmax in fp32, and an fp64
  finfo.min would become -inf there.
- SDPA outputs zeros for a query row whose keys are all masked; eager would average over them.
  Those rows are returned as ``dead`` (True where the output row is zero, broadcastable to the
  (B, L, H, D) output), and their output gradients are dropped, as SDPA's backward does.
- ``scaling=None`` means 1 / sqrt(D) for SDPA; eager gets the number.
- ``position_bias``: SDPA folds it into its mask; eager adds it itself (T5 and the like).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch

# transformers.integrations.sdpa_attention.sdpa_attention_forward's parameters after ``module``.
_SDPA_PARAMS = (
    "query",
    "key",
    "value",
    "attention_mask",
    "dropout",
    "scaling",
    "is_causal",
    "position_bias",
)

Translated = tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None]


def sdpa_call_as_eager(
    module: torch.nn.Module,
) -> Callable[[tuple[Any, ...], dict[str, Any]], Translated]:
    """The translation of one SDPA call of ``module`` into the eager call (module docstring)."""

    def translate(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Translated:
        if len(args) > len(_SDPA_PARAMS):
            raise ValueError(f"unexpected positional arguments to sdpa: {len(args)}")
        call = dict(zip(_SDPA_PARAMS, args, strict=False))
        call.update(kwargs)
        query, key, value = call.pop("query"), call.pop("key"), call.pop("value")
        mask = call.pop("attention_mask", None)
        bias = call.pop("position_bias", None)
        scaling = call.pop("scaling", None)
        is_causal = call.pop("is_causal", None)
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True)
        q_len, kv_len = query.shape[2], key.shape[2]
        causal = bool(q_len > 1 and mask is None and is_causal)
        low = torch.finfo(torch.float32).min  # eager may softmax in fp32: no -inf after a cast
        dead = None
        if causal:
            if kv_len > q_len:  # as SDPA: the keys past the queries are dropped
                key, value = key[:, :, :q_len], value[:, :, :q_len]
                bias = None if bias is None else bias[..., :q_len]
            mask = causal_mask(q_len, query.dtype, query.device)
        elif mask is not None:
            if mask.dtype == torch.bool:
                dead = ~mask.any(-1, keepdim=True)  # (B|1, H|1, L, 1)
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=mask.device).masked_fill(
                    ~mask, low
                )
            else:
                dead = (mask == -math.inf).all(-1, keepdim=True)
                mask = mask.clamp_min(low)
            dead = dead.transpose(1, 2) if dead.dim() == 4 else None  # (B|1, L, H|1, 1)
        call["scaling"] = query.shape[-1] ** -0.5 if scaling is None else scaling
        if bias is not None:
            call["position_bias"] = bias
        return (query, key, value, mask), call, dead

    return translate


def causal_mask(length: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Additive causal mask (1, 1, L, L): 0 where key j <= query i, fp32's finfo.min elsewhere."""
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril_()
    mask = torch.zeros(length, length, dtype=dtype, device=device)
    return mask.masked_fill_(~allowed, torch.finfo(torch.float32).min)[None, None]
