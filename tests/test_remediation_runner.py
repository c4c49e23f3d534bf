"""The action registry and runner, and the halt, page and hyper-parameter request actions."""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch
from pydantic import Field, ValidationError

from agent.incidents import Incident
from remediations.attention import AttentionFP32Backward, AttentionPrecisionSwitch
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.halt import HaltAction, TrainingHalted
from remediations.hparams import HyperparameterRequests
from remediations.lr import LowerLR
from remediations.registry import (
    ACTIONS,
    register_action,
    register_callable,
    split_action_params,
    validate_action,
)
from remediations.requests import BALANCE_COEF, GRAD_ACCUM
from remediations.runner import ActionRunner


class _Run:
    """A tiny run: one Linear, SGD, a step counter the context factory reads."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.step = 0
        self.checkpoints: Any = None
        self.hparams = HyperparameterRequests()

    def context(self) -> ActionContext:
        return ActionContext(
            step=self.step,
            model=self.model,
            optimizer=self.optimizer,
            checkpoints=self.checkpoints,
            hparams=self.hparams,
        )

    @property
    def lr(self) -> float:
        return self.optimizer.param_groups[0]["lr"]


def _incident() -> Incident:
    return Incident(
        id="run-1-s100",
        family="router_instability",
        severity="critical",
        confidence=0.9,
        opened_step=100,
        onset_step=60,
    )


def _runner(run: _Run, registry: dict[str, type[Action]] | None = None, **kw: Any):
    audits: list[dict] = []
    runner = ActionRunner(run.context, audits.append, actions=registry, **kw)
    return runner, audits


# -- registry -------------------------------------------------------------------------------------
def test_builtins_registered_and_unknown_names_listed() -> None:
    for name in [
        "attention_fp32_backward",
        "lower_lr",
        "halt",
        "page",
        "request_hparam",
        "raise_balance_coef",
        "raise_grad_accum",
        "rollback",
    ]:
        assert name in ACTIONS
        if name != "request_hparam":  # the only one without defaults for every field
            validate_action(name, {})
    with pytest.raises(ValueError, match="unknown action 'lower_lrr'.*lower_lr"):
        validate_action("lower_lrr", {})


def test_validation_errors_name_the_field_and_pacing_keys_are_split() -> None:
    with pytest.raises(ValidationError) as err:
        validate_action("lower_lr", {"factor": 2.0})
    assert err.value.errors()[0]["loc"] == ("factor",)
    with pytest.raises(ValidationError) as err:
        validate_action("lower_lr", {"factr": 0.5})
    assert err.value.errors()[0]["loc"] == ("factr",)
    with pytest.raises(ValidationError) as err:
        validate_action("lower_lr", {"factor": 0.5, "cooldown": -1})
    assert err.value.errors()[0]["loc"] == ("cooldown",)
    with pytest.raises(ValidationError):
        validate_action("halt", {"mode": "explode"})
    with pytest.raises(ValidationError):  # strict: a YAML string is not a number
        validate_action("lower_lr", {"factor": "0.5"})
    params, pacing = split_action_params(
        "lower_lr", {"factor": 0.5, "cooldown": 10, "dry_run": True}
    )
    assert params.factor == 0.5 and pacing == {"cooldown": 10, "dry_run": True}
    # rollback's loop guard is pacing's cap: the same keys, read by pacing.
    params, pacing = split_action_params("rollback", {"max_per_window": 4, "cooldown": 100})
    assert params.margin_steps == 100 and pacing == {"max_per_window": 4, "cooldown": 100}
    with pytest.raises(ValidationError) as err:
        validate_action("rollback", {"on_limit": "explode"})
    assert err.value.errors()[0]["loc"] == ("on_limit",)


def test_register_action_and_callable() -> None:
    class Params(ActionParams):
        amount: int = Field(1, ge=1)

    calls: list[tuple[int, bool]] = []

    def bump(ctx: ActionContext, params: Params) -> dict:
        """Bump a counter."""
        if not ctx.dry_run:
            calls.append((params.amount, ctx.dry_run))
        return {"amount": params.amount}

    try:
        cls = register_callable("bump_counter", bump, Params)
        assert ACTIONS["bump_counter"] is cls
        with pytest.raises(ValueError, match="already registered"):
            register_callable("bump_counter", bump, Params)
        with pytest.raises(ValidationError):
            validate_action("bump_counter", {"amount": 0})
        run = _Run()
        runner, audits = _runner(run)
        result = runner.run("bump_counter", {"amount": 3})
        assert result.ok and result.status == "applied" and calls == [(3, False)]
        assert result.record.after == {"amount": 3}
        assert audits[-1]["status"] == "applied"
    finally:
        ACTIONS.pop("bump_counter", None)

    class DryRunParams(ActionParams):
        dry_run: bool = False

    class Bad(Action):
        name = "bad_action"
        Params = DryRunParams

        def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
            return ActionOutcome("")

    with pytest.raises(ValueError, match="which pacing owns"):
        register_action(Bad)
    assert "bad_action" not in ACTIONS


# -- runner: dry run, failures, audit --------------------------------------------------------------
def _lr_scale(runner: ActionRunner) -> float:
    return runner.action("lower_lr").control.lr_scale


def test_dry_run_changes_nothing() -> None:
    run = _Run()
    runner, audits = _runner(run)
    result = runner.run("lower_lr", {"factor": 0.5, "dry_run": True})
    assert result.status == "dry_run" and result.record.dry_run and result.ok
    assert result.record.after["lr"] == [0.05] and run.lr == 0.1
    assert _lr_scale(runner) == 1.0
    assert runner.run("lower_lr", {"factor": 0.5}).status == "applied"
    assert run.lr == 0.05 and _lr_scale(runner) == 0.5
    everything_dry, _ = _runner(run, dry_run=True)
    assert everything_dry.run("lower_lr", {"factor": 0.5}).status == "dry_run"
    assert run.lr == 0.05
    json.dumps(audits)  # the audit trail is JSON


class _Exploding(Action):
    name = "explode"

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        raise RuntimeError("boom")


def test_failures_are_reported_never_raised() -> None:
    run = _Run()
    registry = dict(ACTIONS, explode=_Exploding)
    runner, audits = _runner(run, registry)
    result = runner.run("explode", incident=_incident(), rule="r1")
    assert not result.ok and result.status == "failed"
    assert isinstance(result.error, RuntimeError) and "boom" in result.record.detail
    assert audits[-1] | {"incident": "run-1-s100", "rule": "r1", "ok": False} == audits[-1]
    assert "RuntimeError: boom" in audits[-1]["error"]
    assert runner.run("nope").status == "failed"  # unknown action
    bad = runner.run("lower_lr", {"factor": "half"})
    assert bad.status == "failed" and "invalid request" in bad.record.detail
    assert run.lr == 0.1

    def broken_context() -> ActionContext:
        raise OSError("no device")

    broken = ActionRunner(broken_context)
    assert broken.run("lower_lr").status == "failed"

    def bad_audit(_: dict) -> None:
        raise RuntimeError("disk full")

    quiet = ActionRunner(run.context, bad_audit)
    with pytest.warns(UserWarning, match="audit callback failed"):
        assert quiet.run("lower_lr", {"factor": 0.5}).ok
    # A failing action leaves the run unchanged: lower_lr without an optimizer changes nothing.
    nothing = ActionRunner(lambda: ActionContext(step=0)).run("lower_lr")
    assert not nothing.ok and "needs the optimizer" in nothing.record.detail


# -- attention action through the runner ---------------------------------------------------------
def test_attention_action_switch_listener_dry_run_state_and_reapply() -> None:
    switch = AttentionPrecisionSwitch()

    class Attn(AttentionFP32Backward):
        def __init__(self) -> None:
            super().__init__(switch=switch)

    run = _Run()
    runner, _ = _runner(run, dict(ACTIONS, attention_fp32_backward=Attn))
    dry = runner.run("attention_fp32_backward", {"layers": ["model.layers.*"], "dry_run": True})
    assert dry.ok and not switch.any_enabled
    assert dry.record.after["precision"]["included"] == ["model.layers.*"]
    assert "no attention call has consulted" in dry.record.detail  # nothing would change
    seen: list[dict] = []
    switch.add_listener(lambda s: seen.append(s.state_dict()))
    switch.fp32_backward("model.layers.0.self_attn")  # an attention call site asks
    res = runner.run("attention_fp32_backward", {"layers": ["model.layers.*"]})
    assert res.ok and "warning" not in res.record.detail
    assert switch.fp32_backward("model.layers.3.self_attn") and len(seen) == 1
    state = json.loads(json.dumps(runner.state_dict()))
    switch.disable_fp32_backward()  # a restart: the process-wide switch starts off
    fresh, _ = _runner(run, dict(ACTIONS, attention_fp32_backward=Attn))
    fresh.load_state_dict(state)
    assert fresh.reapply_all() == {}
    assert switch.fp32_backward("model.layers.3.self_attn")
    assert not switch.fp32_backward("lm_head")


def test_attention_action_on_the_process_wide_switch() -> None:
    from remediations.attention import attention_precision

    run = _Run()
    runner, _ = _runner(run)
    try:
        assert runner.run("attention_fp32_backward").ok
        assert attention_precision.global_enabled and attention_precision.fp32_backward(None)
    finally:
        attention_precision.disable_fp32_backward()


# -- rollback re-applies the others --------------------------------------------------------------
class _FakeRollback(Action):
    """Simulates a rollback: loads an older optimizer state and resets the process state."""

    name = "rollback"
    restores_run = True
    old_state: dict | None = None
    switch: AttentionPrecisionSwitch | None = None

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        ctx.optimizer.load_state_dict(self.old_state)
        self.switch.disable_fp32_backward()
        return ActionOutcome("rolled back", after={"step": 10})


def test_after_rollback_the_other_actions_are_reapplied() -> None:
    switch = AttentionPrecisionSwitch()

    class Attn(AttentionFP32Backward):
        def __init__(self) -> None:
            super().__init__(switch=switch)

    run = _Run()
    _FakeRollback.old_state = run.optimizer.state_dict()
    _FakeRollback.switch = switch
    runner, _ = _runner(run, dict(ACTIONS, attention_fp32_backward=Attn, rollback=_FakeRollback))
    run.step = 100
    assert runner.run("attention_fp32_backward").ok
    assert runner.run("lower_lr", {"factor": 0.25}).ok
    assert run.lr == 0.025
    result = runner.run("rollback")
    assert result.ok and sorted(result.reapplied) == ["attention_fp32_backward", "lower_lr"]
    assert run.lr == 0.025 and switch.global_enabled  # both still in force
    assert result.restored_step == 10  # the run continues from the restored step


# -- halt ----------------------------------------------------------------------------------------
class _FakeCheckpoints:
    def __init__(self, fail: bool = False) -> None:
        self.saved: list[tuple[int, dict]] = []
        self.fail = fail

    def save(self, step: int, *, health: dict | None = None) -> bool:
        if self.fail:
            raise OSError("disk full")
        self.saved.append((step, health))
        return True

    def flush(self, timeout_s: float | None = None) -> bool:
        return True


def test_halt_raise_mode_with_final_checkpoint() -> None:
    run = _Run()
    run.checkpoints = _FakeCheckpoints()
    run.step = 321
    runner, _ = _runner(run)
    assert not runner.action("halt").should_stop
    runner.action("halt").check()  # nothing requested: no exception
    result = runner.run("halt", incident=_incident())
    assert result.ok and "saved at step 321" in result.record.detail
    assert run.checkpoints.saved[0][0] == 321 and run.checkpoints.saved[0][1]["healthy"] is False
    assert runner.action("halt").should_stop
    with pytest.raises(TrainingHalted, match="at step 321 \\(incident run-1-s100\\)") as err:
        runner.action("halt").check()
    assert isinstance(err.value, RuntimeError) and err.value.incident_id == "run-1-s100"
    state = json.loads(json.dumps(runner.state_dict()))
    again, _ = _runner(run)
    again.load_state_dict(state)
    assert again.action("halt").should_stop
    again.action("halt").clear()
    assert not again.action("halt").should_stop


def test_halt_flag_mode_dry_run_and_failed_checkpoint() -> None:
    run = _Run()
    runner, _ = _runner(run)
    res = runner.run("halt", {"mode": "flag", "reason": "manual"})
    assert res.ok and "final checkpoint: not enabled" in res.record.detail
    assert runner.action("halt").should_stop and runner.action("halt").error() is None
    runner.action("halt").check()  # flag mode: no exception

    run2 = _Run()
    run2.checkpoints = _FakeCheckpoints(fail=True)
    runner2, _ = _runner(run2)
    assert runner2.run("halt", {"dry_run": True}).ok and not runner2.action("halt").should_stop
    failed = runner2.run("halt")
    assert not failed.ok and "disk full" in failed.record.detail
    assert not runner2.action("halt").should_stop  # all or nothing: no halt without its checkpoint
    assert isinstance(HaltAction().state_dict(), dict)


# -- page and hyper-parameter requests -----------------------------------------------------------
def test_page_validates_and_reports_the_request() -> None:
    run = _Run()
    runner, _ = _runner(run)
    res = runner.run("page", {"severity": "warning", "message": "look"}, incident=_incident())
    assert res.ok and res.record.after == {"page": True, "severity": "warning", "message": "look"}
    assert runner.run("page", incident=_incident()).record.after["severity"] == "critical"
    assert runner.run("page", {"severity": "loud"}).status == "failed"


def test_hyperparameter_requests_with_caps_and_state() -> None:
    run = _Run()
    runner, _ = _runner(run)
    hp = run.hparams
    assert hp.get(BALANCE_COEF, 0.01) == 0.01  # the loop reads it every step
    free = {"cooldown": 0}
    for _ in range(3):
        assert runner.run("raise_balance_coef", {"factor": 4.0, "max": 0.5, **free}).ok
    assert hp.get(BALANCE_COEF, 0.01) == 0.5  # 0.04, 0.16, then capped at 0.5
    hp.get(GRAD_ACCUM, 3)
    assert runner.run("raise_grad_accum", {"factor": 1.5, **free}).ok
    assert hp.get(GRAD_ACCUM, 3) == 5.0  # ceil(4.5)
    assert runner.run("raise_grad_accum", {"factor": 4, "max": 16, **free}).ok
    assert hp.get(GRAD_ACCUM, 3) == 16.0
    res = runner.run("request_hparam", {"name": "z_loss_coef", "op": "multiply", "value": 2.0})
    assert not res.ok and "no 'base'" in res.record.detail
    assert runner.run(
        "request_hparam", {"name": "z_loss_coef", "value": 2.0, "base": 1e-3, **free}
    ).ok
    assert hp.get("z_loss_coef", 0.0) == 2e-3
    assert runner.run(
        "request_hparam", {"name": "z_loss_coef", "op": "set", "value": 0.1, **free}
    ).ok
    assert hp.requested() == {BALANCE_COEF: 0.5, GRAD_ACCUM: 16.0, "z_loss_coef": 0.1}
    dry = runner.run("raise_balance_coef", {"dry_run": True})
    assert dry.ok and hp.get(BALANCE_COEF, 0.01) == 0.5
    with pytest.raises(ValidationError):
        validate_action("request_hparam", {"name": "bad name", "value": 1.0})
    assert hp.state_dict()["values"][GRAD_ACCUM] == 16.0  # saved by the agent, not the runner


def test_runner_state_round_trip_keeps_the_lr_scale() -> None:
    run = _Run()
    runner, _ = _runner(run)
    run.step = 1000
    assert runner.run("lower_lr", {"factor": 0.5}).ok
    state = json.loads(json.dumps(runner.state_dict()))
    run2 = _Run()  # a restart: fresh optimizer at the configured LR
    again, _ = _runner(run2)
    again.load_state_dict(state)
    assert _lr_scale(again) == 0.5
    assert again.reapply_all() == {}
    assert run2.lr == 0.05
    assert isinstance(again.action("lower_lr"), LowerLR)


def test_halt_final_checkpoint_with_the_real_checkpoint_manager(tmp_path) -> None:
    checkpoint = pytest.importorskip("agent.checkpoints")
    run = _Run()
    run.step = 40
    with checkpoint.CheckpointManager(
        tmp_path, model=run.model, optimizer=run.optimizer, pin_memory=False
    ) as manager:
        run.checkpoints = manager
        runner, _ = _runner(run)
        result = runner.run("halt", {"mode": "flag"}, incident=_incident())
        assert result.ok and "saved at step 40" in result.record.detail
        assert [info.step for info in manager.checkpoints()] == [40]
        assert not manager.checkpoints()[0].known_good  # saved during an incident
    assert runner.action("halt").should_stop
