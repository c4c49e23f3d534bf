"""Learning-rate steps: the schedule as a differential diagnosis (DESIGN.md 1c, issue 13).

A step of the learning rate (a step decay's cut, a warm restart, a hand-set change) changes
every weight's update at once, and the update spectra with it: a cut x0.1 on the test bed
drops layer 0's H(Delta_2) by a third in one evaluation while the update keeps its top
direction (``docs/detection.md``), which is what a biased attention backward looks like too.
The agent holds the optimizer, so it reads the learning rate rather than guessing:

* ``learning_rate_samples(optimizer, step)``: the schedule's learning rate of every parameter
  group, one sample per group (metric ``lr``, label ``group``: the group's ``name`` if it has
  one, else its index), read at the symptom read-outs. The agent's own ``lower_lr`` is left
  out (the schedule's value of a group it scaled): its cut and its later relaxing are not the
  schedule, and a fault that returns after a relaxed cut must still page. A Python float: no
  host-device sync (a tensor ``lr`` on an accelerator is skipped rather than synchronized).
  They go to the event log with the other samples, so ``mechwatch replay`` sees the same
  steps.
* ``ScheduleSteps`` finds the steps in those samples: between two read-outs, *every* group's
  learning rate moved by ``ratio`` (default 2) or more, the same way. A change of one group
  only (a router's learning rate raised on its own) is not a schedule step: it moves one
  mechanism, and is exactly what a router fault can be.

* ``ScheduleAccount`` says which firing mechanism evidence a step explains: its onset lies
  after the last read-out before the step and at most ``lag`` steps after the first read-out
  that showed it, *and* it has not fallen further since. A step of the learning rate shifts
  the update spectra's level once; a fault that begins with it keeps them moving. So each
  explained alert's level is kept (its most extreme value while it fired within the step's
  window, or when it first fired, if later), and the explanation lapses for good once the
  value moves ``1 - lapse`` (a fifth) beyond that level in the alert's direction (Evidence
  ``trend``): a healthy cut x0.1 leaves H(Delta_2) at a new level (1.37, then 1.31-1.59 nats
  on the test bed), an FA fault that starts with it keeps falling (1.02, 0.90, ... 0.79).

The attribution (``agent.attribution``) counts explained evidence as a consequence of the
schedule, like a collapse that follows a loss jump: it stays evidence, names no mechanism and
runs no remedy; alone it opens no incident (a scheduled step is not news). Once its
explanation lapses it is a cause like any other. The price: a fault that begins with a step is
named later, after a further fall (benchmarks/results/detection_schedule_135.md).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from agent.incidents import Evidence
from agent.samples import LEARNING_RATE, Sample

STEP_RATIO = 2.0  # a schedule step: every group's learning rate changed by this factor or more
# Steps after the read-out that showed a schedule step within which a mechanism's onset is its
# consequence: two evaluations of the QK monitor at its default cadence (qk.delta 25), the
# first of which spans the step. The agent sets 2 x qk.delta (``Agent``).
SCHEDULE_LAG = 50
_HISTORY = 64  # schedule steps kept (a warm-restart schedule steps every few thousand steps)
# An explained alert whose value moves this far beyond its level (x0.8 falling, /0.8 rising) is
# no longer the step's doing: the shipped QK rules' clear ratio (0.8), the other way.
LAPSE = 0.8


def learning_rate_samples(optimizer: Any, step: int) -> list[Sample]:
    """One ``lr`` sample per parameter group of ``optimizer`` (see the module docstring)."""
    import torch  # here: the attribution imports this module, and needs no torch

    from remediations.lr import SCHEDULED_LR_KEY

    out = []
    for index, group in enumerate(getattr(optimizer, "param_groups", ())):
        lr = group.get(SCHEDULED_LR_KEY, group.get("lr"))  # without lower_lr's own scale
        if isinstance(lr, torch.Tensor):
            if lr.device.type != "cpu" or lr.numel() != 1:
                continue  # reading it would synchronize with the device
            lr = lr.item()
        if not isinstance(lr, (int, float)) or not math.isfinite(lr):
            continue
        name = group.get("name")
        label = name if isinstance(name, str) and name else str(index)
        out.append(Sample.make(step, LEARNING_RATE, float(lr), group=label))
    return out


@dataclass(frozen=True)
class ScheduleStep:
    """Every group's learning rate moved by ``ratio`` (new / old; inf from a zero learning
    rate) between the read-outs at ``before`` and ``at``."""

    before: int
    at: int
    ratio: float

    def explains(self, onset: int, lag: int) -> bool:
        """Whether a change that began at ``onset`` falls in this step's window."""
        return self.before < onset <= self.at + lag


def _log_ratio(old: float, new: float) -> float:
    if old <= 0.0 or new <= 0.0:
        return 0.0 if old == new else (math.inf if new > old else -math.inf)
    return math.log(new / old)


class ScheduleSteps:
    """The schedule steps seen in ``lr`` samples so far (module docstring)."""

    def __init__(self, ratio: float = STEP_RATIO) -> None:
        if not ratio > 1.0:
            raise ValueError(f"a schedule step's ratio must be above 1, got {ratio}")
        self.threshold = math.log(ratio) - 1e-9  # x2 in floating point is a step of x2
        self.last: dict[str, tuple[int, float]] = {}  # group -> (step, lr) of its last read-out
        self.steps: list[ScheduleStep] = []

    def observe(self, samples: list[Sample]) -> None:
        """Take the ``lr`` samples of one decision round."""
        now: dict[str, tuple[int, float]] = {}
        for s in samples:
            if s.metric == LEARNING_RATE:
                now[s.label_dict.get("group", "")] = (s.step, s.value)
        if not now:
            return
        at = max(step for step, _ in now.values())
        if any(step <= self.last.get(g, (-1, 0.0))[0] for g, (step, _) in now.items()):
            self.last = {}  # the run went back (a rollback): compare from here on
        shared = [g for g in now if g in self.last]
        if shared and len(shared) == len(now) == len(self.last):
            logs = [_log_ratio(self.last[g][1], now[g][1]) for g in shared]
            up = all(x >= self.threshold for x in logs)
            down = all(x <= -self.threshold for x in logs)
            if up or down:
                before = max(self.last[g][0] for g in shared)
                smallest = min(logs, key=abs)
                self.steps = [*self.steps, ScheduleStep(before, at, math.exp(smallest))][-_HISTORY:]
        self.last = now

    def explaining(self, onset: int, lag: int) -> ScheduleStep | None:
        """The schedule step whose window holds ``onset``, if any."""
        return next((s for s in reversed(self.steps) if s.explains(onset, lag)), None)

    def state_dict(self) -> dict[str, Any]:
        return {
            "last": {g: list(v) for g, v in self.last.items()},
            "steps": [asdict(s) for s in self.steps],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.last = {g: (int(v[0]), float(v[1])) for g, v in state.get("last", {}).items()}
        self.steps = [ScheduleStep(**s) for s in state.get("steps", [])]


def evidence_key(e: Evidence) -> str:
    """``Evidence.key`` as a string: the form the saved state keeps (JSON object keys)."""
    return e.rule + "|" + ",".join(f"{k}={v}" for k, v in sorted(e.labels.items()))


class ScheduleAccount:
    """Which firing mechanism evidence the schedule's steps explain (module docstring).
    ``observe`` every round's samples, ``track`` every round's firing evidence, then ask
    ``explaining``."""

    def __init__(self, lag: int = SCHEDULE_LAG, lapse: float = LAPSE) -> None:
        if not 0.0 < lapse < 1.0:
            raise ValueError(f"lapse must be in (0, 1), got {lapse}")
        self.lag = lag
        self.lapse = lapse
        self.steps = ScheduleSteps()
        # evidence key -> (the explaining step's ``at``, the alert's level after that step)
        self.levels: dict[str, tuple[int, float]] = {}
        # evidence key -> the ``at`` of the step that no longer explains it (a later step of
        # a step decay may explain the same alert afresh)
        self.lapsed: dict[str, int] = {}

    def observe(self, samples: list[Sample]) -> None:
        self.steps.observe(samples)

    def _step_of(self, e: Evidence) -> ScheduleStep | None:
        onset = e.onset_step if e.onset_step is not None else e.fired_step
        return self.steps.explaining(onset, self.lag)

    def track(self, step: int, firing: list[Evidence]) -> None:
        """One round's firing evidence: keep the levels, find the lapses."""
        for e in firing:
            key = evidence_key(e)
            stepped = self._step_of(e)
            if stepped is None or e.trend not in ("falling", "rising"):
                continue
            if self.lapsed.get(key) == stepped.at:
                continue
            sign = 1.0 if e.trend == "falling" else -1.0  # the alert's direction
            at, level = self.levels.get(key, (None, None))
            if at != stepped.at or level is None:  # first seen since this step
                self.levels[key] = (stepped.at, e.value)
            elif step <= stepped.at + self.lag:  # within the step's window
                self.levels[key] = (at, sign * min(sign * level, sign * e.value))
            else:
                beyond = level * self.lapse if sign > 0 else level / self.lapse
                if level > 0 and sign * e.value < sign * beyond:
                    self.lapsed[key] = stepped.at

    def explaining(self, e: Evidence) -> ScheduleStep | None:
        """The schedule step that explains ``e``, if one does (not lapsed)."""
        stepped = self._step_of(e)
        return None if stepped is None or self._lapsed(e, stepped) else stepped

    def has_lapsed(self, e: Evidence) -> bool:
        """Whether the step that explained ``e`` no longer does."""
        stepped = self._step_of(e)
        return stepped is not None and self._lapsed(e, stepped)

    def _lapsed(self, e: Evidence, stepped: ScheduleStep) -> bool:
        return self.lapsed.get(evidence_key(e)) == stepped.at

    def state_dict(self) -> dict[str, Any]:
        return {
            **self.steps.state_dict(),
            "levels": {k: list(v) for k, v in self.levels.items()},
            "lapsed": dict(self.lapsed),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.steps.load_state_dict(state)
        self.levels = {k: (int(v[0]), float(v[1])) for k, v in state.get("levels", {}).items()}
        self.lapsed = {k: int(v) for k, v in state.get("lapsed", {}).items()}
