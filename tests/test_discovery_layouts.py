"""Discovery of the harder layouts: multi-head latent attention (exact, float64 dense
reference), gated queries, and the attention-like modules it cannot read (never silently).

The small modules copy the names, shapes and forward math of transformers 5.x classes
(DeepseekV3Attention, LongcatFlashMLA, Qwen3NextAttention, KimiDeltaAttention, JetMoeAttention).
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch
from torch import nn

from agent.discovery import AttentionOverride, DiscoveryError, DiscoveryOverrides, find_attention

F64 = torch.float64
D, H, NOPE, ROPE, V, R_Q, R_KV = 24, 3, 5, 4, 6, 10, 7  # MLA shapes (all different on purpose)


class RMSNorm(nn.Module):
    def __init__(self, n: int, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(n, dtype=F64))
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rms = x.pow(2).mean(-1, keepdim=True).add(1e-12).sqrt()
        return (self.weight + self.offset) * x / rms


class MLA(nn.Module):
    """DeepseekV3Attention's projections (q_lora_rank set or not), LongcatFlash's scales."""

    def __init__(self, q_lora: bool = True, scales: bool = False, offset: float = 0.0) -> None:
        super().__init__()
        self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim = H, NOPE, ROPE
        self.v_head_dim, self.kv_lora_rank = V, R_KV
        if q_lora:
            self.q_a_proj = nn.Linear(D, R_Q, bias=False, dtype=F64)
            self.q_a_layernorm = RMSNorm(R_Q, offset)
            self.q_b_proj = nn.Linear(R_Q, H * (NOPE + ROPE), bias=False, dtype=F64)
        else:
            self.q_proj = nn.Linear(D, H * (NOPE + ROPE), bias=False, dtype=F64)
        self.kv_a_proj_with_mqa = nn.Linear(D, R_KV + ROPE, bias=False, dtype=F64)
        self.kv_a_layernorm = RMSNorm(R_KV, offset)
        self.kv_b_proj = nn.Linear(R_KV, H * (NOPE + V), bias=False, dtype=F64)
        self.o_proj = nn.Linear(H * V, D, bias=False, dtype=F64)
        if scales:
            self.mla_scale_q_lora, self.mla_scale_kv_lora = (D / R_Q) ** 0.5, (D / R_KV) ** 0.5

    def content_qk(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The content parts q_nope (T, H, n) and k_nope (T, H, n), as the model computes them."""
        if hasattr(self, "q_a_proj"):
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
            q = q * getattr(self, "mla_scale_q_lora", 1.0)
        else:
            q = self.q_proj(x)
        q_nope = q.view(x.shape[0], H, NOPE + ROPE)[..., :NOPE]
        latent = self.kv_a_layernorm(self.kv_a_proj_with_mqa(x)[:, :R_KV])
        latent = latent * getattr(self, "mla_scale_kv_lora", 1.0)
        k_nope = self.kv_b_proj(latent).view(x.shape[0], H, NOPE + V)[..., :NOPE]
        return q_nope, k_nope


def _rms(t: torch.Tensor) -> torch.Tensor:
    return t.pow(2).mean(-1).add(1e-12).sqrt()  # (T,)


@pytest.mark.parametrize(
    "variant", [dict(), dict(q_lora=False), dict(scales=True), dict(offset=1.0)]
)
def test_mla_content_factors_give_the_exact_bilinear_form(variant: dict) -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.attn = MLA(**variant)
    (site,) = find_attention(model)
    assert (site.layout, site.num_heads, site.num_kv_heads, site.head_dim, site.d_model) == (
        "latent",
        H,
        H,
        NOPE,
        D,
    )
    wq, wk = site.factors(dtype=F64)  # (H, d, n) each
    x = torch.randn(9, D, dtype=F64)
    with torch.no_grad():
        q_nope, k_nope = model.attn.content_qk(x)
    attn = model.attn
    q_rms = _rms(attn.q_a_proj(x)) if hasattr(attn, "q_a_proj") else torch.ones(9, dtype=F64)
    kv_rms = _rms(attn.kv_a_proj_with_mqa(x)[:, :R_KV])
    for h in range(H):
        # x W_q,eff,h = q_nope_h * rms_q(x): the per-token 1/rms is outside the bilinear form
        torch.testing.assert_close(x @ wq[h], q_nope[:, h] * q_rms[:, None], rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(
            x @ wk[h], k_nope[:, h] * kv_rms[:, None], rtol=1e-10, atol=1e-12
        )
        dense = (x @ wq[h] @ wk[h].T @ x.T) / (q_rms[:, None] * kv_rms[None, :])  # (T, T)
        torch.testing.assert_close(dense, q_nope[:, h] @ k_nope[:, h].T, rtol=1e-11, atol=1e-12)
    # Snapshots carry the latent weights and norm scales too.
    snapshot = {k: v.detach().clone() for k, v in site.parameters_to_snapshot().items()}
    assert any(k.endswith("kv_a_layernorm.weight") for k in snapshot)
    torch.testing.assert_close(site.factors(snapshot, dtype=F64)[1], wk, rtol=0, atol=0)


def test_mla_without_its_dimensions_names_what_is_missing() -> None:
    model = nn.Module()
    model.attn = MLA()
    del model.attn.v_head_dim
    with pytest.raises(DiscoveryError, match=r"attn \(MLA\).*missing: v_head_dim"):
        find_attention(model)


class GatedQueries(nn.Module):
    """Qwen3NextAttention: q_proj holds [q_h | gate_h] per head."""

    def __init__(self) -> None:
        super().__init__()
        self.head_dim, self.num_heads, self.num_key_value_heads = 4, 4, 2
        self.q_proj = nn.Linear(16, 4 * 4 * 2, dtype=F64)
        self.k_proj = nn.Linear(16, 2 * 4, dtype=F64)
        self.v_proj = nn.Linear(16, 2 * 4, dtype=F64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        query, gate = torch.chunk(self.q_proj(x).view(*x.shape[:-1], -1, self.head_dim * 2), 2, -1)
        return query, gate  # (T, H, d_h) each


def test_gated_queries_are_read_without_their_gates() -> None:
    model = nn.Module()
    model.attn = GatedQueries()
    (site,) = find_attention(model)
    assert (site.layout, site.num_heads, site.num_kv_heads, site.head_dim) == ("gated", 4, 2, 4)
    x = torch.randn(5, 16, dtype=F64)
    query, _ = model.attn(x)
    wq, _ = site.factors(dtype=F64)
    bias = model.attn.q_proj.bias.view(4, 8)[:, :4]  # (H, d_h): the query part of the bias
    for h in range(4):
        torch.testing.assert_close(x @ wq[h] + bias[h], query[:, h], rtol=1e-12, atol=1e-12)
    # An override that would read the gate rows as query heads is refused, with the reason.
    bad = DiscoveryOverrides(attention={"attn": AttentionOverride(num_heads=8)})
    with pytest.raises(DiscoveryError, match="output-gate rows of attn.q_proj as query heads"):
        find_attention(model, bad)


def test_double_width_queries_without_visible_gates_do_not_suggest_num_heads() -> None:
    class Unclear(GatedQueries):
        def forward(self, x: torch.Tensor) -> torch.Tensor:  # no per-head chunk to read
            return self.q_proj(x)

    model = nn.Module()
    model.attn = Unclear()
    with pytest.raises(DiscoveryError, match=r"output gate each.*`exclude` 'attn'") as info:
        find_attention(model)
    assert "AttentionOverride(num_heads" not in str(info.value)


class KimiDeltaLike(nn.Module):
    """Linear attention with q_proj/k_proj: not a softmax QK form."""

    def __init__(self) -> None:
        super().__init__()
        self.num_heads = 2
        self.q_proj, self.k_proj = nn.Linear(16, 8), nn.Linear(16, 8)
        self.A_log = nn.Parameter(torch.zeros(2))


class JetMoeLikeAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(16, 8) for _ in range(2))
        self.kv_proj = nn.Linear(16, 16)


class Quantized(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.packed = nn.Parameter(torch.zeros(8, 4))


class CustomProjAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj = Quantized(), Quantized()


class MambaLikeLayer(nn.Module):  # a decoder layer named like its mixer
    def __init__(self) -> None:
        super().__init__()
        self.mixer = types.new_class("MambaMixer", (nn.Module,))()
        self.mixer.A_log = nn.Parameter(torch.zeros(2))


def test_every_unreadable_attention_like_module_is_named_with_its_kind() -> None:
    model = nn.Module()
    model.linear = KimiDeltaLike()
    model.moa = JetMoeLikeAttention()
    model.custom = CustomProjAttention()
    model.mamba = MambaLikeLayer()
    with pytest.warns(UserWarning) as record:
        assert find_attention(model) == []
    (warning,) = record
    text = str(warning.message)
    assert "linear (KimiDeltaLike) (linear attention" in text
    assert "moa (JetMoeLikeAttention) (per-expert queries" in text
    assert "custom (CustomProjAttention) (custom projections" in text
    assert "mamba.mixer (MambaMixer) (linear attention" in text
    assert "mamba (MambaLikeLayer)" not in text  # its mixer is named, not the layer twice
    quiet = DiscoveryOverrides(exclude=["linear", "moa", "custom", "mamba*"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert find_attention(model, quiet) == []
