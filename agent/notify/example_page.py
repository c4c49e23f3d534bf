"""An example page: an ``fa_precision`` incident from opening to resolution, for the docs,
``mechwatch slack-test`` and the notifier tests.

``python -m agent.notify.example_page`` prints the rendered opening page (Block Kit JSON and
the plain-text fallback) as the Markdown that ``docs/slack.md`` embeds.
"""

from __future__ import annotations

import copy
import json

from agent.incidents import ActionRecord, Evidence, Incident, IncidentEvent, RunContext
from agent.notify.render import render_page, render_text

EXAMPLE_CONTEXT = RunContext(run_name="llama-1b-bf16", host="gpu-node-17", rank=0, job_id="418233")


def _falling(
    metric: str,
    severity: str,
    *,
    layer: int,
    value: float,
    baseline: float,
    onset: int,
    summary: str = "",
    suggest: str = "",
) -> Evidence:
    """An alert of rule ``fa_<metric>_drop`` on head 5 of ``layer``, fired at step 5,200."""
    return Evidence(
        rule=f"fa_{metric}_drop",
        metric=metric,
        labels={"layer": f"model.layers.{layer}.self_attn", "head": "5"},
        family="fa_precision",
        severity=severity,
        value=value,
        baseline=baseline,
        onset_step=onset,
        fired_step=5200,
        trend="falling",
        summary=summary,
        suggest=suggest,
    )


def example_incident(incident_id: str = "fa_precision-0001") -> Incident:
    """An attributed incident as the agent would open it (nothing done yet)."""
    evidence = [
        _falling(
            "qk_delta2_entropy",
            "critical",
            layer=11,
            value=1.412,
            baseline=3.087,
            onset=4800,
            summary="QK update collapsed onto a few directions (spectral entropy fell 54%).",
            suggest="Run the attention backward in FP32 (attention_fp32_backward), then roll "
            "back to a checkpoint from before step 4,800.",
        ),
        _falling(
            "qk_delta2_entropy", "critical", layer=12, value=1.651, baseline=3.102, onset=4900
        ),
        _falling("dwq_entropy", "warning", layer=11, value=2.204, baseline=2.951, onset=5000),
    ]
    return Incident(
        id=incident_id,
        family="fa_precision",
        severity="critical",
        confidence=0.92,
        opened_step=5200,
        onset_step=4800,
        evidence=evidence,
        quiet_families=["router_instability", "symptom"],
        suggestions=[
            "Check that the attention kernel's backward accumulates in FP32 "
            "(flash-attention with a BF16 O/dO rounding is the usual cause)."
        ],
    )


def example_incident_events(
    context: RunContext | None = None, incident_id: str = "fa_precision-0001"
) -> list[IncidentEvent]:
    """Opened at step 5,200, two actions at 5,201, resolved at 6,000: one thread."""
    context = context or EXAMPLE_CONTEXT
    incident = example_incident(incident_id)

    def event(kind: str, seq: int, step: int, message: str = "") -> IncidentEvent:
        # A copy: the page shows the incident as it was when the event happened.
        return IncidentEvent(kind, seq, step, copy.deepcopy(incident), context, message)

    opened = event("opened", 0, 5200)
    incident.actions = [
        ActionRecord(
            action="attention_fp32_backward",
            step=5201,
            dry_run=False,
            ok=True,
            detail="attention backward now recomputed in FP32",
            before={"attention_backward": "bf16"},
            after={"attention_backward": "fp32"},
        ),
        ActionRecord(
            action="rollback",
            step=5201,
            dry_run=False,
            ok=True,
            detail="restored checkpoint step_4500 (before onset 4,800)",
            before={"step": 5201},
            after={"step": 4500},
        ),
    ]
    incident.updated_step = 5201
    action = event("action", 1, 5201, "Applied the rule's actions.")
    incident.status = "resolved"
    incident.resolved_step = 6000
    resolved = event("resolved", 2, 6000, "qk_delta2_entropy back within its baseline band.")
    return [opened, action, resolved]


def example_page_markdown() -> str:
    """The generated part of docs/slack.md."""
    opened = example_incident_events()[0]
    page = render_page(opened)
    blocks = json.dumps({"text": page.text, "blocks": page.blocks}, indent=2, ensure_ascii=False)
    return (
        "```json\n" + blocks + "\n```\n\n"
        "Plain-text fallback (what notifications, the console and the event log show):\n\n"
        "```text\n" + render_text(opened) + "\n```\n"
    )


if __name__ == "__main__":
    print(example_page_markdown(), end="")
