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
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

from pydantic import BaseModel, ConfigDict

from remediations.hparams import HyperparameterRequests

if TYPE_CHECKING:
    import torch

    from agent.checkpoints import CheckpointStore
    from agent.incidents import Incident
    from agent.samples import Sample
    from remediations.attention import AttentionPrecisionSwitch


class ActionParams(BaseModel):
    """Base of every action's parameter model: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)


@dataclass
class ActionContext:
    """What an action may touch. Built by the agent on the training thread."""

    step: int
    model: torch.nn.Module | None = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: LRSchedulerLike | None = None  # a torch LR scheduler; None for hand-written loops
    incident: Incident | None = None
    checkpoints: CheckpointStore | None = None  # None: checkpoints are not enabled
    dry_run: bool = False
    hparams: HyperparameterRequests = field(default_factory=HyperparameterRequests)
    router_parameters: Sequence[torch.nn.Parameter] = ()  # the MoE routers' parameters
    attention: AttentionPrecisionSwitch | None = None  # the run's; None: the process-wide one


class LRSchedulerLike(Protocol):
    """What actions need of a learning-rate scheduler (any ``torch.optim.lr_scheduler``)."""

    def step(self, *args: Any, **kwargs: Any) -> Any: ...

    def state_dict(self) -> dict[str, Any]: ...


@dataclass
class ActionOutcome:
    """What ``apply`` reports: a one-line description and before/after values."""

    detail: str
    before: dict[str, Any] = field(default_factory=dict)
    after: dict[str, Any] = field(default_factory=dict)


class Action(ABC):
    """One remediation. Subclasses set ``name`` and ``Params`` and implement ``apply``.

    Traits the agent reads instead of action names: ``pacing`` (defaults of the pacing keys,
    ``remediations.pacing``), ``repeats`` (runs again each cooldown while its rule keeps
    firing), ``restores_run`` (the run continues from ``ActionOutcome.after["step"]``: the
    agent restarts its measurements and the runner re-applies the other actions' changes) and
    ``announce`` (a run is posted in the incident's thread; False: the audit log only).
    """

    name: ClassVar[str]
    Params: ClassVar[type[ActionParams]] = ActionParams
    pacing: ClassVar[Mapping[str, Any]] = {}
    repeats: ClassVar[bool] = True
    restores_run: ClassVar[bool] = False
    announce: ClassVar[bool] = True

    @abstractmethod
    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        """Change the run (ctx.dry_run is False) or describe the change (True). All or nothing."""

    def reapply(self, ctx: ActionContext) -> None:  # noqa: B027 - optional hook
        """Re-impose what this action changed (after a restart or a rollback)."""

    def keep_checkpoints_before(self, params: ActionParams, incident: Incident) -> int | None:
        """A step whose checkpoints retention must keep while ``incident`` may still ask for
        this action (a rollback's target); None: none."""
        return None

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
