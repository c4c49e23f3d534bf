"""The report page: one self-contained HTML file. Styles are inline, figures are embedded as
base64 PNG ``data:`` URIs, and there is no script, font, link or any other external asset, so
the file can be mailed, attached to a ticket or opened offline. Every text from the event log
is HTML-escaped.

Sections: the run at a glance; incidents (family, confidence, onset, evidence with its
baselines, what stayed quiet, suggested fixes); the overview figure; the timeline of alerts,
incident events, actions (in words: ``agent.notify.action_text``) and rollbacks; one figure
per family of series; the pages as they were sent; the agent's own errors.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from html import escape
from typing import Any

from agent.notify.action_text import action_sentence
from agent.report.timeline import RunTimeline, place_of

STYLE = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; margin: 2em auto;
       max-width: 1180px; color: #222; line-height: 1.4; }
h1 { font-size: 1.5em; } h2 { font-size: 1.2em; margin-top: 2em; border-bottom: 1px solid #ddd; }
table { border-collapse: collapse; font-size: 0.85em; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 3px 7px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; }
img { max-width: 100%; border: 1px solid #eee; }
pre { background: #f7f7f7; padding: 0.6em; font-size: 0.8em; white-space: pre-wrap; }
.family { font-weight: bold; } .muted { color: #777; }
.fa_precision { color: #b8430b; } .router_instability { color: #1f5fa8; }
.combined { color: #7a1fa8; } .unattributed { color: #555; }
"""


def render_html(
    timeline: RunTimeline,
    overview: bytes,
    sections: Sequence[tuple[str, bytes]],
    source: str,
) -> str:
    """The whole page."""
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>mechwatch report: {escape(timeline.run)}</title>",
        f"<style>{STYLE}</style></head><body>",
        f"<h1>mechwatch report: run {escape(timeline.run)}</h1>",
        _glance(timeline, source),
        "<h2>Incidents</h2>",
        _incidents(timeline),
        "<h2>Overview</h2>",
        _figure(overview, "the loss and the lead mechanism signals, with the run's events"),
        "<h2>Timeline</h2>",
        _timeline(timeline),
    ]
    for title, png in sections:
        parts += [f"<h2>{escape(title)}</h2>", _figure(png, title)]
    parts += ["<h2>Pages</h2>", _pages(timeline)]
    if timeline.errors:
        parts += ["<h2>The agent's own errors</h2>", _errors(timeline)]
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def png_data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def _figure(png: bytes, alt: str) -> str:
    return f'<p><img src="{png_data_uri(png)}" alt="{escape(alt)}"></p>'


def _table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{cell}</td>" for cell in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _text(value: Any) -> str:
    """A value from the log as escaped text ("" for None)."""
    if value is None:
        return ""
    if isinstance(value, float):
        return escape(f"{value:.4g}")
    return escape(str(value))


def _glance(t: RunTimeline, source: str) -> str:
    rows = [
        ("event log", f"<code>{escape(source)}</code>"),
        ("steps measured", f"{_text(t.first_step)} to {_text(t.last_step)}"),
        ("rollbacks", str(len(t.rollbacks))),
        ("attention layers", _text(", ".join(t.attention_layers) or "none")),
        ("routers", _text(", ".join(t.routers) or "none")),
        ("rules", _text(", ".join(t.rules))),
        ("decision rounds recorded", str(t.evaluations)),
        (
            "alerts / incidents / actions / pages",
            f"{len(t.alerts)} / {len(t.incidents)} / {len(t.actions)} / {len(t.pages)}",
        ),
    ]
    return _table(("", ""), [(escape(k), v) for k, v in rows])


def _incidents(t: RunTimeline) -> str:
    if not t.incidents:
        return '<p class="muted">No incident.</p>'
    out = []
    for incident in t.incidents.values():
        family = str(incident.get("family"))
        resolved = incident.get("resolved_step")
        head = (
            f'<p><span class="family {escape(family)}">{escape(family)}</span> '
            f"incident <code>{_text(incident.get('id'))}</code>: "
            f"confidence {float(incident.get('confidence') or 0):.0%}, "
            f"onset step {_text(incident.get('onset_step'))}, "
            f"opened at step {_text(incident.get('opened_step'))}, "
            + (f"resolved at step {_text(resolved)}" if resolved is not None else "still open")
            + f", severity {_text(incident.get('severity'))}.</p>"
        )
        evidence = [
            (
                _text(e.get("rule")),
                _text(e.get("metric")),
                _text(place_of(e.get("labels") or {}) or "run"),
                _text(e.get("value")),
                _text(e.get("baseline")),
                _text(e.get("onset_step")),
                _text(e.get("fired_step")),
                (
                    "consequence"
                    + (f" ({_text(e['consequence_of'])})" if e.get("consequence_of") else "")
                    if e.get("consequence")
                    else "cause"
                ),
            )
            for e in incident.get("evidence") or []
        ]
        header = ("rule", "metric", "where", "value", "baseline", "onset", "fired", "role")
        quiet = ", ".join(incident.get("quiet_families") or []) or "none"
        fixes = "".join(f"<li>{_text(s)}</li>" for s in incident.get("suggestions") or [])
        out += [head, _table(header, evidence), f"<p>Stayed quiet: {_text(quiet)}.</p>"]
        out += [f"<p>Suggested fixes:</p><ul>{fixes}</ul>"] if fixes else []
    return "\n".join(out)


def _timeline(t: RunTimeline) -> str:
    """Alerts, incident events, actions and rollbacks in the order they happened (the log's:
    after a rollback the steps go back)."""
    rows: list[tuple[int, int, str, str]] = []  # (log index, step, what, text)
    for a in t.alerts:
        where = f" at {a.place}" if a.place else ""
        onset = f" (onset {a.onset_step})" if a.onset_step is not None else ""
        if a.fired_step is not None and a.fired_index is not None:
            rows.append((a.fired_index, a.fired_step, "alert", f"{a.rule}{where} fired{onset}"))
        if a.end_step is not None and a.end_index is not None:
            what = "cancelled" if a.cancelled else "resolved"
            rows.append((a.end_index, a.end_step, "alert", f"{a.rule}{where} {what}"))
    for e in t.incident_events:
        if e["event"] != "action":
            message = f": {e['message']}" if e["message"] else ""
            text = f"{e['id']} {e['event']} ({e['family']}){message}"
            rows.append((e["index"], e["step"], "incident", text))
    for a in t.actions:
        sentence = action_sentence(
            str(a.get("action")),
            str(a.get("detail") or ""),
            a.get("before"),
            a.get("after"),
            dry_run=bool(a.get("dry_run")),
            ok=bool(a.get("ok")),
        )
        status = a.get("pacing") or a.get("status")
        rows.append(
            (a["index"], int(a["step"]), f"action ({status})", f"{a.get('action')}: {sentence}")
        )
    for r in t.rollbacks:
        gone = f"steps {r.to_step + 1}-{r.from_step} are abandoned"
        text = f"the run continues from step {r.to_step}; {gone}"
        rows.append((r.index, r.from_step, "rollback", text))
    if not rows:
        return '<p class="muted">Nothing happened: no alert, incident or action.</p>'
    rows.sort(key=lambda r: r[0])
    body = [(str(step), escape(what), escape(text)) for _, step, what, text in rows]
    return _table(("step", "what", ""), body)


def _pages(t: RunTimeline) -> str:
    if not t.pages:
        return '<p class="muted">No page was sent.</p>'
    out = []
    for page in t.pages:
        summary = (
            f"step {_text(page.get('step'))}: {_text(page.get('event_kind'))} "
            f"({_text(page.get('family'))}, {_text(page.get('severity'))}), "
            f"<code>{_text(page.get('event_id'))}</code>"
        )
        out.append(
            f"<details><summary>{summary}</summary><pre>{_text(page.get('text'))}</pre></details>"
        )
    return "\n".join(out)


def _errors(t: RunTimeline) -> str:
    rows = [(_text(e.get("step")), _text(e.get("what")), _text(e.get("error"))) for e in t.errors]
    return _table(("step", "part", "error"), rows)
