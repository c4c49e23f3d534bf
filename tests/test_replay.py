"""`agent.replay`: recorded measurements through rule files, and the attribution over time."""

from __future__ import annotations

from pathlib import Path

from agent.eventlog import EventLog
from agent.replay import replay

RULES = """\
groups:
  - name: g
    rules:
      - name: router_low
        metric: router_entropy_norm
        detector: {type: threshold, below: 0.2}
        for: 0
        severity: critical
        family: router_instability
      - name: delta2_low
        metric: qk_delta2_entropy
        detector: {type: threshold, below: 1.0}
        for: 0
        severity: critical
        family: fa_precision
"""


def _record(path: Path, router: list[float], delta2: list[float]) -> None:
    """One metrics event per 10 steps, as the agent writes them."""
    with EventLog(path) as log:
        log.write("start", 0, run="r", attention_layers=["a"], routers=["g"])
        for i, (h_router, h_delta2) in enumerate(zip(router, delta2, strict=True)):
            step = 10 * i
            samples = [
                [step, "router_entropy_norm", {"router": "g"}, h_router],
                [step, "qk_delta2_entropy", {"layer": "a", "head": "0"}, h_delta2],
            ]
            log.write("metrics", step, samples=samples)


def test_replay_fires_in_order_and_tracks_the_attribution_over_time(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    events = tmp_path / "events.jsonl"
    #          steps 0    10   20   30   40   50   60   70
    router = [0.9, 0.9, 0.1, 0.1, 0.1, 0.1, 0.1, 0.1]  # below 0.2 from step 20
    delta2 = [2.0, 2.0, 2.0, 2.0, 2.0, 0.5, 0.5, 0.5]  # below 1.0 from step 50
    _record(events, router, delta2)

    result = replay(events, [rules])

    assert result.evaluations == 8
    assert result.first_firing() == {"router_instability": 20, "fa_precision": 50}
    assert result.first_firing_by_rule() == {"router_low": 20, "delta2_low": 50}
    assert result.paged_attribution() == "router_instability"
    assert result.attribution(10) is None  # before the incident opened
    assert result.attribution(40) == "router_instability"
    assert result.attribution(50) == "combined"
    assert result.attribution() == "combined"


def test_replay_of_a_quiet_run_has_no_incident(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    events = tmp_path / "events.jsonl"
    _record(events, [0.9] * 5, [2.0] * 5)
    result = replay(events, [rules])
    assert result.first_firing() == {}
    assert result.paged_attribution() is None and result.attribution() is None


def test_replay_reads_the_last_run_of_a_reused_log(tmp_path: Path) -> None:
    """A run directory used again appends a second run to the log: replay reads that run
    alone (the earlier samples would make one series of two runs and fire on the jump)."""
    rules = tmp_path / "rules.yaml"
    rules.write_text(RULES)
    events = tmp_path / "events.jsonl"
    _record(events, [0.1, 0.1, 0.1], [2.0, 2.0, 2.0])  # an earlier run: the router low
    _record(events, [0.9] * 8, [2.0] * 8)  # the run started again: healthy throughout
    alone = tmp_path / "alone.jsonl"
    _record(alone, [0.9] * 8, [2.0] * 8)

    result = replay(events, [rules])

    assert result.evaluations == 8
    assert result.first_firing() == {} and result.incidents == []
    assert result.evaluations == replay(alone, [rules]).evaluations
