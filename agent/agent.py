"""The agent: enabled in a training loop with a few lines, it measures, decides and acts.

    agent = Agent.from_config("mechwatch.yaml", model=model, optimizer=optimizer)
    for step, batch in enumerate(loader):
        ...; optimizer.step(); scheduler.step()
        agent.step(step, loss=loss)
    agent.close()

Per ``step()`` on the training thread (cheap, no host-device sync):
  * the loss (and grad norm) are buffered as device tensors; every ``symptoms.every`` steps
    they are read in one transfer and become samples;
  * every ``router.every`` steps the router hooks' device-side sums are read (one transfer);
  * every ``qk.delta`` steps fp32 snapshots of the sampled Q/K weights are taken and a job is
    handed to the monitor thread (APScheduler ``BackgroundScheduler``), which computes the
    spectra from the snapshots, never from live weights;
  * a monitor result measured at step t is applied at step t + ``scheduling.apply_lag`` (the
    training thread waits for it if it is late), so that every rank feeds the same samples to
    the rules at the same step: decisions are deterministic and made at step boundaries;
  * rules are evaluated on new samples, incidents attributed, pages queued (delivered by a
    background sender), and actions run here, between steps. While a rule keeps firing for
    the same incident, its actions run again each time their cooldown is over (a fix that did
    not hold, or one skipped for its cooldown); actions that follow up on their own change
    (``lower_lr`` relaxing a cut) see the same samples.

``step()`` never raises because of the agent's own failure: a broken part is recorded, reported
once (event log + a warning) and skipped. It raises only ``TrainingHalted`` when a ``halt``
action asked for a stop (or sets ``should_stop`` in flag mode).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
import warnings
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from apscheduler.executors.pool import ThreadPoolExecutor
from apscheduler.schedulers.background import BackgroundScheduler

from agent import samples as m
from agent.attribution import ActionRequest, Attributor
from agent.config import AgentConfig
from agent.decisions import decide
from agent.discovery import find_attention, find_routers
from agent.eventlog import EventLog
from agent.incidents import Incident, IncidentEvent, RunContext
from agent.notify.factory import build_dispatcher
from agent.probes import QKSnapshots, RouterProbe, compute_qk_samples
from agent.rules.engine import RuleEngine
from agent.rules.loader import default_rule_files, load_rule_files
from agent.samples import Sample
from agent.store import SeriesStore

log = logging.getLogger("mechwatch")

STATE_VERSION = 1


class Agent:
    """In-process training monitor. See the module docstring for what happens per step."""

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        config: AgentConfig | None = None,
        *,
        data_state: Callable[[], Any] | None = None,
        restore_data: Callable[[Any, int], None] | None = None,
    ) -> None:
        self.config = config = config or AgentConfig()
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.run_dir = Path(config.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.context = RunContext(run_name=config.run_name)
        self._reported: set[str] = set()
        self.should_stop = False

        # Rules first: a broken rule file fails here, not in the middle of a run.
        from remediations.registry import validate_action

        paths = config.rules if config.rules is not None else default_rule_files()
        self.ruleset = load_rule_files(paths, action_validator=validate_action)
        self.store = SeriesStore()
        self.engine = RuleEngine(self.ruleset, self.store)

        # Probes.
        self.attention_sites = find_attention(model, config.discovery) if config.qk.enabled else []
        self.router_sites = find_routers(model, config.discovery) if config.router.enabled else []
        self.router_probe = RouterProbe(self.router_sites, config.router.default_top_k)
        self.router_probe.attach()
        self.qk = QKSnapshots(
            self.attention_sites,
            delta=config.qk.delta,
            layers_per_eval=config.qk.layers_per_eval,
            heads_per_layer=config.qk.heads_per_layer,
            device=config.qk.snapshot_device,
        )
        monitored = set()
        if self.attention_sites:
            monitored.add("fa_precision")
        if self.router_sites:
            monitored.add("router_instability")
        repeat = config.notify.repeat_every_steps
        self.attributor = Attributor(
            self.context,
            monitored_families=monitored,
            **({"repeat_every_steps": repeat} if repeat is not None else {}),
        )

        # Sinks and pages.
        # Every rank keeps its own event log; only rank 0 pages (one outbox per run dir).
        rank = self.context.rank
        self.events = EventLog(
            self.run_dir / ("events.jsonl" if rank == 0 else f"events.rank{rank}.jsonl")
        )
        self.dispatcher = (
            build_dispatcher(config.notify, self.run_dir, event_log=self.events)
            if rank == 0
            else None
        )

        # Actions.
        from remediations.runner import ActionRunner

        self.checkpoints = self._build_checkpoints(data_state, restore_data)
        self.actions = ActionRunner(
            self._action_context, audit=self._audit, dry_run=config.actions.dry_run
        )

        # Per-step buffers (device tensors, read every `symptoms.every` steps).
        self._loss_buffer: list[tuple[int, torch.Tensor | float]] = []
        self._grad_buffer: list[tuple[int, torch.Tensor | float]] = []
        self._pending: list[tuple[int, Future]] = []  # (due step, future of samples)
        self._evaluations = 0
        self._last_step: int | None = None
        self._last_step_time = time.monotonic()
        self._resume_step: int | None = None
        # Standing requests: actions a rule asked for that ran (or were skipped for their
        # cooldown); run again whenever the cooldown allows while the rule still fires for
        # the same incident (a fix that did not hold is applied again, within each action's
        # cap and the rollback loop guard, which escalates to page + halt).
        self._standing: list[ActionRequest] = []
        self._closed = False

        # Monitor thread and watchdog.
        self._scheduler = BackgroundScheduler(
            executors={"default": ThreadPoolExecutor(max_workers=1)},
            job_defaults={"coalesce": False, "max_instances": 1, "misfire_grace_time": None},
        )
        self._build_watchdog()
        if config.watchdog.enabled:
            self._scheduler.add_job(
                self._watchdog,
                "interval",
                seconds=config.watchdog.check_every_s,
                id="mechwatch-watchdog",
            )
        self._scheduler.start()
        self.events.write(
            "start",
            -1,
            run=config.run_name,
            attention_layers=[s.name for s in self.attention_sites],
            routers=[s.name for s in self.router_sites],
            rules=[r.name for r in self.ruleset],
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

    def _build_checkpoints(self, data_state, restore_data):
        cfg = self.config.checkpoints
        if not cfg.enabled:
            return None
        from remediations.checkpoint import CheckpointManager

        return CheckpointManager(
            cfg.directory or self.run_dir / "checkpoints",
            every_n_steps=cfg.every,
            keep_last=cfg.keep_last,
            keep_known_good=cfg.keep_known_good,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            agent_state=self.state_dict,
            data_state=data_state,
            restore_data=restore_data,
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
            self._step(step, loss, grad_norm)
        except Exception as exc:  # the agent's own failure never stops training
            self._report("step", exc)
        self._raise_if_halted()
        if self._resume_step is not None:
            resume, self._resume_step = self._resume_step, None
            return resume
        return step + 1

    def _step(self, step: int, loss, grad_norm) -> None:
        cfg = self.config
        self._last_step = step
        if loss is not None:
            self._loss_buffer.append((step, _detached(loss)))
        if grad_norm is not None:
            self._grad_buffer.append((step, _detached(grad_norm)))
        elif cfg.symptoms.grad_norm and step % cfg.symptoms.every == 0:
            norm = _grad_norm(self.model)
            if norm is not None:
                self._grad_buffer.append((step, norm))

        new: list[Sample] = []
        if step % cfg.symptoms.every == 0:
            new += self._read_symptoms()
        if self.router_sites and step % cfg.router.every == 0:
            new += self._guarded("router probe", lambda: self.router_probe.read(step), [])
            for err in self.router_probe.errors:
                self._report_text("router probe", err)
            self.router_probe.errors.clear()
        for job in self._guarded("qk snapshot", lambda: self.qk.on_step(step), []):
            self._pending.append((step + cfg.scheduling.apply_lag, self._submit(job)))
        new += self._collect_due(step)
        if new:
            self._ingest(step, new)
        if self.checkpoints is not None and step % cfg.checkpoints.every == 0:
            self._guarded(
                "checkpoint", lambda: self.checkpoints.maybe_save(step, health=self.health()), None
            )

    def _read_symptoms(self) -> list[Sample]:
        out: list[Sample] = []
        for buffer, metric in ((self._loss_buffer, m.LOSS), (self._grad_buffer, m.GRAD_NORM)):
            if not buffer:
                continue
            steps = [s for s, _ in buffer]
            values = _to_floats([v for _, v in buffer])  # one host transfer
            buffer.clear()
            for s, v in zip(steps, values, strict=True):
                out.append(Sample.make(s, metric, v))
                if metric == m.LOSS:
                    out.append(Sample.make(s, m.LOSS_NONFINITE, 0.0 if math.isfinite(v) else 1.0))
        return out

    def _submit(self, job) -> Future:
        future: Future = Future()
        orders = tuple(self.config.qk.orders)

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return  # cancelled by a rollback before it started: nothing to compute
            try:
                future.set_result(compute_qk_samples(job, orders))
            except Exception as exc:
                future.set_exception(exc)

        self._scheduler.add_job(run)
        return future

    def _collect_due(self, step: int) -> list[Sample]:
        out: list[Sample] = []
        keep: list[tuple[int, Future]] = []
        for due, future in self._pending:
            if due > step:
                keep.append((due, future))
                continue
            try:
                out += future.result(timeout=self.config.scheduling.max_wait_s)
            except Exception as exc:
                self._report("qk monitor", exc)
        self._pending = keep
        return out

    def _ingest(self, step: int, new: list[Sample]) -> None:
        self._evaluations += 1
        if self._evaluations % self.config.metrics_every == 0:
            self.events.write(
                "metrics", step, samples=[[s.step, s.metric, s.label_dict, s.value] for s in new]
            )
        decisions = decide(self.engine, self.attributor, step, new, time.time())
        for problem in decisions.problems:
            self._report_text(f"rule {problem.rule}", problem.error)
        for t in decisions.transitions:
            self.events.write(
                "alert",
                step,
                rule=t.rule,
                labels=dict(t.labels),
                transition=f"{t.from_state}->{t.to_state}",
                value=t.alert.value,
                baseline=t.alert.baseline,
                onset_step=t.alert.onset_step,
            )
        for event in decisions.events:
            self._page(event)
        for request in decisions.action_requests:
            self._run_action(step, request)
        if self._resume_step is not None:
            return  # rolled back: these samples and this step no longer describe the run
        self._run_standing(step)
        if self._resume_step is not None:
            return
        for result in self._guarded("action follow-up", lambda: self.actions.observe(new), []):
            event = self.attributor.record_action(result.record, step)
            if event is not None:
                self._page(event)

    # ------------------------------------------------------------------ actions and pages
    def _page(self, event: IncidentEvent) -> None:
        self.events.write(
            "incident",
            event.step,
            event=event.kind,
            incident=event.incident.to_dict(),
            message=event.message,
        )
        if self.dispatcher is not None:
            self._guarded("page", lambda: self.dispatcher.submit(event), None)

    def _allowed(self, action: str) -> bool:
        cfg = self.config.actions
        return cfg.enabled and (cfg.allow is None or action in cfg.allow)

    def _run_action(self, step: int, request: ActionRequest) -> None:
        if request.action == "page":
            return  # every incident event is paged already
        incident = self.attributor.open
        self._protect_checkpoints(incident)
        result = self.actions.run(
            request.action,
            request.params,
            incident=incident,
            rule=request.rule,
            dry_run=not self._allowed(request.action),
        )
        ran = result.status == "applied" or result.retry_in is not None
        paced = self.actions.cooldown_of(request.action, request.params) > 0
        if ran and paced and not result.record.dry_run:
            self._standing.append(request)  # again after the cooldown, if the rule still fires
        event = self.attributor.record_action(result.record, step)
        if event is not None:
            self._page(event)
        if result.status == "applied" and request.action == "rollback":
            self._after_rollback(int(result.outcome.after["step"]))
        self._escalate_if_needed(step, result)

    def _run_standing(self, step: int) -> None:
        """Run the standing requests whose cooldown is over, while their rule still fires for
        the same incident (dropped otherwise), in the order they were asked for."""
        if not self._standing:
            return
        open_id = self.attributor.open.id if self.attributor.open is not None else None
        firing = {alert.rule for alert in self.engine.firing()}
        pending, self._standing = self._standing, []
        for i, request in enumerate(pending):
            if self._resume_step is not None:  # a rollback just ran: look again next round
                self._standing.extend(pending[i:])
                return
            if request.incident_id != open_id or request.rule not in firing:
                continue
            dry = not self._allowed(request.action)
            if self.actions.ready(request.action, request.params, step, dry_run=dry):
                self._run_action(step, request)  # stands again if it ran
            else:
                self._standing.append(request)

    def _escalate_if_needed(self, step: int, result) -> None:
        """A rollback that cannot run safely pages and halts instead of loading garbage."""
        from remediations.checkpoint import CheckpointRestoreError
        from remediations.rollback import RollbackEscalation

        err = result.error
        unsafe = isinstance(err, CheckpointRestoreError) and not err.run_unchanged
        if not (isinstance(err, RollbackEscalation) or unsafe):
            return
        halt = self.actions.run(
            "halt",
            {"reason": f"{result.record.action} escalated: {err}"},
            incident=self.attributor.open,
            rule="escalation",
        )
        event = self.attributor.record_action(halt.record, step)
        if event is not None:
            self._page(event)

    def _protect_checkpoints(self, incident: Incident | None) -> None:
        """Keep retention from deleting the checkpoint a rollback for this incident needs."""
        if self.checkpoints is None or incident is None or incident.onset_step is None:
            return
        from remediations.rollback import latest_allowed_step

        margin = max(
            (
                int(p.get("margin_steps", 100))
                for _, a in self._rule_actions()
                for n, p in a
                if n == "rollback"
            ),
            default=100,
        )
        keep = latest_allowed_step(incident.onset_step, margin) + 1
        current = self.checkpoints.protect_before_step
        self.checkpoints.protect_before_step = keep if current is None else min(current, keep)

    def _rule_actions(self):
        return [(r.name, [(a.name, dict(a.params)) for a in r.actions]) for r in self.ruleset]

    def _after_rollback(self, restored: int) -> None:
        """The run continues from ``restored``: drop what was measured on the abandoned path.
        The runner re-applied the other actions' changes (LR scale, attention precision)."""
        self.qk.reset()
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()
        self._loss_buffer.clear()
        self._grad_buffer.clear()
        self._resume_step = restored + 1
        self._last_step = restored  # what later actions in this round see as the current step

    def _action_context(self):
        from remediations.base import ActionContext

        return ActionContext(
            step=self._last_step if self._last_step is not None else 0,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            checkpoints=self.checkpoints,
            extras={"agent": self, "router_parameters": self._router_parameters()},
        )

    def _router_parameters(self) -> list[torch.nn.Parameter]:
        return [p for site in self.router_sites for p in site.module.parameters()]

    def _audit(self, record: dict[str, Any]) -> None:
        payload = {k: v for k, v in record.items() if k not in ("step", "kind")}
        self.events.write("action", record.get("step", -1), **payload)

    def _raise_if_halted(self) -> None:
        halt = self.actions.halt
        if halt.should_stop:
            self.should_stop = True
            halt.check()  # raises TrainingHalted in "raise" mode

    # ------------------------------------------------------------------ watchdog
    def _build_watchdog(self) -> None:
        """Rules on ``seconds_since_step`` (the hung-run rule) run on the watchdog thread, in
        their own store and engine: a hung run has no step boundary to evaluate them at."""
        rules = tuple(r for r in self.ruleset if r.metric == m.SECONDS_SINCE_STEP)
        self._watchdog_engine = RuleEngine(
            dataclasses.replace(self.ruleset, rules=rules), SeriesStore(capacity=64)
        )
        self._watchdog_incidents = 0
        self._watchdog_checks = 0
        self._watchdog_open: dict[str, IncidentEvent] = {}

    def _watchdog(self) -> None:
        """Scheduler thread: page directly (pages are not actions; nothing touches the model)."""
        if self._last_step is None or self._closed:
            return
        idle = time.monotonic() - self._last_step_time
        step = self._last_step
        engine = self._watchdog_engine
        # The series advances by one point per check (the training step stands still while
        # the run hangs, and the engine feeds each step once).
        self._watchdog_checks += 1
        engine.store.append(Sample.make(self._watchdog_checks, m.SECONDS_SINCE_STEP, idle))
        for t in engine.evaluate(self._watchdog_checks, time.time()):
            key = f"{t.rule}:{t.labels}"
            if t.kind == "firing":
                self._watchdog_incidents += 1
                evidence = t.alert.to_evidence()
                incident = Incident(
                    id=f"{self.context.run_name}-hung-{self._watchdog_incidents}-s{step}",
                    family="unattributed",
                    severity=evidence.severity,
                    confidence=0.5,
                    opened_step=step,
                    onset_step=step,
                    evidence=[evidence],
                    quiet_families=[],
                    suggestions=[evidence.suggest] if evidence.suggest else [],
                )
                event = IncidentEvent("opened", 1, step, incident, self.context, evidence.summary)
                self._watchdog_open[key] = event
            elif t.kind == "resolved" and key in self._watchdog_open:
                opened = self._watchdog_open.pop(key)
                incident = opened.incident
                incident.status, incident.resolved_step = "resolved", step
                event = IncidentEvent("resolved", 2, step, incident, self.context, "steps resumed")
            else:
                continue
            self._guarded_write("incident", event=event.kind, incident=event.incident.to_dict())
            if self.dispatcher is not None:
                self._guarded("page", lambda event=event: self.dispatcher.submit(event), None)

    # ------------------------------------------------------------------ errors
    def _guarded(self, what: str, fn: Callable[[], Any], default: Any) -> Any:
        try:
            return fn()
        except Exception as exc:
            self._report(what, exc)
            return default

    def _report(self, what: str, exc: BaseException) -> None:
        self._report_text(what, f"{type(exc).__name__}: {exc}")

    def _report_text(self, what: str, text: str) -> None:
        key = f"{what}: {text.splitlines()[0] if text else ''}"
        if key in self._reported:
            return
        self._reported.add(key)
        warnings.warn(f"mechwatch: {key} (reported once; the agent skips this part)", stacklevel=3)
        self._guarded_write("error", what=what, error=text)

    def _guarded_write(self, kind: str, **payload: Any) -> None:
        try:
            self.events.write(
                kind, self._last_step if self._last_step is not None else -1, **payload
            )
        except Exception:
            log.exception("mechwatch: cannot write the event log")

    # ------------------------------------------------------------------ user-facing state
    def latest_metrics(self) -> dict[str, float]:
        """The newest value of every series, ``metric{label=value,...}`` -> float."""
        return self.store.latest()

    def health(self) -> dict[str, Any]:
        firing = [a.rule for a in self.engine.firing()]
        return {"healthy": not firing and self.attributor.open is None, "firing": firing}

    @property
    def lr_scale(self) -> float:
        """Multiply your own LR by this in a hand-written loop (1.0 until ``lower_lr`` runs)."""
        return self.actions.lr_scale

    @property
    def hparams(self):
        """Hyper-parameter requests your loop may read (balancing coefficient, accumulation):
        ``agent.hparams.get("balance_coef", default)``."""
        return self.actions.hparams

    @property
    def incident(self) -> Incident | None:
        return self.attributor.open

    def state_dict(self) -> dict[str, Any]:
        return {
            "version": STATE_VERSION,
            "engine": self.engine.state_dict(),
            "attribution": self.attributor.state_dict(),
            "actions": self.actions.state_dict(),
            "standing": [dataclasses.asdict(r) for r in self._standing],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"agent state version {state.get('version')!r} != {STATE_VERSION}")
        self.engine.load_state_dict(state["engine"])
        self.attributor.load_state_dict(state["attribution"])
        self.actions.load_state_dict(state["actions"])
        self._standing = [ActionRequest(**r) for r in state.get("standing", [])]
        self.actions.reapply_all()

    def close(self, timeout: float = 10.0) -> None:
        if self._closed:
            return
        self._closed = True
        self.router_probe.detach()
        try:
            self._scheduler.shutdown(wait=False)
        except Exception:
            pass
        if self.checkpoints is not None:
            self._guarded("checkpoint", self.checkpoints.close, None)
        if self.dispatcher is not None:
            self._guarded("page", lambda: self.dispatcher.close(timeout), None)
        self._guarded_write("stop", evaluations=self._evaluations)
        self.events.close()


def _detached(x: torch.Tensor | float) -> torch.Tensor | float:
    return x.detach() if isinstance(x, torch.Tensor) else float(x)


def _to_floats(values: list[torch.Tensor | float]) -> list[float]:
    tensors = [v for v in values if isinstance(v, torch.Tensor)]
    if not tensors:
        return [float(v) for v in values]
    host = iter(torch.stack([t.float().reshape(()) for t in tensors]).cpu().tolist())
    return [next(host) if isinstance(v, torch.Tensor) else float(v) for v in values]


def _grad_norm(model: torch.nn.Module) -> torch.Tensor | None:
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    if not grads:
        return None
    norms = torch._foreach_norm(grads)
    return torch.linalg.vector_norm(torch.stack([n.float() for n in norms]))
