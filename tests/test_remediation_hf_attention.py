"""The FP32-backward switch on Hugging Face models: it changes nothing while off, honours every
argument of the model's own attention while on, and refuses what it cannot serve exactly.

The first tests need no transformers (``recompute_attention`` on toy attention functions);
the others build tiny models from configs (``tests/hf_tiny.py``) and compare against the same
model without the switch: bit for bit while off; while on, the forward bit for bit and the
gradients equal to those of the model's own eager attention (exactly for models that run
eager, within the model's own eager-vs-sdpa gap for models that run SDPA).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from graph_nodes import uses_node
from torch import nn

from remediations.attention_switch import AttentionPrecisionSwitch
from remediations.fp32_recompute import recompute_attention

F64 = torch.float64


# -- recompute_attention on toy attention functions (no transformers) ------------------------
class _Heads(nn.Module):
    """What an attention function reads from its module: GQA groups, a learned sink per head."""

    def __init__(self, heads: int = 4, groups: int = 2) -> None:
        super().__init__()
        self.num_key_value_groups = groups
        self.sinks = nn.Parameter(torch.randn(heads, dtype=F64))


def _toy_eager(
    module: _Heads,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    softcap: float | None = None,
    position_bias: torch.Tensor | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every feature at once: GQA, softcap, position bias, mask, sinks (module's and s_aux)."""
    key = key.repeat_interleave(module.num_key_value_groups, dim=1)  # (B, H, S, D)
    value = value.repeat_interleave(module.num_key_value_groups, dim=1)
    scores = query @ key.transpose(-1, -2) * scaling  # (B, H, L, S)
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if position_bias is not None:
        scores = scores + position_bias
    if attention_mask is not None:
        scores = scores + attention_mask
    sink = module.sinks if s_aux is None else module.sinks + s_aux
    sink = sink.reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
    probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :-1]
    probs = nn.functional.dropout(probs, p=dropout, training=module.training)
    return (probs @ value).transpose(1, 2).contiguous(), probs  # (B, L, H, D)


def _inputs(dtype: torch.dtype = F64) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(0)

    def make(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, dtype=F64).to(dtype).requires_grad_()

    # query (B, H, L, D), key/value (B, H_kv, S, D), learned mask, position bias, s_aux
    return make(2, 4, 5, 3), make(2, 2, 5, 3), make(2, 2, 5, 3), make(2, 1, 5, 5), make(1, 4, 5, 5)


def test_recompute_gives_every_input_and_the_module_its_exact_gradient() -> None:
    module = _Heads()
    s_aux = torch.randn(4, dtype=F64, requires_grad=True)

    def attention(q, k, v, mask, bias, aux):
        args = (q, k, v, mask)
        kwargs = dict(scaling=0.5, softcap=2.0, position_bias=bias, s_aux=aux)
        out, _ = recompute_attention(
            _toy_eager, _toy_eager, module, args, kwargs, params=[module.sinks]
        )
        return out

    inputs = (*_inputs(), s_aux)
    assert torch.autograd.gradcheck(attention, inputs)
    # The module's own parameter (read by the function, not passed) gets its gradient too.
    want = torch.autograd.grad(_toy_eager(module, *inputs[:4], 0.5)[0].sum(), module.sinks)
    got = torch.autograd.grad(
        recompute_attention(
            _toy_eager, _toy_eager, module, inputs[:4], {"scaling": 0.5}, params=[module.sinks]
        )[0].sum(),
        module.sinks,
    )
    torch.testing.assert_close(got, want, rtol=1e-13, atol=1e-15)


def test_recompute_forward_is_the_kernel_and_backward_the_fp32_reference() -> None:
    module = _Heads().float()
    q, k, v, mask, _ = (t.detach().float().requires_grad_() for t in _inputs())

    def kernel(m: nn.Module, *args: Any, **kwargs: Any) -> tuple[torch.Tensor, None]:
        out, _ = _toy_eager(m, *args, **kwargs)
        return (out + 1e-3).to(torch.bfloat16).float(), None  # a different, rounded forward

    out, weights = recompute_attention(
        kernel, _toy_eager, module, (q, k, v, mask), {"scaling": 0.5}, params=[module.sinks]
    )
    assert weights is None
    torch.testing.assert_close(out, kernel(module, q, k, v, mask, scaling=0.5)[0], rtol=0, atol=0)
    d_out = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v, mask, module.sinks), d_out)
    exact = [t.detach().double().requires_grad_() for t in (q, k, v, mask)]
    module.double()  # the exact gradients, in float64
    ref = _toy_eager(module, *exact, scaling=0.5)[0]
    want = torch.autograd.grad(ref, (*exact, module.sinks), d_out.double())
    for a, b in zip(got, want, strict=True):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)


def test_recompute_replays_the_dropout_mask_in_the_backward() -> None:
    module = _Heads().train()
    q, k, v, mask, _ = _inputs()
    kwargs = {"scaling": 0.5, "dropout": 0.4}
    torch.manual_seed(7)
    out, _ = recompute_attention(
        _toy_eager, _toy_eager, module, (q, k, v, mask), kwargs, params=[module.sinks], dropout=True
    )
    torch.rand(3)  # the RNG moves on before the backward
    got = torch.autograd.grad(out.square().sum(), (q, k, v, mask, module.sinks))
    torch.manual_seed(7)
    ref, _ = _toy_eager(module, q, k, v, mask, **kwargs)  # the same mask from the same seed
    torch.testing.assert_close(out, ref, rtol=0, atol=0)
    want = torch.autograd.grad(ref.square().sum(), (q, k, v, mask, module.sinks))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-13, atol=1e-15)


# -- real transformers models -----------------------------------------------------------------
def _tiny() -> Any:
    pytest.importorskip("transformers")
    import hf_tiny

    return hf_tiny


_uses = uses_node


def _run(model: nn.Module, ids: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, list]:
    return _tiny().run(model, ids, pad)


def _rel(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return _tiny().relative_error(got, want)


# model type, extra config: eager with softcap + sliding window (Gemma 2), eager with sinks
# (GPT-OSS), SDPA (Llama), a learned mask (Doge), a sparse mask chosen by the implementation's
# name (DeepSeek-V3.2).
_FAMILIES: list[tuple[str, dict[str, Any]]] = [
    ("llama", {}),
    ("gemma2", {}),
    ("gpt_oss", {}),
    ("doge", dict(keep_window_size=4, num_experts=None)),
    (
        "deepseek_v32",
        dict(n_routed_experts=4, n_group=1, topk_group=1, first_k_dense_replace=1, index_topk=4)
        | dict(index_n_heads=2, index_head_dim=8, moe_intermediate_size=16, num_experts_per_tok=2)
        | dict(q_lora_rank=12, kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4)
        | dict(v_head_dim=5, num_key_value_heads=4, head_dim=None),
    ),
]


@pytest.mark.parametrize("family", _FAMILIES, ids=[f[0] for f in _FAMILIES])
def test_switch_changes_nothing_while_off_and_matches_the_model_while_on(
    family: tuple[str, dict[str, Any]],
) -> None:
    hf_tiny = _tiny()
    from remediations.hf_attention import install_hf_attention, uninstall_hf_attention

    model_type, extra = family
    model = hf_tiny.tiny(model_type, **extra)
    ids, pad = hf_tiny.batch()
    implementation = model.config._attn_implementation
    ref, ref_grads = _run(model, ids, pad)
    gap = 0.0
    if implementation == "sdpa":  # the model's own eager-vs-sdpa gap
        model.set_attn_implementation("eager")
        gap = _rel(_run(model, ids, pad)[1], ref_grads)
        model.set_attn_implementation("sdpa")
    switch = AttentionPrecisionSwitch()
    assert install_hf_attention(model, switch=switch) == implementation  # the name is kept
    try:
        out, grads = _run(model, ids, pad)
        assert torch.equal(out, ref) and not _uses(out, "FP32Recompute")
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
        switch.enable_fp32_backward(["model.layers.*"])
        out, grads = _run(model, ids, pad)
        assert _uses(out, "FP32Recompute")
        assert switch.consulted_layers == {"model.layers.0.self_attn", "model.layers.1.self_attn"}
        assert torch.equal(out, ref)
        if implementation == "eager":  # the same function, recomputed: the same gradients
            assert _rel(grads, ref_grads) < 1e-13
        else:
            assert _rel(grads, ref_grads) <= 1.01 * gap + 1e-13, (_rel(grads, ref_grads), gap)
        for name, grad in zip([n for n, p in model.named_parameters()], grads, strict=True):
            if name.endswith(("sinks", "self_attn.A")):  # sinks, Doge's learned mask
                assert grad.abs().sum() > 0, name
    finally:
        uninstall_hf_attention(model)
    out, _ = _run(model, ids, pad)
    assert not _uses(out, "FP32Recompute")  # uninstalled


def test_attention_dropout_is_replayed_exactly() -> None:
    hf_tiny = _tiny()
    from remediations.hf_attention import install_hf_attention

    model = hf_tiny.tiny("gpt2", attn_pdrop=0.3)
    model.set_attn_implementation("eager")
    ids, pad = hf_tiny.batch()
    torch.manual_seed(3)
    ref, ref_grads = _run(model, ids, pad)
    switch = AttentionPrecisionSwitch()
    install_hf_attention(model, switch=switch)
    switch.enable_fp32_backward()
    torch.manual_seed(3)
    out, grads = _run(model, ids, pad)
    assert _uses(out, "FP32Recompute")
    torch.testing.assert_close(out, ref, rtol=0, atol=0)  # the same dropout masks
    assert _rel(grads, ref_grads) < 1e-13


def test_t5_position_bias_gets_its_gradient() -> None:
    _tiny()
    import transformers

    from remediations.hf_attention import install_hf_attention

    config = transformers.T5Config(
        vocab_size=64, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_heads=4, dropout_rate=0.0
    )
    torch.manual_seed(0)
    model = transformers.T5ForConditionalGeneration(config).double().train()
    ids = torch.randint(0, 64, (2, 6))

    def run() -> tuple[torch.Tensor, list[torch.Tensor]]:
        out = model(input_ids=ids, decoder_input_ids=ids).logits
        return out, list(torch.autograd.grad(out.square().sum(), list(model.parameters())))

    ref, ref_grads = run()
    switch = AttentionPrecisionSwitch()
    install_hf_attention(model, switch=switch)
    switch.enable_fp32_backward()
    out, grads = run()
    assert _uses(out, "FP32Recompute") and torch.equal(out, ref)
    names = [n for n, _ in model.named_parameters()]
    bias = names.index("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight")
    assert grads[bias].abs().sum() > 0
    torch.testing.assert_close(grads[bias], ref_grads[bias], rtol=1e-6, atol=1e-9)


def test_refusals_name_the_module_and_the_reason() -> None:
    hf_tiny = _tiny()
    from remediations.hf_attention import install_hf_attention

    llama = hf_tiny.tiny("llama")
    llama.config._attn_implementation = "flash_attention_2"
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn .*'flash_attention_2'"):
        install_hf_attention(llama)
    with pytest.raises(ValueError, match=r"_OwnSDPAAttention x2 .*install_sdpa_redirect"):
        install_hf_attention(_OwnSDPAModel())


class _SinkAttentionOnSDPA(nn.Module):
    """A layer passing attention sinks to whatever implementation is configured."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.sinks = nn.Parameter(torch.zeros(2))

    def forward(self, q: torch.Tensor, all_attention_functions: Any) -> torch.Tensor:
        attention_interface: Callable = all_attention_functions.get_interface(
            self.config._attn_implementation, None
        )
        return attention_interface(self, q, q, q, None, scaling=1.0, s_aux=self.sinks)[0]


def test_sinks_passed_to_sdpa_are_refused() -> None:
    _tiny()
    from remediations.hf_attention import install_hf_attention

    model = nn.Module()
    model.config = types.SimpleNamespace(_attn_implementation="sdpa")
    model.attn = _SinkAttentionOnSDPA(model.config)
    with pytest.raises(ValueError, match=r"attn \(_SinkAttentionOnSDPA\) passes s_aux"):
        install_hf_attention(model)


def test_linear_attention_layers_are_named_in_a_warning() -> None:
    hf_tiny = _tiny()
    from remediations.hf_attention import install_hf_attention, installed_layers

    model = hf_tiny.tiny(
        "qwen3_next",
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        shared_expert_intermediate_size=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=2,
        layer_types=["linear_attention", "full_attention"],
    )
    with pytest.warns(UserWarning, match=r"Qwen3NextGatedDeltaNet x1 \(model\.layers\.0\.linear"):
        install_hf_attention(model)
    assert installed_layers(model) == ["model.layers.1.self_attn"]


class _OwnSDPAAttention(nn.Module):
    """A research-style layer: projections, then torch's SDPA called directly (no interface)."""

    def __init__(self, d: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv_proj = nn.Linear(d, 3 * d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
        b, length, d = x.shape  # x: (B, L, d); keep: (B, L) 1 for real tokens
        q, k, v = self.qkv_proj(x).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        causal = torch.ones(length, length, dtype=torch.bool).tril()  # (L, L)
        mask = causal & keep.bool()[:, None, None, :]  # (B, 1, L, L)
        out = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # (B, H, L, D)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, d))


class _OwnSDPAModel(nn.Module):
    """Two blocks of ``_OwnSDPAAttention``, called like a transformers causal LM."""

    def __init__(self, vocab: int = 64, d: int = 16) -> None:
        super().__init__()
        self.config = types.SimpleNamespace(_attn_implementation="sdpa")
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.embed = nn.Embedding(vocab, d)
            self.blocks = nn.ModuleList(_OwnSDPAAttention(d) for _ in range(2))
            self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor, attention_mask: torch.Tensor) -> Any:
        x = self.embed(ids)  # (B, L, d)
        for block in self.blocks:
            x = x + block(x, attention_mask)
        return types.SimpleNamespace(logits=self.head(x))  # (B, L, vocab)


def test_redirect_routes_a_modules_own_sdpa_calls() -> None:
    hf_tiny = _tiny()
    from remediations.sdpa_redirect import install_sdpa_redirect, uninstall_sdpa_redirect

    model = _OwnSDPAModel().double()
    ids, pad = hf_tiny.batch()
    ref, ref_grads = _run(model, ids, pad)
    switch = AttentionPrecisionSwitch()
    names = install_sdpa_redirect(model, switch=switch)
    assert names == ["blocks.0", "blocks.1"]
    out, grads = _run(model, ids, pad)
    assert torch.equal(out, ref) and not _uses(out, "FP32BackwardAttention")
    assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
    switch.enable_fp32_backward(["blocks.1"])
    out, grads = _run(model, ids, pad)
    assert _uses(out, "FP32BackwardAttention") and torch.equal(out, ref)
    assert switch.consulted_layers == set(names)
    assert _rel(grads, ref_grads) < 1e-10
    assert uninstall_sdpa_redirect(model) == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert not _uses(_run(model, ids, pad)[0], "FP32BackwardAttention")


def test_redirect_refuses_a_model_whose_layers_consult_the_interface() -> None:
    hf_tiny = _tiny()
    from remediations.sdpa_redirect import install_sdpa_redirect

    with pytest.raises(ValueError, match=r"no module of LlamaForCausalLM calls torch's"):
        install_sdpa_redirect(hf_tiny.tiny("llama"))


def test_padding_rows_with_no_key_keep_zero_gradients() -> None:
    """SDPA outputs zeros where every key is masked (left padding); so does the backward."""
    hf_tiny = _tiny()
    from remediations.hf_attention import install_hf_attention

    model = hf_tiny.tiny("llama")
    ids, _ = hf_tiny.batch()
    pad = torch.ones_like(ids)
    pad[1, :3] = 0  # left padding: the first rows of the second sequence see no key
    ref, ref_grads = _run(model, ids, pad)
    switch = AttentionPrecisionSwitch()
    install_hf_attention(model, switch=switch)
    switch.enable_fp32_backward()
    out, grads = _run(model, ids, pad)
    assert torch.equal(out, ref)
    assert all(torch.isfinite(g).all() for g in grads)
    assert _rel(grads, ref_grads) < 1e-6
