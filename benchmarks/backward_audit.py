"""Is the attention backward's arithmetic biased? A direct test, measured (issue 13).

    python benchmarks/backward_audit.py testbed --seeds 113 --scenarios clean fa_floor_8 ...
        [--steps 1500] [--every 100] [--out FILE]
    python benchmarks/backward_audit.py llama --seeds 81 --faults floor:6 rne:6 ...
        [--steps 401] [--every 100] [--out FILE]

H(Delta_2) sees a biased attention backward only once the bias has bent the weights; on the
small test bed that is about when the loss moves (``qk_twin_separation.py``). This measures a
signal of the arithmetic itself: at an audit step, the attention's Q and K weight gradients
computed by the run's own kernel and by an exact reference *on the same inputs and the same
upstream gradient*, and how their difference is built.

Per attention layer and projection P (q, k), with x_t the projection's input and e_t the error
of the gradient w.r.t. its output at token t (kernel - reference; pre-RoPE on the Llama),
E = sum_t e_t x_t^T the error of dW_P:

- ``A``, the error's coherence: ||E||_F / sqrt(sum_t ||e_t||^2 ||x_t||^2). Errors that do not
  agree from token to token (unbiased rounding, of any precision) add like a random walk: A
  near 1. A bias pushes every token's error the same way: A grows toward sqrt(tokens). A is
  scale-free: it does not know or need the kernel's precision.
- ``e``, the error's size: ||E||_F / ||dW_P||_F of the reference (what a coherent error
  weighs against the gradient it rides on).
- ``s``, the kernel's sign asymmetry, which needs no reference: the attention backward is
  linear in the upstream gradient dy, and arithmetic that rounds symmetrically in sign (round
  to nearest, which real kernels use; also rounding toward or away from zero) keeps it odd
  bit for bit: dW(-dy) = -dW(dy). Rounding that always goes one way (floor, ceil) breaks it.
  s = ||dW(dy) + dW(-dy)||_F / ||dW(dy) - dW(-dy)||_F, the even part (the bias the rounding
  added) against the odd part (the gradient): exactly 0 for a sign-symmetric kernel with a
  fixed accumulation order, about the bias's relative size for a one-way rounding. It is
  blind to an error that is itself odd in dy (a forward value rounded and read linearly, like
  O in delta = rowsum(dO * O): the test bed's ``O_delta`` site).

Kernels. ``testbed``: the scenario's own attention backward (the catalogue's emulated
arithmetic; exact fp32 outside a fault), measured against float64; and, on the same captured
q, k, v and upstream gradient, torch's own scaled_dot_product_attention in bf16 and fp16
(real kernels, unbiased by design) against float64 on the same rounded inputs. ``llama``: a
module replay (the attention module run again on the step's captured inputs, before the
optimizer step) with the run's fault against the same module with the exact backward; the
gradient taken at the Q and K projections' outputs, so RoPE is undone by autograd itself.

Nothing here is a rule or a monitor; it measures whether an audit of the kernel separates a
biased backward from unbiased low precision and healthy change, at every training phase.
Results: ``benchmarks/results/backward_audit.md``.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.testbed.attention import AttentionFault, emulated_attention, reference_attention


@dataclass(frozen=True)
class ErrorShape:
    """How an error of a projection's weight gradient is built (see the module docstring)."""

    coherence: float  # A: 1 for errors that do not agree across tokens, up to sqrt(tokens)
    size: float  # e: ||E||_F / ||dW||_F of the reference
    asymmetry: float  # s: ||dW(dy) + dW(-dy)||_F / ||dW(dy) - dW(-dy)||_F of the kernel


def error_shape(
    error: torch.Tensor,
    inputs: torch.Tensor,
    reference: torch.Tensor,
    plus: torch.Tensor,
    minus: torch.Tensor,
) -> ErrorShape:
    """Per token (N rows): ``error`` (kernel - reference), ``reference``, and the kernel's
    output gradients under the upstream gradient (``plus``) and its negation (``minus``), all
    (N, d_out); ``inputs``: (N, d_in), the projection's input."""
    e, x, g = error.double(), inputs.double(), reference.double()
    weight_error = e.T @ x  # (d_out, d_in)
    random_walk = torch.sqrt(((e**2).sum(1) * (x**2).sum(1)).sum())
    gradient = (g.T @ x).norm()
    coherence = float(weight_error.norm() / random_walk) if random_walk > 0 else float("nan")
    even = ((plus.double() + minus.double()).T @ x).norm()  # 0 for sign-symmetric arithmetic
    odd = ((plus.double() - minus.double()).T @ x).norm()
    return ErrorShape(coherence, float(weight_error.norm() / gradient), float(even / odd))


# -- the test bed: function-level audit (no RoPE: the head-space gradient is the projection's) --
REAL_KERNELS = {"sdpa_bf16": torch.bfloat16, "sdpa_fp16": torch.float16}


def _heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, d = t.shape
    return t.view(b, n, heads, d // heads).transpose(1, 2)  # (B, H, T, d_h)


def _tokens(t: torch.Tensor) -> torch.Tensor:
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h * d)  # (B*T, H*d_h)


def audit_testbed_layer(capture: dict, fault: AttentionFault | None) -> dict[str, ErrorShape]:
    """One layer's audit from the step's captured input x (B, T, d), weights and upstream
    gradient dy (B, T, H*d_h) of the attention output (before ``o_proj``). MHA only."""
    x, heads = capture["x"].double(), capture["heads"]
    q, k, v = (_heads(x @ w.double().T, heads) for w in capture["w"])
    dy = _heads(capture["dy"].double(), heads)
    scale = 1.0 / math.sqrt(q.shape[-1])
    tokens = x.reshape(-1, x.shape[-1])
    out: dict[str, ErrorShape] = {}
    kernels: dict[str, tuple[torch.dtype, Callable[..., torch.Tensor]]] = {
        "own": (
            torch.float32,
            lambda a, b, c: emulated_attention(a, b, c, scale=scale, fault=fault),
        ),
    }
    for name, dtype in REAL_KERNELS.items():
        kernels[name] = (
            dtype,
            lambda a, b, c: F.scaled_dot_product_attention(a, b, c, is_causal=True, scale=scale),
        )
    for name, (dtype, kernel) in kernels.items():
        inputs = [t.to(dtype).requires_grad_() for t in (q, k, v)]
        o = kernel(*inputs)
        d_q, d_k = torch.autograd.grad(o, inputs[:2], dy.to(dtype), retain_graph=True)
        m_q, m_k = torch.autograd.grad(o, inputs[:2], -dy.to(dtype))
        exact = [t.to(dtype).double().requires_grad_() for t in (q, k, v)]
        o = reference_attention(*exact, is_causal=True, scale=scale)
        r_q, r_k = torch.autograd.grad(o, exact[:2], dy.to(dtype).double())
        for proj, got, ref, neg in (("q", d_q, r_q, m_q), ("k", d_k, r_k, m_k)):
            err = _tokens(got.double() - ref)
            shape = error_shape(err, tokens, _tokens(ref), _tokens(got), _tokens(neg))
            out[f"{name}.{proj}"] = shape
    return out


def run_testbed(scenario: str, seed: int, steps: int, every: int) -> list[dict]:
    from agent.testbed.catalog import BY_NAME
    from agent.testbed.runner import TestbedRun

    run = TestbedRun(BY_NAME[scenario].config(seed), record_monitors=False)
    captures: dict[str, dict] = {}
    modules = list(run.model.attention_modules())
    if any(m.num_kv_heads != m.num_heads for m in modules):
        raise ValueError(f"{scenario}: the test-bed audit measures MHA models only")

    def before(module, args) -> None:  # the forward's input and weights, at audit steps
        if run.step_index % every == 0:
            weights = [p.weight.detach().clone() for p in (module.q_proj, module.k_proj)]
            weights.append(module.v_proj.weight.detach().clone())
            captures[module.name] = {"x": args[0].detach().clone(), "w": weights}
            captures[module.name].update(heads=module.num_heads, fault=module.fault)

    def upstream(module):  # the attention output's gradient (o_proj's input)
        def hook(_, args) -> None:
            if run.step_index % every == 0:
                slot = captures[module.name]
                args[0].register_hook(lambda g: slot.__setitem__("dy", g.detach().clone()))

        return hook

    for m in modules:
        m.register_forward_pre_hook(before)
        m.o_proj.register_forward_pre_hook(upstream(m))
    rows = []
    for _ in range(steps):
        step = run.step_index
        run.step()
        if step % every == 0:
            for layer, cap in captures.items():
                shapes = audit_testbed_layer(cap, cap["fault"])
                rows.append(
                    {"step": step, "layer": layer, "fault": cap["fault"] is not None, **shapes}
                )
            captures.clear()
    return rows


# -- HF Llama: module replay (RoPE, GQA) ---------------------------------------------------------
def run_llama(seed: int, fault: AttentionFault, start: int, steps: int, every: int) -> list[dict]:
    import detection_hf as hf

    attention = hf.EmulatedAttention()
    model = hf.build(seed, attention, "llama")
    optimizer = torch.optim.AdamW(model.parameters(), lr=hf.LR, betas=(0.9, 0.95), weight_decay=0)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / hf.WARMUP))
    data = hf.HiddenMarkovLanguage(seed)
    layers = [block.self_attn for block in model.model.layers]
    armed, captures = [False], {}

    def before(module, args, kwargs) -> None:
        if armed[0]:  # the call, less the KV cache (a replay must not append to it)
            kept = {k: _detached(v) for k, v in kwargs.items() if "Cache" not in type(v).__name__}
            captures[module] = {"args": [_detached(a) for a in args], "kwargs": kept}

    def after(module, args, kwargs, output) -> None:
        if armed[0]:
            slot = captures[module]
            output[0].register_hook(lambda g: slot.__setitem__("dy", g.detach().clone()))

    for layer in layers:
        layer.register_forward_pre_hook(before, with_kwargs=True)
        layer.register_forward_hook(after, with_kwargs=True)
    rows = []
    for step in range(steps):
        if step == start:
            attention.fault = fault
        armed[0] = step % every == 0
        ids = data.batch()
        loss = model(ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if armed[0]:  # before the optimizer step: the weights the forward used
            armed[0] = False  # the replays must not capture themselves
            for i, layer in enumerate(layers):
                kernel = _replay(layer, captures[layer], attention, attention.fault)
                flipped = _replay(layer, captures[layer], attention, attention.fault, sign=-1.0)
                exact = _replay(layer, captures[layer], attention, None)
                row: dict = {"step": step, "layer": f"layers.{i}", "fault": attention.fault}
                for proj in ("q", "k"):
                    x, got = kernel[proj]
                    ref, neg = exact[proj][1], flipped[proj][1]
                    flat = x.reshape(-1, x.shape[-1])
                    n = len(flat)
                    row[f"own.{proj}"] = error_shape(
                        (got - ref).reshape(n, -1),
                        flat,
                        ref.reshape(n, -1),
                        got.reshape(n, -1),
                        neg.reshape(n, -1),
                    )
                row["fault"] = row["fault"] is not None
                rows.append(row)
            captures.clear()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
    return rows


def _detached(v):
    if torch.is_tensor(v):
        return v.detach().clone()
    if isinstance(v, tuple) and v and all(torch.is_tensor(t) for t in v):
        return tuple(t.detach().clone() for t in v)
    return v


def _replay(module, capture: dict, attention, fault, sign: float = 1.0) -> dict[str, tuple]:
    """Run ``module`` again on the captured call with ``fault``; per projection (q, k): its
    input and the gradient at its output under ``sign`` x the captured upstream gradient."""
    saved, attention.fault = attention.fault, fault
    grabbed: dict[str, list] = {}
    handles = []
    for proj in ("q", "k"):

        def hook(_, args, output, proj=proj) -> None:
            grabbed[proj] = [args[0].detach()]
            output.register_hook(lambda g: grabbed[proj].append(g.detach().clone()))

        handles.append(getattr(module, f"{proj}_proj").register_forward_hook(hook))
    try:
        out = module(*capture["args"], **capture["kwargs"])[0]
        weights = [module.q_proj.weight, module.k_proj.weight]
        torch.autograd.grad(out, weights, sign * capture["dy"])
    finally:
        for h in handles:
            h.remove()
        attention.fault = saved
    return {proj: (pair[0], pair[1]) for proj, pair in grabbed.items()}


# -- report ---------------------------------------------------------------------------------------
def table(title: str, rows: list[dict]) -> str:
    kernels = sorted({k for r in rows for k in r if "." in k})
    head = "| step | layer | fault on | " + " | ".join(f"{k}: A / e / s" for k in kernels) + " |"
    lines = [f"### {title}", "", head, "|" + "---|" * (3 + len(kernels))]
    for r in rows:
        cells = [f"{r[k].coherence:.2f} / {r[k].size:.1e} / {r[k].asymmetry:.1e}" for k in kernels]
        lines.append(
            f"| {r['step']} | {r['layer']} | {'yes' if r['fault'] else '-'} | "
            + " | ".join(cells)
            + " |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("bed", choices=["testbed", "llama"])
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--scenarios", nargs="+", default=["clean"], help="testbed: catalogue names")
    p.add_argument("--faults", nargs="+", default=["floor:6"], help="llama: MODE:BITS at dS")
    p.add_argument("--start", type=int, default=100, help="llama: the fault's first step")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args()
    torch.set_num_threads(1)
    parts = []
    for seed in a.seeds:
        if a.bed == "testbed":
            for scenario in a.scenarios:
                rows = run_testbed(scenario, seed, a.steps, a.every)
                parts.append(table(f"test bed, {scenario}, seed {seed}", rows))
                print(parts[-1], flush=True)
        else:
            for spec in a.faults:
                mode, bits = spec.split(":")
                fault = AttentionFault(sites=("dS",), bits=int(bits), mode=mode)  # type: ignore[arg-type]
                rows = run_llama(seed, fault, a.start, a.steps, a.every)
                parts.append(
                    table(f"HF Llama, dS {mode} {bits} bits from {a.start}, seed {seed}", rows)
                )
                print(parts[-1], flush=True)
    if a.out:
        a.out.write_text("\n".join(parts))


if __name__ == "__main__":
    main()
