"""`mechwatch explain RULE`: a rule's series, detector, timing, meaning and paced actions in
plain words, with the detector's numbers worked out (log-units turned into percentages)."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from agent.cli import main
from agent.rules.detector_words import describe_detector

RULE = """\
groups:
  - name: mine
    rules:
      - name: loss_p90_high
        metric: loss
        match: {shard: "train-*"}
        reduce: {op: quantile, q: 0.9, over: [shard]}
        detector: {type: threshold, above: 4}
        for: "500 steps"
        keep_firing_for: 2
        clear: {below: 3.5}
        start_step: 1000
        severity: warning
        family: symptom
        actions:
          - lower_lr: {factor: 0.5, cooldown: 300, dry_run: true}
          - halt
"""


def test_log_cusum_in_percent():
    fa = describe_detector("log_cusum", {"direction": "falling", "k": 0.05, "h": 0.3})
    assert fa.startswith(
        "fires when the value keeps falling faster than 5% per evaluation until the excess "
        "adds up to 26% (a CUSUM on log-changes: k = 0.05, h = 0.3); a slower drift never adds "
        "up, a one-time fall of less than 30% is forgiven"
    )
    rising = describe_detector("log_cusum", {"direction": "rising", "k": 0.1, "h": 0.2})
    assert "rising faster than 11% per evaluation until the excess adds up to 22%" in rising
    assert "a one-time rise of less than 35% is forgiven" in rising


def test_other_detectors_in_words():
    assert describe_detector("threshold", {"above": 1800, "below": -1}) == (
        "fires while the value is above 1800 or below -1 (strictly; no warm-up, no baseline; "
        "NaN is neither above nor below anything)"
    )
    rise = describe_detector("ema_rise", {"span": 50, "margin": 0.1, "warmup": 100})
    assert rise.startswith(
        "fires while the exponential moving average over about 50 values (weight 2/51 on the "
        "newest) is more than 0.1 above its lowest level so far, once 100 values were seen"
    )
    spike = describe_detector("ewma", {"halflife": 50, "z": 8.0, "direction": "rising"})
    assert (
        "more than 8 standard deviations above the exponentially weighted mean (halflife 50;"
        in (spike)
    )
    assert "the first 20 values seed it" in spike  # the model's default warm-up filled in
    drop = describe_detector("baseline", {"warmup": 8, "rel": 0.4})
    assert drop == (
        "fires when the value falls by more than 40% of the baseline from its baseline "
        "(the median of the first 8 values, then frozen)"
    )


def test_a_detector_without_words_lists_its_documented_parameters():
    class Params(BaseModel):
        span: int = Field(3, description="Values per window.")
        level: float = Field(description="Trigger level, metric units.")

    words = describe_detector("my_detector", {"level": 2.5}, Params)
    assert words == (
        "fires when the 'my_detector' detector triggers: span = 3 (Values per window); "
        "level = 2.5 (Trigger level, metric units)"
    )


def _rows(text: str) -> list[str]:
    """The explanation's rows, each with its wrapped lines joined again."""
    rows: list[str] = []
    for line in text.splitlines():
        if line.startswith(" " * 12):
            rows[-1] += " " + line.strip()
        else:
            rows.append(line.strip())
    return rows


def test_explain_a_rule_from_a_file(tmp_path: Path, capsys):
    path = tmp_path / "mine.yaml"
    path.write_text(RULE)
    assert main(["explain", "loss_p90_high", "--rules", str(path)]) == 0
    out = capsys.readouterr().out.replace(str(path), "F")
    assert max(len(line) for line in out.splitlines()) <= 100
    assert _rows(out) == [
        "loss_p90_high  (F:4, group mine)",
        "watches   loss: the series whose shard matches 'train-*', the quantile 0.9 over shard "
        "at each step (one alert); the agent measures it every step. One evaluation is one "
        "value of it.",
        "detector  threshold: fires while the value is above 4 (strictly; no warm-up, no "
        "baseline; NaN is neither above nor below anything).",
        "timing    Looks at values from step 1000 on (earlier ones are ignored); fires once the "
        "condition has held for 500 training steps after it became pending; resolves once more "
        "than 2 evaluations passed without the condition, and only while the value is below "
        "3.5.",
        "means     a symptom (loss, gradient norm, NaN, hung run): it opens an unattributed "
        "incident on its own and corroborates a mechanism's; severity warning.",
        "actions   in this order, when the rule starts firing: "
        "1. lower_lr {factor: 0.5, cooldown: 300, dry_run: True}: Multiply the LR of all (or "
        "selected) param groups by factor, never below min_lr. Runs again every 300 steps "
        "while the rule keeps firing (its own cooldown); at most 3 runs per 10000 steps, then "
        "is skipped; dry run: records what it would do, changes nothing. "
        "2. halt: Request a graceful stop of the run. Runs once each time the rule starts "
        "firing; at most 3 runs per 10000 steps, then is skipped.",
    ]


def test_shipped_rule_and_unknown_names(capsys):
    assert main(["explain", "routing_entropy_collapse", "routing_entropy_colapse"]) == 1
    out, err = capsys.readouterr()
    out = " ".join(_rows(out))
    assert "log_cusum: fires when the value keeps falling faster than 5% per evaluation" in out
    assert (
        "and only while router_update_ratio (the same series selection, the median over "
        "router at each step; the labels it keeps must agree with the alert's) triggered "
        "baseline within the last 50 steps: fires when the value rises by more than 100% of "
        "the baseline" in out
    )
    assert "Runs again every 250 steps while the rule keeps firing (the rule's cooldown)" in out
    assert "at most 2 runs per 5000 steps, then pages and halts the run (escalate)" in out
    assert err == (
        "mechwatch explain: no rule named 'routing_entropy_colapse'; did you mean "
        "'routing_entropy_collapse'?\n"
    )
