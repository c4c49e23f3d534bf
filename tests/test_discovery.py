"""agent.discovery: attention Q/K factors and MoE routers found in model code of each layout.

Each small model below copies the relevant layout of a real family (HF transformers 5.x names
and shapes, see DESIGN.md section 4). Expected factors are hand-sliced from the weights and
compared exactly; the factor convention is tied to each model's own per-head projection.
"""

from __future__ import annotations

import math
import types
import warnings

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from torch import nn

from agent.discovery import (
    AttentionOverride,
    AttentionSite,
    DiscoveryError,
    DiscoveryOverrides,
    RouterOverride,
    find_attention,
    find_routers,
)
from agent.router_output import extract_router_logits

D, H, HKV, DH = 32, 4, 2, 8  # d_model, query heads, KV heads, head dim
T = 5  # tokens in a probe input


def _config(**values: object) -> types.SimpleNamespace:
    """An HF-like config object (attribute access)."""
    return types.SimpleNamespace(**values)


def _randomize(module: nn.Module, seed: int) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.5 + (1.0 if p.dim() == 1 else 0))
    return module


class MLP(nn.Module):  # Llama MLP: gate_proj is not a router
    def __init__(self, d: int = D, inner: int = 48) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, inner, bias=False)
        self.up_proj = nn.Linear(d, inner, bias=False)
        self.down_proj = nn.Linear(inner, d, bias=False)


# ------------------------------------------------------------------------- attention layouts


class LlamaLikeAttention(nn.Module):
    """HF v5 LlamaAttention: no num_heads attribute; counts live on `config`; q/k biases."""

    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.head_dim = config.hidden_size // config.num_attention_heads
        n_q, n_kv = config.num_attention_heads, config.num_key_value_heads
        self.q_proj = nn.Linear(config.hidden_size, n_q * self.head_dim, bias=True)
        self.k_proj = nn.Linear(config.hidden_size, n_kv * self.head_dim, bias=True)
        self.v_proj = nn.Linear(config.hidden_size, n_kv * self.head_dim, bias=True)
        self.o_proj = nn.Linear(n_q * self.head_dim, config.hidden_size, bias=False)

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:  # (T, H, d_h), bias removed
        return (self.q_proj(x) - self.q_proj.bias).view(x.shape[0], -1, self.head_dim)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:  # (T, H_kv, d_h)
        return (self.k_proj(x) - self.k_proj.bias).view(x.shape[0], -1, self.head_dim)


class DecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.self_attn = attn
        self.mlp = mlp if mlp is not None else MLP()


class LlamaLikeModel(nn.Module):
    def __init__(self, layers: int = 2) -> None:
        super().__init__()
        self.config = _config(
            hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV, model_type="llama"
        )
        self.layers = nn.ModuleList(
            DecoderLayer(LlamaLikeAttention(self.config)) for _ in range(layers)
        )
        _randomize(self, 0)


class MetaLlamaMQAAttention(nn.Module):
    """Meta-Llama naming (wq/wk), multi-query: one KV head; counts as attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = H, 1, DH
        self.wq = nn.Linear(D, H * DH, bias=False)
        self.wk = nn.Linear(D, DH, bias=False)
        self.wv = nn.Linear(D, DH, bias=False)
        self.wo = nn.Linear(H * DH, D, bias=False)

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.wq(x).view(x.shape[0], self.n_heads, self.head_dim)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self.wk(x).view(x.shape[0], self.n_kv_heads, self.head_dim)


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm multiplies by (1 + weight)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


class QKNormAttention(nn.Module):
    """OLMoE (norm over the whole projection: scales [H*d_h], [H_kv*d_h]), Qwen3 (per-head
    norm, scale [d_h]) or Gemma-3 (per-head, scales by 1 + weight)."""

    def __init__(self, style: str) -> None:
        super().__init__()
        self.style = style
        self.num_heads, self.num_key_value_heads, self.head_dim = H, HKV, DH
        self.q_proj = nn.Linear(D, H * DH, bias=False)
        self.k_proj = nn.Linear(D, HKV * DH, bias=False)
        self.v_proj = nn.Linear(D, HKV * DH, bias=False)
        if style == "olmoe":
            self.q_norm = nn.RMSNorm(H * DH, eps=1e-5)
            self.k_norm = nn.RMSNorm(HKV * DH, eps=1e-5)
        elif style == "qwen3":
            self.q_norm = nn.RMSNorm(DH, eps=1e-6)
            self.k_norm = nn.RMSNorm(DH, eps=1e-6)
        else:
            self.q_norm = GemmaRMSNorm(DH)
            self.k_norm = GemmaRMSNorm(DH)

    def _heads(self, proj: nn.Linear, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        y = proj(x)  # (T, n*d_h)
        if self.style == "olmoe":
            return norm(y).view(x.shape[0], -1, self.head_dim)
        return norm(y.view(x.shape[0], -1, self.head_dim))

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:  # after the norm
        return self._heads(self.q_proj, self.q_norm, x)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._heads(self.k_proj, self.k_norm, x)

    def rms(self, proj: nn.Linear, x: torch.Tensor) -> torch.Tensor:
        """The norm's divisor for each token and head: (T, n) (broadcast over heads for
        OLMoE's whole-projection norm)."""
        y = proj(x)
        norm = self.q_norm if proj is self.q_proj else self.k_norm
        eps = norm.eps
        if self.style == "olmoe":
            r = torch.sqrt(y.pow(2).mean(-1, keepdim=True) + eps)  # (T, 1)
            return r.expand(x.shape[0], y.shape[-1] // self.head_dim)
        heads = y.view(x.shape[0], -1, self.head_dim)
        return torch.sqrt(heads.pow(2).mean(-1) + eps)  # (T, n)


class Conv1D(nn.Module):
    """transformers.pytorch_utils.Conv1D: a linear layer with weight stored [nx, nf]."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.empty(nx, nf))
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(
            *x.shape[:-1], self.nf
        )


class GPT2LikeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_dim = D
        self.c_attn = Conv1D(3 * D, D)
        self.c_proj = Conv1D(D, D)

    def _split(self, x: torch.Tensor, which: int) -> torch.Tensor:
        qkv = self.c_attn(x) - self.c_attn.bias  # (T, 3d)
        return qkv.split(self.embed_dim, dim=-1)[which].view(x.shape[0], H, DH)

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x, 0)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._split(x, 1)


class GPT2LikeModel(nn.Module):
    """Head count only on the model-level config (GPT2Config-style `n_head`)."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _config(n_head=H, n_embd=D, model_type="gpt2")
        self.h = nn.ModuleList(DecoderLayer(GPT2LikeAttention()) for _ in range(2))
        _randomize(self, 1)


class TimmLikeAttention(nn.Module):
    """timm ViT: fused `qkv` Linear [3*H*d_h, d], rows q | k | v."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = H, DH
        self.qkv = nn.Linear(D, 3 * H * DH, bias=True)

    def _part(self, x: torch.Tensor, which: int) -> torch.Tensor:
        qkv = (self.qkv(x) - self.qkv.bias).reshape(x.shape[0], 3, H, DH)
        return qkv[:, which]

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._part(x, 0)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._part(x, 1)


class MPTLikeGQAAttention(nn.Module):
    """MPT grouped-query: fused `Wqkv` of width (H + 2 H_kv) d_h, split q | k | v."""

    def __init__(self) -> None:
        super().__init__()
        self.d_model, self.n_heads, self.kv_n_heads = D, H, HKV
        self.Wqkv = nn.Linear(D, (H + 2 * HKV) * DH, bias=False)

    def _parts(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return self.Wqkv(x).split([H * DH, HKV * DH, HKV * DH], dim=-1)

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._parts(x)[0].view(x.shape[0], H, DH)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._parts(x)[1].view(x.shape[0], HKV, DH)


class GPTNeoXLikeAttention(nn.Module):
    """GPT-NeoX: `query_key_value` rows are [q_h | k_h | v_h] per head."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads, self.head_size = H, DH
        self.query_key_value = nn.Linear(D, 3 * H * DH, bias=False)

    def _part(self, x: torch.Tensor, which: int) -> torch.Tensor:
        qkv = self.query_key_value(x).view(x.shape[0], H, 3 * DH)
        return qkv.chunk(3, dim=-1)[which]

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._part(x, 0)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._part(x, 1)


class FalconLikeAttention(nn.Module):
    """Falcon-40B ("new decoder architecture"): per KV group, its query heads then k then v."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = H, HKV, DH
        self.new_decoder_architecture = True
        self.query_key_value = nn.Linear(D, (H + 2 * HKV) * DH, bias=False)

    def _grouped(self, x: torch.Tensor) -> torch.Tensor:
        r = H // HKV
        return self.query_key_value(x).view(x.shape[0], HKV, r + 2, DH)

    def query_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._grouped(x)[:, :, :-2].reshape(x.shape[0], H, DH)

    def key_heads(self, x: torch.Tensor) -> torch.Tensor:
        return self._grouped(x)[:, :, -2]


class MysteryFusedAttention(nn.Module):
    """A `query_key_value` of unknown family: its row layout cannot be guessed."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads, self.head_dim = H, DH
        self.query_key_value = nn.Linear(D, 3 * H * DH, bias=False)


class NoCountsAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj = nn.Linear(D, H * DH, bias=False)
        self.k_proj = nn.Linear(D, HKV * DH, bias=False)


class Stack(nn.Module):
    """`blocks.{i}.attn` holding any attention module."""

    def __init__(self, *attns: nn.Module, seed: int = 2) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(DecoderLayer(a) for a in attns)
        for block in self.blocks:
            block.attn = block.self_attn
            del block.self_attn
        _randomize(self, seed)


def _x(seed: int = 3, d: int = D) -> torch.Tensor:
    return torch.randn(T, d, generator=torch.Generator().manual_seed(seed))


def _assert_ties_to_model(site: AttentionSite, x: torch.Tensor) -> None:
    """x @ W_q^h is the model's own query of head h; x @ W_k^g(h) its key of KV head g(h)."""
    wq, wk = site.factors()
    with torch.no_grad():
        q, k = site.module.query_heads(x), site.module.key_heads(x)
    for h in range(site.num_heads):
        torch.testing.assert_close(x @ wq[h], q[:, h], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x @ wk[h], k[:, site.kv_head(h)], rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------- attention: layouts


def test_llama_gqa_from_module_config_with_exact_factors() -> None:
    model = LlamaLikeModel()
    sites = find_attention(model)
    assert [s.name for s in sites] == ["layers.0.self_attn", "layers.1.self_attn"]
    site = sites[1]
    assert (site.num_heads, site.num_kv_heads, site.head_dim, site.d_model) == (H, HKV, DH, D)
    assert site.layout == "separate"
    assert [site.kv_head(h) for h in range(H)] == [0, 0, 1, 1]
    wq, wk = site.factors()
    assert wq.shape == wk.shape == (H, D, DH) and wq.dtype == torch.float32
    q_w = model.layers[1].self_attn.q_proj.weight
    k_w = model.layers[1].self_attn.k_proj.weight
    for h in range(H):
        assert torch.equal(wq[h], q_w[h * DH : (h + 1) * DH].T)
        g = h // 2
        assert torch.equal(wk[h], k_w[g * DH : (g + 1) * DH].T)
    wkv = site.factors_kv()
    assert wkv.shape == (HKV, D, DH)
    for g in range(HKV):
        assert torch.equal(wkv[g], k_w[g * DH : (g + 1) * DH].T)
    assert set(site.parameters_to_snapshot()) == {
        "layers.1.self_attn.q_proj.weight",
        "layers.1.self_attn.k_proj.weight",
    }
    _assert_ties_to_model(site, _x())


def test_mqa_single_kv_head_pairs_every_query_head_with_it() -> None:
    model = Stack(MetaLlamaMQAAttention(), MetaLlamaMQAAttention())
    sites = find_attention(model)
    assert [s.name for s in sites] == ["blocks.0.attn", "blocks.1.attn"]
    site = sites[0]
    assert (site.num_heads, site.num_kv_heads, site.head_dim) == (H, 1, DH)
    assert [site.kv_head(h) for h in range(H)] == [0] * H
    wq, wk = site.factors()
    k_w = model.blocks[0].attn.wk.weight
    for h in range(H):
        assert torch.equal(wk[h], k_w.T)
    assert torch.equal(site.factors_kv()[0], k_w.T)
    _assert_ties_to_model(site, _x())


@pytest.mark.parametrize("style", ["olmoe", "qwen3", "gemma"])
def test_qk_norm_scales_are_folded_into_the_factors(style: str) -> None:
    model = Stack(QKNormAttention(style), seed=4)
    attn = model.blocks[0].attn
    (site,) = find_attention(model)
    assert set(site.parameters_to_snapshot()) == {
        "blocks.0.attn.q_proj.weight",
        "blocks.0.attn.k_proj.weight",
        "blocks.0.attn.q_norm.weight",
        "blocks.0.attn.k_norm.weight",
    }
    offset = 1.0 if style == "gemma" else 0.0
    assert site.q.norm_offset == site.k.norm_offset == offset
    wq, wk = site.factors()
    gq = attn.q_norm.weight.detach().float() + offset
    gk = attn.k_norm.weight.detach().float() + offset
    for h in range(H):
        g = h // 2
        sq = gq[h * DH : (h + 1) * DH] if style == "olmoe" else gq
        sk = gk[g * DH : (g + 1) * DH] if style == "olmoe" else gk
        expected_q = attn.q_proj.weight[h * DH : (h + 1) * DH].T.float() * sq[None, :]
        expected_k = attn.k_proj.weight[g * DH : (g + 1) * DH].T.float() * sk[None, :]
        assert torch.equal(wq[h], expected_q)
        assert torch.equal(wk[h], expected_k)
    # The model's normalized query is the folded factor's output divided by the RMS.
    x = _x()
    with torch.no_grad():
        q, k = attn.query_heads(x), attn.key_heads(x)
        rq, rk = attn.rms(attn.q_proj, x), attn.rms(attn.k_proj, x)
    for h in range(H):
        torch.testing.assert_close((x @ wq[h]) / rq[:, h, None], q[:, h], rtol=1e-4, atol=1e-5)
        kv = site.kv_head(h)
        torch.testing.assert_close((x @ wk[h]) / rk[:, kv, None], k[:, kv], rtol=1e-4, atol=1e-5)


def test_fold_qk_norm_can_be_switched_off() -> None:
    model = Stack(QKNormAttention("qwen3"), seed=4)
    overrides = DiscoveryOverrides(
        attention={"blocks.0.attn": AttentionOverride(fold_qk_norm=False)}
    )
    (site,) = find_attention(model, overrides)
    assert site.q.norm_name is None and len(site.parameters_to_snapshot()) == 2
    wq, _ = site.factors()
    assert torch.equal(wq[1], model.blocks[0].attn.q_proj.weight[DH : 2 * DH].T)


def test_gpt2_conv1d_fused_c_attn_is_input_major_and_heads_come_from_model_config() -> None:
    model = GPT2LikeModel()
    sites = find_attention(model)
    assert [s.name for s in sites] == ["h.0.self_attn", "h.1.self_attn"]
    site = sites[0]
    assert (site.num_heads, site.num_kv_heads, site.head_dim, site.d_model) == (H, H, DH, D)
    assert site.layout == "concat" and site.q.input_major
    w = model.h[0].self_attn.c_attn.weight  # [d, 3d], input-major
    wq, wk = site.factors()
    for h in range(H):
        assert torch.equal(wq[h], w[:, h * DH : (h + 1) * DH])
        assert torch.equal(wk[h], w[:, D + h * DH : D + (h + 1) * DH])
    assert list(site.parameters_to_snapshot()) == ["h.0.self_attn.c_attn.weight"]
    _assert_ties_to_model(site, _x())


def test_fused_qkv_mha_and_fused_gqa_wqkv() -> None:
    model = Stack(TimmLikeAttention(), MPTLikeGQAAttention(), seed=5)
    mha, gqa = find_attention(model)
    assert (mha.num_heads, mha.num_kv_heads, mha.head_dim, mha.layout) == (H, H, DH, "concat")
    assert (gqa.num_heads, gqa.num_kv_heads, gqa.head_dim, gqa.layout) == (H, HKV, DH, "concat")
    w = model.blocks[0].attn.qkv.weight  # [3*H*d_h, d]
    wq, wk = mha.factors()
    for h in range(H):
        assert torch.equal(wq[h], w[h * DH : (h + 1) * DH].T)
        assert torch.equal(wk[h], w[(H + h) * DH : (H + h + 1) * DH].T)
    w = model.blocks[1].attn.Wqkv.weight  # [(H + 2 H_kv) d_h, d]
    wq, wk = gqa.factors()
    for h in range(H):
        g = h // 2
        assert torch.equal(wq[h], w[h * DH : (h + 1) * DH].T)
        assert torch.equal(wk[h], w[(H + g) * DH : (H + g + 1) * DH].T)
    _assert_ties_to_model(mha, _x())
    _assert_ties_to_model(gqa, _x())


def test_query_key_value_layouts_follow_the_model_family() -> None:
    model = Stack(GPTNeoXLikeAttention(), FalconLikeAttention(), seed=6)
    neox, falcon = find_attention(model)
    assert (neox.layout, neox.num_kv_heads) == ("per_head", H)
    assert (falcon.layout, falcon.num_kv_heads) == ("grouped", HKV)
    w = model.blocks[0].attn.query_key_value.weight
    wq, wk = neox.factors()
    assert torch.equal(wq[2], w[6 * DH : 7 * DH].T)  # head 2 starts at row 3 * 2 * d_h
    assert torch.equal(wk[2], w[7 * DH : 8 * DH].T)
    w = model.blocks[1].attn.query_key_value.weight  # per group: q, q, k, v
    wq, wk = falcon.factors()
    assert torch.equal(wq[3], w[5 * DH : 6 * DH].T)  # group 1, second query head
    assert torch.equal(wk[3], w[6 * DH : 7 * DH].T)  # group 1's key
    _assert_ties_to_model(neox, _x())
    _assert_ties_to_model(falcon, _x())


def test_unknown_query_key_value_layout_is_an_error_until_overridden() -> None:
    model = Stack(MysteryFusedAttention())
    with pytest.raises(DiscoveryError, match=r"blocks\.0\.attn.*qkv_layout"):
        find_attention(model)
    overrides = DiscoveryOverrides(
        attention={"blocks.0.attn": AttentionOverride(qkv_layout="per_head")}
    )
    (site,) = find_attention(model, overrides)
    w = model.blocks[0].attn.query_key_value.weight
    assert torch.equal(site.factors()[1][1], w[4 * DH : 5 * DH].T)


def test_torch_multihead_attention_factors_reproduce_its_attention_weights() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(D, H, bias=False, batch_first=True)

    model = _randomize(Wrapper(), 7)
    (site,) = find_attention(model)
    assert (site.name, site.num_heads, site.num_kv_heads, site.head_dim) == ("attn", H, H, DH)
    assert list(site.parameters_to_snapshot()) == ["attn.in_proj_weight"]
    x = _x()[None]  # (1, T, d)
    with torch.no_grad():
        _, probs = model.attn(x, x, x, need_weights=True, average_attn_weights=False)
    wq, wk = site.factors()
    for h in range(H):
        scores = (x[0] @ wq[h]) @ (x[0] @ wk[h]).T / math.sqrt(DH)  # (T, T)
        torch.testing.assert_close(scores.softmax(-1), probs[0, h], rtol=1e-5, atol=1e-6)


def test_bf16_weights_give_fp32_factors() -> None:
    model = LlamaLikeModel(layers=1).to(torch.bfloat16)
    (site,) = find_attention(model)
    wq, wk = site.factors()
    assert wq.dtype == wk.dtype == torch.float32
    w = model.layers[0].self_attn.q_proj.weight
    assert torch.equal(wq[3], w[3 * DH : 4 * DH].T.float())
    wq64, _ = site.factors(dtype=torch.float64)
    assert wq64.dtype == torch.float64 and torch.equal(wq64.float(), wq)


# -------------------------------------------------------------------- attention: snapshots


def test_factors_from_a_cloned_snapshot_match_live_and_stay_put() -> None:
    model = Stack(QKNormAttention("olmoe"), seed=8)
    (site,) = find_attention(model)
    snapshot = {k: p.detach().clone().float() for k, p in site.parameters_to_snapshot().items()}
    live_q, live_k = site.factors()
    snap_q, snap_k = site.factors(snapshot)
    assert torch.equal(live_q, snap_q) and torch.equal(live_k, snap_k)
    assert torch.equal(site.factors_kv(snapshot), site.factors_kv())
    # A full state dict has the same keys.
    state_q, _ = site.factors(model.state_dict())
    assert torch.equal(state_q, live_q)
    with torch.no_grad():
        model.blocks[0].attn.q_proj.weight.add_(1.0)
    moved_q, _ = site.factors()
    assert not torch.equal(moved_q, live_q)
    assert torch.equal(site.factors(snapshot)[0], snap_q)
    # Factors are fresh tensors: editing them leaves the weights alone.
    before = model.blocks[0].attn.q_proj.weight.detach().clone()
    moved_q.zero_()
    assert torch.equal(model.blocks[0].attn.q_proj.weight, before)


def test_bad_snapshot_is_a_clear_error() -> None:
    (site,) = find_attention(Stack(MetaLlamaMQAAttention()))
    snapshot = {k: p.detach().clone() for k, p in site.parameters_to_snapshot().items()}
    del snapshot["blocks.0.attn.wk.weight"]
    with pytest.raises(ValueError, match=r"blocks\.0\.attn.*blocks\.0\.attn\.wk\.weight"):
        site.factors(snapshot)
    snapshot["blocks.0.attn.wk.weight"] = torch.zeros(D, DH)  # transposed
    with pytest.raises(ValueError, match="shape"):
        site.factors(snapshot)


def test_head_subset_selects_query_heads_and_their_kv_pairs() -> None:
    (site, _) = find_attention(LlamaLikeModel())
    full_q, full_k = site.factors()
    wq, wk = site.factors(heads=[3, 0, 2])
    assert wq.shape == (3, D, DH)
    assert torch.equal(wq, full_q[[3, 0, 2]])
    assert torch.equal(wk, full_k[[3, 0, 2]])
    assert torch.equal(wk[0], site.factors_kv(kv_heads=[1])[0])
    assert site.factors(heads=[])[0].shape == (0, D, DH)
    with pytest.raises(ValueError, match="query head 4 is out of range"):
        site.factors(heads=[4])
    with pytest.raises(ValueError, match="KV head 2 is out of range"):
        site.factors_kv(kv_heads=[2])
    with pytest.raises(ValueError, match="out of range"):
        site.kv_head(-1)


def test_sites_are_frozen_values_without_module_in_repr() -> None:
    model = LlamaLikeModel()
    first, again = find_attention(model)[0], find_attention(model)[0]
    assert first == again and hash(first.q) == hash(again.q)
    assert "LlamaLikeAttention" not in repr(first) and "layers.0.self_attn" in repr(first)
    with pytest.raises(AttributeError):
        first.num_heads = 8  # type: ignore[misc]


# ---------------------------------------------------------------- attention: errors, overrides


def test_missing_head_count_names_the_module_and_the_override() -> None:
    model = Stack(NoCountsAttention(), NoCountsAttention())
    with pytest.raises(DiscoveryError) as info:
        find_attention(model)
    message = str(info.value)
    assert "blocks.0.attn (NoCountsAttention)" in message
    assert "number of query heads" in message and "AttentionOverride(num_heads=" in message
    exact = DiscoveryOverrides(
        attention={
            "blocks.0.attn": AttentionOverride(num_heads=H),
            "blocks.1.attn": AttentionOverride(num_heads=2),
        }
    )
    first, second = find_attention(model, exact)
    assert (first.num_heads, first.num_kv_heads, first.head_dim) == (H, HKV, DH)
    # The same weights read as 2 heads of 16: k_proj [16, d] is one KV head.
    assert (second.num_heads, second.num_kv_heads, second.head_dim) == (2, 1, 16)
    pattern = DiscoveryOverrides(attention={"blocks.*.attn": AttentionOverride(num_heads=H)})
    assert [s.num_heads for s in find_attention(model, pattern)] == [H, H]


def test_declared_counts_that_do_not_fit_the_weights_are_errors() -> None:
    model = LlamaLikeModel(layers=1)
    wrong_dim = DiscoveryOverrides(attention={"layers.0.self_attn": AttentionOverride(head_dim=16)})
    with pytest.raises(DiscoveryError, match=r"layers\.0\.self_attn.*q_proj has 32 outputs"):
        find_attention(model, wrong_dim)
    wrong_kv = DiscoveryOverrides(
        attention={"layers.0.self_attn": AttentionOverride(num_kv_heads=4)}
    )
    with pytest.raises(DiscoveryError, match="4 key/value heads are declared"):
        find_attention(model, wrong_kv)


def test_override_naming_a_missing_module_is_a_clear_error() -> None:
    model = LlamaLikeModel()
    typo = DiscoveryOverrides(attention={"layers.0.self_atn": AttentionOverride(num_heads=H)})
    with pytest.raises(DiscoveryError, match=r"'layers\.0\.self_atn'.*did you mean"):
        find_attention(model, typo)
    nothing = DiscoveryOverrides(attention={"decoder.*": AttentionOverride(num_heads=H)})
    with pytest.raises(DiscoveryError, match="matches no module"):
        find_attention(model, nothing)
    bad_child = DiscoveryOverrides(
        attention={"layers.0.self_attn": AttentionOverride(q="query", k="k_proj")}
    )
    with pytest.raises(DiscoveryError, match=r"layers\.0\.self_attn\.query"):
        find_attention(model, bad_child)
    not_attention = DiscoveryOverrides(attention={"layers.0.mlp": AttentionOverride(num_heads=2)})
    with pytest.raises(DiscoveryError, match=r"layers\.0\.mlp \(MLP\).*no recognizable"):
        find_attention(model, not_attention)
    with pytest.raises(DiscoveryError, match="no module of that name"):
        find_routers(model, DiscoveryOverrides(routers={"layers.0.gate": RouterOverride()}))


def test_override_can_name_projections_of_an_unrecognized_module() -> None:
    class Odd(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_heads = H
            self.make_q = nn.Linear(D, H * DH, bias=False)
            self.make_k = nn.Linear(D, H * DH, bias=False)

    model = Stack(Odd())
    assert find_attention(model) == []
    overrides = DiscoveryOverrides(
        attention={"blocks.0.attn": AttentionOverride(q="make_q", k="make_k")}
    )
    (site,) = find_attention(model, overrides)
    assert torch.equal(site.factors()[1][2], model.blocks[0].attn.make_k.weight[16:24].T)


def test_exclude_patterns_skip_modules() -> None:
    model = LlamaLikeModel(layers=3)
    overrides = DiscoveryOverrides(exclude=["layers.1.*"])
    assert [s.name for s in find_attention(model, overrides)] == [
        "layers.0.self_attn",
        "layers.2.self_attn",
    ]
    clash = DiscoveryOverrides(
        attention={"layers.1.self_attn": AttentionOverride(num_heads=H)}, exclude=["layers.1.*"]
    )
    with pytest.raises(DiscoveryError, match="also matched by `exclude`"):
        find_attention(model, clash)


def test_overrides_validate_like_yaml_config() -> None:
    parsed = DiscoveryOverrides.model_validate(
        {
            "attention": {"model.layers.*.self_attn": {"num_heads": 32, "num_kv_heads": 8}},
            "routers": {"model.layers.0.mlp.gate": {"num_experts": 8, "top_k": 2}},
            "exclude": ["vision_tower.*"],
        }
    )
    assert parsed.attention["model.layers.*.self_attn"].num_kv_heads == 8
    assert DiscoveryOverrides.model_validate(parsed.model_dump()) == parsed
    with pytest.raises(ValidationError, match="num_head"):
        DiscoveryOverrides.model_validate({"attention": {"a": {"num_head": 4}}})
    with pytest.raises(ValidationError, match="q and k must be set together"):
        AttentionOverride(q="q_proj")
    with pytest.raises(ValidationError, match="either q and k, or qkv"):
        AttentionOverride(q="q_proj", k="k_proj", qkv="qkv")
    with pytest.raises(ValidationError):
        RouterOverride(num_experts=1)


# -------------------------------------------------------------------------------- routers


class MixtralLikeTopKRouter(nn.Module):
    """HF v5 MixtralTopKRouter: a bare [E, d] weight; forward returns a tuple."""

    def __init__(self, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(num_experts, D))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        logits = F.linear(x.reshape(-1, D), self.weight)  # (tokens, E)
        top, idx = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), idx


class FusedExperts(nn.Module):
    """HF v5 MixtralExperts: expert weights fused into [E, ...] parameters."""

    def __init__(self, num_experts: int, inner: int = 16) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inner, D))
        self.down_proj = nn.Parameter(torch.empty(num_experts, D, inner))


class MixtralLikeBlock(nn.Module):
    def __init__(self, num_experts: int = 6) -> None:
        super().__init__()
        self.gate = MixtralLikeTopKRouter(num_experts, top_k=2)
        self.experts = FusedExperts(num_experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _, scores, _ = self.gate(x)
        return scores


class Qwen2MoeLikeRouter(MixtralLikeTopKRouter):
    def __init__(self, num_experts: int) -> None:
        super().__init__(num_experts, top_k=1)
        del self.top_k  # top_k comes from the model config
        self.num_experts = num_experts


class Qwen2MoeLikeBlock(nn.Module):
    def __init__(self, num_experts: int = 4) -> None:
        super().__init__()
        self.gate = Qwen2MoeLikeRouter(num_experts)
        self.experts = nn.ModuleList(MLP() for _ in range(num_experts))
        self.shared_expert = MLP()
        self.shared_expert_gate = nn.Linear(D, 1, bias=False)  # sigmoid gate, not a router


class LinearGateBlock(nn.Module):
    """OLMoE v4 / plain MoE: an nn.Linear gate beside an experts ModuleList."""

    def __init__(self, num_experts: int = 4, gate_rows: int | None = None) -> None:
        super().__init__()
        self.k = 2
        self.gate = nn.Linear(D, gate_rows or num_experts, bias=True)
        self.experts = nn.ModuleList(MLP() for _ in range(num_experts))


class DbrxLikeRouter(nn.Module):
    def __init__(self, num_experts: int) -> None:
        super().__init__()
        self.moe_num_experts, self.moe_top_k = num_experts, 3
        self.layer = nn.Linear(D, num_experts, bias=False)


class DbrxLikeBlock(nn.Module):
    def __init__(self, num_experts: int = 8) -> None:
        super().__init__()
        self.router = DbrxLikeRouter(num_experts)
        self.experts = FusedExperts(num_experts)


class MoEModel(nn.Module):
    def __init__(self, *mlps: nn.Module, config: types.SimpleNamespace | None = None) -> None:
        super().__init__()
        if config is not None:
            self.config = config
        self.layers = nn.ModuleList(
            DecoderLayer(
                LlamaLikeAttention(
                    _config(hidden_size=D, num_attention_heads=H, num_key_value_heads=HKV)
                ),
                mlp,
            )
            for mlp in mlps
        )
        _randomize(self, 9)


def test_routers_of_each_kind_are_found_and_lookalikes_are_not() -> None:
    config = _config(num_experts=4, num_experts_per_tok=2)
    model = MoEModel(
        MixtralLikeBlock(6),
        Qwen2MoeLikeBlock(4),
        LinearGateBlock(4),
        DbrxLikeBlock(8),
        MLP(),
        config=config,
    )
    routers = find_routers(model)
    got = [(r.name, r.num_experts, r.d_model, r.top_k) for r in routers]
    assert got == [
        ("layers.0.mlp.gate", 6, D, 2),  # E from the fused experts' leading dim
        ("layers.1.mlp.gate", 4, D, 2),  # top_k from the model config
        ("layers.2.mlp.gate", 4, D, 2),  # top_k from the block's `k`
        ("layers.3.mlp.router.layer", 8, D, 3),  # DBRX: router.layer, counts on the router
    ]
    assert routers[1].weight() is model.layers[1].mlp.gate.weight
    assert routers[1].weight_name == "layers.1.mlp.gate.weight"
    assert routers[1].bias() is None
    assert routers[2].bias() is model.layers[2].mlp.gate.bias
    names = {r.name for r in routers}
    assert not any("gate_proj" in n or "shared_expert" in n for n in names)
    assert find_attention(model)[0].name == "layers.0.self_attn"  # attention still found


def test_router_hook_takes_logits_from_the_tuple_output() -> None:
    model = MoEModel(MixtralLikeBlock(6))
    (router,) = find_routers(model)
    captured: list[torch.Tensor] = []

    def hook(module: nn.Module, args: tuple[torch.Tensor], output: object) -> None:
        logits = extract_router_logits(output, router.num_experts)
        assert logits is not None
        captured.append(logits.detach())

    handle = router.module.register_forward_hook(hook)
    x = _x(seed=10)[None]  # (1, T, d)
    with torch.no_grad():
        model.layers[0].mlp(x)
    handle.remove()
    (logits,) = captured
    assert logits.shape == (T, 6)
    torch.testing.assert_close(logits, x[0] @ router.weight().detach().T)


def test_unconfirmed_or_mismatched_router_lookalikes_are_skipped() -> None:
    class DenseGLU(nn.Module):  # a GLU whose gate happens to be called `gate`
        def __init__(self) -> None:
            super().__init__()
            self.gate = nn.Linear(D, 48)
            self.up = nn.Linear(D, 48)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_routers(MoEModel(DenseGLU())) == []  # no expert count anywhere: not a router
    model = MoEModel(LinearGateBlock(num_experts=3, gate_rows=4))
    with pytest.warns(UserWarning, match=r"layers\.0\.mlp\.gate \(Linear\).*4 rows.*\[3\]"):
        assert find_routers(model) == []
    # An explicit override makes it a router.
    overrides = DiscoveryOverrides(routers={"layers.0.mlp.gate": RouterOverride(num_experts=4)})
    (router,) = find_routers(model, overrides)
    assert (router.num_experts, router.top_k) == (4, 2)
    with pytest.raises(DiscoveryError, match="num_experts = 5 but the weight has 4 rows"):
        find_routers(
            model, DiscoveryOverrides(routers={"layers.0.mlp.gate": RouterOverride(num_experts=5)})
        )
    with pytest.raises(DiscoveryError, match=r"layers\.0\.mlp \(LinearGateBlock\).*no 2-D"):
        find_routers(model, DiscoveryOverrides(routers={"layers.0.mlp": RouterOverride()}))


def test_router_exclude_and_pattern_override() -> None:
    model = MoEModel(LinearGateBlock(4), LinearGateBlock(4), LinearGateBlock(4))
    found = find_routers(model, DiscoveryOverrides(exclude=["layers.1.*"]))
    assert [r.name for r in found] == ["layers.0.mlp.gate", "layers.2.mlp.gate"]
    pattern = DiscoveryOverrides(routers={"layers.*.mlp.gate": RouterOverride(top_k=1)})
    assert [r.top_k for r in find_routers(model, pattern)] == [1, 1, 1]


def test_extract_router_logits_from_each_output_shape() -> None:
    logits = torch.randn(T, 4)
    scores, indices = torch.rand(T, 2), torch.zeros(T, 2, dtype=torch.long)
    assert extract_router_logits(logits, 4) is logits
    assert extract_router_logits((logits, scores, indices), 4) is logits
    assert extract_router_logits([scores, logits], 4) is logits
    assert extract_router_logits((scores, indices), 4) is None  # top-k only: no logits
    assert extract_router_logits(logits, 5) is None
    assert extract_router_logits(torch.zeros(T, 4, dtype=torch.long), 4) is None
    assert extract_router_logits({"logits": logits}, 4) is None
    assert extract_router_logits(None, 4) is None


# --------------------------------------------------------- optional: real transformers models


def test_real_transformers_tiny_models() -> None:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=64,
            hidden_size=D,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=HKV,
        )
    )
    sites = find_attention(llama)
    assert [(s.num_heads, s.num_kv_heads, s.head_dim) for s in sites] == [(H, HKV, DH)] * 2
    assert find_routers(llama) == []
    q_w = llama.model.layers[0].self_attn.q_proj.weight
    assert torch.equal(sites[0].factors()[0][1], q_w[DH : 2 * DH].T)
    mixtral = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=64,
            hidden_size=D,
            intermediate_size=48,
            num_hidden_layers=2,
            num_attention_heads=H,
            num_key_value_heads=HKV,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    routers = find_routers(mixtral)
    assert [(r.num_experts, r.top_k, r.d_model) for r in routers] == [(4, 2, D)] * 2
    assert len(find_attention(mixtral)) == 2


def test_attention_between_different_widths_is_skipped_with_a_warning() -> None:
    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cross = nn.MultiheadAttention(D, H, kdim=16, vdim=16)

    with pytest.warns(UserWarning, match=r"cross \(MultiheadAttention\).*different widths"):
        assert find_attention(Wrapper()) == []
