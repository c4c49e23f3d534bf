"""A small decoder-only transformer with MoE feed-forward layers, in plain PyTorch.

Pre-norm blocks: x + attn(ln1(x)), then x + moe(ln2(x)). Module names follow the usual
Hugging Face layout so that discovery finds them by name:

    blocks.{i}.attn.q_proj / k_proj / v_proj / o_proj   nn.Linear, q: [H*d_h, d], k/v: [H_kv*d_h, d]
    blocks.{i}.moe.gate                                   nn.Linear(d, E), the router (softmax)
    blocks.{i}.moe.experts                                nn.ModuleList of E two-layer MLPs

Attention goes through ``remediations.attention.scaled_dot_product_attention`` (so that the
agent can switch one layer to an FP32 backward) with :func:`emulated_attention` as the
fallback; the fault that fallback emulates is ``attn.fault`` (None = exact backward).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, model_validator
from torch import Tensor, nn

from agent.testbed.attention import AttentionFault, emulated_attention

try:  # the agent's switchable attention (FP32-backward remediation)
    from remediations.attention import scaled_dot_product_attention as _switchable_sdpa
except ImportError:  # not installed yet: call the fallback directly
    _switchable_sdpa = None


class TestbedConfig(BaseModel):
    """Shape of the test-bed transformer."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    __test__ = False  # not a pytest test class

    vocab: int = Field(256, ge=2, description="vocabulary size")
    d_model: int = Field(64, ge=1, description="residual width d")
    n_layers: int = Field(2, ge=1, description="transformer blocks")
    n_heads: int = Field(4, ge=1, description="query heads H")
    n_kv_heads: int = Field(4, ge=1, description="key/value heads H_kv (divides H; < H is GQA)")
    n_experts: int = Field(8, ge=1, description="experts E per MoE layer")
    top_k: int = Field(2, ge=1, description="experts per token")
    d_expert: int = Field(128, ge=1, description="hidden width of one expert MLP")
    seq_len: int = Field(64, ge=1, description="context length T")
    balance_coef: float = Field(0.01, ge=0.0, description="load-balancing loss weight (0 = off)")
    router_z_coef: float = Field(
        0.01, ge=0.0, description="router z-loss weight, mean logsumexp(logits)^2 (0 = off)"
    )
    norm_topk: bool = Field(True, description="renormalize the top-k routing weights to sum 1")
    init_std: float = Field(0.02, gt=0.0, description="std of the normal weight init")

    @model_validator(mode="after")
    def _check_shapes(self) -> TestbedConfig:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads ({self.n_heads}) must be divisible by n_kv_heads ({self.n_kv_heads})"
            )
        if self.top_k > self.n_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= n_experts ({self.n_experts})")
        return self

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


class CausalSelfAttention(nn.Module):
    def __init__(self, config: TestbedConfig, name: str) -> None:
        super().__init__()
        self.name = name  # module path, e.g. "blocks.0.attn": the remediation's layer key
        self.num_heads = config.n_heads
        self.num_kv_heads = config.n_kv_heads
        self.head_dim = config.head_dim
        d, d_h = config.d_model, config.head_dim
        self.q_proj = nn.Linear(d, self.num_heads * d_h, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * d_h, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * d_h, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d_h, d, bias=False)
        self.scale = 1.0 / math.sqrt(d_h)
        self.fault: AttentionFault | None = None

    def forward(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B,H,T,d_h)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.num_kv_heads != self.num_heads:  # GQA: each KV head serves H / H_kv queries
            groups = self.num_heads // self.num_kv_heads
            k = k.repeat_interleave(groups, dim=1)  # (B, H, T, d_h)
            v = v.repeat_interleave(groups, dim=1)
        fallback: Callable[..., Tensor] = functools.partial(emulated_attention, fault=self.fault)
        if _switchable_sdpa is not None:
            y = _switchable_sdpa(
                q, k, v, is_causal=True, scale=self.scale, layer=self.name, fallback=fallback
            )
        else:
            y = fallback(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=True, scale=self.scale)
        y = y.transpose(1, 2).reshape(b, t, self.num_heads * self.head_dim)  # (B, T, H*d_h)
        return self.o_proj(y)


class ExpertMLP(nn.Module):
    def __init__(self, d_model: int, d_hidden: int) -> None:
        super().__init__()
        self.up_proj = nn.Linear(d_model, d_hidden, bias=False)
        self.down_proj = nn.Linear(d_hidden, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.gelu(self.up_proj(x)))


class MoEFeedForward(nn.Module):
    """Softmax router over E experts, top-k dispatch, weights renormalized over the top k."""

    def __init__(self, config: TestbedConfig) -> None:
        super().__init__()
        self.num_experts = config.n_experts
        self.top_k = config.top_k
        self.norm_topk = config.norm_topk
        self.gate = nn.Linear(config.d_model, config.n_experts, bias=False)
        self.experts = nn.ModuleList(
            ExpertMLP(config.d_model, config.d_expert) for _ in range(config.n_experts)
        )

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x (B, T, d) -> (y (B, T, d), Switch load-balancing loss (scalar, 1.0 when uniform),
        router z-loss (scalar): mean over tokens of logsumexp(logits)^2, ST-MoE)."""
        b, t, d = x.shape
        flat = x.reshape(b * t, d)  # (N, d)
        logits = self.gate(flat)  # (N, E)
        probs = torch.softmax(logits.float(), dim=-1)  # (N, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)  # (N, k)
        if self.norm_topk:
            top_p = top_p / top_p.sum(dim=-1, keepdim=True)
        weights = top_p.to(x.dtype)  # (N, k)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(top_i == e, as_tuple=True)  # tokens routed to e
            out.index_add_(0, rows, expert(flat[rows]) * weights[rows, slot].unsqueeze(1))
        # Switch Transformer balancing loss: E * sum_e (assignment fraction_e * mean prob_e).
        assigned = torch.zeros(self.num_experts, device=x.device, dtype=torch.float32)
        assigned.scatter_add_(
            0, top_i.reshape(-1), torch.ones_like(top_i.reshape(-1), dtype=torch.float32)
        )
        fraction = assigned / top_i.numel()  # (E,)
        balance = self.num_experts * torch.sum(fraction * probs.mean(dim=0))
        z_loss = torch.logsumexp(logits.float(), dim=-1).square().mean()
        return out.view(b, t, d), balance, z_loss


class Block(nn.Module):
    def __init__(self, config: TestbedConfig, index: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = CausalSelfAttention(config, name=f"blocks.{index}.attn")
        self.ln2 = nn.LayerNorm(config.d_model)
        self.moe = MoEFeedForward(config)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        x = x + self.attn(self.ln1(x))
        y, balance, z_loss = self.moe(self.ln2(x))
        return x + y, balance, z_loss


class MoETransformer(nn.Module):
    """Token ids (B, T) -> (next-token logits (B, T, V), auxiliary router loss (scalar)).

    The auxiliary loss is the layer mean of ``balance_coef * balancing + router_z_coef * z``.
    """

    def __init__(self, config: TestbedConfig) -> None:
        super().__init__()
        self.config = config
        self.balance_coef = config.balance_coef  # mutable: a router fault may switch it off
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq_len, config.d_model)
        self.blocks = nn.ModuleList(Block(config, i) for i in range(config.n_layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.lm_head = nn.Linear(config.d_model, config.vocab, bias=False)
        self._init_weights()

    def _init_weights(self) -> None:
        std = self.config.init_std
        residual_std = std / math.sqrt(2 * self.config.n_layers)  # GPT-2 residual scaling
        for name, p in self.named_parameters():
            if p.dim() < 2:
                continue  # LayerNorm weights and biases keep their defaults
            is_residual_out = name.endswith(("o_proj.weight", "down_proj.weight"))
            nn.init.normal_(p, mean=0.0, std=residual_std if is_residual_out else std)

    def attention_modules(self) -> list[CausalSelfAttention]:
        return [block.attn for block in self.blocks]

    def moe_modules(self) -> list[MoEFeedForward]:
        return [block.moe for block in self.blocks]

    def set_attention_fault(
        self, fault: AttentionFault | None, layers: tuple[int, ...] | None = None
    ) -> None:
        """Emulate ``fault`` in the attention backward of ``layers`` (None: every layer) from
        the next forward on; the other layers get the exact backward."""
        for i, attn in enumerate(self.attention_modules()):
            attn.fault = fault if layers is None or i in layers else None

    def forward(self, idx: Tensor) -> tuple[Tensor, Tensor]:
        b, t = idx.shape
        if t > self.config.seq_len:
            raise ValueError(f"sequence length {t} exceeds seq_len {self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)  # (B, T, d)
        balance_total = x.new_zeros(())
        z_total = x.new_zeros(())
        for block in self.blocks:
            x, balance, z_loss = block(x)
            balance_total = balance_total + balance
            z_total = z_total + z_loss
        logits = self.lm_head(self.ln_f(x))  # (B, T, V)
        weighted = self.balance_coef * balance_total + self.config.router_z_coef * z_total
        aux = weighted / len(self.blocks)
        return logits, aux
