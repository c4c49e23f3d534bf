"""Loading a checkpoint payload into a running training job: all or nothing.

``restore_payload`` first checks that the payload fits the model, optimizer and scheduler
(ValueError before anything changes), then takes an undo copy of the current state on the
host (cost: one host copy of model + optimizer state, and the time to make it), then loads, in
this order: the data position (the user's hook, the likeliest to fail), the model, the
optimizer, the scheduler and, last, the RNG states (so whatever the data hook draws does not
move them off the saved values). If a stage fails the undo copy is put back and
``CheckpointRestoreError(run_unchanged=True)`` is raised; ``run_unchanged=False`` when putting
back failed too, or when there is a ``restore_data`` hook but no ``data_state`` hook to read
the data position back from: the run may be inconsistent, halt it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from agent.checkpoints.format import (
    KEY_DATA,
    KEY_MODEL,
    KEY_OPTIMIZER,
    KEY_RNG,
    KEY_SCHEDULER,
    KEY_STEP,
    CheckpointRestoreError,
)
from agent.checkpoints.host_copy import HostCopier
from agent.checkpoints.rng import capture_rng_state, restore_rng_state


def restore_payload(
    payload: dict[str, Any],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    data_state: Callable[[], Any] | None,
    restore_data: Callable[[Any, int], None] | None,
    skip_batches: int,
    source: str,
    warn: Callable[[str], None],
) -> int:
    """Load ``payload`` into the run (see the module docstring); returns its step."""
    check_payload_fits(payload, model, optimizer, scheduler, source)
    undo = _undo_copy(model, optimizer, scheduler, data_state)
    stage = "data"
    try:
        if restore_data is not None:
            restore_data(payload.get(KEY_DATA), skip_batches)
        elif payload.get(KEY_DATA) is not None:
            warn(f"{source}: data position saved but no restore_data hook")
        stage = "model"
        model.load_state_dict(payload[KEY_MODEL])
        stage = "optimizer"
        if optimizer is not None:
            optimizer.load_state_dict(payload[KEY_OPTIMIZER])
        stage = "scheduler"
        if scheduler is not None:
            scheduler.load_state_dict(payload[KEY_SCHEDULER])
        stage = "rng"
        for warning in restore_rng_state(payload[KEY_RNG]):
            warn(f"{source}: {warning}")
    except Exception as e:
        try:
            _put_back(undo, model, optimizer, scheduler, data_state, restore_data)
        except Exception as undo_error:
            raise CheckpointRestoreError(
                f"{source}: loading the {stage} failed ({type(e).__name__}: {e}) and "
                f"putting the run back failed too ({undo_error}): the run is inconsistent",
                run_unchanged=False,
            ) from e
        if restore_data is not None and data_state is None:
            raise CheckpointRestoreError(
                f"{source}: loading the {stage} failed ({type(e).__name__}: {e}); the "
                "model, optimizer, scheduler and RNG were put back, the data position "
                "could not be (no data_state hook)",
                run_unchanged=False,
            ) from e
        raise CheckpointRestoreError(
            f"{source}: loading the {stage} failed ({type(e).__name__}: {e}); the run "
            "was put back as it was",
            run_unchanged=True,
        ) from e
    return int(payload[KEY_STEP])


def _undo_copy(
    model: torch.nn.Module,
    optimizer: Any | None,
    scheduler: Any | None,
    data_state: Callable[[], Any] | None,
) -> dict[str, Any]:
    copier = HostCopier(weights_only=False, pinned=None)  # synchronous, not reused
    return {
        KEY_MODEL: copier.copy(model.state_dict(), "model"),
        KEY_OPTIMIZER: None if optimizer is None else copier.copy(optimizer.state_dict(), ""),
        KEY_SCHEDULER: None if scheduler is None else copier.copy(scheduler.state_dict(), ""),
        KEY_RNG: capture_rng_state(),
        KEY_DATA: None if data_state is None else copier.copy(data_state(), ""),
    }


def _put_back(
    undo: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any | None,
    scheduler: Any | None,
    data_state: Callable[[], Any] | None,
    restore_data: Callable[[Any, int], None] | None,
) -> None:
    if data_state is not None and restore_data is not None:
        restore_data(undo[KEY_DATA], 0)
    model.load_state_dict(undo[KEY_MODEL])
    if optimizer is not None:
        optimizer.load_state_dict(undo[KEY_OPTIMIZER])
    if scheduler is not None:
        scheduler.load_state_dict(undo[KEY_SCHEDULER])
    restore_rng_state(undo[KEY_RNG])


def check_payload_fits(
    payload: dict[str, Any],
    model: torch.nn.Module,
    optimizer: Any | None,
    scheduler: Any | None,
    source: str,
) -> None:
    """ValueError unless the payload's model/optimizer/scheduler state fit the run."""
    saved = payload[KEY_MODEL]
    current = model.state_dict()
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    wrong_shape = [
        f"{k} {tuple(saved[k].shape)} vs {tuple(current[k].shape)}"
        for k in current
        if k in saved and isinstance(saved[k], torch.Tensor) and saved[k].shape != current[k].shape
    ]
    if missing or unexpected or wrong_shape:
        raise ValueError(
            f"{source} does not fit the model: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}, shape mismatch {wrong_shape[:5]}"
        )
    if optimizer is not None:
        saved_opt = payload.get(KEY_OPTIMIZER)
        if saved_opt is None:
            raise ValueError(f"{source} holds no optimizer state but the run has an optimizer")
        saved_sizes = [len(g["params"]) for g in saved_opt["param_groups"]]
        sizes = [len(g["params"]) for g in optimizer.param_groups]
        if saved_sizes != sizes:
            raise ValueError(
                f"{source} does not fit the optimizer: parameter groups of sizes "
                f"{saved_sizes}, the optimizer has {sizes}"
            )
    if scheduler is not None and payload.get(KEY_SCHEDULER) is None:
        raise ValueError(f"{source} holds no scheduler state but the run has a scheduler")
    if KEY_RNG not in payload:
        raise ValueError(f"{source} holds no RNG state")
