"""Faults injected into the agent's own path: it keeps watching, never mislabels a checkpoint,
never crashes the loop, and names what went wrong once."""

from __future__ import annotations

import errno
import os
import warnings
from pathlib import Path

import pytest
import torch

from agent.agent import Agent
from agent.checkpoints import KEY_DATA, KEY_MODEL
from agent.config import AgentConfig
from agent.eventlog import read_events
from agent.testbed.runner import TestbedRun
from agent.testbed.scenarios import ScenarioConfig


def _run(steps: int = 60) -> TestbedRun:
    torch.manual_seed(0)
    cfg = ScenarioConfig.preset("clean", seed=0, steps=steps, monitor_every=10**9)
    return TestbedRun(cfg, record_monitors=False)


def _config(tmp_path: Path, **kw) -> AgentConfig:
    # Symptom-only incidents open at once here: these tests are about what happens next (the
    # wait itself: test_a_symptom_only_incident_is_paged_after_the_symptom_wait).
    base = {"run_dir": tmp_path / "run", "notify": {"console": "never", "symptom_wait_steps": 0}}
    base.update(kw)
    return AgentConfig.model_validate(base)


def _rules(tmp_path: Path, body: str) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text("groups:\n  - name: g\n    rules:\n" + body)
    return path


def _data_hooks(run: TestbedRun):
    def data_state() -> dict:
        return {"step_index": run.step_index, "generator": run.generator.get_state()}

    def restore_data(state: dict, skip: int) -> None:
        run.generator.set_state(state["generator"])
        run.step_index = int(state["step_index"])

    return data_state, restore_data


def test_a_rollback_on_a_checkpoint_step_never_mislabels_the_checkpoint(tmp_path):
    """The rule rolls back at step 40, a checkpoint step. The restored state (after step 30)
    must not be saved as ckpt-40; the real step 40 is saved when the run gets there again."""
    rules = _rules(
        tmp_path,
        "      - name: always\n        metric: loss\n"
        "        detector: {type: threshold, above: 0.0}\n        for: 0\n"
        "        start_step: 40\n        severity: critical\n        family: symptom\n"
        "        actions: [{rollback: {margin_steps: 5}}]\n",
    )
    run = _run()
    data_state, restore_data = _data_hooks(run)
    cfg = _config(
        tmp_path,
        rules=[rules],
        symptoms={"every": 10},
        checkpoints={"enabled": True, "every": 10, "keep_last": 10},
    )
    agent = Agent(
        run.model,
        run.optimizer,
        run.scheduler,
        cfg,
        data_state=data_state,
        restore_data=restore_data,
    )
    step, moves, weights_at = 0, [], {}
    while step < 46:
        run.step()
        next_step = agent.step(step, loss=run.last_loss)
        if next_step != step + 1:
            moves.append((step, next_step))
        elif step % 10 == 0:
            weights_at[step] = {k: v.clone() for k, v in run.model.state_dict().items()}
        step = next_step
    agent.checkpoints.flush()
    assert moves == [(40, 31)]
    infos = {info.step: info for info in agent.checkpoints.checkpoints()}
    assert 40 in infos  # saved when the run reached step 40 again
    for saved_step, info in infos.items():
        payload = agent.checkpoints.load(info)
        assert payload[KEY_DATA]["step_index"] == saved_step + 1, saved_step
        model = payload[KEY_MODEL]
        assert all(torch.equal(model[k], weights_at[saved_step][k]) for k in model), saved_step
    agent.close()


def test_malformed_step_inputs_are_reduced_or_rejected_once_and_the_agent_goes_on(tmp_path):
    run = _run()
    cfg = _config(tmp_path, symptoms={"every": 5}, checkpoints={"enabled": True, "every": 10})
    agent = Agent(run.model, run.optimizer, config=cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(30):
            run.step()
            loss: object = run.last_loss
            if step in (3, 13):
                loss = torch.tensor([1.0, 2.0, 3.0, 6.0])  # per-sample losses: the mean
            elif step in (6, 16):
                loss = "2.5"  # not a number: rejected
            assert agent.step(step, loss=loss, grad_norm=run.last_grad_norm) == step + 1
        assert agent.step("7") == "7"  # a step that is not an integer: rejected, not raised
    agent.checkpoints.flush()
    series = dict(agent.store.series("loss"))
    assert series[3] == pytest.approx(3.0) and series[13] == pytest.approx(3.0)
    assert 6 not in series and 16 not in series and 25 in series  # the rest kept working
    assert sorted(i.step for i in agent.checkpoints.checkpoints()) == [0, 10, 20]
    agent.close()
    texts = [str(w.message) for w in caught if "mechwatch" in str(w.message)]
    assert len(texts) == 3, texts  # reduced, rejected, bad step: each reported once
    assert any("reduced loss: a tensor of shape (4,)" in t for t in texts)
    assert any("rejected loss: expected a number or a tensor, got str" in t for t in texts)
    errors = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "error"]
    assert len(errors) == 3


def test_a_full_disk_never_reaches_the_loop_and_is_named_once(tmp_path, monkeypatch):
    """Checkpoint writes fail with ENOSPC: the run goes on, the cause is in the event log once;
    the event log itself on a full device: ``close()`` does not raise."""
    from agent.checkpoints import atomic

    real_write = atomic.HashingWriter.write

    def full(self, data):  # every checkpoint byte hits a full disk
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(atomic.HashingWriter, "write", full)
    run = _run()
    cfg = _config(tmp_path, symptoms={"every": 5}, checkpoints={"enabled": True, "every": 5})
    agent = Agent(run.model, run.optimizer, config=cfg)
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        for step in range(40):
            run.step()
            agent.step(step, loss=run.last_loss)
        agent.checkpoints.flush()
    monkeypatch.setattr(atomic.HashingWriter, "write", real_write)
    agent.close()
    errors = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "error"]
    about_disk = [e for e in errors if "ENOSPC" in e["error"]]
    assert len(about_disk) == 1, errors
    assert agent.checkpoints.checkpoints() == []

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full on this machine")
    full_dir = tmp_path / "full"
    full_dir.mkdir()
    (full_dir / "events.jsonl").symlink_to("/dev/full")
    again = Agent(run.model, run.optimizer, config=_config(tmp_path, run_dir=full_dir))
    for step in range(12):
        run.step()
        again.step(step, loss=run.last_loss)
    again.close()  # the buffered records cannot be written: no exception


class _Collect:
    """A notifier that keeps what it is sent."""

    name = "collect"

    def __init__(self) -> None:
        self.events: list = []

    def send(self, event, thread):
        self.events.append(event)
        return None

    def close(self) -> None:
        pass


def test_injected_notifiers_receive_the_pages(tmp_path):
    rules = _rules(
        tmp_path,
        "      - name: high\n        metric: loss\n"
        "        detector: {type: threshold, above: 0.0}\n        for: 0\n"
        "        severity: warning\n        family: symptom\n",
    )
    notifier = _Collect()
    run = _run()
    cfg = _config(tmp_path, rules=[rules], symptoms={"every": 5})
    agent = Agent(run.model, run.optimizer, config=cfg, notifiers=[notifier])
    for step in range(6):
        run.step()
        agent.step(step, loss=run.last_loss)
    agent.close()
    assert [e.kind for e in notifier.events] == ["opened"]
    assert notifier.events[0].incident.evidence[0].rule == "high"


def test_a_symptom_only_incident_is_paged_after_the_symptom_wait(tmp_path):
    """Default ``notify.symptom_wait_steps`` (50): a loss rule that fires at step 0 opens its
    incident, and runs its actions, at the first read-out 50 steps later, not before."""

    rules = _rules(
        tmp_path,
        "      - name: high\n        metric: loss\n"
        "        detector: {type: threshold, above: 0.0}\n        for: 0\n"
        "        severity: warning\n        family: symptom\n"
        "        actions: [{lower_lr: {factor: 0.5}}]\n",
    )
    notifier = _Collect()
    run = _run(steps=60)
    cfg = _config(tmp_path, rules=[rules], symptoms={"every": 5}, notify={"console": "never"})
    assert cfg.notify.symptom_wait_steps == 50
    agent = Agent(run.model, run.optimizer, run.scheduler, cfg, notifiers=[notifier])
    for step in range(50):
        run.step()
        agent.step(step, loss=run.last_loss)
    assert notifier.events == [] and agent.incident is None and agent.lr_scale == 1.0
    run.step()
    agent.step(50, loss=run.last_loss)
    agent.close()
    assert [e.kind for e in notifier.events][:1] == ["opened"]
    assert notifier.events[0].incident.opened_step == 50
    assert agent.lr_scale == pytest.approx(0.5)


def test_the_hung_run_rules_actions_run_at_the_next_step_boundary(tmp_path):
    """The watchdog's samples go through the same decision round: the hung_run incident is
    opened off the training thread, and the rule's actions run when the run steps again."""
    import time

    rules = _rules(
        tmp_path,
        "      - name: hung_run\n        metric: seconds_since_step\n"
        "        detector: {type: threshold, above: 0.3}\n        for: 0\n"
        "        keep_firing_for: 1000\n"
        "        severity: critical\n        family: symptom\n"
        "        actions: [{lower_lr: {factor: 0.5}}]\n",
    )
    run = _run()
    cfg = _config(tmp_path, rules=[rules], watchdog={"check_every_s": 0.1}, symptoms={"every": 1})
    agent = Agent(run.model, run.optimizer, config=cfg)
    run.step()
    agent.step(0, loss=run.last_loss)
    deadline = time.monotonic() + 5
    while agent.incident is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert agent.incident is not None and agent.lr_scale == 1.0  # nothing ran off-thread
    run.step()
    agent.step(1, loss=run.last_loss)
    agent.close()
    assert agent.lr_scale == 0.5
    actions = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "action"]
    assert [(a["action"], a["rule"], a["step"]) for a in actions] == [("lower_lr", "hung_run", 1)]
