from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from agent.testbed.attention import AttentionFault, emulated_attention, reference_attention
from agent.testbed.lowprec import round_mantissa


def _qkv(dtype: torch.dtype, *, seed: int = 0, shape=(2, 3, 12, 8), positive_q: bool = False):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(*shape, generator=g, dtype=dtype) for _ in range(3))
    if positive_q:
        q = q.abs() + 0.1
    return [t.requires_grad_() for t in (q, k, v)]


def _grads(fn, q, k, v, d_o):
    out = fn(q, k, v)
    gq, gk, gv = torch.autograd.grad(out, (q, k, v), d_o)
    return out, gq, gk, gv


@pytest.mark.parametrize("is_causal", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_exact_backward_matches_fp64_autograd(is_causal: bool, scale: float | None) -> None:
    q, k, v = _qkv(torch.float64)
    d_o = torch.randn(q.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    got = _grads(
        lambda a, b, c: emulated_attention(a, b, c, is_causal=is_causal, scale=scale), q, k, v, d_o
    )
    ref = _grads(
        lambda a, b, c: reference_attention(a, b, c, is_causal=is_causal, scale=scale), q, k, v, d_o
    )
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_gradcheck_fp64() -> None:
    q, k, v = _qkv(torch.float64, shape=(1, 2, 5, 3))
    assert torch.autograd.gradcheck(lambda a, b, c: emulated_attention(a, b, c), (q, k, v))


def test_fp32_forward_matches_torch_sdpa() -> None:
    q, k, v = _qkv(torch.float32)
    ours = emulated_attention(q, k, v, is_causal=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    torch.testing.assert_close(ours, sdpa, rtol=1e-5, atol=1e-6)


def test_disabled_fault_is_exactly_the_exact_backward() -> None:
    q, k, v = _qkv(torch.float32)
    d_o = torch.randn(q.shape)
    off = AttentionFault(sites=("dS", "dQK", "O_delta"), bits=2, mode="floor", enabled=False)
    a = _grads(lambda *t: emulated_attention(*t, fault=off), q, k, v, d_o)
    b = _grads(lambda *t: emulated_attention(*t), q, k, v, d_o)
    for x, y in zip(a, b, strict=True):
        assert torch.equal(x, y)


def test_dqk_site_rounds_exactly_the_exact_gradients() -> None:
    q, k, v = _qkv(torch.float32)
    d_o = torch.randn(q.shape)
    _, gq, gk, gv = _grads(lambda *t: emulated_attention(*t), q, k, v, d_o)
    fault = AttentionFault(sites=("dQK",), bits=4, mode="floor")
    _, fq, fk, fv = _grads(lambda *t: emulated_attention(*t, fault=fault), q, k, v, d_o)
    assert torch.equal(fq, round_mantissa(gq, 4, "floor"))
    assert torch.equal(fk, round_mantissa(gk, 4, "floor"))
    assert torch.equal(fv, gv)  # dV is never rounded
    assert (fq <= gq).all() and (fq < gq).any()


def _shared_key_shift_gradient(mode: str | None, bits: int = 4) -> torch.Tensor:
    """d loss / d b for keys k_j + b: sum_j dK_j = c sum_i q_i sum_j dS_ij (0 in exact math)."""
    q, k, v = _qkv(torch.float32, seed=3, shape=(4, 4, 32, 16), positive_q=True)
    d_o = torch.randn(q.shape, generator=torch.Generator().manual_seed(4))
    fault = None if mode is None else AttentionFault(sites=("dS",), bits=bits, mode=mode)
    _, _, gk, _ = _grads(lambda *t: emulated_attention(*t, fault=fault), q, k, v, d_o)
    return gk.sum(dim=-2)  # (B, H, d_h)


def test_biased_ds_rounding_breaks_softmax_shift_invariance_with_a_sign() -> None:
    exact = _shared_key_shift_gradient(None)
    floor = _shared_key_shift_gradient("floor")
    ceil = _shared_key_shift_gradient("ceil")
    rne = _shared_key_shift_gradient("rne")
    # floor makes every row sum of dS negative; q_i > 0 makes every component negative
    assert (floor < 0).all() and (ceil > 0).all()
    scale = floor.abs().mean()
    assert exact.abs().max() < 1e-3 * scale  # exact: zero up to fp32 noise
    # unbiased rounding is noise: its mean is much smaller than the biased one's
    assert rne.mean().abs() < 0.05 * floor.mean().abs()


def test_o_delta_site_changes_only_through_delta() -> None:
    q, k, v = _qkv(torch.float32)
    d_o = torch.randn(q.shape)
    exact = _grads(lambda *t: emulated_attention(*t), q, k, v, d_o)
    fault = AttentionFault(sites=("O_delta",), bits=2, mode="trunc")
    faulty = _grads(lambda *t: emulated_attention(*t, fault=fault), q, k, v, d_o)
    assert torch.equal(exact[0], faulty[0])  # forward output is untouched
    assert torch.equal(exact[3], faulty[3])  # dV does not read delta
    assert not torch.equal(exact[1], faulty[1])  # dQ does


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"attn_mask": torch.ones(12, 12, dtype=torch.bool)}, "attn_mask"),
        ({"dropout_p": 0.1}, "dropout_p"),
    ],
)
def test_unsupported_sdpa_arguments_raise(kwargs: dict, match: str) -> None:
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match=match):
        emulated_attention(q, k, v, **kwargs)


def test_sdpa_calling_convention_is_accepted() -> None:
    q, k, v = _qkv(torch.float32)
    out = emulated_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=0.25)
    ref = reference_attention(q, k, v, scale=0.25)
    torch.testing.assert_close(out, ref)


def test_shape_mismatch_raises() -> None:
    q, k, v = _qkv(torch.float32)
    with pytest.raises(ValueError, match="B, H, T, d_h"):
        emulated_attention(q, k[:, :1], v)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"sites": ("dX",)}, "sites"),
        ({"sites": "dS"}, "tuple"),
        ({"sites": ()}, "sites"),
        ({"bits": 30}, "bits"),
        ({"mode": "up"}, "mode"),
    ],
)
def test_attention_fault_validation(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        AttentionFault(**kwargs)


def test_default_scale_is_inverse_sqrt_head_dim() -> None:
    q, k, v = _qkv(torch.float64)
    a = emulated_attention(q, k, v)
    b = emulated_attention(q, k, v, scale=1 / math.sqrt(q.shape[-1]))
    assert torch.equal(a, b)
