"""What the agent costs: test-bed steps per second with and without it, and one monitor
evaluation of a frontier-shaped layer stack.

Run: python benchmarks/overhead.py [--blocks 12] [--block-steps 50] [--out FILE]

1. Test bed: two identical runs (same seed), one with the agent (all default monitors and
   rules, detect-only, no checkpoints), stepped alternately in blocks of --block-steps steps in
   one process; the median time per block gives the slowdown. One intra-op thread for training
   (the monitor thread has the other core).
2. Frontier shape: one attention layer with d = 4096, 32 query heads of d_h = 128 and 8 KV heads
   (GQA), measured through the agent's own probe code (snapshot + compute_qk_samples) for all
   heads and for the sampled subset, extrapolated to 32 layers with the default and a sampled
   configuration; a 64-expert router's per-forward hook work on 8192 tokens; snapshot memory.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance
from torch import nn

from agent.agent import Agent
from agent.discovery import find_attention
from agent.monitors import routing_stats
from agent.probes import QKSnapshots, compute_qk_samples
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig
from agent.testbed.supervised import default_agent_config


def testbed_overhead(blocks: int, block_steps: int, run_dir: Path) -> tuple[float, float]:
    torch.set_num_threads(1)
    scenario = ScenarioConfig.preset("clean", seed=0, steps=blocks * block_steps + 1)
    bare = TestbedRun(scenario, record_monitors=False)
    watched = TestbedRun(scenario, record_monitors=False)
    config = default_agent_config(run_dir, remediate=False, checkpoints={"enabled": False})
    agent = Agent(watched.model, watched.optimizer, watched.scheduler, config)
    t_bare, t_agent = [], []
    step = 0
    for _ in range(blocks):
        t0 = time.perf_counter()
        for _ in range(block_steps):
            bare.step()
        t_bare.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for i in range(block_steps):
            loss = watched.step()
            agent.step(step + i, loss=loss, grad_norm=watched.last_grad_norm)
        t_agent.append(time.perf_counter() - t0)
        step += block_steps
    agent.close()
    return statistics.median(t_bare) / block_steps, statistics.median(t_agent) / block_steps


class _Layer(nn.Module):
    def __init__(self, d: int, heads: int, kv_heads: int, dh: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, kv_heads, dh
        self.q_proj = nn.Linear(d, heads * dh, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * dh, bias=False)


def frontier_layer(d: int, heads: int, kv_heads: int, dh: int, sampled_heads: int) -> dict:
    torch.manual_seed(0)
    model = nn.Module()
    model.attn = _Layer(d, heads, kv_heads, dh)
    site = find_attention(model)[0]
    snapshot_bytes = sum(p.numel() * 4 for p in site.parameters_to_snapshot().values())
    out = {"snapshot_mb_per_layer": snapshot_bytes / 2**20}
    for label, per_layer in (("all heads", None), (f"{sampled_heads} heads", sampled_heads)):
        snaps = QKSnapshots([site], delta=1, heads_per_layer=per_layer)
        t0 = time.perf_counter()
        snaps.on_step(0)
        out["snapshot_s"] = time.perf_counter() - t0
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-3 * torch.randn_like(p))
        (job,) = snaps.on_step(1)
        t0 = time.perf_counter()
        compute_qk_samples(job)
        out[label] = time.perf_counter() - t0
    return out


def router_hook_cost(tokens: int, experts: int, top_k: int) -> float:
    logits = torch.randn(tokens, experts)
    routing_stats(logits, top_k)
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        routing_stats(logits, top_k)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=12)
    p.add_argument("--block-steps", type=int, default=50)
    p.add_argument("--run-dir", type=Path, default=Path("out/overhead"))
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # training: one thread; the monitor thread has the other core
    lines = provenance()
    bare, watched = testbed_overhead(args.blocks, args.block_steps, args.run_dir)
    lines += [
        "| test bed (2 layers, d 64, 8 experts) | ms / step |",
        "|---|---|",
        f"| without the agent | {1e3 * bare:.2f} |",
        f"| with the agent (default cadences) | {1e3 * watched:.2f} |",
        f"| slowdown | {watched / bare - 1:+.1%} |",
        "",
    ]
    print("\n".join(lines), flush=True)
    torch.set_num_threads(1)  # one core, as the monitor thread has beside a training loop
    layer = frontier_layer(4096, 32, 8, 128, sampled_heads=8)
    per_layer_all, per_layer_8 = layer["all heads"], layer["8 heads"]
    mb = layer["snapshot_mb_per_layer"]
    lines += [
        "| frontier shape: d 4096, 32 heads x 128, 8 KV heads (GQA), 32 layers; CPU, 1 thread "
        "| value |",
        "|---|---|",
        f"| one layer, all 32 heads (monitor thread) | {per_layer_all:.2f} s |",
        f"| one layer, 8 heads (heads_per_layer: 8) | {per_layer_8:.2f} s |",
        f"| 32 layers, all heads, per evaluation | {32 * per_layer_all:.1f} s |",
        f"| layers_per_eval: 4, heads_per_layer: 8, per evaluation | {4 * per_layer_8:.2f} s |",
        f"| snapshot copy of one layer, training thread | {layer['snapshot_s']:.3f} s |",
        f"| snapshot memory per layer (fp32 W_q + W_k) | {mb:.0f} MiB |",
        f"| snapshot memory, all 32 layers (previous + current) | {2 * 32 * mb / 1024:.1f} GiB |",
        f"| snapshot memory, layers_per_eval: 4 | {2 * 4 * mb:.0f} MiB |",
        f"| 64-expert router hook on 8192 tokens (per forward, CPU) | "
        f"{1e3 * router_hook_cost(8192, 64, 2):.2f} ms |",
    ]
    text = "\n".join(lines)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
