"""Checkpoints the agent can roll back to: atomic, checksummed, written off the training thread.

A ``CheckpointManager`` saves, every ``every_n_steps`` optimizer steps, everything a run needs
to continue bit-for-bit: the model, the optimizer, the LR scheduler, the RNG states (python
``random``, numpy's global generator, torch CPU and CUDA), the agent's state and the user's
data position. On the training thread ``save`` only copies that state to host memory; a
background thread serializes it with ``torch.save`` to ``ckpt-<step>.pt.tmp``, fsyncs it,
renames it to ``ckpt-<step>.pt``, fsyncs the directory and then writes the sidecar manifest
``ckpt-<step>.json`` (also atomically) with the file's sha256, size, time and the monitors'
health at save time. A checkpoint is *verified* when its manifest exists and the file's sha256
matches; a crash at any point leaves either the previous checkpoints or a complete new one,
never a half file that is taken for good. A full disk is survived: the failed save leaves
nothing behind and its cause (``ENOSPC``, the directory, the free bytes) is reported once.

Example::

    ckpts = CheckpointManager("runs/ckpt", model=model, optimizer=opt, scheduler=sched,
                              every_n_steps=500, data_state=loader.state,
                              restore_data=loader.restore)
    for step in range(1, total + 1):
        ...  # forward, backward, opt.step(), sched.step()
        ckpts.maybe_save(step, health={"healthy": True, "firing": []})
    ckpts.close()

``step`` always means the number of optimizer steps completed when the state was captured; a
restored run continues with optimizer step ``step + 1``. A checkpoint belongs to the run that
wrote it (its *lineage*): rollbacks and retention only touch the run's own.

One concern per module:

- ``format``: payload keys, file names, the manifest, ``CheckpointInfo``, the errors;
- ``atomic``: temp file, fsync, rename, hashing writer;
- ``host_copy``: copies of the run's state in host memory; ``rng``: the RNG states;
- ``writer``: the background publish sequence; ``failures``: failed saves reported once;
- ``verify``: checksum and payload checks, the newest trusted checkpoint;
- ``retention``: what is kept, lineage, discarding an abandoned future;
- ``restore``: all-or-nothing restore with undo;
- ``store``: ``CheckpointStore``, the protocol the rollback action depends on;
- ``manager``: ``CheckpointManager``, which ties them together.
"""

from __future__ import annotations

from agent.checkpoints.format import (
    FORMAT_VERSION,
    KEY_AGENT,
    KEY_DATA,
    KEY_FORMAT,
    KEY_LINEAGE,
    KEY_MODEL,
    KEY_OPTIMIZER,
    KEY_RNG,
    KEY_SCHEDULER,
    KEY_STEP,
    CheckpointCorrupt,
    CheckpointInfo,
    CheckpointRestoreError,
)
from agent.checkpoints.manager import (
    DEFAULT_EVERY,
    DEFAULT_KEEP_KNOWN_GOOD,
    DEFAULT_KEEP_LAST,
    CheckpointManager,
)
from agent.checkpoints.rng import capture_rng_state, restore_rng_state
from agent.checkpoints.store import CheckpointStore

__all__ = [
    "DEFAULT_EVERY",
    "DEFAULT_KEEP_KNOWN_GOOD",
    "DEFAULT_KEEP_LAST",
    "FORMAT_VERSION",
    "KEY_AGENT",
    "KEY_DATA",
    "KEY_FORMAT",
    "KEY_LINEAGE",
    "KEY_MODEL",
    "KEY_OPTIMIZER",
    "KEY_RNG",
    "KEY_SCHEDULER",
    "KEY_STEP",
    "CheckpointCorrupt",
    "CheckpointInfo",
    "CheckpointManager",
    "CheckpointRestoreError",
    "CheckpointStore",
    "capture_rng_state",
    "restore_rng_state",
]
