"""Render an incident event as a Slack Block Kit message and as plain text.

One page says: what broke (severity, fault family, confidence, onset), why we think so (the
firing metrics with value, baseline, onset step, trend; which family stayed quiet), what the
agent did or would do (actions, dry-run), what a person should do (suggested fixes) and
where it happened (run, step, host, rank, job). Replies in the incident's thread (escalation,
action, repeat, resolution) are shorter. The wording of each line (numbers, evidence,
actions, suggestions) is shared with the plain text and lives in ``agent.notify.page_lines``.

Slack's limits are enforced here, not hoped for: at most 50 blocks, section text <= 3000
characters, header <= 150, section fields <= 10 of <= 2000 characters, context <= 10
elements; the fallback text is bounded too. Whatever does not fit is cut with an ellipsis and
the page says how many items were left out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from agent.incidents import ActionRecord, Incident, IncidentEvent
from agent.notify.page_lines import (
    ELLIPSIS,
    action_line,
    actions_for_event,
    code_span,
    escape_mrkdwn,
    evidence_line,
    family_title,
    format_step,
    group_evidence,
    suggestions,
    truncate,
    when,
)

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


def _mrkdwn_elements(texts: list[str], most: int) -> list[dict[str, Any]]:
    """Context elements or section fields: at most ``most``, each within Slack's limit."""
    assert len(texts) <= most
    return [{"type": "mrkdwn", "text": truncate(t, MAX_FIELD_TEXT)} for t in texts]


def _context(event: IncidentEvent) -> dict[str, Any]:
    ctx = event.context
    elements = [
        f"run {code_span(ctx.run_name)}",
        f"step {format_step(event.step)}",
        f"host {code_span(ctx.host)}",
        f"rank {ctx.rank}" + (f" of {ctx.world_size}" if ctx.world_size > 1 else ""),
    ]
    if ctx.job_id:
        elements.append(f"job {code_span(str(ctx.job_id))}")
    if ctx.ranks:
        elements.append(f"ranks involved: {ctx.ranks}")
    elements.append(f"incident {code_span(event.incident.id)}")
    elements.append(f"event {code_span(event.event_id)}")
    return {"type": "context", "elements": _mrkdwn_elements(elements, MAX_CONTEXT_ELEMENTS)}


def _title(event: IncidentEvent) -> str:
    inc = event.incident
    sev = inc.severity.upper()
    fam = inc.family
    if event.kind == "opened":
        return f"{SEVERITY_EMOJI.get(inc.severity, '')} {sev} · {fam} · {family_title(fam)}"
    if event.kind == "action":
        names = ", ".join(a.action for a in actions_for_event(event)) or "action"
        return f"{KIND_EMOJI['action']} Action · {names}"
    what = {
        "escalated": f"Escalated to {sev}",
        "repeat": f"Still firing · {sev}",
        "resolved": "Resolved",
    }.get(event.kind, f"{event.kind.capitalize()} · {sev}")
    return f"{KIND_EMOJI.get(event.kind, '')} {what} · {fam}{when(event)}"


def _summary_fields(event: IncidentEvent) -> dict[str, Any]:
    inc = event.incident
    fields = {
        "Fault family": code_span(inc.family),
        "Severity": escape_mrkdwn(inc.severity),
        "Confidence": f"{inc.confidence:.0%}",
        "Onset step": format_step(inc.onset_step),
        "Opened at step": format_step(inc.opened_step),
        "Incident": code_span(inc.id),
    }
    texts = [f"*{name}*\n{value}" for name, value in fields.items()]
    return {"type": "section", "fields": _mrkdwn_elements(texts, MAX_FIELDS)}


def _evidence_blocks(incident: Incident, *, limit: int | None = None) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    groups = group_evidence(incident.evidence)
    if groups:
        lines = [evidence_line(g, mrkdwn=True) for g in groups]
        firing = len(incident.evidence)
        title = f"Evidence ({firing} firing alert{'s' if firing != 1 else ''})"
        if limit is not None and len(lines) > limit:
            lines = lines[:limit]
            title += f", top {limit} of {len(groups)} signals"
        blocks.append(_list_section(title, lines, "signals"))
    if incident.quiet_families:
        quiet = "; ".join(
            f"{code_span(f)} ({FAMILY_QUIET_NOTES.get(f, 'quiet')})"
            for f in incident.quiet_families
        )
        blocks.append(_section(f"*Stayed quiet:* {quiet}"))
    return blocks


def _actions_blocks(actions: Sequence[ActionRecord]) -> list[dict[str, Any]]:
    taken = [a for a in actions if not a.dry_run]
    proposed = [a for a in actions if a.dry_run]
    blocks = []
    if taken:
        blocks.append(
            _list_section("Actions taken", [action_line(a, mrkdwn=True) for a in taken], "actions")
        )
    if proposed:
        blocks.append(
            _list_section(
                "Actions proposed (dry-run, nothing was changed)",
                [action_line(a, mrkdwn=True) for a in proposed],
                "actions",
            )
        )
    return blocks


def _suggestion_blocks(incident: Incident) -> list[dict[str, Any]]:
    fixes = suggestions(incident)
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
                f"Re: incident {code_span(inc.id)} ({escape_mrkdwn(inc.family)}, "
                f"opened at step {format_step(inc.opened_step)})"
            )
        )
    if event.message and event.kind != "action":  # an action's line says it in words
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
        blocks += _actions_blocks(actions_for_event(event))
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
    label = "RESOLVED" if event.kind == "resolved" else sev
    what = {"repeat": "still firing: ", "escalated": "escalated: ", "resolved": ""}.get(
        event.kind, f"{event.kind}: "
    )
    return f"[{label}] {what}{inc.family} incident {inc.id}{when(event)}"


def render_text(event: IncidentEvent, *, limit: int | None = MAX_FALLBACK_TEXT) -> str:
    """Plain text: Slack's notification/fallback text, and what the console prints."""
    inc = event.incident
    lines = [_plain_title(event)]
    if event.message and event.kind != "action":
        lines.append(event.message)
    show_evidence = event.kind in ("opened", "escalated", "updated", "repeat")
    if show_evidence and inc.evidence:
        groups = group_evidence(inc.evidence)
        lines.append("Evidence:")
        lines += ["  - " + evidence_line(g, mrkdwn=False) for g in groups]
    if show_evidence and inc.quiet_families:
        lines.append("Stayed quiet: " + ", ".join(inc.quiet_families))
    actions = actions_for_event(event) if event.kind == "action" else inc.actions
    if event.kind in ("opened", "action", "resolved") and actions:
        lines.append("Actions:")
        lines += ["  - " + action_line(a, mrkdwn=False) for a in actions]
    if event.kind in ("opened", "escalated", "repeat"):
        fixes = suggestions(inc)
        if fixes:
            lines.append("Suggested fixes:")
            lines += [f"  - {s}" for s in fixes]
    ctx = event.context
    job = f", job {ctx.job_id}" if ctx.job_id else ""
    world = f" of {ctx.world_size}" if ctx.world_size > 1 else ""
    lines.append(
        f"Run {ctx.run_name}, step {format_step(event.step)}, host {ctx.host}, "
        f"rank {ctx.rank}{world}{job}; event {event.event_id}"
    )
    if ctx.ranks:
        lines.append(f"Ranks involved: {ctx.ranks}")
    text = "\n".join(lines)
    return text if limit is None else truncate(text, limit)


def render_page(event: IncidentEvent, *, threaded: bool = True) -> RenderedPage:
    """The Slack message for ``event``: Block Kit blocks plus a bounded fallback text."""
    return RenderedPage(text=render_text(event), blocks=render_blocks(event, threaded=threaded))
