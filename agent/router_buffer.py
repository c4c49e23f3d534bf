"""Routing logits of recent forwards, buffered on the device and reduced in batches.

A router hook runs once per router per training forward: what it costs is paid on every step.
Computing the routing statistics there takes a few dozen small operations per forward, which
on a small model costs more than the router itself. ``RouterLogitBuffer`` instead writes each
forward's logits, experts first (z^T = W x^T + b, E x N), into the next slot of a preallocated
device buffer (one matrix product, no allocation) and reduces all buffered forwards at once
(``routing_sums``) when the buffer is full or the statistics are read. The sums are those of
computing every forward on its own: every forward and every token counts.

Memory: the buffer holds at most ``max_bytes`` of logits (and at most ``max_forwards``
forwards), at the input's precision: a forward of N tokens and E experts takes N E elements,
so a large forward (8192 tokens x 256 experts in bf16 is 4 MiB) gets a buffer of one or two
slots and is reduced at once, as before; a small one (1024 x 8) is reduced every 64 forwards.
A forward with a different token count or dtype reduces what is buffered and starts a new
buffer.

A plain ``nn.Linear`` router's output *is* its logits (z = x W^T + b, computed by the router
itself at the precision it routes with): ``add_logits`` copies it, tokens first (N x E), into
a buffer of that layout, which is a plain copy instead of a product; the reduction reads it
experts first (a transposed view, made contiguous where it is reduced).

Off the training thread: ``hand_over()`` gives the buffered forwards and sums to a
``HandedBatch`` that the monitor thread reduces (``HandedBatch.reduce``), or the monitor
process, whose shared files then hold the CPU buffers (``allocate_cpu``), while the hooks go on
writing into a second buffer; the first one is reused once the batch was reduced
(``recycle``). The training thread then pays only the product per forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from agent.monitors.router import routing_sums

DEFAULT_MAX_BYTES = 4 * 2**20
DEFAULT_MAX_FORWARDS = 64


@dataclass(frozen=True)
class _Storage:
    """A preallocated logit buffer and its layout."""

    tensor: torch.Tensor  # (slots, E, N), or (slots, N, E) when tokens_first
    tokens_first: bool  # filled from routers' outputs (N x E) instead of products (E x N)
    # The per-forward views of ``tensor``, made once: unbinding 64 slots at every hand-over
    # cost the training thread ~0.1 ms per router (test bed, CPU).
    slots: tuple[torch.Tensor, ...] = field(init=False, repr=False, compare=False)
    tokens: int = field(init=False)  # N

    def __post_init__(self) -> None:
        object.__setattr__(self, "slots", self.tensor.unbind(0))
        tokens = self.tensor.shape[1] if self.tokens_first else self.tensor.shape[2]
        object.__setattr__(self, "tokens", tokens)

    def fits(self, z: torch.Tensor, tokens_first: bool) -> bool:
        """Can it take a forward of ``tokens_first`` layout with z (N, ...) as input or logits?"""
        t = self.tensor
        return (
            self.tokens_first == tokens_first
            and self.tokens == z.shape[0]
            and t.dtype == z.dtype
            and t.device == z.device
        )

    def experts_first(self, filled: int) -> torch.Tensor:
        """The first ``filled`` forwards, (F, E, N) (a view)."""
        view = self.tensor[:filled]
        return view.transpose(1, 2) if self.tokens_first else view


@dataclass
class HandedBatch:
    """One router's forwards since its previous hand-over, to reduce on another thread."""

    top_k: int
    logits: torch.Tensor | None  # (F, E, N) buffered, not yet reduced (None: none); a view
    sums: torch.Tensor | None  # (5,) of the forwards already reduced (None: none)
    load: torch.Tensor | None  # (E,)
    storage: _Storage | None  # the buffer ``logits`` lives in, to recycle

    def reduce(self) -> torch.Tensor | None:
        """(5 + E,) on the device, as ``RouterLogitBuffer.take``; None: no forward."""
        sums, load = self.sums, self.load
        if self.logits is not None:
            row, part = routing_sums(self.logits.contiguous(), self.top_k)
            sums, load = (row, part) if sums is None or load is None else (sums + row, load + part)
        if sums is None or load is None:
            return None
        return torch.cat([sums, load.to(sums.dtype)])


class RouterLogitBuffer:
    """One router's buffered logits and the running sums of its routing statistics."""

    def __init__(
        self,
        num_experts: int,
        top_k: int,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        max_forwards: int = DEFAULT_MAX_FORWARDS,
    ) -> None:
        self.num_experts, self.top_k = num_experts, top_k
        self.max_bytes, self.max_forwards = max_bytes, max_forwards
        self._storage: _Storage | None = None  # the buffer the hooks write into
        self._spare: _Storage | None = None  # a reduced buffer to swap in at a hand-over
        self._slots: tuple[torch.Tensor, ...] = ()  # the per-forward views of ``_storage``
        self._filled = 0  # slots holding a forward's logits
        self._sums: torch.Tensor | None = None  # (5,) in ROUTING_SUM_FIELDS order, fp32+
        self._load: torch.Tensor | None = None  # (E,) summed load fractions
        # Allocates the CPU logit buffers (shape, dtype) -> tensor: shared files when the
        # reductions run in the monitor process (agent.monitor_process); None: torch.empty.
        self.allocate_cpu: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None

    def add(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Buffer z^T = W x^T + b for x (tokens, d), W [E, d], b [E], at x's precision; x, W
        and b detached (no autograd graph). Runs inside every training forward, with the
        caches cold: as few operations as possible."""
        out = self._next_slot(x, tokens_first=False)  # (E, N), a contiguous view made once
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        if torch.is_autocast_enabled(x.device.type):  # out= keeps the input's dtype anyway
            with torch.autocast(x.device.type, enabled=False):
                _product(w, x, bias, out)
        else:
            _product(w, x, bias, out)
        self._filled_one()

    def add_logits(self, z: torch.Tensor) -> None:
        """Buffer logits z (tokens, E) that the router computed itself, detached, at their
        precision: one copy."""
        self._next_slot(z, tokens_first=True).copy_(z)  # (N, E)
        self._filled_one()

    def flush(self) -> None:
        """Add the buffered forwards' statistics to the running sums (on the device)."""
        if self._storage is None or self._filled == 0:
            return
        logits = self._storage.experts_first(self._filled).contiguous()  # (F, E, N)
        row, load = routing_sums(logits, self.top_k)
        self._filled = 0
        if self._sums is None or self._load is None:
            self._sums, self._load = row, load
        else:
            self._sums.add_(row)
            self._load.add_(load)

    def take(self) -> torch.Tensor | None:
        """The sums since the last call, (5 + E,) on the device: the running sums in
        ``ROUTING_SUM_FIELDS`` order, then the summed load fractions; None when no forward was
        counted. Resets them."""
        self.flush()
        if self._sums is None or self._load is None:
            return None
        row = torch.cat([self._sums, self._load.to(self._sums.dtype)])
        self._sums.zero_()
        self._load.zero_()
        return row

    def hand_over(self) -> HandedBatch:
        """Everything since the last take or hand-over, to reduce elsewhere; the hooks go on in
        the spare buffer (or a new one). Resets the sums."""
        filled, storage = self._filled, self._storage
        batch = HandedBatch(
            self.top_k,
            storage.experts_first(filled) if storage is not None and filled else None,
            self._sums,
            self._load,
            storage,
        )
        self._storage, self._slots = None, ()  # the next forward takes the spare, if any
        self._filled = 0
        self._sums = self._load = None
        return batch

    def recycle(self, batch: HandedBatch) -> None:
        """``batch`` was reduced: its buffer may take forwards again."""
        if batch.storage is not None and self._spare is None:
            self._spare = batch.storage

    def reset(self) -> None:
        """Drop the buffered logits and the sums (the run moved to another state)."""
        self._filled = 0
        self._sums = self._load = None

    def _next_slot(self, z: torch.Tensor, tokens_first: bool) -> torch.Tensor:
        """The slot for the next forward, whose input or logits z is (N, ...)."""
        storage = self._storage
        if storage is None or not storage.fits(z, tokens_first):
            self._new_buffer(z, tokens_first)
        return self._slots[self._filled]

    def _filled_one(self) -> None:
        self._filled += 1
        if self._filled == len(self._slots):
            self.flush()

    def _new_buffer(self, z: torch.Tensor, tokens_first: bool) -> None:
        """Reduce what the current buffer holds and switch to one for forwards like z (N, ...)
        in layout ``tokens_first``: the spare when it fits, else a new one."""
        self.flush()
        spare, self._spare = self._spare, None
        if spare is None or not spare.fits(z, tokens_first):
            tokens, e = z.shape[0], self.num_experts
            per_forward = max(1, tokens * e * z.element_size())
            slots = max(1, min(self.max_forwards, self.max_bytes // per_forward))
            shape = (slots, tokens, e) if tokens_first else (slots, e, tokens)
            if self.allocate_cpu is not None and z.device.type == "cpu":
                tensor = self.allocate_cpu(shape, z.dtype)
            else:
                tensor = torch.empty(shape, dtype=z.dtype, device=z.device)
            spare = _Storage(tensor, tokens_first)
        self._storage = spare
        self._slots = spare.slots


def _product(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    """out (E, N) = W x^T + b, one kernel."""
    if b is None:
        torch.matmul(w, x.t(), out=out)
    else:
        torch.addmm(b.to(x.dtype).unsqueeze(-1), w, x.t(), out=out)
