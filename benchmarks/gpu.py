"""What mechwatch costs on a GPU: the QK monitors, the agent on a real training step, and the
FP32 attention backward against flash SDPA. A prepared script: one command on a CUDA machine.

Run: python benchmarks/gpu.py --out benchmarks/results/gpu.md       (needs CUDA; else it skips)
     python benchmarks/gpu.py --dry-run [--out FILE]               (tiny shapes on the CPU)

1. QK monitors per evaluation (every spectrum of Delta_1/2/3, dW_q, dW_k of all layers and
   heads) at two shapes: a public peer (18 layers, d 1024, 8 heads x 128) and 32 layers x 32
   heads, d 4096, d_h 128 with 8 KV heads (GQA). Paths: ``qk_monitor_spectra`` layer by layer
   (what the agent calls), the batched ``agent.monitors.batched.qk_monitor_spectra_batched``
   (method "qr" and "gram", when that module exists), and the agent's own code
   (``QKSnapshots`` + ``compute_qk_samples`` on nn.Linear q_proj/k_proj layers; the snapshot is
   training-thread work, the samples monitor-thread work). The control matrices the agent also
   measures by default (v_proj, o_proj, MLP gate/up: update spectra of their first
   ``qk.control_rows`` rows, the agent's default ``AgentConfig().qk.control_rows``) are timed for
   one layer and multiplied by the layer count. CUDA-synchronized, warm-up excluded, medians.
2. The agent on a ~100M-parameter decoder (plain torch: SDPA attention with q/k/v/o_proj, two
   MoE layers with an HF-style ``mlp.gate`` router, bf16 autocast, AdamW): whole runs of
   ``steps`` steps without ``Agent`` and with it (default monitors and rules, detect-only;
   and the same with ``qk.snapshot_device: cpu``), in rotated order, repeated; ms/step, the
   run's wall-time overhead and the longest ``agent.step`` call.
3. The FP32-backward switch (``remediations.attention.scaled_dot_product_attention`` with its
   switch on) against torch's flash SDPA: forward + backward at (8, 16, 2048, 128) in bf16.
3b. The kernel audit (``--parts audit``; ``remediations.kernel_audit``) on torch's SDPA
   backends (flash, efficient, math) in bf16 and fp16 at the same shape: its statistic for a
   healthy kernel (exactly 0 when the backward is odd in dO bit for bit; a GPU kernel whose
   accumulation order varies between calls leaves a small value, shown next to the gap
   between two backward passes of the same call), and one audit's cost.
5. The linear algebra under the QK monitors, op by op (``--parts linalg``): a batch of 32
   heads' QR of d x 2 d_h factors, Grams, and SVDs / symmetric eigenvalues of the 2 d_h x
   2 d_h cores, in fp32 and fp64, on the device and on the host's CPU (torch's threads), to
   choose the device path (issue #17 item 1) from measurements.
4. Host-device synchronizations: the same training loop under
   ``torch.cuda.set_sync_debug_mode("warn")``, without and with the agent, every synchronizing
   call counted by the thread that made it and the first line of our code on its stack. The
   training thread must show none that the bare loop does not (the agent's promise: no sync
   per step); the monitor thread may synchronize (its waits block only itself).

Without CUDA (and without --dry-run) it prints that no GPU was found and exits 0, writing
nothing. --dry-run runs every measurement through the same code at tiny shapes on the CPU
(seconds; the numbers mean nothing) so that CI catches breakage.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import math
import statistics
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from provenance import provenance
from timing import QKLayer, median_seconds, sync
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from agent.agent import Agent
from agent.config import AgentConfig
from agent.discovery import find_attention
from agent.discovery.controls import find_controls
from agent.monitors import qk_monitor_spectra
from agent.probes import QKSnapshots, compute_qk_samples
from remediations.attention import AttentionPrecisionSwitch, scaled_dot_product_attention
from remediations.kernel_audit import sign_asymmetry

# ----------------------------------------------------------------------------- plans


def _median_ms(fn: Callable[[], object], device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` in ms (``timing.median_seconds``)."""
    return 1e3 * median_seconds(fn, repeats, device)


@dataclass(frozen=True)
class QKShape:
    """An attention layer stack for the QK monitors."""

    label: str
    layers: int
    d: int
    heads: int
    kv_heads: int
    dh: int
    d_ff: int  # MLP width (for the control matrices gate_proj / up_proj)


@dataclass(frozen=True)
class ModelShape:
    """The decoder trained in part 2."""

    layers: int
    d: int
    heads: int
    d_ff: int  # dense MLP width (SwiGLU)
    vocab: int
    seq: int
    batch: int
    moe_layers: tuple[int, ...]  # which layers have an MoE MLP instead of the dense one
    experts: int
    top_k: int
    expert_ff: int  # one expert's MLP width


@dataclass(frozen=True)
class AttentionShape:
    batch: int
    heads: int
    seq: int
    dh: int


@dataclass(frozen=True)
class Plan:
    qk: tuple[QKShape, ...]
    model: ModelShape
    steps: int  # steps per timed run
    runs: int  # timed runs per kind (with / without the agent)
    warmup_steps: int  # one untimed run of each kind first
    delta: int  # agent cadences: qk.delta, router.every, symptoms.every
    router_every: int
    symptoms_every: int
    attention: AttentionShape
    repeats: int  # timed calls per monitor / attention measurement (median)


FULL = Plan(
    qk=(
        # public peer: 18 layers, hidden 1024, 8 heads x 128 (MHA); MLP width assumed 4x
        QKShape("18 layers x 8 heads, d 1024, d_h 128 (MHA)", 18, 1024, 8, 8, 128, 4096),
        # Llama-3-8B-like: GQA with 8 KV heads, MLP 14336
        QKShape("32 layers x 32 heads, d 4096, d_h 128, 8 KV heads", 32, 4096, 32, 8, 128, 14336),
    ),
    model=ModelShape(
        layers=12,
        d=768,
        heads=12,
        d_ff=2048,  # SwiGLU with ~8/3 d: the parameters of a 4x GELU MLP
        vocab=32000,
        seq=1024,
        batch=8,
        moe_layers=(5, 11),
        experts=8,
        top_k=2,
        expert_ff=512,
    ),
    steps=200,
    runs=2,
    warmup_steps=40,
    delta=25,  # the agent's defaults
    router_every=25,
    symptoms_every=10,
    attention=AttentionShape(batch=8, heads=16, seq=2048, dh=128),
    repeats=3,
)

DRY = Plan(
    qk=(
        QKShape("dry: 2 layers x 2 heads, d 64, d_h 16", 2, 64, 2, 2, 16, 128),
        QKShape("dry: 2 layers x 4 heads, d 64, d_h 16, 2 KV heads", 2, 64, 4, 2, 16, 128),
    ),
    model=ModelShape(
        layers=2,
        d=64,
        heads=4,
        d_ff=128,
        vocab=256,
        seq=16,
        batch=2,
        moe_layers=(1,),
        experts=4,
        top_k=2,
        expert_ff=32,
    ),
    steps=6,
    runs=1,
    warmup_steps=3,
    delta=2,  # so that 6 steps include evaluations and router read-outs
    router_every=2,
    symptoms_every=2,
    attention=AttentionShape(batch=2, heads=2, seq=16, dh=16),
    repeats=2,
)

# ----------------------------------------------------------------------------- results


@dataclass(frozen=True)
class QKResult:
    shape: QKShape
    path: str  # what was timed
    ms: float  # per evaluation (all layers and heads)
    note: str = ""


# The agent's configurations timed in part 2 (beside the bare loop): its defaults, and the
# spectra computed on the host from snapshots in pinned host memory.
AGENT_KINDS: dict[str, dict] = {
    "default": {},
    "host snapshots": {"qk": {"snapshot_device": "cpu"}},
}


@dataclass(frozen=True)
class StepRun:
    kind: str  # "bare" or an AGENT_KINDS key
    seconds: float  # the whole run's wall time
    longest_ms: float  # the longest agent.step call (waits for late results); 0 when bare


@dataclass(frozen=True)
class StepResult:
    params: int
    routers: int
    attention_layers: int
    runs: list[StepRun]
    audit_every: int | None = None  # the kernel audit's cadence (None: off)
    audits: int = 0  # calls it audited in the warm-up run

    def seconds(self, kind: str) -> list[float]:
        return [r.seconds for r in self.runs if r.kind == kind]

    def ms_per_step(self, kind: str, steps: int) -> float:
        return 1e3 * statistics.median(self.seconds(kind)) / steps

    def overhead(self, kind: str) -> float:
        return statistics.median(self.seconds(kind)) / statistics.median(self.seconds("bare")) - 1

    def longest_ms(self, kind: str) -> float:
        return max(r.longest_ms for r in self.runs if r.kind == kind)


@dataclass(frozen=True)
class AttentionResult:
    flash_ms: float
    fp32_ms: float
    flash_gib: float | None  # peak memory above the inputs (CUDA only)
    fp32_gib: float | None


# ----------------------------------------------------------------------------- timing


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- 1. QK monitors


def _factors(n: int, d: int, dh: int, device: torch.device) -> list[torch.Tensor]:
    """(wq_prev, wk_prev, wq, wk), (n, d, d_h) fp32 each; n = layers x query heads (the key
    factor paired with each query head)."""
    g = torch.Generator(device=device).manual_seed(0)
    out = []
    for _ in range(2):
        w = torch.randn(n, d, dh, generator=g, device=device) / d**0.5  # (n, d, d_h)
        dw = 1e-3 * torch.randn(n, d, dh, generator=g, device=device) / d**0.5
        out.append((w, w + dw))
    (wq0, wq1), (wk0, wk1) = out
    return [wq0, wk0, wq1, wk1]


def _batched_spectra() -> Callable | None:
    """``agent.monitors.batched.qk_monitor_spectra_batched`` when this checkout has it."""
    try:
        from agent.monitors.batched import qk_monitor_spectra_batched
    except ImportError:
        return None
    return qk_monitor_spectra_batched


def measure_qk_monitors(
    shape: QKShape, device: torch.device, repeats: int, dtype: torch.dtype
) -> list[QKResult]:
    """The spectra of one evaluation (all layers and heads) through each available path, from
    fp32 factors (what the snapshots hold whatever the training ``dtype``)."""
    heads = shape.heads
    wq0, wk0, wq1, wk1 = _factors(shape.layers * heads, shape.d, shape.dh, device)

    def per_layer() -> None:  # what compute_qk_samples calls, one layer (H heads) at a time
        for layer in range(shape.layers):
            rows = slice(layer * heads, (layer + 1) * heads)
            qk_monitor_spectra(wq0[rows], wk0[rows], wq1[rows], wk1[rows])

    results = [
        QKResult(
            shape, "qk_monitor_spectra, layer by layer", _median_ms(per_layer, device, repeats)
        )
    ]
    batched = _batched_spectra()
    if batched is None:
        results.append(QKResult(shape, "batched path", math.nan, "not in this checkout"))
    else:
        for method in ("qr", "gram"):

            def call(method: str = method) -> None:  # all n = L x H heads, 32 at a time
                batched(wq0, wk0, wq1, wk1, chunk_size=32, method=method, directions=False)

            path = f"qk_monitor_spectra_batched, method={method}"
            results.append(QKResult(shape, path, _median_ms(call, device, repeats)))
    return results


def _perturb(model: nn.Module) -> None:
    """A training-like change of every weight between two snapshots."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-3 * p.abs().mean() * torch.randn_like(p))


def measure_agent_qk(
    shape: QKShape, device: torch.device, repeats: int, dtype: torch.dtype
) -> list[QKResult]:
    """The agent's own path for all layers and heads, without controls: the snapshot
    (training thread) and ``compute_qk_samples`` of every layer's job (monitor thread)."""
    torch.manual_seed(0)
    model = nn.Module()
    with torch.device(device):  # built in place: no host-side initialization of big weights
        model.layers = nn.ModuleList(
            QKLayer(shape.d, shape.heads, shape.kv_heads, shape.dh) for _ in range(shape.layers)
        )
    model.to(dtype=dtype)
    sites = find_attention(model)
    snaps = QKSnapshots(sites, delta=1, controls={})
    snaps.on_step(0)
    _perturb(model)
    sync(device)
    t0 = time.perf_counter()
    jobs = snaps.on_step(1)  # measures step 0 -> 1, snapshots for the next evaluation
    sync(device)
    snapshot_ms = 1e3 * (time.perf_counter() - t0)

    def evaluate() -> None:
        for job in jobs:
            compute_qk_samples(job)

    monitor_ms = _median_ms(evaluate, device, repeats)
    return [
        QKResult(shape, "agent: compute_qk_samples, all layers and heads", monitor_ms),
        QKResult(shape, "agent: snapshot copy, training thread", snapshot_ms, "one call"),
    ]


class _Block(nn.Module):
    """One decoder layer's 2-D weights, named like Hugging Face Llama (attention + MLP)."""

    def __init__(self, d: int, heads: int, kv_heads: int, dh: int, d_ff: int) -> None:
        super().__init__()
        self.self_attn = QKLayer(d, heads, kv_heads, dh)
        self.self_attn.v_proj = nn.Linear(d, kv_heads * dh, bias=False)
        self.self_attn.o_proj = nn.Linear(heads * dh, d, bias=False)
        self.mlp = nn.Module()
        self.mlp.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.up_proj = nn.Linear(d, d_ff, bias=False)
        self.mlp.down_proj = nn.Linear(d_ff, d, bias=False)


def measure_agent_controls(
    shape: QKShape, device: torch.device, repeats: int, dtype: torch.dtype
) -> list[QKResult]:
    """The control matrices of ONE layer (the agent's default: up to 4, ``find_controls``,
    measured on their first ``qk.control_rows`` rows as the Agent does), through
    ``compute_qk_samples``' control-only branch; then x layers (not measured)."""
    torch.manual_seed(0)
    model = nn.Module()
    with torch.device(device):
        block = _Block(shape.d, shape.heads, shape.kv_heads, shape.dh, shape.d_ff)
    model.layers = nn.ModuleList([block.to(dtype=dtype)])
    (site,) = find_attention(model)
    controls = find_controls(model, site)
    rows = AgentConfig().qk.control_rows  # the agent's default
    snaps = QKSnapshots([site], delta=1, controls={site.name: controls}, control_rows=rows)
    snaps.on_step(0)
    _perturb(model)
    (job,) = snaps.on_step(1)
    job = dataclasses.replace(job, heads=[])  # controls only (a rank owning only them)
    one_ms = _median_ms(lambda: compute_qk_samples(job), device, max(2, repeats // 2))
    measured = [tuple(job.current[name].shape) for name in controls]  # the snapshotted part
    shapes = ", ".join(
        "x".join(map(str, p.shape)) + ("" if tuple(p.shape) == part else f" (rows 0-{part[0] - 1})")
        for p, part in zip(controls.values(), measured, strict=True)
    )
    return [
        QKResult(shape, f"agent: {len(controls)} controls of one layer", one_ms, shapes),
        QKResult(
            shape,
            f"agent: controls, all {shape.layers} layers",
            shape.layers * one_ms,
            "one layer x layers (not measured)",
        ),
    ]


# ----------------------------------------------------------------------------- 2. training step


class Attention(nn.Module):
    """Causal self-attention through torch's SDPA, projections named like Hugging Face's. The
    call goes through the FP32 switch's wrapper under the module's own name (``name``, set by
    ``Decoder``), as a user's model that enables the kernel audit does: the agent's audit is
    part of what is timed."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.name: str | None = None  # module path, e.g. "layers.0.self_attn"
        self.num_heads = self.num_key_value_heads = heads
        self.head_dim = d // heads
        self.q_proj = nn.Linear(d, d, bias=False)
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d, bias=False)
        self.o_proj = nn.Linear(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, d)
        b, n, d = x.shape
        q, k, v = (
            p(x).view(b, n, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, L, d_h)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        out = scaled_dot_product_attention(
            q, k, v, is_causal=True, layer=self.name
        )  # (B, H, L, d_h)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, d))


class MLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, d: int, d_ff: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(d, d_ff, bias=False)
        self.up_proj = nn.Linear(d, d_ff, bias=False)
        self.down_proj = nn.Linear(d_ff, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Top-k MoE with an HF-style ``gate`` router [E, d]. Dense dispatch: every expert runs
    on every token and is weighted by its combine weight (zero when not chosen), so nothing
    synchronizes the device (a real MoE dispatches; this one costs E x an expert's FLOPs)."""

    def __init__(self, d: int, experts: int, top_k: int, d_ff: int) -> None:
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.gate = nn.Linear(d, experts, bias=False)
        self.experts = nn.ModuleList(MLP(d, d_ff) for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (B, L, d)
        probs = F.softmax(self.gate(x), dim=-1, dtype=torch.float32)  # (B, L, E)
        top, chosen = probs.topk(self.top_k, dim=-1)  # (B, L, k)
        combine = torch.zeros_like(probs).scatter(-1, chosen, top / top.sum(-1, keepdim=True))
        combine = combine.to(x.dtype)  # (B, L, E), zero for experts not chosen
        return sum(expert(x) * combine[..., e : e + 1] for e, expert in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self, shape: ModelShape, moe: bool) -> None:
        super().__init__()
        d = shape.d
        self.input_layernorm = nn.RMSNorm(d)
        self.self_attn = Attention(d, shape.heads)
        self.post_attention_layernorm = nn.RMSNorm(d)
        self.mlp = (
            MoE(d, shape.experts, shape.top_k, shape.expert_ff) if moe else MLP(d, shape.d_ff)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """A decoder-only LM (no positional encoding: the cost, not the quality, is measured)."""

    def __init__(self, shape: ModelShape) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(shape.vocab, shape.d)
        self.layers = nn.ModuleList(
            Block(shape, i in shape.moe_layers) for i in range(shape.layers)
        )
        for i, layer in enumerate(self.layers):
            layer.self_attn.name = f"layers.{i}.self_attn"
        self.norm = nn.RMSNorm(shape.d)
        self.lm_head = nn.Linear(shape.d, shape.vocab, bias=False)
        self.lm_head.weight = self.embed_tokens.weight  # tied

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, L, V)
        x = self.embed_tokens(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def _train_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, tokens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step on ``tokens`` (B, L + 1); returns the loss and grad norm (device
    tensors: nothing synchronizes)."""
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens[:, :-1])  # (B, L, V)
    loss = F.cross_entropy(logits.float().flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach(), grad_norm


def _agent_config(plan: Plan, run_dir: Path, kind: str = "default") -> AgentConfig:
    """Default monitors and rules (with ``AGENT_KINDS[kind]``'s changes), detect-only, no
    checkpoints, no console pages."""
    extra = AGENT_KINDS[kind]
    return AgentConfig.model_validate(
        {
            "run_name": "gpu-benchmark",
            "run_dir": str(run_dir),
            "qk": {"delta": plan.delta, **extra.get("qk", {})},
            "router": {"every": plan.router_every},
            "symptoms": {"every": plan.symptoms_every},
            "actions": {"dry_run": True},
            "notify": {"console": "never"},
        }
    )


def _training_setup(
    plan: Plan, device: torch.device, run_dir: Path | None, kind: str
) -> tuple[Decoder, torch.optim.Optimizer, torch.Tensor, Agent | None]:
    """A fresh model (seed 0), its AdamW, 4 batches of random tokens (4, B, L + 1), and the
    agent configured as ``kind`` when ``run_dir`` is given."""
    torch.manual_seed(0)
    shape = plan.model
    with torch.device(device):
        model = Decoder(shape).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    batches = torch.randint(0, shape.vocab, (4, shape.batch, shape.seq + 1), device=device)
    agent = (
        None
        if run_dir is None
        else Agent(model, optimizer, config=_agent_config(plan, run_dir, kind))
    )
    return model, optimizer, batches, agent


def _timed_run(
    plan: Plan, device: torch.device, steps: int, run_dir: Path | None, kind: str = "default"
) -> tuple[StepRun, Decoder, Agent | None]:
    """``steps`` training steps of a fresh model (seed 0), with the agent configured as
    ``kind`` when ``run_dir`` is given (its construction is not timed; its close is)."""
    model, optimizer, batches, agent = _training_setup(plan, device, run_dir, kind)
    sync(device)
    t0 = time.perf_counter()
    step, longest = 0, 0.0
    while step < steps:
        loss, grad_norm = _train_step(model, optimizer, batches[step % len(batches)])
        if agent is None:
            step += 1
            continue
        called = time.perf_counter()  # host time of the call: no sync, waits show
        step = agent.step(step, loss=loss, grad_norm=grad_norm)
        longest = max(longest, time.perf_counter() - called)
    if agent is not None:
        agent.close()
    sync(device)
    seconds = time.perf_counter() - t0
    return StepRun("bare" if agent is None else kind, seconds, 1e3 * longest), model, agent


def measure_training_overhead(plan: Plan, device: torch.device) -> StepResult:
    """Whole runs without the agent and with each of ``AGENT_KINDS``, the order rotated
    each round, after one untimed warm-up run of each kind; each run printed as it ends."""
    kinds = ["bare", *AGENT_KINDS]
    with tempfile.TemporaryDirectory(prefix="mechwatch-gpu-") as tmp:
        _timed_run(plan, device, plan.warmup_steps, None)
        _, model, agent = _timed_run(plan, device, plan.warmup_steps, Path(tmp) / "warmup")
        assert agent is not None
        params = sum(p.numel() for p in model.parameters())
        routers, layers = len(agent.router_sites), len(agent.attention_sites)
        probe = agent.kernel_audit
        audit = (probe.every, probe.audits) if probe is not None else (None, 0)
        del model, agent, probe
        runs: list[StepRun] = []
        for r in range(plan.runs):
            for i in range(len(kinds)):
                kind = kinds[(i + r) % len(kinds)]
                run_dir = None if kind == "bare" else Path(tmp) / f"run{r}-{i}"
                run, _, _ = _timed_run(plan, device, plan.steps, run_dir, kind)
                runs.append(run)
                print(
                    f"round {r}, {kind}: {1e3 * run.seconds / plan.steps:.2f} ms/step, "
                    f"longest agent.step {run.longest_ms:.1f} ms",
                    flush=True,
                )
                _free(device)
    return StepResult(params, routers, layers, runs, *audit)


# ----------------------------------------------------------------------------- 3. attention


def measure_attention(shape: AttentionShape, device: torch.device, repeats: int) -> AttentionResult:
    """Forward + backward of causal attention in bf16: torch's flash SDPA, and the same call
    through ``remediations.attention.scaled_dot_product_attention`` with the FP32 backward
    switched on (its forward is the same flash kernel)."""
    g = torch.Generator(device=device).manual_seed(0)
    size = (shape.batch, shape.heads, shape.seq, shape.dh)  # (B, H, L, d_h)
    q, k, v, grad = (
        torch.randn(size, generator=g, device=device, dtype=torch.bfloat16) for _ in range(4)
    )
    for t in (q, k, v):
        t.requires_grad_(True)
    switch = AttentionPrecisionSwitch()  # this benchmark's own: the process-wide one untouched
    switch.enable_fp32_backward()

    def flash() -> None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.backward(out, grad)

    def fp32() -> None:
        out = scaled_dot_product_attention(q, k, v, is_causal=True, layer="bench", switch=switch)
        torch.autograd.backward(out, grad)

    times, peaks = {}, {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        for name, fn in (("flash", flash), ("fp32", fp32)):
            times[name] = _median_ms(fn, device, repeats)
            peaks[name] = _peak_gib(fn, device)
    return AttentionResult(times["flash"], times["fp32"], peaks["flash"], peaks["fp32"])


def _peak_gib(fn: Callable[[], object], device: torch.device) -> float | None:
    """Peak device memory of one call above what was allocated before it (CUDA only)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**30


# ----------------------------------------------------------------------------- 4b. audit


@dataclass(frozen=True)
class AuditResult:
    backend: str
    dtype: str
    asymmetry: float | None  # the kernel audit's statistic on one call (None: backend absent)
    repeat_gap: float | None  # ||g - g'|| / ||g|| of two backward passes of the same call
    ms: float | None  # one audit: the captured call's forward and two backward passes


def measure_audit(shape: AttentionShape, device: torch.device) -> list[AuditResult]:
    """The kernel audit (``remediations.kernel_audit``) on torch's SDPA backends: its
    statistic for a healthy kernel (0 when the backward is odd in dO bit for bit; small when
    the kernel's accumulation order varies between calls, which ``repeat_gap`` shows), and
    what one audit of a full call costs."""
    g = torch.Generator(device=device).manual_seed(0)
    size = (shape.batch, shape.heads, shape.seq, shape.dh)  # (B, H, L, d_h)
    out: list[AuditResult] = []
    backends = [
        ("flash", SDPBackend.FLASH_ATTENTION),
        ("efficient", SDPBackend.EFFICIENT_ATTENTION),
    ]
    backends.append(("math", SDPBackend.MATH))
    for name, backend in backends:
        for dtype in (torch.bfloat16, torch.float16):
            q, k, v, d_out = (
                torch.randn(size, generator=g, device=device).to(dtype) for _ in range(4)
            )
            switch = AttentionPrecisionSwitch()  # this benchmark's own
            switch.audit.sequences = shape.batch
            try:
                with sdpa_kernel(backend):
                    leaves = [t.requires_grad_() for t in (q, k, v)]
                    switch.audit.arm(["bench"])
                    o = scaled_dot_product_attention(
                        *leaves, is_causal=True, layer="bench", switch=switch
                    )
                    first = torch.autograd.grad(o, leaves[:2], d_out)
                    second = torch.autograd.grad(
                        F.scaled_dot_product_attention(*leaves, is_causal=True), leaves[:2], d_out
                    )
                    (capture,) = switch.audit.take()
                    _sync(device)
                    t0 = time.perf_counter()
                    value = sign_asymmetry(capture)
                    _sync(device)
                    ms = (time.perf_counter() - t0) * 1e3
            except RuntimeError:  # the backend does not serve this device, dtype or shape
                out.append(AuditResult(name, str(dtype), None, None, None))
                continue
            gap = sum(
                float((a.double() - b.double()).norm() ** 2)
                for a, b in zip(first, second, strict=True)
            )
            norm = sum(float(a.double().norm() ** 2) for a in first)
            out.append(AuditResult(name, str(dtype), value, (gap / norm) ** 0.5, ms))
    return out


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def render_audit(shape: AttentionShape, rows: list[AuditResult]) -> list[str]:
    head = [
        f"### The kernel audit on torch's SDPA backends (B {shape.batch}, H {shape.heads}, "
        f"L {shape.seq}, d_h {shape.dh}, causal)",
        "",
        "| backend | dtype | asymmetry | two backwards differ by | one audit (ms) |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        if r.asymmetry is None:
            head.append(f"| {r.backend} | {r.dtype} | not served | - | - |")
        else:
            head.append(
                f"| {r.backend} | {r.dtype} | {r.asymmetry:.2e} | {r.repeat_gap:.2e} | {r.ms:.1f} |"
            )
    return head + [""]


# ----------------------------------------------------------------------------- 5. linalg


@dataclass(frozen=True)
class LinalgResult:
    op: str
    batch: int
    dtype: str
    device_ms: float | None  # None: not run on the device (CPU dry run) or not available there
    host_ms: float


def _linalg_ops(
    batch: int, d: int, r: int, dtype: torch.dtype, device: torch.device
) -> dict[str, Callable[[], object]]:
    """The QK path's operations on ``batch`` random inputs: tall factors (batch, d, r) and
    square cores (batch, r, r), r = 2 d_h."""
    g = torch.Generator(device=device).manual_seed(0)
    tall = torch.randn(batch, d, r, generator=g, device=device, dtype=dtype)
    core = torch.randn(batch, r, r, generator=g, device=device, dtype=dtype)
    sym = core @ core.mT
    ops: dict[str, Callable[[], object]] = {
        f"qr mode=r ({d} x {r})": lambda: torch.linalg.qr(tall, mode="r"),
        f"gram A^T A ({d} x {r})": lambda: tall.mT @ tall,
        f"svdvals ({r} x {r})": lambda: torch.linalg.svdvals(core),
        f"eigvalsh ({r} x {r})": lambda: torch.linalg.eigvalsh(sym),
        f"eigh ({r} x {r})": lambda: torch.linalg.eigh(sym),
    }
    if device.type == "cuda":
        for driver in ("gesvdj", "gesvda"):
            ops[f"svd driver={driver} ({r} x {r})"] = lambda d_=driver: torch.linalg.svd(
                core, full_matrices=False, driver=d_
            )
    return ops


def measure_linalg(plan: Plan, device: torch.device) -> list[LinalgResult]:
    """Each op of ``_linalg_ops`` at the plan's QK shapes' (d, 2 d_h), fp32 and fp64, on
    ``device`` and on the host (the host only in a dry run)."""
    host = torch.device("cpu")
    batch = 32  # GPU_CHUNK_SIZE: the agent's chunk of heads
    out: list[LinalgResult] = []
    for d, r in sorted({(q.d, 2 * q.dh) for q in plan.qk}):
        for dtype in (torch.float32, torch.float64):
            on_host = _linalg_ops(batch, d, r, dtype, host)
            on_device = _linalg_ops(batch, d, r, dtype, device) if device.type == "cuda" else {}
            for name in dict.fromkeys([*on_host, *on_device]):
                dev_ms = (
                    _median_ms(on_device[name], device, plan.repeats) if name in on_device else None
                )
                host_ms = (
                    _median_ms(on_host[name], host, plan.repeats) if name in on_host else math.nan
                )
                out.append(
                    LinalgResult(name, batch, str(dtype).removeprefix("torch."), dev_ms, host_ms)
                )
            _free(device)
    return out


def render_linalg(r: list[LinalgResult]) -> list[str]:
    def ms(x: float | None) -> str:
        return "-" if x is None or math.isnan(x) else f"{x:.2f}"

    rows = [
        f"The QK path's linear algebra, one call on a batch of 32 heads (the agent's chunk), "
        f"median; host: this machine's CPU with torch's {torch.get_num_threads()} threads:",
        "",
        "| op | batch | dtype | device ms | host ms |",
        "|---|---|---|---|---|",
    ]
    rows += [f"| {x.op} | {x.batch} | {x.dtype} | {ms(x.device_ms)} | {ms(x.host_ms)} |" for x in r]
    return rows + [""]


# ----------------------------------------------------------------------------- 4. syncs

ROOT = Path(__file__).resolve().parents[1]
SYNC_WARNING = "synchroniz"  # "called a synchronizing CUDA operation"


@dataclass(frozen=True)
class SyncResult:
    steps: int  # counted steps per loop (after the warm-up)
    bare: Counter  # (thread, origin) -> synchronizing calls, loop without the agent
    agent: dict[str, Counter]  # AGENT_KINDS key -> the same with the agent so configured
    checked: bool  # False on a CPU: there is no device to synchronize with


def _origin() -> str:
    """The innermost frame of this repository's code outside this file's recorder, as
    ``path:line (function)``; the innermost frame at all when none is ours."""
    frames = [f for f in traceback.extract_stack()[:-2] if "warnings" not in f.filename]
    ours = [f for f in frames if f.filename.startswith(str(ROOT)) and f.name != "_record"]
    frame = (ours or frames)[-1]
    path = Path(frame.filename)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path.name
    return f"{where}:{frame.lineno} ({frame.name})"


def _count_syncs(
    plan: Plan, device: torch.device, steps: int, run_dir: Path | None, kind: str = "default"
) -> Counter:
    """Synchronizing calls during ``steps`` training steps after ``plan.warmup_steps``
    uncounted ones, with the agent configured as ``kind`` when ``run_dir`` is given (its
    close() is not counted)."""
    model, optimizer, batches, agent = _training_setup(plan, device, run_dir, kind)
    counts: Counter = Counter()
    lock = threading.Lock()

    def _record(message, category, filename, lineno, file=None, line=None) -> None:  # noqa: ANN001
        if SYNC_WARNING in str(message):
            key = (threading.current_thread().name, _origin())
            with lock:
                counts[key] += 1

    step = 0
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = _record
        try:
            while step < plan.warmup_steps + steps:
                if step == plan.warmup_steps and device.type == "cuda":
                    sync(device)
                    torch.cuda.set_sync_debug_mode("warn")
                loss, grad_norm = _train_step(model, optimizer, batches[step % len(batches)])
                step = (
                    step + 1 if agent is None else agent.step(step, loss=loss, grad_norm=grad_norm)
                )
            if agent is not None:
                # the monitor thread's work for the counted steps, still under the debug mode
                agent.thread.submit(lambda: None).result(timeout=120)  # jobs run in order
        finally:
            if device.type == "cuda":
                torch.cuda.set_sync_debug_mode("default")
    if agent is not None:
        agent.close()
    return counts


def measure_syncs(plan: Plan, device: torch.device) -> SyncResult:
    steps = 3 * plan.delta  # three QK evaluations, router read-outs and symptom rounds
    with tempfile.TemporaryDirectory(prefix="mechwatch-gpu-sync-") as tmp:
        bare = _count_syncs(plan, device, steps, None)
        _free(device)
        watched = {}
        for kind in AGENT_KINDS:
            watched[kind] = _count_syncs(plan, device, steps, Path(tmp) / kind, kind)
            _free(device)
    return SyncResult(steps, bare, watched, device.type == "cuda")


# ----------------------------------------------------------------------------- report


def device_lines(device: torch.device, dry_run: bool) -> list[str]:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        what = f"GPU {name}, CUDA {torch.version.cuda}"
    else:
        what = "CPU (dry run: tiny shapes, the numbers mean nothing)"
    tf32 = torch.backends.cuda.matmul.allow_tf32
    return [
        f"Device: {what}; torch {torch.__version__}; {datetime.datetime.now():%Y-%m-%d %H:%M}; "
        f"fp32 matmuls {'TF32' if tf32 else 'full fp32'} (torch default)"
        + ("; --dry-run" if dry_run else ""),
        "",
    ]


def render_qk_header() -> list[str]:
    return [
        "QK monitors, one evaluation (every layer and head; Delta_1/2/3, dW_q, dW_k spectra), "
        "fp32 factors; CUDA-synchronized, warm-up excluded, median:",
        "",
        "| shape | path | ms / evaluation | note |",
        "|---|---|---|---|",
    ]


def render_qk_row(r: QKResult) -> str:
    value = "n/a" if math.isnan(r.ms) else f"{r.ms:.2f}"
    return f"| {r.shape.label} | {r.path} | {value} | {r.note} |"


def _audit_words(r: StepResult, plan: Plan) -> str:
    if r.audit_every is None:
        return "the kernel audit off"
    return (
        f"the kernel audit every {r.audit_every} steps (attention through the FP32 switch's "
        f"wrapper; {r.audits} call(s) audited in the {plan.warmup_steps}-step warm-up run)"
    )


def render_step(plan: Plan, r: StepResult) -> list[str]:
    s = plan.model
    rows = [
        f"Training step: {r.params / 1e6:.1f}M parameters ({s.layers} layers, d {s.d}, "
        f"{s.heads} heads, MoE in layers {list(s.moe_layers)} with {s.experts} experts top-"
        f"{s.top_k}), vocab {s.vocab}, batch {s.batch} x seq {s.seq}, bf16 autocast, AdamW, "
        f"grad clipping; {r.attention_layers} attention layers and {r.routers} router(s) found by "
        f"the agent; {_audit_words(r, plan)}; {plan.steps} steps per run, {plan.runs} rounds "
        f"of every kind in rotated order, median; agent: default monitors and rules "
        f"(qk.delta {plan.delta}, router.every {plan.router_every}, symptoms.every "
        f"{plan.symptoms_every}), detect-only, no checkpoints; its close() is inside the "
        "timed run; 'longest agent.step' is the longest call's host time (a wait for a late "
        "monitor result shows there):",
        "",
        "| run | ms / step | longest agent.step (ms) |",
        "|---|---|---|",
        f"| without the agent | {r.ms_per_step('bare', plan.steps):.2f} | |",
    ]
    for kind in AGENT_KINDS:
        label = "with the agent" + ("" if kind == "default" else f", {kind}")
        rows.append(
            f"| {label} | {r.ms_per_step(kind, plan.steps):.2f} | {r.longest_ms(kind):.1f} |"
        )
    for kind in AGENT_KINDS:
        label = "overhead (whole-run wall time)" + ("" if kind == "default" else f", {kind}")
        rows.append(f"| {label} | {100 * r.overhead(kind):+.2f}% | |")
    per_run = "; ".join(
        f"{kind} {', '.join(f'{1e3 * t / plan.steps:.2f}' for t in r.seconds(kind))}"
        for kind in ("bare", *AGENT_KINDS)
    )
    return rows + ["", f"Per run (ms / step): {per_run}.", ""]


def render_attention(shape: AttentionShape, r: AttentionResult) -> list[str]:
    def gib(x: float | None) -> str:
        return "-" if x is None else f"{x:.2f}"

    return [
        f"Attention forward + backward, bf16, causal, (batch {shape.batch}, heads {shape.heads}, "
        f"seq {shape.seq}, d_h {shape.dh}), flash SDPA backend forced; median:",
        "",
        "| kernel | ms / forward+backward | peak extra memory (GiB) |",
        "|---|---|---|",
        f"| flash SDPA (torch) | {r.flash_ms:.3f} | {gib(r.flash_gib)} |",
        f"| FP32 backward (remediations.attention) | {r.fp32_ms:.3f} | {gib(r.fp32_gib)} |",
        f"| ratio FP32 / flash | {r.fp32_ms / r.flash_ms:.2f}x | |",
        "",
    ]


def render_syncs(plan: Plan, r: SyncResult) -> list[str]:
    head = (
        f"Host-device synchronizations over {r.steps} training steps (after {plan.warmup_steps} "
        "uncounted), torch.cuda.set_sync_debug_mode('warn'), counted by thread and by the "
        "innermost line of this repository's code on the stack:"
    )
    if not r.checked:
        return [head, "", "Not counted on a CPU (no device to synchronize with).", ""]
    rows = [head, "", "| loop | thread | where | calls | per step |", "|---|---|---|---|---|"]
    loops = {"without the agent": r.bare}
    loops.update(
        {"with the agent" + ("" if k == "default" else f", {k}"): c for k, c in r.agent.items()}
    )
    for label, counts in loops.items():
        if not counts:
            rows.append(f"| {label} | - | none | 0 | 0 |")
        for (thread, where), n in sorted(counts.items(), key=lambda kv: -kv[1]):
            rows.append(f"| {label} | {thread} | {where} | {n} | {n / r.steps:.2f} |")
    main = {
        label: sum(n for (t, _), n in c.items() if t == "MainThread") for label, c in loops.items()
    }
    bare = main.pop("without the agent")
    rows += ["", f"Training thread: {bare} synchronizing calls without the agent."]
    rows += [
        f"- {label}: {n} ({(n - bare) / r.steps:+.2f} per step from the agent)."
        for label, n in main.items()
    ]
    return rows + [""]


# ----------------------------------------------------------------------------- main

PARTS = ("qk", "step", "attention", "audit", "sync", "linalg")


def run(plan: Plan, device: torch.device, parts: tuple[str, ...]) -> list[str]:
    """Every requested measurement; returns the report's lines (printed as they come)."""
    dtype = torch.bfloat16  # the training dtype of the weights the agent snapshots
    lines: list[str] = []

    def emit(block: list[str]) -> None:
        print("\n".join(block), flush=True)
        lines.extend(block)

    if "qk" in parts:  # rows printed as they come: the big shape takes minutes
        emit(render_qk_header())
        for shape in plan.qk:
            for measure in (measure_qk_monitors, measure_agent_qk, measure_agent_controls):
                emit([render_qk_row(r) for r in measure(shape, device, plan.repeats, dtype)])
                _free(device)  # the measurement's tensors went with its frame
        emit([""])
    if "step" in parts:
        emit(render_step(plan, measure_training_overhead(plan, device)))
    if "attention" in parts:
        emit(
            render_attention(
                plan.attention, measure_attention(plan.attention, device, plan.repeats)
            )
        )
    if "audit" in parts:
        emit(render_audit(plan.attention, measure_audit(plan.attention, device)))
    if "sync" in parts:
        emit(render_syncs(plan, measure_syncs(plan, device)))
    if "linalg" in parts:
        emit(render_linalg(measure_linalg(plan, device)))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (seconds)")
    p.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    args = p.parse_args(argv)
    parts = tuple(x for x in args.parts.split(",") if x)
    unknown = set(parts) - set(PARTS)
    if unknown:
        p.error(f"unknown parts: {sorted(unknown)}")
    if args.dry_run:
        torch.set_num_threads(1)
        plan, device = DRY, torch.device("cpu")
    elif torch.cuda.is_available():
        plan, device = FULL, torch.device("cuda")
    else:
        print("benchmarks/gpu.py: no GPU found (torch.cuda.is_available() is False); skipped")
        return 0
    header = provenance() + device_lines(device, args.dry_run)
    print("\n".join(header), flush=True)
    lines = header + run(plan, device, parts)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(lines) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
