"""The shipped rule packs on live test-bed runs (shortened, fixed seed, detect-only): clean runs
stay quiet, the attention fault is attributed to fa_precision and the router fault to
router_instability, each before the loss degrades. benchmarks/lead_time.py runs the full
version over five seeds and every scenario."""

from __future__ import annotations

import pytest

from agent.testbed.divergence import divergence_step
from agent.testbed.scenarios import ScenarioConfig
from agent.testbed.supervised import default_agent_config, run_supervised


def _detect(tmp_path, scenario: str, steps: int):
    config = default_agent_config(
        tmp_path / scenario, remediate=False, checkpoints={"enabled": False}
    )
    return run_supervised(ScenarioConfig.preset(scenario, seed=0, steps=steps), config)


def test_clean_run_raises_no_alert(tmp_path):
    result = _detect(tmp_path, "clean", 900)
    assert result.first_alert == {}
    assert result.incidents == []


def test_fa_fault_is_attributed_to_fa_precision_before_the_loss_moves(tmp_path):
    result = _detect(tmp_path, "fa_precision", 900)
    assert result.attribution == "fa_precision"
    assert set(result.first_alert) == {"fa_precision"}  # the router family stayed quiet
    first = result.first_alert["fa_precision"]
    assert result.fault_start < first < 900
    # The onset estimate lies between the fault and the alert.
    assert result.fault_start <= result.onset_step <= first
    # When the alert fires the loss has not diverged (it may not have by the end either).
    assert divergence_step(result.losses[: first + 1]) is None
    # Detect-only: the actions were proposed, not applied.
    assert result.actions and all(a["dry_run"] for a in result.actions)
    assert result.rolled_back_steps == 0


def test_router_fault_is_attributed_to_router_instability(tmp_path):
    result = _detect(tmp_path, "router_instability", 700)
    assert result.attribution == "router_instability"
    assert set(result.first_alert) == {"router_instability"}  # the FA family stayed quiet
    first = result.first_alert["router_instability"]
    assert result.fault_start < first <= result.fault_start + 150
    assert divergence_step(result.losses) is None


@pytest.mark.parametrize("scenario", ["combined"])
def test_combined_fault_is_attributed_to_combined(tmp_path, scenario):
    result = _detect(tmp_path, scenario, 1100)
    assert result.attribution == "combined"
    assert {"fa_precision", "router_instability"} <= set(result.first_alert)


def test_a_reused_run_directory_reports_only_the_latest_run(tmp_path):
    """The event log appends; run_supervised summarizes from the last agent start on."""
    from agent.testbed.supervised import _this_run

    earlier = [{"kind": "start"}, {"kind": "action", "action": "rollback"}, {"kind": "stop"}]
    latest = [{"kind": "start"}, {"kind": "alert", "rule": "r"}, {"kind": "stop"}]
    assert _this_run(earlier + latest) == latest
    assert _this_run(latest[1:]) == latest[1:]  # no start recorded: everything counts
