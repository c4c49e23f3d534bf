"""Step markers on a column of step-axis panels (fault on, onset, alert, actions, rollbacks,
pages): a vertical line through every panel and a label above the top one whose text never
overlaps another label's.

Labels are written horizontally above the top panel, each joined to its line by a thin
leader: each, in step order, goes as low as it can while its text clears every label's text
already placed (and the panel's title) by a few pixels (boxes measured with the figure's
renderer, so fonts and DPI are accounted for); a leader may cross a lower label. Marks at the
same step share one label, a line each. Save the figure with ``bbox_inches="tight"`` so that
the labels above the panel are kept.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from matplotlib.text import Annotation, Text

if TYPE_CHECKING:
    from matplotlib.artist import Artist
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure
    from matplotlib.transforms import Bbox

GAP_PX = 8.0  # room between two labels, in pixels
LIFT_PT = 3.0  # the lowest labels' distance above the panel, in points
FONTSIZE = 7


@dataclass(frozen=True)
class Mark:
    step: int
    text: str
    color: str
    style: str = "--"  # the vertical line's style


def merge_marks(marks: Sequence[Mark]) -> list[Mark]:
    """One mark per step, in step order: its texts one per line (each once), the first color."""
    by_step: dict[int, list[Mark]] = {}
    for mark in marks:
        by_step.setdefault(mark.step, []).append(mark)
    merged = []
    for step in sorted(by_step):
        group = by_step[step]
        texts = list(dict.fromkeys(m.text for m in group))
        merged.append(Mark(step, "\n".join(texts), group[0].color, group[0].style))
    return merged


def draw_marks(
    axes: Sequence[Axes], marks: Sequence[Mark], avoid: Sequence[Artist] = ()
) -> list[Annotation]:
    """Vertical lines through every panel of ``axes`` and non-overlapping labels above
    ``axes[0]``, clear of the artists in ``avoid`` too (the panel's title). Call it after the
    layout is final (``tight_layout``). Returns the labels."""
    merged = merge_marks(marks)
    for ax in axes:
        for mark in merged:
            ax.axvline(mark.step, color=mark.color, ls=mark.style, lw=0.8)
    top = axes[0]
    renderer = top.figure.canvas.get_renderer()
    points = top.figure.dpi / 72.0  # pixels per point
    panel = top.get_window_extent(renderer)
    placed: list[tuple[float, float, float, float]] = []  # (x0, x1, y0, y1), px above the panel
    for artist in avoid:
        box = (
            text_extent(artist) if isinstance(artist, Text) else artist.get_window_extent(renderer)
        )
        placed.append((box.x0, box.x1, box.y0 - panel.y1, box.y1 - panel.y1))
    labels = []
    x_min, x_max = top.get_xlim()
    for mark in merged:
        if not x_min <= mark.step <= x_max:
            continue
        label = top.annotate(
            mark.text,
            xy=(mark.step, 1.0),
            xycoords=("data", "axes fraction"),
            xytext=(2, LIFT_PT),
            textcoords="offset points",
            ha="left",
            va="bottom",
            fontsize=FONTSIZE,
            color=mark.color,
            annotation_clip=False,
            arrowprops={"arrowstyle": "-", "color": mark.color, "lw": 0.6, "shrinkA": 0},
        )
        box = text_extent(label)
        if box.x1 > panel.x1:  # past the panel's right end: write it leftwards
            label.set_horizontalalignment("right")
            label.set_position((-2, LIFT_PT))
            box = text_extent(label)
        ground = box.y0 - panel.y1  # where the label's box starts at lift 0
        lift = _lowest_free(placed, box.x0, box.x1, ground, box.height)
        placed.append((box.x0, box.x1, ground + lift, ground + lift + box.height))
        label.set_position((label.get_position()[0], LIFT_PT + lift / points))
        labels.append(label)
    return labels


def text_extent(label: Text) -> Bbox:
    """The box of a label's text alone, in pixels (an annotation's own extent includes its
    leader, and its text is positioned only when it is drawn or updated)."""
    renderer = label.figure.canvas.get_renderer()
    if isinstance(label, Annotation):
        label.update_positions(renderer)
    return Text.get_window_extent(label, renderer)


def _lowest_free(
    placed: Sequence[tuple[float, float, float, float]],
    x0: float,
    x1: float,
    ground: float,
    height: float,
) -> float:
    """The lowest lift (pixels, >= 0) at which a box spanning ``x0..x1`` and, unlifted,
    ``ground..ground + height`` clears every placed box by ``GAP_PX`` (a skyline: try the
    ground, then just above each box it would sit over)."""
    over = [b for b in placed if b[0] < x1 + GAP_PX and x0 < b[1] + GAP_PX]
    tops = (b[3] + GAP_PX - ground for b in over)
    for lift in sorted({0.0, *(t for t in tops if t > 0)}):
        bottom, top = ground + lift, ground + lift + height
        if all(top + GAP_PX <= b[2] or bottom >= b[3] + GAP_PX for b in over):
            return lift
    raise AssertionError("unreachable: just above the highest box is always free")


def title_above(figure: Figure, top: Axes, labels: Sequence[Annotation], text: str) -> None:
    """A figure title above the top panel and every label ``draw_marks`` put over it."""
    renderer = figure.canvas.get_renderer()
    highest = max(
        [
            top.get_tightbbox(renderer).y1,
            *(label.get_window_extent(renderer).y1 for label in labels),
        ]
    )
    figure.suptitle(text, y=highest / figure.bbox.height + 0.005, va="bottom")
