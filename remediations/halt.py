"""``halt``: stop the run gracefully, after a final checkpoint if configured.

The action does not stop anything by itself: it records the request (reason, incident id, step,
mode) and, with ``checkpoint: true`` and checkpoints enabled, first saves a final checkpoint and
waits for it to be written. The agent reads the request at its next ``step``:

- ``mode: raise`` (default): ``agent.step`` raises ``TrainingHalted`` (a ``RuntimeError``), so a
  plain loop stops with a clear message; catch it to exit cleanly.
- ``mode: flag``: ``agent.should_stop`` becomes True and the loop checks it
  (``if agent.should_stop: break``), for loops that must finish their own shutdown.

``HaltAction.check()`` is what the agent calls at each step; ``HaltAction.should_stop`` is the
flag. The request is part of the action's state; the final checkpoint is taken before the
request is recorded, so a run resumed from that checkpoint does not halt again at once.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar, Literal

from pydantic import ConfigDict, Field

from remediations.base import Action, ActionContext, ActionOutcome, ActionParams


class TrainingHalted(RuntimeError):
    """Raised by the agent's ``step`` after a ``halt`` action in ``raise`` mode."""

    def __init__(self, reason: str, *, incident_id: str | None = None, step: int | None = None):
        where = "" if step is None else f" at step {step}"
        about = "" if incident_id is None else f" (incident {incident_id})"
        super().__init__(f"training halted by mechwatch{where}{about}: {reason}")
        self.reason = reason
        self.incident_id = incident_id
        self.step = step


class HaltParams(ActionParams):
    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    mode: Literal["raise", "flag"] = Field(
        "raise", description="raise TrainingHalted at the next step, or only set should_stop"
    )
    checkpoint: bool = Field(True, description="save a final checkpoint first, if enabled")
    reason: str | None = Field(None, description="why; default: the incident and its family")


class HaltAction(Action):
    """Request a graceful stop of the run."""

    name = "halt"
    Params = HaltParams
    pacing: ClassVar[Mapping[str, Any]] = {"cooldown": 0}
    repeats: ClassVar[bool] = False
    flush_timeout_s: float = 600.0  # longest wait for the final checkpoint to be written

    def __init__(self) -> None:
        self.request: dict[str, Any] | None = None  # {reason, incident_id, step, mode}

    @property
    def should_stop(self) -> bool:
        """True once a halt was requested (either mode)."""
        return self.request is not None

    def error(self) -> TrainingHalted | None:
        """The exception the agent raises, or None (no request, or ``flag`` mode)."""
        if self.request is None or self.request["mode"] != "raise":
            return None
        r = self.request
        return TrainingHalted(r["reason"], incident_id=r["incident_id"], step=r["step"])

    def check(self) -> None:
        """Raise ``TrainingHalted`` if a halt in ``raise`` mode was requested."""
        err = self.error()
        if err is not None:
            raise err

    def clear(self) -> None:
        """Forget the request (a person decided to continue the run)."""
        self.request = None

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        assert isinstance(params, HaltParams)
        incident = ctx.incident
        reason = params.reason or (
            f"incident {incident.id} ({incident.family}, {incident.severity})"
            if incident is not None
            else "requested"
        )
        request = {
            "reason": reason,
            "incident_id": incident.id if incident is not None else None,
            "step": ctx.step,
            "mode": params.mode,
        }
        before = {"halt_requested": self.request is not None}
        manager = ctx.checkpoints
        checkpoint = "none"
        if params.checkpoint and manager is None:
            checkpoint = "not enabled"
        elif params.checkpoint and ctx.dry_run:
            checkpoint = "would save"
        elif params.checkpoint:
            health = {"healthy": False, "reason": f"final checkpoint before halt: {reason}"}
            if not manager.save(ctx.step, health=health):
                checkpoint = "skipped (previous write still running)"
            elif not manager.flush(self.flush_timeout_s):
                checkpoint = f"still writing after {self.flush_timeout_s:g} s"
            else:
                checkpoint = f"saved at step {ctx.step}"
        how = "raise TrainingHalted" if params.mode == "raise" else "set should_stop"
        verb = "would halt" if ctx.dry_run else "halt"
        detail = f"{verb} at the next step ({how}); final checkpoint: {checkpoint}; {reason}"
        after = dict(request, checkpoint=checkpoint)
        if not ctx.dry_run:
            self.request = request  # last: the checkpoint above did not contain the request
        return ActionOutcome(detail, before, after)

    def state_dict(self) -> dict[str, Any]:
        return {"request": None if self.request is None else dict(self.request)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        request = state.get("request")
        if request is not None and (
            not isinstance(request, dict)
            or set(request) != {"reason", "incident_id", "step", "mode"}
            or request["mode"] not in ("raise", "flag")
        ):
            raise ValueError(f"halt state: bad request {request!r}")
        self.request = None if request is None else dict(request)
