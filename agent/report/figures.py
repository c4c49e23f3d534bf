"""The report's figures (matplotlib, Agg backend), returned as PNG bytes.

- ``overview_png``: the loss and the lead mechanism signals (H(Delta_2) per layer, routing
  entropy per router) on one step axis, with the run's events marked: incident onsets and
  openings, first alerts, actions, rollbacks and pages (``agent.report.markers``).
- ``section_pngs``: every monitored series, one panel per metric, grouped by family.

In every panel each place (layer, router) has its colour; the path the run kept is solid, a
path abandoned by a rollback is dashed and faded; an alert on that metric shades its firing
period in its place's colour, draws its baseline (where the detector has one) as a dotted line
from its onset, and marks its onset with a triangle on the step axis.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

from agent.report.markers import Mark, draw_marks, title_above
from agent.report.timeline import RunTimeline, SeriesPath

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.text import Text

OVERVIEW = ("loss", "qk_delta2_entropy", "router_entropy_norm")
SECTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "Attention: per layer, mean over heads",
        (
            "qk_delta2_entropy",
            "qk_delta1_entropy",
            "qk_delta3_entropy",
            "qk_delta2_stable_rank",
            "qk_delta2_frobenius",
            "qk_delta2_persistence",
            "dwq_entropy",
            "dwk_entropy",
            "wq_spectral_norm",
            "wk_spectral_norm",
            "control_update_entropy",
            "control_update_rel_norm",
        ),
    ),
    (
        "Routers: per router",
        (
            "router_entropy_norm",
            "router_entropy",
            "router_entropy_p10",
            "router_eps",
            "router_similarity",
            "router_margin",
            "router_load_max",
            "router_load_entropy",
            "router_dead_experts",
        ),
    ),
    ("Symptoms", ("loss", "grad_norm", "loss_nonfinite", "seconds_since_step")),
)
TITLES = {
    "qk_delta2_entropy": "H(Delta_2): entropy of the QK update spectrum (nats)",
    "qk_delta1_entropy": "H(Delta_1) (nats)",
    "qk_delta3_entropy": "H(Delta_3) (nats)",
    "dwq_entropy": "H(dW_q) (nats)",
    "dwk_entropy": "H(dW_k), mean over KV heads (nats)",
    "control_update_entropy": "H(dW) of the block's other matrices, mean (nats)",
    "control_update_rel_norm": "|dW| / |W| of the block's other matrices, mean",
    "router_entropy_norm": "routing entropy / ln E",
    "loss": "loss (nats)",
    "grad_norm": "gradient norm",
}
DPI = 90


def overview_png(timeline: RunTimeline) -> bytes:
    """The at-a-glance figure (also the report's PNG file)."""
    metrics = [m for m in OVERVIEW if m in timeline.series] or sorted(timeline.series)[:3]
    fig, axes = _figure(len(metrics), 1, height=2.6)
    titles = [_panel(ax, timeline, metric) for ax, metric in zip(axes, metrics, strict=True)]
    axes[-1].set_xlabel("step")
    fig.tight_layout()
    labels = draw_marks(axes, event_marks(timeline), avoid=titles[:1])
    title_above(fig, axes[0], labels, f"mechwatch: run {timeline.run}")
    return _png(fig)


def section_pngs(timeline: RunTimeline) -> list[tuple[str, bytes]]:
    """(section title, PNG) for each section with at least one series in the log."""
    listed = {m for _, metrics in SECTIONS for m in metrics}
    sections = [
        (title, [m for m in metrics if m in timeline.series]) for title, metrics in SECTIONS
    ]
    sections.append(("Other series", sorted(m for m in timeline.series if m not in listed)))
    out = []
    for title, metrics in sections:
        if not metrics:
            continue
        rows = math.ceil(len(metrics) / 2)
        fig, axes = _figure(rows, 2 if len(metrics) > 1 else 1, height=2.3)
        for ax, metric in zip(axes, metrics, strict=False):
            _panel(ax, timeline, metric)
        for ax in axes[len(metrics) :]:
            ax.set_visible(False)
        for ax in axes[-2:]:
            ax.set_xlabel("step")
        fig.tight_layout()
        marks = [
            Mark(r.from_step, f"rollback to {r.to_step}", "saddlebrown", ":")
            for r in timeline.rollbacks
        ]
        for ax in axes[: len(metrics)]:
            for mark in marks:
                ax.axvline(mark.step, color=mark.color, ls=mark.style, lw=0.8)
        out.append((title, _png(fig)))
    return out


def event_marks(timeline: RunTimeline) -> list[Mark]:
    """What the overview marks: incidents (onset, opened, resolved), first firing of each
    rule, applied actions, rollbacks and pages (openings, escalations, repeats)."""
    marks: list[Mark] = []
    for incident in timeline.incidents.values():
        if incident.get("onset_step") is not None:
            marks.append(Mark(int(incident["onset_step"]), "onset", "darkorange", ":"))
    for event in timeline.incident_events:
        if event["event"] in ("opened", "escalated", "resolved"):
            marks.append(Mark(event["step"], f"incident {event['event']}", "crimson"))
    fired: set[str] = set()
    for alert in timeline.alerts:
        if alert.fired_step is not None and alert.rule not in fired:
            fired.add(alert.rule)
            marks.append(Mark(alert.fired_step, f"{alert.rule} fired", "purple"))
    for action in timeline.actions:
        if action.get("status") in ("applied", "dry_run") and action.get("action") != "page":
            verb = " (dry run)" if action.get("status") == "dry_run" else ""
            marks.append(Mark(int(action["step"]), f"{action['action']}{verb}", "green"))
    for rollback in timeline.rollbacks:
        marks.append(Mark(rollback.from_step, f"rolled back to {rollback.to_step}", "saddlebrown"))
    for page in timeline.pages:
        if page.get("event_kind") in ("opened", "escalated", "repeat"):
            marks.append(Mark(int(page["step"]), f"page ({page['event_kind']})", "steelblue", "-."))
    return marks


# ----------------------------------------------------------------------------- drawing


def _figure(rows: int, cols: int, *, height: float) -> tuple[Figure, list[Axes]]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, grid = plt.subplots(
        rows, cols, figsize=(11 if cols > 1 else 10, height * rows), squeeze=False
    )
    axes = [ax for row in grid for ax in row]
    for ax in axes[1:]:
        ax.sharex(axes[0])
    return fig, axes


def _panel(ax: Axes, timeline: RunTimeline, metric: str) -> Text:
    """Draw one metric's panel; returns its title."""
    import matplotlib.pyplot as plt
    from matplotlib.transforms import blended_transform_factory

    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    places = timeline.series.get(metric, {})
    color_of = {place: colors[i % len(colors)] for i, place in enumerate(places)}
    for place, path in places.items():
        draw_path(ax, path, color_of[place], place or metric)
    end = timeline.last_step or 0
    under = blended_transform_factory(ax.transData, ax.transAxes)
    for alert in timeline.alerts:
        if timeline.rule_metrics.get(alert.rule) != metric or alert.place not in color_of:
            continue
        color = color_of[alert.place]
        stop = alert.end_step if alert.end_step is not None else end
        if alert.fired_step is not None:
            ax.axvspan(alert.fired_step, max(stop, alert.fired_step), color=color, alpha=0.12, lw=0)
        start = alert.onset_step if alert.onset_step is not None else alert.pending_step
        if alert.baseline is not None and math.isfinite(alert.baseline):
            ax.hlines(alert.baseline, start, max(stop, start), colors=color, linestyles=":", lw=1.2)
        ax.plot([start], [0.0], marker="^", color=color, ms=6, transform=under, clip_on=False)
    title = ax.set_title(TITLES.get(metric, metric), fontsize=8, loc="left")
    ax.tick_params(labelsize=7)
    if _wide_positive(places.values()):
        ax.set_yscale("log")
    if len(places) > 1 or any(places):
        ax.legend(fontsize=6, loc="best", framealpha=0.6)
    return title


def draw_path(ax: Axes, path: SeriesPath, color: str, label: str) -> None:
    """One series at one place: the kept path solid, each abandoned piece dashed and faded."""
    for piece in path.abandoned:
        steps, values = zip(*piece, strict=True)
        ax.plot(steps, values, color=color, lw=0.9, ls="--", alpha=0.35)
    if path.kept:
        steps, values = zip(*path.kept, strict=True)
        ax.plot(steps, values, color=color, lw=1.0, label=label)


def _wide_positive(paths: Iterable[SeriesPath]) -> bool:
    """Positive values spanning more than 100x: a log scale shows them better."""
    values = [v for p in paths for _, v in p.kept if math.isfinite(v)]
    return bool(values) and min(values) > 0 and max(values) / min(values) > 100


def _png(fig: Figure) -> bytes:
    import matplotlib.pyplot as plt

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
