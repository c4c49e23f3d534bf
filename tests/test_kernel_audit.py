"""The kernel audit: the sign asymmetry of an attention call's backward, captured through the
switch-aware wrappers, and the agent's rule on it."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from agent.eventlog import read_events
from agent.testbed.attention import AttentionFault, emulated_attention
from agent.testbed.catalog import BY_NAME
from agent.testbed.supervised import default_agent_config, run_supervised
from remediations.attention_switch import AttentionPrecisionSwitch
from remediations.fp32_attention import scaled_dot_product_attention
from remediations.kernel_audit import KernelAudit, batch_rows, sign_asymmetry


def _emulated(fault: AttentionFault | None):
    return functools.partial(emulated_attention, fault=fault)


def _audited_call(fallback, *, dtype=torch.float32, fp32: bool = False, mask=None, rows=1):
    """One armed call of layer "l0" through the SDPA wrapper and its backward; the capture."""
    switch = AttentionPrecisionSwitch()
    switch.audit.sequences = rows
    if fp32:
        switch.enable_fp32_backward(["l0"])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 4, 24, 8, generator=g).to(dtype).requires_grad_() for _ in "qkv")
    switch.audit.arm(["l0"])
    causal = mask is None
    out = scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, layer="l0", fallback=fallback, switch=switch
    )
    assert not switch.audit.armed("l0")  # one call captured, then disarmed
    (out.float() ** 2).sum().backward()
    (capture,) = switch.audit.take()
    assert capture.rows == rows and capture.upstream is not None
    assert capture.upstream.shape[0] == rows
    return capture


@pytest.mark.parametrize(
    "name, fallback, dtype",
    [
        ("exact fp32", _emulated(None), torch.float32),
        ("round to nearest, 3 bits at dS", _emulated(AttentionFault(bits=3, mode="rne")), None),
        ("away from zero, 4 bits at dS", _emulated(AttentionFault(bits=4, mode="away")), None),
        ("torch SDPA, bf16", F.scaled_dot_product_attention, torch.bfloat16),
        ("torch SDPA, fp16", F.scaled_dot_product_attention, torch.float16),
    ],
)
def test_sign_symmetric_arithmetic_is_exactly_zero(name, fallback, dtype) -> None:
    capture = _audited_call(fallback, dtype=dtype or torch.float32)
    assert sign_asymmetry(capture) == 0.0, name


@pytest.mark.parametrize(
    "fault, low, high",
    [
        (AttentionFault(bits=8, mode="floor"), 5e-4, 5e-3),
        (AttentionFault(bits=4, mode="floor"), 1e-2, 1e-1),
        (AttentionFault(bits=6, mode="ceil"), 2e-3, 3e-2),
        (AttentionFault(sites=("dQK",), bits=6, mode="floor"), 2e-3, 3e-2),
    ],
)
def test_one_way_rounding_leaves_its_bias(fault, low, high) -> None:
    value = sign_asymmetry(_audited_call(_emulated(fault)))
    assert low < value < high
    # The fix: the same kernel with the switch's fp32 backward is exact again.
    assert sign_asymmetry(_audited_call(_emulated(fault), fp32=True)) == 0.0


def test_a_per_row_mask_is_sliced_with_the_rows() -> None:
    mask = torch.ones(3, 1, 24, 24, dtype=torch.bool).tril()
    mask[1:, :, :, :4] = False  # rows 1 and 2 differ from row 0
    assert batch_rows(mask, 2, 3).shape[0] == 2
    assert batch_rows(mask[:1], 2, 3).shape[0] == 1  # broadcast over the batch: as it is
    assert batch_rows(mask[0, 0], 2, 3).dim() == 2  # (L, S): as it is
    switch = AttentionPrecisionSwitch()
    switch.audit.sequences = 2
    q, k, v = (torch.randn(3, 4, 24, 8, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    switch.audit.arm(["l0"])
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, layer="l0", switch=switch)
    out.sum().backward()
    (capture,) = switch.audit.take()
    replayed = capture.replay(capture.query, capture.key, capture.value)
    torch.testing.assert_close(replayed, out[:2].detach(), rtol=1e-12, atol=1e-12)
    assert sign_asymmetry(capture) == 0.0


def test_an_evaluation_forward_leaves_the_layer_armed() -> None:
    audit = KernelAudit()
    switch = AttentionPrecisionSwitch()
    switch.audit = audit
    audit.arm(["l0"])
    q = torch.randn(2, 2, 8, 4)
    with torch.no_grad():
        scaled_dot_product_attention(q, q, q, is_causal=True, layer="l0", switch=switch)
    assert audit.armed("l0") and audit.take() == []


def test_hf_dispatcher_captures_the_models_own_call() -> None:
    pytest.importorskip("transformers")
    import hf_tiny

    from remediations.hf_attention import install_hf_attention, uninstall_hf_attention

    model = hf_tiny.tiny("llama")
    ids, pad = hf_tiny.batch()
    switch = AttentionPrecisionSwitch()
    install_hf_attention(model, switch=switch)
    try:
        switch.audit.arm(["model.layers.1.self_attn"])
        hf_tiny.run(model, ids, pad)
        (capture,) = switch.audit.take()
        assert capture.layer == "model.layers.1.self_attn"
        assert sign_asymmetry(capture) == 0.0  # torch's SDPA: round to nearest
        assert switch.audit.unaudited == {}
    finally:
        uninstall_hf_attention(model)


def _asymmetry(run_dir: Path) -> dict[int, float]:
    out = {}
    for e in read_events(run_dir / "events.jsonl", "metrics"):
        for step, name, _, value in e["samples"]:
            if name == "attention_backward_asymmetry":
                out[step] = value
    return out


def test_agent_pages_a_biased_kernel_at_the_first_audit_after_its_onset(tmp_path: Path) -> None:
    """The test bed, 8-bit floor rounding of dS from step 100 (the weakest catalogue fault),
    audits every 25 steps: paged fa_precision at the first audit that captured a faulty call
    (the arming at 100 captures step 101's call); the clean run audits to exactly 0."""
    faulty = BY_NAME["fa_floor_8"].config(0).model_copy(update={"steps": 160, "fault_start": 100})
    config = default_agent_config(
        tmp_path / "fa", remediate=False, kernel_audit={"every": 25}, checkpoints={"enabled": False}
    )
    result = run_supervised(faulty, config)
    values = _asymmetry(tmp_path / "fa")
    assert [s for s, v in values.items() if v > 0] == [s for s in values if s > 100]
    assert min(v for s, v in values.items() if s > 100) > 1e-4
    assert result.first_alert_rule["attention_backward_one_way_rounding"] == 101
    assert result.incidents and result.incidents[0]["family"] == "fa_precision"

    clean = BY_NAME["clean"].config(0).model_copy(update={"steps": 130})
    config = default_agent_config(
        tmp_path / "clean",
        remediate=False,
        kernel_audit={"every": 25},
        checkpoints={"enabled": False},
    )
    result = run_supervised(clean, config)
    values = _asymmetry(tmp_path / "clean")
    assert len(values) == 6 and set(values.values()) == {0.0}  # steps 1, 26, ..., 126
    assert "attention_backward_one_way_rounding" not in result.first_alert_rule


def test_torch_compile_captures_and_stops_recompiling() -> None:
    """Arming and disarming a layer every few calls: each armed call is captured, and the
    compiled function settles on its armed and unarmed graphs (measured: 4 frames by the
    fourth call, none after), no recompile per audit."""
    from torch._dynamo.testing import CompileCounter

    switch = AttentionPrecisionSwitch()

    def attention(q, k, v):
        return scaled_dot_product_attention(q, k, v, is_causal=True, layer="l0", switch=switch)

    counter = CompileCounter()
    compiled = torch.compile(attention, backend=counter)
    q, k, v = (torch.randn(2, 2, 8, 4, dtype=torch.float64, requires_grad=True) for _ in "qkv")
    d_out = torch.randn(2, 2, 8, 4, dtype=torch.float64)
    frames = []
    for call in range(12):
        if call % 3 == 0:
            switch.audit.arm(["l0"])
        torch.autograd.grad(compiled(q, k, v), (q, k, v), d_out)
        captures = switch.audit.take()
        assert len(captures) == (call % 3 == 0)
        assert all(sign_asymmetry(c) == 0.0 for c in captures)
        frames.append(counter.frame_count)
    assert frames[-1] == frames[5] <= 6


def test_probe_says_once_when_no_layer_reaches_a_wrapper_and_drops_an_unreached_one() -> None:
    from agent.kernel_audit_probe import KernelAuditProbe

    said: list[tuple[str, str]] = []
    audit = KernelAudit()
    probe = KernelAuditProbe(audit, ["a", "b"], 10, 1, lambda what, text: said.append((what, text)))
    assert probe.on_step(0) == [] and audit.pending() == {"a"}
    for step in range(1, 21):  # "a" is never called: no layer ever reached a wrapper
        assert probe.on_step(step) == []
    assert probe.layers == [] and audit.pending() == frozenset()
    assert len(said) == 1 and said[0][1].startswith("no attention layer is audited")

    # One layer measured, the other never called: only that one is dropped, said once.
    said.clear()
    switch = AttentionPrecisionSwitch()
    probe = KernelAuditProbe(switch.audit, ["l0", "b"], 10, 1, lambda w, t: said.append((w, t)))
    probe.on_step(0)  # arms l0
    q = torch.randn(2, 2, 8, 4, requires_grad=True)
    out = scaled_dot_product_attention(q, q, q, is_causal=True, layer="l0", switch=switch)
    out.sum().backward()
    (sample,) = probe.on_step(1)
    assert sample.metric == "attention_backward_asymmetry" and sample.value == 0.0
    probe.on_step(10)  # arms b
    probe.on_step(20)  # b was never called
    assert probe.layers == ["l0"] and len(said) == 1 and said[0][1].startswith("b is not")


def _call_layer(switch: AttentionPrecisionSwitch, name: str, fault=None) -> None:
    """One training call of attention layer ``name`` (as its wrapper calls it) and its
    backward."""
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g).requires_grad_() for _ in "qkv")
    out = scaled_dot_product_attention(
        q, k, v, is_causal=True, layer=name, switch=switch, fallback=_emulated(fault)
    )
    out.square().sum().backward()


def test_probe_arms_a_layer_by_the_name_its_wrapper_calls_it() -> None:
    """The agent found "module.blocks.0.attn" (a DDP-wrapped model) while the wrapper calls it
    "blocks.0.attn" (named before wrapping): the audit is armed under the wrapper's name, and
    the sample is labelled with the agent's."""
    from agent.kernel_audit_probe import KernelAuditProbe

    switch = AttentionPrecisionSwitch()
    probe = KernelAuditProbe(
        switch.audit, ["module.blocks.0.attn"], 5, 1, lambda w, t: None,
        call_names=lambda: switch.consulted_layers,
    )  # fmt: skip
    _call_layer(switch, "blocks.0.attn")  # the first step: the wrapper asks the switch
    probe.on_step(0)
    assert switch.audit.pending() == {"blocks.0.attn"}
    _call_layer(switch, "blocks.0.attn", AttentionFault(bits=4, mode="floor"))
    (sample,) = probe.on_step(1)
    assert sample.label_dict == {"layer": "module.blocks.0.attn"} and sample.value > 1e-3


def test_a_result_in_flight_from_a_device_is_taken_apply_lag_steps_later(monkeypatch) -> None:
    """From a GPU the audit's two numbers travel to the host without a wait (HostRead): the
    sample keeps its audit's step and reaches the rules ``lag`` steps later. Here a CPU read
    that says it is in flight stands for the CUDA copy."""
    import agent.kernel_audit_probe as probe_module
    from agent.host_read import HostRead

    class InFlight(HostRead):
        in_flight = True

    monkeypatch.setattr(probe_module, "HostRead", InFlight)
    switch = AttentionPrecisionSwitch()
    probe = probe_module.KernelAuditProbe(switch.audit, ["l0"], 10, 1, lambda w, t: None, lag=3)
    probe.on_step(0)
    _call_layer(switch, "l0", AttentionFault(bits=4, mode="floor"))
    assert [probe.on_step(s) for s in (1, 2, 3)] == [[], [], []]
    (sample,) = probe.on_step(4)
    assert sample.step == 1 and sample.value > 1e-3
    probe.on_step(10)  # the next audit, measured at 11; a rollback drops it before it arrives
    _call_layer(switch, "l0")
    assert probe.on_step(11) == []
    probe.restart()
    assert [probe.on_step(s) for s in (12, 13, 14, 15)] == [[], [], [], []]


@pytest.mark.parametrize(
    ("layers", "config", "every", "warned"),
    [
        (1, {}, 50, False),  # at most 50: one layer is audited every 50 steps
        (2, {}, 50, False),  # the test bed
        (3, {}, 33, False),  # every layer within 99 steps
        (32, {}, 3, False),
        (150, {}, 1, True),  # 150 layers cannot all be audited within 100 steps: said
        (4, {"every": 50}, 50, True),  # the user's cadence, 200 steps a layer: said
        (4, {"every": 50, "sweep_steps": 200}, 50, False),
    ],
)
def test_every_layer_is_audited_within_sweep_steps_or_the_agent_says_so(
    layers, config, every, warned
) -> None:
    from agent.config import KernelAuditConfig
    from agent.distributed.world import World
    from agent.kernel_audit_probe import build_kernel_audit

    said: list[tuple[str, str]] = []
    names = [f"layers.{i}.attn" for i in range(layers)]
    probe, state = build_kernel_audit(
        KernelAuditConfig.model_validate(config),
        names,
        AttentionPrecisionSwitch(),
        World(0, 1),
        report=lambda what, text: said.append((what, text)),
    )
    assert state == "on" and probe is not None and probe.every == every
    assert bool(said) == warned
    if warned:
        assert f"audited every {every * layers} steps" in said[0][1]


def test_the_audit_is_blind_to_a_forward_value_rounded_one_way_and_read_linearly() -> None:
    """A documented blind spot: O rounded toward -inf where delta = rowsum(dO * O) reads it
    (the test bed's O_delta site) is an error that is itself odd in dO, so the audit reads
    exactly 0 although the gradient differs from the exact one (benign at this scale:
    shared/FINDINGS.md)."""
    fault = AttentionFault(sites=("O_delta",), bits=3, mode="floor")
    capture = _audited_call(_emulated(fault))
    assert sign_asymmetry(capture) == 0.0
    exact = _audited_call(_emulated(None))
    with torch.enable_grad():
        grads = []
        for c in (capture, exact):
            q, k, v = (t.detach().requires_grad_() for t in (c.query, c.key, c.value))
            grads.append(torch.autograd.grad(c.replay(q, k, v), q, c.upstream)[0])
    assert not torch.equal(grads[0], grads[1])  # the fault is there; the audit cannot see it


def test_a_model_that_calls_torch_sdpa_itself_is_audited_through_the_redirect() -> None:
    """Research code calls torch's SDPA in its own forward: ``install_sdpa_redirect`` routes
    those calls through the switch's wrapper under the module's name, and the audit reaches
    them (torch's SDPA rounds to nearest: exactly 0)."""
    from agent.kernel_audit_probe import KernelAuditProbe
    from remediations.sdpa_redirect import install_sdpa_redirect

    class SelfAttention(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.qkv = torch.nn.Linear(16, 48, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, T, 16)
            q, k, v = (t.view(*x.shape[:2], 2, 8).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
            return F.scaled_dot_product_attention(q, k, v, is_causal=True).sum()

    model = torch.nn.Sequential(SelfAttention())
    switch = AttentionPrecisionSwitch()
    assert install_sdpa_redirect(model, ["0"], switch=switch) == ["0"]
    said: list[tuple[str, str]] = []
    probe = KernelAuditProbe(
        switch.audit, ["0"], 5, 1, lambda w, t: said.append((w, t)),
        call_names=lambda: switch.consulted_layers,
    )  # fmt: skip
    x = torch.randn(2, 12, 16)
    model(x).backward()
    probe.on_step(0)
    model(x).backward()
    (sample,) = probe.on_step(1)
    assert sample.label_dict == {"layer": "0"} and sample.value == 0.0 and said == []
