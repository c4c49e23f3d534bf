"""The ``rollback`` action: go back to a verified checkpoint from before the fault began.

The weights after an incident's onset already carry the fault, so the action restores the
newest checkpoint that verifies (sha256 against its manifest, then a clean ``torch.load``),
was known-good at save time, and predates the onset by ``margin_steps``:
``checkpoint.step <= onset_step - margin_steps``. Corrupt or truncated checkpoints are
skipped for older ones. It then loads model, optimizer, scheduler, RNG states and the data
position (optionally skipping ``skip_batches`` batches), deletes the checkpoints of the
abandoned future, and reports the restored step; the agent re-applies its remediation state
(LR scale, attention precision) through the other actions' ``reapply``, and the training loop
continues from ``outcome.after["step"]``.

Escalation instead of garbage or loops: no usable checkpoint raises ``NoUsableCheckpoint``,
more than ``max_per_window`` rollbacks within ``window_steps`` training steps raise
``RollbackLimitExceeded``; on either the agent pages and halts the run. The loop guard counts
training steps actually run (a rollback does not rewind its clock), and its history lives in
this action's ``state_dict``: the agent must keep it across the rollback (not overwrite it
with the restored agent state), or a loop could never be detected.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import Field

from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.checkpoint import KEY_AGENT, KEY_DATA, CheckpointStore

_MAX_HISTORY = 64  # rollbacks remembered for the loop guard


class RollbackEscalation(RuntimeError):
    """A rollback the agent must not attempt: page and halt instead."""


class NoUsableCheckpoint(RollbackEscalation):
    """No verified, known-good checkpoint old enough to predate the fault."""


class RollbackLimitExceeded(RollbackEscalation):
    """Too many rollbacks within the loop-guard window."""


class RollbackParams(ActionParams):
    margin_steps: int = Field(
        100, ge=0, description="the restored step must be <= onset_step - margin_steps"
    )
    skip_batches: int = Field(
        0, ge=0, description="batches to skip after the restored data position"
    )
    max_per_window: int = Field(
        2, ge=1, description="rollbacks allowed within window_steps before escalating"
    )
    window_steps: int = Field(
        5000, ge=1, description="loop-guard window, in training steps actually run"
    )
    require_known_good: bool = Field(
        True, description="only restore checkpoints whose save-time health was healthy"
    )
    discard_newer: bool = Field(
        True, description="delete checkpoints newer than the restored one (abandoned future)"
    )


@dataclass(frozen=True)
class RestoredCheckpoint:
    """What the last rollback restored, for the agent to act on."""

    step: int  # optimizer steps completed in the restored state; the loop continues at step+1
    path: str
    from_step: int  # the step the run was at when it rolled back
    onset_step: int
    skipped_batches: int
    known_good: bool
    health: dict[str, Any] | None  # the monitors' health when the checkpoint was saved
    agent_state: dict[str, Any] | None  # the agent's state saved with the checkpoint
    data_state: Any  # the data position saved with the checkpoint (before skipping)


def latest_allowed_step(onset_step: int, margin_steps: int) -> int:
    """The newest checkpoint step a rollback for an incident with this onset may restore.
    The agent passes ``latest_allowed_step(...) + 1`` as ``protect_before_step`` to retention."""
    return onset_step - margin_steps


class RollbackAction(Action):
    name: ClassVar[str] = "rollback"
    Params: ClassVar[type[ActionParams]] = RollbackParams

    def __init__(self) -> None:
        self.last_restore: RestoredCheckpoint | None = None
        # Loop-guard clock: training steps run since the first apply, never rewound.
        self._clock: int | None = None
        self._clock_step: int | None = None  # the run's step when the clock was last read
        self._history: list[dict[str, int]] = []  # {"clock", "from_step", "to_step"}

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        p = self._as_params(params)
        manager = ctx.checkpoints
        if manager is None:
            raise ValueError("rollback needs checkpoints enabled (no CheckpointManager given)")
        if not isinstance(manager, CheckpointStore):
            raise ValueError(
                f"rollback: ctx.checkpoints is a {type(manager).__name__}, "
                "expected a CheckpointManager (or another CheckpointStore)"
            )
        incident = ctx.incident
        onset = (
            incident.onset_step
            if incident is not None and incident.onset_step is not None
            else ctx.step
        )
        latest = latest_allowed_step(onset, p.margin_steps)
        now = self._clock_at(ctx.step)
        recent = self.rollbacks_within(now, p.window_steps)
        before = {"step": ctx.step, "onset_step": onset, "rollbacks_in_window": recent}
        if recent >= p.max_per_window:
            message = (
                f"{recent} rollbacks in the last {p.window_steps} training steps (limit "
                f"{p.max_per_window}): escalating instead of rolling back again"
            )
            if ctx.dry_run:
                return ActionOutcome(f"would escalate: {message}", before, {"escalate": True})
            raise RollbackLimitExceeded(message)

        manager.flush()  # a write in flight may be the checkpoint we need (or must discard)
        skipped: list[str] = []
        if ctx.dry_run:
            info = manager.newest_verified(
                latest + 1, known_good_only=p.require_known_good, skipped=skipped, own_run=True
            )
            if info is None:
                message = self._no_usable_message(manager, onset, p, latest, skipped)
                return ActionOutcome(f"would escalate: {message}", before, {"escalate": True})
            return ActionOutcome(
                f"would roll back from step {ctx.step} to checkpoint step {info.step} "
                f"(onset {onset}, margin {p.margin_steps}, skip {p.skip_batches} batches)",
                before,
                {"step": info.step, "checkpoint": str(info.path)},
            )

        found = manager.load_newest(
            latest + 1, known_good_only=p.require_known_good, skipped=skipped, own_run=True
        )
        if found is None:
            raise NoUsableCheckpoint(self._no_usable_message(manager, onset, p, latest, skipped))
        info, payload = found
        restored_step = manager.restore(
            payload,
            model=ctx.model,
            optimizer=ctx.optimizer,
            scheduler=ctx.scheduler,
            skip_batches=p.skip_batches,
            source=info.path.name,
        )
        assert restored_step == info.step, (restored_step, info.step)
        # Committed: from here on the run is at restored_step.
        self._history.append({"clock": now, "from_step": ctx.step, "to_step": restored_step})
        del self._history[:-_MAX_HISTORY]
        self._clock, self._clock_step = now, restored_step
        discarded: list[int] = []
        if p.discard_newer:
            try:
                discarded = manager.discard_after(restored_step)
            except OSError as e:  # the run is restored; stale files are a warning, not a failure
                manager.record_warning(f"could not delete checkpoints after {restored_step}: {e}")
        self.last_restore = RestoredCheckpoint(
            step=restored_step,
            path=str(info.path),
            from_step=ctx.step,
            onset_step=onset,
            skipped_batches=p.skip_batches,
            known_good=info.known_good,
            health=info.health,
            agent_state=payload.get(KEY_AGENT),
            data_state=payload.get(KEY_DATA),
        )
        detail = (
            f"rolled back from step {ctx.step} to checkpoint step {restored_step} "
            f"(onset {onset}, margin {p.margin_steps})"
            + (f", skipped {p.skip_batches} batches" if p.skip_batches else "")
            + (f"; skipped unusable: {'; '.join(skipped)}" if skipped else "")
        )
        after = {
            "step": restored_step,
            "checkpoint": str(info.path),
            "known_good": info.known_good,
            "skipped_batches": p.skip_batches,
            "skipped_checkpoints": list(skipped),
            "discarded_steps": discarded,
        }
        return ActionOutcome(detail, before, after)

    def rollbacks_within(self, clock: int, window_steps: int) -> int:
        """How many rollbacks happened within the last ``window_steps`` training steps."""
        return sum(1 for h in self._history if h["clock"] > clock - window_steps)

    def state_dict(self) -> dict[str, Any]:
        return {
            "clock": self._clock,
            "clock_step": self._clock_step,
            "history": [dict(h) for h in self._history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._clock = state.get("clock")
        self._clock_step = state.get("clock_step")
        history = state.get("history", [])[-_MAX_HISTORY:]
        self._history = [{k: int(v) for k, v in h.items()} for h in history]

    def _clock_at(self, step: int) -> int:
        """Advance the loop-guard clock by the steps run since it was last read."""
        if self._clock is None or self._clock_step is None:
            self._clock = step
        else:
            self._clock += max(0, step - self._clock_step)
        self._clock_step = step
        return self._clock

    @staticmethod
    def _as_params(params: ActionParams) -> RollbackParams:
        if isinstance(params, RollbackParams):
            return params
        return RollbackParams.model_validate(params.model_dump())

    @staticmethod
    def _no_usable_message(
        manager: CheckpointStore,
        onset: int,
        p: RollbackParams,
        latest: int,
        skipped: list[str],
    ) -> str:
        steps = [i.step for i in manager.checkpoints()]
        return (
            f"no usable checkpoint at or before step {latest} (onset {onset} - margin "
            f"{p.margin_steps}{', known-good only' if p.require_known_good else ''}) in "
            f"{manager.directory}; checkpoints on disk: {steps or 'none'}"
            + (f"; skipped: {'; '.join(skipped)}" if skipped else "")
            + "; paging and halting instead of loading an unusable checkpoint"
        )
