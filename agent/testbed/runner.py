"""Scenario runner: build model, optimizer, schedule and data from a ScenarioConfig, train one
step at a time, and write a JSONL record per step plus a summary.

``TestbedRun`` is the training loop itself, one optimizer step per ``step()`` call, so that an
agent can sit inside it (it exposes ``model``, ``optimizer``, ``scheduler``, ``step_index`` and
``last_loss``). ``run_scenario`` drives it to the end and writes ``metrics.jsonl`` (one record
per step; every ``monitor_every`` steps the record carries the samples the agent's own
measurement pipeline took, ``agent.testbed.recorder``), ``summary.json`` and, on request,
``plot.png``.

Faults follow the step index: at the start of every step the run switches each fault on or
off according to ``step_index >= fault_start``, so a rollback to a checkpoint from before the
onset runs healthy again until ``fault_start``.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from agent.testbed.data import MarkovSource
from agent.testbed.divergence import degradation_step, divergence_step, ema
from agent.testbed.model import MoETransformer
from agent.testbed.recorder import MonitorRecorder
from agent.testbed.scenarios import ScenarioConfig

ROUTER_GROUP = "routers"
OTHER_GROUP = "other"


class TestbedRun:
    """One seeded training run of the test bed; ``step()`` is one optimizer step."""

    __test__ = False  # not a pytest test class

    def __init__(
        self,
        config: ScenarioConfig,
        *,
        device: str | torch.device = "cpu",
        record_monitors: bool = True,
    ) -> None:
        """``record_monitors=False`` skips the built-in monitors (an agent measures its own)."""
        self.config = config
        self.device = torch.device(device)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(config.seed)
            self.model = MoETransformer(config.model).to(self.device)
        self.source = _markov(config, config.data_seed)
        self.shifted_source = (
            _markov(config, config.shift_data_seed) if config.shift_step is not None else None
        )
        self.generator = torch.Generator().manual_seed(config.seed)
        router_params = [m.gate.weight for m in self.model.moe_modules()]
        router_ids = {id(p) for p in router_params}
        other_params = [p for p in self.model.parameters() if id(p) not in router_ids]
        self.optimizer = torch.optim.AdamW(
            [
                {"params": other_params, "name": OTHER_GROUP},
                {"params": router_params, "name": ROUTER_GROUP},
            ],
            lr=config.lr,
            betas=(config.beta1, config.beta2),
            weight_decay=config.weight_decay,
        )
        multipliers = [self._lr_multiplier(router=False), self._lr_multiplier(router=True)]
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, multipliers)
        self.recorder = MonitorRecorder(self.model, config.monitor_every if record_monitors else 0)
        self.step_index = 0
        self.last_loss: Tensor | None = None  # () cross-entropy of the last step, nats
        self.last_aux_loss: Tensor | None = None  # () weighted balancing + z-loss
        self.last_grad_norm: Tensor | None = None  # () global grad norm before clipping
        self.last_samples: list[list[Any]] | None = None  # [step, metric, labels, value] rows
        self.fa_fault_active = False
        self.router_fault_active = False

    # --- faults -----------------------------------------------------------------------
    def _fault_on(self, step: int) -> bool:
        return step >= self.config.fault_start

    def _lr_multiplier(self, *, router: bool) -> Callable[[int], float]:
        cfg = self.config

        def factor(step: int) -> float:
            warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
            if cfg.has_router_fault and self._fault_on(step):
                warm *= cfg.lr_mult * (cfg.router_lr_mult if router else 1.0)
            return warm * cfg.lr_factor(step)

        return factor

    def _sync_faults(self) -> None:
        on = self._fault_on(self.step_index)
        fa_on = self.config.fa_faulty(self.step_index)
        if fa_on != self.fa_fault_active:
            fault = self.config.attention_fault() if fa_on else None
            self.model.set_attention_fault(fault, layers=self.config.fa_layers)
            self.fa_fault_active = fa_on
        router_on = on and self.config.has_router_fault
        if router_on != self.router_fault_active:
            coef = self.config.fault_balance_coef if router_on else None
            self.model.balance_coef = self.config.model.balance_coef if coef is None else coef
            self.router_fault_active = router_on

    @property
    def batch_size(self) -> int:
        """Sequences in the current step's batch (the router fault may shrink it)."""
        cfg = self.config
        if self.router_fault_active and cfg.fault_batch_size is not None:
            return cfg.fault_batch_size
        if cfg.batch_change_step is not None and self.step_index >= cfg.batch_change_step:
            return cfg.batch_change_size or cfg.batch_size
        return cfg.batch_size

    def lr(self, group: str = OTHER_GROUP) -> float:
        for g in self.optimizer.param_groups:
            if g["name"] == group:
                return float(g["lr"])
        raise ValueError(f"no parameter group named {group!r}")

    # --- training ---------------------------------------------------------------------
    def step(self) -> Tensor:
        """One optimizer step; returns the step's cross-entropy loss (a 0-dim tensor)."""
        self._sync_faults()
        # cleared here, not after the optimizer step: the gradients stay readable between
        # steps (an agent given no grad_norm measures them at agent.step), the same update
        self.optimizer.zero_grad(set_to_none=True)
        step = self.step_index
        batch = self._batch(step).to(self.device)
        inputs, targets = batch[:, :-1], batch[:, 1:]  # (B, T) each
        logits, aux = self.model(inputs)  # (B, T, V), ()
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        (loss + aux).backward()
        max_norm = self.config.grad_clip if self.config.grad_clip is not None else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        self.scheduler.step()
        self.last_samples = self.recorder.after_step(step)
        self.last_loss = loss.detach()
        self.last_aux_loss = aux.detach()
        self.last_grad_norm = grad_norm.detach()
        self.step_index += 1
        return self.last_loss

    def _batch(self, step: int) -> Tensor:
        """(B, T+1) tokens; from ``shift_step`` on the first ``shift_fraction`` of the sequences
        come from the other chain (before it ``mix_fraction_before``, if set)."""
        cfg, n = self.config, self.batch_size
        t = cfg.model.seq_len
        if cfg.short_seq_len is not None and step < (cfg.short_seq_until or 0):
            t = min(t, cfg.short_seq_len)  # a sequence-length curriculum's short phase
        before = step < (cfg.shift_step or 0)
        share = (cfg.mix_fraction_before or 0.0) if before else cfg.shift_fraction
        if self.shifted_source is None or share == 0.0:
            return self.source.batch(n, t, self.generator)
        shifted = min(n, max(1, round(share * n)))
        parts = [self.shifted_source.batch(shifted, t, self.generator)]
        if shifted < n:
            parts.append(self.source.batch(n - shifted, t, self.generator))
        return torch.cat(parts)

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume this run exactly: weights, optimizer, schedule, step and
        the data generator (the faults follow from the step index)."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "step_index": self.step_index,
            "generator": self.generator.get_state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step_index = int(state["step_index"])
        self.generator.set_state(state["generator"])
        self.recorder.reset()  # the last snapshot is from another timeline

    def weight_norm(self) -> Tensor:
        """Global L2 norm of all parameters, a 0-dim tensor."""
        norms = torch._foreach_norm([p.detach() for p in self.model.parameters()])
        return torch.linalg.vector_norm(torch.stack(norms))

    def record(self, lr_before: float, lr_router_before: float) -> dict[str, Any]:
        """The JSON record of the step just taken (see ``run_scenario``)."""
        assert self.last_loss is not None and self.last_grad_norm is not None
        rec: dict[str, Any] = {
            "step": self.step_index - 1,
            "loss": float(self.last_loss),
            "aux_loss": float(self.last_aux_loss),
            "grad_norm": float(self.last_grad_norm),
            "weight_norm": float(self.weight_norm()),
            "lr": lr_before,
            "lr_router": lr_router_before,
            "batch_size": self.batch_size,
            "fa_fault": self.fa_fault_active,
            "router_fault": self.router_fault_active,
        }
        if self.last_samples is not None:
            rec["samples"] = self.last_samples
        return rec


def _markov(config: ScenarioConfig, seed: int) -> MarkovSource:
    return MarkovSource(
        config.model.vocab,
        seed,
        order=config.markov_order,
        pool=config.markov_pool,
        branching=config.markov_branching,
    )


@dataclass
class RunSummary:
    """What one scenario run came to (written as summary.json)."""

    scenario: str
    seed: int
    steps: int  # steps actually run
    fault_start: int
    divergence_step: int | None  # divergence.divergence_step of the loss
    degradation_step: int | None  # divergence.degradation_step against the run's own minimum
    nonfinite_step: int | None  # first step with a non-finite loss (the run stops there)
    final_loss_ema: float
    min_loss_ema: float
    wall_seconds: float
    ms_per_step: float
    config: dict[str, Any] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run_scenario(
    config: ScenarioConfig,
    out_dir: str | Path,
    *,
    plot: bool = False,
    stop_on_nonfinite: bool = True,
    progress_every: int = 0,
) -> RunSummary:
    """Run ``config`` to the end; write metrics.jsonl, summary.json (and plot.png if ``plot``).

    Each JSONL record: step, loss (cross-entropy, nats), aux_loss, grad_norm (before clipping),
    weight_norm, lr and lr_router (used in that step), batch_size, fa_fault, router_fault, and
    on cadence steps ``samples`` = [[step, metric, {label: value}, value], ...]: the agent's
    own measurements (metric names of ``agent.samples``), as in the event log's ``metrics``.
    ``progress_every > 0`` prints a line every so many steps.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    metrics_path = out / "metrics.jsonl"
    run = TestbedRun(config)
    losses: list[float] = []
    nonfinite: int | None = None
    start = time.perf_counter()
    with metrics_path.open("w") as f:
        for _ in range(config.steps):
            lr, lr_router = run.lr(OTHER_GROUP), run.lr(ROUTER_GROUP)
            run.step()
            rec = run.record(lr, lr_router)
            f.write(json.dumps(rec) + "\n")
            losses.append(rec["loss"])
            if progress_every and rec["step"] % progress_every == 0:
                tag = f"{config.scenario} seed {config.seed}"
                print(f"[{tag}] step {rec['step']} loss {rec['loss']:.4f}")
            if not math.isfinite(rec["loss"]):
                nonfinite = rec["step"]
                if stop_on_nonfinite:
                    break
    run.recorder.close()
    wall = time.perf_counter() - start
    smooth = ema(losses)
    finite_smooth = [v for v in smooth if math.isfinite(v)] or [math.nan]
    files = {"metrics": str(metrics_path)}
    summary = RunSummary(
        scenario=config.scenario,
        seed=config.seed,
        steps=len(losses),
        fault_start=config.fault_start,
        divergence_step=divergence_step(losses),
        degradation_step=degradation_step(losses),
        nonfinite_step=nonfinite,
        final_loss_ema=smooth[-1],
        min_loss_ema=min(finite_smooth),
        wall_seconds=wall,
        ms_per_step=1000.0 * wall / max(1, len(losses)),
        config=config.model_dump(mode="json"),
        files=files,
    )
    if plot:
        from agent.testbed.plot import plot_run

        files["plot"] = str(plot_run(metrics_path, out / "plot.png", title=_title(config)))
    (out / "summary.json").write_text(json.dumps(summary.to_dict(), indent=2) + "\n")
    return summary


def _title(config: ScenarioConfig) -> str:
    title = f"{config.scenario}, seed {config.seed}"
    if config.has_fa_fault:
        title += f", {'+'.join(config.fa_sites)} {config.fa_mode} {config.fa_bits} bits"
    if config.has_router_fault:
        title += f", router LR x{config.router_lr_mult:g}"
    if config.scenario != "clean":
        title += f", fault from step {config.fault_start}"
    return title
