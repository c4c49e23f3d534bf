"""FP32 attention backward: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

The fix for the ``fa_precision`` fault family (DESIGN.md 1a, 1d). A low-precision attention
kernel can round ``O = P V`` and the backward's ``delta = rowsum(dO * O)`` with a *bias*; the
biased term lands in dW_q / dW_k every step. ``fp32_backward_attention`` keeps the forward as it
was (the usual kernel, in the input dtype) and replaces only the backward: it recomputes the
scores, the probabilities, ``O`` and ``delta`` in fp32 from the saved q, k, v and returns
gradients in the input dtypes. That removes the biased term without touching the forward.

``scaled_dot_product_attention`` takes the same arguments as torch's, plus ``layer`` (a name for
the per-layer switch), ``fallback`` (the kernel used when the switch is off, and for the
forward when it is on) and ``switch`` (default: the process-wide ``attention_precision`` of
``remediations.attention_switch``, which the ``attention_fp32_backward`` action flips).

Dropout: torch's kernels do not expose their dropout mask, so with ``dropout_p > 0`` under
autograd the forward also runs here, in the fp32 math path, with a mask drawn from a seed taken
from torch's default CPU generator; the backward regenerates the same mask from the seed. That
costs O(B * H * L * S) memory like torch's math backend; models without attention dropout (most
LLM pre-training) keep their fast forward kernel.

torch.compile: the switch is a Python-level branch (``switch.fp32_backward(layer)`` reads a
bool and a dict). Dynamo guards on that state, so a compiled model recompiles at most once per
flip of the switch, never per step.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from remediations.attention_switch import AttentionPrecisionSwitch, attention_precision
from remediations.kernel_audit import batch_rows

AttentionKernel = Callable[..., torch.Tensor]


def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layer: str | None = None,
    fallback: AttentionKernel = F.scaled_dot_product_attention,
    switch: AttentionPrecisionSwitch = attention_precision,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with a switchable fp32 backward.

    When ``switch.fp32_backward(layer)`` is on and autograd will differentiate the call, the
    forward runs ``fallback`` as usual and the backward is recomputed in fp32
    (``fp32_backward_attention``). Otherwise ``fallback`` runs alone. ``fallback`` is called as
    ``fallback(q, k, v, is_causal=..., scale=...)`` plus ``attn_mask``, ``dropout_p`` and
    ``enable_gqa`` when they differ from their defaults, so a kernel without mask or GQA
    support works for calls that do not use them.
    """
    options = _Options(dropout_p, is_causal, scale, enable_gqa)
    out = _attend(switch, layer, fallback, options, query, key, value, attn_mask)
    if switch.audit.armed(layer) and layer is not None:  # the kernel audit's capture
        batch = query.shape[0]

        def replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
            mask = batch_rows(attn_mask, rows, batch)
            return _attend(switch, layer, fallback, options, q, k, v, mask)

        switch.audit.capture(layer, query, key, value, out, replay)
    return out


def _attend(
    switch: AttentionPrecisionSwitch,
    layer: str | None,
    fallback: AttentionKernel,
    options: _Options,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
) -> torch.Tensor:
    """The call as the switch wants it: the fp32 backward, or ``fallback`` alone."""
    if switch.fp32_backward(layer) and _needs_grad(query, key, value):
        return fp32_backward_attention(
            query, key, value, attn_mask, *options, forward_kernel=fallback
        )
    return options.call(fallback, query, key, value, attn_mask)


def fp32_backward_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    forward_kernel: AttentionKernel | None = None,
) -> torch.Tensor:
    """Attention whose forward is ``forward_kernel`` (default torch's SDPA) in the input dtype and
    whose backward recomputes attention in fp32 from the saved q, k, v.

    Shapes follow torch: query (..., H, L, E), key (..., H_kv, S, E), value (..., H_kv, S, Ev),
    attn_mask broadcastable to (..., H, L, S) (bool: True = attend; float: added to the scores),
    H_kv == H unless ``enable_gqa`` (H % H_kv == 0, query head h uses KV head h // (H / H_kv)).
    ``is_causal`` is top-left aligned (query i attends to keys j <= i), as in torch; like torch,
    a mask and ``is_causal`` together are an error. Returns (..., H, L, Ev) in the query dtype.
    The backward computes in fp32 (fp64 for fp64 inputs).
    """
    _check_shapes(query, key, value, attn_mask, _Options(dropout_p, is_causal, scale, enable_gqa))
    options = _Options(float(dropout_p), bool(is_causal), scale, enable_gqa)
    kernel = F.scaled_dot_product_attention if forward_kernel is None else forward_kernel
    return _FP32BackwardAttention.apply(query, key, value, attn_mask, options, kernel)


class _Options(NamedTuple):
    """torch's attention arguments other than the tensors."""

    dropout_p: float
    is_causal: bool
    scale: float | None
    enable_gqa: bool

    def call(
        self,
        kernel: AttentionKernel,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``kernel(q, k, v, is_causal=..., scale=...)`` plus the other options that differ
        from torch's defaults."""
        kwargs: dict[str, Any] = {"is_causal": self.is_causal, "scale": self.scale}
        if mask is not None:
            kwargs["attn_mask"] = mask
        if self.dropout_p:
            kwargs["dropout_p"] = self.dropout_p
        if self.enable_gqa:
            kwargs["enable_gqa"] = True
        return kernel(query, key, value, **kwargs)


class _FP32BackwardAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        options: _Options,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        seed = None
        if options.dropout_p > 0.0:
            # torch's kernels hide their dropout mask: draw our own, reproducibly from a seed.
            seed = int(torch.randint(0, 2**62, (1,)).item())  # CPU generator: no device sync
            out = _math_forward(query, key, value, attn_mask, options, seed).to(query.dtype)
        else:
            out = options.call(kernel, query, key, value, attn_mask)
        ctx.save_for_backward(query, key, value, attn_mask)
        ctx.options, ctx.seed = options, seed
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, attn_mask = ctx.saved_tensors
        options: _Options = ctx.options
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        f32 = _compute_dtype(query)
        q = query.to(f32)  # (..., H, L, E)
        k = _repeat_kv(key.to(f32), query, options.enable_gqa)  # (..., H, S, E)
        v = _repeat_kv(value.to(f32), query, options.enable_gqa)  # (..., H, S, Ev)
        scale = _scale(query, options.scale)
        p = _probs(q, k, attn_mask, options.is_causal, scale)  # (..., H, L, S), fp32
        if ctx.seed is not None:
            kept = _dropout_keep(p, options.dropout_p, ctx.seed) / (1.0 - options.dropout_p)
            p_used = p * kept  # (..., H, L, S): the probabilities after dropout
        else:
            kept, p_used = None, p
        do = grad_out.to(f32)  # (..., H, L, Ev)
        grad_v = p_used.transpose(-1, -2) @ do if need_v else None  # (..., H, S, Ev)
        grad_q = grad_k = None
        if need_q or need_k:
            out = p_used @ v  # (..., H, L, Ev): O recomputed in fp32
            delta = (do * out).sum(-1, keepdim=True)  # (..., H, L, 1) = rowsum(dO * O)
            ds = do @ v.transpose(-1, -2)  # (..., H, L, S): dP (after dropout)
            if kept is not None:
                ds.mul_(kept)
            ds.sub_(delta).mul_(p)  # dS = P * (dP - delta), in place
            if need_q:
                grad_q = (ds @ k).mul_(scale)  # (..., H, L, E)
            if need_k:
                grad_k = (ds.transpose(-1, -2) @ q).mul_(scale)  # (..., H, S, E)
        grad_k = _sum_kv_groups(grad_k, key, options.enable_gqa)
        grad_v = _sum_kv_groups(grad_v, value, options.enable_gqa)
        return (
            None if grad_q is None else grad_q.to(query.dtype),
            None if grad_k is None else grad_k.to(key.dtype),
            None if grad_v is None else grad_v.to(value.dtype),
            None,  # attn_mask
            None,  # options
            None,  # kernel
        )


# -- helpers ----------------------------------------------------------------------------------
def _needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )


def _check_shapes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    options: _Options,
) -> None:
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "query, key, value must have the same number (>= 2) of dimensions, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ValueError(
            "expected query (..., L, E), key (..., S, E), value (..., S, Ev), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(
            f"key and value batch dims differ: {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if options.enable_gqa:
        if query.dim() < 3 or query.shape[-3] % key.shape[-3] != 0:
            raise ValueError(
                f"enable_gqa: query heads ({query.shape[-3] if query.dim() >= 3 else '?'}) must be "
                f"a multiple of key/value heads ({key.shape[-3] if key.dim() >= 3 else '?'})"
            )
        if query.shape[:-3] != key.shape[:-3]:
            raise ValueError(
                f"query and key batch dims differ: {tuple(query.shape)}, {tuple(key.shape)}"
            )
    elif query.shape[:-2] != key.shape[:-2]:
        raise ValueError(
            f"query and key batch/head dims differ: {tuple(query.shape)}, {tuple(key.shape)} "
            "(pass enable_gqa=True for fewer key/value heads)"
        )
    if (
        attn_mask is not None
        and attn_mask.dtype != torch.bool
        and not attn_mask.is_floating_point()
    ):
        raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask is not None and options.is_causal:
        raise ValueError("attn_mask and is_causal are both set: pass one (as torch requires)")
    if not 0.0 <= options.dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {options.dropout_p}")


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (never less precise than the inputs)."""
    return torch.promote_types(query.dtype, torch.float32)


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _repeat_kv(kv: torch.Tensor, query: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
    """(..., H_kv, S, E) -> (..., H, S, E): KV head g serves query heads g*G .. g*G + G-1."""
    if not enable_gqa or kv.shape[-3] == query.shape[-3]:
        return kv
    return kv.repeat_interleave(query.shape[-3] // kv.shape[-3], dim=-3)


def _sum_kv_groups(
    grad: torch.Tensor | None, kv: torch.Tensor, enable_gqa: bool
) -> torch.Tensor | None:
    """(..., H, S, E) -> (..., H_kv, S, E): sum over the query heads that share a KV head."""
    if grad is None or not enable_gqa or grad.shape[-3] == kv.shape[-3]:
        return grad
    return grad.unflatten(-3, (kv.shape[-3], grad.shape[-3] // kv.shape[-3])).sum(-3)


def _probs(
    q: torch.Tensor, k: torch.Tensor, attn_mask: torch.Tensor | None, is_causal: bool, scale: float
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) in fp32, (..., H, L, S); fully masked rows are zero."""
    scores = (q @ k.transpose(-1, -2)).mul_(scale)  # (..., H, L, S)
    if attn_mask is not None:
        in_place = torch.broadcast_shapes(scores.shape, attn_mask.shape) == scores.shape
        if attn_mask.dtype == torch.bool:
            drop = attn_mask.logical_not()
            scores = (
                scores.masked_fill_(drop, -math.inf)
                if in_place
                else scores.masked_fill(drop, -math.inf)
            )
        else:
            mask = attn_mask.to(scores.dtype)
            scores = scores.add_(mask) if in_place else scores + mask
    if is_causal:
        L, S = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril_()  # (L, S)
        scores.masked_fill_(causal.logical_not_(), -math.inf)
    p = torch.softmax(scores, dim=-1)
    if attn_mask is not None:  # a row with every key masked attends to nothing (as torch)
        p.masked_fill_(scores.amax(dim=-1, keepdim=True) == -math.inf, 0.0)
    return p


def _dropout_keep(p: torch.Tensor, dropout_p: float, seed: int) -> torch.Tensor:
    """The dropout keep-mask (float 0/1, shape of ``p``), regenerated identically from ``seed``."""
    gen = torch.Generator(device=p.device)
    gen.manual_seed(seed)
    return (torch.rand(p.shape, generator=gen, device=p.device) >= dropout_p).to(p.dtype)


def _math_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    options: _Options,
    seed: int,
) -> torch.Tensor:
    """Attention with dropout in fp32 (used only when dropout_p > 0): (..., H, L, Ev)."""
    f32 = _compute_dtype(query)
    q = query.to(f32)
    k = _repeat_kv(key.to(f32), query, options.enable_gqa)
    v = _repeat_kv(value.to(f32), query, options.enable_gqa)
    p = _probs(q, k, attn_mask, options.is_causal, _scale(query, options.scale))
    p.mul_(_dropout_keep(p, options.dropout_p, seed)).div_(1.0 - options.dropout_p)
    return p @ v
