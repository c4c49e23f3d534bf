"""The contract every remediation action follows.

An action is a class with a YAML name, a pydantic parameter model and an ``apply`` that runs
on the training thread at a step boundary. ``apply`` is all-or-nothing: it either changes the
run completely and returns a record with before/after values, or raises and leaves the run as
it was. What an action changed lives in the action instance and is saved through
``state_dict`` so that a restart or a rollback re-applies it (``reapply``). An action may also
follow up on its own change (``watching`` / ``observe``: ``lower_lr`` relaxing a cut that
overshot), from the samples of each evaluation.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:
    import torch

    from agent.incidents import Incident
    from agent.samples import Sample


class ActionParams(BaseModel):
    """Base of every action's parameter model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class ActionContext:
    """What an action may touch. Built by the agent on the training thread."""

    step: int
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: Any | None = None  # a torch LR scheduler, or None for hand-written loops
    incident: Incident | None = None
    checkpoints: Any | None = None  # remediations.checkpoint.CheckpointManager, if enabled
    dry_run: bool = False
    # Free-form extras an integration passes (for example the agent itself).
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class ActionOutcome:
    """What ``apply`` reports: a one-line description and before/after values."""

    detail: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


class Action(ABC):
    """One remediation. Subclasses set ``name`` and ``Params`` and implement ``apply``."""

    name: ClassVar[str]
    Params: ClassVar[type[ActionParams]] = ActionParams

    @abstractmethod
    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        """Change the run (ctx.dry_run is False) or describe the change (True). All or nothing."""

    def reapply(self, ctx: ActionContext) -> None:  # noqa: B027 - optional hook
        """Re-impose what this action changed (after a restart or a rollback)."""

    @property
    def watching(self) -> bool:
        """True while the action wants ``observe`` calls (a change it may follow up on)."""
        return False

    def observe(self, ctx: ActionContext, samples: Sequence[Sample]) -> ActionOutcome | None:
        """Follow up on an earlier change from one evaluation's samples (training thread, step
        boundary). Return an outcome when the run was changed (all or nothing), else None."""
        return None

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Restore what ``state_dict`` returned."""
