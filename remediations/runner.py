"""``ActionRunner``: runs actions on the training thread, with limits, dry-run and an audit trail.

A request is ``(name, params, incident, dry_run)``. The runner validates the parameters,
enforces a cooldown and a cap per window (counted in training steps actually run: a rollback
does not rewind the runner's clock), builds the ``ActionContext`` (``context_factory()``, then
``incident``/``dry_run``/``extras["hparams"]`` filled in), calls ``apply``, and reports an
``ActionRecord`` plus an audit dict (``audit`` callback). It never raises into the training
loop: bad parameters, a failing ``context_factory``, an action that raises, a failing audit
callback are all reported, and an action that raises leaves the run unchanged (actions are all
or nothing).

Limits (per action, dry runs counted separately from real runs): after a run at step s the
action may not run again before s + ``cooldown`` (a skip says when: ``ActionResult.retry_in``,
and ``ready`` tells whether a request would pass now); at most ``max_per_window`` runs within the
last ``window_steps`` steps. Failed runs count (a failing action is not retried every step).
Defaults: ``RunPolicy`` (cooldown 500, 3 per 10 000 steps); ``page`` and ``halt`` have no
cooldown. A rule overrides them with the common keys next to the action's params
(``{lower_lr: {factor: 0.5, cooldown: 1000}}``); a key the action's own parameters declare
belongs to the action instead (``rollback`` enforces its own ``max_per_window``).

After a successful ``rollback`` the runner calls ``reapply`` on every other action, so what
they changed (LR scale, fp32 attention backward) holds in the restored run.

``observe(samples)`` hands each evaluation's samples to the actions that follow up on their own
change (``lower_lr`` with ``relax_above``); a follow-up is audited like a run (``follow_up``:
true) but is part of the change it follows, so cooldowns and caps do not apply to it.
"""

from __future__ import annotations

import threading
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from agent.incidents import ActionRecord, Incident
from agent.samples import Sample
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.registry import (
    ACTIONS,
    RunPolicy,
    action_class,
    default_policy,
    runner_limits_owned_by_action,
    split_action_params,
)
from remediations.requests import HPARAMS_EXTRA, HyperparameterRequests

_RESTORES_RUN = frozenset({"rollback"})  # actions after which the others are re-applied
_MAX_HISTORY = 256  # runs remembered per (action, dry_run) for the limits


@dataclass
class ActionResult:
    """What one request came to."""

    record: ActionRecord
    audit: dict[str, Any]
    status: str  # "applied", "dry_run", "skipped", "failed"
    outcome: ActionOutcome | None = None
    error: BaseException | None = None  # what apply (or validation) raised
    reapplied: list[str] = field(default_factory=list)  # actions re-applied after a rollback
    retry_in: int | None = None  # skipped for a cooldown: training steps until it may run

    @property
    def ok(self) -> bool:
        return self.record.ok


@dataclass(frozen=True)
class _Request:
    name: str
    params: Any
    incident: Incident | None
    rule: str | None
    dry_run: bool


class ActionRunner:
    """Executes action requests at a step boundary on the training thread.

    Args:
        context_factory: returns an ``ActionContext`` for the current step (model, optimizer,
            scheduler, checkpoints, extras); the runner sets ``incident`` and ``dry_run``.
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
        self.hparams = HyperparameterRequests()
        self._actions: dict[str, Action] = {}
        self._history: dict[tuple[str, bool], list[int]] = {}  # runs, on the runner's clock
        self._clock: int | None = None  # training steps run, never rewound
        self._clock_step: int | None = None
        self._queue: deque[_Request] = deque()
        self._lock = threading.Lock()

    # -- actions -----------------------------------------------------------------------------
    def _class(self, name: str) -> type[Action]:
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
            inst = self._class(name)()
            self._actions[name] = inst
        return inst

    @property
    def lr_control(self) -> Any:
        """The ``LRControl`` of ``lower_lr`` (its ``lr_scale`` is what a hand-written loop
        multiplies its LR by)."""
        return self.action("lower_lr").control  # type: ignore[attr-defined]

    @property
    def lr_scale(self) -> float:
        return float(self.lr_control.lr_scale)

    @property
    def halt(self) -> Any:
        """The ``HaltAction`` instance (``should_stop``, ``check()``)."""
        return self.action("halt")

    # -- requests ----------------------------------------------------------------------------
    def submit(
        self,
        name: str,
        params: Mapping[str, Any] | ActionParams | None = None,
        *,
        incident: Incident | None = None,
        rule: str | None = None,
        dry_run: bool = False,
    ) -> None:
        """Queue a request from any thread; ``run_pending`` executes it on the training thread."""
        with self._lock:
            self._queue.append(_Request(name, params, incident, rule, dry_run))

    def run_pending(self) -> list[ActionResult]:
        """Execute the queued requests, in order (call at a step boundary)."""
        with self._lock:
            requests = list(self._queue)
            self._queue.clear()
        return [
            self.run(r.name, r.params, incident=r.incident, rule=r.rule, dry_run=r.dry_run)
            for r in requests
        ]

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
        step = self._clock_step if self._clock_step is not None else -1
        dry = self.dry_run or dry_run
        audit: dict[str, Any] = {
            "action": name,
            "rule": rule,
            "incident": incident.id if incident is not None else None,
            "params": _jsonable(
                params.model_dump() if isinstance(params, ActionParams) else params
            ),
        }
        try:
            cls, action_params, policy = self._parse(name, params)
            dry = dry or policy.dry_run
        except (ValueError, ValidationError, TypeError) as exc:
            return self._finish(audit, name, step, dry, "failed", f"invalid request: {exc}", exc)
        try:
            ctx = self.context_factory()
            step = ctx.step
            ctx.incident, ctx.dry_run = incident, dry
            ctx.extras.setdefault(HPARAMS_EXTRA, self.hparams)
        except Exception as exc:
            return self._finish(audit, name, step, dry, "failed", f"no context: {exc!r}", exc)

        now = self._clock_at(step)
        why_not = self._limited(cls, name, dry, policy, now)
        if why_not is not None:
            reason, retry_in = why_not
            result = self._finish(audit, name, step, dry, "skipped", f"skipped: {reason}")
            result.retry_in = retry_in
            return result

        self._remember(name, dry, now)
        try:
            outcome = self.action(name).apply(ctx, action_params)
            if not isinstance(outcome, ActionOutcome):
                raise TypeError(
                    f"{name}.apply returned {type(outcome).__name__}, not an ActionOutcome"
                )
        except Exception as exc:
            tb = traceback.format_exception_only(type(exc), exc)[-1].strip()
            return self._finish(audit, name, step, dry, "failed", f"failed: {tb}", exc)

        result = self._finish(
            audit, name, step, dry, "dry_run" if dry else "applied", outcome.detail, None, outcome
        )
        if name in _RESTORES_RUN and not dry:
            restored = outcome.after.get("step")
            if isinstance(restored, int):  # the run continues from there: the clock does not
                self._clock_step = restored  # rewind, it counts on from the restored step
            errors = self.reapply_all(ctx, exclude=(name,))
            result.reapplied = [n for n in self._actions if n != name and n not in errors]
            if errors:
                result.audit["reapply_errors"] = errors
        return result

    def run_request(self, request: Any, incident: Incident | None = None) -> ActionResult:
        """Run an ``agent.attribution.ActionRequest`` (``.action``, ``.params``, ``.rule``)."""
        return self.run(
            request.action,
            getattr(request, "params", None),
            incident=incident,
            rule=getattr(request, "rule", None),
        )

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
            step = self._clock_step if self._clock_step is not None else -1
            audit: dict[str, Any] = {
                "action": name,
                "rule": None,
                "incident": None,
                "params": None,
                "follow_up": True,
            }
            try:
                ctx = self.context_factory()
                step = ctx.step
                ctx.extras.setdefault(HPARAMS_EXTRA, self.hparams)
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

    # -- limits ------------------------------------------------------------------------------
    def _parse(
        self, name: str, params: Mapping[str, Any] | ActionParams | None
    ) -> tuple[type[Action], ActionParams, RunPolicy]:
        """The action class, its validated parameters and the run policy of a request."""
        raw = params.model_dump() if isinstance(params, ActionParams) else dict(params or {})
        cls = self._class(name)
        action_params, overrides = split_action_params_with(cls, raw)
        return cls, action_params, default_policy(cls).model_copy(update=overrides)

    def cooldown_of(self, name: str, params: Mapping[str, Any] | None = None) -> int:
        """The cooldown, in steps, a request for ``name`` runs under (0 for an unknown action
        or unparsable parameters)."""
        try:
            cls, _, policy = self._parse(name, params)
        except (ValueError, ValidationError, TypeError):
            return 0
        return 0 if "cooldown" in runner_limits_owned_by_action(cls) else policy.cooldown

    def ready(
        self,
        name: str,
        params: Mapping[str, Any] | ActionParams | None,
        step: int,
        *,
        dry_run: bool = False,
    ) -> bool:
        """Whether ``run`` at ``step`` would pass the cooldown and the cap (a request it cannot
        parse counts as ready: ``run`` reports it). Changes nothing but the step clock."""
        try:
            cls, _, policy = self._parse(name, params)
        except (ValueError, ValidationError, TypeError):
            return True
        dry = self.dry_run or dry_run or policy.dry_run
        return self._limited(cls, name, dry, policy, self._clock_at(step)) is None

    def note_step(self, step: int) -> None:
        """Tell the runner the run is at ``step`` (optional; keeps its clock exact when the
        step goes back for a reason other than a ``rollback`` run through this runner)."""
        self._clock_at(step)

    def _clock_at(self, step: int) -> int:
        """Advance the clock by the training steps run since it was last read."""
        if self._clock is None or self._clock_step is None:
            self._clock = step
        else:
            self._clock += max(0, step - self._clock_step)
        self._clock_step = step
        return self._clock

    def _limited(
        self, cls: type[Action], name: str, dry: bool, policy: RunPolicy, now: int
    ) -> tuple[str, int | None] | None:
        """Why the action may not run now, and in how many steps it may (None: not by
        waiting for a cooldown); None when it may run."""
        runs = self._history.get((name, dry), [])
        owned = runner_limits_owned_by_action(cls)
        if runs and "cooldown" not in owned and now - runs[-1] < policy.cooldown:
            left = policy.cooldown - (now - runs[-1])
            return f"cooldown ({left} more steps; cooldown {policy.cooldown})", left
        if "max_per_window" not in owned and "window_steps" not in owned:
            recent = sum(1 for t in runs if t > now - policy.window_steps)
            if recent >= policy.max_per_window:
                return (
                    f"cap reached ({recent} runs in the last {policy.window_steps} steps; "
                    f"max_per_window {policy.max_per_window})",
                    None,
                )
        return None

    def _remember(self, name: str, dry: bool, now: int) -> None:
        runs = self._history.setdefault((name, dry), [])
        runs.append(now)
        del runs[:-_MAX_HISTORY]

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
        return {
            "actions": {name: inst.state_dict() for name, inst in self._actions.items()},
            "history": [[n, d, list(t)] for (n, d), t in sorted(self._history.items())],
            "clock": self._clock,
            "clock_step": self._clock_step,
            "hparams": self.hparams.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore action states, limits bookkeeping and requests. Call ``reapply_all`` after
        loading the model/optimizer/scheduler to re-impose what the actions changed."""
        for name, action_state in state.get("actions", {}).items():
            try:
                self._class(name)
            except ValueError:
                warnings.warn(
                    f"mechwatch: saved state for unknown action {name!r} ignored", stacklevel=2
                )
                continue
            self.action(name).load_state_dict(action_state)
        self._history = {
            (str(n), bool(d)): [int(t) for t in times] for n, d, times in state.get("history", [])
        }
        self._clock = state.get("clock")
        self._clock_step = state.get("clock_step")
        self.hparams.load_state_dict(state.get("hparams", {}))


def split_action_params_with(
    cls: type[Action], raw: dict[str, Any]
) -> tuple[ActionParams, dict[str, Any]]:
    """``split_action_params`` for a class that may not be in the global registry."""
    if ACTIONS.get(cls.name) is cls:
        return split_action_params(cls.name, raw)
    own = cls.Params.model_fields
    runner = {k: raw.pop(k) for k in list(raw) if k in RunPolicy.model_fields and k not in own}
    RunPolicy.model_validate(runner)
    return cls.Params.model_validate(raw), runner


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
