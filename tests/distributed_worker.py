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
        detector: {type: threshold, above: 1.0}
        for: 0
        severity: critical
        family: symptom
        actions: [page]
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


def _setup(run: Path, wrap: str, **config: Any):
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
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.01 * s))
    rules = run / "rules.yaml"
    if dist.get_rank() == 0:
        run.mkdir(parents=True, exist_ok=True)
        rules.write_text(RULES)
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
    loader = Loader(dist.get_rank())
    recorder = Recorder()
    agent = Agent(
        model, opt, sched, AgentConfig.model_validate(base),
        data_state=loader.state, restore_data=loader.restore, notifiers=[recorder],
    )  # fmt: skip
    return model, opt, sched, loader, agent, recorder


def _train_step(model, opt, sched, batch) -> torch.Tensor:
    logits, aux = model(batch)
    loss = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, SHAPE.vocab), batch[:, 1:].reshape(-1)
    )
    (loss + aux).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
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
                    time.sleep(2.5)  # rank 1 stops stepping; rank 0 waits in the next step
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
    """FSDP2: a rank's fetched Q/K rows are exactly the full weight's rows of its heads, and
    its monitors measure on them exactly what they measure on the full weights."""
    from agent.discovery import find_attention
    from agent.distributed import World
    from agent.distributed.assignment import heads_of
    from agent.distributed.snapshots import ShardedQKSnapshots, expand_job
    from agent.probes import QKJob, compute_qk_samples

    model, opt, sched, loader, agent, _ = _setup(run, "fsdp", checkpoints={"enabled": False})
    agent.close()
    sites = find_attention(model)
    world = World.detect()
    snaps = ShardedQKSnapshots(sites, world=world, delta=1)
    full_before = {n: p.full_tensor().float() for n, p in model.named_parameters()}
    assert snaps.on_step(0) == []
    _train_step(model, opt, sched, loader.next())
    full_after = {n: p.full_tensor().float() for n, p in model.named_parameters()}
    jobs = snaps.on_step(1)
    rows_held, mismatches, same = {}, [], True
    for layer, site in enumerate(sites):
        for name, held in snaps._previous[site.name].items():
            index = held.index if held.index is not None else torch.arange(held.shape[0])
            rows_held[name] = len(index)
            if not torch.equal(held.values, full_after[name][index]):
                mismatches.append(name)
        assert sorted(h for j in jobs if j.site is site for h in j.heads) == heads_of(
            layer, site.num_heads, rank, world.size
        )
    for job in jobs:
        names = list(job.site.parameters_to_snapshot())
        reference = QKJob(
            job.step, job.site, {n: full_before[n] for n in names},
            {n: full_after[n] for n in names}, job.heads,
        )  # fmt: skip
        got = [
            s
            for s in compute_qk_samples(expand_job(job))
            if s.metric != "control_update_entropy" and s.metric != "control_update_rel_norm"
        ]
        want = compute_qk_samples(reference)
        same = same and got == want and len(want) > 0
    return {"rows_held": rows_held, "mismatches": mismatches, "same_samples": same,
            "jobs": len(jobs)}  # fmt: skip


SCENARIOS = {"fault": fault, "fetch": fetch}


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
