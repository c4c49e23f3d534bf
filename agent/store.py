"""The series store: bounded ring buffers of (step, value) per (metric, labels).

Monitors append from a scheduler thread; the rule engine and the user's logger read on the
training thread. One lock guards everything, and ``extend`` appends a whole batch under it, so
all samples of one monitor evaluation become visible together (the rule engine reduces a step
over all heads of a layer only once, when the step arrives; see agent/rules/engine.py).

Bounds: each series keeps its last ``capacity`` points; at most ``max_series`` series exist.
A sample that would create a series beyond ``max_series`` is dropped (``dropped_samples``
counts them, one warning is issued); existing series keep their data so the rules watching
them are unaffected. Memory is about 100 bytes per point, so the worst case of the defaults
(512 points x 20000 series) is about 1 GB; a run with 32 layers x 32 heads x 8 per-head
metrics uses 8192 series.

>>> from agent.samples import Sample
>>> store = SeriesStore(capacity=3)
>>> store.extend(Sample.make(s, "loss", 1.0 / (s + 1)) for s in range(5))
>>> store.series("loss")
[(2, 0.3333333333333333), (3, 0.25), (4, 0.2)]
"""

from __future__ import annotations

import threading
import uuid
import warnings
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from typing import Any

from agent.rules.matchers import LabelMatcher
from agent.samples import Sample

Labels = tuple[tuple[str, str], ...]  # sorted (key, value) pairs
Point = tuple[int, float]  # (step, value)


def normalize_labels(labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None) -> Labels:
    """A mapping or pairs -> the sorted tuple of (key, str value) pairs samples use."""
    if not labels:
        return ()
    items = labels.items() if isinstance(labels, Mapping) else labels
    return tuple(sorted((str(k), str(v)) for k, v in items))


def flat_name(metric: str, labels: Labels) -> str:
    """``metric{k=v,...}``, or just ``metric`` without labels."""
    if not labels:
        return metric
    return metric + "{" + ",".join(f"{k}={v}" for k, v in labels) + "}"


class _Series:
    __slots__ = ("points", "appended")

    def __init__(self, capacity: int) -> None:
        self.points: deque[Point] = deque(maxlen=capacity)
        self.appended = 0  # points ever appended; the engine's cursor into this series


class SeriesStore:
    """Thread-safe bounded store of metric series (see the module docstring)."""

    def __init__(self, capacity: int = 512, max_series: int = 20_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        if max_series < 1:
            raise ValueError(f"max_series must be >= 1, got {max_series}")
        self.capacity = capacity
        self.max_series = max_series
        # Changes whenever the store is created or replaced by load_state_dict, so readers
        # holding cursors know to start over.
        self.epoch = uuid.uuid4().hex
        self.dropped_samples = 0
        self._lock = threading.Lock()
        self._by_metric: dict[str, dict[Labels, _Series]] = {}
        self._versions: dict[str, int] = {}  # metric -> samples ever appended to it
        self._n_series = 0
        self._warned_full = False

    # ----- writing -----

    def append(self, sample: Sample) -> None:
        self.extend((sample,))

    def extend(self, samples: Iterable[Sample]) -> None:
        """Append a batch atomically: readers see all of it or none of it."""
        batch = list(samples)
        dropped = 0
        with self._lock:
            for sample in batch:
                by_labels = self._by_metric.setdefault(sample.metric, {})
                series = by_labels.get(sample.labels)
                if series is None:
                    if self._n_series >= self.max_series:
                        dropped += 1
                        continue
                    series = by_labels[sample.labels] = _Series(self.capacity)
                    self._n_series += 1
                series.points.append((sample.step, sample.value))
                series.appended += 1
                self._versions[sample.metric] = self._versions.get(sample.metric, 0) + 1
            self.dropped_samples += dropped
            warn = dropped and not self._warned_full
            self._warned_full = self._warned_full or bool(dropped)
        if warn:
            warnings.warn(
                f"SeriesStore is full ({self.max_series} series); dropping samples of new "
                "series. Raise max_series or narrow what the monitors emit.",
                RuntimeWarning,
                stacklevel=2,
            )

    # ----- reading -----

    def series(
        self, metric: str, labels: Mapping[str, Any] | Iterable[tuple[str, Any]] | None = None
    ) -> list[Point]:
        """The kept points of one series, oldest first (empty if unknown)."""
        key = normalize_labels(labels)
        with self._lock:
            series = self._by_metric.get(metric, {}).get(key)
            return list(series.points) if series is not None else []

    def select(
        self, metric: str, matchers: Mapping[str, str] | LabelMatcher | None = None
    ) -> dict[Labels, list[Point]]:
        """Every series of ``metric`` whose labels match (globs or ``~regex``, see matchers)."""
        matcher = (
            matchers if isinstance(matchers, LabelMatcher) else LabelMatcher.from_mapping(matchers)
        )
        with self._lock:
            return {
                labels: list(series.points)
                for labels, series in self._by_metric.get(metric, {}).items()
                if matcher.matches(labels)
            }

    def read_new(
        self,
        metric: str,
        accept: Callable[[Labels], bool],
        cursors: Mapping[Labels, int],
    ) -> tuple[dict[Labels, list[Point]], dict[Labels, int]]:
        """Points appended to accepted series of ``metric`` since ``cursors`` (points ever
        appended, per series, as returned by the previous call). Returns the new points per
        series and the advanced cursors of the series that had new points. Points that the
        ring buffer already overwrote are skipped."""
        new: dict[Labels, list[Point]] = {}
        advanced: dict[Labels, int] = {}
        with self._lock:
            for labels, series in self._by_metric.get(metric, {}).items():
                unseen = series.appended - cursors.get(labels, 0)
                if unseen <= 0 or not accept(labels):
                    continue
                kept = len(series.points)
                new[labels] = list(islice(series.points, max(0, kept - unseen), kept))
                advanced[labels] = series.appended
        return new, advanced

    def version(self, metric: str) -> int:
        """Samples ever appended to ``metric``; unchanged means nothing new arrived."""
        return self._versions.get(metric, 0)

    def latest(self) -> dict[str, float]:
        """``metric{k=v,...}`` -> latest value of every series, for the user's own logger."""
        with self._lock:
            return {
                flat_name(metric, labels): series.points[-1][1]
                for metric, by_labels in self._by_metric.items()
                for labels, series in by_labels.items()
                if series.points
            }

    def metrics(self) -> list[str]:
        with self._lock:
            return sorted(self._by_metric)

    def __len__(self) -> int:
        """Number of series."""
        return self._n_series

    # ----- persistence -----

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable contents (NaN/inf values stay floats)."""
        with self._lock:
            return {
                "epoch": self.epoch,
                "capacity": self.capacity,
                "series": [
                    {
                        "metric": metric,
                        "labels": [list(pair) for pair in labels],
                        "appended": series.appended,
                        "points": [list(point) for point in series.points],
                    }
                    for metric, by_labels in self._by_metric.items()
                    for labels, series in by_labels.items()
                ],
            }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Replace the contents; keeps this store's capacity (older points beyond it drop)."""
        by_metric: dict[str, dict[Labels, _Series]] = {}
        versions: dict[str, int] = {}
        n_series = 0
        for entry in state.get("series", []):
            if n_series >= self.max_series:
                break
            labels = tuple((str(k), str(v)) for k, v in entry["labels"])
            series = _Series(self.capacity)
            series.points.extend((int(s), float(v)) for s, v in entry["points"])
            series.appended = int(entry["appended"])
            by_metric.setdefault(entry["metric"], {})[labels] = series
            versions[entry["metric"]] = versions.get(entry["metric"], 0) + series.appended
            n_series += 1
        with self._lock:
            self._by_metric = by_metric
            self._versions = versions
            self._n_series = n_series
            self.epoch = str(state.get("epoch") or uuid.uuid4().hex)
