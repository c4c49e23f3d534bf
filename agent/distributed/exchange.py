"""The read-out exchange: what each rank contributes at a read-out step, and the one list of
samples every rank gets back from it.

At a read-out step every rank packs its local values into one float64 vector laid out by
``Layout`` (the same on every rank: it depends only on the step and the configuration):

    header   step, now (unix s), symptoms flag, router flag      (NOT_DUE, OK or FAILED)
    symptoms 6 fields x ``every`` slots, slot i = step - every + 1 + i:
             loss sum, loss count, given grad-norm sum, its count,
             this rank's share of the squared grad norm, its count
    routers  per router: its running sums and summed load (``RouterProbe.take``), then the
             weight statistics eps, similarity and relative update, and the step they
             describe (-1: none here)

The vectors are gathered (one ``all_gather``; at a QK apply step they travel in the
``all_gather_object`` that carries the QK samples) and ``merge`` turns the (world, K) matrix
into samples, in float64 and in rank order, so the result is bitwise the same on every rank:

- loss: the mean over the ranks' values of each step (a NaN or inf on one rank gives a NaN or
  inf mean: ``loss_nonfinite`` fires everywhere);
- grad norm: the mean of the values given to ``agent.step`` (a global norm), else the square
  root of the summed shares (each rank's squared norm divided by how many ranks hold the same
  values: DDP's replicas, FSDP's shards); only when every rank contributed;
- router sums and loads: summed over the ranks (each rank routes its own tokens); the weight
  statistics come from the rank assigned the router;
- QK samples: every rank's own heads, concatenated in rank order.

A part that failed on a rank is flagged (FAILED) and left out of the merge on every rank;
``ReadOutNotes`` names the ranks involved (failures, non-finite losses, each rank's loss).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from agent import samples as m
from agent.discovery import RouterSite
from agent.router_probe import WEIGHT_STATS, router_samples
from agent.samples import Sample
from agent.step_inputs import Scalar

HEADER = 4
NOT_DUE, OK, FAILED = 0.0, 1.0, 2.0
SYMPTOM_FIELDS = 6
LOSS_SUM, LOSS_COUNT, GIVEN_SUM, GIVEN_COUNT, SQUARE_SUM, SQUARE_COUNT = range(SYMPTOM_FIELDS)
ROUTER_SUMS = 5  # agent.probes: running sums kept per router


@dataclass(frozen=True)
class Layout:
    """Where each part lives in a rank's vector (see the module docstring)."""

    step: int
    every: int  # symptom slots
    experts: tuple[int, ...]  # E of each router
    symptoms: bool  # symptoms due at this step
    routers: bool  # router read-out due at this step

    def router_width(self, j: int) -> int:
        return ROUTER_SUMS + self.experts[j] + WEIGHT_STATS + 1  # sums, load, stats, step

    @property
    def symptoms_at(self) -> int:
        return HEADER

    @property
    def routers_at(self) -> int:
        return HEADER + (SYMPTOM_FIELDS * self.every if self.symptoms else 0)

    @property
    def size(self) -> int:
        widths = sum(self.router_width(j) for j in range(len(self.experts)))
        return self.routers_at + (widths if self.routers else 0)

    def slot(self, step: int) -> int | None:
        i = step - (self.step - self.every + 1)
        return i if 0 <= i < self.every else None


def pack_values(size: int, entries: list[tuple[int, Scalar]], device: torch.device) -> torch.Tensor:
    """A float64 vector of ``size`` with each ``(position, value)`` added in; a tensor of n
    elements fills positions position .. position + n - 1. Device tensors stay on the device
    until the gather (no host sync here on CUDA)."""
    out = torch.zeros(size, dtype=torch.float64, device=device)
    tensors = [(i, v.detach().reshape(-1)) for i, v in entries if isinstance(v, torch.Tensor)]
    floats = [(i, float(v)) for i, v in entries if not isinstance(v, torch.Tensor)]
    if tensors:
        index = torch.cat([torch.arange(i, i + v.numel()) for i, v in tensors]).to(device)
        values = torch.cat([v.to(device=device, dtype=torch.float64) for _, v in tensors])
        out.index_add_(0, index, values)
    if floats:
        index = torch.tensor([i for i, _ in floats], dtype=torch.long, device=device)
        values = torch.tensor([v for _, v in floats], dtype=torch.float64, device=device)
        out.index_add_(0, index, values)
    return out


@dataclass
class ReadOutNotes:
    """Which ranks a read-out involved: for the page (``text``) and the event log."""

    first: int  # the symptom window, first step
    last: int
    world: int
    failed: dict[int, list[str]] = field(default_factory=dict)  # rank -> parts that failed
    nonfinite: list[int] = field(default_factory=list)  # ranks with a non-finite loss
    loss: list[float | None] = field(default_factory=list)  # each rank's mean loss

    def text(self) -> str:
        parts = []
        if self.nonfinite:
            parts.append(f"non-finite loss on rank {_ranks(self.nonfinite)}")
        for rank, what in sorted(self.failed.items()):
            parts.append(f"rank {rank}: {', '.join(what)} failed")
        known = [(v, r) for r, v in enumerate(self.loss) if v is not None]
        if known:  # highest first (non-finite first of all)
            shown = sorted(known, key=lambda x: -x[0] if math.isfinite(x[0]) else -math.inf)
            each = ", ".join(f"rank {r} {v:.4g}" for v, r in shown[: 8 if len(shown) <= 8 else 3])
            parts.append(
                f"local loss over steps {self.first}-{self.last}: {each}"
                + (f" (highest 3 of {len(known)})" if len(known) > 8 else "")
            )
        return "; ".join(parts)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def merge(
    gathered: torch.Tensor,
    layout: Layout,
    routers: list[RouterSite],
    qk: list[list[Sample]] | None = None,
) -> tuple[list[Sample], float, ReadOutNotes]:
    """Samples, rank 0's clock and the notes from the gathered (world, K) float64 matrix."""
    rows = gathered.double().cpu().tolist()
    now = rows[0][1]
    notes = ReadOutNotes(layout.step - layout.every + 1, layout.step, len(rows))
    for rank, row in enumerate(rows):
        failed = [w for w, flag in (("symptoms", row[2]), ("router", row[3])) if flag == FAILED]
        if failed:
            notes.failed[rank] = failed
    out: list[Sample] = []
    if layout.symptoms:
        out += _symptoms(rows, layout, notes)
    if layout.routers:
        out += _routers(rows, layout, routers)
    if qk is not None:
        seen: set[tuple] = set()
        for samples in qk:  # rank order; a KV head measured by two ranks counts once
            for s in samples:
                key = (s.step, s.metric, s.labels)
                if key not in seen:
                    seen.add(key)
                    out.append(s)
    return out, now, notes


def _symptoms(rows: list[list[float]], layout: Layout, notes: ReadOutNotes) -> list[Sample]:
    every, at = layout.every, layout.symptoms_at
    ok = [row for row in rows if row[2] == OK]

    def field_sum(f: int, slot: int, among: list[list[float]]) -> float:
        return math.fsum(row[at + f * every + slot] for row in among)

    losses, grads = [], []
    for slot in range(every):
        step = layout.step - every + 1 + slot
        count = field_sum(LOSS_COUNT, slot, ok)
        if count > 0:
            v = sum(row[at + LOSS_SUM * every + slot] for row in ok) / count  # NaN stays NaN
            losses += [
                Sample.make(step, m.LOSS, v),
                Sample.make(step, m.LOSS_NONFINITE, 0.0 if math.isfinite(v) else 1.0),
            ]
        given = field_sum(GIVEN_COUNT, slot, ok)
        if given > 0:
            v = sum(row[at + GIVEN_SUM * every + slot] for row in ok) / given
            grads.append(Sample.make(step, m.GRAD_NORM, v))
        elif len(ok) == len(rows) and field_sum(SQUARE_COUNT, slot, ok) == len(rows):
            square = sum(row[at + SQUARE_SUM * every + slot] for row in ok)
            grads.append(Sample.make(step, m.GRAD_NORM, math.sqrt(square)))
    for rank, row in enumerate(rows):
        total = sum(row[at + LOSS_SUM * every : at + (LOSS_SUM + 1) * every])
        count = sum(row[at + LOSS_COUNT * every : at + (LOSS_COUNT + 1) * every])
        notes.loss.append(total / count if count > 0 and row[2] == OK else None)
        if count > 0 and not math.isfinite(total):
            notes.nonfinite.append(rank)
    return losses + grads


def _routers(rows: list[list[float]], layout: Layout, routers: list[RouterSite]) -> list[Sample]:
    out: list[Sample] = []
    ok = [row for row in rows if row[3] == OK]
    at = layout.routers_at
    for j, site in enumerate(routers):
        width = layout.router_width(j)
        stats_at = width - 1 - WEIGHT_STATS
        sums = [sum(row[at + i] for row in ok) for i in range(stats_at)]
        stats = next(
            (
                (int(row[at + width - 1]), *row[at + stats_at : at + width - 1])
                for row in ok
                if row[at + width - 1] >= 0
            ),
            None,
        )
        out += router_samples(layout.step, site, sums, stats)
        at += width
    return out
