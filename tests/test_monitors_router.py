"""Router monitors against brute-force references."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from agent.monitors import (
    router_conditioning_ratio,
    router_similarity,
    routing_entropy,
    routing_load,
    routing_stats,
)

SETTINGS = settings(max_examples=40, deadline=None)


def _pairwise_cosine_mean(w: np.ndarray) -> float:
    e = w.shape[0]
    norms = np.linalg.norm(w, axis=1)
    total = 0.0
    for i in range(e):
        for j in range(e):
            if i != j and norms[i] > 0 and norms[j] > 0:
                total += float(w[i] @ w[j] / (norms[i] * norms[j]))
    return total / (e * (e - 1))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(2, 16), st.integers(1, 32), st.floats(0.0, 3.0))
def test_similarity_and_eps_match_brute_force(seed, e, d, offset):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, d, generator=g, dtype=torch.float64) + offset  # shared offset: redundant
    sim = float(router_similarity(w))
    assert math.isclose(sim, _pairwise_cosine_mean(w.numpy()), rel_tol=1e-9, abs_tol=1e-12)
    wn = w.numpy()
    mean = wn.mean(axis=0)
    eps_ref = np.max(np.linalg.norm(wn - mean, axis=1)) / np.linalg.norm(mean)
    assert math.isclose(float(router_conditioning_ratio(w)), eps_ref, rel_tol=1e-9)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(2, 12), st.integers(2, 24), st.floats(0.01, 0.9))
def test_cosine_bound_from_eps(seed, e, d, spread):
    """For eps < 1 every pairwise cosine is at least 1 - 2 eps^2."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(d, generator=g, dtype=torch.float64)
    w = common + spread * common.norm() * torch.randn(e, d, generator=g, dtype=torch.float64) / d
    eps = float(router_conditioning_ratio(w))
    if eps >= 1:
        return
    unit = w / w.norm(dim=1, keepdim=True)
    cos = unit @ unit.T
    assert float(cos.min()) >= 1 - 2 * eps**2 - 1e-12


def test_eps_is_scale_invariant_and_batched():
    w = torch.randn(3, 8, 16, dtype=torch.float64) + 1.0  # three routers
    eps = router_conditioning_ratio(w)
    assert eps.shape == (3,)
    assert torch.allclose(router_conditioning_ratio(7.5 * w), eps, rtol=1e-12)
    assert torch.allclose(router_conditioning_ratio(1e-3 * w), eps, rtol=1e-12)
    assert router_similarity(w).shape == (3,)


def test_router_edge_cases_are_defined():
    assert float(router_conditioning_ratio(torch.zeros(4, 8))) == 0.0  # all rows equal (zero)
    same = torch.ones(4, 8)
    assert float(router_conditioning_ratio(same)) == 0.0
    assert math.isclose(float(router_similarity(same)), 1.0, rel_tol=1e-6)
    centred = torch.tensor([[1.0, 0.0], [-1.0, 0.0]])  # mean row is zero
    assert float(router_conditioning_ratio(centred)) == math.inf
    assert float(router_similarity(centred)) == -1.0
    with_zero_row = torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 0.0]])
    assert math.isclose(
        float(router_similarity(with_zero_row)),
        _pairwise_cosine_mean(with_zero_row.numpy()),
        rel_tol=1e-6,
    )
    assert float(router_similarity(torch.zeros(3, 4))) == 0.0
    with pytest.raises(ValueError, match="E >= 2"):
        router_conditioning_ratio(torch.ones(1, 8))
    with pytest.raises(ValueError, match="E >= 2"):
        router_similarity(torch.ones(8))


def test_uniform_router_has_entropy_ln_e():
    for e in (2, 8, 64):
        ent = routing_entropy(torch.zeros(100, e))
        assert math.isclose(float(ent.mean), math.log(e), rel_tol=1e-6)
        assert math.isclose(float(ent.normalized), 1.0, rel_tol=1e-6)
        assert math.isclose(float(ent.p10), math.log(e), rel_tol=1e-6)


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 300), st.integers(2, 16), st.floats(0.1, 20.0))
def test_routing_entropy_matches_numpy(seed, n, e, temperature):
    g = torch.Generator().manual_seed(seed)
    z = temperature * torch.randn(n, e, generator=g, dtype=torch.float64)
    ent = routing_entropy(z)
    zn = z.numpy()
    p = np.exp(zn - zn.max(axis=1, keepdims=True))
    p /= p.sum(axis=1, keepdims=True)
    h = -np.sum(np.where(p > 0, p * np.log(np.where(p > 0, p, 1.0)), 0.0), axis=1)
    assert math.isclose(float(ent.mean), h.mean(), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(float(ent.normalized), h.mean() / math.log(e), rel_tol=1e-9, abs_tol=1e-12)
    assert math.isclose(float(ent.p10), float(np.quantile(h, 0.1)), rel_tol=1e-9, abs_tol=1e-12)


def test_routing_entropy_flattens_tokens_and_handles_masked_experts():
    z = torch.randn(4, 25, 8)  # (batch, seq, E)
    assert math.isclose(
        float(routing_entropy(z).mean), float(routing_entropy(z.reshape(100, 8)).mean), rel_tol=1e-6
    )
    masked = torch.tensor([[0.0, 0.0, -math.inf, -math.inf]])
    ent = routing_entropy(masked)
    assert math.isclose(float(ent.mean), math.log(2), rel_tol=1e-6)
    with pytest.raises(ValueError, match="no tokens"):
        routing_entropy(torch.zeros(0, 4))


@SETTINGS
@given(st.integers(0, 2**31 - 1), st.integers(1, 200), st.integers(2, 12), st.data())
def test_routing_load_matches_brute_force(seed, n, e, data):
    top_k = data.draw(st.integers(1, e))
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, e, generator=g, dtype=torch.float64)
    out = routing_load(z, top_k)
    p = torch.softmax(z, dim=-1).numpy()
    counts = np.zeros(e)
    margins = []
    for row in p:
        order = np.argsort(-row, kind="stable")
        counts[order[:top_k]] += 1
        margins.append(row[order[0]] - row[order[1]])
    load = counts / (n * top_k)
    assert np.allclose(out.load.numpy(), load, rtol=0, atol=1e-12)
    assert math.isclose(float(out.max_load), load.max(), rel_tol=1e-12)
    nz = load[load > 0]
    assert math.isclose(float(out.load_entropy), float(-(nz * np.log(nz)).sum()), abs_tol=1e-12)
    assert math.isclose(float(out.margin), float(np.mean(margins)), rel_tol=1e-9, abs_tol=1e-12)
    assert int(out.dead_experts) == int((counts == 0).sum())


def test_collapsed_router_has_dead_experts_and_low_entropy():
    z = torch.zeros(50, 8)
    z[:, 3] = 30.0  # every token goes to expert 3
    load = routing_load(z, top_k=1)
    assert int(load.dead_experts) == 7
    assert float(load.max_load) == 1.0
    assert float(load.load_entropy) == 0.0
    assert float(routing_entropy(z).mean) < 1e-9
    with pytest.raises(ValueError, match="top_k"):
        routing_load(z, top_k=9)


@pytest.mark.parametrize("seed", [0, 1, 2, 84, 231])
def test_routing_stats_equals_the_two_monitors(seed):
    g = torch.Generator().manual_seed(seed)
    z = 3.0 * torch.randn(777, 16, dtype=torch.float64, generator=g)
    ent, load = routing_stats(z, top_k=4)
    for got, ref in zip(ent, routing_entropy(z), strict=True):
        assert torch.equal(got, ref)
    for got, ref in zip(load, routing_load(z, 4), strict=True):
        # The fused margin sums in another order: equal to the last bits of a float64.
        torch.testing.assert_close(got, ref, rtol=0, atol=4e-16)
