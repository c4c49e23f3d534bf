"""Page rendering: content of an attributed incident, Slack's size limits, escaping, docs."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

from agent.incidents import ActionRecord, Evidence, IncidentEvent
from agent.notify.example_page import (
    example_incident,
    example_incident_events,
    example_page_markdown,
)
from agent.notify.render import (
    MAX_BLOCKS,
    MAX_CONTEXT_ELEMENTS,
    MAX_FALLBACK_TEXT,
    MAX_FIELD_TEXT,
    MAX_FIELDS,
    MAX_HEADER_TEXT,
    MAX_SECTION_TEXT,
    render_blocks,
    render_page,
    render_text,
    truncate,
)

DOCS = Path(__file__).resolve().parents[1] / "docs" / "slack.md"


def _texts(blocks: list[dict[str, Any]]) -> str:
    return json.dumps(blocks, ensure_ascii=False)


def _section_texts(blocks: list[dict[str, Any]]) -> list[str]:
    return [b["text"]["text"] for b in blocks if b["type"] == "section" and "text" in b]


def assert_within_slack_limits(blocks: list[dict[str, Any]], text: str) -> None:
    assert 1 <= len(blocks) <= MAX_BLOCKS
    assert len(text) <= MAX_FALLBACK_TEXT
    for block in blocks:
        if block["type"] == "header":
            assert len(block["text"]["text"]) <= MAX_HEADER_TEXT
            assert block["text"]["type"] == "plain_text"
        elif block["type"] == "section":
            if "text" in block:
                assert len(block["text"]["text"]) <= MAX_SECTION_TEXT
            for f in block.get("fields", []):
                assert len(f["text"]) <= MAX_FIELD_TEXT
            assert len(block.get("fields", [])) <= MAX_FIELDS
        elif block["type"] == "context":
            assert len(block["elements"]) <= MAX_CONTEXT_ELEMENTS
        else:
            assert block["type"] == "divider", block


def test_opening_page_shows_everything_a_person_needs() -> None:
    opened = example_incident_events()[0]
    page = render_page(opened)
    assert_within_slack_limits(page.blocks, page.text)
    header = page.blocks[0]["text"]["text"]
    assert "CRITICAL" in header and "fa_precision" in header
    fields = " ".join(f["text"] for f in page.blocks[1]["fields"])
    assert "92%" in fields and "4,800" in fields and "5,200" in fields
    sections = _section_texts(page.blocks)
    evidence = next(s for s in sections if s.startswith("*Evidence"))
    # Three firing alerts in two (rule, metric) groups; the earliest onset is shown first.
    assert evidence.startswith("*Evidence (3 firing alerts)*")
    lines = evidence.splitlines()[1:]
    assert len(lines) == 2
    assert "`qk_delta2_entropy`" in lines[0] and "layer=model.layers.11.self_attn" in lines[0]
    assert "= 1.412 vs baseline 3.087 (−54%)" in lines[0]
    assert "falling" in lines[0] and "onset step 4,800" in lines[0]
    assert "2 places fire" in lines[0]
    assert "`dwq_entropy`" in lines[1] and "onset step 5,000" in lines[1]
    quiet = next(s for s in sections if s.startswith("*Stayed quiet"))
    assert "`router_instability`" in quiet
    fixes = next(s for s in sections if s.startswith("*Suggested fixes"))
    assert "FP32" in fixes and fixes.count("\n• ") == 2  # incident + evidence suggestions
    context = " ".join(e["text"] for e in page.blocks[-1]["elements"])
    for part in (
        "llama-1b-bf16",
        "step 5,200",
        "gpu-node-17",
        "rank 0",
        "418233",
        "fa_precision-0001:opened:0",
    ):
        assert part in context
    # Fallback text carries the same essentials.
    assert page.text.startswith("[CRITICAL] fa_precision")
    assert "confidence 92%" in page.text and "onset step 4,800" in page.text
    assert "Stayed quiet: router_instability, symptom" in page.text
    assert "host gpu-node-17" in page.text and "job 418233" in page.text


def test_replies_are_about_their_event() -> None:
    _, action, resolved = example_incident_events()
    blocks = render_blocks(action)
    assert blocks[0]["text"]["text"].endswith("Action · attention_fp32_backward, rollback")
    taken = next(s for s in _section_texts(blocks) if s.startswith("*Actions taken"))
    assert "`attention_fp32_backward` at step 5,201: done" in taken
    assert "attention_backward: bf16 → fp32" in taken  # an unknown record: what changed
    assert "rolled back from step 5201 to the checkpoint of step 4500" in taken  # in words
    assert "Applied the rule's actions." not in _texts(blocks)  # the lines say it already
    assert "Evidence" not in _texts(blocks)  # a reply is short
    blocks = render_blocks(resolved)
    assert "Resolved · fa_precision at step 6,000" in blocks[0]["text"]["text"]
    assert any("800 steps after it opened" in s for s in _section_texts(blocks))
    # In a thread the incident is implied; without threads (webhooks) it is quoted.
    assert "Re: incident" not in _texts(render_blocks(resolved, threaded=True))
    assert "Re: incident `fa_precision-0001`" in _texts(render_blocks(resolved, threaded=False))
    assert render_text(resolved).startswith("[RESOLVED] fa_precision incident fa_precision-0001")


def test_dry_run_actions_are_proposed_not_taken() -> None:
    incident = example_incident()
    incident.actions = [
        ActionRecord(
            action="lr_scale",
            step=10,
            dry_run=True,
            ok=True,
            detail="would scale LR",
            before={"lr": 1e-3},
            after={"lr": 5e-4},
        ),
        ActionRecord(action="rollback", step=10, dry_run=False, ok=False, detail="no checkpoint"),
    ]
    event = IncidentEvent(kind="opened", seq=0, step=10, incident=incident)
    sections = _section_texts(render_blocks(event))
    taken = next(s for s in sections if s.startswith("*Actions taken"))
    proposed = next(s for s in sections if s.startswith("*Actions proposed (dry-run"))
    assert "`rollback` at step 10: FAILED — no checkpoint" in taken
    assert "lr_scale" not in taken
    assert "`lr_scale` at step 10: proposed (dry-run) — would scale LR (lr: 0.001 → 0.0005)" in (
        proposed
    )


def test_huge_incident_is_truncated_with_counts() -> None:
    incident = example_incident()
    # 400 distinct rules firing, long summaries, a very long suggestion list.
    incident.evidence = [
        Evidence(
            rule=f"rule_{i:03d}",
            metric=f"metric_{i:03d}",
            labels={"layer": f"l{i}" * 20},
            family="fa_precision",
            severity="critical",
            value=float(i),
            baseline=1.0,
            onset_step=1000 + i,
            fired_step=2000,
            trend="falling",
            summary="s" * 900,
            suggest=f"fix number {i} " + "x" * 100,
        )
        for i in range(400)
    ]
    incident.suggestions = []
    incident.id = "i" * 300
    incident.family = "unattributed" + "f" * 300
    event = IncidentEvent(kind="opened", seq=0, step=2000, incident=incident, message="m" * 10_000)
    page = render_page(event)
    assert_within_slack_limits(page.blocks, page.text)
    assert page.text.endswith("…")
    sections = _section_texts(page.blocks)
    evidence = next(s for s in sections if s.startswith("*Evidence (400 firing alerts)*"))
    shown = evidence.count("\n• ")
    assert 1 <= shown < 400
    assert evidence.endswith(f"… and {400 - shown} more signals not shown")
    fixes = next(s for s in sections if s.startswith("*Suggested fixes"))
    shown_fixes = fixes.count("\n• ")
    assert fixes.endswith(f"… and {400 - shown_fixes} more suggestions not shown")
    # Each shown evidence line was cut to a bounded length, ending in an ellipsis.
    assert all(len(line) <= 702 for line in evidence.splitlines())


def test_every_kind_renders_within_limits() -> None:
    base = example_incident_events()[1]
    for kind in ("opened", "updated", "escalated", "action", "repeat", "resolved", "custom"):
        event = copy.deepcopy(base)
        event.kind = kind
        for threaded in (True, False):
            page = render_page(event, threaded=threaded)
            assert_within_slack_limits(page.blocks, page.text)
            assert page.blocks[-1]["type"] == "context"


def test_user_text_is_escaped_for_mrkdwn() -> None:
    incident = example_incident()
    incident.evidence[0].summary = "<!channel> & <http://evil|click>"
    event = IncidentEvent(
        kind="opened", seq=0, step=1, incident=incident, message="a `tick` <@U123>"
    )
    text = _texts(render_blocks(event))
    assert "<!channel>" not in text and "&lt;!channel&gt; &amp; &lt;http://evil|click&gt;" in text
    assert "&lt;@U123&gt;" in text


def test_non_finite_values_render() -> None:
    incident = example_incident()
    incident.evidence[0].value = float("nan")
    incident.evidence[0].baseline = None
    text = render_text(IncidentEvent(kind="opened", seq=0, step=1, incident=incident))
    assert "qk_delta2_entropy [head=5, layer=model.layers.11.self_attn] = nan," in text


def test_truncate() -> None:
    assert truncate("abc", 3) == "abc"
    assert truncate("abcd", 3) == "ab…"


def test_docs_example_is_generated_by_the_renderer() -> None:
    text = DOCS.read_text(encoding="utf-8")
    match = re.search(r"<!-- BEGIN GENERATED.*?-->\n(.*)<!-- END GENERATED -->", text, re.S)
    assert match, "docs/slack.md lost its generated section"
    assert match.group(1) == example_page_markdown(), (
        "docs/slack.md is stale: regenerate it with `python -m agent.notify.example_page`"
    )
