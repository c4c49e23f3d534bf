"""Spectral monitors of attention weight updates (DESIGN.md 1a).

Everything here is a pure function of tensors: batched over leading dimensions, fp32 or fp64,
no autograd. Factors are per head, shape (..., d, d_h): W_q^h and the paired key factor
W_k^g(h) (see ``agent.discovery``).

The QK bilinear increment between a snapshot W = W(t - delta) and now W' = W(t), with
dW = W' - W, splits as Delta_1 = W_q' W_k'^T - W_q W_k^T = Delta_2 + Delta_3 with

    Delta_2 = dW_q W_k^T + W_q dW_k^T = [dW_q, W_q] [W_k, dW_k]^T   (first order, the lead signal)
    Delta_3 = dW_q dW_k^T                                          (second order)
    Delta_1 = Delta_2 + Delta_3 = [dW_q, W_q] [W_k', dW_k]^T           (the whole increment)

Each is a product A B^T of two thin (d, r) matrices, r = 2 d_h or d_h. With thin QR
A = Q_A R_A, B = Q_B R_B, the non-zero singular values of the d x d matrix A B^T are those of
the r x r core R_A R_B^T, because Q_A and Q_B have orthonormal columns. Cost O(d r^2) instead of
O(d^3), and no d x d matrix is ever formed.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_FLOAT_DTYPES = (torch.float32, torch.float64)


class SpectrumStats(NamedTuple):
    """Statistics of singular-value vectors; every field has the leading shape of the input."""

    entropy: torch.Tensor  # (...,) spectral entropy H in nats; 0 for an all-zero spectrum
    effective_rank: torch.Tensor  # (...,) exp(H); 0 for an all-zero spectrum
    stable_rank: torch.Tensor  # (...,) sum s^2 / s_max^2; 0 for an all-zero spectrum
    frobenius: torch.Tensor  # (...,) sqrt(sum s^2), in the units of the matrix entries


def _check_float(name: str, t: torch.Tensor) -> None:
    if t.dtype not in _FLOAT_DTYPES:
        raise ValueError(f"{name} must be float32 or float64, got {t.dtype}")


def default_rtol(shape: tuple[int, int], dtype: torch.dtype) -> float:
    """Relative cut-off eps * max(shape) below which a singular value counts as zero."""
    return torch.finfo(dtype).eps * max(shape)


@torch.no_grad()
def spectrum_stats(
    singular_values: torch.Tensor,
    alpha: float = 2.0,
    *,
    shape: tuple[int, int] | None = None,
    rtol: float | None = None,
) -> SpectrumStats:
    """Spectral entropy, effective rank, stable rank and Frobenius norm of spectra (..., k).

    p_i = s_i^alpha / sum_j s_j^alpha over the kept values; H = -sum p_i ln p_i (natural log).
    Values below ``rtol * s_max`` are dropped, with ``rtol = eps(dtype) * max(shape)``; ``shape``
    is the shape of the matrix the values come from (default (k, k)). An all-zero spectrum (a
    zero update) has entropy 0, effective rank 0, stable rank 0 and norm 0: never NaN.
    """
    s = singular_values
    _check_float("singular_values", s)
    if s.ndim < 1 or s.shape[-1] == 0:
        raise ValueError(
            f"singular_values must have shape (..., k) with k >= 1, got {tuple(s.shape)}"
        )
    if alpha <= 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    if rtol is None:
        k = s.shape[-1]
        rtol = default_rtol(shape if shape is not None else (k, k), s.dtype)
    s = s.abs()
    s_max = s.amax(dim=-1, keepdim=True)  # (..., 1)
    kept = s > rtol * s_max  # (..., k); all False for an all-zero spectrum
    s = torch.where(kept, s, torch.zeros_like(s))
    nonzero = s_max.squeeze(-1) > 0  # (...,)

    # Normalize by s_max before powering so that alpha * log(s) cannot overflow.
    safe_max = torch.where(s_max > 0, s_max, torch.ones_like(s_max))
    u = s / safe_max  # (..., k) in [0, 1]
    w = torch.where(kept, u.pow(alpha), torch.zeros_like(u))
    total = w.sum(dim=-1, keepdim=True)
    p = w / torch.where(total > 0, total, torch.ones_like(total))
    plogp = torch.where(p > 0, p * torch.log(torch.where(p > 0, p, torch.ones_like(p))), 0.0)
    entropy = -plogp.sum(dim=-1)
    entropy = torch.where(nonzero, entropy.clamp_min(0.0), torch.zeros_like(entropy))

    sq = u.square().sum(dim=-1)  # sum s^2 / s_max^2
    stable_rank = torch.where(nonzero, sq, torch.zeros_like(sq))
    frobenius = s_max.squeeze(-1) * sq.sqrt()
    effective_rank = torch.where(nonzero, entropy.exp(), torch.zeros_like(entropy))
    return SpectrumStats(entropy, effective_rank, stable_rank, frobenius)


def _check_factors(**factors: torch.Tensor) -> torch.Size:
    shape = None
    for name, t in factors.items():
        _check_float(name, t)
        if t.ndim < 2:
            raise ValueError(f"{name} must have shape (..., d, d_h), got {tuple(t.shape)}")
        if shape is None:
            shape = t.shape
        elif t.shape != shape:
            raise ValueError(
                f"factor shapes differ: {name} has {tuple(t.shape)}, expected {tuple(shape)}"
            )
    assert shape is not None
    return shape


def _lowrank_product_svdvals(
    a: torch.Tensor, b: torch.Tensor, exactly_zero: torch.Tensor
) -> torch.Tensor:
    """Singular values of a @ b.mT for a, b of shape (..., d, r), through the r x r QR core.

    Returns (..., min(d, r)) values in descending order; values below eps * d * s_max are set
    to exactly zero (they are rounding noise of a rank-deficient product), and so is the whole
    spectrum where ``exactly_zero`` (...,) says the product is zero by construction.
    """
    _, r_a = torch.linalg.qr(a, mode="r")  # (..., min(d, r), r)
    _, r_b = torch.linalg.qr(b, mode="r")  # (..., min(d, r), r)
    core = r_a @ r_b.mT  # (..., min(d, r), min(d, r))
    s = torch.linalg.svdvals(core)  # (..., min(d, r)), descending
    d = a.shape[-2]
    tol = default_rtol((d, d), s.dtype) * s[..., :1]
    keep = (s > tol) & ~exactly_zero.unsqueeze(-1)
    return torch.where(keep, s, torch.zeros_like(s))


def _is_zero(t: torch.Tensor) -> torch.Tensor:
    """(..., d, d_h) -> (...,): True where every entry is zero."""
    return (t == 0).flatten(-2).all(dim=-1)


def _head_by_head_on_cpu(fn, *factors: torch.Tensor):  # noqa: ANN202 - returns fn's type
    """Apply ``fn`` to factors (..., d, d_h) one head at a time on a CPU, batched elsewhere.

    On a CPU a batched QR of many tall matrices runs out of cache: one head at a time is about
    30% faster at d = 4096 (benchmarks/monitor_speed.py). Results are stacked back to (...).
    """
    first = factors[0]
    if first.device.type != "cpu" or first.ndim == 2 or first.shape[:-2].numel() <= 1:
        return fn(*factors)
    lead = first.shape[:-2]
    flat = [f.reshape(-1, *f.shape[-2:]) for f in factors]
    outs = [fn(*(f[i] for f in flat)) for i in range(flat[0].shape[0])]
    if isinstance(outs[0], tuple):  # a NamedTuple of tensors
        fields = [
            torch.stack(parts).reshape(*lead, *parts[0].shape) for parts in zip(*outs, strict=True)
        ]
        return type(outs[0])(*fields)
    return torch.stack(outs).reshape(*lead, *outs[0].shape)


@torch.no_grad()
def qk_increment_spectrum(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    order: int = 2,
) -> torch.Tensor:
    """Singular values of the QK bilinear increment Delta_order for factors (..., d, d_h).

    ``order=2``: Delta_2 = dW_q W_k^T + W_q dW_k^T (W the previous snapshot), through a
    2 d_h core; ``order=3``: Delta_3 = dW_q dW_k^T through a d_h core; ``order=1``: the whole
    increment Delta_1 = W_q' W_k'^T - W_q W_k^T = Delta_2 + Delta_3, through the 2 d_h core of
    [dW_q, W_q] [W_k', dW_k]^T (no cancellation between two large products). Returns
    (..., min(d, r)) descending, r the core size; the values beyond the product's rank are
    zeros. Never forms a d x d matrix.
    """
    _check_factors(wq_prev=wq_prev, wk_prev=wk_prev, wq=wq, wk=wk)
    if order not in (1, 2, 3):
        raise ValueError(f"order must be 1, 2 or 3, got {order}")
    return _head_by_head_on_cpu(
        lambda *f: _increment_spectrum(*f, order=order), wq_prev, wk_prev, wq, wk
    )


def _increment_spectrum(
    wq_prev: torch.Tensor, wk_prev: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor, order: int
) -> torch.Tensor:
    dq, dk = wq - wq_prev, wk - wk_prev  # (..., d, d_h)
    zero_q, zero_k = _is_zero(dq), _is_zero(dk)  # (...)
    if order == 3:
        return _lowrank_product_svdvals(dq, dk, zero_q | zero_k)
    a = torch.cat([dq, wq_prev], dim=-1)  # (..., d, 2 d_h)
    b = torch.cat([wk_prev if order == 2 else wk, dk], dim=-1)  # (..., d, 2 d_h)
    return _lowrank_product_svdvals(a, b, zero_q & zero_k)


@torch.no_grad()
def update_spectrum(w_prev: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Singular values of dW = w - w_prev per head slice, (..., d, d_h) -> (..., min(d, d_h)).

    Descending; values below eps * max(d, d_h) * s_max are set to exactly zero.
    """
    _check_factors(w_prev=w_prev, w=w)
    return _head_by_head_on_cpu(_update_spectrum, w_prev, w)


def _update_spectrum(w_prev: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    diff = w - w_prev  # (..., m, n)
    if diff.shape[-2] < diff.shape[-1]:  # same values; LAPACK is several times faster tall
        diff = diff.mT
    s = torch.linalg.svdvals(diff)
    tol = default_rtol(tuple(w.shape[-2:]), s.dtype) * s[..., :1]
    return torch.where(s > tol, s, torch.zeros_like(s))


@torch.no_grad()
def qk_delta2_direction(
    wq_prev: torch.Tensor, wk_prev: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor
) -> torch.Tensor:
    """The unit top left singular vector of Delta_2 for factors (..., d, d_h): (..., d).

    Delta_2 = A B^T with A = [dW_q, W_q], B = [W_k, dW_k]; with A = Q_A R_A and B = Q_B R_B its
    left singular vectors are Q_A U, U those of the 2 d_h core R_A R_B^T. The sign is arbitrary
    (compare two directions with |cos|); an all-zero Delta_2 gives the zero vector.
    """
    _check_factors(wq_prev=wq_prev, wk_prev=wk_prev, wq=wq, wk=wk)
    return _head_by_head_on_cpu(_delta2_direction, wq_prev, wk_prev, wq, wk)


def _delta2_direction(
    wq_prev: torch.Tensor, wk_prev: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor
) -> torch.Tensor:
    dq, dk = wq - wq_prev, wk - wk_prev  # (..., d, d_h)
    q_a, r_a = torch.linalg.qr(torch.cat([dq, wq_prev], dim=-1))  # (..., d, 2dh), (.., 2dh, 2dh)
    _, r_b = torch.linalg.qr(torch.cat([wk_prev, dk], dim=-1), mode="r")
    u, _, _ = torch.linalg.svd(r_a @ r_b.mT)  # (..., 2dh, 2dh)
    top = q_a @ u[..., :, :1]  # (..., d, 1)
    zero = (_is_zero(dq) & _is_zero(dk))[..., None, None]
    return torch.where(zero, torch.zeros_like(top), top).squeeze(-1)


class QKSpectra(NamedTuple):
    """Every QK spectrum of one snapshot pair, (..., k) each, from one QR pair."""

    delta1: torch.Tensor  # (..., min(d, 2 d_h)) singular values of Delta_1
    delta2: torch.Tensor  # (..., min(d, 2 d_h)) singular values of Delta_2
    delta3: torch.Tensor  # (..., d_h) singular values of Delta_3
    dwq: torch.Tensor  # (..., d_h) singular values of dW_q
    dwk: torch.Tensor  # (..., d_h) singular values of dW_k (the paired key factor)
    wq_norm: torch.Tensor  # (...,) spectral norm of the newer W_q


def _trim(s: torch.Tensor, shape: tuple[int, int], exactly_zero: torch.Tensor) -> torch.Tensor:
    tol = default_rtol(shape, s.dtype) * s[..., :1]
    return torch.where((s > tol) & ~exactly_zero.unsqueeze(-1), s, torch.zeros_like(s))


@torch.no_grad()
def qk_monitor_spectra(
    wq_prev: torch.Tensor, wk_prev: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor
) -> QKSpectra:
    """All QK monitors of factors (..., d, d_h) through ONE thin QR of each side.

    With A = [dW_q, W_q] and B' = [dW_k, W_k] (W the older snapshot), A = Q_A R_A and
    B' = Q_B R_B. Then (Q_A, Q_B orthonormal, so only the small R factors matter):
    Delta_2 = A [W_k, dW_k]^T has core R_A (R_B with its two column blocks swapped)^T;
    dW_q = Q_A[:, :d_h] R_A[:d_h, :d_h] and dW_k likewise, so dW_q, dW_k and Delta_3 = dW_q dW_k^T
    come from the leading d_h x d_h blocks; Delta_1 = A [W_k', dW_k]^T and W_q' = A [I; I] are
    small products of R_A and R_B. Same values as ``qk_increment_spectrum`` and
    ``update_spectrum``, about a third of their combined cost. Needs d >= 2 d_h.
    """
    shape = _check_factors(wq_prev=wq_prev, wk_prev=wk_prev, wq=wq, wk=wk)
    d, dh = shape[-2], shape[-1]
    if d < 2 * dh:
        raise ValueError(f"qk_monitor_spectra needs d >= 2 d_h, got d={d}, d_h={dh}")
    return _head_by_head_on_cpu(_monitor_spectra, wq_prev, wk_prev, wq, wk)


def _monitor_spectra(
    wq_prev: torch.Tensor, wk_prev: torch.Tensor, wq: torch.Tensor, wk: torch.Tensor
) -> QKSpectra:
    d, dh = wq.shape[-2], wq.shape[-1]
    dq, dk = wq - wq_prev, wk - wk_prev  # (..., d, d_h)
    zero_q, zero_k = _is_zero(dq), _is_zero(dk)
    _, r_a = torch.linalg.qr(torch.cat([dq, wq_prev], dim=-1), mode="r")  # (..., 2dh, 2dh)
    _, r_b = torch.linalg.qr(torch.cat([dk, wk_prev], dim=-1), mode="r")  # (..., 2dh, 2dh)
    rb_dk, rb_w = r_b[..., :dh], r_b[..., dh:]  # R of dW_k and of W_k, (..., 2dh, dh) each
    core2 = r_a @ torch.cat([rb_w, rb_dk], dim=-1).mT  # B = [W_k, dW_k]
    core1 = r_a @ torch.cat([rb_w + rb_dk, rb_dk], dim=-1).mT  # B = [W_k + dW_k, dW_k]
    rq, rk = r_a[..., :dh, :dh], r_b[..., :dh, :dh]  # (..., dh, dh): dW_q, dW_k up to Q
    delta1 = _trim(torch.linalg.svdvals(core1), (d, d), zero_q & zero_k)
    delta2 = _trim(torch.linalg.svdvals(core2), (d, d), zero_q & zero_k)
    delta3 = _trim(torch.linalg.svdvals(rq @ rk.mT), (d, d), zero_q | zero_k)
    dwq = _trim(torch.linalg.svdvals(rq), (d, dh), zero_q)
    dwk = _trim(torch.linalg.svdvals(rk), (d, dh), zero_k)
    wq_new = r_a[..., :dh] + r_a[..., dh:]  # R-coordinates of W_q' = dW_q + W_q
    wq_norm = torch.linalg.svdvals(wq_new)[..., 0]
    return QKSpectra(delta1, delta2, delta3, dwq, dwk, wq_norm)
