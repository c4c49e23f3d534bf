"""Host copies of a run's state, taken on the training thread for the background writer.

``HostCopier.copy`` walks a nested state (dicts, lists, tuples, tensors, plain values) and
returns a copy in host memory that the training loop can no longer change. CPU tensors are
cloned. Device tensors are copied with ``non_blocking=True`` into pinned host buffers that are
kept and reused from one save to the next (``pinned`` is None for a one-off synchronous copy);
``devices`` lists the devices with copies in flight, so the caller can record one CUDA event
per device and the writer thread waits on it: the training thread never synchronizes with
the device. With ``weights_only`` every leaf must be a type ``torch.load(weights_only=True)``
accepts; numpy scalars are stored as Python numbers, anything else is a ValueError naming its
path (for example ``agent_state['detectors'][0]['w']``).

``capture_payload`` builds a whole checkpoint payload (the ``format.KEY_*`` dict) this way, and
``copy_done_events`` records the per-device CUDA events the writer waits on.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from agent.checkpoints import format as fmt
from agent.checkpoints.rng import capture_rng_state

# Types that torch.load(weights_only=True) reconstructs without extra allow-listing.
_PLAIN_LEAVES = (str, bytes, bytearray, int, float, bool, complex, type(None))
_PLAIN_TORCH_LEAVES = (torch.dtype, torch.device, torch.Size)


class HostCopier:
    """One capture's copier; see the module docstring."""

    def __init__(self, *, weights_only: bool, pinned: dict[str, torch.Tensor] | None) -> None:
        self.weights_only = weights_only
        self.pinned = pinned  # path -> reused pinned host buffer, or None
        self.devices: set[torch.device] = set()

    def copy(self, obj: Any, path: str) -> Any:
        kind = type(obj)
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path)
        if kind in _PLAIN_LEAVES or kind in _PLAIN_TORCH_LEAVES:
            return obj
        if kind in (dict, OrderedDict, Counter):
            out = kind()
            for key, value in obj.items():
                if self.weights_only and type(key) not in _PLAIN_LEAVES:
                    raise self._not_loadable(f"{path} key {key!r}", key)
                out[key] = self.copy(value, f"{path}[{key!r}]")
            metadata = getattr(obj, "_metadata", None)  # module state_dict versions
            if metadata is not None:
                out._metadata = copy.deepcopy(metadata)
            return out
        if kind in (list, tuple):
            return kind(self.copy(v, f"{path}[{i}]") for i, v in enumerate(obj))
        if kind is set:
            return {self.copy(v, f"{path}{{...}}") for v in obj}
        if isinstance(obj, np.generic) and self.weights_only:
            return obj.item()  # a numpy scalar becomes the Python number it holds
        if self.weights_only:
            raise self._not_loadable(path, obj)
        return copy.deepcopy(obj)

    def _copy_tensor(self, t: torch.Tensor, path: str) -> torch.Tensor:
        if self.weights_only and type(t) not in (torch.Tensor, torch.nn.Parameter):
            raise self._not_loadable(path, t)
        t = t.detach()
        if t.device.type == "cpu":
            return t.clone()
        if self.pinned is None or not torch.cuda.is_available() or t.device.type != "cuda":
            return t.to("cpu")  # one-off copy: synchronous, only used off the hot path
        buf = self.pinned.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
            self.pinned[path] = buf
        buf.copy_(t, non_blocking=True)
        self.devices.add(t.device)
        return buf

    @staticmethod
    def _not_loadable(path: str, obj: Any) -> ValueError:
        return ValueError(
            f"{path}: a {type(obj).__module__}.{type(obj).__qualname__} cannot be loaded with "
            "torch.load(weights_only=True); keep checkpointed state to dicts, lists, tuples, "
            "numbers, strings and plain tensors, or construct "
            "CheckpointManager(weights_only=False)"
        )


def capture_payload(
    step: int,
    copier: HostCopier,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    scheduler: Any | None,
    agent_state: Callable[[], dict[str, Any]] | None,
    data_state: Callable[[], Any] | None,
    lineage: str,
) -> dict[str, Any]:
    """The checkpoint payload of the run's current state, copied to host memory."""
    payload: dict[str, Any] = {
        fmt.KEY_FORMAT: fmt.FORMAT_VERSION,
        fmt.KEY_STEP: step,
        fmt.KEY_MODEL: copier.copy(model.state_dict(), "model"),
        fmt.KEY_OPTIMIZER: None,
        fmt.KEY_SCHEDULER: None,
        fmt.KEY_RNG: capture_rng_state(),  # already fresh containers / tensors
        fmt.KEY_AGENT: None,
        fmt.KEY_DATA: None,
        fmt.KEY_LINEAGE: lineage,
    }
    if optimizer is not None:
        payload[fmt.KEY_OPTIMIZER] = copier.copy(optimizer.state_dict(), "optimizer")
    if scheduler is not None:
        payload[fmt.KEY_SCHEDULER] = copier.copy(scheduler.state_dict(), "scheduler")
    if agent_state is not None:
        payload[fmt.KEY_AGENT] = copier.copy(agent_state(), "agent_state")
    if data_state is not None:
        payload[fmt.KEY_DATA] = copier.copy(data_state(), "data_state")
    return payload


def copy_done_events(devices: set[torch.device]) -> list[Any]:
    """One recorded torch.cuda.Event per device, after the non-blocking copies enqueued so far
    on its current stream."""
    events = []
    for device in devices:
        with torch.cuda.device(device):
            event = torch.cuda.Event()
            event.record()
        events.append(event)
    return events
