"""A run's event log (docs/events.md) as the timeline a report draws: every monitored series
per place, alert episodes, incidents, actions, rollbacks and pages. No plotting here.

Places: a series is drawn per layer or router: the labels ``head``, ``kv_head`` and ``param``
(query heads, KV heads, a block's control matrices) are averaged away at each step, the other
labels name the place (``blocks.0.attn``; "" for run-wide series such as the loss). An alert's
labels name its place the same way.

Rollbacks: after a rollback the run goes back to an earlier step and the steps after it are
abandoned. The log is read in order; each applied action that restores the run (``restores_run``)
ends a *segment*. A segment's points after the step that a later rollback went back to are the
abandoned path (drawn faded); the rest, and the last segment, are the path the run kept.

Only the last agent start of a log counts (a run directory used twice keeps both runs).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.eventlog import last_run, read_events

AVERAGED_LABELS = frozenset({"head", "kv_head", "param"})
Points = list[tuple[int, float]]  # (step, value), sorted by step


def place_of(labels: Mapping[str, str]) -> str:
    """The place a sample or an alert belongs to: its labels but the averaged ones."""
    kept = [str(v) for k, v in sorted(labels.items()) if k not in AVERAGED_LABELS]
    return ", ".join(kept)


@dataclass
class SeriesPath:
    """One series at one place: the path the run kept and the abandoned pieces."""

    kept: Points = field(default_factory=list)
    abandoned: list[Points] = field(default_factory=list)  # one piece per rolled-back segment


@dataclass
class Rollback:
    from_step: int  # the step the run was at
    to_step: int  # the checkpoint's step it went back to
    index: int  # position in the event log (orders it among the other records)


@dataclass
class AlertEpisode:
    """One alert from pending to resolved (or cancelled, or still open at the end)."""

    rule: str
    labels: dict[str, str]
    pending_step: int
    fired_step: int | None = None
    fired_index: int | None = None  # positions in the event log (time order across rollbacks)
    end_index: int | None = None
    end_step: int | None = None  # resolved or cancelled; None: open at the end of the log
    cancelled: bool = False
    value: float | None = None  # at its latest transition
    baseline: float | None = None
    onset_step: int | None = None

    @property
    def place(self) -> str:
        return place_of(self.labels)


@dataclass
class RunTimeline:
    run: str = "run"
    attention_layers: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    rules: list[str] = field(default_factory=list)
    series: dict[str, dict[str, SeriesPath]] = field(default_factory=dict)  # metric -> place
    rollbacks: list[Rollback] = field(default_factory=list)
    alerts: list[AlertEpisode] = field(default_factory=list)
    rule_metrics: dict[str, str] = field(default_factory=dict)  # rule -> metric, where known
    incidents: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> latest snapshot
    incident_events: list[dict[str, Any]] = field(default_factory=list)  # step, event, id, ...
    actions: list[dict[str, Any]] = field(default_factory=list)  # action records, with "index"
    pages: list[dict[str, Any]] = field(default_factory=list)  # the log's page records
    errors: list[dict[str, Any]] = field(default_factory=list)  # the agent's own failures
    evaluations: int = 0  # metrics records read
    first_step: int | None = None
    last_step: int | None = None


def read_timeline(events_path: str | Path) -> RunTimeline:
    """The timeline of the last run recorded in ``events_path``."""
    return build_timeline(last_run(read_events(Path(events_path))))


def build_timeline(events: Iterable[dict[str, Any]]) -> RunTimeline:
    timeline = RunTimeline()
    # metric -> place -> segment -> step -> values (averaged per step)
    raw: dict[str, dict[str, dict[int, dict[int, list[float]]]]] = defaultdict(
        lambda: defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    )
    open_alerts: dict[tuple[str, tuple[tuple[str, str], ...]], AlertEpisode] = {}
    segment = 0
    for index, e in enumerate(events):
        kind = e.get("kind")
        if kind == "start":
            timeline.run = str(e.get("run", timeline.run))
            timeline.attention_layers = list(e.get("attention_layers") or [])
            timeline.routers = list(e.get("routers") or [])
            timeline.rules = list(e.get("rules") or [])
        elif kind == "metrics":
            timeline.evaluations += 1
            for step, metric, labels, value in e.get("samples", []):
                raw[metric][place_of(labels)][segment][int(step)].append(_float(value))
                timeline.first_step = _min(timeline.first_step, int(step))
                timeline.last_step = _max(timeline.last_step, int(step))
        elif kind == "alert":
            _alert(e, index, open_alerts, timeline)
        elif kind == "incident":
            _incident(e, index, timeline)
        elif kind == "action":
            timeline.actions.append({**e, "index": index})
            after, before = e.get("after") or {}, e.get("before") or {}
            if e.get("restores_run") and e.get("status") == "applied":
                if isinstance(after.get("step"), int) and isinstance(before.get("step"), int):
                    timeline.rollbacks.append(Rollback(before["step"], after["step"], index))
                    segment += 1
        elif kind == "page":
            timeline.pages.append(e)
        elif kind == "error":
            timeline.errors.append(e)
    timeline.alerts.sort(key=lambda a: (a.pending_step, a.rule))
    limits = _segment_limits([r.to_step for r in timeline.rollbacks])
    for metric, places in raw.items():
        timeline.series[metric] = {
            place: _path(segments, limits) for place, segments in sorted(places.items())
        }
    return timeline


def _segment_limits(restored: list[int]) -> list[float]:
    """For each segment, the last step of it the run kept: the lowest step any later rollback
    went back to (the last segment keeps everything)."""
    limits = [math.inf] * (len(restored) + 1)
    lowest = math.inf
    for i in range(len(restored) - 1, -1, -1):
        lowest = min(lowest, restored[i])
        limits[i] = lowest
    return limits


def _path(segments: Mapping[int, Mapping[int, list[float]]], limits: list[float]) -> SeriesPath:
    path = SeriesPath()
    for seg in sorted(segments):
        points = [(s, sum(v) / len(v)) for s, v in sorted(segments[seg].items())]
        limit = limits[seg] if seg < len(limits) else math.inf
        path.kept += [p for p in points if p[0] <= limit]
        gone = [p for p in points if p[0] > limit]
        if gone:
            path.abandoned.append(gone)
    path.kept.sort()
    return path


def _alert(e: Mapping[str, Any], index: int, open_alerts: dict, timeline: RunTimeline) -> None:
    labels = {str(k): str(v) for k, v in (e.get("labels") or {}).items()}
    key = (str(e.get("rule")), tuple(sorted(labels.items())))
    transition = str(e.get("transition", ""))
    step = int(e.get("step", 0))
    episode = open_alerts.get(key)
    if transition.startswith("inactive->") or episode is None:
        episode = AlertEpisode(key[0], labels, step)
        open_alerts[key] = episode
        timeline.alerts.append(episode)
    if transition.endswith("->firing"):
        episode.fired_step, episode.fired_index = step, index
    elif transition.endswith("->inactive"):
        episode.end_step, episode.end_index = step, index
        episode.cancelled = transition.startswith("pending")
        del open_alerts[key]
    episode.value = _float(e.get("value"))
    episode.baseline = _float(e.get("baseline"))
    episode.onset_step = e.get("onset_step", episode.onset_step)


def _incident(e: Mapping[str, Any], index: int, timeline: RunTimeline) -> None:
    incident = e.get("incident") or {}
    incident_id = str(incident.get("id", "?"))
    timeline.incidents[incident_id] = incident
    for evidence in incident.get("evidence") or []:
        timeline.rule_metrics.setdefault(str(evidence.get("rule")), str(evidence.get("metric")))
    timeline.incident_events.append(
        {
            "index": index,
            "step": int(e.get("step", 0)),
            "event": e.get("event"),
            "id": incident_id,
            "family": incident.get("family"),
            "message": e.get("message", ""),
        }
    )


def _float(value: Any) -> float | None:
    """A logged number ("nan", "inf", "-inf" are written as strings); None stays None."""
    return None if value is None else float(value)


def _min(a: int | None, b: int) -> int:
    return b if a is None else min(a, b)


def _max(a: int | None, b: int) -> int:
    return b if a is None else max(a, b)
