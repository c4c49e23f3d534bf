"""Monitor cost and snapshot memory at 7B, 70B and 671B shapes, on paper: derived from unit
costs MEASURED here (CPU, one intra-op thread) with the agent's own code, at its defaults.

Run: python benchmarks/scale.py [--out benchmarks/results/scale.md]    (about 2 minutes)

Measured (fp32, medians, the agent's code):

- one QK job (``QKSnapshots`` + ``compute_qk_samples``: every QK spectrum and Delta_2's top
  direction (persistence) from one batched QR pass, ||W_k||) of n = 2 and n = 6 query heads at
  each model's real d and d_h: MHA at d 4096, GQA at d 8192 (8 query heads per KV head), MLA at
  d 7168 (factors through the q/kv latents, ``agent.discovery.latent``); cost = per job + n x
  per head;
- one control matrix's update spectrum (``compute_qk_samples``' control branch) at every real
  control shape, as the agent measures it by default: built with
  ``control_rows = AgentConfig().qk.control_rows``, a matrix whose both dimensions exceed it is
  snapshotted and measured on its first ``control_rows`` rows (``agent.probes.control_slice``);
- what ``control_rows: null`` (whole matrices) costs: re-measured at the real shapes that take
  seconds, the rest taken from this table at commit 9ad304b (``WHOLE_9AD304B``: measured there,
  or from a flop model fitted there; wide shapes at the cost of their transpose, which
  ``update_spectrum`` now takes);
- the router probe on 8192 tokens x 256 experts (d 7168, top-8): forwards with the probe
  attached minus without, plus its read-out, per forward.

Derived per model: the work of one evaluation (all layers and heads; and per sampling
setting), in total and on the slowest rank when the work is spread over the job's GPUs as
``agent/distributed/assignment.py`` does (query head h of layer i on rank (i H + h) % world, all
controls of layer i on rank i % world); the fraction of an assumed step time, with
step time = 6 N T / (GPUs x peak x MFU); the snapshot memory (fp32, one process).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import statistics
import subprocess
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch
from provenance import provenance
from timing import QKLayer, median_seconds
from torch import nn

from agent.config import AgentConfig
from agent.discovery import find_attention, find_routers
from agent.distributed.assignment import control_rank, head_rank
from agent.probes import QKSnapshots, RouterProbe, compute_qk_samples, control_slice

H100_BF16 = 989e12  # dense bf16 FLOP/s of an H100 / H800 SXM (no sparsity)
BUDGET = 0.01  # monitor-thread work per step, as a fraction of the step time
APPLY_LAG = 5  # scheduling.apply_lag: a result later than this many steps stalls training
DELTAS = (25, 50, 100, 200, 400)
CONTROL_ROWS = AgentConfig().qk.control_rows  # the agent's default (None: whole matrices)

# ----------------------------------------------------------------------------- model shapes


@dataclass(frozen=True)
class StepAssumption:
    """step time = 6 N T / (GPUs x peak x MFU)."""

    params: float  # N: (activated) parameters per token
    tokens: int  # T: tokens per optimizer step
    gpus: int
    peak_flops: float  # per GPU
    mfu: float
    basis: str

    @property
    def seconds(self) -> float:
        return 6 * self.params * self.tokens / (self.gpus * self.peak_flops * self.mfu)


@dataclass(frozen=True)
class RouterShape:
    experts: int
    top_k: int
    moe_layers: int
    tokens_per_forward: int  # tokens one GPU routes per forward (micro-batch)


@dataclass(frozen=True)
class ModelShape:
    name: str
    kind: str  # head-cost kind: "mha" (d 4096), "gqa" (d 8192), "mla" (d 7168)
    layers: int
    d: int
    heads: int
    kv_heads: int
    dh: int
    qk_numel: int  # elements QKSnapshots copies per layer (Q/K weights, latents, norms)
    controls: tuple[tuple[int, int], ...]  # weight shapes [out, in], in find_controls' order
    moe_controls: tuple[tuple[int, int], ...] | None  # for MoE layers (None: dense model)
    first_moe: int  # layers before this one are dense
    step: StepAssumption
    router: RouterShape | None = None

    def layer_controls(self, layer: int) -> tuple[tuple[int, int], ...]:
        if self.moe_controls is not None and layer >= self.first_moe:
            return self.moe_controls
        return self.controls


LLAMA2_7B = ModelShape(
    name="Llama-2-7B",
    kind="mha",
    layers=32,
    d=4096,
    heads=32,
    kv_heads=32,
    dh=128,
    qk_numel=2 * 4096 * 4096,  # q_proj, k_proj
    controls=((4096, 4096), (4096, 4096), (11008, 4096), (11008, 4096)),  # v, o, gate, up
    moe_controls=None,
    first_moe=0,
    step=StepAssumption(
        params=6.74e9,
        tokens=4 * 2**20,
        gpus=8,
        peak_flops=H100_BF16,
        mfu=0.40,
        basis="8 H100, 4M tokens/step (Llama 2's batch), MFU 40%",
    ),
)

LLAMA3_70B = ModelShape(
    name="Llama-3-70B",
    kind="gqa",
    layers=80,
    d=8192,
    heads=64,
    kv_heads=8,
    dh=128,
    qk_numel=8192 * 8192 + 1024 * 8192,  # q_proj [8192, 8192], k_proj [1024, 8192]
    controls=((1024, 8192), (8192, 8192), (28672, 8192), (28672, 8192)),  # v, o, gate, up
    moe_controls=None,
    first_moe=0,
    step=StepAssumption(
        params=70.6e9,
        tokens=16 * 2**20,
        gpus=1024,
        peak_flops=H100_BF16,
        mfu=0.40,
        basis="1024 H100, 16M tokens/step (Llama 3's largest batch), MFU 40%",
    ),
)

# DeepSeek-V3: MLA with q_lora_rank 1536, kv_lora_rank 512, qk_nope 128, qk_rope 64, v 128;
# the agent measures the content (NoPE) part: per head a (7168, 128) factor through the latents.
_DSV3_QK = (
    1536 * 7168  # q_a_proj
    + 128 * 192 * 1536  # q_b_proj [H (nope + rope), q_rank]
    + 576 * 7168  # kv_a_proj_with_mqa [kv_rank + rope, d]
    + 128 * 256 * 512  # kv_b_proj [H (nope + v), kv_rank]
    + 1536
    + 512  # the two latent RMSNorm scales
)
DEEPSEEK_V3 = ModelShape(
    name="DeepSeek-V3 (671B)",
    kind="mla",
    layers=61,
    d=7168,
    heads=128,
    kv_heads=128,
    dh=128,
    qk_numel=_DSV3_QK,
    # dense layers 0-2: o_proj, mlp.gate_proj, up_proj, down_proj (MLP 18432)
    controls=((7168, 16384), (18432, 7168), (18432, 7168), (7168, 18432)),
    # MoE layers: o_proj, then (routed experts fused 3-D, router excluded) the shared expert's
    # gate_proj, up_proj, down_proj (MLP 2048); checked with transformers' DeepseekV3 layout
    moe_controls=((7168, 16384), (2048, 7168), (2048, 7168), (7168, 2048)),
    first_moe=3,
    step=StepAssumption(
        params=37e9,
        tokens=15360 * 4096,
        gpus=2048,
        peak_flops=H100_BF16,
        mfu=0.40,
        basis="2048 H800, 15360 x 4096 tokens/step (DeepSeek-V3's batch), 37B activated, "
        "MFU 40% of bf16 peak (cross-check: the report's 180K H800-hours per 1T tokens give "
        "19.9 s)",
    ),
    router=RouterShape(experts=256, top_k=8, moe_layers=58, tokens_per_forward=8192),
)

MODELS = (LLAMA2_7B, LLAMA3_70B, DEEPSEEK_V3)

# ----------------------------------------------------------------------------- measurement


def _perturb(module: nn.Module) -> None:
    """A training-like change of every weight (between two snapshots)."""
    with torch.no_grad():
        for p in module.parameters():
            p.add_(1e-3 * p.abs().mean() * torch.randn_like(p))


class _MLALayer(nn.Module):
    """DeepSeek-V3's attention projections, named as in transformers (``agent.discovery.latent``
    reads them): queries through a 1536 latent, keys through a 512 latent."""

    def __init__(self, d: int, heads: int, q_rank: int, kv_rank: int, nope: int, rope: int, v: int):
        super().__init__()
        self.num_heads, self.kv_lora_rank, self.v_head_dim = heads, kv_rank, v
        self.qk_nope_head_dim, self.qk_rope_head_dim = nope, rope
        self.q_a_proj = nn.Linear(d, q_rank, bias=False)  # [r_q, d]
        self.q_a_layernorm = nn.RMSNorm(q_rank)
        self.q_b_proj = nn.Linear(q_rank, heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, kv_rank + rope, bias=False)  # [r_kv + r, d]
        self.kv_a_layernorm = nn.RMSNorm(kv_rank)
        self.kv_b_proj = nn.Linear(kv_rank, heads * (nope + v), bias=False)


@dataclass(frozen=True)
class HeadCost:
    """One QK job: per_job + n x per_head seconds for n selected query heads."""

    kind: str
    shape: str
    n: tuple[int, int]
    seconds: tuple[float, float]  # measured at the two n

    @property
    def per_head(self) -> float:
        (n0, n1), (t0, t1) = self.n, self.seconds
        return (t1 - t0) / (n1 - n0)

    @property
    def per_job(self) -> float:
        return max(0.0, self.seconds[0] - self.n[0] * self.per_head)

    def job(self, heads: int) -> float:
        return self.per_job + heads * self.per_head if heads else 0.0


def _qk_layer(kind: str, n: int) -> tuple[nn.Module, str]:
    """A model with one attention layer of ``n`` query heads of the kind's real width."""
    model = nn.Module()
    if kind == "mha":
        model.attn = QKLayer(4096, n, n, 128)
        return model, "d 4096, d_h 128, MHA"
    if kind == "gqa":
        model.attn = QKLayer(8192, 8, 1, 128)  # one KV group of 8; n of them measured
        return model, "d 8192, d_h 128, 8 query heads per KV head"
    model.attn = _MLALayer(7168, n, 1536, 512, 128, 64, 128)
    return model, "d 7168, MLA (q latent 1536, kv latent 512), nope d_h 128"


def measure_head_cost(kind: str, ns: tuple[int, int] = (2, 6)) -> HeadCost:
    """``compute_qk_samples`` of one job with n query heads, for the two n."""
    seconds = []
    shape = ""
    for n in ns:
        torch.manual_seed(0)
        model, shape = _qk_layer(kind, n)
        (site,) = find_attention(model)
        snaps = QKSnapshots(
            [site], delta=1, heads_per_layer=n, controls={}, control_rows=CONTROL_ROWS
        )
        snaps.on_step(0)
        _perturb(model)
        (job,) = snaps.on_step(1)
        assert len(job.heads) == n, job.heads
        seconds.append(median_seconds(lambda job=job: compute_qk_samples(job), 3))
    return HeadCost(kind, shape, ns, (seconds[0], seconds[1]))


def control_part(shape: tuple[int, int], rows: int | None) -> tuple[int, int]:
    """The part of a control matrix [out, in] the agent measures and snapshots with
    ``qk.control_rows`` = ``rows`` (``agent.probes.control_slice``, applied to a meta tensor)."""
    m, n = control_slice(torch.empty(shape, device="meta"), rows).shape
    return m, n


def measure_control(shape: tuple[int, int], rows: int | None, repeats: int) -> float:
    """Seconds for one control matrix [m, n] as the agent measures it with ``control_rows`` =
    ``rows``: ``compute_qk_samples`` of a job that holds only that control (the branch a rank
    owning a layer's controls runs). The whole matrix is built and perturbed; QKSnapshots
    snapshots (and the job measures) only ``control_part``, which is asserted."""
    m, n = shape
    torch.manual_seed(0)
    model = nn.Module()
    model.attn = QKLayer(64, 2, 2, 16)  # a host site; its heads are not measured
    control = nn.Parameter(torch.randn(m, n) / n**0.5)
    (site,) = find_attention(model)
    controls = {site.name: {"control.weight": control}}
    snaps = QKSnapshots([site], delta=1, controls=controls, control_rows=rows)
    snaps.on_step(0)
    with torch.no_grad():
        control.add_(1e-3 * torch.randn_like(control) / n**0.5)
    (job,) = snaps.on_step(1)
    job = dataclasses.replace(job, heads=[])
    assert tuple(job.current["control.weight"].shape) == control_part(shape, rows), job
    del control, controls, snaps  # only the job's snapshots stay
    return median_seconds(lambda: compute_qk_samples(job), repeats, warmup=repeats > 1)


# control_rows: null (whole matrices). Per-matrix seconds from benchmarks/results/scale.md at
# commit 9ad304b (this machine, 2026-12-01, the agent code before that commit: no control_rows,
# no transpose in update_spectrum), rounded as printed there: "measured" where a shape was
# timed, "model" from its two-rate fit of LAPACK's values-only SVD flop count to 12 timed
# shapes (measured / modelled 0.88-1.24). Not re-measured: the large ones take 100-340 s each.
# Only tall and square shapes: a wide difference is transposed now, so a wide matrix costs
# what its transpose cost then.
WHOLE_9AD304B: dict[tuple[int, int], tuple[float, str]] = {
    (4096, 4096): (13.54, "measured"),
    (11008, 4096): (18.95, "measured"),
    (8192, 1024): (0.51, "measured"),
    (7168, 2048): (2.20, "measured"),
    (8192, 8192): (108.0, "model"),
    (28672, 8192): (167.0, "model"),
    (18432, 7168): (100.0, "model"),
    (16384, 7168): (96.6, "model"),
}
# Their wide shapes as measured at 9ad304b (before the transpose), to compare with now.
WIDE_9AD304B = {(1024, 8192): 4.26, (2048, 7168): 11.68}
# Whole matrices re-measured now (seconds each): the wide real shapes that are cheap once
# transposed, the small tall one, and 4096 x 4096 as an anchor (same path as at 9ad304b: the
# ratio says how far today's machine state moves the reused numbers).
WHOLE_NOW = ((1024, 8192), (2048, 7168), (7168, 2048), (4096, 4096))


@dataclass(frozen=True)
class ControlCosts:
    """Seconds per control matrix [out, in] at one ``control_rows`` setting."""

    rows: int | None
    seconds_by_shape: dict[tuple[int, int], float]
    sources: dict[tuple[int, int], str]

    def seconds(self, shape: tuple[int, int]) -> float:
        return self.seconds_by_shape[shape]

    def source(self, shape: tuple[int, int]) -> str:
        return self.sources[shape]

    def part(self, shape: tuple[int, int]) -> tuple[int, int]:
        return control_part(shape, self.rows)


def real_control_shapes() -> list[tuple[int, int]]:
    shapes: list[tuple[int, int]] = []
    for model in MODELS:
        for shape in (*model.controls, *(model.moe_controls or ())):
            if shape not in shapes:
                shapes.append(shape)
    return shapes


def whole_costs(now: dict[tuple[int, int], float]) -> ControlCosts:
    """control_rows: null: re-measured where ``now`` has the shape, else 9ad304b's number of
    the shape (tall or square) or of its transpose (wide)."""
    seconds, sources = {}, {}
    for shape in real_control_shapes():
        m, n = shape
        if shape in now:
            seconds[shape], sources[shape] = now[shape], "measured now"
        elif shape in WHOLE_9AD304B:
            seconds[shape], how = WHOLE_9AD304B[shape]
            sources[shape] = f"9ad304b ({how})"
        else:
            seconds[shape], how = WHOLE_9AD304B[(n, m)]
            sources[shape] = f"9ad304b, its transpose ({how})"
    return ControlCosts(None, seconds, sources)


def measure_controls(rows: int | None, repeats: int = 3) -> tuple[ControlCosts, ControlCosts]:
    """(the agent's default, control_rows ``rows``; control_rows null). Every real shape is
    timed at ``rows`` unless that is the whole matrix (then the null cost applies)."""
    now = {}
    for shape in WHOLE_NOW:
        now[shape] = measure_control(shape, None, 1 if shape == (4096, 4096) else 2)
        print(f"  control {shape[0]} x {shape[1]}, whole: {now[shape]:.2f} s", flush=True)
    whole = whole_costs(now)
    seconds, sources = {}, {}
    for shape in real_control_shapes():
        if control_part(shape, rows) == shape:
            seconds[shape], sources[shape] = whole.seconds(shape), whole.source(shape)
            continue
        seconds[shape], sources[shape] = measure_control(shape, rows, repeats), "measured now"
        m, n = control_part(shape, rows)
        print(
            f"  control {shape[0]} x {shape[1]} (measures {m} x {n}): {seconds[shape]:.3f} s",
            flush=True,
        )
    return ControlCosts(rows, seconds, sources), whole


@dataclass(frozen=True)
class RouterCost:
    tokens: int
    experts: int
    d: int
    bare_s: float  # the router's own forward (x W^T)
    hooked_s: float  # the same forward with the probe attached, plus its read-out, per forward

    @property
    def hook_s(self) -> float:
        return max(0.0, self.hooked_s - self.bare_s)


class _MoEBlock(nn.Module):
    def __init__(self, d: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.n_routed_experts, self.num_experts_per_tok = experts, top_k
        self.gate = nn.Linear(d, experts, bias=False)


def measure_router(router: RouterShape, d: int, forwards: int = 4) -> RouterCost:
    """The probe's cost per forward: ``forwards`` router forwards with the probe attached and
    one read-out, minus the same forwards without it."""
    torch.manual_seed(0)
    model = nn.Module()
    model.mlp = _MoEBlock(d, router.experts, router.top_k)
    sites = find_routers(model)
    assert len(sites) == 1, sites
    x = torch.randn(router.tokens_per_forward, d)
    gate = model.mlp.gate

    def run(read: RouterProbe | None) -> None:
        with torch.no_grad():
            for _ in range(forwards):
                gate(x)
        if read is not None:
            read.read(0)

    bare = median_seconds(lambda: run(None), 3) / forwards
    probe = RouterProbe(sites, default_top_k=router.top_k)
    probe.attach()
    hooked = median_seconds(lambda: run(probe), 3) / forwards
    probe.detach()
    return RouterCost(router.tokens_per_forward, router.experts, d, bare, hooked)


# ----------------------------------------------------------------------------- the model on paper


@dataclass(frozen=True)
class Settings:
    delta: int = 25
    layers_per_eval: int | None = None  # None: all
    heads_per_layer: int | None = None  # None: all
    controls: int = 4

    def describe(self, model: ModelShape, rows: int | None = CONTROL_ROWS) -> str:
        lpe = self.layers_per_eval or model.layers
        hpl = self.heads_per_layer or model.heads
        text = (
            f"delta {self.delta}, layers_per_eval {lpe}, heads_per_layer {hpl}, "
            f"controls {self.controls}"
        )
        return text + (f", control_rows {_rows(rows)}" if self.controls else "")


@dataclass(frozen=True)
class Work:
    """Seconds of monitor work per evaluation, mean over a rotation."""

    qk_total: float  # every head's job, one process
    controls_total: float
    slowest_rank: float  # at the model's GPU count: mean over evaluations of the max rank
    worst_rank: float  # the largest single evaluation on one rank

    @property
    def total(self) -> float:
        return self.qk_total + self.controls_total


def control_seconds(model: ModelShape, costs: ControlCosts, layer: int, count: int) -> float:
    return sum(costs.seconds(shape) for shape in model.layer_controls(layer)[:count])


def evaluation_work(
    model: ModelShape, head: HeadCost, costs: ControlCosts, s: Settings, max_evals: int = 64
) -> Work:
    """Simulate the rotation of QKSnapshots (layer window, head window per layer) and the
    distributed assignment (head h of layer i -> rank (i H + h) % world, controls of layer i ->
    rank i % world) over up to ``max_evals`` evaluations."""
    world, layers, heads = model.step.gpus, model.layers, model.heads
    lpe = min(s.layers_per_eval or layers, layers)
    hpl = min(s.heads_per_layer or heads, heads)
    evals = min(max_evals, math.ceil(layers / lpe) * math.ceil(heads / hpl))
    offset = [0] * layers
    qk_total = ctl_total = slowest = worst = 0.0
    for e in range(evals):
        start = (e * lpe) % layers
        per_rank: Counter[int] = Counter()
        for i in range(lpe):
            layer = (start + i) % layers
            chosen = [(offset[layer] + j) % heads for j in range(hpl)]
            offset[layer] = (offset[layer] + hpl) % heads
            for rank, n in Counter(head_rank(layer, h, heads, world) for h in chosen).items():
                per_rank[rank] += head.job(n)
            ctl = control_seconds(model, costs, layer, s.controls)
            per_rank[control_rank(layer, world)] += ctl
            qk_total += head.job(hpl)
            ctl_total += ctl
        top = max(per_rank.values())
        slowest += top
        worst = max(worst, top)
    return Work(qk_total / evals, ctl_total / evals, slowest / evals, worst)


def snapshot_bytes(model: ModelShape, s: Settings, rows: int | None) -> float:
    """fp32 snapshot bytes held at once by one process: all layers -> previous + current of
    each; a rotating window -> previous + current of the measured window and the previous of
    the next one (QKSnapshots.on_step), counted at the largest layers. Of a control matrix
    only the part measured with ``control_rows`` = ``rows`` is copied (``control_part``)."""
    lpe = min(s.layers_per_eval or model.layers, model.layers)
    per_layer = max(
        model.qk_numel
        + sum(
            math.prod(control_part(shape, rows)) for shape in model.layer_controls(i)[: s.controls]
        )
        for i in range(model.layers)
    )
    copies = 2 * model.layers if lpe == model.layers else 3 * lpe
    return 4.0 * per_layer * copies


def fraction(work: Work, model: ModelShape, delta: int) -> float:
    """The slowest rank's monitor work per step as a fraction of the step time."""
    return work.slowest_rank / (delta * model.step.seconds)


def _control_bytes(model: ModelShape, rows: int | None) -> float:
    """What the 4 controls add to the snapshot memory with every layer."""
    every = snapshot_bytes(model, Settings(controls=4), rows)
    return every - snapshot_bytes(model, Settings(controls=0), rows)


def _options(limit: int, extra: int) -> list[int]:
    return sorted({v for v in (1, 2, 4, 8, 16, 32, 64, 128) if v <= limit} | {extra})


@dataclass(frozen=True)
class Choice:
    settings: Settings
    work: Work

    def head_period(self, model: ModelShape) -> int:
        s = self.settings
        lpe = s.layers_per_eval or model.layers
        hpl = s.heads_per_layer or model.heads
        return s.delta * math.ceil(model.layers / lpe) * math.ceil(model.heads / hpl)

    def layer_period(self, model: ModelShape) -> int:
        lpe = self.settings.layers_per_eval or model.layers
        return self.settings.delta * math.ceil(model.layers / lpe)


def recommend(
    model: ModelShape, head: HeadCost, costs: ControlCosts, with_controls: bool
) -> Choice | None:
    """Within the budget on the slowest rank: the smallest delta, then the shortest period in
    which every head is measured, then the most layers per evaluation, then the most controls.
    ``with_controls``: at least one control matrix per measured layer; else none."""
    counts = range(1, 5) if with_controls else (0,)
    works: dict[tuple[int, int, int], Work] = {}
    for lpe in _options(model.layers, model.layers):
        for hpl in _options(model.heads, model.heads):
            for c in counts:
                works[(lpe, hpl, c)] = evaluation_work(
                    model, head, costs, Settings(25, lpe, hpl, c), max_evals=24
                )
    for delta in DELTAS:
        fits = [
            Choice(Settings(delta, lpe, hpl, c), work)
            for (lpe, hpl, c), work in works.items()
            if fraction(work, model, delta) <= BUDGET
        ]
        if fits:
            return min(
                fits,
                key=lambda ch: (
                    ch.head_period(model),
                    -(ch.settings.layers_per_eval or 0),
                    -ch.settings.controls,
                ),
            )
    return None


# ----------------------------------------------------------------------------- report


def _s(seconds: float) -> str:
    if seconds >= 100:
        return f"{seconds:,.0f} s"
    if seconds >= 1:
        return f"{seconds:.1f} s"
    return f"{1e3 * seconds:.0f} ms" if seconds >= 0.01 else f"{1e3 * seconds:.1f} ms"


def _pct(x: float) -> str:
    return f"{100 * x:,.1f}%" if x >= 0.001 else f"{100 * x:.3f}%"


def _gib(b: float) -> str:
    return f"{b / 2**30:,.1f} GiB"


def _rows(rows: int | None) -> str:
    return "null" if rows is None else str(rows)


def _shape(shape: tuple[int, int]) -> str:
    return f"{shape[0]} x {shape[1]}"


def _git_state() -> str:
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "agent"], capture_output=True, text=True
        ).stdout.split("\n")
    except (OSError, subprocess.CalledProcessError):
        return "Working tree: unknown (no git)."
    changed = sorted({line[3:] for line in dirty if line.strip()})
    more = f"; uncommitted changes in {', '.join(changed)}" if changed else ""
    return f"Working tree: commit {head}{more} (the agent code measured is what was there)."


# The per-head QK cost printed in this table at commit 9ad304b (Delta_2's direction from a second
# QR then), to compare with now.
QK_PER_HEAD_9AD304B = {"mha": 0.098, "gqa": 0.173, "mla": 0.247}
CONTROL_NAMES = {
    "Llama-2-7B": ("v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj"),
    "Llama-3-70B": ("v_proj", "o_proj", "mlp.gate_proj", "mlp.up_proj"),
}


def _control_groups(model: ModelShape) -> list[tuple[str, tuple[tuple[int, int], ...]]]:
    if model.moe_controls is None:
        return [("all", model.controls)]
    return [
        (f"dense (0-{model.first_moe - 1})", model.controls),
        (f"MoE ({model.first_moe}-{model.layers - 1})", model.moe_controls),
    ]


def _control_label(model: ModelShape, where: str, i: int) -> str:
    labels = CONTROL_NAMES.get(
        model.name, ("o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    )
    moe = where.startswith("MoE")
    return labels[i] if not moe or i == 0 else "shared_experts." + labels[i][4:]


def render(
    heads: dict[str, HeadCost],
    costs: ControlCosts,
    whole: ControlCosts,
    now: dict[tuple[int, int], float],
    router: RouterCost,
    seconds: float,
    load: tuple[float, float] = (math.nan, math.nan),
) -> list[str]:
    rows = _rows(costs.rows)
    lines = [
        "# Monitor cost at scale, on paper",
        "",
        *provenance(),
        _git_state(),
        "",
        "**Every cost below was measured on this CPU with one intra-op thread (no GPU was "
        "available) and is an upper bound for the same work on a GPU, where the snapshots "
        "live by default. A GPU will be faster; by how much is unmeasured here "
        "(`benchmarks/gpu.py` measures it, and was not run).** Costs at shapes that were not "
        f"timed are taken as stated. Measuring took {seconds:.0f} s; the 1-minute load "
        f"average was {load[0]:.1f} at the start and {load[1]:.1f} at the end, on "
        f"{os.cpu_count()} cores"
        + (
            ": other processes were running, the unit costs may be inflated by contention."
            if max(load) > 1.5
            else "."
        ),
        "",
        "What is measured is what the agent does by default: `qk.control_rows` = "
        f"{rows} (`AgentConfig().qk.control_rows`), so a control matrix whose both dimensions "
        f"exceed {rows} is snapshotted and measured on its first {rows} rows "
        "(`agent.probes.control_slice`); `update_spectrum` transposes a wide difference before "
        "`svdvals`; the QK spectra and Delta_2's direction come from one batched QR pass. "
        "Whole matrices (`control_rows: null`) are a secondary column: re-measured at the "
        f"shapes that take seconds ({', '.join(_shape(x) for x in now)}), the rest are the "
        "numbers of this table at commit 9ad304b (measured or modelled there, before the "
        "transpose; a wide matrix at its transpose's cost), not re-measured.",
        "",
        "## Measured unit costs (agent code, fp32, 1 thread, medians)",
        "",
        "| unit | shape | seconds | how |",
        "|---|---|---|---|",
    ]
    for kind, cost in heads.items():
        lines.append(
            f"| QK job, per query head | {cost.shape} | {cost.per_head:.3f} | compute_qk_samples "
            f"at n = {cost.n[0]} and {cost.n[1]} heads ({_s(cost.seconds[0])}, "
            f"{_s(cost.seconds[1])}): slope (9ad304b's table: {QK_PER_HEAD_9AD304B[kind]:.3f}) |"
        )
        lines.append(
            f"| QK job, fixed part | {cost.shape} | {cost.per_job:.3f} | intercept of the same |"
        )
    for shape in real_control_shapes():
        if costs.source(shape) != "measured now":
            continue
        lines.append(
            f"| control matrix, control_rows {rows} | {_shape(shape)} (measures "
            f"{_shape(costs.part(shape))}) | {costs.seconds(shape):.3f} | compute_qk_samples, "
            "controls only |"
        )
    for shape, t in now.items():
        before = WIDE_9AD304B.get(shape) or WHOLE_9AD304B.get(shape, (math.nan, ""))[0]
        lines.append(
            f"| control matrix, control_rows null | {_shape(shape)} | {t:.2f} | "
            f"compute_qk_samples, controls only, whole matrix (9ad304b's table: {before:.2f}) |"
        )
    lines += [
        f"| router probe, per forward | {router.tokens} tokens x {router.experts} experts, "
        f"d {router.d} | {router.hook_s:.3f} | forwards with the probe + read-out, minus "
        f"without (the router's own x W^T: {router.bare_s:.3f} s) |",
        "",
        "## Assumed step times",
        "",
        "step time = 6 N T / (GPUs x peak x MFU), peak = 989 TFLOP/s (dense bf16, H100/H800 "
        "SXM), MFU 40% (Llama 3 reports 38-43% on 16K H100s). The budget is 1% of it: the "
        "slowest rank's monitor work per evaluation must stay under 0.01 x delta x step time.",
        "",
        "| model | N | tokens / step | GPUs | step time | 1% budget per evaluation at delta 25 "
        "| basis |",
        "|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        st = model.step
        lines.append(
            f"| {model.name} | {st.params / 1e9:.1f}B | {st.tokens / 1e6:.1f}M | {st.gpus} | "
            f"{st.seconds:.1f} s | {_s(BUDGET * 25 * st.seconds)} | {st.basis} |"
        )
    lines += [
        "",
        "## Control matrices (what one costs, in the order the agent takes them)",
        "",
        f"| model | layer | control | shape [out, in] | measured part (control_rows {rows}) "
        f"| seconds (control_rows {rows}) | seconds, control_rows null | null from |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for model in MODELS:
        for where, shapes in _control_groups(model):
            for i, shape in enumerate(shapes):
                lines.append(
                    f"| {model.name} | {where} | {i + 1}. {_control_label(model, where, i)} | "
                    f"{_shape(shape)} | {_shape(costs.part(shape))} | "
                    f"{_s(costs.seconds(shape))} | {_s(whole.seconds(shape))} | "
                    f"{whole.source(shape)} |"
                )
    lines += [
        "",
        "## One evaluation with every layer and head",
        "",
        "Total: all the work in one process (world 1). Slowest rank: spread over the job's "
        "GPUs as `agent/distributed/assignment.py` does (mean over evaluations of the busiest "
        "rank; a layer's controls all land on one rank). % of step: the slowest rank's work "
        f"per step at delta 25. The default is controls 4, control_rows {rows}.",
        "",
        "| model | controls | control_rows | QK, total | controls, total | total | even spread "
        "(total / GPUs) | slowest rank | % of step (delta 25) | snapshot memory (fp32, world 1) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    summary: dict[tuple[str, int, int | None], Work] = {}
    for model in MODELS:
        head = heads[model.kind]
        for c, ctl in ((0, costs), (4, costs), (4, whole)):
            s = Settings(25, None, None, c)
            work = evaluation_work(model, head, ctl, s)
            summary[(model.name, c, ctl.rows)] = work
            lines.append(
                f"| {model.name} | {c} | {_rows(ctl.rows) if c else '-'} | {_s(work.qk_total)} "
                f"| {_s(work.controls_total)} | {_s(work.total)} | "
                f"{_s(work.total / model.step.gpus)} | {_s(work.slowest_rank)} | "
                f"{_pct(fraction(work, model, 25))} | {_gib(snapshot_bytes(model, s, ctl.rows))} |"
            )
    lines += [
        "",
        "## Settings that keep the monitor work within 1% of the step time",
        "",
        "Searched: delta in {25, 50, 100, 200, 400}, layers_per_eval and heads_per_layer in "
        "powers of two (and all), controls 0-4; chosen: the smallest delta, then the shortest "
        "period in which every head is measured, then the most layers, then the most "
        "controls. Work on the slowest rank at the model's GPU count.",
        "",
        "| model | controls | settings | slowest rank / evaluation | % of step | every head "
        "measured every | every layer every | snapshot memory (world 1) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    choices: dict[tuple[str, bool, int | None], Choice | None] = {}
    for model in MODELS:
        head = heads[model.kind]
        for with_controls, ctl in ((False, costs), (True, costs), (True, whole)):
            choice = recommend(model, head, ctl, with_controls)
            choices[(model.name, with_controls, ctl.rows)] = choice
            what = f"at least 1, control_rows {_rows(ctl.rows)}" if with_controls else "none"
            if choice is None:
                one = min(control_seconds(model, ctl, layer, 1) for layer in range(model.layers))
                lines.append(
                    f"| {model.name} | {what} | none fits up to delta {DELTAS[-1]}: the first "
                    f"control alone costs {_s(one)} on one rank, over the budget of "
                    f"{_s(BUDGET * DELTAS[-1] * model.step.seconds)} | | | | | |"
                )
                continue
            s = choice.settings
            lines.append(
                f"| {model.name} | {what} | {s.describe(model, ctl.rows)} | "
                f"{_s(choice.work.slowest_rank)} | {_pct(fraction(choice.work, model, s.delta))} "
                f"| {choice.head_period(model):,} steps | {choice.layer_period(model):,} steps | "
                f"{_gib(snapshot_bytes(model, s, ctl.rows))} |"
            )
    lines += ["", *router_lines(router), ""]
    lines += conclusions(heads, summary, choices, costs, whole, now)
    return lines


def router_lines(router: RouterCost) -> list[str]:
    model = DEEPSEEK_V3
    shape = model.router
    assert shape is not None
    forwards = model.step.tokens / (model.step.gpus * shape.tokens_per_forward)
    per_step = shape.moe_layers * forwards * router.hook_s
    flops = shape.moe_layers * 2 * model.d * shape.experts / (6 * model.step.params)
    return [
        "## Router probe (DeepSeek-V3)",
        "",
        f"Per GPU and step: {model.step.tokens / model.step.gpus:,.0f} tokens = {forwards:.2f} "
        f"forwards of {shape.tokens_per_forward} tokens through each of {shape.moe_layers} "
        f"routers. On this CPU the probe costs {_s(router.hook_s)} per forward, "
        f"{_s(per_step)} per step ({_pct(per_step / model.step.seconds)} of the step time): "
        "meaningless for a GPU, where the probe's work is the logits' recomputation "
        f"(2 d E = {2 * model.d * shape.experts / 1e6:.1f} MFLOP per token and router) and a "
        f"few reductions over (tokens, E): {100 * flops:.2f}% of the training FLOPs "
        "(6 N per token), plus kernel launches (unmeasured).",
    ]


def conclusions(
    heads: dict[str, HeadCost],
    summary: dict[tuple[str, int, int | None], Work],
    choices: dict[tuple[str, bool, int | None], Choice | None],
    costs: ControlCosts,
    whole: ControlCosts,
    now: dict[tuple[int, int], float],
) -> list[str]:
    rows = _rows(costs.rows)
    lines = ["## What this says", ""]
    for model in MODELS:
        qk = summary[(model.name, 0, costs.rows)]
        work = summary[(model.name, 4, costs.rows)]
        null = summary[(model.name, 4, None)]
        lag = APPLY_LAG * model.step.seconds
        lines.append(
            f"- {model.name}: the default settings (every layer and head, 4 controls on their "
            f"first {rows} rows, delta 25) take {_pct(fraction(work, model, 25))} of the step "
            f"time on the slowest of {model.step.gpus} ranks ({_s(work.slowest_rank)} per "
            f"evaluation; {_pct(fraction(qk, model, 25))} without controls); in one process "
            f"the controls are {_s(work.controls_total)} of {_s(work.total)} "
            f"({100 * work.controls_total / work.total:.0f}%). Its worst evaluation on one rank "
            f"({_s(work.worst_rank)}) "
            + (
                f"exceeds apply_lag x step ({_s(lag)}): training would wait for it (up to "
                "scheduling.max_wait_s, 120 s, per job; then the result is dropped)."
                if work.worst_rank > lag
                else f"stays within apply_lag x step ({_s(lag)})."
            )
            + f" With control_rows: null: {_pct(fraction(null, model, 25))} of the step, "
            f"controls {_s(null.controls_total)} in one process"
            + (
                f", worst evaluation {_s(null.worst_rank)} over apply_lag x step."
                if null.worst_rank > lag
                else "."
            )
        )
    dominated = [
        m.name
        for m in MODELS
        if summary[(m.name, 4, costs.rows)].controls_total
        > summary[(m.name, 4, costs.rows)].qk_total
    ]
    dominated_null = [
        m.name
        for m in MODELS
        if summary[(m.name, 4, None)].controls_total > summary[(m.name, 4, None)].qk_total
    ]
    per_layer = "; ".join(
        f"{m.name} {_s(control_seconds(m, costs, m.layers - 1, 4))} for 4 controls against "
        f"{_s(heads[m.kind].job(m.heads))} for the {m.heads} QK heads"
        for m in MODELS
    )
    added = "; ".join(
        f"{m.name} {_s(summary[(m.name, 0, costs.rows)].slowest_rank)} -> "
        f"{_s(summary[(m.name, 4, costs.rows)].slowest_rank)}"
        for m in MODELS
    )
    if not dominated:
        verdict = (
            "The control matrices no longer dominate the monitor cost at any scale here"
            + (
                f" (with whole matrices they do: {', '.join(dominated_null)})"
                if dominated_null
                else ""
            )
            + f": measured on its first {rows} rows, a control is an SVD of a (in x {rows}) "
            f"block, O(in {rows}^2), instead of O(d^3) for a whole d x d matrix. Per layer (the "
            f"last one): {per_layer}."
        )
    else:
        verdict = (
            f"The control matrices still dominate the monitor cost in one process for "
            f"{', '.join(dominated)} (of {len(MODELS)} models). Per layer (the last one): "
            f"{per_layer}."
        )
    lines += [
        "",
        f"- {verdict} On a distributed job a layer's controls still land on one rank; with "
        "every layer and head at delta 25 they move the slowest rank (controls 0 -> 4): "
        f"{added}.",
    ]
    same_part: dict[tuple[int, int], list[float]] = {}
    for shape in real_control_shapes():
        if costs.source(shape) == "measured now":
            same_part.setdefault(costs.part(shape), []).append(costs.seconds(shape))
    spread = [max(v) / min(v) for v in same_part.values() if len(v) > 1]
    blocks = sorted(same_part.items(), key=lambda kv: kv[0][1])
    medians = [statistics.median(v) for _, v in blocks]
    per_column = [t / part[1] for (part, _), t in zip(blocks, medians, strict=True)]
    groups = [(m, where, shapes) for m in MODELS for where, shapes in _control_groups(m)]

    def span(ctl: ControlCosts, shapes: tuple[tuple[int, int], ...]) -> float:
        values = [ctl.seconds(x) for x in shapes]
        return max(values) / min(values)

    first = [  # the first control taken costs (within 10% of) the layer's most
        f"{m.name} {where}"
        for m, where, shapes in groups
        if span(costs, shapes) > 1.5
        and costs.seconds(shapes[0]) >= 0.9 * max(costs.seconds(x) for x in shapes)
    ]
    lines.append(
        f"- The measured {rows}-row blocks cost "
        + ", ".join(
            f"{_s(t)} at {_shape(part)}" for (part, _), t in zip(blocks, medians, strict=True)
        )
        + f": {1e6 * min(per_column):.0f}-{1e6 * max(per_column):.0f} us per input column"
        + (
            f"; real shapes with the same block within {max(spread):.2f}x of each other."
            if spread
            else "."
        )
        + " Costliest / cheapest control of a layer, with control_rows "
        f"{rows} (null): "
        + "; ".join(
            f"{m.name} {where} {span(costs, shapes):.1f}x ({span(whole, shapes):.1f}x)"
            for m, where, shapes in groups
        )
        + (
            f". The first control taken is (within 10% of) the layer's costliest in: "
            f"{', '.join(first)}."
            if first
            else "."
        )
    )
    for model in MODELS:
        choice = choices[(model.name, False, costs.rows)]
        s = None if choice is None else choice.settings
        full = s is not None and s.delta == 25 and s.layers_per_eval == model.layers
        full = full and s is not None and s.heads_per_layer == model.heads
        with_ctl = choices[(model.name, True, costs.rows)]
        lines.append(
            f"- {model.name}, QK monitors alone (controls 0): "
            + (
                "every layer and head at delta 25 fits the budget once spread over the ranks "
                f"({_pct(fraction(choice.work, model, 25))} of the step)"
                if full and choice is not None
                else f"{'no setting fits' if s is None else s.describe(model)} (every layer "
                f"and head at delta 25: "
                f"{_pct(fraction(summary[(model.name, 0, costs.rows)], model, 25))} "
                "of the step on the slowest rank)"
            )
            + "; with controls: "
            + (
                "none fits"
                if with_ctl is None
                else f"{with_ctl.settings.describe(model, costs.rows)}"
            )
            + "."
        )
    moved = [
        f"{_shape(shape)} {t:.2f} s against {WIDE_9AD304B[shape]:.2f} s"
        for shape, t in now.items()
        if shape in WIDE_9AD304B
    ]
    anchor = now.get((4096, 4096))
    concentrated = [
        m.name
        for m in MODELS
        if fraction(summary[(m.name, 0, costs.rows)], m, 25) > BUDGET
        and summary[(m.name, 0, costs.rows)].total / m.step.gpus <= BUDGET * 25 * m.step.seconds
    ]
    lines += [
        f"- Wide differences are transposed before `svdvals` now (same values): whole wide "
        f"matrices measured now against 9ad304b's table (not transposed then): "
        f"{'; '.join(moved)}. CPU only: a GPU library may behave otherwise.",
    ]
    if anchor is not None:
        ratio = anchor / WHOLE_9AD304B[(4096, 4096)][0]
        lines.append(
            f"- The whole-matrix numbers reused from 9ad304b: a whole 4096 x 4096 (the same "
            f"path then and now) took {anchor:.2f} s now against "
            f"{WHOLE_9AD304B[(4096, 4096)][0]:.2f} s then ({ratio:.2f}x)"
            + (
                "; the reused numbers should be within about that of what this machine gives now."
                if 0.8 <= ratio <= 1.25
                else "; the machine's state differs from then: the reused numbers may be off "
                "by about that factor."
            )
        )
    lines += [
        "- Not measured: the GPU. Snapshots live next to the weights by default, so the "
        "monitors run on the device beside training; how much faster the QR-based QK path and "
        "the controls' SVDs are there is unknown (`benchmarks/gpu.py` times the agent's "
        "default path, controls included, on a GPU; not run).",
        "- The spread over ranks is uneven: query head h of layer i goes to rank (i + h) % "
        "world and every layer's head window starts at the same offset, so one evaluation "
        "puts up to min(layers_per_eval, heads_per_layer) heads on one rank however many "
        "ranks there are. QK work of one evaluation with every layer and head, slowest rank "
        "against an even spread: "
        + "; ".join(
            f"{m.name} {_s(summary[(m.name, 0, costs.rows)].slowest_rank)} against "
            f"{_s(summary[(m.name, 0, costs.rows)].total / m.step.gpus)} ("
            f"{_pct(fraction(summary[(m.name, 0, costs.rows)], m, 25))} against "
            f"{_pct(summary[(m.name, 0, costs.rows)].total / m.step.gpus / (25 * m.step.seconds))}"
            " of the step at delta 25)"
            for m in MODELS
        )
        + "."
        + (
            " Where every layer and head at delta 25 is over the budget, it is this "
            "concentration, not the total work: "
            + ", ".join(concentrated)
            + " would fit with an even spread."
            if concentrated
            else ""
        ),
        "- Snapshot memory is that of one process (where the snapshots live: next to the "
        "weights by default, i.e. on the GPU); only the measured part of a control matrix is "
        "copied, so with every layer the 4 controls add "
        + "; ".join(
            f"{m.name} {_gib(_control_bytes(m, costs.rows))} (whole: "
            f"{_gib(_control_bytes(m, None))})"
            for m in MODELS
        )
        + ". A distributed rank holds only its heads' Q/K rows (all of an MLA layer's latent "
        "stage) and the controls of the layers it owns.",
        "- Assumed: every rank can measure any layer (DDP / FSDP, as "
        "`agent/distributed/assignment.py` spreads the work); pipeline parallelism is not "
        "covered by the agent.",
    ]
    return lines


# ----------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/scale.md"))
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # one core: what a monitor thread has beside a training loop
    t0 = time.perf_counter()
    load_start = os.getloadavg()[0]
    heads = {}
    for kind in ("mha", "gqa", "mla"):
        heads[kind] = measure_head_cost(kind)
        cost = heads[kind]
        print(f"  QK {cost.shape}: {cost.per_head:.3f} s/head + {cost.per_job:.3f} s", flush=True)
    router_shape = DEEPSEEK_V3.router
    assert router_shape is not None
    router = measure_router(router_shape, DEEPSEEK_V3.d)
    print(f"  router probe: {router.hook_s:.3f} s per forward", flush=True)
    costs, whole = measure_controls(CONTROL_ROWS)
    now = {shape: whole.seconds(shape) for shape in WHOLE_NOW}
    load = (load_start, os.getloadavg()[0])
    lines = render(heads, costs, whole, now, router, time.perf_counter() - t0, load)
    text = "\n".join(lines) + "\n"
    print(text)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
