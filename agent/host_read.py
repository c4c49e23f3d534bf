"""Device values read on the host without stalling the training thread.

``tensor.cpu()`` of a CUDA tensor waits for every kernel queued before it: the GPU's queue
drains and the next step starts from an idle device (benchmarks/results/gpu.md part 2: the
symptom and router read-outs were the agent's only synchronizations on the training thread).
A ``HostRead`` instead queues a non-blocking copy into pinned host memory and records a CUDA
event behind it; its values are taken ``scheduling.apply_lag`` steps later (the caller's
choice), when the event has long passed and nothing waits. A CPU tensor is read at once, as
before: on a CPU there is no queue to drain.
"""

from __future__ import annotations

import torch


class HostRead:
    """One tensor on its way to the host (``values``: any shape, any device)."""

    def __init__(self, values: torch.Tensor) -> None:
        self._event: torch.cuda.Event | None = None
        if values.is_cuda:
            # pinned (page-locked) memory from torch's caching host allocator: a copy into
            # pageable memory would be synchronous whatever non_blocking says
            host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            with torch.cuda.device(values.device):  # the copy's and the event's stream agree
                host.copy_(values, non_blocking=True)
                self._event = torch.cuda.Event()
                self._event.record()  # on values' device's current stream, behind the copy
            self._host = host
        else:
            self._host = values.detach()

    @property
    def in_flight(self) -> bool:
        """True while the copy may still be on its way (a CUDA source): take the values later."""
        return self._event is not None

    def tolist(self) -> list:
        """The values as Python numbers (``Tensor.tolist``), waiting for the copy only if it
        has not arrived yet (a CUDA event that has passed costs nothing)."""
        if self._event is not None and not self._event.query():
            self._event.synchronize()
        return self._host.tolist()
