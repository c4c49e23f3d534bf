"""The agent: enabled in a training loop with a few lines, it measures, decides and acts.

    agent = Agent.from_config("mechwatch.yaml", model=model, optimizer=optimizer)
    for step, batch in enumerate(loader):
        ...; optimizer.step(); scheduler.step()
        agent.step(step, loss=loss)
    agent.close()

Data flows one way (README "Architecture"):

    agent.step -> measurements (probes, monitors) -> samples -> decision round
      (series store -> rules -> attribution -> pacing) -> actions (training thread)
                                                       -> pages (notifiers, never blocking)

Per ``step()`` on the training thread (cheap, no host-device sync): the loss and grad norm are
checked at the call (``agent.step_inputs``) and buffered; ``agent.measurements`` returns the
samples due at this step (symptoms, router read-outs, QK spectra computed off the training
thread on snapshots and applied at t + ``scheduling.apply_lag``); when there are samples, one
decision round (``agent.decisions``) turns them into alert transitions, incident events (paged
through the dispatcher's outbox) and paced action admissions, which run here, between steps;
then, on checkpoint steps, a checkpoint is queued. Each of these parts is guarded on its own.

The watchdog (``seconds_since_step``, for the ``hung_run`` rule) runs on a timer off the
training thread and feeds its samples into the same decision round (under the same lock); the
actions its rules ask for run at the next step boundary.

``step()`` never raises because of the agent's own failure or a malformed input: a broken part
is recorded, reported once (event log + a warning) and skipped. It raises only
``TrainingHalted`` when a ``halt`` action asked for a stop (or sets ``should_stop`` in flag
mode), and ``RankFailure`` when a collective of a distributed job failed.

Under torchrun (one agent per rank) the samples are reduced and gathered over the ranks at
each read-out, so every rank decides and acts alike; see ``agent.distributed``.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from agent import samples as m
from agent.agent_actions import AgentActions
from agent.attribution import MECHANISM_FAMILIES, Attributor
from agent.checkpoints import CheckpointStore
from agent.config import AgentConfig
from agent.costs import Costs
from agent.decisions import Decisions, alert_fields, decide
from agent.discovery import find_attention, find_routers
from agent.distributed import World
from agent.distributed.wiring import (
    build_checkpoints,
    build_measurements,
    build_rank_watch,
    metrics_config,
)
from agent.eventlog import EVENT_LOG_FORMAT, EventLog
from agent.failures import FailureLog
from agent.incidents import Incident, IncidentEvent, RunContext
from agent.kernel_audit_probe import build_kernel_audit
from agent.metric_sinks import build_sinks, write_round
from agent.monitor_thread import MonitorThread
from agent.notify.base import Notifier
from agent.notify.factory import build_dispatcher
from agent.optimizer_steps import OptimizerSteps
from agent.rules.engine import RuleEngine
from agent.rules.loader import default_rule_files, load_rule_files
from agent.samples import Sample
from agent.schedule_steps import learning_rate_samples
from agent.step_inputs import check_scalar, check_step
from agent.store import SeriesStore
from remediations.attention import AttentionPrecisionSwitch
from remediations.attention_switch import attention_precision
from remediations.base import Action
from remediations.hparams import HyperparameterRequests
from remediations.pacing import Pacing
from remediations.registry import validate_action
from remediations.runner import ActionRunner

STATE_VERSION = 1


class Agent(AgentActions):
    """In-process training monitor. See the module docstring for what happens per step.

    Injectable parts (each defaults to what ``config`` builds): ``notifiers`` (pages go to
    these, through the durable outbox), ``checkpoints`` (a ``CheckpointStore`` for periodic
    checkpoints and rollback), ``attention_switch`` (the run's FP32-backward switch; default
    the process-wide ``remediations.attention.attention_precision``), ``actions`` (the action
    registry, name -> class; default ``remediations.registry.ACTIONS``), ``on_metrics``
    (``fn(step, {name: value})`` for your own logger, ``agent.metric_sinks``).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        config: AgentConfig | None = None,
        *,
        data_state: Callable[[], Any] | None = None,
        restore_data: Callable[[Any, int], None] | None = None,
        notifiers: Sequence[Notifier] | None = None,
        checkpoints: CheckpointStore | None = None,
        attention_switch: AttentionPrecisionSwitch | None = None,
        actions: Mapping[str, type[Action]] | None = None,
        on_metrics: Callable[[int, dict[str, float]], Any] | None = None,
        process_group: Any | None = None,
    ) -> None:
        self.config = config = config or AgentConfig()
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.attention_switch = attention_switch
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.world = World.detect(process_group)  # rank and size (agent/distributed)
        self.context = RunContext(
            run_name=config.run_name, rank=self.world.rank, world_size=self.world.size
        )
        self._lock = threading.Lock()  # one decision round at a time (training + watchdog)
        self.should_stop = False
        self._closed = False
        self._last_step: int | None = None

        # Rules first: a broken rule file fails here, not in the middle of a run.
        paths = config.rules if config.rules is not None else default_rule_files()
        self.ruleset = load_rule_files(paths, action_validator=validate_action)
        self.store = SeriesStore()
        self.engine = RuleEngine(self.ruleset, self.store)

        # Sinks: every rank keeps its own event log; only rank 0 pages.
        rank = self.context.rank
        self.events = EventLog(
            self.run_dir / ("events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl")
        )
        self.failures = FailureLog(
            self.events, lambda: -1 if self._last_step is None else self._last_step
        )
        self._guarded = self.failures.guarded
        self._costs = Costs()  # where the agent's own time goes (``costs()``)
        self.dispatcher = (
            build_dispatcher(
                config.notify, self.run_dir, event_log=self.events, notifiers=notifiers
            )
            if rank == 0
            else None
        )
        self.metric_sinks = self._guarded(
            "metrics",
            lambda: build_sinks(metrics_config(self.world, config), self.run_dir, on_metrics),
            [],
        )

        # Measurements (probes, monitors) on a monitor thread.
        self.thread = MonitorThread()
        self.attention_sites = find_attention(model, config.discovery) if config.qk.enabled else []
        self.router_sites = find_routers(model, config.discovery) if config.router.enabled else []
        self.measurements = build_measurements(
            self.world,
            model,
            config,
            self.attention_sites,
            self.router_sites,
            submit=self.thread.submit,
            report=self.failures.report,
            costs=self._costs,
        )

        # Optimizer steps a GradScaler skipped (agent/optimizer_steps.py); one process only: a
        # distributed read-out would have to agree on them over the ranks (not done yet)
        self._optimizer_steps = (
            OptimizerSteps(optimizer) if optimizer is not None and self.world.size == 1 else None
        )

        self.kernel_audit, kernel_audit_state = build_kernel_audit(
            config.kernel_audit,
            [site.name for site in self.attention_sites],
            attention_switch if attention_switch is not None else attention_precision,
            self.world,
            report=self.failures.report,
            lag=config.scheduling.apply_lag,
        )

        # Decisions and actions.
        monitored = {
            family
            for family, sites in zip(
                MECHANISM_FAMILIES, (self.attention_sites, self.router_sites), strict=True
            )
            if sites
        }
        self.attributor = Attributor(
            self.context,
            monitored_families=monitored,
            symptom_wait=config.notify.symptom_wait_steps,
            schedule_lag=2 * config.qk.delta,
        )
        self.hparams = HyperparameterRequests()
        self.checkpoints = (
            checkpoints
            if checkpoints is not None
            else build_checkpoints(self, data_state, restore_data)
        )
        self.actions = ActionRunner(
            self._action_context,
            audit=self._audit,
            dry_run=config.actions.dry_run,
            actions=actions,
        )
        self.pacing = self.new_pacing()
        self.rank_watch = build_rank_watch(self)  # a distributed job's hung-rank watchdog
        self._evaluations = 0
        self._last_step_time = time.monotonic()
        self._resume_step: int | None = None

        if config.watchdog.enabled:
            self.thread.every(config.watchdog.check_every_s, self._watchdog, "mechwatch-watchdog")
        self.thread.start()
        self.events.write(
            "start",
            -1,
            format=EVENT_LOG_FORMAT,
            run=config.run_name,
            attention_layers=[s.name for s in self.attention_sites],
            routers=[s.name for s in self.router_sites],
            rules=[r.name for r in self.ruleset],
            rank=self.world.rank,
            world_size=self.world.size,
            schedule_lag=self.attributor.schedule_lag,
            kernel_audit=kernel_audit_state,
        )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_config(
        cls,
        path: str | Path,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        **kwargs: Any,
    ) -> Agent:
        from agent.config_file import load_agent_config

        return cls(model, optimizer, scheduler, load_agent_config(path), **kwargs)

    def new_pacing(self) -> Pacing:
        """A ``Pacing`` with this agent's limits (the agent's own; the watchdog's)."""
        config = self.config
        return Pacing(
            self.actions.limits_of,
            rule_cooldowns={r.name: r.spec.cooldown for r in self.ruleset},
            dry_run_of=lambda action: config.actions.dry_run or not self._allowed(action),
            repeat_every_steps=config.notify.repeat_every_steps,
            repeat_every_s=config.notify.repeat_every_s,
        )

    def __enter__(self) -> Agent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ the hot path
    def step(
        self,
        step: int,
        loss: torch.Tensor | float | None = None,
        grad_norm: torch.Tensor | float | None = None,
    ) -> int:
        """Record one optimizer step. Returns the step the loop should run next: ``step + 1``,
        or the step after the restored checkpoint when a rollback happened."""
        self._last_step_time = time.monotonic()
        self._raise_if_halted()
        try:
            step = check_step(step)
        except TypeError as exc:
            self.failures.exception("agent.step", exc)
            return step  # type: ignore[return-value]  # nothing sensible to add 1 to
        values = {}
        for name, value in (("loss", loss), ("grad_norm", grad_norm)):
            checked = self._costs.call("step inputs", lambda n=name, v=value: check_scalar(n, v))
            if checked.problem is not None:
                self.failures.report("agent.step", checked.problem, outcome="the run goes on")
            values[name] = checked.value
        self._last_step = step
        skipped = self._optimizer_steps.skipped() if self._optimizer_steps is not None else None
        self._guarded(
            "measurements",
            lambda: self.measurements.record(
                step, values["loss"], values["grad_norm"], skipped=skipped
            ),
            None,
        )
        new = self._guarded("measurements", lambda: self.measurements.collect(step), [])
        if self.kernel_audit is not None:
            audit = self.kernel_audit
            new += self._guarded(
                "kernel audit",
                lambda: self._costs.call("kernel audit", lambda: audit.on_step(step)),
                [],
            )
        if self.optimizer is not None and step % self.config.symptoms.every == 0:
            new += self._guarded(
                "learning rate", lambda: learning_rate_samples(self.optimizer, step), []
            )
        if new:
            self._guarded("decisions", lambda: self._round(step, new), None)
        if self._resume_step is None and self.checkpoints is not None:
            self._guarded("checkpoint", lambda: self._checkpoint(step), None)
        self._raise_if_halted()
        if self._resume_step is not None:
            resume, self._resume_step = self._resume_step, None
            return resume
        return step + 1

    def _checkpoint(self, step: int) -> None:
        """Queue a checkpoint on checkpoint steps. Never in a round that rolled back: the
        model then holds the restored state, not the state after ``step``."""
        if step % self.config.checkpoints.every == 0:
            self._costs.call(
                "checkpoints", lambda: self.checkpoints.maybe_save(step, health=self.health())
            )

    # ------------------------------------------------------------------ decisions
    def _round(self, step: int, new: list[Sample], *, act: bool = True) -> None:
        """One decision round (training thread, or the watchdog with ``act=False``)."""
        with self._lock:
            self._evaluations += 1
            if self._evaluations % self.config.metrics_every == 0:
                samples = [[s.step, s.metric, s.label_dict, s.value] for s in new]
                self._write("metrics", step, samples=samples)
            for sink in self.metric_sinks:
                self._costs.call(
                    "metric sinks",
                    lambda k=sink: self._guarded(
                        f"metrics {type(k).__name__}", lambda: write_round(k, new), None
                    ),
                )
            agreed = self.measurements.now  # rank 0's clock at a distributed read-out
            now = agreed if act and agreed is not None else time.time()
            decisions = self._costs.call(
                "rules",
                lambda: decide(self.engine, self.attributor, self.pacing, step, new, now, act=act),
            )
            self._record(step, decisions, ranks=self.measurements.notes)
            if not act:
                return
            self._protect_checkpoints()
            for admission in decisions.admissions:
                self._costs.call(
                    "actions",
                    lambda a=admission: self._guarded("action", lambda: self._admit(step, a), None),
                )
            if self._resume_step is not None:
                return  # rolled back: these samples no longer describe the run
            for result in self._guarded("action follow-up", lambda: self.actions.observe(new), []):
                self._announce(result, step)

    def _record(self, step: int, decisions: Decisions, ranks: Any = None) -> None:
        """Log a round's rule problems and alert transitions, page its incident events
        (``ranks``: a distributed read-out's notes on the ranks involved)."""
        for problem in decisions.problems:
            self.failures.report(f"rule {problem.rule}", problem.error)
        for t in decisions.transitions:
            self._write("alert", step, **alert_fields(t))
        for event in decisions.events:
            self._page(event, ranks.text() if ranks is not None else "")

    def _page(self, event: IncidentEvent, ranks: str = "") -> None:
        if ranks:  # a distributed job: the page names the ranks involved
            event.context = dataclasses.replace(event.context, ranks=ranks)
        extra = {"ranks": ranks} if self.world.size > 1 else {}
        self._write(
            "incident",
            event.step,
            event=event.kind,
            incident=event.incident.to_dict(),
            message=event.message,
            **extra,
        )
        if self.dispatcher is not None:
            self._costs.call(
                "pages", lambda: self._guarded("page", lambda: self.dispatcher.submit(event), None)
            )

    # ------------------------------------------------------------------ watchdog
    def _watchdog(self) -> None:
        """Monitor thread, on a timer: seconds since the last step into the decision round
        (the run may hang inside a step, where no round would ever happen)."""
        if self._closed:
            return
        idle = time.monotonic() - self._last_step_time
        if self.rank_watch is not None:  # a distributed job: every rank's heartbeat (rank 0)
            self._guarded("watchdog", lambda: self.rank_watch.tick(self._last_step, idle), None)
            return
        if self._last_step is None:
            return
        sample = Sample.make(self._last_step, m.SECONDS_SINCE_STEP, idle)
        self._guarded("watchdog", lambda: self._round(self._last_step, [sample], act=False), None)

    def _write(self, kind: str, step: int, **payload: Any) -> None:
        """An event-log record (never raises; its time counts as the event log's)."""
        self._costs.call("event log", lambda: self.failures.write(kind, step, **payload))

    # ------------------------------------------------------------------ user-facing state
    def costs(self) -> dict[str, float]:
        """Seconds of the agent's own work per part since it started (``agent.costs``):
        wall seconds on the training thread, CPU seconds on the monitor thread."""
        return self._costs.seconds()

    def latest_metrics(self) -> dict[str, float]:
        """The newest value of every series, ``metric{label=value,...}`` -> float."""
        return self.store.latest()

    def health(self) -> dict[str, Any]:
        firing = [a.rule for a in self.engine.firing()]
        return {"healthy": not firing and self.attributor.open is None, "firing": firing}

    @property
    def lr_scale(self) -> float:
        """Multiply your own LR by this in a hand-written loop (1.0 until ``lower_lr`` runs)."""
        try:
            control = getattr(self.actions.action("lower_lr"), "control", None)
        except ValueError:  # an injected registry without lower_lr
            return 1.0
        return float(control.lr_scale) if control is not None else 1.0

    @property
    def incident(self) -> Incident | None:
        return self.attributor.open

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "engine": self.engine.state_dict(),
            "attribution": self.attributor.state_dict(),
            "actions": self.actions.state_dict(),
            "pacing": self.pacing.state_dict(),
            "hparams": self.hparams.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"agent state version {state.get('version')!r} != {STATE_VERSION}")
        self.engine.load_state_dict(state["engine"])
        self.attributor.load_state_dict(state["attribution"])
        self.actions.load_state_dict(state["actions"])
        self.pacing.load_state_dict(state.get("pacing", {}))
        self.hparams.load_state_dict(
            state.get("hparams", state["actions"].get("hparams", {}))  # before 0.2: in actions
        )
        self.actions.reapply_all()

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self._guarded("measurements", self.measurements.close, None)
        if self._optimizer_steps is not None:
            self._optimizer_steps.close()
        if self.kernel_audit is not None:
            self._guarded("kernel audit", self.kernel_audit.close, None)
        self.thread.shutdown()
        for sink in self.metric_sinks:
            self._guarded("metrics", sink.close, None)
        if self.checkpoints is not None:
            self._guarded("checkpoint", self.checkpoints.close, None)
        if self.dispatcher is not None:
            self._guarded("page", lambda: self.dispatcher.close(timeout), None)
        self._write(
            "stop",
            self._last_step if self._last_step is not None else -1,
            evaluations=self._evaluations,
            costs={part: round(seconds, 6) for part, seconds in self.costs().items()},
        )
        self._guarded("event log", self.events.close, None)
