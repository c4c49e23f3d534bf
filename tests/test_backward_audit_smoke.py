"""benchmarks/backward_audit.py: the error-shape statistic and one audit of a test-bed step."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from backward_audit import audit_testbed_layer, error_shape  # noqa: E402

from agent.testbed.attention import AttentionFault  # noqa: E402


def test_error_shape_random_walk_and_coherent_push() -> None:
    g = torch.Generator().manual_seed(0)
    n, d_out, d_in = 4096, 32, 16
    x = torch.randn(n, d_in, generator=g, dtype=torch.float64)
    grad = torch.randn(n, d_out, generator=g, dtype=torch.float64)
    noise = 1e-3 * torch.randn(n, d_out, generator=g, dtype=torch.float64)
    random = error_shape(noise, x, grad, grad + noise, -grad + noise)
    assert random.coherence == pytest.approx(1.0, abs=0.05)
    # The same error at every token, on the same input: a push that adds up, A = sqrt(n).
    same_x = x[:1].expand(n, d_in)
    push = error_shape(noise[:1].expand(n, d_out), same_x, grad, grad, -grad)
    assert push.coherence == pytest.approx(n**0.5, rel=1e-9)
    # e is the weight-gradient error against the weight gradient, in float64.
    expected = (noise.T @ x).norm() / (grad.T @ x).norm()
    assert random.size == pytest.approx(float(expected), rel=1e-12)
    # The even part of the kernel's map dy -> dW against its odd part: 0 for an odd map.
    assert push.asymmetry == 0.0
    assert random.asymmetry == pytest.approx(float(expected), rel=1e-12)


def _captured_step() -> dict:
    """One test-bed step's layer-0 attention input, weights and upstream gradient."""
    from agent.testbed.catalog import BY_NAME
    from agent.testbed.runner import TestbedRun

    torch.manual_seed(0)
    run = TestbedRun(BY_NAME["clean"].config(0), record_monitors=False)
    attn = next(iter(run.model.attention_modules()))
    cap: dict = {"heads": attn.num_heads}

    def before(module, args) -> None:
        cap["x"] = args[0].detach().clone()
        cap["w"] = [
            p.weight.detach().clone() for p in (module.q_proj, module.k_proj, module.v_proj)
        ]

    def upstream(_, args) -> None:
        args[0].register_hook(lambda grad: cap.__setitem__("dy", grad.detach().clone()))

    attn.register_forward_pre_hook(before)
    attn.o_proj.register_forward_pre_hook(upstream)
    run.step()
    return cap


def test_audit_separates_a_biased_backward_from_unbiased_rounding() -> None:
    cap = _captured_step()
    exact = audit_testbed_layer(cap, None)
    floor = audit_testbed_layer(cap, AttentionFault(sites=("dS",), bits=8, mode="floor"))
    rne = audit_testbed_layer(cap, AttentionFault(sites=("dS",), bits=3, mode="rne"))
    for proj in ("q", "k"):
        assert exact[f"own.{proj}"].size < 1e-5  # fp32 against float64
        assert floor[f"own.{proj}"].coherence > 1.4  # a bias adds up over the tokens (1.6-1.75)
        assert floor[f"own.{proj}"].size > 1e-3
        assert rne[f"own.{proj}"].coherence < 1.2  # 3 bits, but unbiased: a random walk
        assert rne[f"own.{proj}"].size > floor[f"own.{proj}"].size  # larger, yet harmless
        # Sign symmetry, without a reference: exact for round-to-nearest, broken by floor.
        assert exact[f"own.{proj}"].asymmetry == 0.0
        assert rne[f"own.{proj}"].asymmetry == 0.0
        assert floor[f"own.{proj}"].asymmetry > 1e-3
        for real in ("sdpa_bf16", "sdpa_fp16"):  # torch's own kernels: unbiased
            assert floor[f"{real}.{proj}"].coherence < 1.2
            assert 1e-4 < floor[f"{real}.{proj}"].size < 0.2  # fp16 underflows: ~5e-2
            assert floor[f"{real}.{proj}"].asymmetry == 0.0
