"""Causal attention with a hand-written backward whose intermediates can be rounded.

Forward (per batch and head, T queries, T keys, head size d_h, scale c = 1/sqrt(d_h)):

    S = c Q K^T (T, T), causal mask -> -inf, P = softmax(S), O = P V (T, d_h)

saving Q, K, V, O and the row log-sum-exp L (T,). Backward, the textbook flash-attention
recurrence (P is recomputed from L as exp(S - L)):

    dV = P^T dO
    dP = dO V^T
    delta = rowsum(dO * O)        <- site "O_delta" rounds O as read here
    dS = P * (dP - delta)         <- site "dS" rounds dS
    dQ = c dS K,  dK = c dS^T Q   <- site "dQK" rounds dQ and dK

A fault rounds the chosen intermediates to ``bits`` mantissa bits with a rounding mode from
:mod:`agent.testbed.lowprec`. With a biased mode (floor, ceil, trunc, away) the error has the
same sign step after step and accumulates in W_q/W_k; with ``"rne"`` the error is unbiased and
averages out: that arm is the control. With no fault (or a disabled one) the gradients equal
those of autograd through the reference math attention.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from agent.testbed.lowprec import FP32_MANTISSA_BITS, ROUNDING_MODES, RoundingMode, round_mantissa

FAULT_SITES: tuple[str, ...] = ("O_delta", "dS", "dQK")


@dataclass(frozen=True)
class AttentionFault:
    """Which backward intermediates are rounded, to how many mantissa bits, in which mode.

    sites: any of ``FAULT_SITES``; bits: explicit mantissa bits kept (0..23; bf16 keeps 7);
    mode: rounding mode (``"rne"`` unbiased, the others biased); enabled: off = exact backward.
    """

    sites: tuple[str, ...] = ("dS",)
    bits: int = 5
    mode: RoundingMode = "floor"
    enabled: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.sites, str):
            raise ValueError(f"AttentionFault.sites must be a tuple of sites, got {self.sites!r}")
        unknown = [s for s in self.sites if s not in FAULT_SITES]
        if unknown or not self.sites:
            raise ValueError(
                f"AttentionFault.sites must be a non-empty subset of {FAULT_SITES}, "
                f"got {self.sites!r}"
            )
        if not isinstance(self.bits, int) or not 0 <= self.bits <= FP32_MANTISSA_BITS:
            raise ValueError(f"AttentionFault.bits must be an int in 0..23, got {self.bits!r}")
        if self.mode not in ROUNDING_MODES:
            raise ValueError(
                f"AttentionFault.mode must be one of {ROUNDING_MODES}, got {self.mode!r}"
            )

    def rounds(self, site: str) -> bool:
        return self.enabled and site in self.sites

    def apply(self, site: str, x: Tensor) -> Tensor:
        """``x`` rounded if this fault covers ``site``, else ``x`` itself."""
        if not self.rounds(site):
            return x
        return round_mantissa(x.float(), self.bits, self.mode).to(x.dtype)


def _scores(q: Tensor, k: Tensor, scale: float, is_causal: bool) -> Tensor:
    s = torch.matmul(q, k.transpose(-2, -1)) * scale  # (B, H, T, T)
    if is_causal:
        t_q, t_k = s.shape[-2], s.shape[-1]
        future = torch.ones(t_q, t_k, dtype=torch.bool, device=s.device).triu(t_k - t_q + 1)
        s = s.masked_fill(future, float("-inf"))
    return s


class _EmulatedAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale, is_causal, fault):  # type: ignore[override]
        s = _scores(q, k, scale, is_causal)  # (B, H, T, T)
        lse = torch.logsumexp(s, dim=-1, keepdim=True)  # (B, H, T, 1)
        p = torch.exp(s - lse)
        o = torch.matmul(p, v)  # (B, H, T, d_h)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.scale = scale
        ctx.is_causal = is_causal
        ctx.fault = fault
        return o

    @staticmethod
    def backward(ctx, d_o):  # type: ignore[override]
        q, k, v, o, lse = ctx.saved_tensors
        fault: AttentionFault | None = ctx.fault
        scale: float = ctx.scale
        p = torch.exp(_scores(q, k, scale, ctx.is_causal) - lse)  # (B, H, T, T)
        d_v = torch.matmul(p.transpose(-2, -1), d_o)  # (B, H, T, d_h)
        d_p = torch.matmul(d_o, v.transpose(-2, -1))  # (B, H, T, T)
        o_read = fault.apply("O_delta", o) if fault is not None else o
        delta = (d_o * o_read).sum(dim=-1, keepdim=True)  # (B, H, T, 1)
        d_s = p * (d_p - delta)
        if fault is not None:
            d_s = fault.apply("dS", d_s)
        d_q = torch.matmul(d_s, k) * scale  # (B, H, T, d_h)
        d_k = torch.matmul(d_s.transpose(-2, -1), q) * scale
        if fault is not None:
            d_q = fault.apply("dQK", d_q)
            d_k = fault.apply("dQK", d_k)
        return d_q, d_k, d_v, None, None, None


def emulated_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    *,
    is_causal: bool = True,
    scale: float | None = None,
    fault: AttentionFault | None = None,
) -> Tensor:
    """Attention of q, k, v (B, H, T, d_h) -> (B, H, T, d_h) with an emulated-precision backward.

    Same calling convention as ``torch.nn.functional.scaled_dot_product_attention`` for the
    arguments it supports: ``attn_mask`` must be None and ``dropout_p`` 0 (accepted so that the
    function can serve as an SDPA fallback). K and V must have as many heads as Q (expand
    grouped KV heads first). ``scale`` defaults to 1/sqrt(d_h).
    """
    if attn_mask is not None:
        raise ValueError("emulated_attention: attn_mask is not supported (use is_causal)")
    if dropout_p != 0.0:
        raise ValueError(f"emulated_attention: dropout_p must be 0.0, got {dropout_p}")
    if q.dim() != 4 or k.shape != q.shape or v.shape[:-1] != q.shape[:-1]:
        raise ValueError(
            "emulated_attention: q, k, v must be (B, H, T, d_h) with equal B, H, T, got "
            f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}"
        )
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if fault is not None and not fault.enabled:
        fault = None
    return _EmulatedAttention.apply(q, k, v, float(scale), bool(is_causal), fault)


def reference_attention(
    q: Tensor, k: Tensor, v: Tensor, *, is_causal: bool = True, scale: float | None = None
) -> Tensor:
    """The same math through plain autograd: the ground truth the tests compare against."""
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    p = torch.softmax(_scores(q, k, scale, is_causal), dim=-1)
    return torch.matmul(p, v)
