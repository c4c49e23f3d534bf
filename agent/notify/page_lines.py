"""The wording shared by a page's Block Kit and plain-text forms: numbers and steps, one
line per evidence group, per action (what it did, as a sentence: ``agent.notify.action_text``)
and per suggestion (``mrkdwn=True`` escapes user text for Slack), and where a repeat or a
resolution sits in the run.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from agent.incidents import ActionRecord, Evidence, Incident, IncidentEvent
from agent.notify.action_text import record_sentence

ELLIPSIS = "…"

FAMILY_TITLES = {
    "fa_precision": "biased low-precision attention backward",
    "router_instability": "MoE router collapse",
    "combined": "attention precision fault and MoE router collapse",
    "unattributed": "training symptoms without an attributed mechanism",
}

# ----------------------------------------------------------------------------- formatting


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending in an ellipsis if it was cut."""
    assert limit >= 1
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def escape_mrkdwn(text: str) -> str:
    """Escape the three characters Slack's mrkdwn gives meaning to."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def code_span(text: str) -> str:
    """``text`` as inline code in mrkdwn."""
    return "`" + escape_mrkdwn(text.replace("`", "'")) + "`"


def format_number(x: float | None) -> str:
    if x is None:
        return "n/a"
    x = float(x)
    if not math.isfinite(x):
        return str(x)  # "nan", "inf", "-inf"
    if x == 0:
        return "0"
    if abs(x) >= 1e5 or abs(x) < 1e-3:
        return f"{x:.3e}"
    return f"{x:.4g}"


def format_step(step: int | None) -> str:
    return "n/a" if step is None else f"{int(step):,}"


def relative_change(value: float, baseline: float | None) -> str:
    if baseline is None or not math.isfinite(value) or not math.isfinite(baseline):
        return ""
    if baseline == 0:
        return ""
    change = (value - baseline) / abs(baseline)
    return f" ({change:+.0%})".replace("-", "−")


def labels_text(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def family_title(family: str) -> str:
    return FAMILY_TITLES.get(family, family)


def trend_word(trend: str | None) -> str:
    return {"falling": "falling ↓", "rising": "rising ↑"}.get(trend or "", trend or "")


# ----------------------------------------------------------------------------- evidence


@dataclass
class EvidenceGroup:
    """Evidence from one rule on one metric, across label sets (layers, heads, routers)."""

    rule: str
    metric: str
    family: str
    items: list[Evidence]

    @property
    def lead(self) -> Evidence:
        # The earliest departure is the most informative one to show.
        return min(
            self.items,
            key=lambda e: (
                e.onset_step if e.onset_step is not None else e.fired_step,
                e.fired_step,
            ),
        )


def group_evidence(evidence: Sequence[Evidence]) -> list[EvidenceGroup]:
    groups: dict[tuple[str, str], EvidenceGroup] = {}
    for ev in evidence:
        key = (ev.rule, ev.metric)
        if key not in groups:
            groups[key] = EvidenceGroup(ev.rule, ev.metric, ev.family, [])
        groups[key].items.append(ev)
    return sorted(groups.values(), key=lambda g: g.lead.onset_step or g.lead.fired_step)


def evidence_line(group: EvidenceGroup, *, mrkdwn: bool) -> str:
    ev = group.lead
    quote = code_span if mrkdwn else (lambda s: s)
    esc = escape_mrkdwn if mrkdwn else (lambda s: s)
    where = f" [{esc(labels_text(ev.labels))}]" if ev.labels else ""
    baseline = f" vs baseline {format_number(ev.baseline)}" if ev.baseline is not None else ""
    parts = [
        f"{quote(ev.metric)}{where} = {format_number(ev.value)}{baseline}"
        f"{relative_change(ev.value, ev.baseline)}"
    ]
    trend = trend_word(ev.trend)
    if trend:
        parts.append(trend)
    parts.append(f"onset step {format_step(ev.onset_step)}, fired at {format_step(ev.fired_step)}")
    line = ", ".join(parts)
    if len(group.items) > 1:
        line += f"; {len(group.items)} places fire (earliest shown)"
    line += f" — rule {quote(group.rule)}, {esc(ev.severity)}"
    if ev.consequence:
        line += f"; a consequence, not a cause: {esc(ev.consequence_of or 'see the attribution')}"
    if ev.summary:
        line += f". {esc(ev.summary)}"
    return line


# ----------------------------------------------------------------------------- actions


def action_line(action: ActionRecord, *, mrkdwn: bool) -> str:
    quote = code_span if mrkdwn else (lambda s: s)
    esc = escape_mrkdwn if mrkdwn else (lambda s: s)
    if action.dry_run:
        status = "proposed (dry-run)"
    elif action.ok:
        status = "done"
    else:
        status = "FAILED"
    line = f"{quote(action.action)} at step {format_step(action.step)}: {status}"
    sentence = record_sentence(action)  # what it did, in words (agent.notify.action_text)
    return line + (f" — {esc(sentence)}" if sentence else "")


def actions_for_event(event: IncidentEvent) -> list[ActionRecord]:
    """The actions an ``action`` event is about: those at the event's step, else the last."""
    at_step = [a for a in event.incident.actions if a.step == event.step]
    return at_step or event.incident.actions[-1:]


def suggestions(incident: Incident) -> list[str]:
    seen: list[str] = []
    for text in [*incident.suggestions, *(e.suggest for e in incident.evidence)]:
        text = text.strip()
        if text and text not in seen:
            seen.append(text)
    return seen


def when(event: IncidentEvent) -> str:
    """Where a repeat or a resolution sits in the run: " since step N", " at step N" or ""."""
    inc = event.incident
    if event.kind == "repeat":
        return f" since step {format_step(inc.opened_step)}"
    if event.kind == "resolved":
        end = inc.resolved_step if inc.resolved_step is not None else event.step
        return f" at step {format_step(end)}"
    return ""
