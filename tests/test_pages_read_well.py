"""Pages that read well: what an action did as a sentence, from the records the real actions
produce (not raw dictionaries), and console pages that never share a line with a progress
bar."""

from __future__ import annotations

import io
import threading

import torch

from agent.incidents import ActionRecord, IncidentEvent
from agent.notify.action_text import action_sentence, record_sentence
from agent.notify.console import ConsoleNotifier, StatusLine
from agent.notify.example_page import example_incident, example_incident_events
from agent.notify.page_lines import action_line
from remediations.attention import AttentionFP32Backward
from remediations.attention_switch import AttentionPrecisionSwitch
from remediations.base import ActionContext
from remediations.halt import HaltAction, HaltParams
from remediations.lr import LowerLR, LowerLRParams
from remediations.page import PageAction, PageParams
from remediations.requests import (
    RaiseBalanceCoef,
    RaiseBalanceCoefParams,
    RequestHparam,
    RequestHparamParams,
)


def _sentence(outcome, action: str, *, dry_run: bool = False) -> str:
    return action_sentence(action, outcome.detail, outcome.before, outcome.after, dry_run=dry_run)


def test_attention_switch_in_words():
    action = AttentionFP32Backward(AttentionPrecisionSwitch())
    every = action.apply(ActionContext(step=730), action.Params())
    assert _sentence(every, action.name) == (
        "switched the attention backward to FP32 for every layer"
    )
    again = action.apply(ActionContext(step=731), action.Params())
    assert (
        _sentence(again, action.name) == "the attention backward was already FP32 for every layer"
    )
    one = AttentionFP32Backward(AttentionPrecisionSwitch())
    ctx = ActionContext(step=5, dry_run=True)
    outcome = one.apply(ctx, one.Params(layers=["blocks.1.attn"]))
    assert _sentence(outcome, one.name, dry_run=True) == (
        "would switch the attention backward to FP32 for layer blocks.1.attn"
    )


def test_lower_lr_in_words():
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(
        [{"params": [model.weight], "lr": 3e-3}, {"params": [model.bias], "lr": 3e-3}]
    )
    outcome = LowerLR().apply(
        ActionContext(step=500, optimizer=optimizer), LowerLRParams(factor=0.1, groups=[1])
    )
    assert _sentence(outcome, "lower_lr") == "lowered the LR x0.1 on param group 1 (0.003 → 0.0003)"
    everywhere = LowerLR().apply(
        ActionContext(step=9, optimizer=optimizer), LowerLRParams(factor=0.5)
    )
    assert _sentence(everywhere, "lower_lr").startswith("lowered the LR x0.5 on every param group")


def test_requests_halt_and_page_in_words():
    ctx = ActionContext(step=40)
    ctx.hparams.get("balance_loss_coef", 0.01)  # the loop read it
    raised = RaiseBalanceCoef().apply(ctx, RaiseBalanceCoefParams())
    assert (
        _sentence(raised, "raise_balance_coef") == "requested balance_loss_coef = 0.02 (was 0.01)"
    )
    fresh = RequestHparam().apply(ctx, RequestHparamParams(name="z_loss", op="set", value=1e-3))
    assert _sentence(fresh, "request_hparam") == "requested z_loss = 0.001 (not set before)"
    halt = HaltAction().apply(ctx, HaltParams(reason="escalated: 3 rollbacks"))
    assert _sentence(halt, "halt") == (
        "halted the run at step 40 (the loop raises TrainingHalted); final checkpoint: not "
        "enabled; reason: escalated: 3 rollbacks"
    )
    page = PageAction().apply(ctx, PageParams(severity="critical"))
    assert _sentence(page, "page") == "paged (critical)"


def test_rollback_in_words_from_its_logged_record():
    # The record of the demo's rollback, as the agent logged it (remediations/rollback.py).
    before = {"step": 730, "onset_step": 675}
    after = {
        "step": 600,
        "checkpoint": "/runs/x/checkpoints/ckpt-600.pt",
        "known_good": True,
        "skipped_batches": 0,
        "skipped_checkpoints": [],
        "discarded_steps": [700],
    }
    detail = "rolled back from step 730 to checkpoint step 600 (onset 675, margin 50)"
    assert action_sentence("rollback", detail, before, after) == (
        "rolled back from step 730 to the checkpoint of step 600 (onset 675, margin 50); "
        "deleted the newer checkpoint of step 700"
    )
    would = action_sentence(
        "rollback", "would escalate: no usable checkpoint", before, {"escalate": True}
    )
    assert would == "would escalate: no usable checkpoint"


def test_user_actions_and_failures_fall_back_to_their_detail():
    assert (
        action_sentence(
            "notify_oncall",
            "called the on-call",
            {"calls": 0, "cfg": {"a": 1}},
            {"calls": 1, "cfg": {"a": 1}},
        )
        == "called the on-call (calls: 0 → 1)"
    )
    assert action_sentence("x", "", {}, {"level": "y" * 100}) == (
        f"ran x (level: unset → {'y' * 79}…)"
    )
    assert action_sentence("rollback", "NoUsableCheckpoint: none", {}, {}, ok=False) == (
        "NoUsableCheckpoint: none"
    )
    # A record of an unexpected shape does not raise: it is said the generic way.
    assert action_sentence("lower_lr", "LR x0.5", {"lr_scale": "?"}, {"lr_scale": [1]}) == (
        "LR x0.5 (lr_scale: ? → [1])"
    )


def test_a_page_shows_sentences_not_raw_dictionaries():
    switch = AttentionFP32Backward(AttentionPrecisionSwitch())
    outcome = switch.apply(ActionContext(step=730), switch.Params())
    record = ActionRecord(
        "attention_fp32_backward", 730, False, True, outcome.detail, outcome.before, outcome.after
    )
    line = action_line(record, mrkdwn=False)
    assert line == (
        "attention_fp32_backward at step 730: done — switched the attention backward to FP32 "
        "for every layer"
    )
    assert "{" not in line and record_sentence(record) in line


def test_console_pages_never_share_a_line_with_the_progress_bar():
    out = io.StringIO()
    status = StatusLine(out)
    console = ConsoleNotifier(out, status)
    opened = example_incident_events()[0]
    status.show("[###.......] step   100/1000")
    console.send(opened, None)
    status.show("[####......] step 125/1000")
    status.end()
    text = out.getvalue()
    page_start = text.index("=" * 78)
    assert text[page_start - 1] == "\n"  # the bar's line was ended before the page
    lines = text.split("\n")
    assert lines[0] == "\r[###.......] step   100/1000"
    after_page = text[text.rindex("=" * 78) + 79 :]
    assert after_page == "\r[###.......] step   100/1000\r[####......] step 125/1000  \n"
    # Pages from several threads each keep their own lines.
    out2 = io.StringIO()
    console2 = ConsoleNotifier(out2, StatusLine(out2))
    event = IncidentEvent("opened", 1, 5, example_incident())
    threads = [threading.Thread(target=console2.send, args=(event, None)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out2.getvalue().count("[mechwatch page]") == 8
    assert all(
        line.startswith(("=", "[mechwatch", "Evidence", "  ", "Stayed", "Suggested", "Run"))
        for line in out2.getvalue().splitlines()
    )
