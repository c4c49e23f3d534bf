"""Every supported Hugging Face family, end to end, on tiny models built from configs.

For each family (``tests/hf_tiny.py``): the discovered Q/K factors against the queries and
keys the model really hands its attention function, the router probe against the router's
real logits, and the FP32-backward switch against the model's own attention (bit for bit while
off; while on, the same forward and gradients within the model's own eager-vs-sdpa gap).

Queries and keys are compared at position 0, where RoPE is the identity, with all biases
zeroed (factors exclude biases by convention); a QK-norm, MLA's latent norm or YaRN's attention
factor leaves a positive per-token scale, so those are compared as directions (cosine 1), the
others exactly.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from agent import samples as m
from agent.discovery import find_attention, find_routers
from agent.monitors import routing_entropy
from agent.probes import RouterProbe
from remediations.attention_switch import AttentionPrecisionSwitch
from remediations.hf_layers import attention_modules

transformers = pytest.importorskip("transformers")
import hf_tiny  # noqa: E402  (needs transformers)

# family -> (router output index of the logits or None, queries/keys carry a positive per-token
# scale (QK-norm, MLA's latent norm, YaRN's attention factor), switch installer: "hf", "redirect"
# or "auto" (the one the installed transformers' classes call for))
FAMILIES: dict[str, tuple[int | None, bool, str]] = {
    "llama": (None, False, "hf"),
    "qwen3": (None, True, "hf"),
    "gemma3_text": (None, True, "hf"),
    "gpt2": (None, False, "hf"),
    "gpt_neox": (None, False, "hf"),
    "falcon": (None, False, "auto"),  # older transformers: calls torch SDPA itself
    "phi3": (None, False, "hf"),
    "mixtral": (0, False, "hf"),
    "qwen2_moe": (0, False, "hf"),
    "olmoe": (0, True, "hf"),
    "deepseek_v3": (0, True, "hf"),
    "gpt_oss": (0, True, "hf"),  # YaRN scales cos and sin, also at position 0
    "llama4_text": (1, True, "hf"),  # Llama 4's router returns (scores, logits)
}


class _SDPACapture(TorchFunctionMode):
    """Records (query, key) of torch SDPA calls (Falcon computes attention itself)."""

    def __init__(self, out: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        super().__init__()
        self.out = out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.scaled_dot_product_attention:
            self.out.append((args[0].detach(), args[1].detach()))
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def _capture(model: nn.Module) -> Iterator[dict[str, Any]]:
    """Per attention module: its input x (B, L, d) and the (query, key) it attends with."""
    seen: dict[str, Any] = {}
    names = {mod: name for name, mod in model.named_modules()}
    interface = transformers.AttentionInterface
    original = interface.get_interface
    sdpa_calls: list[tuple[torch.Tensor, torch.Tensor]] = []

    def get_interface(self, implementation, default):
        fn = original(self, implementation, default)

        def record(module, query, key, *args, **kwargs):
            seen.setdefault(names[module], {})["qk"] = (query.detach(), key.detach())
            return fn(module, query, key, *args, **kwargs)

        return record

    def pre_hook(module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]
        seen.setdefault(names[module], {})["x"] = x.detach()

    handles = [
        site.module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        for site in find_attention(model)
    ]
    interface.get_interface = get_interface
    try:
        with _SDPACapture(sdpa_calls):
            yield seen
    finally:
        interface.get_interface = original
        for handle in handles:
            handle.remove()
    for site, call in zip(find_attention(model), sdpa_calls, strict=False):
        seen[site.name].setdefault("qk", call)


def _check_factors(model: nn.Module, normed: bool) -> None:
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.zero_()
    sites = find_attention(model)
    assert len(sites) == 2
    ids, pad = hf_tiny.batch()
    with _capture(model) as seen, torch.no_grad():
        model(ids, attention_mask=pad)
    for site in sites:
        x = seen[site.name]["x"][:, 0]  # (B, d) at position 0
        query, key = seen[site.name]["qk"]  # (B, H, L, D), (B, H_kv, L, D)
        wq, wk = site.factors(dtype=torch.float64)  # (H, d, d_h) each, wk paired per query head
        d_h = site.head_dim  # the content part for MLA (the first d_h of each head)
        got_q = torch.einsum("bd,hde->bhe", x, wq)  # (B, H, d_h)
        got_k = torch.einsum("bd,hde->bhe", x, site.factors_kv(dtype=torch.float64))
        real_q, real_k = query[:, :, 0, :d_h], key[:, :, 0, :d_h]
        if key.shape[1] != site.num_kv_heads:  # MLA keys are expanded per head
            real_k = real_k[:, :: site.group_size]
        for got, real in ((got_q, real_q), (got_k, real_k)):
            if normed:
                cos = F.cosine_similarity(got, real, dim=-1)
                torch.testing.assert_close(cos, torch.ones_like(cos), rtol=0, atol=1e-10)
            else:
                torch.testing.assert_close(got, real, rtol=1e-10, atol=1e-12)


def _check_routers(model: nn.Module, index: int) -> None:
    routers = find_routers(model)
    assert routers and all(r.num_experts == hf_tiny.E for r in routers)
    probe = RouterProbe(routers)
    probe.attach()
    real: dict[str, torch.Tensor] = {}
    handles = [
        r.module.register_forward_hook(
            lambda mod, args, out, name=r.name: real.__setitem__(name, out[index].detach())
        )
        for r in routers
    ]
    ids, pad = hf_tiny.batch()
    with torch.no_grad():
        model(ids, attention_mask=pad)
    for handle in handles:
        handle.remove()
    probe.detach()
    entropy = {
        s.label_dict["router"]: s.value for s in probe.read(1) if s.metric == m.ROUTER_ENTROPY
    }
    assert set(entropy) == {r.name for r in routers}
    for name, logits in real.items():
        want = float(routing_entropy(logits.reshape(-1, hf_tiny.E)).mean)
        assert entropy[name] == pytest.approx(want, rel=1e-6), name


def _grads(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    return hf_tiny.run(model, *hf_tiny.batch())


_rel = hf_tiny.relative_error


def _check_switch(model: nn.Module, installer: str) -> None:
    from remediations.hf_attention import install_hf_attention, uninstall_hf_attention
    from remediations.sdpa_redirect import install_sdpa_redirect, uninstall_sdpa_redirect

    if installer == "auto":
        installer = "redirect" if attention_modules(model).calling_torch_sdpa() else "hf"
    implementation = model.config._attn_implementation
    ref, ref_grads = _grads(model)
    gap = 0.0
    if implementation == "sdpa" and installer == "hf":
        model.set_attn_implementation("eager")
        gap = _rel(_grads(model)[1], ref_grads)
        model.set_attn_implementation("sdpa")
    switch = AttentionPrecisionSwitch()
    if installer == "hf":
        install_hf_attention(model, switch=switch)
    else:
        install_sdpa_redirect(model, switch=switch)
    try:
        out, grads = _grads(model)
        assert torch.equal(out, ref)
        assert all(torch.equal(a, b) for a, b in zip(grads, ref_grads, strict=True))
        switch.enable_fp32_backward()
        out, grads = _grads(model)
        assert torch.equal(out, ref)
        assert len(switch.consulted_layers) == 2
        assert _rel(grads, ref_grads) <= 1.01 * gap + 1e-10
    finally:
        uninstall_hf_attention(model)
        uninstall_sdpa_redirect(model)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family(family: str) -> None:
    router_index, normed, installer = FAMILIES[family]
    _check_switch(hf_tiny.tiny(family), installer)
    model = hf_tiny.tiny(family)
    if router_index is not None:
        _check_routers(model, router_index)
    else:
        assert find_routers(model) == []
    _check_factors(model, normed)
