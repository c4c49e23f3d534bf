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

Off the training thread: ``hand_over()`` gives the buffered forwards and sums to a
``HandedBatch`` that the monitor thread reduces (``HandedBatch.reduce``), while the hooks go on
writing into a second buffer; the first one is reused once the batch was reduced
(``recycle``). The training thread then pays only the product per forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from agent.monitors.router import routing_sums

DEFAULT_MAX_BYTES = 4 * 2**20
DEFAULT_MAX_FORWARDS = 64


@dataclass
class HandedBatch:
    """One router's forwards since its previous hand-over, to reduce on another thread."""

    top_k: int
    logits: torch.Tensor | None  # (F, E, N) buffered, not yet reduced (None: none)
    sums: torch.Tensor | None  # (5,) of the forwards already reduced (None: none)
    load: torch.Tensor | None  # (E,)
    storage: torch.Tensor | None  # the buffer ``logits`` lives in, to recycle

    def reduce(self) -> torch.Tensor | None:
        """(5 + E,) on the device, as ``RouterLogitBuffer.take``; None: no forward."""
        sums, load = self.sums, self.load
        if self.logits is not None:
            row, part = routing_sums(self.logits, self.top_k)
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
        self._logits: torch.Tensor | None = None  # (slots, E, N) at the input's precision
        self._spare: torch.Tensor | None = None  # a reduced buffer to swap in at a hand-over
        self._slots: list[torch.Tensor] = []  # the (E, N) views of ``_logits``, one per slot
        self._filled = 0  # slots holding a forward's logits
        self._sums: torch.Tensor | None = None  # (5,) in ROUTING_SUM_FIELDS order, fp32+
        self._load: torch.Tensor | None = None  # (E,) summed load fractions

    def add(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        """Buffer z^T = W x^T + b for x (tokens, d), W [E, d], b [E], at x's precision; x, W
        and b detached (no autograd graph). Runs inside every training forward, with the
        caches cold: as few operations as possible."""
        slots = self._slots
        if not slots or not _fits(self._logits, x):
            slots = self._new_buffer(x)
        out = slots[self._filled]  # (E, N), a contiguous view made once
        w = weight if weight.dtype == x.dtype else weight.to(x.dtype)
        if torch.is_autocast_enabled(x.device.type):  # out= keeps the input's dtype anyway
            with torch.autocast(x.device.type, enabled=False):
                _product(w, x, bias, out)
        else:
            _product(w, x, bias, out)
        self._filled += 1
        if self._filled == len(slots):
            self.flush()

    def flush(self) -> None:
        """Add the buffered forwards' statistics to the running sums (on the device)."""
        if self._logits is None or self._filled == 0:
            return
        row, load = routing_sums(self._logits[: self._filled], self.top_k)
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
        filled, storage = self._filled, self._logits
        batch = HandedBatch(
            self.top_k,
            storage[:filled] if storage is not None and filled else None,
            self._sums,
            self._load,
            storage,
        )
        self._logits, self._slots = None, []  # the next forward takes the spare, if any
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

    def _new_buffer(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Reduce what the current buffer holds and switch to one for forwards like ``x``:
        the spare when it fits, else a new one; returns its slots, (E, N) views."""
        self.flush()
        spare, self._spare = self._spare, None
        if spare is None or not _fits(spare, x):
            tokens = x.shape[0]
            per_forward = max(1, tokens * self.num_experts * x.element_size())
            slots = max(1, min(self.max_forwards, self.max_bytes // per_forward))
            spare = torch.empty((slots, self.num_experts, tokens), dtype=x.dtype, device=x.device)
        self._logits = spare
        self._slots = list(spare.unbind(0))
        return self._slots


def _fits(buffer: torch.Tensor | None, x: torch.Tensor) -> bool:
    """Can ``buffer`` (slots, E, N) take the logits of a forward with input x (N, d)?"""
    return (
        buffer is not None
        and buffer.shape[2] == x.shape[0]
        and buffer.dtype == x.dtype
        and buffer.device == x.device
    )


def _product(w: torch.Tensor, x: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor) -> None:
    """out (E, N) = W x^T + b, one kernel."""
    if b is None:
        torch.matmul(w, x.t(), out=out)
    else:
        torch.addmm(b.to(x.dtype).unsqueeze(-1), w, x.t(), out=out)
