"""The rollback action: which checkpoint it restores, bit-for-bit restore and continuation,
corrupt checkpoints, the loop guard, escalation."""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pydantic
import pytest
import torch
from state_compare import assert_bitwise_equal, snapshot

from agent.checkpoints import CheckpointManager
from agent.incidents import Incident
from remediations.base import ActionContext, ActionParams
from remediations.pacing import Pacing
from remediations.rollback import (
    NoUsableCheckpoint,
    RollbackAction,
    RollbackParams,
    latest_allowed_step,
)
from remediations.runner import ActionRunner

HEALTHY = {"healthy": True, "firing": []}
UNHEALTHY = {"healthy": False, "firing": ["router_entropy_drop"]}


class DataSource:
    """Batch i is a pure function of i, so the position is the whole data state."""

    def __init__(self) -> None:
        self.position = 0  # batches handed out so far

    def next_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(1_000 + self.position)
        self.position += 1
        x = torch.randn(16, 8, generator=g)  # (B, d_in)
        return x, x[:, :1].cos()  # (B, 1)

    def state(self) -> dict[str, int]:
        return {"position": self.position}

    def restore(self, state: dict[str, int] | None, skip_batches: int) -> None:
        self.position = (0 if state is None else state["position"]) + skip_batches


@dataclass
class Run:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any
    data: DataSource
    step: int = 0  # optimizer steps completed


def make_run(init_seed: int = 0) -> Run:
    torch.manual_seed(init_seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.GELU(), torch.nn.Dropout(0.25), torch.nn.Linear(32, 1)
    )
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.98**s)
    return Run(model, opt, sched, DataSource())


def train_step(run: Run) -> float:
    """One optimizer step drawing on torch (dropout), numpy and python RNGs."""
    x, y = run.data.next_batch()
    x = x * (1.0 + 0.01 * float(np.random.standard_normal())) + 0.01 * random.random()
    loss = torch.nn.functional.mse_loss(run.model(x), y)
    run.optimizer.zero_grad()
    loss.backward()
    run.optimizer.step()
    run.scheduler.step()
    run.step += 1
    return loss.item()


def make_manager(run: Run, directory: Path, **kw: Any) -> CheckpointManager:
    kw.setdefault("every_n_steps", 5)
    kw.setdefault("keep_last", 20)
    return CheckpointManager(
        directory,
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        data_state=run.data.state,
        restore_data=run.data.restore,
        agent_state=lambda: {"saved_at_step": run.step, "lr_scale": 1.0},
        **kw,
    )


def train_and_save(
    run: Run, manager: CheckpointManager, steps: int, health: dict | None = None
) -> tuple[list[float], dict[int, dict[str, torch.Tensor]]]:
    """Train ``steps`` steps with periodic checkpoints; the losses and, per saved step, a
    snapshot of the state taken at save time."""
    losses, snapshots = [], {}
    for _ in range(steps):
        losses.append(train_step(run))
        if manager.maybe_save(run.step, health=health or HEALTHY):
            snapshots[run.step] = snapshot(run)
    manager.flush()
    return losses, snapshots


def seed_globals(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def incident(onset_step: int | None, opened_step: int = 0) -> Incident:
    return Incident(
        id="inc-1",
        family="fa_precision",
        severity="critical",
        confidence=0.9,
        opened_step=opened_step,
        onset_step=onset_step,
    )


def context(run: Run, manager: CheckpointManager | None, onset: int | None, **kw: Any) -> Any:
    return ActionContext(
        step=run.step,
        model=run.model,
        optimizer=run.optimizer,
        scheduler=run.scheduler,
        incident=incident(onset, opened_step=run.step),
        checkpoints=manager,
        **kw,
    )


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 3] ^= 0x40
    path.write_bytes(bytes(data))


# --------------------------------------------------------------------------------------------


def test_corrupt_newest_then_rollback_restores_the_older_one_bit_for_bit(tmp_path: Path) -> None:
    seed_globals(0)
    run = make_run()
    manager = make_manager(run, tmp_path)
    _, at_save = train_and_save(run, manager, 40)
    flip_byte(tmp_path / "ckpt-30.pt")  # the newest checkpoint before onset - margin
    action = RollbackAction()
    outcome = action.apply(context(run, manager, onset=33), RollbackParams(margin_steps=2))

    assert outcome.before["step"] == 40
    assert outcome.after["step"] == 25
    assert outcome.after["checkpoint"] == str(tmp_path / "ckpt-25.pt")
    assert "ckpt-30.pt" in outcome.after["skipped_checkpoints"][0]
    assert_bitwise_equal(at_save[25], snapshot(run))
    assert run.data.position == 25 and run.scheduler.last_epoch == 25
    # The abandoned future (including the corrupt file) is gone; older ones remain.
    assert outcome.after["discarded_steps"] == [30, 35, 40]
    assert [i.step for i in manager.checkpoints()] == [25, 20, 15, 10, 5]
    restored = action.last_restore
    assert restored is not None and restored.step == 25 and restored.from_step == 40
    assert restored.agent_state == {"saved_at_step": 25, "lr_scale": 1.0}
    assert restored.data_state == {"position": 25} and restored.known_good


def test_training_after_rollback_matches_a_run_resumed_by_hand(tmp_path: Path) -> None:
    # The original run, 45 steps.
    seed_globals(7)
    original = make_run()
    manager = make_manager(original, tmp_path / "original")
    original_losses, _ = train_and_save(original, manager, 45)

    # The same run, then a rollback at step 45 past a corrupt checkpoint, then 20 more steps.
    seed_globals(7)
    run = make_run()
    manager = make_manager(run, tmp_path / "rolled")
    train_and_save(run, manager, 45)
    flip_byte(tmp_path / "rolled" / "ckpt-30.pt")
    outcome = RollbackAction().apply(
        context(run, manager, onset=34), RollbackParams(margin_steps=3)
    )
    run.step = outcome.after["step"]  # the loop continues from the restored step
    assert run.step == 25
    payload_by_hand = torch.load(tmp_path / "rolled" / "ckpt-25.pt", weights_only=True)
    rolled_losses, _ = train_and_save(run, manager, 20)

    # Resumed by hand: fresh objects with other initial weights and other RNG states.
    seed_globals(12345)
    by_hand = make_run(init_seed=99)
    by_hand.model.load_state_dict(payload_by_hand["model"])
    by_hand.optimizer.load_state_dict(payload_by_hand["optimizer"])
    by_hand.scheduler.load_state_dict(payload_by_hand["scheduler"])
    rng = payload_by_hand["rng"]
    random.setstate(rng["python"])
    np_rng = rng["numpy"]
    np.random.set_state(
        (
            np_rng["kind"],
            np.array(np_rng["keys"], dtype=np.uint32),
            np_rng["pos"],
            np_rng["has_gauss"],
            np_rng["cached_gaussian"],
        )
    )
    torch.set_rng_state(rng["torch"])
    by_hand.data.position = payload_by_hand["data"]["position"]
    by_hand.step = payload_by_hand["step"]
    hand_losses = [train_step(by_hand) for _ in range(20)]

    assert rolled_losses == hand_losses  # bitwise: float equality of every loss
    assert rolled_losses == original_losses[25:45]
    assert_bitwise_equal(snapshot(run), snapshot(by_hand))
    assert_bitwise_equal(snapshot(run), snapshot(original))
    assert run.data.position == by_hand.data.position == 45
    # The step-30 checkpoint was written again on the new timeline and verifies.
    assert manager.newest_verified().step == 45
    assert 30 in [i.step for i in manager.checkpoints()]


@pytest.mark.parametrize(
    "onset, margin, expected",
    [(380, 100, 200), (400, 100, 300), (301, 1, 300), (300, 0, 300), (299, 0, 200)],
)
def test_margin_never_chooses_a_checkpoint_after_onset_minus_margin(
    tmp_path: Path, onset: int, margin: int, expected: int
) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path, every_n_steps=100)
    for step in (100, 200, 300, 400):
        train_step(run)
        manager.save(step, health=HEALTHY)
    manager.flush()
    run.step = 450
    outcome = RollbackAction().apply(
        context(run, manager, onset=onset), RollbackParams(margin_steps=margin)
    )
    assert outcome.after["step"] == expected
    assert outcome.after["step"] <= latest_allowed_step(onset, margin)


def test_without_an_onset_the_current_step_is_the_onset(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path, every_n_steps=100)
    for step in (100, 200, 300):
        manager.save(step, health=HEALTHY)
    run.step = 350
    ctx = ActionContext(step=350, model=run.model, optimizer=run.optimizer,
                        scheduler=run.scheduler, checkpoints=manager)  # fmt: skip
    outcome = RollbackAction().apply(ctx, RollbackParams(margin_steps=100))
    assert outcome.after["step"] == 200 and outcome.before["onset_step"] == 350


def test_no_usable_checkpoint_pages_and_halts_instead_of_loading_garbage(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path)
    train_and_save(run, manager, 20)
    for step in (5, 10, 15):
        flip_byte(tmp_path / f"ckpt-{step}.pt")
    before = snapshot(run)
    action = RollbackAction()
    with pytest.raises(NoUsableCheckpoint, match="no usable checkpoint at or before step 16") as e:
        action.apply(context(run, manager, onset=18), RollbackParams(margin_steps=2))
    assert e.value.escalate  # pacing pages and halts instead
    for step in (5, 10, 15):
        assert f"ckpt-{step}.pt: sha256" in str(e.value)
    assert_bitwise_equal(before, snapshot(run))
    assert run.data.position == 20
    assert len(list(tmp_path.glob("ckpt-*.pt"))) == 4  # nothing deleted
    assert action.last_restore is None


def test_checkpoints_all_after_onset_minus_margin_are_not_usable(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path)
    train_and_save(run, manager, 20)
    with pytest.raises(NoUsableCheckpoint, match=r"checkpoints on disk: \[20, 15, 10, 5\]"):
        RollbackAction().apply(context(run, manager, onset=8), RollbackParams(margin_steps=5))


def test_unhealthy_checkpoints_are_skipped_unless_allowed(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path)
    train_and_save(run, manager, 10, health=UNHEALTHY)
    with pytest.raises(NoUsableCheckpoint, match="not known-good"):
        RollbackAction().apply(context(run, manager, onset=10), RollbackParams(margin_steps=0))
    params = RollbackParams(margin_steps=0, require_known_good=False)
    outcome = RollbackAction().apply(context(run, manager, onset=10), params)
    assert outcome.after["step"] == 10 and outcome.after["known_good"] is False


def test_loop_guard_escalates_after_max_per_window_rollbacks(tmp_path: Path) -> None:
    """The loop guard is pacing's cap on rollback, counted in steps run (never rewound)."""
    run = make_run()
    manager = make_manager(run, tmp_path, every_n_steps=10)
    train_and_save(run, manager, 20)  # checkpoints at 10 and 20
    runner = ActionRunner(lambda: context(run, manager, onset=run.step - 10))
    pacing = Pacing(runner.limits_of)
    params = {"margin_steps": 5, "max_per_window": 2, "window_steps": 100, "cooldown": 0}

    def roll_back_at(step: int, pacing: Pacing = pacing) -> str:
        run.step = step
        firing = [("rule", [("rollback", params)])]
        (admission,) = pacing.round(step, firing, f"incident-{step}")
        if admission.verdict == "run":
            result = runner.run("rollback", params)
            pacing.ran(admission, ok=result.ok)
            assert result.ok and result.restored_step == 20
            pacing.moved_to(result.restored_step)
            run.step = result.restored_step
        pacing.round(run.step, [], None)  # the rule stops: the episode is over
        return admission.verdict

    assert roll_back_at(50) == "run"  # clock 0
    assert roll_back_at(60) == "run"  # 40 steps trained since: clock 40
    before = snapshot(run)
    saved = pacing.state_dict()
    assert roll_back_at(60) == "escalate"  # clock 80: 2 rollbacks in the last 100 steps
    assert_bitwise_equal(before, snapshot(run))  # untouched

    # The guard survives a restart of the agent (pacing's state is saved with the agent's).
    restarted = Pacing(runner.limits_of)
    restarted.load_state_dict(saved)
    assert roll_back_at(60, restarted) == "escalate"

    # Once the window has passed in trained steps, a rollback is allowed again.
    run.step = 20
    assert roll_back_at(20 + 60) == "run"  # clock 80 + 60 = 140: the first left the window


def test_dry_run_describes_the_rollback_and_changes_nothing(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path)
    train_and_save(run, manager, 20)
    before = snapshot(run)
    action = RollbackAction()
    outcome = action.apply(
        context(run, manager, onset=13, dry_run=True), RollbackParams(margin_steps=2)
    )
    assert outcome.after == {"step": 10, "checkpoint": str(tmp_path / "ckpt-10.pt")}
    assert outcome.detail.startswith("would roll back from step 20 to checkpoint step 10")
    assert_bitwise_equal(before, snapshot(run))
    assert run.data.position == 20
    assert [i.step for i in manager.checkpoints()] == [20, 15, 10, 5]
    assert action.last_restore is None
    dry_none = action.apply(context(run, manager, onset=3, dry_run=True), RollbackParams())
    assert dry_none.after == {"escalate": True}


def test_skip_batches_moves_the_data_position_past_the_saved_one(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path)
    train_and_save(run, manager, 20)
    params = RollbackParams(margin_steps=0, skip_batches=3)
    outcome = RollbackAction().apply(context(run, manager, onset=16), params)
    assert outcome.after["step"] == 15 and outcome.after["skipped_batches"] == 3
    assert run.data.position == 18
    assert "skipped 3 batches" in outcome.detail


@pytest.mark.parametrize("protect", [False, True])
def test_protect_before_step_keeps_the_checkpoint_a_rollback_needs(
    tmp_path: Path, protect: bool
) -> None:
    run = make_run()
    manager = make_manager(
        run, tmp_path, every_n_steps=1, keep_last=2, keep_known_good=1, known_good_spacing=0
    )
    params = RollbackParams(margin_steps=1)
    train_and_save(run, manager, 4)
    assert [i.step for i in manager.checkpoints()] == [4, 3]
    onset = 4  # an incident opens at step 4 with its onset estimated at step 4
    if protect:  # what the agent does when an incident opens
        manager.protect_before_step = latest_allowed_step(onset, params.margin_steps) + 1
    train_and_save(run, manager, 6)  # later checkpoints are still marked healthy
    action = RollbackAction()
    if protect:
        assert [i.step for i in manager.checkpoints()] == [10, 9, 3]
        assert action.apply(context(run, manager, onset=onset), params).after["step"] == 3
    else:
        assert [i.step for i in manager.checkpoints()] == [10, 9]
        with pytest.raises(NoUsableCheckpoint):
            action.apply(context(run, manager, onset=onset), params)


def test_rollback_needs_checkpoints_enabled() -> None:
    run = make_run()
    with pytest.raises(ValueError, match="rollback needs checkpoints enabled"):
        RollbackAction().apply(context(run, None, onset=0), RollbackParams())
    with pytest.raises(ValueError, match="ctx.checkpoints is a str"):
        RollbackAction().apply(context(run, "runs/ckpt", onset=0), RollbackParams())


def test_params_are_validated() -> None:
    assert RollbackAction.name == "rollback" and RollbackAction.Params is RollbackParams
    assert RollbackParams() == RollbackParams(margin_steps=100, skip_batches=0)
    with pytest.raises(pydantic.ValidationError):
        RollbackParams(margin_steps=-1)
    with pytest.raises(pydantic.ValidationError):  # the loop guard belongs to pacing
        RollbackParams(max_per_window=2)
    with pytest.raises(pydantic.ValidationError, match="margin"):
        RollbackParams.model_validate({"margin": 5})  # unknown key


def test_base_params_fall_back_to_defaults(tmp_path: Path) -> None:
    run = make_run()
    manager = make_manager(run, tmp_path, every_n_steps=100)
    manager.save(100, health=HEALTHY)
    run.step = 300
    outcome = RollbackAction().apply(context(run, manager, onset=200), ActionParams())
    assert outcome.after["step"] == 100


def test_another_runs_checkpoints_are_never_rolled_back_to_nor_crowd_out_this_runs(
    tmp_path: Path,
) -> None:
    """A new run in a directory that holds an earlier run's checkpoints (some at the same step
    names, some newer): retention keeps this run's own, a rollback restores this run's state
    and never falls back on the other run's files."""
    seed_globals(1)
    earlier = make_run(init_seed=1)
    old = make_manager(earlier, tmp_path, every_n_steps=3, keep_last=100)
    train_and_save(earlier, old, 60)  # steps 3, 6, ..., 60
    old.close()

    seed_globals(0)
    run = make_run()
    manager = make_manager(run, tmp_path, keep_last=3, keep_known_good=0)
    _, at_save = train_and_save(run, manager, 40)  # steps 5, 10, ..., 40; 15 and 30 replace
    foreign = [s for s in range(3, 61, 3) if s not in (15, 30)]
    ours = [30, 35, 40]  # retention: the last 3 of this run, however many newer ones exist
    assert sorted(i.step for i in manager.checkpoints()) == sorted(ours + foreign)
    assert any("20 checkpoint(s)" in w and "another run" in w for w in manager.warnings)

    outcome = RollbackAction().apply(
        context(run, manager, onset=38), RollbackParams(margin_steps=2)
    )
    assert outcome.after["step"] == 35
    assert_bitwise_equal(at_save[35], snapshot(run))
    assert outcome.after["discarded_steps"] == [40]  # ours only: the other run's files stay
    assert sorted(i.step for i in manager.checkpoints()) == sorted([30, 35] + foreign)
    # Nothing of ours at or before step 20: the other run's ckpt-18 is no fallback.
    with pytest.raises(NoUsableCheckpoint, match="ckpt-18.pt: written by another run"):
        RollbackAction().apply(context(run, manager, onset=20), RollbackParams(margin_steps=0))


def test_restoring_a_checkpoint_continues_its_run(tmp_path: Path) -> None:
    """Resuming: a fresh manager restores the newest checkpoint of any run and adopts its
    lineage, so a later rollback may use that run's older checkpoints."""
    seed_globals(0)
    first = make_run()
    manager = make_manager(first, tmp_path)
    _, at_save = train_and_save(first, manager, 20)
    manager.close()

    run = make_run(init_seed=5)
    resumed = make_manager(run, tmp_path)
    assert resumed.newest_verified(own_run=True) is None  # nothing of its own yet
    info, payload = resumed.load_newest()
    assert resumed.restore(payload) == 20 and resumed.lineage == manager.lineage
    run.step = 20
    outcome = RollbackAction().apply(
        context(run, resumed, onset=12), RollbackParams(margin_steps=1)
    )
    assert outcome.after["step"] == 10
    assert_bitwise_equal(at_save[10], snapshot(run))
