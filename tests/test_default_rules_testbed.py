"""The shipped rule packs on live test-bed runs: a shortened version of the detection benchmark
(benchmarks/detection.py runs the whole catalogue over the evaluation seeds). Detect-only, the
catalogue's scenarios, shortened: a clean run stays quiet, a data shift is no mechanism fault,
the attention fault is attributed to fa_precision before the loss detectors people use fire,
the router fault (balancing loss on) to router_instability within 100 steps, both faults at
once to combined.

The five runs are independent: they run once per module, two at a time, each in its own
process with one torch thread (the machine's two cores; the suite's wall time)."""

from __future__ import annotations

import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from agent.testbed.catalog import BY_NAME
from agent.testbed.loss_baselines import earliest_loss_alarm
from agent.testbed.supervised import (
    SupervisedResult,
    default_agent_config,
    run_supervised,
    set_threads,
)

# scenario -> (steps, knobs over the catalogue's seed-0 configuration); longest first, so that
# the two processes finish close together
RUNS: dict[str, tuple[int, dict[str, Any]]] = {
    "combined": (1000, {}),
    "clean": (900, {}),
    "fa_floor_6": (900, {}),
    "data_shift": (800, {"shift_step": 600}),
    "router_x10": (700, {}),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, SupervisedResult]:
    root = tmp_path_factory.mktemp("default_rules")
    spawn = multiprocessing.get_context("spawn")  # no fork of a process that holds threads
    with ProcessPoolExecutor(2, mp_context=spawn, initializer=set_threads, initargs=(1,)) as pool:
        futures = {
            name: pool.submit(
                run_supervised,
                BY_NAME[name].config(0, steps=steps).model_copy(update=knobs),
                default_agent_config(root / name, remediate=False, checkpoints={"enabled": False}),
            )
            for name, (steps, knobs) in RUNS.items()
        }
        return {name: future.result() for name, future in futures.items()}


def _families(result: SupervisedResult) -> set[str]:
    return {i["family"] for i in result.incidents}


def test_clean_run_raises_no_alert(runs):
    result = runs["clean"]
    assert result.first_alert == {}
    assert result.incidents == []


def test_a_data_shift_is_not_taken_for_a_mechanism_fault(runs):
    result = runs["data_shift"]
    # The loss jumps and the model relearns: an unattributed incident (a page about the loss)
    # from the jump on, never fa_precision (H(Delta_2) falls once at the shift and does not
    # keep falling; where a QK alert does fire, it is a consequence of the jump).
    assert result.first_alert["symptom"] == 600
    assert result.first_alert.get("fa_precision", 600) >= 600
    assert _families(result) == {"unattributed"}


def test_fa_fault_is_attributed_before_the_loss_detectors_fire(runs):
    result = runs["fa_floor_6"]
    assert result.attribution == "fa_precision"
    assert "router_instability" not in result.first_alert  # the router family stayed quiet
    first = result.first_alert["fa_precision"]
    loss_alarm, _ = earliest_loss_alarm(result.losses, min_step=result.fault_start)
    assert result.fault_start < first < 900
    assert loss_alarm is None or first < loss_alarm
    assert result.fault_start <= result.onset_step <= first
    # Detect-only: the actions were proposed, not applied.
    assert result.actions and all(a["dry_run"] for a in result.actions)
    assert result.rolled_back_steps == 0


def test_router_fault_with_the_balancing_loss_on_is_caught_within_100_steps(runs):
    result = runs["router_x10"]
    assert result.attribution == "router_instability"
    assert "fa_precision" not in result.first_alert  # the FA family stayed quiet
    assert result.fault_start < result.first_alert["router_instability"] <= result.fault_start + 100


def test_combined_fault_is_attributed_to_combined(runs):
    result = runs["combined"]
    assert result.attribution == "combined"
    assert {"fa_precision", "router_instability"} <= set(result.first_alert)


def test_a_reused_run_directory_reports_only_the_latest_run(tmp_path):
    """The event log appends; run_supervised summarizes from the last agent start on
    (``agent.eventlog.last_run``)."""
    from agent.eventlog import last_run as _this_run

    earlier = [{"kind": "start"}, {"kind": "action", "action": "rollback"}, {"kind": "stop"}]
    latest = [{"kind": "start"}, {"kind": "alert", "rule": "r"}, {"kind": "stop"}]
    assert _this_run(earlier + latest) == latest
    assert _this_run(latest[1:]) == latest[1:]  # no start recorded: everything counts
