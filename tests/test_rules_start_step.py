"""`start_step`: a rule ignores the early phase, and its detector's warm-up starts after it."""

from __future__ import annotations

from agent.rules.engine import RuleEngine
from agent.rules.loader import load_rule_text
from agent.samples import Sample
from agent.store import SeriesStore

RULE = """
groups:
  - name: g
    rules:
      - name: drop
        metric: router_entropy_norm
        detector: {type: baseline, warmup: 3, direction: drop, rel: 0.3}
        start_step: {start}
        for: 0
        severity: warning
        family: router_instability
"""


def _fired_at(start: int, values: list[tuple[int, float]]) -> list[int]:
    engine = RuleEngine(load_rule_text(RULE.replace("{start}", str(start))), SeriesStore())
    fired = []
    for step, value in values:
        engine.store.append(Sample.make(step, "router_entropy_norm", value, router="r"))
        fired += [t.step for t in engine.evaluate(step, 0.0) if t.kind == "firing"]
    return fired


def test_early_phase_is_ignored_and_warmup_starts_after_it():
    # Healthy early sharpening (1.0 -> 0.4 by step 40), then stable, then a collapse at 90.
    series = [
        (0, 1.0),
        (10, 0.9),
        (20, 0.7),
        (30, 0.5),
        (40, 0.4),
        (50, 0.4),
        (60, 0.41),
        (70, 0.39),
        (80, 0.4),
        (90, 0.1),
    ]
    assert _fired_at(0, series) == [30]  # the early phase looks like a collapse
    assert _fired_at(45, series) == [90]  # baseline learned from 50..70, collapse caught
