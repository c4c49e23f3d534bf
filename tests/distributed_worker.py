"""What each rank runs in tests/test_distributed.py (spawned processes, gloo, file:// rendezvous).

One small MoE transformer (agent.testbed), one ``Agent`` per rank, a custom rule file; each
scenario writes what the rank saw to ``<tmp>/<scenario>.rank<r>.json`` for the test to compare
across ranks.
"""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from agent.agent import Agent
from agent.config import AgentConfig
from agent.eventlog import read_events
from agent.testbed.model import MoETransformer, TestbedConfig

SHAPE = TestbedConfig(
    vocab=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, n_experts=4, top_k=2,
    d_expert=32, seq_len=16,
)  # fmt: skip
RULES = """groups:
  - name: g
    rules:
      - name: high_loss
        metric: loss
        detector: {type: threshold, above: 20.0}
        for: 0
        keep_firing_for: 10
        severity: critical
        family: symptom
        actions: [{rollback: {margin_steps: 3}}, {lower_lr: {factor: 0.5}}]
      - name: loss_nonfinite
        metric: loss_nonfinite
        detector: {type: threshold, above: 0.5}
        for: 0
        keep_firing_for: 10
        severity: critical
        family: symptom
        actions: [{rollback: {margin_steps: 0}}]
      - name: hung_run
        metric: seconds_since_step
        detector: {type: threshold, above: 2.0}
        for: 0
        severity: critical
        family: symptom
        actions: [page]
"""
AUDIT_RULE = """
      - name: one_way_rounding
        metric: attention_backward_asymmetry
        detector: {type: threshold, above: 1.0e-4}
        for: 0
        keep_firing_for: 2
        severity: critical
        family: fa_precision
        actions: [attention_fp32_backward, page]
"""


class Recorder:
    """A notifier that keeps what it is sent."""

    name = "recorder"

    def __init__(self) -> None:
        self.events: list[Any] = []

    def send(self, event: Any, thread: str | None) -> str | None:
        self.events.append(event)
        return None

    def close(self) -> None:
        pass


class Loader:
    """Each rank's own batches: a seeded generator (its state is the data position)."""

    def __init__(self, rank: int) -> None:
        self.generator = torch.Generator().manual_seed(1000 + rank)
        self.batches = 0

    def next(self) -> torch.Tensor:
        self.batches += 1
        return torch.randint(0, SHAPE.vocab, (2, SHAPE.seq_len), generator=self.generator)

    def state(self) -> dict[str, Any]:
        return {"generator": self.generator.get_state(), "batches": self.batches}

    def restore(self, state: dict[str, Any], skip: int) -> None:
        self.generator.set_state(state["generator"])
        self.batches = state["batches"]


def main(rank: int, world: int, init: str, tmp: str, scenarios: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for scenario in scenarios:
            result = SCENARIOS[scenario.split(":")[0]](rank, Path(tmp) / scenario, scenario)
            out = Path(tmp) / f"{scenario}.rank{rank}.json"
            out.write_text(json.dumps(result, default=str))
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _setup(run: Path, wrap: str, rules_text: str = RULES, **config: Any):
    torch.manual_seed(0)
    model = MoETransformer(SHAPE)
    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif wrap == "tp":
        _tensor_parallel(model)
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    rules = run / "rules.yaml"
    if dist.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        rules.write_text(rules_text)
    dist.barrier()
    base = {
        "run_dir": run,
        "rules": [rules],
        "notify": {"console": "never"},
        "symptoms": {"every": 5},
        "router": {"every": 5},
        "qk": {"delta": 5},
        "scheduling": {"apply_lag": 2},
        "checkpoints": {"enabled": True, "every": 10, "keep_last": 2, "directory": run / "ckpt"},
        "watchdog": {"check_every_s": 0.2},
    }
    base.update(config)
    loader = Loader(0 if wrap == "tp" else dist.get_rank())  # TP ranks share their batches
    recorder = Recorder()
    agent = Agent(
        model, opt, sched, AgentConfig.model_validate(base),
        data_state=loader.state, restore_data=loader.restore, notifiers=[recorder],
    )  # fmt: skip
    if wrap == "tp":  # discovery read the global head counts; each rank runs its local heads
        for attn in model.attention_modules():
            attn.num_heads //= dist.get_world_size()
            attn.num_kv_heads //= dist.get_world_size()
    return model, opt, sched, loader, agent, recorder


def _tensor_parallel(model: MoETransformer) -> None:
    """Column-parallel q/k/v and row-parallel o_proj (each rank holds half of the heads)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    plan = {}
    for i in range(len(model.blocks)):
        for name in ("q_proj", "k_proj", "v_proj"):
            plan[f"blocks.{i}.attn.{name}"] = ColwiseParallel()
        plan[f"blocks.{i}.attn.o_proj"] = RowwiseParallel()
    parallelize_module(model, mesh, plan)


def _train_step(model, opt, sched, batch) -> torch.Tensor:
    # cleared first: the gradients are there at agent.step, whose own grad norm reads them
    opt.zero_grad(set_to_none=True)
    logits, aux = model(batch)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, SHAPE.vocab), batch[:, 1:].reshape(-1)
    )
    (loss + aux).backward()
    opt.step()
    sched.step()
    return loss.detach()


def _full(model) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in model.state_dict().items():
        out[k] = (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
    return out


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    import hashlib

    h = hashlib.sha256()
    for k in sorted(tensors):
        h.update(k.encode())
        h.update(tensors[k].float().contiguous().numpy().tobytes())
    return h.hexdigest()


def fault(rank: int, run: Path, scenario: str) -> dict[str, Any]:
    """``fault:<ddp|fsdp>:<spike|nan|raise|stall>``: a fault on rank 1 only."""
    _, wrap, kind = scenario.split(":")
    model, opt, sched, loader, agent, recorder = _setup(run, wrap)
    measured: list[list] = []
    import agent.distributed.measurements as dm

    real = dm.compute_qk_samples

    def counting(job, orders):
        measured.append([job.step, job.site.name, list(job.heads)])
        if kind == "raise" and rank == 1 and job.step == 15:
            raise RuntimeError("monitor exploded on rank 1")
        return real(job, orders)

    dm.compute_qk_samples = counting
    step, moves, injected, saved = 0, [], False, {}
    try:
        while step < 36:
            loss = _train_step(model, opt, sched, loader.next())
            reported = loss
            if rank == 1 and step == 23 and not injected:
                injected = True
                if kind == "spike":
                    reported = loss * 20  # only rank 1's local loss: the mean crosses 20
                elif kind == "nan":
                    reported = torch.tensor(math.nan)
                elif kind == "stall":
                    time.sleep(4.0)  # rank 1 stops stepping; rank 0 waits in the next step
            nxt = agent.step(step, loss=reported)
            if step == 20:
                saved = _full(model)
            if nxt != step + 1:
                moves.append([step, nxt])
                restored = _full(model)
                assert all(torch.equal(restored[k], saved[k]) for k in saved), "rollback"
            step = nxt
    finally:
        dm.compute_qk_samples = real
    if kind == "stall":  # the watchdog (every 0.2 s) must get a look after rank 1 is back
        time.sleep(0.8)
    agent.checkpoints.flush()
    agent.close()
    time.sleep(0.5)  # the page sender thread
    log = run / ("events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl")
    events = read_events(log)
    return {
        "moves": moves,
        "params": _digest(_full(model)),
        "lr": [g["lr"] for g in opt.param_groups],
        "actions": [(e["action"], e["status"], e["step"]) for e in events if e["kind"] == "action"],
        "alerts": [(e["step"], e["rule"], e["transition"], e["labels"]) for e in events
                   if e["kind"] == "alert"],
        "metrics": [e["samples"] for e in events if e["kind"] == "metrics"],
        "errors": [(e["what"], e["error"]) for e in events if e["kind"] == "error"],
        "pages": [(e.kind, e.incident.id, e.context.ranks, e.incident.evidence[0].labels)
                  for e in recorder.events],
        "measured": measured,
        "checkpoints": sorted(os.listdir(run / "ckpt")),
    }  # fmt: skip


def fetch(rank: int, run: Path, scenario: str) -> dict[str, Any]:
    """``fetch:<gqa|mqa|tp>``: a rank's snapshot rows are exactly the full weight's rows its
    heads need, and its monitors measure on them exactly what they measure on full weights.
    gqa: FSDP2, shards on head boundaries (each rank its local heads); mqa: FSDP2, the one KV
    head split over both ranks (round robin, rows sent point to point); tp: column-parallel
    q/k/v and row-parallel o_proj on a 2-rank mesh (local heads; o_proj fetched by columns)."""
    from agent.discovery import find_attention
    from agent.discovery.controls import find_controls
    from agent.distributed import World
    from agent.distributed.assignment import heads_of
    from agent.distributed.snapshots import ShardedQKSnapshots, expand_job
    from agent.probes import QKJob, compute_qk_samples

    kind = scenario.split(":")[1]
    torch.manual_seed(0)
    shape = SHAPE.model_copy(update={"n_kv_heads": 1}) if kind == "mqa" else SHAPE
    model = MoETransformer(shape)
    if kind == "tp":
        _tensor_parallel(model)
        sites = find_attention(model)  # the modules still say the global head counts
        for attn in model.attention_modules():  # each rank runs its local heads
            attn.num_heads //= dist.get_world_size()
            attn.num_kv_heads //= dist.get_world_size()
    else:
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    sites = find_attention(model) if kind != "tp" else sites
    controls = {s.name: find_controls(model, s, [], 4) for s in sites}
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    world = World.detect()
    snaps = ShardedQKSnapshots(sites, world=world, delta=1, controls=controls)

    def full() -> dict[str, torch.Tensor]:
        return {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in model.named_parameters()
        }

    before = full()
    assert snaps.on_step(0) == []
    batch = torch.randint(
        0,
        shape.vocab,
        (2, shape.seq_len),
        generator=torch.Generator().manual_seed(rank if kind != "tp" else 0),
    )
    logits, aux = model(batch)
    (logits.float().logsumexp(-1).mean() + aux).backward()
    opt.step()
    after = full()
    jobs = snaps.on_step(1)
    rows, mismatches, same = {}, [], True
    for layer, site in enumerate(sites):
        for name, held in snaps._previous[site.name].items():
            index = held.index if held.index is not None else torch.arange(held.shape[0])
            rows[name] = len(index)
            if not torch.equal(held.values, after[name][index]):
                mismatches.append(name)
        owners = snaps.owners[site.name]
        mine = heads_of(layer, site.num_heads, rank, world.size, owners)
        assert sorted(h for j in jobs if j.site is site for h in j.heads) == mine
    for job in jobs:
        names = [*job.site.parameters_to_snapshot(), *job.controls]
        reference = QKJob(
            job.step, job.site, {n: before[n] for n in names}, {n: after[n] for n in names},
            job.heads, job.controls,
        )  # fmt: skip
        want = compute_qk_samples(reference)
        same = same and compute_qk_samples(expand_job(job)) == want and len(want) > 0
    return {
        "rows_held": rows, "mismatches": mismatches, "same_samples": same, "jobs": len(jobs),
        "owners": [snaps.owners[s.name] for s in sites],
        "measured": sorted((j.site.name, h) for j in jobs for h in j.heads),
        "controls": sorted(label for j in jobs for label in j.controls.values()),
    }  # fmt: skip


def audit(rank: int, run: Path, scenario: str) -> dict[str, Any]:
    """``audit:<ddp|fsdp|tp>``: from step 12 rank 1's attention backward rounds dS toward -inf
    (4 mantissa bits); rank 0's stays exact. Kernel audit every 5 steps."""
    from agent.testbed.attention import AttentionFault
    from remediations.attention_switch import AttentionPrecisionSwitch, attention_precision

    wrap = scenario.split(":")[1]
    model, opt, sched, loader, agent, recorder = _setup(
        run, wrap, RULES + AUDIT_RULE, kernel_audit={"every": 5}
    )
    inner = model.module if wrap == "ddp" else model
    try:
        for step in range(30):
            if step == 12 and rank == 1:
                inner.set_attention_fault(AttentionFault(("dS",), 4, "floor"))
            loss = _train_step(model, opt, sched, loader.next())
            assert agent.step(step, loss=loss) == step + 1
        start = next(e for e in read_events(run / _log(rank)) if e["kind"] == "start")
        switched = sorted(attention_precision.state_dict()["included"])
        switched_all = attention_precision.state_dict()["all"]
    finally:
        agent.close()
        attention_precision.load_state_dict(AttentionPrecisionSwitch().state_dict())
    time.sleep(0.5)  # the page sender thread
    events = read_events(run / _log(rank))
    return {
        "kernel_audit": start["kernel_audit"],
        "asymmetry": [
            [s, labels["layer"].replace("module.", ""), v]
            for e in events if e["kind"] == "metrics"
            for s, metric, labels, v in e["samples"] if metric == "attention_backward_asymmetry"
        ],
        "alerts": [(e["step"], e["rule"], e["transition"]) for e in events if e["kind"] == "alert"],
        "actions": [(e["action"], e["status"], e["step"]) for e in events if e["kind"] == "action"],
        "switched": [switched_all, switched],
        "errors": [(e["what"], e["error"]) for e in events if e["kind"] == "error"],
        "pages": [(e.kind, e.incident.family) for e in recorder.events],
        "params": _digest(_full(model)),
    }  # fmt: skip


def _log(rank: int) -> str:
    return "events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl"


SCENARIOS = {"fault": fault, "fetch": fetch, "audit": audit}


def killed(rank: int, world: int, init: str, tmp: str) -> None:
    """Rank 1 dies in the middle of the step-20 checkpoint (its shard written, nothing
    committed); rank 0 must fail cleanly. Writes ``killed.rank<r>.txt`` with the outcome."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    outcome = "finished"
    try:
        model, opt, sched, loader, agent, _ = _setup(Path(tmp) / "killed", "ddp")
        if rank == 1:
            from agent.distributed.checkpoints import DistributedCheckpointStore

            real = DistributedCheckpointStore._hash_own

            def die(self, directory: Path):
                if directory.name == "ckpt-20.dcp.tmp":
                    os._exit(1)
                return real(self, directory)

            DistributedCheckpointStore._hash_own = die
        for step in range(30):
            agent.step(step, loss=_train_step(model, opt, sched, loader.next()))
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    Path(tmp, f"killed.rank{rank}.txt").write_text(outcome)
    os._exit(0)  # no destroy_process_group: a peer is gone
