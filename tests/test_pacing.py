"""Pacing: cooldowns, caps, standing requests (episodes), the loop guard, the repeat page."""

from __future__ import annotations

import json

import pytest

from remediations.pacing import ActionRequest, Pacing, PacingLimits
from remediations.runner import ActionRunner

FIRES = [("r", [("lower_lr", {"factor": 0.5})])]


def _pacing(**limits) -> Pacing:
    def limits_of(request: ActionRequest) -> tuple[PacingLimits, bool]:
        keys = {k: v for k, v in request.params.items() if k in PacingLimits.model_fields}
        return PacingLimits(**{**limits, **keys}), request.action != "page"

    return Pacing(limits_of, repeat_every_steps=None, repeat_every_s=None)


def _drive(pacing: Pacing, steps, fires_at, *, ok: bool = True) -> list[tuple[int, str]]:
    """Rounds at ``steps``; the rule fires when ``fires_at(step)``; every "run" succeeds."""
    out = []
    for step in steps:
        firing = FIRES if fires_at(step) else []
        for admission in pacing.round(step, firing, "inc-1"):
            out.append((step, admission.verdict))
            if admission.verdict == "run":
                pacing.ran(admission, ok=ok)
    return out


def test_a_request_stands_while_its_rule_fires_and_runs_each_cooldown():
    pacing = _pacing(cooldown=30, max_per_window=100)
    got = _drive(pacing, range(0, 100, 5), lambda s: 10 <= s)
    assert got == [(10, "run"), (40, "run"), (70, "run")]
    assert [r.action for r in pacing.standing()] == ["lower_lr"]


def test_a_new_episode_inside_the_cooldown_waits_once_then_runs():
    pacing = _pacing(cooldown=30, max_per_window=100)
    got = _drive(pacing, range(0, 60, 5), lambda s: 10 <= s < 15 or s >= 20)
    # 10: runs; 15: the rule stops (episode over); 20: fires again inside the cooldown:
    # one "wait", silently until 40, when it runs.
    assert got == [(10, "run"), (20, "wait"), (40, "run")]
    pacing = _pacing(cooldown=30, max_per_window=100)
    got = _drive(pacing, range(0, 60, 5), lambda s: 10 <= s < 15 or 20 <= s < 25)
    assert got == [(10, "run"), (20, "wait")] and pacing.standing() == []


def test_the_clock_counts_steps_run_and_a_rollback_does_not_rewind_it():
    pacing = _pacing(cooldown=15, max_per_window=100)
    assert _drive(pacing, [20], lambda s: True) == [(20, "run")]
    pacing.moved_to(10)  # a rollback to step 10: the clock stays at 20 steps run
    got = _drive(pacing, [15, 20, 25], lambda s: True)
    assert got == [(25, "run")]  # 15 steps run since the last run, not 5
    assert pacing.clock == 15  # steps run since the first round (at step 20)


def test_cap_skips_or_escalates_and_ends_the_episode():
    pacing = _pacing(cooldown=10, max_per_window=2, window_steps=100)
    got = _drive(pacing, range(0, 60, 10), lambda s: True)
    assert got == [(0, "run"), (10, "run"), (20, "skip")]
    guard = _pacing(cooldown=10, max_per_window=2, window_steps=100, on_limit="escalate")
    got = _drive(guard, range(0, 60, 10), lambda s: True)
    assert got == [(0, "run"), (10, "run"), (20, "escalate")]
    # A capped episode is over while the rule keeps firing (150); once the rule stopped (160)
    # and fires again after the window (170), a new episode runs.
    got = _drive(pacing, [150, 160, 170], lambda s: s != 160)
    assert got == [(170, "run")]


def test_dry_runs_failures_and_non_repeating_actions_run_once_per_episode():
    pacing = _pacing(cooldown=10, max_per_window=100, dry_run=True)
    assert _drive(pacing, range(0, 50, 10), lambda s: True) == [(0, "run")]
    failing = _pacing(cooldown=10, max_per_window=100)
    assert _drive(failing, range(0, 50, 10), lambda s: True, ok=False) == [(0, "run")]
    pages = _pacing(cooldown=0, max_per_window=100)
    firing = [("r", [("page", {})])]
    runs = 0
    for step in range(0, 50, 10):
        for a in pages.round(step, firing, "inc-1"):
            runs += a.verdict == "run"
            pages.ran(a, ok=True)
    assert runs == 1


def test_limits_precedence_action_key_then_rule_cooldown_then_class_defaults():
    runner = ActionRunner(lambda: None)  # type: ignore[arg-type, return-value]
    pacing = Pacing(runner.limits_of, rule_cooldowns={"r": 250, "s": None})
    rollback = ActionRequest("i", "r", "rollback", {"margin_steps": 50})
    limits, repeats = pacing.limits(rollback)
    assert (limits.cooldown, limits.max_per_window, limits.window_steps) == (250, 2, 5000)
    assert limits.on_limit == "escalate" and repeats
    own = ActionRequest("i", "r", "rollback", {"cooldown": 40})
    assert pacing.limits(own)[0].cooldown == 40
    assert pacing.limits(ActionRequest("i", "s", "lower_lr", {}))[0].cooldown == 500
    page, repeats = pacing.limits(ActionRequest("i", "r", "page", {}))
    assert page.cooldown == 0 and not repeats  # runs once per episode: the rule's cooldown
    # is how often a fix may run again, not how often a page may go out
    assert pacing.limits(ActionRequest("i", "s", "halt", {}))[1] is False


def test_the_rollback_loop_guard_with_the_real_defaults():
    runner = ActionRunner(lambda: None)  # type: ignore[arg-type, return-value]
    pacing = Pacing(runner.limits_of)
    firing = [("r", [("rollback", {"cooldown": 100})])]
    verdicts, reasons = [], []
    for step in range(0, 1000, 50):
        for a in pacing.round(step, firing, "inc-1"):
            verdicts.append((step, a.verdict))
            reasons.append(a.reason)
            if a.verdict == "run":
                pacing.ran(a, ok=True)
    assert verdicts == [(0, "run"), (100, "run"), (200, "escalate")]
    assert reasons[-1] == ("2 runs of rollback in the last 5000 training steps (max_per_window 2)")


def test_repeat_page_by_steps_on_the_clock_and_by_seconds():
    pacing = Pacing(lambda r: (PacingLimits(), True), repeat_every_steps=100, repeat_every_s=60)
    pacing.advance(0)
    pacing.paged("inc", now=1000.0)
    pacing.advance(99)
    assert not pacing.repeat_due("inc", now=1059.0)
    assert pacing.repeat_due("inc", now=1060.0)  # seconds first
    pacing.advance(100)
    assert pacing.repeat_due("inc", now=1000.0)  # 100 steps run
    assert not pacing.repeat_due("other", now=10**9)  # never paged: never repeated
    pacing.closed("inc")
    assert not pacing.repeat_due("inc", now=10**9)


def test_state_round_trip_keeps_clock_history_and_episodes():
    pacing = _pacing(cooldown=30, max_per_window=100)
    _drive(pacing, [0, 10], lambda s: s >= 10)
    pacing.paged("inc-1", now=5.0)
    state = json.loads(json.dumps(pacing.state_dict()))
    again = _pacing(cooldown=30, max_per_window=100)
    again.load_state_dict(state)
    assert again.state_dict() == pacing.state_dict()
    assert _drive(again, [20, 30, 40], lambda s: True) == [(40, "run")]


@pytest.mark.parametrize("incident", ["inc-1", "inc-2"])
def test_a_new_incident_starts_new_episodes(incident):
    pacing = _pacing(cooldown=0, max_per_window=100)
    firing = [("r", [("page", {})])]
    first = pacing.round(0, firing, "inc-1")
    pacing.ran(first[0], ok=True)
    again = pacing.round(10, firing, incident)
    assert [a.verdict for a in again] == ([] if incident == "inc-1" else ["run"])


def test_two_rules_asking_the_same_fix_in_one_round_run_it_once():
    """Two rules that fire together (the router rule and its hard-push twin) both ask for
    lower_lr: the first runs it, the second waits for the cooldown as after any run; while both
    fire, the fix repeats once per cooldown, not twice. A different action is not held up."""
    pacing = _pacing(cooldown=30, max_per_window=100)
    both = [("r", [("lower_lr", {"factor": 0.1})]), ("s", [("lower_lr", {"factor": 0.1})])]
    got = []
    for step in range(0, 50, 5):
        for admission in pacing.round(step, both, "inc-1"):
            got.append((step, admission.request.rule, admission.verdict))
            if admission.verdict == "run":
                pacing.ran(admission, ok=True)
    assert got == [(0, "r", "run"), (0, "s", "wait"), (30, "r", "run")]
    other = [("r", [("lower_lr", {})]), ("s", [("rollback", {})])]
    fresh = _pacing(cooldown=30, max_per_window=100)
    verdicts = [(a.request.action, a.verdict) for a in fresh.round(0, other, "inc-1")]
    assert verdicts == [("lower_lr", "run"), ("rollback", "run")]
