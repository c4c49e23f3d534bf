"""Router monitors for mixture-of-experts layers (DESIGN.md 1b).

Weights: ``w_router`` of shape (..., E, d), one row w_i per expert. Logits: (..., E), every
leading position a token (they are flattened). Pure functions, no autograd, computed in fp32 at
least (fp64 stays fp64). They run on the device of their input without host synchronization, so
a forward hook can call them on every forward.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch


class RoutingEntropy(NamedTuple):
    mean: torch.Tensor  # () mean over tokens of the full-softmax entropy, nats
    normalized: torch.Tensor  # () mean / ln E, in [0, 1]
    p10: torch.Tensor  # () 10th percentile (linear interpolation) of per-token entropy, nats


class RoutingLoad(NamedTuple):
    load: torch.Tensor  # (E,) fraction of the tokens' top-k assignments each expert received
    max_load: torch.Tensor  # () largest load fraction; 1/E is perfectly balanced
    load_entropy: torch.Tensor  # () entropy of ``load`` in nats (0 log 0 = 0)
    margin: torch.Tensor  # () mean over tokens of top-1 minus top-2 probability
    dead_experts: torch.Tensor  # () number of experts that received no assignment (int64)


def _work_dtype(t: torch.Tensor) -> torch.dtype:
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def _check_router(w_router: torch.Tensor) -> torch.Tensor:
    if w_router.ndim < 2 or w_router.shape[-2] < 2:
        raise ValueError(
            f"w_router must have shape (..., E, d) with E >= 2 experts, got {tuple(w_router.shape)}"
        )
    return w_router.detach().to(_work_dtype(w_router))


def _flatten_logits(logits: torch.Tensor) -> torch.Tensor:
    if logits.ndim < 1 or logits.shape[-1] < 2:
        raise ValueError(f"logits must have shape (..., E) with E >= 2, got {tuple(logits.shape)}")
    z = logits.detach().reshape(-1, logits.shape[-1]).to(_work_dtype(logits))  # (N, E)
    if z.shape[0] == 0:
        raise ValueError("logits hold no tokens")
    return z


@torch.no_grad()
def router_conditioning_ratio(w_router: torch.Tensor) -> torch.Tensor:
    """Centred conditioning ratio eps = max_i ||w_i - w_bar|| / ||w_bar||, shape (...).

    Small eps: the rows share one direction (a redundant router). Defined edge cases: all rows
    equal (including all zero) -> 0; zero mean row with distinct rows -> +inf.
    """
    w = _check_router(w_router)
    w_bar = w.mean(dim=-2, keepdim=True)  # (..., 1, d)
    spread = (w - w_bar).norm(dim=-1).amax(dim=-1)  # (...)
    centre = w_bar.squeeze(-2).norm(dim=-1)  # (...)
    ratio = spread / torch.where(centre > 0, centre, torch.ones_like(centre))
    inf = torch.full_like(ratio, math.inf)
    return torch.where(centre > 0, ratio, torch.where(spread > 0, inf, torch.zeros_like(ratio)))


@torch.no_grad()
def router_similarity(w_router: torch.Tensor) -> torch.Tensor:
    """Mean pairwise cosine similarity of the rows, shape (...), in O(E d).

    With unit rows u_i and their mean u_bar, the mean over i != j of u_i . u_j is
    (E^2 ||u_bar||^2 - E) / (E (E - 1)) = (E ||u_bar||^2 - 1) / (E - 1). A zero row has cosine 0
    with every row (it counts in the pairs but adds nothing).
    """
    w = _check_router(w_router)
    e = w.shape[-2]
    norms = w.norm(dim=-1, keepdim=True)  # (..., E, 1)
    u = w / torch.where(norms > 0, norms, torch.ones_like(norms))  # zero rows stay zero
    n_unit = (norms.squeeze(-1) > 0).sum(dim=-1).to(w.dtype)  # (...) sum ||u_i||^2
    total = u.sum(dim=-2)  # (..., d) = E u_bar
    return (total.square().sum(dim=-1) - n_unit) / (e * (e - 1))


def _entropy_from(logp: torch.Tensor, p: torch.Tensor) -> RoutingEntropy:
    h = -torch.where(p > 0, p * logp, torch.zeros_like(p)).sum(dim=-1)  # (N,) nats
    mean = h.mean()
    return RoutingEntropy(
        mean=mean, normalized=mean / math.log(p.shape[-1]), p10=_linear_quantile(h, 0.1)
    )


def _load_from(p: torch.Tensor, top_k: int) -> RoutingLoad:
    n, e = p.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    top = torch.topk(p, k=max(top_k, 2), dim=-1)  # values and indices (N, max(k, 2))
    counts = torch.bincount(top.indices[:, :top_k].reshape(-1), minlength=e).to(p.dtype)  # (E,)
    load = counts / (n * top_k)  # (E,)
    load_entropy = -torch.where(
        load > 0, load * torch.log(torch.where(load > 0, load, 1.0)), 0.0
    ).sum()
    margin = (top.values[:, 0] - top.values[:, 1]).mean()
    return RoutingLoad(
        load=load,
        max_load=load.max(),
        load_entropy=load_entropy,
        margin=margin,
        dead_experts=(counts == 0).sum(),
    )


@torch.no_grad()
def routing_entropy(logits: torch.Tensor) -> RoutingEntropy:
    """Per-token entropy of the full routing softmax (before top-k), reduced over tokens.

    Mean of per-token entropies, not the entropy of the mean load. Logits of -inf (masked
    experts) contribute 0 log 0 = 0.
    """
    logp = torch.log_softmax(_flatten_logits(logits), dim=-1)  # (N, E)
    return _entropy_from(logp, logp.exp())


@torch.no_grad()
def routing_load(logits: torch.Tensor, top_k: int) -> RoutingLoad:
    """Load and margin statistics of top-k routing (lagging, context metrics)."""
    return _load_from(torch.softmax(_flatten_logits(logits), dim=-1), top_k)


@torch.no_grad()
def routing_stats(logits: torch.Tensor, top_k: int) -> tuple[RoutingEntropy, RoutingLoad]:
    """``routing_entropy`` and ``routing_load`` from one softmax (what a router hook calls)."""
    logp = torch.log_softmax(_flatten_logits(logits), dim=-1)  # (N, E)
    p = logp.exp()
    return _entropy_from(logp, p), _load_from(p, top_k)


# What ``routing_sums`` adds up per router, in this order (``RouterProbe`` keeps these sums).
ROUTING_SUM_FIELDS = ("entropy", "entropy_normalized", "entropy_p10", "margin", "forwards")


@torch.no_grad()
def routing_sums(logits: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing statistics of F forwards at once, summed over the forwards.

    ``logits`` (F, E, N): F forwards of N tokens each, *experts first* (z^T: the layout a
    router hook writes with one product W x^T; every reduction over the few experts then runs
    across the tokens, which a CPU vectorizes). Returns ``row`` (5,) in the order of
    ``ROUTING_SUM_FIELDS`` -- the sums over forwards of each forward's mean full-softmax
    entropy (nats), its normalized entropy (/ ln E), its 10th-percentile token entropy (linear
    interpolation), its mean top-1 minus top-2 probability, and F -- and ``load`` (E,), the sum
    over forwards of each forward's top-k load fractions.

    Per forward these are ``routing_stats``'s values (``entropy.mean``, ``entropy.normalized``,
    ``entropy.p10``, ``load.margin``, ``load.load``) with one difference in ties: where experts
    tie at a token's k-th largest probability, ``routing_stats`` (``torch.topk``) counts some of
    them and this function shares the remaining assignments equally among them (each token
    still assigns exactly k). Without ties the values are equal. No ``topk``, no softmax call
    (both are slow over a last dimension of a few experts on a CPU), fp32 at least, on the
    device, no host synchronization.
    """
    if logits.ndim != 3 or logits.shape[1] < 2 or logits.shape[2] == 0:
        raise ValueError(
            f"logits must have shape (F, E, N) with E >= 2, N >= 1, got {tuple(logits.shape)}"
        )
    f, e, n = logits.shape
    if not 1 <= top_k <= e:
        raise ValueError(f"top_k must be in [1, {e}], got {top_k}")
    z = logits.detach().to(_work_dtype(logits))  # (F, E, N)
    top1 = z.amax(dim=1, keepdim=True)  # (F, 1, N)
    zc = z - top1  # (F, E, N), <= 0; -inf for a masked expert
    p = zc.exp()
    total = p.sum(dim=1, keepdim=True)  # (F, 1, N), in [1, E]
    p.div_(total)
    # H = -sum p log p = log(total) - sum p zc; a masked expert has p = 0 and contributes 0.
    zc.clamp_min_(torch.finfo(zc.dtype).min)
    h = total.squeeze(1).log() - zc.mul_(p).sum(dim=1)  # (F, N) nats
    mean = h.mean(dim=-1)  # (F,)
    # zc's storage is scratch from here on: the 0/1 masks below are written into it in p's
    # dtype (a comparison into a float tensor is vectorized, one into a bool tensor is not:
    # several times faster on a CPU, and no new (F, E, N) allocation).
    scratch = zc
    kth, second = _kth_largest(p, top_k, scratch)  # (F, 1, N) each
    margin = (1.0 / total.squeeze(1) - second.squeeze(1)).mean(dim=-1)  # p_top1 = 1 / total
    # Counts as float sums of 0/1 masks: exact integers while a sum stays <= 2^24 in float32.
    count_dtype = p.dtype if f * n <= 2**24 else torch.float64
    above = torch.gt(p, kth, out=scratch)  # (F, E, N) 0/1
    n_above = above.sum(dim=1, keepdim=True)  # (F, 1, N), exact
    assigned_above = above.sum(dim=(0, 2), dtype=count_dtype).to(p.dtype)  # (E,), exact
    tied = torch.eq(p, kth, out=scratch)  # (F, E, N) 0/1; ``above`` is not read again
    n_tied = tied.sum(dim=1, keepdim=True)
    share = (top_k - n_above) / n_tied  # each tied expert's part of what is left
    assigned = assigned_above + tied.mul_(share).sum(dim=(0, 2))  # (E,)
    forwards = torch.full((), f, dtype=z.dtype, device=z.device)
    row = torch.stack(
        [
            mean.sum(),
            mean.sum() / math.log(e),
            _linear_quantile(h, 0.1).sum(),
            margin.sum(),
            forwards,
        ]
    )
    return row, assigned.to(z.dtype) / (n * top_k)


def _kth_largest(
    p: torch.Tensor, k: int, scratch: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's k-th and 2nd largest value over the experts of p (F, E, N), p >= 0,
    counting repeated values: (F, 1, N) each. max(k, 2) passes of one max over the experts;
    the values found are zeroed (p >= 0: they drop to the bottom) instead of masked, and the
    counts are sums of 0/1 masks written into ``scratch`` (F, E, N), p's dtype (several times
    faster on a CPU than masked_fill or boolean masks). ``scratch`` is overwritten."""
    remaining = p
    passes = max(k, 2)
    kth = second = found = None
    for i in range(passes):
        value = remaining.amax(dim=1, keepdim=True)  # the next distinct value, (F, 1, N)
        kth = value if found is None else torch.where(found >= k, kth, value)
        second = value if found is None else torch.where(found >= 2, second, value)
        if i + 1 == passes:
            break
        # values >= the current one, (F, 1, N), exact (at most E)
        found = torch.ge(p, value, out=scratch).sum(dim=1, keepdim=True)
        below = torch.lt(remaining, value, out=scratch)  # 0/1
        remaining = remaining * below if remaining is p else remaining.mul_(below)
    assert kth is not None and second is not None
    return kth, second


def _linear_quantile(x: torch.Tensor, q: float) -> torch.Tensor:
    """Quantile along the last dimension of x (..., N) with linear interpolation (numpy's
    default): (...). The two order statistics it interpolates come from one partial selection
    (``topk`` of the lo + 2 smallest, sorted; about half the CPU time of two ``kthvalue``
    calls, the same values). No full sort, no host synchronization, no size limit."""
    n = x.shape[-1]
    pos = q * (n - 1)
    lo = math.floor(pos)
    frac = pos - lo
    if frac == 0.0:
        return torch.kthvalue(x, lo + 1, dim=-1).values
    # frac > 0, so lo + 2 <= n: the (lo + 1)-th and (lo + 2)-th smallest, ascending
    smallest = torch.topk(x, lo + 2, dim=-1, largest=False, sorted=True).values  # (..., lo + 2)
    v_lo, v_hi = smallest[..., lo], smallest[..., lo + 1]
    return v_lo + frac * (v_hi - v_lo)
