"""Read-outs of device values without a sync on the training thread (agent/host_read.py):
on a GPU the symptom and router read-outs are taken ``apply_lag`` steps after their transfer
starts, with the same values and step labels as an immediate read; on a CPU nothing changes.

There is no GPU in CI: the GPU schedule is driven here by marking every ``HostRead`` as in
flight (its values are then taken later, from the same CPU tensors)."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from agent import samples as m
from agent.config import AgentConfig
from agent.discovery import find_attention, find_routers
from agent.host_read import HostRead
from agent.measurements import Measurements
from agent.samples import Sample
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig

STEPS = 120


def _collect(tmp_path, *, in_flight: bool, lag: int, restart_at: int | None = None, monkeypatch):
    """{step collected: samples} of a test-bed run measured through ``Measurements`` (QK
    monitors off: only the symptom and router read-outs)."""
    if in_flight:
        monkeypatch.setattr(HostRead, "in_flight", property(lambda self: True))
    torch.manual_seed(0)
    run = TestbedRun(ScenarioConfig.preset("clean", seed=5, steps=STEPS), record_monitors=False)
    config = AgentConfig.model_validate(
        {
            "run_dir": tmp_path,
            "qk": {"enabled": False},
            "scheduling": {"apply_lag": lag},
        }
    )
    measurements = Measurements(
        run.model, config, find_attention(run.model), find_routers(run.model)
    )
    got: dict[int, list[Sample]] = defaultdict(list)
    try:
        for step in range(STEPS):
            loss = run.step()
            measurements.record(step, loss, None)
            if step == restart_at:
                measurements.restart()
            got[step] += measurements.collect(step)
    finally:
        measurements.close()
    return got


def _by_label(got: dict[int, list[Sample]]) -> dict[tuple, float]:
    return {(s.step, s.metric, s.labels): s.value for ss in got.values() for s in ss}


def test_in_flight_reads_arrive_apply_lag_steps_later_with_the_same_values(
    tmp_path, monkeypatch
) -> None:
    now = _collect(tmp_path / "a", in_flight=False, lag=5, monkeypatch=monkeypatch)
    later = _collect(tmp_path / "b", in_flight=True, lag=5, monkeypatch=monkeypatch)
    # immediately: the loss read-out every symptoms.every (10) steps, routers every 25
    loss_at = sorted(k for k, ss in now.items() if any(s.metric == m.LOSS for s in ss))
    assert loss_at[:3] == [0, 10, 20]
    router_at = sorted(k for k, ss in now.items() if any("router" in s.label_dict for s in ss))
    assert router_at[:3] == [0, 25, 50]
    # in flight: each read-out 5 steps later, everything else identical
    loss_later = sorted(k for k, ss in later.items() if any(s.metric == m.LOSS for s in ss))
    assert loss_later == [k + 5 for k in loss_at if k + 5 < STEPS]
    router_later = sorted(k for k, ss in later.items() if any("router" in s.label_dict for s in ss))
    assert router_later == [k + 5 for k in router_at if k + 5 < STEPS]
    a, b = _by_label(now), _by_label(later)
    last = STEPS - 5  # read-outs after this are still in flight at the end of the run
    expected = {k: v for k, v in a.items() if k[0] < last}
    assert {k: v for k, v in b.items() if k[0] < last} == pytest.approx(expected)
    assert any(k[1] == m.LOSS for k in expected) and any("router" in str(k[2]) for k in expected)


def test_lag_zero_reads_at_once_and_restart_drops_reads_in_flight(tmp_path, monkeypatch) -> None:
    at_once = _collect(tmp_path / "a", in_flight=True, lag=0, monkeypatch=monkeypatch)
    assert any(s.metric == m.LOSS for s in at_once[10])  # no deferral without a lag
    restarted = _collect(
        tmp_path / "b", in_flight=True, lag=5, restart_at=52, monkeypatch=monkeypatch
    )
    # the read-outs of 50 (loss and routers) were in flight at the restart: dropped
    assert not restarted[55]
    assert any(s.metric == m.LOSS and s.step == 60 for s in restarted[65])


def test_a_cpu_tensor_is_not_in_flight() -> None:
    read = HostRead(torch.tensor([1.5, 2.0]))
    assert not read.in_flight and read.tolist() == [1.5, 2.0]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_a_cuda_read_arrives_in_pinned_memory() -> None:
    values = torch.arange(4, dtype=torch.float32, device="cuda") * 0.5
    read = HostRead(values)
    assert read.in_flight and read._host.is_pinned()
    assert read.tolist() == [0.0, 0.5, 1.0, 1.5]
