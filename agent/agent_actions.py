"""The agent's side of the actions a decision round admits: running them (or recording why
not), escalating to a page and a halt, announcing them in the incident's thread, keeping the
checkpoints a standing request may restore, and picking the run up after a rollback.

``AgentActions`` is a part of ``agent.agent.Agent`` (a base class); it uses the parts the
agent builds, named below.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from remediations.base import ActionContext
from remediations.pacing import ESCALATION_ACTION, Admission
from remediations.runner import ActionResult

if TYPE_CHECKING:
    from agent.attribution import Attributor
    from agent.checkpoints import CheckpointStore
    from agent.config import AgentConfig
    from agent.discovery import RouterSite
    from agent.kernel_audit_probe import KernelAuditProbe
    from agent.measurements import Measurements
    from remediations.attention import AttentionPrecisionSwitch
    from remediations.hparams import HyperparameterRequests
    from remediations.pacing import Pacing
    from remediations.runner import ActionRunner


class AgentActions:
    """Actions between steps, on the training thread (see the module docstring)."""

    config: AgentConfig
    model: Any
    optimizer: Any
    scheduler: Any
    attributor: Attributor
    actions: ActionRunner
    pacing: Pacing
    hparams: HyperparameterRequests
    checkpoints: CheckpointStore | None
    measurements: Measurements
    kernel_audit: KernelAuditProbe | None
    router_sites: list[RouterSite]
    attention_switch: AttentionPrecisionSwitch | None
    should_stop: bool
    _last_step: int | None
    _resume_step: int | None

    _page: Callable[..., None]  # (event, ranks="") the agent's: log and page an incident event
    _write: Callable[..., None]  # (kind, step, **payload) the agent's: an event-log record

    def _admit(self, step: int, admission: Admission) -> None:
        """Run (or record) what pacing decided about one request; ``step`` moves to the
        restored step after a rollback earlier in the round."""
        step = self._last_step if self._last_step is not None else step
        incident, request = self.attributor.open, admission.request
        if admission.verdict != "run":
            result = self.actions.held_back(admission, incident, step)
            if admission.verdict == "escalate":
                self._announce(result, step)
                if not admission.dry_run:
                    self._escalate(step, admission.reason)
            return
        result = self.actions.run(
            request.action,
            request.params,
            incident=incident,
            rule=request.rule,
            dry_run=admission.dry_run,
        )
        self.pacing.ran(admission, ok=result.ok)
        self._announce(result, step)
        if result.restored_step is not None:
            self._after_restore(result.restored_step)
        if result.escalates:
            self._escalate(step, f"{request.action} failed: {result.error}")

    def _escalate(self, step: int, reason: str) -> None:
        """Page and halt: a run that cannot be fixed safely stops instead of looping or
        loading garbage."""
        result = self.actions.run(
            ESCALATION_ACTION,
            {"reason": f"escalated: {reason}"},
            incident=self.attributor.open,
            rule="pacing",
        )
        self._announce(result, self._last_step if self._last_step is not None else step)

    def _announce(self, result: ActionResult, step: int) -> None:
        """Attach an action's record to the open incident; post it in the incident's thread
        unless the action is not announced (``page``: the incident is paged anyway)."""
        event = self.attributor.record_action(result.record, step)
        if event is not None and self.actions.announces(result.record.action):
            self._page(event)

    def _protect_checkpoints(self) -> None:
        """Keep retention from deleting a checkpoint that a standing request may restore."""
        incident = self.attributor.open
        if self.checkpoints is None or incident is None or incident.onset_step is None:
            return
        keep = self.actions.keep_checkpoints_before(self.pacing.standing(), incident)
        current = self.checkpoints.protect_before_step
        self.checkpoints.protect_before_step = keep if current is None else min(current, keep)

    def _after_restore(self, restored: int) -> None:
        """The run continues from ``restored``: drop what was measured on the abandoned path
        (the runner re-applied the other actions' changes: LR scale, attention precision)."""
        self.measurements.restart()
        if self.kernel_audit is not None:
            self.kernel_audit.restart()
        self.pacing.moved_to(restored)
        self._resume_step = restored + 1
        self._last_step = restored  # what later actions in this round see as the current step

    def _allowed(self, action: str) -> bool:
        cfg = self.config.actions
        return cfg.enabled and (cfg.allow is None or action in cfg.allow)

    def _action_context(self) -> ActionContext:
        return ActionContext(
            step=self._last_step if self._last_step is not None else 0,
            model=self.model,
            optimizer=self.optimizer,
            scheduler=self.scheduler,
            checkpoints=self.checkpoints,
            hparams=self.hparams,
            router_parameters=tuple(p for s in self.router_sites for p in s.module.parameters()),
            attention=self.attention_switch,
        )

    def _audit(self, record: dict[str, Any]) -> None:
        payload = {k: v for k, v in record.items() if k not in ("step", "kind")}
        self._write("action", record.get("step", -1), **payload)

    def _raise_if_halted(self) -> None:
        halt = self.actions.action(ESCALATION_ACTION)
        if halt.should_stop:  # type: ignore[attr-defined]
            self.should_stop = True
            halt.check()  # type: ignore[attr-defined]  # raises TrainingHalted ("raise" mode)
