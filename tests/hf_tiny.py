"""Tiny randomly initialised Hugging Face models built from configs (no downloads), for tests.

``tiny(model_type)`` builds a 2-layer model of width 32 for each family the tests cover, in
float64 and training mode, with the MoE experts on their eager path (grouped matmuls do not
take float64). Importing this module imports transformers: use it behind
``pytest.importorskip("transformers")``.
"""

from __future__ import annotations

from typing import Any

import torch
import transformers

V, D, H, HKV, DH, E = 64, 32, 4, 2, 8, 4  # vocab, width, heads, KV heads, head dim, experts

_COMMON: dict[str, Any] = dict(
    vocab_size=V,
    hidden_size=D,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=H,
    num_key_value_heads=HKV,
    head_dim=DH,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
_MOE: dict[str, Any] = dict(num_experts_per_tok=2, moe_intermediate_size=16)
_MLA: dict[str, Any] = dict(
    q_lora_rank=12,
    kv_lora_rank=10,
    qk_nope_head_dim=6,
    qk_rope_head_dim=4,
    v_head_dim=5,
    num_key_value_heads=H,
    head_dim=None,  # MLA's rotary part is qk_rope_head_dim wide
)

# model_type -> config keywords (on top of _COMMON unless the family names things differently).
CONFIGS: dict[str, dict[str, Any]] = {
    "llama": {},
    "qwen3": {},
    "gemma2": dict(attn_logit_softcapping=5.0, sliding_window=4),
    "gemma3_text": dict(sliding_window=4),
    "phi3": dict(num_key_value_heads=H, head_dim=None),
    "mixtral": dict(num_local_experts=E, num_experts_per_tok=2),
    "qwen2_moe": dict(_MOE, num_experts=E, shared_expert_intermediate_size=16),
    "olmoe": dict(num_experts=E, num_experts_per_tok=2),
    "gpt_oss": dict(num_local_experts=E, num_experts_per_tok=2, sliding_window=4),
    "llama4_text": dict(_MOE, num_local_experts=E, num_experts_per_tok=1, intermediate_size_mlp=48),
    "deepseek_v3": {
        **_MOE,
        **_MLA,
        **dict(n_routed_experts=E, n_group=1, topk_group=1, first_k_dense_replace=1),
    },
}
# Families whose configs use other names: the full keyword set.
RAW: dict[str, dict[str, Any]] = {
    "gpt2": dict(
        vocab_size=V,
        n_embd=D,
        n_layer=2,
        n_head=H,
        n_positions=64,
        bos_token_id=1,
        attn_pdrop=0.0,  # dropout has tests of its own
        resid_pdrop=0.0,
        embd_pdrop=0.0,
    ),
    "gpt_neox": dict(
        vocab_size=V,
        hidden_size=D,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=H,
        max_position_embeddings=64,
        bos_token_id=1,
        eos_token_id=2,
    ),
    "falcon": dict(
        vocab_size=V,
        hidden_size=D,
        num_hidden_layers=2,
        num_attention_heads=H,
        num_kv_heads=HKV,
        new_decoder_architecture=True,
    ),
}


def config(model_type: str, **overrides: Any) -> transformers.PretrainedConfig:
    if model_type in RAW:
        kwargs = dict(RAW[model_type])
    else:
        kwargs = {**_COMMON, **CONFIGS.get(model_type, {})}
    kwargs.update(overrides)
    kwargs = {k: v for k, v in kwargs.items() if v is not None}
    if model_type == "gpt2":
        kwargs["eos_token_id"] = 2
    return transformers.AutoConfig.for_model(model_type, **kwargs)


def tiny(model_type: str, seed: int = 0, **overrides: Any) -> torch.nn.Module:
    """A tiny float64 causal LM of family ``model_type`` in training mode."""
    cfg = config(model_type, **overrides)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).double().train()
    if hasattr(model, "set_experts_implementation"):
        try:
            model.set_experts_implementation("eager")
        except (ValueError, NotImplementedError):
            pass
    with torch.no_grad():  # zero-initialised extras (sinks, biases) get values
        for name, p in model.named_parameters():
            if name.endswith("sinks") or name.endswith("e_score_correction_bias"):
                p.normal_()
    return model


def batch(seed: int = 0, length: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids (2, length) and a padding mask with the second row padded at the end."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (2, length), generator=g)
    pad = torch.ones(2, length, dtype=torch.long)
    pad[1, -3:] = 0
    return ids, pad


def run(model: torch.nn.Module, ids: torch.Tensor, pad: torch.Tensor) -> tuple[torch.Tensor, list]:
    """The logits of the real tokens and the gradients of their squared sum w.r.t. every
    trainable parameter (zeros for parameters the loss does not reach)."""
    out = model(ids, attention_mask=pad).logits[pad.bool()]
    params = [p for p in model.parameters() if p.requires_grad]
    grads = torch.autograd.grad(out.square().sum(), params, allow_unused=True)
    return out, [
        torch.zeros_like(p) if g is None else g for p, g in zip(params, grads, strict=True)
    ]


def relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest ||a - b|| / ||b|| over paired tensors."""
    pairs = zip(got, want, strict=True)
    return max(float((a - b).norm() / b.norm().clamp_min(1e-300)) for a, b in pairs)
