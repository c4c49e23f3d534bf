"""Relaxing an LR cut that overshot: one bisection step back toward the scale that failed.

A cut is chosen before anyone knows how far is far enough. If it was too little the fault
comes back and the rule cuts again; if it was too much the mechanism is over-damped: the
watched value ends up beyond its pre-onset level on the *other* side. For an MoE router the
healthy routing entropy depends on the router's LR (on the test bed, layer 0 ends at 0.71 of
ln E at the healthy LR and at 0.85-0.89 at 0.3 of it: more uniform than any healthy run).

``OvershootWatch`` is what ``lower_lr`` keeps after a cut with ``relax_above`` set. It watches
the series the incident's evidence names (metric + labels, with the baseline the detector had
learned before the onset). When every one of them stays beyond ``relax_above`` times its
baseline, on the side opposite to the fault (above it for a metric that fell, below
``baseline / relax_above`` for one that rose), for ``relax_for`` read-outs in a row, the cut is
relaxed once: each group's scale becomes the geometric mean of its scale after the cut and its
scale before the cut (half the cut, in log scale). The scale before the cut is the one at which
the fault showed, so the relaxed scale stays strictly below it. One relaxation per cut; a new
cut of the same groups replaces the watch (the fault came back: the old scale was too high).

Everything here is decided from the samples of one evaluation at a step boundary: the same
samples give the same decision on every rank.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from agent.incidents import Evidence
from agent.samples import Sample

SeriesKey = tuple[str, tuple[tuple[str, str], ...]]  # (metric, sorted labels)


@dataclass(frozen=True)
class WatchedSeries:
    """One series of the incident's evidence, with the level it had before the onset."""

    metric: str
    labels: tuple[tuple[str, str], ...]  # sorted (name, value) pairs, as in ``Sample.labels``
    baseline: float  # the detector's pre-onset level (> 0)
    fell: bool  # the fault moved the value below the baseline (True) or above it (False)

    @property
    def key(self) -> SeriesKey:
        return (self.metric, self.labels)

    def threshold(self, ratio: float) -> float:
        """The value beyond which this series counts as over-damped."""
        return self.baseline * ratio if self.fell else self.baseline / ratio

    def beyond(self, value: float, ratio: float) -> bool:
        if not math.isfinite(value):
            return False
        limit = self.threshold(ratio)
        return value > limit if self.fell else value < limit

    def describe(self) -> str:
        labels = ",".join(f"{k}={v}" for k, v in self.labels)
        return f"{self.metric}{{{labels}}}" if labels else self.metric


def watched_series(evidence: Iterable[Evidence]) -> list[WatchedSeries]:
    """The series of ``evidence`` that a relaxation can be judged on: a positive baseline and
    a value that departed from it (metrics without a learned baseline are left out)."""
    out: dict[SeriesKey, WatchedSeries] = {}
    for e in evidence:
        if e.baseline is None or not (e.baseline > 0.0) or not math.isfinite(e.baseline):
            continue
        if not math.isfinite(e.value) or e.value == e.baseline:
            continue
        series = WatchedSeries(
            metric=e.metric,
            labels=tuple(sorted((str(k), str(v)) for k, v in e.labels.items())),
            baseline=float(e.baseline),
            fell=e.value < e.baseline,
        )
        out[series.key] = series
    return list(out.values())


@dataclass
class OvershootWatch:
    """A cut under watch: relax it once if its mechanism settles beyond its pre-onset level."""

    groups: list[int]  # param-group indices the cut scaled
    scale_before: dict[int, float]  # per group: the scale at which the fault showed
    series: list[WatchedSeries]
    ratio: float  # relax_above (> 1)
    needed: int  # relax_for: read-outs in a row
    incident: str | None = None  # the incident id that asked for the cut
    run: int = 0  # consecutive read-outs with every series beyond

    def observe(self, samples: Sequence[Sample]) -> bool:
        """Count a read-out in which every watched series was measured; True = relax now."""
        wanted = {s.key: s for s in self.series}
        latest: dict[SeriesKey, Sample] = {}
        for sample in samples:
            key = (sample.metric, sample.labels)
            if key in wanted and (key not in latest or sample.step >= latest[key].step):
                latest[key] = sample
        if len(latest) < len(wanted):  # not a read-out of every watched series: no verdict
            return False
        if all(wanted[k].beyond(s.value, self.ratio) for k, s in latest.items()):
            self.run += 1
        else:
            self.run = 0
        return self.run >= self.needed

    def relaxed_scales(self, current: dict[int, float]) -> dict[int, float]:
        """Each watched group's new scale: the geometric mean of ``current`` and the scale
        before the cut, never above the scale before the cut."""
        out = {}
        for g in self.groups:
            before = self.scale_before[g]
            now = current.get(g, 1.0)
            out[g] = min(before, math.sqrt(now * before)) if now < before else now
        return out

    def why(self) -> str:
        side = "above" if all(s.fell for s in self.series) else "beyond"
        parts = [
            f"{s.describe()} {side} {s.threshold(self.ratio):.3g} (pre-onset {s.baseline:.3g})"
            for s in self.series
        ]
        return f"{'; '.join(parts)} for {self.needed} read-outs"

    # -- state ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "groups": list(self.groups),
            "scale_before": [[g, s] for g, s in sorted(self.scale_before.items())],
            "series": [
                [s.metric, [list(p) for p in s.labels], s.baseline, s.fell] for s in self.series
            ],
            "ratio": self.ratio,
            "needed": self.needed,
            "incident": self.incident,
            "run": self.run,
        }

    @staticmethod
    def from_dict(d: dict[str, Any]) -> OvershootWatch:
        try:
            watch = OvershootWatch(
                groups=[int(g) for g in d["groups"]],
                scale_before={int(g): float(s) for g, s in d["scale_before"]},
                series=[
                    WatchedSeries(
                        metric=str(m),
                        labels=tuple((str(k), str(v)) for k, v in labels),
                        baseline=float(b),
                        fell=bool(f),
                    )
                    for m, labels, b, f in d["series"]
                ],
                ratio=float(d["ratio"]),
                needed=int(d["needed"]),
                incident=None if d.get("incident") is None else str(d["incident"]),
                run=int(d.get("run", 0)),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"LR relax watch state: malformed entry {d!r}: {exc}") from exc
        if set(watch.groups) - set(watch.scale_before) or not watch.series or watch.ratio <= 1:
            raise ValueError(f"LR relax watch state: inconsistent entry {d!r}")
        return watch
