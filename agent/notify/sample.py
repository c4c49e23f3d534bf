"""A sample ``fa_precision`` incident, from opening to resolution, for docs and slack-test.

``python -m agent.notify.sample`` prints the rendered opening page (Block Kit JSON and the
plain-text fallback) as the Markdown that ``docs/slack.md`` embeds.
"""

from __future__ import annotations

import copy
import json

from agent.incidents import ActionRecord, Evidence, Incident, IncidentEvent, RunContext
from agent.notify.render import render_page, render_text

SAMPLE_CONTEXT = RunContext(run_name="llama-1b-bf16", host="gpu-node-17", rank=0, job_id="418233")


def sample_incident(incident_id: str = "fa_precision-0001") -> Incident:
    """An attributed incident as the agent would open it (nothing done yet)."""
    evidence = [
        Evidence(
            rule="fa_qk_delta2_entropy_drop",
            metric="qk_delta2_entropy",
            labels={"layer": "model.layers.11.self_attn", "head": "5"},
            family="fa_precision",
            severity="critical",
            value=1.412,
            baseline=3.087,
            onset_step=4800,
            fired_step=5200,
            trend="falling",
            summary="QK update collapsed onto a few directions (spectral entropy fell 54%).",
            suggest="Run the attention backward in FP32 (attention_fp32_backward), then roll "
            "back to a checkpoint from before step 4,800.",
        ),
        Evidence(
            rule="fa_qk_delta2_entropy_drop",
            metric="qk_delta2_entropy",
            labels={"layer": "model.layers.12.self_attn", "head": "5"},
            family="fa_precision",
            severity="critical",
            value=1.651,
            baseline=3.102,
            onset_step=4900,
            fired_step=5200,
            trend="falling",
        ),
        Evidence(
            rule="fa_dwq_entropy_drop",
            metric="dwq_entropy",
            labels={"layer": "model.layers.11.self_attn", "head": "5"},
            family="fa_precision",
            severity="warning",
            value=2.204,
            baseline=2.951,
            onset_step=5000,
            fired_step=5200,
            trend="falling",
        ),
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


def sample_incident_events(
    context: RunContext | None = None, incident_id: str = "fa_precision-0001"
) -> list[IncidentEvent]:
    """Opened at step 5,200, two actions at 5,201, resolved at 6,000: one thread."""
    context = context or SAMPLE_CONTEXT
    incident = sample_incident(incident_id)
    opened = IncidentEvent(
        kind="opened", seq=0, step=5200, incident=copy.deepcopy(incident), context=context
    )
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
    action = IncidentEvent(
        kind="action",
        seq=1,
        step=5201,
        incident=copy.deepcopy(incident),
        context=context,
        message="Applied the rule's actions.",
    )
    incident.status = "resolved"
    incident.resolved_step = 6000
    resolved = IncidentEvent(
        kind="resolved",
        seq=2,
        step=6000,
        incident=copy.deepcopy(incident),
        context=context,
        message="qk_delta2_entropy back within its baseline band.",
    )
    return [opened, action, resolved]


def sample_markdown() -> str:
    """The generated part of docs/slack.md."""
    opened = sample_incident_events()[0]
    page = render_page(opened)
    blocks = json.dumps({"text": page.text, "blocks": page.blocks}, indent=2, ensure_ascii=False)
    return (
        "```json\n" + blocks + "\n```\n\n"
        "Plain-text fallback (what notifications, the console and the event log show):\n\n"
        "```text\n" + render_text(opened) + "\n```\n"
    )


if __name__ == "__main__":
    print(sample_markdown(), end="")
