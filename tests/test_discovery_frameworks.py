"""Layouts beyond Hugging Face: torchtitan and Megatron-Core, on small modules with the same
names, shapes and forward reshapes (torchtitan ``models/llama3`` and ``models/deepseek_v3``,
Megatron-Core ``SelfAttention``/``MLASelfAttention``/``TopKRouter``, tensor parallel size 1).

Each test computes the framework's real per-head queries and keys as its forward does and
compares them with the discovered factors; routers are checked through the router probe.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agent import samples as m
from agent.discovery import find_attention, find_routers
from agent.monitors import routing_entropy
from agent.probes import RouterProbe

F64 = torch.float64
D, H, HKV, DH, E, T = 16, 4, 2, 4, 4, 6  # width, heads, KV heads, head dim, experts, tokens


def _linear(i: int, o: int, bias: bool = False) -> nn.Linear:
    return nn.Linear(i, o, bias=bias, dtype=F64)


# -- torchtitan --------------------------------------------------------------------------------
class TitanAttention(nn.Module):
    """torchtitan llama3 Attention: wq/wk/wv/wo, n_heads/n_kv_heads/head_dim attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = H, HKV, DH
        self.wq, self.wk = _linear(D, H * DH), _linear(D, HKV * DH)
        self.wv, self.wo = _linear(D, HKV * DH), _linear(H * DH, D)

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        bs, seqlen, _ = x.shape
        xq = self.wq(x).view(bs, seqlen, -1, self.head_dim)  # (bs, T, H, d_h)
        xk = self.wk(x).view(bs, seqlen, -1, self.head_dim)  # (bs, T, H_kv, d_h)
        return xq, xk


class TitanRouter(nn.Module):
    """torchtitan TokenChoiceTopKRouter: a ``gate`` nn.Linear(dim, num_experts)."""

    def __init__(self) -> None:
        super().__init__()
        self.num_experts, self.top_k = E, 2
        self.gate = _linear(D, E)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x).sigmoid()


class TitanMoE(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.router = TitanRouter()
        self.experts = types.new_class("GroupedExperts", (nn.Module,))()
        self.experts.num_experts = E
        self.experts.w1 = nn.Parameter(torch.zeros(E, D, 8, dtype=F64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.router(x.view(-1, D))


class TitanMLA(nn.Module):
    """torchtitan deepseek_v3 Attention: wq_a/q_norm/wq_b, wkv_a/kv_norm/wkv_b."""

    def __init__(self) -> None:
        super().__init__()
        self.n_heads, self.q_lora_rank, self.kv_lora_rank = H, 6, 5
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = 3, 2, 4
        self.wq_a, self.q_norm = _linear(D, 6), nn.RMSNorm(6, dtype=F64)
        self.wq_b = _linear(6, H * 5)
        self.wkv_a, self.kv_norm = _linear(D, 5 + 2), nn.RMSNorm(5, dtype=F64)
        self.wkv_b = _linear(5, H * (3 + 4))

    def content_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(*x.shape[:-1], -1, 5)[..., :3]
        kv, _ = torch.split(self.wkv_a(x), [5, 2], dim=-1)
        k = self.wkv_b(self.kv_norm(kv)).view(*x.shape[:-1], -1, 7)[..., :3]
        return q, k  # (bs, T, H, n) each, before the per-token 1 / rms


class Titan(nn.Module):
    def __init__(self, mla: bool = False) -> None:
        super().__init__()
        block = nn.Module()
        block.attention = TitanMLA() if mla else TitanAttention()
        block.moe = TitanMoE()
        self.layers = nn.ModuleDict({"0": block})
        _randomize(self)


# -- Megatron-Core -----------------------------------------------------------------------------
def _megatron_config(**extra: object) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        hidden_size=D,
        num_attention_heads=H,
        num_query_groups=HKV,
        kv_channels=DH,
        num_moe_experts=E,
        moe_router_topk=2,
        **extra,
    )


class MegatronSelfAttention(nn.Module):
    """Megatron-Core SelfAttention: fused ``linear_qkv`` grouped per query group, QK layernorms."""

    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.linear_qkv = _linear(D, (H + 2 * HKV) * DH, bias=True)
        self.q_layernorm = nn.RMSNorm(DH, dtype=F64)
        self.k_layernorm = nn.RMSNorm(DH, dtype=F64)
        self.linear_proj = _linear(H * DH, D)

    def qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As get_query_key_value_tensors: [sq, b, ng, (np/ng + 2) hn] split per group."""
        mixed = self.linear_qkv(x) - self.linear_qkv.bias  # (sq, b, (np + 2 ng) hn)
        mixed = mixed.view(*x.shape[:-1], HKV, (H // HKV + 2) * DH)
        query, key, _ = torch.split(mixed, [H // HKV * DH, DH, DH], dim=-1)
        query = query.reshape(*x.shape[:-1], H, DH)
        return self.q_layernorm.weight * query, self.k_layernorm.weight * key  # scale folded


class MegatronMLA(nn.Module):
    """Megatron-Core MLASelfAttention names; n and r are qk_head_dim and qk_pos_emb_head_dim."""

    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config = config
        self.linear_q_proj = _linear(D, H * (3 + 2))  # q_lora_rank None: one projection
        self.linear_kv_down_proj = _linear(D, 5 + 2)
        self.kv_layernorm = nn.RMSNorm(5, dtype=F64)
        self.linear_kv_up_proj = _linear(5, H * (3 + 4))

    def content_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        q = self.linear_q_proj(x).view(*x.shape[:-1], H, 5)[..., :3]
        kv, _ = torch.split(self.linear_kv_down_proj(x), [5, 2], dim=-1)
        k = self.linear_kv_up_proj(self.kv_layernorm(kv)).view(*x.shape[:-1], H, 7)[..., :3]
        return q, k


class MegatronTopKRouter(nn.Module):
    """Megatron-Core TopKRouter: the [E, d] ``weight`` lives on the router itself."""

    def __init__(self, config: types.SimpleNamespace) -> None:
        super().__init__()
        self.config, self.topk = config, config.moe_router_topk
        self.weight = nn.Parameter(torch.empty(E, D, dtype=F64))

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return F.linear(input, self.weight)  # [s, b, E]


class Megatron(nn.Module):
    def __init__(self, mla: bool = False) -> None:
        super().__init__()
        config = _megatron_config(kv_lora_rank=5, qk_head_dim=3, qk_pos_emb_head_dim=2)
        config.v_head_dim = 4
        layer = nn.Module()
        layer.self_attention = MegatronMLA(config) if mla else MegatronSelfAttention(config)
        layer.mlp = nn.Module()
        layer.mlp.router = MegatronTopKRouter(config)
        layer.mlp.experts = nn.ModuleList(_linear(D, D) for _ in range(E))
        self.decoder = nn.Module()
        self.decoder.layers = nn.ModuleList([layer])
        _randomize(self)


def _randomize(model: nn.Module) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g, dtype=F64) * 0.5 + (p.dim() == 1))


def _assert_heads(site, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, scaled: bool) -> None:
    """q (..., H, d_h), k (..., H_kv, d_h) against x @ factors (up to 1/rms when ``scaled``)."""
    wq, _ = site.factors(dtype=F64)
    wk = site.factors_kv(dtype=F64)
    got_q = torch.einsum("...d,hde->...he", x, wq)
    got_k = torch.einsum("...d,hde->...he", x, wk)
    for got, real in ((got_q, q), (got_k, k)):
        if scaled:  # per-token positive scale: compare directions
            cos = F.cosine_similarity(got, real, dim=-1)
            torch.testing.assert_close(cos, torch.ones_like(cos), rtol=0, atol=1e-12)
        else:
            torch.testing.assert_close(got, real, rtol=1e-12, atol=1e-12)


def test_torchtitan_attention_and_router() -> None:
    model = Titan()
    (site,) = find_attention(model)
    assert (site.name, site.layout, site.num_heads, site.num_kv_heads) == (
        "layers.0.attention",
        "separate",
        H,
        HKV,
    )
    x = torch.randn(2, T, D, dtype=F64)
    _assert_heads(site, x, *model.layers["0"].attention.qk(x), scaled=False)
    _assert_router(model, "layers.0.moe.router.gate", lambda: model.layers["0"].moe(x), x)


def test_torchtitan_mla() -> None:
    model = Titan(mla=True)
    (site,) = find_attention(model)
    assert (site.layout, site.head_dim) == ("latent", 3)
    x = torch.randn(2, T, D, dtype=F64)
    with torch.no_grad():
        _assert_heads(site, x, *model.layers["0"].attention.content_qk(x), scaled=True)


def test_megatron_grouped_qkv_with_qk_layernorm_and_router() -> None:
    model = Megatron()
    (site,) = find_attention(model)
    assert (site.layout, site.num_heads, site.num_kv_heads, site.head_dim) == ("grouped", H, 2, 4)
    assert site.q.norm_name is not None and site.k.norm_name is not None
    x = torch.randn(T, 2, D, dtype=F64)  # [s, b, h]
    attention = model.decoder.layers[0].self_attention
    with torch.no_grad():
        _assert_heads(site, x, *attention.qk(x), scaled=False)
    router = model.decoder.layers[0].mlp.router
    _assert_router(model, "decoder.layers.0.mlp.router", lambda: router(x), x)


def test_megatron_mla() -> None:
    model = Megatron(mla=True)
    (site,) = find_attention(model)
    assert (site.layout, site.num_heads, site.head_dim) == ("latent", H, 3)
    x = torch.randn(T, 2, D, dtype=F64)
    with torch.no_grad():
        _assert_heads(site, x, *model.decoder.layers[0].self_attention.content_qk(x), scaled=True)


def _assert_router(model: nn.Module, name: str, forward, x: torch.Tensor) -> None:
    (router,) = find_routers(model)
    assert (router.name, router.num_experts, router.top_k) == (name, E, 2)
    probe = RouterProbe([router])
    probe.attach()
    with torch.no_grad():
        forward()
    probe.detach()
    (entropy,) = [s.value for s in probe.read(1) if s.metric == m.ROUTER_ENTROPY]
    logits = x.reshape(-1, D) @ router.weight().T + (0 if router.bias() is None else router.bias())
    assert entropy == pytest.approx(float(routing_entropy(logits).mean), rel=1e-13)
