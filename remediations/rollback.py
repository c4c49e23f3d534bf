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

Escalation instead of garbage or loops: no usable checkpoint raises ``NoUsableCheckpoint``
(an error that escalates: the agent pages and halts the run). The loop guard is pacing's cap on
this action (``pacing`` below: more than 2 rollbacks within 5000 training steps escalate;
``remediations.pacing``), counted in steps actually run, never rewound by a rollback.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import Field

from agent.checkpoints import KEY_AGENT, KEY_DATA, CheckpointStore
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams

if TYPE_CHECKING:
    from agent.incidents import Incident


class NoUsableCheckpoint(RuntimeError):
    """No verified, known-good checkpoint old enough to predate the fault: page and halt
    instead of rolling back (``escalate``: pacing's escalation on failure)."""

    escalate = True


class RollbackParams(ActionParams):
    margin_steps: int = Field(
        100, ge=0, description="the restored step must be <= onset_step - margin_steps"
    )
    skip_batches: int = Field(
        0, ge=0, description="batches to skip after the restored data position"
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
    """Restore the newest verified, known-good checkpoint from before the fault's onset."""

    name: ClassVar[str] = "rollback"
    Params: ClassVar[type[ActionParams]] = RollbackParams

    # The loop guard: a third rollback within 5000 training steps pages and halts.
    pacing: ClassVar[Mapping[str, Any]] = {
        "max_per_window": 2,
        "window_steps": 5000,
        "on_limit": "escalate",
    }
    restores_run: ClassVar[bool] = True

    def __init__(self) -> None:
        self.last_restore: RestoredCheckpoint | None = None

    def keep_checkpoints_before(self, params: ActionParams, incident: Incident) -> int | None:
        if incident.onset_step is None:
            return None
        return latest_allowed_step(incident.onset_step, self._as_params(params).margin_steps) + 1

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
        before = {"step": ctx.step, "onset_step": onset}

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
