"""lower_lr: the scale survives every torch scheduler, hand-written loops, and rollbacks."""

from __future__ import annotations

import copy
import io
import math
import pickle
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch.optim import lr_scheduler as sched

import remediations.lr as lr_mod
from remediations.base import ActionContext
from remediations.lr import SCHEDULED_LR_KEY, LowerLR, LowerLRParams, select_groups

MakeScheduler = Callable[[torch.optim.Optimizer], Any]

SCHEDULERS: dict[str, MakeScheduler] = {
    "lambda": lambda o: sched.LambdaLR(o, lambda s: 1.0 / (1.0 + 0.05 * s)),
    "cosine": lambda o: sched.CosineAnnealingLR(o, T_max=40, eta_min=1e-4),  # recursive form
    "onecycle": lambda o: sched.OneCycleLR(o, max_lr=[0.2, 0.1], total_steps=200),
    "step": lambda o: sched.StepLR(o, step_size=7, gamma=0.8),  # chainable form
    "chained": lambda o: sched.ChainedScheduler(
        [sched.ConstantLR(o, factor=0.5, total_iters=15), sched.ExponentialLR(o, gamma=0.98)]
    ),
    "sequential": lambda o: sched.SequentialLR(
        o,
        [sched.LinearLR(o, start_factor=0.1, total_iters=5), sched.CosineAnnealingLR(o, 30)],
        milestones=[5],
    ),
    "warm_restarts": lambda o: sched.CosineAnnealingWarmRestarts(o, T_0=9, T_mult=2),
    "plateau": lambda o: sched.ReduceLROnPlateau(o, factor=0.7, patience=3),
}


def _optimizer(lr: float | torch.Tensor = 0.1) -> tuple[torch.optim.Optimizer, torch.nn.Parameter]:
    torch.manual_seed(0)
    body = torch.nn.Parameter(torch.randn(4, 4))
    router = torch.nn.Parameter(torch.randn(3, 4))
    lr2 = lr * 0.5
    opt = torch.optim.SGD(
        [
            {"params": [body], "name": "body"},
            {"params": [router], "name": "router", "lr": lr2},
        ],
        lr=lr,
        momentum=0.9,
    )
    return opt, router


def _step(opt: torch.optim.Optimizer, scheduler: Any) -> None:
    opt.step()  # no grads: a no-op that keeps the scheduler's call-order check happy
    if isinstance(scheduler, sched.ReduceLROnPlateau):
        scheduler.step(1.0)  # a flat metric: the LR is reduced every patience+1 steps
    else:
        scheduler.step()


def _lrs(opt: torch.optim.Optimizer) -> list[float]:
    return [float(g["lr"]) for g in opt.param_groups]


def _close(a: float, b: float, rel: float = 1e-12) -> bool:
    return abs(a - b) <= rel * max(abs(a), abs(b)) or (a == b)


@pytest.mark.parametrize("kind", sorted(SCHEDULERS))
@pytest.mark.parametrize("groups", ["all", "router"])
def test_scale_survives_100_scheduler_steps(kind: str, groups: str) -> None:
    ref_opt, _ = _optimizer()
    ref_sched = SCHEDULERS[kind](ref_opt)
    opt, router = _optimizer()
    scheduler = SCHEDULERS[kind](opt)
    for _ in range(10):
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)
    action = LowerLR()
    ctx = ActionContext(step=10, optimizer=opt, scheduler=scheduler, router_parameters=[router])
    out = action.apply(ctx, LowerLRParams(factor=0.3, groups=groups))
    factors = [0.3, 0.3] if groups == "all" else [1.0, 0.3]
    assert out.after["lr_scale"] == factors
    for lr, ref, f in zip(_lrs(opt), _lrs(ref_opt), factors, strict=True):
        assert _close(lr, ref * f)
    for _ in range(100):
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)
        for lr, ref, f in zip(_lrs(opt), _lrs(ref_opt), factors, strict=True):
            assert _close(lr, ref * f), (lr, ref, f)
    # get_last_lr() reports what the optimizer uses; the state dict holds no wrapper.
    assert [float(x) for x in scheduler.get_last_lr()] == _lrs(opt)
    assert isinstance(scheduler, type(ref_sched))
    assert "step" not in scheduler.state_dict()
    torch.save(scheduler.state_dict(), io.BytesIO())
    if kind in ("step", "cosine", "onecycle"):  # picklable schedulers stay picklable
        clone = pickle.loads(pickle.dumps(scheduler))
        assert type(clone) is type(ref_sched) and clone.last_epoch == scheduler.last_epoch


def test_floor_never_lowered_below_min_lr_nor_raised_above_schedule() -> None:
    ref_opt, _ = _optimizer()
    ref_sched = sched.CosineAnnealingLR(ref_opt, T_max=60, eta_min=0.0)
    opt, _ = _optimizer()
    scheduler = sched.CosineAnnealingLR(opt, T_max=60, eta_min=0.0)
    LowerLR().apply(
        ActionContext(step=0, optimizer=opt, scheduler=scheduler),
        LowerLRParams(factor=0.1, min_lr=0.004),
    )
    floored = 0
    for _ in range(60):
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)
        for lr, ref in zip(_lrs(opt), _lrs(ref_opt), strict=True):
            want = max(ref * 0.1, min(ref, 0.004))
            assert _close(lr, want), (lr, ref)
            assert lr <= ref * (1 + 1e-12)
            floored += ref * 0.1 < 0.004 <= ref
    assert floored > 20  # the floor was binding for a good part of the run


def test_tensor_lr_updated_in_place() -> None:
    def make() -> tuple[torch.optim.Optimizer, Any]:
        p = torch.nn.Parameter(torch.zeros(3))
        o = torch.optim.Adam([p], lr=torch.tensor(1e-3), foreach=False)
        return o, sched.LambdaLR(o, lambda s: 0.99**s)

    ref_opt, ref_sched = make()
    opt, scheduler = make()
    lr_tensor = opt.param_groups[0]["lr"]
    out = LowerLR().apply(
        ActionContext(step=0, optimizer=opt, scheduler=scheduler), LowerLRParams(factor=0.25)
    )
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert _close(out.after["lr"][0], 0.25e-3, 1e-6)  # an fp32 tensor
    for _ in range(100):
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)
    assert opt.param_groups[0]["lr"] is lr_tensor
    assert _close(float(lr_tensor), float(ref_opt.param_groups[0]["lr"]) * 0.25, 1e-6)
    assert isinstance(opt.param_groups[0][SCHEDULED_LR_KEY], torch.Tensor)


def test_hand_written_loop_reads_lr_scale() -> None:
    opt, _ = _optimizer()
    action = LowerLR()

    def get_lr(it: int) -> float:  # nanoGPT: warmup then cosine, set by the loop every step
        return 0.1 * min(1.0, (it + 1) / 10) * (0.5 * (1 + math.cos(math.pi * it / 200)))

    for it in range(150):
        lr = get_lr(it) * action.control.lr_scale
        for g in opt.param_groups:
            g["lr"] = lr
        if it == 50:
            action.apply(ActionContext(step=it, optimizer=opt), LowerLRParams(factor=0.5))
            assert action.control.lr_scale == 0.5
            assert _lrs(opt) == [lr * 0.5, lr * 0.5]  # also applied in place at once
        if it > 50:
            assert _lrs(opt) == [get_lr(it) * 0.5] * 2
    action.apply(ActionContext(step=150, optimizer=opt), LowerLRParams(factor=0.1, min_lr=0.003))
    assert action.control.lr_scale == pytest.approx(0.05)
    assert action.control.scaled_lr(0.1) == pytest.approx(0.005)
    assert action.control.scaled_lr(0.01) == 0.003  # floor
    assert action.control.scaled_lr(0.002) == 0.002  # never above the loop's own LR


def test_constant_lr_without_scheduler_and_selection_by_name_and_index() -> None:
    opt, _ = _optimizer()
    action = LowerLR()
    action.apply(ActionContext(step=0, optimizer=opt), LowerLRParams(factor=0.5, groups=["router"]))
    assert _lrs(opt) == [0.1, 0.025]
    assert action.control.scale_for(1) == 0.5 and action.control.lr_scale == 1.0
    action.apply(ActionContext(step=1, optimizer=opt), LowerLRParams(factor=0.5, groups=[0, 1]))
    assert _lrs(opt) == [0.05, 0.0125]
    assert select_groups(opt, ["body", 1]) == [0, 1]
    with pytest.raises(ValueError, match="no param group named 'experts'"):
        select_groups(opt, ["experts"])
    with pytest.raises(ValueError, match="out of range"):
        select_groups(opt, [5])
    with pytest.raises(ValueError, match="router parameters"):
        select_groups(opt, "router")
    with pytest.raises(ValueError, match="needs the optimizer"):
        action.apply(ActionContext(step=2), LowerLRParams())
    with pytest.raises(ValueError):
        LowerLRParams(factor=1.5)
    with pytest.raises(ValueError):
        LowerLRParams(factor=0.5, bogus=1)


def test_dry_run_changes_nothing_and_predicts() -> None:
    opt, _ = _optimizer()
    scheduler = sched.StepLR(opt, step_size=3, gamma=0.5)
    action = LowerLR()
    ctx = ActionContext(step=0, optimizer=opt, scheduler=scheduler, dry_run=True)
    out = action.apply(ctx, LowerLRParams(factor=0.2))
    assert _lrs(opt) == [0.1, 0.05] and type(scheduler) is sched.StepLR
    assert not action.control.active
    assert all(SCHEDULED_LR_KEY not in g for g in opt.param_groups)
    ctx.dry_run = False
    real = action.apply(ctx, LowerLRParams(factor=0.2))
    assert real.after == out.after and real.before == out.before


def test_apply_is_all_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    opt, _ = _optimizer()
    scheduler = sched.StepLR(opt, step_size=3, gamma=0.5)
    action = LowerLR()
    calls = {"n": 0}
    real_set = lr_mod._set_lr

    def failing_set(group: dict, value: Any) -> None:
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("device error")
        real_set(group, value)

    monkeypatch.setattr(lr_mod, "_set_lr", failing_set)
    with pytest.raises(RuntimeError, match="device error"):
        action.apply(
            ActionContext(step=0, optimizer=opt, scheduler=scheduler), LowerLRParams(factor=0.5)
        )
    monkeypatch.setattr(lr_mod, "_set_lr", real_set)
    assert _lrs(opt) == [0.1, 0.05]
    assert type(scheduler) is sched.StepLR and not action.control.active
    assert all(SCHEDULED_LR_KEY not in g for g in opt.param_groups)
    assert [float(x) for x in scheduler.get_last_lr()] == [0.1, 0.05]


def test_state_round_trip_and_reapply_after_rollback() -> None:
    kind = "cosine"
    ref_opt, _ = _optimizer()
    ref_sched = SCHEDULERS[kind](ref_opt)
    opt, _ = _optimizer()
    scheduler = SCHEDULERS[kind](opt)
    for _ in range(10):
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)

    def snapshot() -> list[dict]:
        return [copy.deepcopy(x.state_dict()) for x in (opt, scheduler, ref_opt, ref_sched)]

    def restore(states: list[dict], *targets: Any) -> None:
        for target, state in zip(targets, states, strict=True):
            target.load_state_dict(copy.deepcopy(state))

    before_action = snapshot()
    action = LowerLR()
    ctx = ActionContext(step=10, optimizer=opt, scheduler=scheduler)
    action.apply(ctx, LowerLRParams(factor=0.4))
    for _ in range(20):
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)
    after_action = snapshot()
    for _ in range(15):
        _step(opt, scheduler)

    # 1. Rollback to a state saved before the action: the scale is re-imposed.
    restore(before_action, opt, scheduler, ref_opt, ref_sched)
    assert all(SCHEDULED_LR_KEY not in g for g in opt.param_groups)  # the old state predates it
    action.reapply(ctx)
    for _ in range(50):
        assert all(_close(a, r * 0.4) for a, r in zip(_lrs(opt), _lrs(ref_opt), strict=True))
        _step(ref_opt, ref_sched)
        _step(opt, scheduler)

    # 2. Restart: new optimizer, scheduler and action, loaded from a state saved after it.
    opt2, _ = _optimizer()
    sched2 = SCHEDULERS[kind](opt2)
    restore(after_action, opt2, sched2, ref_opt, ref_sched)
    action2 = LowerLR()
    action2.load_state_dict(action.state_dict())
    assert action2.state_dict() == {"groups": [[0, 0.4, 0.0], [1, 0.4, 0.0]], "watches": []}
    action2.reapply(ActionContext(step=30, optimizer=opt2, scheduler=sched2))
    for _ in range(50):
        assert all(_close(a, r * 0.4) for a, r in zip(_lrs(opt2), _lrs(ref_opt), strict=True))
        _step(ref_opt, ref_sched)
        _step(opt2, sched2)
    with pytest.raises(ValueError, match="LR control state"):
        action2.load_state_dict({"groups": [[0, 2.0, 0.0]]})
