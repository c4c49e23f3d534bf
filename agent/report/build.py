"""``mechwatch report RUN_DIR``: build the report of a run from its event log.

    mechwatch report runs/llama-7b-moe            # -> runs/llama-7b-moe/report.html (+ .png)
    mechwatch report runs/x/events.jsonl --out /tmp/x.html --png /tmp/x.png

The HTML is self-contained (``agent.report.html``); the PNG is the report's overview figure,
for a chat message or a slide.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

from agent.report.figures import overview_png, section_pngs
from agent.report.html import render_html
from agent.report.timeline import read_timeline

EVENTS_FILE = "events.jsonl"


@dataclass(frozen=True)
class ReportFiles:
    html: Path
    png: Path


def events_file(run: str | Path) -> Path:
    """A run directory's event log (or the log itself when given one)."""
    path = Path(run)
    return path / EVENTS_FILE if path.is_dir() else path


def build_report(
    run: str | Path, html_path: str | Path | None = None, png_path: str | Path | None = None
) -> ReportFiles:
    """Write the report of the run in ``run`` (a run directory or its ``events.jsonl``).
    Defaults: ``report.html`` and ``report.png`` next to the event log."""
    events = events_file(run)
    if not events.is_file():
        raise FileNotFoundError(f"no event log at {events}")
    timeline = read_timeline(events)
    html_path = Path(html_path) if html_path is not None else events.parent / "report.html"
    png_path = Path(png_path) if png_path is not None else html_path.with_suffix(".png")
    overview = overview_png(timeline) if timeline.series else b""
    sections = section_pngs(timeline)
    html_path.parent.mkdir(parents=True, exist_ok=True)
    html_path.write_text(render_html(timeline, overview, sections, str(events)), encoding="utf-8")
    if overview:
        png_path.parent.mkdir(parents=True, exist_ok=True)
        png_path.write_bytes(overview)
    return ReportFiles(html_path, png_path)


def cli_report(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="mechwatch report",
        description="Write a self-contained HTML report (and a PNG) of a run from its event log.",
    )
    parser.add_argument("run", type=Path, help="a run directory, or its events.jsonl")
    parser.add_argument(
        "--out", type=Path, default=None, help="the HTML file (RUN_DIR/report.html)"
    )
    parser.add_argument("--png", type=Path, default=None, help="the PNG file (next to the HTML)")
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        files = build_report(args.run, args.out, args.png)
    except FileNotFoundError as e:
        print(f"mechwatch report: {e}", file=sys.stderr)
        return 2
    print(f"report: {files.html}")
    if files.png.exists():
        print(f"figure: {files.png}")
    return 0
