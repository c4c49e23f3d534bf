"""The kernel audit in a distributed job: every rank audits its own calls, every rank gets the
same samples.

Each rank runs ``KernelAuditProbe`` on its own attention calls (its own batch rows; under
tensor parallelism its own heads). A biased kernel may sit on one rank only (one node with
another kernel build, one faulty device), so the ranks' values are not averaged: at each
exchange step every rank contributes, per layer, the largest value it measured since the
previous exchange, and each layer's sample is the largest over the ranks that measured it,
taken at the exchange step. The values travel in one ``all_gather_object`` of a small dict
(training thread), in the same order on every rank.

Exchange steps depend on the step and ``kernel_audit.every`` only, never on what a rank
measured: the steps where a layer is armed (``step % every == 0``), the step after them
(where an audit armed at t is measured when the loop steps every step) and ``apply_lag``
steps later (where that result arrives from a GPU: ``agent.host_read``). A rank that measured
nothing (its layer was not called, it has stopped auditing) still takes part, with nothing.
A collective that fails raises ``RankFailure`` out of ``agent.step``: the job stops.
"""

from __future__ import annotations

import math
from typing import Any

from agent import samples as m
from agent.distributed.world import World
from agent.kernel_audit_probe import KernelAuditProbe
from agent.samples import Sample, labels_of


class DistributedKernelAuditProbe(KernelAuditProbe):
    """See the module docstring. ``world`` is this rank's ``World``."""

    def __init__(self, *args: Any, world: World, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.world = world
        self._held: dict[str, float] = {}  # layer -> the largest value here since the exchange

    def on_step(self, step: int) -> list[Sample]:
        for sample in super().on_step(step):
            layer = sample.label_dict["layer"]
            self._held[layer] = _larger(self._held.get(layer), sample.value)
        if not self.exchanges_at(step):
            return []
        held, self._held = self._held, {}
        merged: dict[str, float] = {}
        for values in self.world.gather_objects(held):  # RankFailure: the agent stops
            for layer, value in values.items():
                merged[layer] = _larger(merged.get(layer), float(value))
        return [
            Sample(step, m.ATTENTION_BACKWARD_ASYMMETRY, merged[layer], labels_of(layer=layer))
            for layer in sorted(merged)
        ]

    def exchanges_at(self, step: int) -> bool:
        """Whether ``step`` is an exchange step (the same on every rank)."""
        return step % self.every in (0, 1 % self.every, (1 + self.lag) % self.every)

    def restart(self) -> None:
        super().restart()
        self._held.clear()


def _larger(held: float | None, value: float) -> float:
    """The larger of two audit values; nan (a zero gradient) only when nothing else is known."""
    if held is None or math.isnan(held):
        return value
    return held if math.isnan(value) else max(held, value)
