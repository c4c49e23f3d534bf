"""Per-rank monitor cost and collective time of one Agent per rank, at world 1, 2 and 4.

Run: python benchmarks/distributed.py [--out benchmarks/results/distributed.md] [--steps N]

Spawns ``world`` processes (gloo, file:// rendezvous, one intra-op thread each), each training
the test-bed MoE transformer under DDP (and FSDP2 with ``--wraps ddp fsdp``) with one
``Agent``; the default rules, checkpoints and the watchdog off (their cost is not the
monitors'). Per rank it measures:

- the monitor thread's CPU time (``time.thread_time`` inside every job the agent submits to
  it: QK spectra, controls, router weight statistics, and in a distributed job the expansion
  of the fetched rows) per QK evaluation, and how many query heads the rank measured per
  evaluation: the work that should fall as 1/world;
- every collective the agent runs (``World``'s gathers, and the row fetches of sharded
  weights): the steps it ran at, its count and its wall time, per read-out step and averaged
  over all steps. A read-out step here is a symptom/router read-out (every ``EVERY`` steps)
  or a QK apply step (an evaluation + ``LAG``, where the QK results are gathered); no
  collective may run on any other step;
- the wall time of ``agent.step`` on the training thread, averaged over the steps.

The world-1 run is the same script in one process (no collectives: ``Measurements``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from provenance import provenance

from agent.testbed.model import MoETransformer, TestbedConfig

SHAPE = TestbedConfig(
    vocab=256, d_model=256, n_layers=4, n_heads=8, n_kv_heads=8, n_experts=4, top_k=2,
    d_expert=256, seq_len=32,
)  # fmt: skip
EVERY = 10  # qk delta, router and symptom read-outs: every 10 steps
LAG = 5  # QK results measured at step t are gathered at t + LAG (scheduling.apply_lag)


NOTES = """How to read it:

- Monitor CPU is the monitor thread's own CPU time (``time.thread_time``), so other processes
  on the machine slow it only through shared caches and memory; per rank it falls about as
  1/world because each rank measures L x H / world heads. What does not split exactly: the
  control matrices and router weight statistics go by layer / router (4 layers: 2 or 1 per
  rank), and a rank expands its fetched rows into full-shape tensors.
- Steps with a collective: the read-outs (every {every} steps from 0) and the QK apply steps
  (each evaluation + {lag}); "other steps with one" counts any other step and must be 0. DDP
  runs one collective per such step (an ``all_gather`` of a small vector, or at an apply step
  one ``all_gather_object`` with the QK results); FSDP2 adds, at each snapshot step, the
  batched point-to-point fetch of the Q/K rows of a rank's heads (hence 1.5).
- Collective wall time includes the time a rank waits for the slowest rank to arrive: here
  2 or 4 processes share 2 CPU cores (which were also running another benchmark), so the
  ranks drift apart by milliseconds between read-outs; it is an upper bound on the transport
  cost, not the cost of moving a few hundred bytes. gloo on CPU only: NCCL on GPUs was not
  measured. "agent.step wall" (training thread) includes that wait and the snapshot copies.
- Compare the rows of one run: on this shared machine the absolute times moved by up to 45%
  between two runs of this script (world 1: 148 and 214 ms per evaluation), the ratios to
  world 1 by up to 0.1 (FSDP2 at world 4: 0.22 and 0.34).
"""


def _rank(rank: int, world: int, init: str, tmp: str, wrap: str, steps: int) -> None:
    """One rank: train ``steps`` steps with an Agent, write what it measured to JSON."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    import agent.distributed.fetch as fetch
    import agent.measurements as single
    from agent.agent import Agent
    from agent.config import AgentConfig
    from agent.distributed import World
    from agent.monitor_thread import MonitorThread

    current = {"step": -1}
    monitor_cpu: list[float] = []
    heads: dict[int, int] = {}  # QK evaluation step -> query heads this rank measured
    collectives: list[tuple[int, str, float]] = []  # (step, what, wall seconds)

    real_submit = MonitorThread.submit

    def submit(self, fn):
        def timed():
            t0 = time.thread_time()
            try:
                return fn()
            finally:
                monitor_cpu.append(time.thread_time() - t0)

        return real_submit(self, timed)

    def counting(real):
        def measure(job, orders):
            heads[job.step] = heads.get(job.step, 0) + len(job.heads)
            return real(job, orders)

        return measure

    real_run = World._run

    def run(self, what, fn):
        t0 = time.perf_counter()
        try:
            return real_run(self, what, fn)
        finally:
            collectives.append((current["step"], what, time.perf_counter() - t0))

    real_exchange = fetch._send_and_receive

    def exchange(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return real_exchange(*args, **kwargs)
        finally:
            collectives.append((current["step"], "batch_isend_irecv", time.perf_counter() - t0))

    MonitorThread.submit = submit
    World._run = run
    fetch._send_and_receive = exchange
    single.compute_qk_samples = counting(single.compute_qk_samples)
    if world > 1:
        import agent.distributed.measurements as sharded

        sharded.compute_qk_samples = counting(sharded.compute_qk_samples)

    torch.manual_seed(0)
    model = MoETransformer(SHAPE)
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = AgentConfig.model_validate(
        {
            "run_dir": Path(tmp) / "run",
            "notify": {"console": "never"},
            "symptoms": {"every": EVERY},
            "router": {"every": EVERY},
            "qk": {"delta": EVERY},
            "scheduling": {"apply_lag": LAG},
            "checkpoints": {"enabled": False},
            "watchdog": {"enabled": False},
        }
    )
    agent = Agent(model, opt, config=config)
    generator = torch.Generator().manual_seed(1000 + rank)
    step_wall = []
    for step in range(steps):
        batch = torch.randint(0, SHAPE.vocab, (2, SHAPE.seq_len), generator=generator)
        logits, aux = model(batch)
        loss = torch.nn.functional.cross_entropy(
            logits[:, :-1].reshape(-1, SHAPE.vocab), batch[:, 1:].reshape(-1)
        )
        (loss + aux).backward()
        opt.step()
        current["step"] = step
        t0 = time.perf_counter()
        agent.step(step, loss=loss.detach())  # before zero_grad: it measures the grad norm
        step_wall.append(time.perf_counter() - t0)
        opt.zero_grad(set_to_none=True)
    current["step"] = steps
    agent.close()
    result = {
        "monitor_cpu": sum(monitor_cpu),
        "heads": heads,
        "collectives": collectives,
        "step_wall": step_wall,
    }
    Path(tmp, f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()


def run(world: int, wrap: str, steps: int) -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as tmp:
        args = (world, f"file://{tmp}/rendezvous", tmp, wrap, steps)
        mp.spawn(_rank, args=args, nprocs=world)
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world)]


def row(world: int, wrap: str, steps: int, ranks: list[dict[str, Any]], base: float | None):
    """The table row of one run, and its mean monitor CPU per evaluation (ms)."""
    evaluations = [r["heads"] for r in ranks]
    # evaluations every rank measured before the agent closed (the last one may be cut short)
    done = set.intersection(*({int(s) for s in e} for e in evaluations))
    cpu = [1e3 * r["monitor_cpu"] / len(done) for r in ranks]
    heads = [statistics.mean(e[str(s)] for s in done) for e in evaluations]
    collective_steps = sorted({s for r in ranks for s, _, _ in r["collectives"]})
    # a collective may run only at a read-out (step % EVERY == 0) or a QK apply step
    off_cadence = [s for s in collective_steps if s % EVERY not in (0, LAG) and s != steps]
    per_readout, per_step, counts = [], [], []
    for r in ranks:
        seconds = sum(t for s, _, t in r["collectives"] if s < steps)
        readouts = len({s for s, _, _ in r["collectives"] if s < steps})
        counts.append(len([c for c in r["collectives"] if c[0] < steps]) / max(readouts, 1))
        per_readout.append(1e3 * seconds / max(readouts, 1))
        per_step.append(1e3 * seconds / steps)
    step_ms = statistics.mean(1e3 * statistics.mean(r["step_wall"]) for r in ranks)
    mean_cpu = statistics.mean(cpu)
    ratio = f"{mean_cpu / base:.2f}" if base else "1.00"
    cells = [
        wrap, str(world), str(len(done)), f"{mean_cpu:.1f}", f"{max(cpu):.1f}", ratio,
        f"{1 / world:.2f}", f"{statistics.mean(heads):.0f} of {SHAPE.n_layers * SHAPE.n_heads}",
        f"{statistics.mean(counts):.1f}" if world > 1 else "0",
        f"{len([s for s in collective_steps if s < steps])} of {steps}",
        str(len(off_cadence)), f"{statistics.mean(per_readout):.2f}",
        f"{statistics.mean(per_step):.3f}", f"{step_ms:.2f}",
    ]  # fmt: skip
    return "| " + " | ".join(cells) + " |", mean_cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the table (markdown) here too")
    parser.add_argument("--steps", type=int, default=200, help="training steps per run")
    parser.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--wraps", nargs="+", default=["ddp"], choices=["ddp", "fsdp"])
    args = parser.parse_args()
    lines = [
        *provenance(),
        f"Model: test-bed MoE transformer, d {SHAPE.d_model}, {SHAPE.n_layers} layers x "
        f"{SHAPE.n_heads} heads (d_h {SHAPE.d_model // SHAPE.n_heads}), {SHAPE.n_experts} "
        f"experts; batch 2 x {SHAPE.seq_len} tokens per rank; {args.steps} steps; QK delta, "
        f"router and symptom read-outs every {EVERY} steps (all heads of all layers per "
        "evaluation, 4 control matrices per layer); gloo, one process per rank.",
        "",
        "| wrap | world | QK evaluations | monitor CPU / evaluation, mean rank (ms) | "
        "max rank (ms) | / world 1 | ideal 1/world | heads measured / evaluation, per rank | "
        "collectives / read-out | steps with a collective | other steps with one | "
        "collective wall / read-out (ms) | collective wall / step, averaged (ms) | "
        "agent.step wall / step (ms) |",
        "|" + "---|" * 14,
    ]
    base = None  # the world-1 (DDP) cost
    for wrap in args.wraps:
        for world in args.worlds:
            if wrap == "fsdp" and world == 1:
                continue
            t0 = time.perf_counter()
            line, cpu = row(world, wrap, args.steps, run(world, wrap, args.steps), base)
            base = cpu if world == 1 else base
            print(line, f"({time.perf_counter() - t0:.0f} s)", file=sys.stderr)
            lines.append(line)
    lines += ["", *NOTES.format(every=EVERY, lag=LAG, steps=args.steps).splitlines()]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
