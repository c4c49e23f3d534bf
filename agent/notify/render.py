"""Render an incident event as a Slack Block Kit message and as plain text.

One page says: what broke (severity, fault family, confidence, onset), why we think so (the
firing metrics with value, baseline, onset step, trend; which family stayed quiet), what the
agent did or would do (actions, dry-run), what a person should do (suggested fixes) and
where it happened (run, step, host, rank, job). Replies in the incident's thread (escalation,
action, repeat, resolution) are shorter.

Slack's limits are enforced here, not hoped for: at most 50 blocks, section text <= 3000
characters, header <= 150, section fields <= 10 of <= 2000 characters, context <= 10
elements; the fallback text is bounded too. Whatever does not fit is cut with an ellipsis and
the page says how many items were left out.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.incidents import ActionRecord, Evidence, Incident, IncidentEvent

# Slack Block Kit limits (api.slack.com/reference/block-kit/blocks).
MAX_BLOCKS = 50
MAX_SECTION_TEXT = 3000
MAX_HEADER_TEXT = 150
MAX_FIELDS = 10
MAX_FIELD_TEXT = 2000
MAX_CONTEXT_ELEMENTS = 10
# chat.postMessage truncates text at 40,000 characters and recommends <= 4,000; a
# notification preview needs far less.
MAX_FALLBACK_TEXT = 3000
# One evidence, action or suggestion line; longer ones are cut so that others still fit.
MAX_ITEM_TEXT = 700

ELLIPSIS = "…"

FAMILY_TITLES = {
    "fa_precision": "biased low-precision attention backward",
    "router_instability": "MoE router collapse",
    "combined": "attention precision fault and MoE router collapse",
    "unattributed": "training symptoms without an attributed mechanism",
}
FAMILY_QUIET_NOTES = {
    "fa_precision": "attention-spectrum monitors stayed at baseline",
    "router_instability": "router monitors stayed at baseline",
    "symptom": "loss and gradient norm look normal so far",
}
SEVERITY_EMOJI = {
    "info": ":information_source:",
    "warning": ":warning:",
    "critical": ":rotating_light:",
}
KIND_EMOJI = {
    "escalated": ":arrow_double_up:",
    "updated": ":memo:",
    "action": ":wrench:",
    "repeat": ":repeat:",
    "resolved": ":white_check_mark:",
}


@dataclass(frozen=True)
class RenderedPage:
    """A Slack message: ``blocks`` for the client, ``text`` for notifications and fallback."""

    text: str
    blocks: list[dict[str, Any]]


# ----------------------------------------------------------------------------- formatting


def truncate(text: str, limit: int) -> str:
    """``text`` cut to at most ``limit`` characters, ending in an ellipsis if it was cut."""
    assert limit >= 1
    return text if len(text) <= limit else text[: limit - 1] + ELLIPSIS


def escape_mrkdwn(text: str) -> str:
    """Escape the three characters Slack's mrkdwn gives meaning to."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _code(text: str) -> str:
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


def _relative_change(value: float, baseline: float | None) -> str:
    if baseline is None or not math.isfinite(value) or not math.isfinite(baseline):
        return ""
    if baseline == 0:
        return ""
    change = (value - baseline) / abs(baseline)
    return f" ({change:+.0%})".replace("-", "−")


def _labels(labels: dict[str, str]) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(labels.items()))


def family_title(family: str) -> str:
    return FAMILY_TITLES.get(family, family)


def _trend_word(trend: str | None) -> str:
    return {"falling": "falling ↓", "rising": "rising ↑"}.get(trend or "", trend or "")


# ----------------------------------------------------------------------------- evidence


@dataclass
class _EvidenceGroup:
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


def _group_evidence(evidence: Sequence[Evidence]) -> list[_EvidenceGroup]:
    groups: dict[tuple[str, str], _EvidenceGroup] = {}
    for ev in evidence:
        key = (ev.rule, ev.metric)
        if key not in groups:
            groups[key] = _EvidenceGroup(ev.rule, ev.metric, ev.family, [])
        groups[key].items.append(ev)
    return sorted(groups.values(), key=lambda g: g.lead.onset_step or g.lead.fired_step)


def _evidence_line(group: _EvidenceGroup, *, mrkdwn: bool) -> str:
    ev = group.lead
    code = _code if mrkdwn else (lambda s: s)
    esc = escape_mrkdwn if mrkdwn else (lambda s: s)
    where = f" [{esc(_labels(ev.labels))}]" if ev.labels else ""
    baseline = f" vs baseline {format_number(ev.baseline)}" if ev.baseline is not None else ""
    parts = [
        f"{code(ev.metric)}{where} = {format_number(ev.value)}{baseline}"
        f"{_relative_change(ev.value, ev.baseline)}"
    ]
    trend = _trend_word(ev.trend)
    if trend:
        parts.append(trend)
    parts.append(f"onset step {format_step(ev.onset_step)}, fired at {format_step(ev.fired_step)}")
    line = ", ".join(parts)
    if len(group.items) > 1:
        line += f"; {len(group.items)} places fire (earliest shown)"
    line += f" — rule {code(group.rule)}, {esc(ev.severity)}"
    if ev.summary:
        line += f". {esc(ev.summary)}"
    return line


# ----------------------------------------------------------------------------- actions


def _action_line(action: ActionRecord, *, mrkdwn: bool) -> str:
    code = _code if mrkdwn else (lambda s: s)
    esc = escape_mrkdwn if mrkdwn else (lambda s: s)
    if action.dry_run:
        status = "proposed (dry-run)"
    elif action.ok:
        status = "done"
    else:
        status = "FAILED"
    line = f"{code(action.action)} at step {format_step(action.step)}: {status}"
    if action.detail:
        line += f" — {esc(action.detail)}"
    changes = [
        f"{k}: {action.before.get(k, '?')} → {action.after[k]}"
        for k in sorted(action.after)
        if action.before.get(k) != action.after[k]
    ]
    if changes:
        line += f" ({esc('; '.join(changes))})"
    return line


def _actions_for_event(event: IncidentEvent) -> list[ActionRecord]:
    """The actions an ``action`` event is about: those at the event's step, else the last."""
    at_step = [a for a in event.incident.actions if a.step == event.step]
    return at_step or event.incident.actions[-1:]


def _suggestions(incident: Incident) -> list[str]:
    seen: list[str] = []
    for text in [*incident.suggestions, *(e.suggest for e in incident.evidence)]:
        text = text.strip()
        if text and text not in seen:
            seen.append(text)
    return seen


# ----------------------------------------------------------------------------- blocks


def _section(text: str) -> dict[str, Any]:
    return {"type": "section", "text": {"type": "mrkdwn", "text": truncate(text, MAX_SECTION_TEXT)}}


def _list_section(title: str, lines: Sequence[str], noun: str) -> dict[str, Any]:
    """One section: a bold title and bullet lines, as many as fit; says how many did not."""

    def footer(left: int) -> str:
        return f"\n{ELLIPSIS} and {left} more {noun} not shown" if left else ""

    body = f"*{truncate(title, 200)}*"
    for i, line in enumerate(lines):
        bullet = "\n• " + truncate(line, MAX_ITEM_TEXT)
        # Adding this line must leave room for the footer a later cut would need.
        if len(body) + len(bullet) + len(footer(len(lines) - i - 1)) > MAX_SECTION_TEXT:
            body += footer(len(lines) - i)
            break
        body += bullet
    assert len(body) <= MAX_SECTION_TEXT
    return _section(body)


def _header(text: str) -> dict[str, Any]:
    return {
        "type": "header",
        "text": {"type": "plain_text", "text": truncate(text, MAX_HEADER_TEXT), "emoji": True},
    }


def _context(event: IncidentEvent) -> dict[str, Any]:
    ctx = event.context
    elements = [
        f"run {_code(ctx.run_name)}",
        f"step {format_step(event.step)}",
        f"host {_code(ctx.host)}",
        f"rank {ctx.rank}",
    ]
    if ctx.job_id:
        elements.append(f"job {_code(str(ctx.job_id))}")
    elements.append(f"incident {_code(event.incident.id)}")
    elements.append(f"event {_code(event.event_id)}")
    assert len(elements) <= MAX_CONTEXT_ELEMENTS
    return {
        "type": "context",
        "elements": [{"type": "mrkdwn", "text": truncate(t, MAX_FIELD_TEXT)} for t in elements],
    }


def _title(event: IncidentEvent) -> str:
    inc = event.incident
    sev = inc.severity.upper()
    fam = inc.family
    if event.kind == "opened":
        return f"{SEVERITY_EMOJI.get(inc.severity, '')} {sev} · {fam} · {family_title(fam)}"
    if event.kind == "escalated":
        return f"{KIND_EMOJI['escalated']} Escalated to {sev} · {fam}"
    if event.kind == "action":
        names = ", ".join(a.action for a in _actions_for_event(event)) or "action"
        return f"{KIND_EMOJI['action']} Action · {names}"
    if event.kind == "repeat":
        return (
            f"{KIND_EMOJI['repeat']} Still firing · {sev} · {fam} "
            f"since step {format_step(inc.opened_step)}"
        )
    if event.kind == "resolved":
        return (
            f"{KIND_EMOJI['resolved']} Resolved · {fam} "
            f"at step {format_step(inc.resolved_step or event.step)}"
        )
    return f"{KIND_EMOJI.get(event.kind, '')} {event.kind.capitalize()} · {sev} · {fam}"


def _summary_fields(event: IncidentEvent) -> dict[str, Any]:
    inc = event.incident
    fields = [
        f"*Fault family*\n{_code(inc.family)}",
        f"*Severity*\n{escape_mrkdwn(inc.severity)}",
        f"*Confidence*\n{inc.confidence:.0%}",
        f"*Onset step*\n{format_step(inc.onset_step)}",
        f"*Opened at step*\n{format_step(inc.opened_step)}",
        f"*Incident*\n{_code(inc.id)}",
    ]
    assert len(fields) <= MAX_FIELDS
    return {
        "type": "section",
        "fields": [{"type": "mrkdwn", "text": truncate(f, MAX_FIELD_TEXT)} for f in fields],
    }


def _evidence_blocks(incident: Incident, *, limit: int | None = None) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    groups = _group_evidence(incident.evidence)
    if groups:
        lines = [_evidence_line(g, mrkdwn=True) for g in groups]
        firing = len(incident.evidence)
        title = f"Evidence ({firing} firing alert{'s' if firing != 1 else ''})"
        if limit is not None and len(lines) > limit:
            lines = lines[:limit]
            title += f", top {limit} of {len(groups)} signals"
        blocks.append(_list_section(title, lines, "signals"))
    if incident.quiet_families:
        quiet = "; ".join(
            f"{_code(f)} ({FAMILY_QUIET_NOTES.get(f, 'quiet')})" for f in incident.quiet_families
        )
        blocks.append(_section(f"*Stayed quiet:* {quiet}"))
    return blocks


def _actions_blocks(actions: Sequence[ActionRecord]) -> list[dict[str, Any]]:
    taken = [a for a in actions if not a.dry_run]
    proposed = [a for a in actions if a.dry_run]
    blocks = []
    if taken:
        blocks.append(
            _list_section("Actions taken", [_action_line(a, mrkdwn=True) for a in taken], "actions")
        )
    if proposed:
        blocks.append(
            _list_section(
                "Actions proposed (dry-run, nothing was changed)",
                [_action_line(a, mrkdwn=True) for a in proposed],
                "actions",
            )
        )
    return blocks


def _suggestion_blocks(incident: Incident) -> list[dict[str, Any]]:
    fixes = _suggestions(incident)
    if not fixes:
        return []
    return [_list_section("Suggested fixes", [escape_mrkdwn(s) for s in fixes], "suggestions")]


def render_blocks(event: IncidentEvent, *, threaded: bool = True) -> list[dict[str, Any]]:
    """Block Kit blocks for ``event``. ``threaded=False`` (webhooks) quotes the incident id."""
    inc = event.incident
    blocks: list[dict[str, Any]] = [_header(_title(event))]
    if event.kind != "opened" and not threaded:
        blocks.append(
            _section(
                f"Re: incident {_code(inc.id)} ({escape_mrkdwn(inc.family)}, "
                f"opened at step {format_step(inc.opened_step)})"
            )
        )
    if event.message:
        blocks.append(_section(escape_mrkdwn(event.message)))

    if event.kind == "opened":
        blocks.append(_summary_fields(event))
        blocks.append({"type": "divider"})
        blocks += _evidence_blocks(inc)
        blocks += _actions_blocks(inc.actions)
        blocks += _suggestion_blocks(inc)
    elif event.kind == "escalated":
        blocks.append(
            _section(f"Confidence {inc.confidence:.0%}, onset step {format_step(inc.onset_step)}.")
        )
        blocks += _evidence_blocks(inc)
        blocks += _suggestion_blocks(inc)
    elif event.kind == "updated":
        blocks += _evidence_blocks(inc)
    elif event.kind == "action":
        blocks += _actions_blocks(_actions_for_event(event))
    elif event.kind == "repeat":
        steps = event.step - inc.opened_step
        blocks.append(
            _section(
                f"Firing for {format_step(steps)} steps (opened at step "
                f"{format_step(inc.opened_step)}). Nothing has resolved it yet."
            )
        )
        blocks += _evidence_blocks(inc, limit=3)
        blocks += _suggestion_blocks(inc)
    elif event.kind == "resolved":
        end = inc.resolved_step if inc.resolved_step is not None else event.step
        blocks.append(
            _section(
                f"Back to baseline at step {format_step(end)}, "
                f"{format_step(end - inc.opened_step)} steps after it opened."
            )
        )
        blocks += _actions_blocks(inc.actions)
    else:
        blocks += _evidence_blocks(inc)

    blocks.append(_context(event))
    if len(blocks) > MAX_BLOCKS:  # cannot happen with the layout above; kept as a guard
        blocks = blocks[: MAX_BLOCKS - 2] + [
            _section(f"{ELLIPSIS} {len(blocks) - MAX_BLOCKS + 1} more blocks not shown"),
            blocks[-1],
        ]
    return blocks


# ----------------------------------------------------------------------------- plain text


def _plain_title(event: IncidentEvent) -> str:
    inc = event.incident
    sev = inc.severity.upper()
    if event.kind == "opened":
        return (
            f"[{sev}] {inc.family}: {family_title(inc.family)} — incident {inc.id}, "
            f"confidence {inc.confidence:.0%}, onset step {format_step(inc.onset_step)}"
        )
    if event.kind == "resolved":
        end = inc.resolved_step if inc.resolved_step is not None else event.step
        return f"[RESOLVED] {inc.family} incident {inc.id} at step {format_step(end)}"
    if event.kind == "repeat":
        return (
            f"[{sev}] still firing: {inc.family} incident {inc.id} since step "
            f"{format_step(inc.opened_step)}"
        )
    if event.kind == "escalated":
        return f"[{sev}] escalated: {inc.family} incident {inc.id}"
    return f"[{sev}] {event.kind}: {inc.family} incident {inc.id}"


def render_text(event: IncidentEvent, *, limit: int | None = MAX_FALLBACK_TEXT) -> str:
    """Plain text: Slack's notification/fallback text, and what the console prints."""
    inc = event.incident
    lines = [_plain_title(event)]
    if event.message:
        lines.append(event.message)
    show_evidence = event.kind in ("opened", "escalated", "updated", "repeat")
    if show_evidence and inc.evidence:
        groups = _group_evidence(inc.evidence)
        lines.append("Evidence:")
        lines += ["  - " + _evidence_line(g, mrkdwn=False) for g in groups]
    if show_evidence and inc.quiet_families:
        lines.append("Stayed quiet: " + ", ".join(inc.quiet_families))
    actions = _actions_for_event(event) if event.kind == "action" else inc.actions
    if event.kind in ("opened", "action", "resolved") and actions:
        lines.append("Actions:")
        lines += ["  - " + _action_line(a, mrkdwn=False) for a in actions]
    if event.kind in ("opened", "escalated", "repeat"):
        fixes = _suggestions(inc)
        if fixes:
            lines.append("Suggested fixes:")
            lines += [f"  - {s}" for s in fixes]
    ctx = event.context
    job = f", job {ctx.job_id}" if ctx.job_id else ""
    lines.append(
        f"Run {ctx.run_name}, step {format_step(event.step)}, host {ctx.host}, "
        f"rank {ctx.rank}{job}; event {event.event_id}"
    )
    text = "\n".join(lines)
    return text if limit is None else truncate(text, limit)


def render_page(event: IncidentEvent, *, threaded: bool = True) -> RenderedPage:
    """The Slack message for ``event``: Block Kit blocks plus a bounded fallback text."""
    return RenderedPage(text=render_text(event), blocks=render_blocks(event, threaded=threaded))
