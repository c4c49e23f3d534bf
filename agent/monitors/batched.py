"""All QK monitor spectra of many heads, in equal-size chunks, for a device (issue #17 item 1).

``qk_monitor_spectra_batched`` returns what ``qk_monitor_spectra`` returns (DESIGN.md 1a), for
factors (..., d, d_h) of every sampled head of every layer at once, plus optionally Delta_2's
top left singular vector (``qk_delta2_direction``). The heads go through in chunks of exactly
``chunk_size`` heads (the last chunk is padded by repeating the last head, and the padded rows
are dropped): cuSOLVER sets itself up again whenever the batch size of a call changes, so every
call must see the same one. Nothing in here reads a tensor value on the host (no ``.item()``,
no branching on values): zero updates and rank-deficient factors are handled with
``torch.where``. (``torch.linalg.svdvals``/``eigh``/``eigvalsh`` on CUDA still check their
convergence flags on the host in PyTorch; that is inside torch, as in ``spectrum.py``.)

Notation, as in ``spectrum.py``: W the older snapshot, dW = W' - W, A = [dW_q, W_q],
B' = [dW_k, W_k] (both d x r, r = 2 d_h) and Delta_2 = A B_s^T with B_s = [W_k, dW_k] = B' P
(P swaps the two column blocks). For any R with R^T R = A^T A (the R of a thin QR, or any other
square root of the Gram) the non-zero singular values of A X^T are those of R X'^T, so only the
r x r factors matter. Two ways to get them:

``method="qr"`` (default): one batched thin QR of each side in the input dtype, exactly as
    ``spectrum.py``. Householder QR is column-wise backward stable, so the dW blocks keep
    their own relative accuracy although W is 10^3..10^6 times larger: every singular value
    has an absolute error of about eps(dtype) * s_max. The r x r core products and SVDs run
    in the input dtype, except that the products are formed in float64 where float32
    matmuls may run in TF32 (CUDA with TF32 enabled).
``method="gram"``: the Grams G_A = A^T A and G_B = B'^T B' (the O(d r^2) work, three matmuls
    per side, in ``gram_dtype``), then everything r x r in float64: a square root R_A of the
    Jacobi-scaled G_A from ``eigh`` (R_A = diag(sqrt(max(l, 0))) V^T D with G_A = D C D and
    C = V diag(l) V^T; valid for rank-deficient G_A, e.g. a zero or low-rank dW_q, without any
    jitter), and the squared singular values as eigenvalues of small symmetric sandwiches
    (Delta_2: R_A P^T G_B P R_A^T). A Gram squares the condition number: a singular value s
    comes out with an absolute error of about eps(gram_dtype) * s_max^2 / s, so values below
    about sqrt(eps) * s_max (3e-4 s_max in float32) are noise. For Delta_3 = dW_q dW_k^T,
    formed from its factors' Grams, read s_max as ||dW_q|| ||dW_k||: larger than Delta_3's own
    s_max when the two updates nearly cancel in the product. For alpha = 2 statistics
    (entropy, effective and stable rank, Frobenius norm, all functions of s^2) that noise
    weighs eps * s_max^2 and does not matter (benchmarks/results/batched_speed.md).

Why eigh and not Cholesky for R_A: a Cholesky factor would also do (G = R^T R) and is fifteen
times cheaper, but it breaks down on a rank-deficient Gram, and low-rank updates are common
(the fault signature is a collapse onto a few directions). A branch-free fallback would have
to compute the eigh for every head anyway, so eigh it is.

Delta_2's top left singular vector, without Q_A: if v is the top right singular vector of an
r x r core R_A R_s^T (R_s^T R_s = B_s^T B_s), then Delta_2 (Q_s v) = A R_s^T v = s_1 u_1, so
u_1 is A w normalized, w = R_s^T v. With only a square root R_A and the Gram G_s = P^T G_B P:
if y is the top eigenvector of K = R_A G_s R_A^T (= core core^T), then R_s^T v = G_s R_A^T y
/ s_1, so w = G_s R_A^T y (no inverse of R_A anywhere).
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch

from agent.monitors.spectrum import QKSpectra, _check_factors, _is_zero, _trim

Method = Literal["qr", "gram"]


class BatchedQKSpectra(NamedTuple):
    """``QKSpectra``'s fields for factors (..., d, d_h), plus Delta_2's top left direction."""

    delta1: torch.Tensor | None  # (..., 2 d_h) singular values of Delta_1 (None: not asked)
    delta2: torch.Tensor  # (..., 2 d_h) singular values of Delta_2
    delta3: torch.Tensor  # (..., d_h) singular values of Delta_3
    dwq: torch.Tensor  # (..., d_h) singular values of dW_q
    dwk: torch.Tensor  # (..., d_h) singular values of dW_k (the paired key factor)
    wq_norm: torch.Tensor  # (...,) spectral norm of the newer W_q
    direction: torch.Tensor | None  # (..., d) unit top left singular vector of Delta_2, or None

    def spectra(self) -> QKSpectra:
        """The six spectra as a ``QKSpectra`` (Delta_1 included: ``delta1=True``)."""
        if self.delta1 is None:
            raise ValueError("Delta_1 was not computed (delta1=False)")
        return QKSpectra(self.delta1, self.delta2, self.delta3, self.dwq, self.dwk, self.wq_norm)


def _tf32_possible(device: torch.device) -> bool:
    """True where a float32 matmul on ``device`` may run in TF32 (a 10-bit mantissa).

    Reads PyTorch's flags only (host state, no tensor). Mixed legacy/new flag settings make
    PyTorch refuse to answer; then assume the worst.
    """
    if device.type != "cuda":
        return False
    matmul = torch.backends.cuda.matmul
    precision = getattr(matmul, "fp32_precision", None)  # new API (torch >= 2.9)
    if precision == "ieee":
        return False
    if precision == "tf32":
        return True
    try:
        return bool(matmul.allow_tf32)
    except RuntimeError:
        return True


@torch.no_grad()
def qk_monitor_spectra_batched(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    *,
    chunk_size: int = 32,
    method: Method = "qr",
    directions: bool = False,
    gram_dtype: torch.dtype | None = None,
    delta1: bool = True,
) -> BatchedQKSpectra:
    """All QK monitors of factors (..., d, d_h), in chunks of exactly ``chunk_size`` heads.

    Same values as ``qk_monitor_spectra`` (and, with ``directions=True``, as
    ``qk_delta2_direction``, up to sign) within float tolerance, in the input dtype (float32
    or float64), with the same conventions: values below eps(dtype) * max(shape) * s_max are
    exactly zero, and so is every spectrum that is zero by construction (a zero dW_q, dW_k or
    both; the direction is then the zero vector). The leading dimensions (at least one head)
    are flattened into heads, cut into chunks of ``chunk_size`` (the last one padded with
    copies of the last head) and restored in the result. Needs d >= 2 d_h.

    ``method``: ``"qr"`` (thin QR of each side) or ``"gram"`` (Grams, then float64 eigh; see
    the module docstring for the accuracy of each). ``gram_dtype``: the dtype of the Gram
    matmuls for ``"gram"``; default the input dtype, or float64 where float32 matmuls may run
    in TF32 on CUDA. ``delta1=False``: Delta_1 is not computed (its field is None; the other
    values are unchanged). Never forms a d x d matrix; memory per chunk is a few copies of the
    chunk's factors.
    """
    shape = _check_factors(wq_prev=wq_prev, wk_prev=wk_prev, wq=wq, wk=wk)
    factors = (wq_prev, wk_prev, wq, wk)
    if len({(t.dtype, t.device) for t in factors}) != 1:
        raise ValueError("wq_prev, wk_prev, wq and wk must have one dtype and one device")
    d, dh = shape[-2], shape[-1]
    if d < 2 * dh:
        raise ValueError(f"qk_monitor_spectra_batched needs d >= 2 d_h, got d={d}, d_h={dh}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")
    if method not in ("qr", "gram"):
        raise ValueError(f"method must be 'qr' or 'gram', got {method!r}")
    if gram_dtype is not None and gram_dtype not in (torch.float32, torch.float64):
        raise ValueError(f"gram_dtype must be float32 or float64, got {gram_dtype}")
    lead = shape[:-2]
    n = lead.numel()
    if n < 1:
        raise ValueError(f"need at least one head, got factors of shape {tuple(shape)}")
    if gram_dtype is None:
        tf32 = _tf32_possible(wq.device) and wq.dtype == torch.float32
        gram_dtype = torch.float64 if tf32 else wq.dtype

    flat = [t.reshape(n, d, dh) for t in factors]  # (n, d, d_h) each
    parts: list[BatchedQKSpectra] = []
    for start in range(0, n, chunk_size):
        chunk = [_padded_chunk(t, start, chunk_size) for t in flat]  # (chunk_size, d, d_h)
        if method == "qr":
            parts.append(_chunk_qr(*chunk, directions=directions, delta1=delta1))
        else:
            parts.append(
                _chunk_gram(*chunk, directions=directions, gram_dtype=gram_dtype, delta1=delta1)
            )

    def gather(field: int) -> torch.Tensor | None:
        pieces = [p[field] for p in parts]
        if pieces[0] is None:
            return None
        whole = (pieces[0] if len(pieces) == 1 else torch.cat(pieces))[:n]  # drop the padding
        return whole.reshape(*lead, *whole.shape[1:])

    return BatchedQKSpectra(*(gather(i) for i in range(len(BatchedQKSpectra._fields))))


def _padded_chunk(t: torch.Tensor, start: int, size: int) -> torch.Tensor:
    """Heads start .. start + size of t (n, d, d_h), padded with copies of the last head."""
    part = t[start : start + size]
    missing = size - part.shape[0]
    if missing == 0:
        return part
    return torch.cat([part, t[-1:].expand(missing, *t.shape[1:])])


def _unit(v: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """v (c, d) scaled to unit norm per row; rows where ``zero`` (c,) or of norm 0 become 0."""
    norm = torch.linalg.vector_norm(v, dim=-1, keepdim=True)  # (c, 1)
    ok = (norm > 0) & ~zero.unsqueeze(-1)
    return torch.where(ok, v / torch.where(ok, norm, torch.ones_like(norm)), torch.zeros_like(v))


def _apply(a_d: torch.Tensor, a_w: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """[a_d, a_w] @ w for blocks (c, d, d_h) and w (c, 2 d_h) float64: (c, d), in a_d's dtype.

    ``w`` is normalized first so that the float32 product can neither overflow nor underflow;
    where float32 matmuls may run in TF32 the product is taken in float64.
    """
    dh = a_d.shape[-1]
    w = w / torch.linalg.vector_norm(w, dim=-1, keepdim=True).clamp_min(torch.finfo(w.dtype).tiny)
    dtype = torch.float64 if _tf32_possible(a_d.device) else a_d.dtype
    w = w.to(dtype).unsqueeze(-1)  # (c, 2 d_h, 1)
    out = a_d.to(dtype) @ w[:, :dh] + a_w.to(dtype) @ w[:, dh:]  # (c, d, 1)
    return out.squeeze(-1).to(a_d.dtype)


def _chunk_qr(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    *,
    directions: bool,
    delta1: bool = True,
) -> BatchedQKSpectra:
    """One chunk (c, d, d_h) through thin QRs in the input dtype (``_monitor_spectra``)."""
    d, dh = wq.shape[-2], wq.shape[-1]
    dtype = wq.dtype
    dq, dk = wq - wq_prev, wk - wk_prev  # (c, d, d_h)
    zero_q, zero_k = _is_zero(dq), _is_zero(dk)  # (c,)
    _, r_a = torch.linalg.qr(torch.cat([dq, wq_prev], dim=-1), mode="r")  # (c, 2dh, 2dh)
    _, r_b = torch.linalg.qr(torch.cat([dk, wk_prev], dim=-1), mode="r")  # (c, 2dh, 2dh)
    # Core products in the input dtype (as spectrum.py), in float64 where TF32 could round them.
    small = torch.float64 if _tf32_possible(wq.device) else dtype
    ra, rb = r_a.to(small), r_b.to(small)
    rb_dk, rb_w = rb[..., :dh], rb[..., dh:]  # R of dW_k and of W_k, (c, 2dh, dh) each
    rb_s = torch.cat([rb_w, rb_dk], dim=-1)  # R of B_s = [W_k, dW_k], (c, 2dh, 2dh)
    core2 = (ra @ rb_s.mT).to(dtype)  # (c, 2dh, 2dh)
    both = zero_q & zero_k
    direction = None
    if directions:
        _, s2, vh = torch.linalg.svd(core2)  # (c, 2dh), (c, 2dh, 2dh)
        w = rb_s.mT @ vh[..., 0, :].to(small).unsqueeze(-1)  # (c, 2dh, 1): A w = s_1 u_1
        direction = _unit(_apply(dq, wq_prev, w.squeeze(-1).double()), both)
    else:
        s2 = torch.linalg.svdvals(core2)
    delta2 = _trim(s2, (d, d), both)
    spectrum1 = None
    if delta1:
        core1 = (ra @ torch.cat([rb_w + rb_dk, rb_dk], dim=-1).mT).to(dtype)  # B = [W_k', dW_k]
        spectrum1 = _trim(torch.linalg.svdvals(core1), (d, d), both)
    rq, rk = r_a[..., :dh, :dh], r_b[..., :dh, :dh]  # (c, dh, dh): dW_q, dW_k up to Q
    core3 = (ra[..., :dh, :dh] @ rb[..., :dh, :dh].mT).to(dtype)  # (c, dh, dh)
    delta3 = _trim(torch.linalg.svdvals(core3), (d, d), zero_q | zero_k)
    dwq = _trim(torch.linalg.svdvals(rq), (d, dh), zero_q)
    dwk = _trim(torch.linalg.svdvals(rk), (d, dh), zero_k)
    wq_norm = torch.linalg.svdvals(r_a[..., :dh] + r_a[..., dh:])[..., 0]  # R-coords of W_q'
    return BatchedQKSpectra(spectrum1, delta2, delta3, dwq, dwk, wq_norm, direction)


def _gram(x_d: torch.Tensor, x_w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[x_d, x_w]^T [x_d, x_w] for blocks (c, d, d_h): (c, 2 d_h, 2 d_h) float64.

    Three block matmuls in ``dtype`` (a quarter fewer flops than the full product, and no
    concatenated copy), assembled in float64.
    """
    x_d, x_w = x_d.to(dtype), x_w.to(dtype)
    g_dd, g_dw, g_ww = x_d.mT @ x_d, x_d.mT @ x_w, x_w.mT @ x_w  # (c, dh, dh) each
    top = torch.cat([g_dd, g_dw], dim=-1)
    bottom = torch.cat([g_dw.mT, g_ww], dim=-1)
    g = torch.cat([top, bottom], dim=-2).double()  # (c, 2dh, 2dh)
    return (g + g.mT) / 2  # exactly symmetric (the diagonal blocks come out of a GEMM)


def _gram_sqrt(g: torch.Tensor) -> torch.Tensor:
    """A square root R (c, r, r) with R^T R = G of PSD Grams G (c, r, r), float64.

    Jacobi-scaled eigh: G = D C D with D = sqrt(diag(G)), C = V diag(l) V^T, and
    R = diag(sqrt(max(l, 0))) V^T D. The scaling makes the result column-wise accurate (the
    dW columns are orders of magnitude shorter than the W columns); zero columns stay exactly
    zero; a rank-deficient G just has zero eigenvalues. No jitter.
    """
    dg = torch.diagonal(g, dim1=-2, dim2=-1).clamp_min(0).sqrt()  # (c, r)
    safe = torch.where(dg > 0, dg, torch.ones_like(dg))
    c = g / (safe.unsqueeze(-1) * safe.unsqueeze(-2))
    lam, v = torch.linalg.eigh(c)  # (c, r), (c, r, r)
    return lam.clamp_min(0).sqrt().unsqueeze(-1) * v.mT * dg.unsqueeze(-2)


def _sqrt_eigvals_desc(k: torch.Tensor) -> torch.Tensor:
    """Square roots of the eigenvalues of symmetric PSD k (c, m, m), descending, (c, m)."""
    return torch.linalg.eigvalsh(_sym(k)).flip(-1).clamp_min(0).sqrt()


def _sym(k: torch.Tensor) -> torch.Tensor:
    """The symmetric part of k (..., m, m): a sandwich X G X^T is symmetric up to rounding."""
    return (k + k.mT) / 2


def _chunk_gram(
    wq_prev: torch.Tensor,
    wk_prev: torch.Tensor,
    wq: torch.Tensor,
    wk: torch.Tensor,
    *,
    directions: bool,
    gram_dtype: torch.dtype,
    delta1: bool = True,
) -> BatchedQKSpectra:
    """One chunk (c, d, d_h) through Grams (``gram_dtype``) and float64 eigh/eigvalsh."""
    d, dh = wq.shape[-2], wq.shape[-1]
    dtype = wq.dtype
    dq, dk = wq - wq_prev, wk - wk_prev  # (c, d, d_h)
    zero_q, zero_k = _is_zero(dq), _is_zero(dk)  # (c,)
    g_a = _gram(dq, wq_prev, gram_dtype)  # (c, 2dh, 2dh) Gram of A = [dW_q, W_q]
    g_b = _gram(dk, wk_prev, gram_dtype)  # (c, 2dh, 2dh) Gram of B' = [dW_k, W_k]
    r_a = _gram_sqrt(g_a)  # (c, 2dh, 2dh), R_A^T R_A = G_A
    perm = torch.arange(2 * dh, device=g_b.device).roll(dh)  # [dh .. 2dh-1, 0 .. dh-1]
    g_s = g_b[:, perm][:, :, perm]  # Gram of B_s = [W_k, dW_k]
    g_bd, g_bx, g_bw = g_b[:, :dh, :dh], g_b[:, :dh, dh:], g_b[:, dh:, dh:]
    k2 = r_a @ g_s @ r_a.mT  # (c, 2dh, 2dh): eigenvalues = s(Delta_2)^2
    r_q = r_a[..., :dh]  # (c, 2dh, dh): R_q^T R_q = dW_q^T dW_q
    k3 = r_q @ g_bd @ r_q.mT  # s(Delta_3)^2, rank <= d_h
    g_ad, g_ax, g_aw = g_a[:, :dh, :dh], g_a[:, :dh, dh:], g_a[:, dh:, dh:]
    g_wq = g_ad + g_ax + g_ax.mT + g_aw  # Gram of W_q' = dW_q + W_q, (c, dh, dh)
    both = zero_q & zero_k
    direction = None
    if directions:
        lam, y = torch.linalg.eigh(_sym(k2))  # ascending; y[..., -1] is the top eigenvector
        s2 = lam.flip(-1).clamp_min(0).sqrt()
        w = g_s @ r_a.mT @ y[..., -1:]  # (c, 2dh, 1): A w = s_1^2 u_1
        direction = _unit(_apply(dq, wq_prev, w.squeeze(-1)), both)
    else:
        s2 = _sqrt_eigvals_desc(k2)
    spectrum1 = None
    if delta1:
        # Delta_1 = A [W_k', dW_k]^T and [W_k', dW_k] = B' M, M = [[I, I], [I, 0]].
        g_1 = torch.cat(
            [
                torch.cat([g_bd + g_bx + g_bx.mT + g_bw, g_bd + g_bx.mT], dim=-1),
                torch.cat([g_bd + g_bx, g_bd], dim=-1),
            ],
            dim=-2,
        )  # M^T G_B M, (c, 2dh, 2dh)
        k1 = r_a @ g_1 @ r_a.mT  # s(Delta_1)^2
        spectrum1 = _trim(_sqrt_eigvals_desc(k1).to(dtype), (d, d), both)
    delta2 = _trim(s2.to(dtype), (d, d), both)
    delta3 = _trim(_sqrt_eigvals_desc(k3)[..., :dh].to(dtype), (d, d), zero_q | zero_k)
    dwq = _trim(_sqrt_eigvals_desc(g_ad).to(dtype), (d, dh), zero_q)
    dwk = _trim(_sqrt_eigvals_desc(g_bd).to(dtype), (d, dh), zero_k)
    wq_norm = _sqrt_eigvals_desc(g_wq)[..., 0].to(dtype)
    return BatchedQKSpectra(spectrum1, delta2, delta3, dwq, dwk, wq_norm, direction)
