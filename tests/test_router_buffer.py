"""The buffered router statistics equal those of computing every forward on its own."""

from __future__ import annotations

import math

import pytest
import torch

from agent.monitors import routing_stats
from agent.monitors.router import routing_sums
from agent.router_buffer import RouterLogitBuffer

D, E = 12, 6


def _reference(forwards: list[tuple[torch.Tensor, torch.Tensor]], top_k: int) -> list[float]:
    """Per forward routing_stats of z = x W^T, summed: the five sums, then the load."""
    sums = [0.0] * 5
    load = torch.zeros(E, dtype=torch.float64)
    for x, w in forwards:
        ent, ld = routing_stats(x @ w.T, top_k)
        for i, v in enumerate((ent.mean, ent.normalized, ent.p10, ld.margin, 1.0)):
            sums[i] += float(v)
        load += ld.load.double()
    return sums + load.tolist()


@pytest.mark.parametrize("max_forwards", [1, 3, 64])
def test_sums_equal_per_forward_statistics_across_flushes(max_forwards: int) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(E, D, generator=gen, dtype=torch.float64)
    buffer = RouterLogitBuffer(E, top_k=2, max_forwards=max_forwards)
    forwards = []
    for i in range(7):
        tokens = 9 if i < 4 else 5  # a change of token count starts a new buffer
        x = 3 * torch.randn(tokens, D, generator=gen, dtype=torch.float64)
        w_now = w + 0.1 * i  # the weight moves between forwards: each forward uses its own
        buffer.add(x, w_now, None)
        forwards.append((x, w_now))
    got = buffer.take()
    assert got is not None
    assert got.tolist() == pytest.approx(_reference(forwards, 2), rel=1e-12, abs=1e-12)
    assert buffer.take().tolist() == [0.0] * (5 + E)  # reset after a take


def test_bias_and_masked_experts() -> None:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(11, D, generator=gen, dtype=torch.float64)
    w = torch.randn(E, D, generator=gen, dtype=torch.float64)
    bias = torch.zeros(E, dtype=torch.float64)
    bias[2] = -math.inf  # a masked expert: p = 0, contributes 0 log 0 = 0
    buffer = RouterLogitBuffer(E, top_k=1)
    buffer.add(x, w, bias)
    got = buffer.take()
    ent, load = routing_stats(x @ w.T + bias, 1)
    assert float(got[0]) == pytest.approx(float(ent.mean), rel=1e-12)
    assert float(got[2]) == pytest.approx(float(ent.p10), rel=1e-12)
    assert got[5:].tolist() == pytest.approx(load.load.tolist(), abs=0)
    assert math.isfinite(float(got[0]))


def test_memory_bound_sets_the_slots() -> None:
    buffer = RouterLogitBuffer(E, top_k=1, max_bytes=3 * 10 * E * 4)  # three fp32 forwards
    x, w = torch.randn(10, D), torch.randn(E, D)
    for _ in range(3):
        buffer.add(x, w, None)
    assert buffer._storage is not None and buffer._storage.tensor.shape == (3, E, 10)
    assert buffer._filled == 0  # full after three: reduced at once


@pytest.mark.parametrize("max_forwards", [2, 64])
def test_logits_given_tokens_first_reduce_like_products(max_forwards: int) -> None:
    """add_logits (a router's own N x E output) sums what add (the product) sums, also when
    forwards of both kinds and of other token counts alternate in one buffer's life."""
    torch.manual_seed(3)
    w, b = torch.randn(E, D, dtype=torch.float64), torch.randn(E, dtype=torch.float64)
    xs = [torch.randn(n, D, dtype=torch.float64) for n in (10, 10, 7, 10, 10)]
    by_product = RouterLogitBuffer(E, top_k=2, max_forwards=max_forwards)
    by_logits = RouterLogitBuffer(E, top_k=2, max_forwards=max_forwards)
    mixed = RouterLogitBuffer(E, top_k=2, max_forwards=max_forwards)
    for i, x in enumerate(xs):
        z = x @ w.T + b  # (N, E)
        by_product.add(x, w, b)
        by_logits.add_logits(z)
        if i % 2:
            mixed.add(x, w, b)
        else:
            mixed.add_logits(z)
    want = by_product.take()
    assert want is not None
    for buffer in (by_logits, mixed):
        got = buffer.take()
        assert got is not None
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_handed_logits_reduce_off_thread_and_the_buffer_is_recycled() -> None:
    torch.manual_seed(4)
    buffer = RouterLogitBuffer(E, top_k=1)
    zs = [torch.randn(10, E) for _ in range(3)]
    for z in zs:
        buffer.add_logits(z)
    batch = buffer.hand_over()
    assert batch.logits is not None and batch.logits.shape == (3, E, 10)  # experts first
    storage = batch.storage
    got = batch.reduce()
    want = routing_sums(torch.stack([z.T for z in zs]), 1)
    assert got is not None
    torch.testing.assert_close(got, torch.cat([want[0], want[1]]))
    buffer.recycle(batch)
    buffer.add_logits(zs[0])
    assert buffer._storage is storage  # the spare was reused, no new allocation


def test_bf16_input_under_autocast_keeps_the_input_precision() -> None:
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(16, D, generator=gen).bfloat16()
    w = torch.randn(E, D, generator=gen)
    buffer = RouterLogitBuffer(E, top_k=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        buffer.add(x, w, None)
    got = buffer.take()
    ent, _ = routing_stats(x @ w.bfloat16().T, 2)  # logits rounded to bf16, as nn.Linear does
    assert float(got[0]) == pytest.approx(float(ent.mean), rel=1e-5)


def test_routing_sums_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="top_k"):
        routing_sums(torch.zeros(1, E, 3), top_k=E + 1)
    with pytest.raises(ValueError, match="shape"):
        routing_sums(torch.zeros(E, 3), top_k=1)


@pytest.mark.parametrize("top_k", [1, 2, 3])
def test_ties_share_the_remaining_assignments(top_k: int) -> None:
    """Every token assigns exactly k; experts tied at the k-th value share what is left."""
    z = torch.tensor([[2.0, 1.0, 1.0, 1.0, 0.0, -math.inf]], dtype=torch.float64)  # (N=1, E)
    row, load = routing_sums(z.T.unsqueeze(0), top_k)
    want = {
        1: [1, 0, 0, 0, 0, 0],
        2: [0.5, 1 / 6, 1 / 6, 1 / 6, 0, 0],
        3: [1 / 3, 2 / 9, 2 / 9, 2 / 9, 0, 0],
    }
    assert load.tolist() == pytest.approx(want[top_k], abs=1e-15)
    p = torch.softmax(z, dim=-1)[0]
    assert float(row[3]) == pytest.approx(float(p[0] - p[1]), rel=1e-15)  # top-1 minus top-2


def test_margin_is_zero_when_the_top_two_tie() -> None:
    z = torch.tensor([[1.0, 1.0, 0.0]], dtype=torch.float64)
    row, load = routing_sums(z.T.unsqueeze(0), 1)
    assert float(row[3]) == 0.0
    assert load.tolist() == pytest.approx([0.5, 0.5, 0.0])
