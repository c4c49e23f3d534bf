"""The spectral monitors against dense float64 references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agent.monitors import (
    qk_delta2_direction,
    qk_increment_spectrum,
    qk_monitor_spectra,
    spectrum_stats,
    update_spectrum,
)

SETTINGS = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _factors(seed: int, batch: int, d: int, dh: int, rank_q: int, rank_k: int, scale: float, dtype):
    """Factors (batch, d, dh) and updates of chosen rank (0 = zero update)."""
    g = torch.Generator().manual_seed(seed)

    def low_rank(rank: int) -> torch.Tensor:
        if rank == 0:
            return torch.zeros(batch, d, dh, dtype=torch.float64)
        left = torch.randn(batch, d, rank, generator=g, dtype=torch.float64)
        right = torch.randn(batch, rank, dh, generator=g, dtype=torch.float64)
        return scale * left @ right / math.sqrt(rank)

    wq = torch.randn(batch, d, dh, generator=g, dtype=torch.float64)
    wk = torch.randn(batch, d, dh, generator=g, dtype=torch.float64)
    return (
        wq.to(dtype),
        wk.to(dtype),
        (wq + low_rank(rank_q)).to(dtype),
        (wk + low_rank(rank_k)).to(dtype),
    )


def _dense(wq0, wk0, wq1, wk1, order: int) -> torch.Tensor:
    """Materialized d x d increment in float64 from the (possibly fp32) factors."""
    wq0, wk0, wq1, wk1 = (t.double() for t in (wq0, wk0, wq1, wk1))
    dq, dk = wq1 - wq0, wk1 - wk0
    if order == 1:
        return wq1 @ wk1.mT - wq0 @ wk0.mT
    if order == 2:
        return dq @ wk0.mT + wq0 @ dk.mT
    return dq @ dk.mT


def _assert_spectrum_matches(ours: torch.Tensor, dense: torch.Tensor, rtol: float) -> None:
    ref = torch.linalg.svdvals(dense)  # (..., d) float64
    k = ours.shape[-1]
    exact_zero = ref[..., 0] == 0
    assert bool((ours[exact_zero] == 0).all())
    scale = ref[..., :1].clamp_min(1e-300)
    ref, ours, scale = ref[~exact_zero], ours[~exact_zero], scale[~exact_zero]
    if ours.numel() == 0:
        return
    err = (ours.double() - ref[..., :k]).abs() / scale
    assert float(err.max()) <= rtol, float(err.max())
    # Everything beyond the core size is zero in the dense reference too.
    if ref.shape[-1] > k:
        assert float((ref[..., k:] / scale).max()) <= 1e-10


shapes = st.tuples(
    st.integers(0, 2**31 - 1),  # seed
    st.integers(1, 3),  # batch
    st.integers(2, 48),  # d
    st.integers(1, 12),  # d_h
    st.integers(0, 12),  # rank of dW_q (clipped to d_h)
    st.integers(0, 12),  # rank of dW_k
    st.sampled_from([1e-3, 0.1, 1.0]),  # update scale
)


@SETTINGS
@given(shapes, st.sampled_from([1, 2, 3]))
def test_qk_increment_spectrum_equals_dense_svd_float64(shape, order):
    seed, batch, d, dh, rq, rk, scale = shape
    f = _factors(seed, batch, d, dh, min(rq, dh), min(rk, dh), scale, torch.float64)
    ours = qk_increment_spectrum(*f, order=order)
    assert ours.dtype == torch.float64
    assert ours.shape == (batch, min(d, dh if order == 3 else 2 * dh))
    _assert_spectrum_matches(ours, _dense(*f, order), rtol=1e-9)
    # Same spectrum statistics as the dense spectrum (tiny values dropped in both).
    ours_h = spectrum_stats(ours, shape=(d, d)).entropy
    dense_h = spectrum_stats(torch.linalg.svdvals(_dense(*f, order)), shape=(d, d)).entropy
    assert torch.allclose(ours_h, dense_h, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(shapes, st.sampled_from([1, 2, 3]))
def test_qk_increment_spectrum_float32_within_1e4(shape, order):
    seed, batch, d, dh, rq, rk, scale = shape
    f = _factors(seed, batch, d, dh, min(rq, dh), min(rk, dh), max(scale, 0.1), torch.float32)
    ours = qk_increment_spectrum(*f, order=order)
    assert ours.dtype == torch.float32
    _assert_spectrum_matches(ours, _dense(*f, order), rtol=1e-4)


def test_order1_is_delta2_plus_delta3():
    f = _factors(3, 2, 40, 6, 6, 6, 0.5, torch.float64)
    dense = _dense(*f, 2) + _dense(*f, 3)
    _assert_spectrum_matches(qk_increment_spectrum(*f, order=1), dense, rtol=1e-9)


def test_zero_update_gives_zero_spectrum_and_defined_stats():
    wq = torch.randn(2, 32, 4, dtype=torch.float64)
    wk = torch.randn(2, 32, 4, dtype=torch.float64)
    for order in (1, 2, 3):
        s = qk_increment_spectrum(wq, wk, wq.clone(), wk.clone(), order=order)
        assert torch.count_nonzero(s) == 0
        stats = spectrum_stats(s)
        for field in stats:
            assert torch.equal(field, torch.zeros(2, dtype=torch.float64))


@SETTINGS
@given(shapes)
def test_update_spectrum_equals_dense_svd(shape):
    seed, batch, d, dh, rq, _, scale = shape
    wq0, _, wq1, _ = _factors(seed, batch, d, dh, min(rq, dh), 0, scale, torch.float64)
    ours = update_spectrum(wq0, wq1)
    assert ours.shape == (batch, min(d, dh))
    ref = torch.linalg.svdvals(wq1 - wq0)
    tol = 1e-9 * ref[..., :1].clamp_min(1e-300)
    assert bool(((ours - ref).abs() <= tol).all())


def test_shared_rotation_of_head_basis_leaves_spectra_unchanged():
    wq0, wk0, wq1, wk1 = _factors(7, 3, 64, 8, 3, 5, 0.3, torch.float64)
    rot, _ = torch.linalg.qr(torch.randn(8, 8, dtype=torch.float64))  # orthogonal (d_h, d_h)
    for order in (1, 2, 3):
        a = qk_increment_spectrum(wq0, wk0, wq1, wk1, order=order)
        b = qk_increment_spectrum(wq0 @ rot, wk0 @ rot, wq1 @ rot, wk1 @ rot, order=order)
        assert torch.allclose(a, b, rtol=1e-10, atol=1e-12 * float(a.max()))


def _entropy_numpy(s: np.ndarray, alpha: float, rtol: float) -> float:
    s = np.abs(s)
    if s.max() == 0:
        return 0.0
    s = s[s > rtol * s.max()] / s.max()  # scale-free (and no underflow of s**alpha)
    p = s**alpha / np.sum(s**alpha)
    return float(-np.sum(p * np.log(p)))


@SETTINGS
@given(
    st.lists(st.floats(0, 1e6, allow_nan=False), min_size=1, max_size=30),
    st.sampled_from([0.5, 1.0, 2.0, 3.0]),
)
def test_spectrum_stats_matches_numpy(values, alpha):
    s = torch.tensor(values, dtype=torch.float64)
    k = len(values)
    stats = spectrum_stats(s, alpha=alpha)
    rtol = np.finfo(np.float64).eps * k
    expected = _entropy_numpy(np.array(values), alpha, rtol)
    assert math.isclose(float(stats.entropy), expected, rel_tol=1e-9, abs_tol=1e-12)
    arr = np.array(values)
    kept = arr[arr > rtol * arr.max()] if arr.max() > 0 else np.array([])
    frob = float(kept.max() * np.sqrt(np.sum((kept / kept.max()) ** 2))) if kept.size else 0.0
    assert math.isclose(float(stats.frobenius), frob, rel_tol=1e-12, abs_tol=0.0)
    if kept.size:
        assert math.isclose(
            float(stats.stable_rank), np.sum((kept / kept.max()) ** 2), rel_tol=1e-12
        )
        assert math.isclose(float(stats.effective_rank), math.exp(expected), rel_tol=1e-9)
    assert not any(torch.isnan(f).any() for f in stats)


def test_spectrum_stats_known_values_and_batching():
    s = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    stats = spectrum_stats(s)
    assert stats.entropy.shape == (3,)
    assert torch.allclose(stats.entropy, torch.tensor([math.log(4), 0.0, 0.0]))
    assert torch.allclose(stats.effective_rank, torch.tensor([4.0, 1.0, 0.0]))
    assert torch.allclose(stats.stable_rank, torch.tensor([4.0, 1.0, 0.0]))
    assert torch.allclose(stats.frobenius, torch.tensor([2.0, 1.0, 0.0]))
    # Tiny values relative to s_max are dropped (below eps * max(shape) * s_max).
    tiny = spectrum_stats(torch.tensor([1.0, 1e-20], dtype=torch.float64))
    assert float(tiny.entropy) == 0.0
    # Huge values do not overflow.
    huge = spectrum_stats(torch.tensor([1e30, 1e30], dtype=torch.float32))
    assert math.isclose(float(huge.entropy), math.log(2), rel_tol=1e-6)


def test_coherent_low_rank_drift_lowers_entropy_below_isotropic_noise():
    """The property the product rests on: a biased, coherent update collapses H(Delta_2)."""
    g = torch.Generator().manual_seed(0)
    d, dh, heads = 256, 16, 4
    wq = torch.randn(heads, d, dh, generator=g, dtype=torch.float64) / math.sqrt(d)
    wk = torch.randn(heads, d, dh, generator=g, dtype=torch.float64) / math.sqrt(d)
    noise_q = torch.randn(heads, d, dh, generator=g, dtype=torch.float64)
    noise_k = torch.randn(heads, d, dh, generator=g, dtype=torch.float64)
    u = torch.randn(heads, d, 1, generator=g, dtype=torch.float64)
    v = torch.randn(heads, 1, dh, generator=g, dtype=torch.float64)
    drift_q = u @ v  # rank one, the same direction in every step's update
    drift_k = u @ torch.randn(heads, 1, dh, generator=g, dtype=torch.float64)

    def same_norm(x: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return x * (like.norm(dim=(-2, -1), keepdim=True) / x.norm(dim=(-2, -1), keepdim=True))

    eps = 1e-3
    noise_h = spectrum_stats(
        qk_increment_spectrum(wq, wk, wq + eps * noise_q, wk + eps * noise_k)
    ).entropy
    drift_h = spectrum_stats(
        qk_increment_spectrum(
            wq, wk, wq + eps * same_norm(drift_q, noise_q), wk + eps * same_norm(drift_k, noise_k)
        )
    ).entropy
    assert bool((drift_h < 0.5 * noise_h).all()), (drift_h, noise_h)


@pytest.mark.parametrize(
    "args, message",
    [
        ((torch.ones(4, 2, dtype=torch.int64),) * 4, "must be float32 or float64"),
        (
            (torch.ones(4, 2), torch.ones(4, 3), torch.ones(4, 2), torch.ones(4, 2)),
            "factor shapes differ",
        ),
        ((torch.ones(4),) * 4, r"must have shape \(\.\.\., d, d_h\)"),
    ],
)
def test_bad_factor_input_is_a_clear_error(args, message):
    with pytest.raises(ValueError, match=message):
        qk_increment_spectrum(*args)


def test_bad_order_and_alpha():
    w = torch.ones(4, 2)
    with pytest.raises(ValueError, match="order must be 1, 2 or 3"):
        qk_increment_spectrum(w, w, w, w, order=4)
    with pytest.raises(ValueError, match="alpha must be > 0"):
        spectrum_stats(torch.ones(3), alpha=0.0)


@SETTINGS
@given(shapes)
def test_qk_monitor_spectra_equals_the_separate_monitors_and_dense_svd(shape):
    seed, batch, d, dh, rq, rk, scale = shape
    if d < 2 * dh:
        return
    f = _factors(seed, batch, d, dh, min(rq, dh), min(rk, dh), scale, torch.float64)
    got = qk_monitor_spectra(*f)
    for order, values in ((1, got.delta1), (2, got.delta2), (3, got.delta3)):
        _assert_spectrum_matches(values, _dense(*f, order), rtol=1e-9)
    for values, prev, new in ((got.dwq, f[0], f[2]), (got.dwk, f[1], f[3])):
        ref = update_spectrum(prev, new)
        assert torch.allclose(values, ref, rtol=0, atol=1e-9 * float(ref.max().clamp_min(1e-300)))
    assert torch.allclose(got.wq_norm, torch.linalg.matrix_norm(f[2], ord=2), rtol=1e-10)


def test_qk_monitor_spectra_float32_and_shape_check():
    f = _factors(1, 4, 96, 16, 2, 16, 0.1, torch.float32)
    got = qk_monitor_spectra(*f)
    assert got.delta2.dtype == torch.float32 and got.delta2.shape == (4, 32)
    _assert_spectrum_matches(got.delta2, _dense(*f, 2), rtol=1e-4)
    with pytest.raises(ValueError, match="needs d >= 2 d_h"):
        qk_monitor_spectra(*(torch.ones(8, 5),) * 4)


@SETTINGS
@given(seed=st.integers(0, 10_000), d=st.integers(8, 40), dh=st.integers(1, 4))
def test_qk_delta2_direction_is_the_dense_top_left_singular_vector(seed, d, dh):
    wq0, wk0, wq1, wk1 = _factors(seed, 3, d, dh, 2, 2, 0.3, torch.float64)
    direction = qk_delta2_direction(wq0, wk0, wq1, wk1)  # (3, d)
    delta2 = (wq1 - wq0) @ wk0.mT + wq0 @ (wk1 - wk0).mT  # (3, d, d), dense
    u, s, _ = torch.linalg.svd(delta2)
    for i in range(3):
        if s[i, 0] - s[i, 1] < 1e-3 * s[i, 0]:
            continue  # a repeated top singular value has no unique direction
        assert abs(float(direction[i] @ u[i, :, 0])) == pytest.approx(1.0, abs=1e-8)
        assert float(direction[i].norm()) == pytest.approx(1.0, abs=1e-10)


def test_qk_delta2_direction_of_a_zero_update_is_zero():
    wq0, wk0, _, _ = _factors(1, 2, 16, 4, 0, 0, 0.0, torch.float64)
    assert torch.equal(qk_delta2_direction(wq0, wk0, wq0, wk0), torch.zeros(2, 16, dtype=wq0.dtype))
