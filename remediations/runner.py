"""``ActionRunner``: runs actions on the training thread, with dry-run and an audit trail.

A request is ``(name, params, incident, rule, dry_run)``. The runner validates the parameters
(the pacing keys are split off: ``remediations.pacing`` decides *when* a request runs, the
runner only *runs* it), builds the ``ActionContext`` (``context_factory()``, then ``incident``
and ``dry_run`` filled in), calls ``apply``, and reports an ``ActionRecord`` plus an audit dict
(``audit`` callback). It never raises into the training loop: bad parameters, a failing
``context_factory``, an action that raises, a failing audit callback are all reported, and an
action that raises leaves the run unchanged (actions are all or nothing).

After a successful run of an action that ``restores_run`` (``rollback``) the runner calls
``reapply`` on every other action, so what they changed (LR scale, fp32 attention backward)
holds in the restored run.

``observe(samples)`` hands each evaluation's samples to the actions that follow up on their own
change (``lower_lr`` with ``relax_above``); a follow-up is audited like a run (``follow_up``:
true) but is part of the change it follows, so pacing does not apply to it.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from agent.incidents import ActionRecord, Incident
from agent.samples import Sample
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.pacing import ActionRequest, Admission, PacingLimits, split_pacing
from remediations.registry import action_class, pacing_limits


@dataclass
class ActionResult:
    """What one request came to."""

    record: ActionRecord
    audit: dict[str, Any]
    status: str  # "applied", "dry_run", "skipped", "failed"
    outcome: ActionOutcome | None = None
    error: BaseException | None = None  # what apply (or validation) raised
    reapplied: list[str] = field(default_factory=list)  # actions re-applied after a restore

    @property
    def ok(self) -> bool:
        return self.record.ok

    @property
    def restored_step(self) -> int | None:
        """The step the run continues from, when this run restored an earlier state."""
        if self.status != "applied" or self.outcome is None:
            return None
        step = self.outcome.after.get("step")
        return step if isinstance(step, int) and self.audit.get("restores_run") else None

    @property
    def escalates(self) -> bool:
        """The action failed in a way that must stop the run (its error says so)."""
        return bool(getattr(self.error, "escalate", False))


class ActionRunner:
    """Executes action requests at a step boundary on the training thread.

    Args:
        context_factory: returns an ``ActionContext`` for the current step (model, optimizer,
            scheduler, checkpoints, ...); the runner sets ``incident`` and ``dry_run``.
        audit: called with a JSON-serializable dict for every request (also skipped ones).
        dry_run: run every action as a dry run (the agent's ``actions.dry_run``).
        actions: the registry to use (default: ``remediations.registry.ACTIONS``).
    """

    def __init__(
        self,
        context_factory: Callable[[], ActionContext],
        audit: Callable[[dict[str, Any]], None] | None = None,
        *,
        dry_run: bool = False,
        actions: Mapping[str, type[Action]] | None = None,
    ) -> None:
        self.context_factory = context_factory
        self.audit = audit
        self.dry_run = dry_run
        self._registry = actions
        self._actions: dict[str, Action] = {}

    # -- actions -----------------------------------------------------------------------------
    def action_class(self, name: str) -> type[Action]:
        if self._registry is None:
            return action_class(name)
        cls = self._registry.get(name)
        if cls is None:
            raise ValueError(
                f"unknown action {name!r}; registered actions: {', '.join(sorted(self._registry))}"
            )
        return cls

    def action(self, name: str) -> Action:
        """The runner's instance of action ``name`` (created on first use)."""
        inst = self._actions.get(name)
        if inst is None:
            inst = self.action_class(name)()
            self._actions[name] = inst
        return inst

    def parse(
        self, name: str, params: Mapping[str, Any] | ActionParams | None
    ) -> tuple[type[Action], ActionParams, PacingLimits]:
        """The action class, its validated parameters and its pacing limits."""
        raw = params.model_dump() if isinstance(params, ActionParams) else dict(params or {})
        cls = self.action_class(name)
        own, pacing = split_pacing(raw)
        return cls, cls.Params.model_validate(own), pacing_limits(cls, pacing)

    def limits_of(self, request: ActionRequest) -> tuple[PacingLimits, bool]:
        """Pacing's view of a request: its limits and whether the action repeats. A request
        that does not parse gets the defaults (``run`` reports what is wrong with it)."""
        try:
            cls, _, limits = self.parse(request.action, request.params)
        except (ValueError, ValidationError, TypeError):
            return PacingLimits(), False
        return limits, cls.repeats

    # -- requests ----------------------------------------------------------------------------
    def run(
        self,
        name: str,
        params: Mapping[str, Any] | ActionParams | None = None,
        *,
        incident: Incident | None = None,
        rule: str | None = None,
        dry_run: bool = False,
    ) -> ActionResult:
        """Run one action now. Never raises (except on a bug in the runner itself)."""
        audit = _audit_head(name, rule, incident, params)
        step, dry = -1, self.dry_run or dry_run
        try:
            cls, action_params, limits = self.parse(name, params)
            dry = dry or limits.dry_run
        except (ValueError, ValidationError, TypeError) as exc:
            return self._finish(audit, name, step, dry, "failed", f"invalid request: {exc}", exc)
        try:
            ctx = self.context_factory()
            step = ctx.step
            ctx.incident, ctx.dry_run = incident, dry
        except Exception as exc:
            return self._finish(audit, name, step, dry, "failed", f"no context: {exc!r}", exc)
        try:
            outcome = self.action(name).apply(ctx, action_params)
            if not isinstance(outcome, ActionOutcome):
                raise TypeError(
                    f"{name}.apply returned {type(outcome).__name__}, not an ActionOutcome"
                )
        except Exception as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return self._finish(audit, name, step, dry, "failed", f"failed: {tb}", exc)

        audit["restores_run"] = cls.restores_run and not dry
        status = "dry_run" if dry else "applied"
        result = self._finish(audit, name, step, dry, status, outcome.detail, None, outcome)
        if result.restored_step is not None:
            errors = self.reapply_all(ctx, exclude=(name,))
            result.reapplied = [n for n in self._actions if n != name and n not in errors]
            if errors:
                result.audit["reapply_errors"] = errors
        return result

    def held_back(self, admission: Admission, incident: Incident | None, step: int) -> ActionResult:
        """Audit a request pacing did not run now (``wait``, ``skip``, ``escalate``)."""
        request = admission.request
        audit = _audit_head(request.action, request.rule, incident, request.params)
        audit["pacing"] = admission.verdict
        if admission.retry_in is not None:
            audit["retry_in"] = admission.retry_in
        verb = {"wait": "waits", "skip": "skipped", "escalate": "escalated"}[admission.verdict]
        return self._finish(
            audit, request.action, step, admission.dry_run, "skipped", f"{verb}: {admission.reason}"
        )

    def announces(self, name: str) -> bool:
        """Whether a run of ``name`` is posted in the incident's thread."""
        try:
            return self.action_class(name).announce
        except ValueError:
            return True

    def keep_checkpoints_before(self, requests: Sequence[ActionRequest], incident: Incident) -> int:
        """The oldest step whose checkpoints one of ``requests`` may still need (or a very
        large number when none does)."""
        keep = []
        for request in requests:
            try:
                _, params, _ = self.parse(request.action, request.params)
                step = self.action(request.action).keep_checkpoints_before(params, incident)
            except Exception:  # an invalid request needs nothing (``run`` reports it)
                continue
            if step is not None:
                keep.append(step)
        return min(keep, default=2**62)

    def observe(self, samples: Sequence[Sample]) -> list[ActionResult]:
        """Give one evaluation's samples to the actions that are watching their own change
        (call on the training thread after the rules' decisions). Never raises."""
        results = []
        for name, inst in list(self._actions.items()):
            try:
                if not inst.watching:
                    continue
            except Exception:  # a broken user action must not stop the others
                continue
            audit = _audit_head(name, None, None, None)
            audit["follow_up"] = True
            step = -1
            try:
                ctx = self.context_factory()
                step = ctx.step
                outcome = inst.observe(ctx, samples)
                if outcome is not None and not isinstance(outcome, ActionOutcome):
                    raise TypeError(
                        f"{name}.observe returned {type(outcome).__name__}, not an ActionOutcome"
                    )
            except Exception as exc:
                tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
                results.append(
                    self._finish(audit, name, step, False, "failed", f"follow-up failed: {tb}", exc)
                )
                continue
            if outcome is not None:
                results.append(
                    self._finish(audit, name, step, False, "applied", outcome.detail, None, outcome)
                )
        return results

    # -- records -----------------------------------------------------------------------------
    def _finish(
        self,
        audit: dict[str, Any],
        name: str,
        step: int,
        dry: bool,
        status: str,
        detail: str,
        error: BaseException | None = None,
        outcome: ActionOutcome | None = None,
    ) -> ActionResult:
        ok = status in ("applied", "dry_run")
        before = dict(outcome.before) if outcome is not None else {}
        after = dict(outcome.after) if outcome is not None else {}
        record = ActionRecord(
            action=name, step=step, dry_run=dry, ok=ok, detail=detail, before=before, after=after
        )
        audit.update(
            step=step,
            dry_run=dry,
            ok=ok,
            status=status,
            detail=detail,
            before=_jsonable(before),
            after=_jsonable(after),
            error=None if error is None else f"{type(error).__name__}: {error}",
        )
        result = ActionResult(record, audit, status, outcome, error)
        if self.audit is not None:
            try:
                self.audit(audit)
            except Exception as exc:  # the audit trail must not stop training
                warnings.warn(f"mechwatch: action audit callback failed: {exc!r}", stacklevel=2)
        return result

    # -- restart / rollback ------------------------------------------------------------------
    def reapply_all(
        self, ctx: ActionContext | None = None, *, exclude: tuple[str, ...] = ()
    ) -> dict[str, str]:
        """Call ``reapply`` on every action the runner has used; returns {name: error}."""
        errors: dict[str, str] = {}
        try:
            ctx = ctx if ctx is not None else self.context_factory()
        except Exception as exc:
            return {"*": f"no context: {exc!r}"}
        for name, inst in self._actions.items():
            if name in exclude:
                continue
            try:
                inst.reapply(ctx)
            except Exception as exc:
                errors[name] = f"{type(exc).__name__}: {exc}"
        for name, err in errors.items():
            warnings.warn(f"mechwatch: re-applying {name} failed: {err}", stacklevel=2)
        return errors

    def state_dict(self) -> dict[str, Any]:
        return {"actions": {name: inst.state_dict() for name, inst in self._actions.items()}}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore action states. Call ``reapply_all`` after loading the model, optimizer and
        scheduler to re-impose what the actions changed."""
        for name, action_state in state.get("actions", {}).items():
            try:
                self.action_class(name)
            except ValueError:
                warnings.warn(
                    f"mechwatch: saved state for unknown action {name!r} ignored", stacklevel=2
                )
                continue
            self.action(name).load_state_dict(action_state)


def _audit_head(
    name: str, rule: str | None, incident: Incident | None, params: Any
) -> dict[str, Any]:
    return {
        "action": name,
        "rule": rule,
        "incident": incident.id if incident is not None else None,
        "params": _jsonable(params.model_dump() if isinstance(params, ActionParams) else params),
    }


def _jsonable(value: Any) -> Any:
    """A JSON-serializable copy (tensors and other objects become floats / strings)."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [_jsonable(v) for v in value]
    try:
        import torch

        if isinstance(value, torch.Tensor) and value.numel() == 1:
            return float(value)
    except ImportError:  # pragma: no cover
        pass
    return repr(value)
