"""``qk_monitor_spectra_batched`` against dense float64 references and the head-by-head path.

Tolerances, relative to the largest singular value s_max of each spectrum:

- ``qr``: thin Householder QR is column-wise backward stable, so every value has an absolute
  error of a small multiple of eps * s_max: 1e-12 in float64; 1e-5 in float32 (eps32 * d =
  5.7e-6 at d = 48 is also the cut-off below which float32 values are set to zero, so a true
  value just under it comes back as 0: the tolerance must cover it).
- ``gram``: a Gram squares the condition number; what it gets right is s^2 to a small multiple
  of eps * s_max^2 (so a value s has an error of about eps * s_max^2 / s, and values under
  sqrt(eps) * s_max are noise). Checked as |s^2 - s_ref^2| <= 1e-13 s_max^2 in float64 and
  1e-5 s_max^2 in float32 (d * eps32 = 5.7e-6, with the same cut-off margin as above).
  Delta_3 = dW_q dW_k^T is formed from the Grams of its own two factors, so its s^2 error is
  relative to (||dW_q|| ||dW_k||)^2, which exceeds s_max(Delta_3)^2 when the two updates
  nearly cancel in the product (rank-1 updates whose d_h-directions are nearly orthogonal:
  s_max 1.7e-15 against ||dW_q|| ||dW_k|| 1e-12 gave an s^2 error of 2e-10 s_max^2, that is
  6e-16 of the factors' scale); the check uses the factors' scale for Delta_3.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from agent.monitors import (
    qk_delta2_direction,
    qk_monitor_spectra,
    qk_monitor_spectra_batched,
    spectrum_stats,
)
from agent.monitors.batched import _tf32_possible

METHODS = ("qr", "gram")
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device"),
    ),
]
D, DH = 48, 8


def _factors(
    seed: int,
    n: int,
    d: int = D,
    dh: int = DH,
    *,
    rank_q: int | None = None,
    rank_k: int | None = None,
    scale: float = 1e-3,
    dtype: torch.dtype = torch.float64,
    device: str = "cpu",
    kv_groups: int | None = None,
) -> list[torch.Tensor]:
    """(wq_prev, wk_prev, wq, wk), each (n, d, dh): W of norm ~1, updates ``scale`` times that.

    ``rank_q``/``rank_k``: rank of the update (None: full rank, 0: exactly zero).
    ``kv_groups``: GQA, the key factors (and their updates) shared by n / kv_groups heads.
    """
    g = torch.Generator().manual_seed(seed)

    def update(rank: int | None, heads: int) -> torch.Tensor:
        if rank == 0:
            return torch.zeros(heads, d, dh, dtype=torch.float64)
        if rank is None:
            return scale * torch.randn(heads, d, dh, generator=g, dtype=torch.float64) / d**0.5
        left = torch.randn(heads, d, rank, generator=g, dtype=torch.float64) / d**0.5
        right = torch.randn(heads, rank, dh, generator=g, dtype=torch.float64) / rank**0.5
        return scale * left @ right

    wq = torch.randn(n, d, dh, generator=g, dtype=torch.float64) / d**0.5
    dq = update(rank_q, n)
    if kv_groups is None:
        wk = torch.randn(n, d, dh, generator=g, dtype=torch.float64) / d**0.5
        dk = update(rank_k, n)
    else:
        per_group = n // kv_groups
        wk = torch.randn(kv_groups, d, dh, generator=g, dtype=torch.float64) / d**0.5
        dk = update(rank_k, kv_groups)
        wk, dk = wk.repeat_interleave(per_group, 0), dk.repeat_interleave(per_group, 0)
    out = [wq, wk, wq + dq, wk + dk]
    return [t.to(dtype=dtype, device=device) for t in out]


def _dense_reference(wq0, wk0, wq1, wk1) -> dict[str, torch.Tensor]:
    """Every spectrum from materialized d x d matrices, in float64, on the CPU."""
    wq0, wk0, wq1, wk1 = (t.double().cpu() for t in (wq0, wk0, wq1, wk1))
    dq, dk = wq1 - wq0, wk1 - wk0
    delta2 = dq @ wk0.mT + wq0 @ dk.mT
    u, _, _ = torch.linalg.svd(delta2)
    return {
        "delta1": torch.linalg.svdvals(delta2 + dq @ dk.mT),  # no cancellation of W W^T
        "delta2": torch.linalg.svdvals(delta2),
        "delta3": torch.linalg.svdvals(dq @ dk.mT),
        "dwq": torch.linalg.svdvals(dq),
        "dwk": torch.linalg.svdvals(dk),
        "wq_norm": torch.linalg.svdvals(wq1)[..., 0],
        "direction": u[..., :, 0],
    }


def _tolerance(method: str, dtype: torch.dtype) -> float:
    if method == "qr":
        return 1e-12 if dtype == torch.float64 else 1e-5
    return 1e-13 if dtype == torch.float64 else 1e-5


def _assert_close(
    ours: torch.Tensor,
    ref: torch.Tensor,
    method: str,
    dtype,
    name: str,
    factor_scale: torch.Tensor | None = None,
) -> None:
    """ours (..., k) against the dense reference (..., m >= k), per the module docstring.
    ``factor_scale`` (...,): where the Gram route's error is relative to the product of the
    factors' norms rather than to s_max (Delta_3, module docstring)."""
    ours = ours.double().cpu()
    if ours.ndim == 1:  # wq_norm
        ours, ref = ours.unsqueeze(-1), ref.unsqueeze(-1)
    k = ours.shape[-1]
    scale = ref[..., :1]
    exact_zero = (scale == 0).squeeze(-1)
    if method == "gram" and factor_scale is not None:
        scale = torch.maximum(scale, factor_scale.unsqueeze(-1))
    assert bool((ours[exact_zero] == 0).all()), f"{name}: a zero spectrum came back non-zero"
    assert bool((ours >= 0).all()) and bool(torch.isfinite(ours).all()), name
    ours, ref, scale = ours[~exact_zero], ref[~exact_zero], scale[~exact_zero]
    if ours.numel() == 0:
        return
    tol = _tolerance(method, dtype)
    if method == "qr":
        err = ((ours - ref[..., :k]).abs() / scale).max()
    else:
        err = ((ours.square() - ref[..., :k].square()).abs() / scale.square()).max()
    assert float(err) <= tol, f"{name}: {float(err):.3g} > {tol:.3g}"
    if ref.shape[-1] > k:  # beyond the core size the dense spectrum is zero too
        assert float((ref[..., k:] / scale).max()) <= 1e-10


def _assert_matches_dense(out, factors, method: str, dtype) -> None:
    ref = _dense_reference(*factors)
    for name in ("delta1", "delta2", "delta3", "dwq", "dwk", "wq_norm"):
        factor_scale = ref["dwq"][..., 0] * ref["dwk"][..., 0] if name == "delta3" else None
        _assert_close(getattr(out, name), ref[name], method, dtype, name, factor_scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("n", "chunk_size"), [(7, 3), (2, 32), (6, 6), (5, 1)])
def test_matches_dense_float64(device, method, dtype, n, chunk_size) -> None:
    factors = _factors(n, n, dtype=dtype, device=device)
    out = qk_monitor_spectra_batched(*factors, chunk_size=chunk_size, method=method)
    assert out.direction is None
    assert out.delta2.shape == (n, 2 * DH) and out.delta3.shape == (n, DH)
    assert out.wq_norm.shape == (n,)
    assert all(t.dtype == dtype and t.device.type == device for t in out.spectra())
    _assert_matches_dense(out, factors, method, dtype)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_same_values_as_head_by_head(method, dtype) -> None:
    factors = _factors(1, 5, dtype=dtype)
    ours = qk_monitor_spectra_batched(*factors, chunk_size=2, method=method)
    theirs = qk_monitor_spectra(*factors)
    for name, a, b in zip(theirs._fields, ours.spectra(), theirs, strict=True):
        scale = b.amax(dim=-1, keepdim=True) if b.ndim > 1 else b
        err = float(((a.double() - b.double()).abs() / scale.double()).max())
        if method == "qr":
            tol = 1e-13 if dtype == torch.float64 else 1e-5
        else:  # a Gram resolves values down to about sqrt(eps) * s_max
            tol = 1e-7 if dtype == torch.float64 else 1e-3
        assert err <= tol, (name, err)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize(("rank_q", "rank_k"), [(0, None), (None, 0), (0, 0), (2, 1), (0, 3)])
def test_zero_and_low_rank_updates(method, dtype, rank_q, rank_k) -> None:
    factors = _factors(2, 5, rank_q=rank_q, rank_k=rank_k, scale=1e-2, dtype=dtype)
    out = qk_monitor_spectra_batched(*factors, chunk_size=4, method=method, directions=True)
    _assert_matches_dense(out, factors, method, dtype)
    if rank_q == 0:
        assert bool((out.dwq == 0).all()) and bool((out.delta3 == 0).all())
    if rank_k == 0:
        assert bool((out.dwk == 0).all()) and bool((out.delta3 == 0).all())
    if rank_q == 0 and rank_k == 0:
        for t in (out.delta1, out.delta2, out.direction):
            assert bool((t == 0).all())
    else:
        norms = torch.linalg.vector_norm(out.direction.double(), dim=-1)
        assert float((norms - 1).abs().max()) < 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_all_zero_factors_give_zeros_not_nan(method) -> None:
    zeros = [torch.zeros(3, D, DH) for _ in range(4)]
    out = qk_monitor_spectra_batched(*zeros, chunk_size=2, method=method, directions=True)
    for t in out:
        assert bool((t == 0).all())


@pytest.mark.parametrize("method", METHODS)
def test_rank_deficient_weights(method) -> None:
    """W_q with zero columns and W_k of rank 2: singular Grams, still exact and finite."""
    wq0, wk0, wq1, wk1 = _factors(3, 4, scale=1e-2)
    wq0[..., :3] = 0
    wq1[..., :3] = 0
    low = torch.randn(4, D, 2, dtype=torch.float64) @ torch.randn(4, 2, DH, dtype=torch.float64)
    wk1 = wk1 - wk0 + low / D
    wk0 = low / D
    factors = [wq0, wk0, wq1, wk1]
    out = qk_monitor_spectra_batched(*factors, chunk_size=3, method=method)
    _assert_matches_dense(out, factors, method, torch.float64)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_gqa_shared_key_factors(method, dtype) -> None:
    factors = _factors(4, 8, dtype=dtype, kv_groups=2)
    assert torch.equal(factors[1][0], factors[1][3]) and torch.equal(factors[3][4], factors[3][7])
    out = qk_monitor_spectra_batched(*factors, chunk_size=3, method=method)
    _assert_matches_dense(out, factors, method, dtype)
    # Heads of one KV group share dW_k exactly.
    assert torch.allclose(out.dwk[0], out.dwk[3], rtol=1e-6, atol=0)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_directions_agree_with_qk_delta2_direction(method, dtype) -> None:
    factors = _factors(5, 7, dtype=dtype)
    out = qk_monitor_spectra_batched(*factors, chunk_size=3, method=method, directions=True)
    assert out.direction.shape == (7, D) and out.direction.dtype == dtype
    theirs = qk_delta2_direction(*(t.double() for t in factors))
    dense = _dense_reference(*factors)["direction"]
    bound = 1e-6 if dtype == torch.float64 else 1e-4
    for ref in (theirs, dense):
        cos = (out.direction.double() * ref).sum(dim=-1).abs()
        assert float((1 - cos).max()) < bound, float((1 - cos).max())
    # The spectra are the same with or without the direction.
    plain = qk_monitor_spectra_batched(*factors, chunk_size=3, method=method)
    for a, b in zip(out.spectra(), plain.spectra(), strict=True):
        assert torch.allclose(a, b, rtol=1e-5 if dtype == torch.float32 else 1e-12, atol=0)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("directions", [False, True])
def test_every_linalg_call_sees_chunk_size_heads(monkeypatch, device, method, directions) -> None:
    """Wrap the batched torch.linalg solvers and record the batch size of every call."""
    batches: list[tuple[str, tuple[int, ...]]] = []
    for name in ("qr", "svd", "svdvals", "eigh", "eigvalsh"):
        original = getattr(torch.linalg, name)

        def wrapped(a, *args, _name=name, _original=original, **kwargs):
            batches.append((_name, tuple(a.shape[:-2])))
            return _original(a, *args, **kwargs)

        monkeypatch.setattr(torch.linalg, name, wrapped)
    factors = _factors(6, 7, device=device)
    out = qk_monitor_spectra_batched(*factors, chunk_size=3, method=method, directions=directions)
    monkeypatch.undo()
    assert out.delta2.shape[0] == 7
    chunks = 3  # ceil(7 / 3)
    per_chunk = {"qr": 8, "gram": 7}[method]  # qr: 2 QRs + 6 SVDs; gram: 1 eigh + 6 eigvalsh
    assert len(batches) == chunks * per_chunk, batches
    assert {shape for _, shape in batches} == {(3,)}, batches
    used = {name for name, _ in batches}
    if method == "qr":
        assert "qr" in used and ("svd" in used) == directions
    else:
        assert "qr" not in used and "eigh" in used


@pytest.mark.parametrize("method", METHODS)
def test_without_delta1_the_other_values_are_unchanged(method) -> None:
    """``delta1=False`` (what the agent asks for with its default orders 2 and 3) skips
    Delta_1 only: every other field is the same tensor value as with it."""
    factors = _factors(9, 5, dtype=torch.float32)
    full = qk_monitor_spectra_batched(*factors, chunk_size=2, method=method, directions=True)
    lean = qk_monitor_spectra_batched(
        *factors, chunk_size=2, method=method, directions=True, delta1=False
    )
    assert lean.delta1 is None
    for name in ("delta2", "delta3", "dwq", "dwk", "wq_norm", "direction"):
        assert torch.equal(getattr(lean, name), getattr(full, name)), name
    with pytest.raises(ValueError, match="Delta_1"):
        lean.spectra()


def test_leading_dimensions_are_kept() -> None:
    factors = [t.reshape(2, 3, D, DH) for t in _factors(7, 6)]
    out = qk_monitor_spectra_batched(*factors, chunk_size=4, directions=True)
    assert out.delta1.shape == (2, 3, 2 * DH) and out.wq_norm.shape == (2, 3)
    assert out.direction.shape == (2, 3, D)
    flat = qk_monitor_spectra_batched(
        *(t.reshape(6, D, DH) for t in factors), chunk_size=4, directions=True
    )
    assert torch.equal(out.delta2.reshape(6, -1), flat.delta2)
    assert torch.equal(out.direction.reshape(6, -1), flat.direction)


def test_invalid_arguments() -> None:
    factors = _factors(8, 2)
    with pytest.raises(ValueError, match="chunk_size"):
        qk_monitor_spectra_batched(*factors, chunk_size=0)
    with pytest.raises(ValueError, match="method"):
        qk_monitor_spectra_batched(*factors, method="svd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one dtype"):
        qk_monitor_spectra_batched(*factors[:3], factors[3].float())
    with pytest.raises(ValueError, match="d >= 2 d_h"):
        qk_monitor_spectra_batched(*(t[:, :10] for t in factors))
    with pytest.raises(ValueError, match="gram_dtype"):
        qk_monitor_spectra_batched(*factors, method="gram", gram_dtype=torch.float16)
    assert _tf32_possible(torch.device("cpu")) is False


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", [1e-3, 1e-6])
def test_float32_entropy_close_to_float64(method, scale) -> None:
    """The statistics the monitors use, from float32 factors, against float64 exact values.

    d = 256, d_h = 32, realistic scales: the alpha = 2 entropy of every spectrum within 1e-4
    nats, stable rank within 1e-3 relative, Frobenius norm within 1e-5 relative.
    """
    factors = _factors(9, 3, d=256, dh=32, scale=scale, dtype=torch.float32)
    out = qk_monitor_spectra_batched(*factors, chunk_size=2, method=method)
    ref = qk_monitor_spectra(*(t.double() for t in factors))
    for name in ("delta1", "delta2", "delta3", "dwq", "dwk"):
        ours = spectrum_stats(getattr(out, name).double())
        exact = spectrum_stats(getattr(ref, name))
        assert float((ours.entropy - exact.entropy).abs().max()) < 1e-4, name
        rel = (ours.stable_rank - exact.stable_rank).abs() / exact.stable_rank
        assert float(rel.max()) < 1e-3, name
        rel = (ours.frobenius - exact.frobenius).abs() / exact.frobenius
        assert float(rel.max()) < 1e-5, name


def test_gram_in_float64_for_float32_inputs() -> None:
    """gram_dtype=float64 resolves s^2 to float64 precision: only the output is rounded."""
    factors = _factors(10, 3, scale=1e-6, dtype=torch.float32)
    out = qk_monitor_spectra_batched(*factors, method="gram", gram_dtype=torch.float64)
    ref = _dense_reference(*factors)
    for name in ("delta1", "delta2", "dwq", "wq_norm"):
        ours, exact = getattr(out, name).double(), ref[name]
        if ours.ndim == 1:
            ours, exact = ours.unsqueeze(-1), exact.unsqueeze(-1)
        k = ours.shape[-1]
        err = (ours - exact[..., :k]).abs() / exact[..., :1]
        # float32 rounding of the output plus the float32 cut-off (eps32 * d = 5.7e-6).
        assert float(err.max()) < 6e-6, (name, float(err.max()))


@pytest.mark.parametrize("method", METHODS)
def test_tf32_guard_paths(monkeypatch, method) -> None:
    """Where TF32 could round float32 matmuls, the float64 fallbacks give the same results."""
    import agent.monitors.batched as batched

    factors = _factors(11, 5, dtype=torch.float32)
    plain = qk_monitor_spectra_batched(*factors, chunk_size=2, method=method, directions=True)
    monkeypatch.setattr(batched, "_tf32_possible", lambda device: True)
    guarded = qk_monitor_spectra_batched(*factors, chunk_size=2, method=method, directions=True)
    _assert_matches_dense(guarded, factors, method, torch.float32)
    cos = (guarded.direction.double() * plain.direction.double()).sum(dim=-1).abs()
    assert float((1 - cos).max()) < 1e-5


SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(1, 5),
    chunk_size=st.integers(1, 4),
    dh=st.integers(1, 8),
    extra=st.integers(0, 10),
    rank_q=st.one_of(st.none(), st.integers(0, 8)),
    rank_k=st.one_of(st.none(), st.integers(0, 8)),
    scale=st.sampled_from([1e-6, 1e-3, 1.0]),
    method=st.sampled_from(METHODS),
)
@example(  # rank-1 updates nearly orthogonal in the product (module docstring, Delta_3)
    seed=0, n=3, chunk_size=1, dh=4, extra=4, rank_q=1, rank_k=1, scale=1e-6, method="gram"
)
def test_property_matches_dense(seed, n, chunk_size, dh, extra, rank_q, rank_k, scale, method):
    d = 2 * dh + extra
    rank_q = None if rank_q is None else min(rank_q, dh)
    rank_k = None if rank_k is None else min(rank_k, dh)
    factors = _factors(seed, n, d, dh, rank_q=rank_q, rank_k=rank_k, scale=scale)
    out = qk_monitor_spectra_batched(*factors, chunk_size=chunk_size, method=method)
    _assert_matches_dense(out, factors, method, torch.float64)
    assert math.isfinite(float(out.delta2.sum()))
