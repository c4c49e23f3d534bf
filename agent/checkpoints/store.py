"""``CheckpointStore``: what the agent and the rollback action need from a checkpoint store.

``CheckpointManager`` is the implementation; an integration (or a test) may bring its own,
for example one backed by a framework's checkpointing. Steps are optimizer steps completed
when the state was captured.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

    from agent.checkpoints.format import CheckpointInfo


@runtime_checkable
class CheckpointStore(Protocol):
    """Saving periodically, finding, loading and restoring checkpoints, and dropping an
    abandoned future. ``protect_before_step``: retention keeps a checkpoint older than this
    step that a rollback may still need (None: nothing protected)."""

    directory: Path
    protect_before_step: int | None

    def save(self, step: int, *, health: dict[str, Any] | None = None) -> bool:
        """Queue a checkpoint of the state after ``step``; False if a write is still busy."""
        ...

    def maybe_save(self, step: int, *, health: dict[str, Any] | None = None) -> bool:
        """``save`` on the store's checkpoint steps."""
        ...

    def close(self, timeout_s: float | None = None) -> None:
        """Finish writing; never raises because of a failed write."""
        ...

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for a write in flight; False if it was still running at the timeout."""
        ...

    def checkpoints(self) -> list[CheckpointInfo]:
        """Every checkpoint with a readable manifest, newest first (not verified)."""
        ...

    def newest_verified(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> CheckpointInfo | None:
        """The newest checkpoint with ``step < before_step`` whose file matches its manifest."""
        ...

    def load_newest(
        self,
        before_step: int | None = None,
        *,
        known_good_only: bool = False,
        skipped: list[str] | None = None,
        own_run: bool = False,
    ) -> tuple[CheckpointInfo, dict[str, Any]] | None:
        """Like ``newest_verified``, and the payload loads; with the payload."""
        ...

    def restore(
        self,
        payload: dict[str, Any],
        *,
        model: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        skip_batches: int = 0,
        source: str = "checkpoint",
    ) -> int:
        """Load a payload into the run, all or nothing; returns its step."""
        ...

    def discard_after(self, step: int) -> list[int]:
        """Delete this run's checkpoints newer than ``step``; returns the deleted steps."""
        ...

    def record_warning(self, message: str) -> None:
        """Log a warning and keep it with the store's warnings."""
        ...
