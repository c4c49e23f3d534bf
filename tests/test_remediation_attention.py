"""The fp32 attention backward, its switch, and the Hugging Face adapter."""

from __future__ import annotations

import math
from functools import partial

import pytest
import torch
import torch.nn.functional as F
from graph_nodes import uses_node

from remediations.attention import (
    AttentionPrecisionSwitch,
    fp32_backward_attention,
    scaled_dot_product_attention,
)
from remediations.hf_attention import hf_attention_forward, layer_name, register_module_names

F64 = torch.float64


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny tensors: threads only add overhead on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _qkv(b: int, h: int, h_kv: int, l: int, s: int, e: int, ev: int, dtype=F64, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, h, l, e, generator=g, dtype=dtype).requires_grad_()
    k = torch.randn(b, h_kv, s, e, generator=g, dtype=dtype).requires_grad_()
    v = torch.randn(b, h_kv, s, ev, generator=g, dtype=dtype).requires_grad_()
    return q, k, v


def _bool_mask(l: int, s: int) -> torch.Tensor:
    m = torch.rand(l, s, generator=torch.Generator().manual_seed(3)) > 0.4  # (L, S)
    m[:, 0] = True
    m[1] = False  # a fully masked row: attends to nothing, output and gradients 0
    return m


def _float_mask(b: int, l: int, s: int) -> torch.Tensor:
    m = torch.randn(b, 1, l, s, generator=torch.Generator().manual_seed(4), dtype=F64)
    m[..., 2] = -math.inf  # key 2 is masked out by the additive mask
    return m  # (B, 1, L, S)


CASES = {
    "plain": dict(shape=(2, 3, 3, 4, 4, 5, 5), kw={}),
    "causal": dict(shape=(2, 2, 2, 5, 5, 4, 3), kw=dict(is_causal=True)),
    "causal_l_lt_s": dict(shape=(1, 2, 2, 3, 6, 4, 4), kw=dict(is_causal=True)),
    "causal_l_gt_s": dict(shape=(1, 2, 2, 6, 3, 4, 4), kw=dict(is_causal=True)),
    "bool_mask": dict(shape=(2, 2, 2, 4, 6, 5, 3), kw=dict(attn_mask=_bool_mask(4, 6))),
    "float_mask": dict(shape=(2, 2, 2, 4, 6, 5, 5), kw=dict(attn_mask=_float_mask(2, 4, 6))),
    "gqa_causal": dict(shape=(2, 4, 2, 5, 5, 4, 4), kw=dict(is_causal=True, enable_gqa=True)),
    "gqa_mask_scale": dict(
        shape=(1, 6, 2, 4, 6, 4, 3),
        kw=dict(attn_mask=_bool_mask(4, 6), enable_gqa=True, scale=0.37),
    ),
    "mqa": dict(shape=(2, 3, 1, 4, 4, 4, 4), kw=dict(is_causal=True, enable_gqa=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradcheck_fp64(case: str) -> None:
    c = CASES[case]
    q, k, v = _qkv(*c["shape"])
    assert torch.autograd.gradcheck(
        lambda q, k, v: fp32_backward_attention(q, k, v, **c["kw"]), (q, k, v)
    )


def test_gradcheck_with_dropout() -> None:
    q, k, v = _qkv(2, 4, 2, 4, 5, 3, 3)

    def attend(q, k, v):
        torch.manual_seed(7)  # the dropout mask is drawn from a seed from torch's CPU generator
        return fp32_backward_attention(q, k, v, dropout_p=0.3, is_causal=True, enable_gqa=True)

    assert torch.autograd.gradcheck(attend, (q, k, v))
    out = attend(q, k, v)
    # Dropout really dropped: the output differs from attention without dropout.
    plain = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert (out - plain).abs().max() > 0.1


@pytest.mark.parametrize("case", sorted(CASES))
def test_forward_is_the_kernel_and_grads_match_torch(case: str) -> None:
    c = CASES[case]
    q, k, v = _qkv(*c["shape"])
    out = fp32_backward_attention(q, k, v, **c["kw"])
    ref = F.scaled_dot_product_attention(q, k, v, **c["kw"])
    assert torch.equal(out, ref)  # the forward is the usual kernel, bit for bit
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    want = torch.autograd.grad(ref, (q, k, v), d_out)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


def _math_attention(q, k, v, is_causal: bool) -> torch.Tensor:
    """Reference attention through plain autograd (torch's documented math definition)."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril()
        scores = scores.masked_fill(~keep, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def test_fp32_grads_equal_autograd_on_math_attention() -> None:
    q, k, v = _qkv(2, 4, 4, 16, 16, 8, 8, dtype=torch.float32)
    out = fp32_backward_attention(q, k, v, is_causal=True)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), d_out)
    want = torch.autograd.grad(_math_attention(q, k, v, True), (q, k, v), d_out)
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("seed", [0, 1])
def test_bf16_grads_are_the_exact_grads_rounded_once(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    shape = (2, 4, 64, 32)  # (B, H, T, d_h)
    base = [torch.randn(shape, generator=g).bfloat16() for _ in range(3)]
    d_out = torch.randn(shape, generator=g).bfloat16()

    def grads(dtype: torch.dtype, fp32: bool):
        switch = AttentionPrecisionSwitch()
        if fp32:
            switch.enable_fp32_backward()
        x = [t.to(dtype).requires_grad_() for t in base]
        out = scaled_dot_product_attention(*x, is_causal=True, switch=switch)
        return torch.autograd.grad(out, x, d_out.to(dtype))

    exact = grads(F64, False)  # fp64 on the same (bf16-valued) inputs

    def rel_err(gs):
        return [float((a.double() - r).norm() / r.norm()) for a, r in zip(gs, exact, strict=True)]

    native = rel_err(grads(torch.bfloat16, False))
    ours_grads = grads(torch.bfloat16, True)
    assert all(t.dtype == torch.bfloat16 for t in ours_grads)
    ours = rel_err(ours_grads)
    rounding = rel_err([r.bfloat16() for r in exact])  # the floor: one rounding to bf16
    for o, n, r in zip(ours, native, rounding, strict=True):
        assert o <= r * 1.001 + 1e-7  # measured: equal to ~1e-9 relative
        assert n >= 1.3 * o  # measured: native bf16 backward ~1.6x worse


@pytest.mark.parametrize(
    ("site", "mode"), [("dS", "floor"), ("O_delta", "floor"), ("dQK", "trunc")]
)
def test_emulated_biased_backward_error_cut_at_least_100x(site: str, mode: str) -> None:
    testbed = pytest.importorskip("agent.testbed.attention")
    fault = testbed.AttentionFault(sites=(site,), bits=5, mode=mode)
    kernel = partial(testbed.emulated_attention, fault=fault)
    g = torch.Generator().manual_seed(0)
    shape = (2, 4, 32, 16)  # (B, H, T, d_h)
    base = [torch.randn(shape, generator=g) for _ in range(3)]
    d_out = torch.randn(shape, generator=g)
    x64 = [t.double().requires_grad_() for t in base]
    exact = torch.autograd.grad(
        testbed.reference_attention(*x64, is_causal=True), x64, d_out.double()
    )
    switch = AttentionPrecisionSwitch()

    def max_rel_err() -> float:
        x = [t.clone().requires_grad_() for t in base]
        out = scaled_dot_product_attention(
            *x, is_causal=True, layer="l0", fallback=kernel, switch=switch
        )
        gs = torch.autograd.grad(out, x, d_out)
        return max(
            float((a.double() - r).norm() / r.norm()) for a, r in zip(gs, exact, strict=True)
        )

    biased = max_rel_err()
    switch.enable_fp32_backward(["l0"])
    fixed = max_rel_err()
    assert biased > 1e-3  # the fault is real
    assert biased / fixed >= 100.0, (biased, fixed)  # measured: ~7e4 (1.4e-2 -> 1.8e-7)


# -- the switch ---------------------------------------------------------------------------------
def test_switch_per_layer_glob_global_and_exclusion() -> None:
    sw = AttentionPrecisionSwitch()
    assert not sw.fp32_backward("model.layers.0.self_attn") and not sw.fp32_backward(None)
    sw.enable_fp32_backward(["model.layers.1.self_attn", "blocks.*.attn"])
    assert sw.fp32_backward("model.layers.1.self_attn")
    assert not sw.fp32_backward("model.layers.0.self_attn")
    assert sw.fp32_backward("blocks.7.attn") and not sw.fp32_backward("blocks.7.mlp")
    assert not sw.fp32_backward(None)  # an unnamed call site follows only the global switch
    sw.disable_fp32_backward(["blocks.*.attn"])
    assert not sw.fp32_backward("blocks.7.attn")
    sw.enable_fp32_backward()
    assert sw.fp32_backward("anything") and sw.fp32_backward(None)
    sw.disable_fp32_backward(["model.layers.3.*"])
    assert not sw.fp32_backward("model.layers.3.self_attn") and sw.fp32_backward("x")
    sw.disable_fp32_backward()
    assert not sw.any_enabled and not sw.fp32_backward("model.layers.1.self_attn")


def test_switch_listeners_state_and_rollback_on_listener_error() -> None:
    sw = AttentionPrecisionSwitch()
    seen: list[bool] = []
    sw.add_listener(lambda s: seen.append(s.global_enabled))
    sw.enable_fp32_backward()
    sw.disable_fp32_backward()
    assert seen == [True, False]

    def refuse(s: AttentionPrecisionSwitch) -> None:
        if s.fp32_backward("a"):
            raise RuntimeError("kernel flag refused")

    sw.add_listener(refuse)
    with pytest.raises(RuntimeError, match="refused"):
        sw.enable_fp32_backward(["a"])
    assert not sw.fp32_backward("a")  # the change was undone
    sw.remove_listener(refuse)

    sw.enable_fp32_backward(["a", "b.*"])
    state = sw.state_dict()
    other = AttentionPrecisionSwitch()
    other.load_state_dict(state)
    assert other.state_dict() == state and other.fp32_backward("b.x")
    with pytest.raises(ValueError, match="unknown keys"):
        other.load_state_dict({"all": True, "bogus": 1})
    with pytest.raises(ValueError, match="non-empty strings"):
        other.enable_fp32_backward([""])


def test_wrapper_calls_fallback_when_off_or_without_grad() -> None:
    calls: list[dict] = []

    def kernel(q, k, v, **kw):
        calls.append(kw)
        return F.scaled_dot_product_attention(q, k, v, **kw)

    sw = AttentionPrecisionSwitch()
    q, k, v = _qkv(1, 2, 2, 3, 3, 4, 4)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, fallback=kernel, switch=sw)
    assert calls == [{"is_causal": True, "scale": None}]  # defaults are not passed on
    assert out.grad_fn is not None and not _uses_fp32_backward(out)
    sw.enable_fp32_backward()
    out = scaled_dot_product_attention(q, k, v, is_causal=True, fallback=kernel, switch=sw)
    assert _uses_fp32_backward(out)
    assert len(calls) == 2  # the forward still ran the kernel
    with torch.no_grad():  # nothing to differentiate: the kernel alone
        out = scaled_dot_product_attention(q, k, v, fallback=kernel, switch=sw)
    assert out.grad_fn is None and len(calls) == 3


def test_bad_arguments_are_value_errors() -> None:
    q, k, v = _qkv(1, 4, 2, 3, 3, 4, 4)
    with pytest.raises(ValueError, match="enable_gqa"):
        fp32_backward_attention(q, k, v)
    with pytest.raises(ValueError, match="both set"):
        fp32_backward_attention(
            q, k, v, attn_mask=_bool_mask(3, 3), is_causal=True, enable_gqa=True
        )
    with pytest.raises(ValueError, match="dropout_p"):
        fp32_backward_attention(q, k, v, dropout_p=1.0, enable_gqa=True)
    q3, k3, v3 = _qkv(1, 3, 3, 3, 3, 4, 4)
    with pytest.raises(ValueError, match="multiple"):
        fp32_backward_attention(q3, k3[:, :2], v3[:, :2], enable_gqa=True)


# -- Hugging Face adapter (no transformers needed) ----------------------------------------------
class _FakeHFAttention(torch.nn.Module):
    """What transformers' attention layers expose to the attention function."""

    def __init__(self, layer_idx: int, groups: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_key_value_groups = groups
        self.is_causal = True


def _uses_fp32_backward(out: torch.Tensor) -> bool:
    """Whether the autograd graph of ``out`` goes through the fp32-backward attention."""
    return uses_node(out, "FP32BackwardAttention")


def _hf_reference(query, key, value, mask, groups: int, is_causal: bool) -> torch.Tensor:
    """transformers' sdpa_attention_forward: repeat_kv, causal iff L > 1 and no mask."""
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    causal = query.shape[2] > 1 and mask is None and is_causal
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, is_causal=causal)
    return out.transpose(1, 2).contiguous()  # (B, L, H, D)


@pytest.mark.parametrize("with_mask", [False, True])
def test_hf_attention_forward_matches_sdpa_layout_and_switch(with_mask: bool) -> None:
    from remediations.attention import attention_precision

    model = torch.nn.Module()
    model.layers = torch.nn.ModuleList([_FakeHFAttention(0, 2), _FakeHFAttention(1, 2)])
    register_module_names(model)
    attn = model.layers[1]
    assert layer_name(attn) == "layers.1"
    assert layer_name(_FakeHFAttention(5, 1)) == "layer5"  # not installed: layer_idx fallback
    q, k, v = _qkv(2, 4, 2, 5, 5, 4, 4)  # HF layout: (B, H, L, D), (B, H_kv, S, D)
    mask = None
    if with_mask:  # a 4-D additive padding+causal mask as transformers builds it
        mask = torch.zeros(2, 1, 5, 5, dtype=F64)
        mask.masked_fill_(torch.ones(5, 5, dtype=torch.bool).triu(1), -math.inf)
        mask[1, :, :, 0] = -math.inf
    ref = _hf_reference(q, k, v, mask, 2, True)
    d_out = torch.randn_like(ref)
    want = torch.autograd.grad(ref, (q, k, v), d_out)
    try:
        attention_precision.enable_fp32_backward(["layers.1"])
        out, weights = hf_attention_forward(attn, q, k, v, mask)
        assert weights is None and out.shape == (2, 5, 4, 4) and out.is_contiguous()
        assert _uses_fp32_backward(out)  # switched on
        torch.testing.assert_close(out, ref, rtol=0, atol=0)
        got = torch.autograd.grad(out, (q, k, v), d_out)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
        out0, _ = hf_attention_forward(model.layers[0], q, k, v, mask)  # layer 0 stays off
        assert not _uses_fp32_backward(out0)
    finally:
        attention_precision.disable_fp32_backward()


def test_hf_attention_forward_refuses_arguments_it_cannot_honour() -> None:
    """Sinks, soft-capping, sparse indices and position biases would be dropped: refused by name
    (install_hf_attention keeps the model's own attention and honours them)."""
    attn = _FakeHFAttention(0, 1)
    q, k, v = _qkv(1, 2, 2, 3, 3, 4, 4)
    for name, value in [("s_aux", torch.zeros(2)), ("softcap", 30.0), ("indices", torch.zeros(1))]:
        with pytest.raises(ValueError, match=f"cannot honour {name}"):
            hf_attention_forward(attn, q, k, v, None, **{name: value})
    hf_attention_forward(attn, q, k, v, None, softcap=None, sliding_window=4)  # None: fine
    learned = torch.zeros(1, 1, 3, 3, dtype=F64, requires_grad=True)
    from remediations.attention import attention_precision

    try:
        attention_precision.enable_fp32_backward()
        with pytest.raises(ValueError, match="learned attention mask"):
            hf_attention_forward(attn, q, k, v, learned)
    finally:
        attention_precision.disable_fp32_backward()


def test_torch_compile_recompiles_at_most_once_per_flip() -> None:
    from torch._dynamo.testing import CompileCounter

    switch = AttentionPrecisionSwitch()

    def loss(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, layer="l0", switch=switch)

    counter = CompileCounter()
    compiled = torch.compile(loss, backend=counter)
    q, k, v = _qkv(1, 2, 2, 8, 8, 4, 4)
    d_out = torch.randn(1, 2, 8, 4, dtype=F64)

    def run() -> tuple[torch.Tensor, ...]:
        return torch.autograd.grad(compiled(q, k, v), (q, k, v), d_out)

    for _ in range(3):
        run()
    frames = counter.frame_count  # the first call sees the layer for the first time
    assert frames <= 2
    for flip in range(4):
        if flip % 2 == 0:
            switch.enable_fp32_backward(["l0"])
        else:
            switch.disable_fp32_backward()
        for _ in range(3):
            got = run()
        assert counter.frame_count <= frames + 1 + flip  # at most one recompile per flip
        want = torch.autograd.grad(loss(q, k, v), (q, k, v), d_out)
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
    assert counter.frame_count <= frames + 1  # measured: flips back and forth reuse both graphs
