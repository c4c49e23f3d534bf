"""Who this process is in a distributed job, and the few collectives the agent runs.

``World.detect(group)`` reads the rank and the size from torch.distributed when a process group
is initialized (``group``, default the whole job), else from the ``RANK`` and ``WORLD_SIZE``
variables (a job whose process group is not initialized yet: each rank then decides alone,
with a warning). The agent's collectives all go through a ``World``, on the training thread
only, and in the same order on every rank:

- ``gather(tensor)``: ``all_gather`` of a small tensor on ``device`` (CUDA for NCCL, CPU
  otherwise), returned as one (world, ...) tensor;
- ``gather_objects(obj)``: ``all_gather_object``; ``broadcast_object(obj)`` from rank 0;
  ``barrier()``.

A collective that fails (a rank left the job, the process group timed out) raises
``RankFailure``: the agent cannot keep its decisions identical without it, so the job stops
instead of going on with ranks that disagree.
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A collective of the agent failed: a rank left the job, hung past the process group's
    timeout, or the group is broken. The job cannot go on with one decision."""

    escalate = True  # inside an action (a rollback's collectives): page and halt


@dataclass(frozen=True)
class World:
    rank: int  # this process's rank in ``group``
    size: int  # ranks in ``group``
    group: Any = None  # a torch.distributed ProcessGroup; None: no collectives (one process)
    device: torch.device = torch.device("cpu")  # where gathered tensors live

    @property
    def collective(self) -> bool:
        """Whether the agent runs collectives: several ranks in an initialized group."""
        return self.group is not None and self.size > 1

    @classmethod
    def detect(cls, group: Any = None) -> World:
        """The world of this process (see the module docstring)."""
        if dist.is_available() and dist.is_initialized():
            group = group if group is not None else dist.group.WORLD
            rank, size = dist.get_rank(group), dist.get_world_size(group)
            device = torch.device("cpu")
            if dist.get_backend(group) == "nccl":
                device = torch.device("cuda", torch.cuda.current_device())
            return cls(rank, size, group if size > 1 else None, device)
        rank = int(os.environ.get("RANK", "0") or 0)
        size = int(os.environ.get("WORLD_SIZE", "1") or 1)
        if size > 1:
            warnings.warn(
                f"mechwatch: WORLD_SIZE is {size} but torch.distributed is not initialized: "
                "each rank measures and decides on its own (call "
                "torch.distributed.init_process_group before creating the Agent)",
                stacklevel=3,
            )
        return cls(rank, size, None)

    def global_rank(self, rank: int) -> int:
        """The job-wide rank of ``rank`` of this world's group."""
        return dist.get_global_rank(self.group, rank) if self.collective else rank

    # -- collectives (training thread, same order on every rank) ------------------------
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (same shape and dtype everywhere), stacked: (size, ...)."""
        if not self.collective:
            return tensor.unsqueeze(0)
        tensor = tensor.to(self.device)
        out = [torch.empty_like(tensor) for _ in range(self.size)]
        self._run("all_gather", lambda: dist.all_gather(out, tensor, group=self.group))
        return torch.stack(out)

    def gather_objects(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if not self.collective:
            return [obj]
        out: list[Any] = [None] * self.size
        self._run("all_gather_object", lambda: dist.all_gather_object(out, obj, group=self.group))
        return out

    def broadcast_object(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        if not self.collective:
            return obj
        box = [obj]
        src = self.global_rank(0)
        self._run(
            "broadcast_object_list",
            lambda: dist.broadcast_object_list(box, src=src, group=self.group),
        )
        return box[0]

    def barrier(self) -> None:
        if self.collective:
            self._run("barrier", lambda: dist.barrier(group=self.group))

    def _run(self, what: str, fn: Any) -> None:
        try:
            fn()
        except Exception as exc:
            raise RankFailure(
                f"mechwatch: {what} across {self.size} ranks failed on rank {self.rank} "
                f"({type(exc).__name__}: {exc}); a rank probably left the job or hung"
            ) from exc
