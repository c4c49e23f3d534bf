"""MechwatchLightningCallback really trains a tiny model with ``lightning.Trainer``: one agent
step per optimizer step (also with gradient accumulation, with the true mean loss), its state in
the checkpoint's ``callbacks`` and back on resume, a rollback on a non-finite loss after which
training goes on, and a halt that stops the Trainer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

lightning = pytest.importorskip("lightning")

from agent.config import AgentConfig  # noqa: E402
from agent.integrations.lightning import MechwatchLightningCallback  # noqa: E402


class Regression(lightning.LightningModule):
    def __init__(self, nan_at: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 1))
        self.nan_at = nan_at
        self.losses: list[float] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.losses.append(float(loss.detach()))
        if self.global_step == self.nan_at:
            loss = loss * math.nan
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.SGD(self.parameters(), lr=0.05)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.99)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler}}


def _data() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(64, 4, generator=g)
    y = x.sum(-1, keepdim=True)
    return torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=4)


def _callback(tmp_path: Path) -> MechwatchLightningCallback:
    config = AgentConfig.model_validate(
        {
            "run_dir": str(tmp_path / "mechwatch"),
            "checkpoints": {"enabled": True, "every": 2},
            "symptoms": {"every": 1},
            "watchdog": {"enabled": False},
        }
    )
    return MechwatchLightningCallback(config)


def _trainer(callback, max_steps: int, **kwargs) -> lightning.Trainer:
    return lightning.Trainer(
        max_steps=max_steps,
        accelerator="cpu",
        devices=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **kwargs,
    )


def test_one_agent_step_per_optimizer_step_with_the_mean_loss(tmp_path: Path) -> None:
    callback = _callback(tmp_path)
    module = Regression()
    _trainer(callback, max_steps=4, accumulate_grad_batches=2).fit(module, _data())
    agent = callback.agent
    assert agent is not None and agent._last_step == 3 and callback.next_step == 4
    last_two = module.losses[-2:]  # the two batches of the last optimizer step
    assert agent.latest_metrics()["loss"] == pytest.approx(sum(last_two) / 2, rel=1e-6)
    # the gradients are still there at the callback: the agent's own grad norm is measured
    assert [s for s, _ in agent.store.series("grad_norm")] == [0, 1, 2, 3]
    assert all(v > 0 for _, v in agent.store.series("grad_norm"))


def test_state_travels_in_the_lightning_checkpoint(tmp_path: Path) -> None:
    callback = _callback(tmp_path)
    trainer = _trainer(callback, max_steps=3)
    trainer.fit(Regression(), _data())
    path = tmp_path / "run.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, map_location="cpu", weights_only=False)["callbacks"]
    (state,) = [v for k, v in saved.items() if "MechwatchLightningCallback" in k]
    assert state["next_step"] == 3 and "engine" in state["agent"]
    resumed = _callback(tmp_path / "again")
    _trainer(resumed, max_steps=5).fit(Regression(), _data(), ckpt_path=path)
    assert resumed.next_step == 5  # 3 from the checkpoint, then steps 3 and 4


def test_a_non_finite_loss_rolls_back_and_training_goes_on(tmp_path: Path) -> None:
    callback = _callback(tmp_path)
    module = Regression(nan_at=5)
    trainer = _trainer(callback, max_steps=8)
    trainer.fit(module, _data())
    assert callback.restores == [(6, 4)]  # after Lightning's step 6, back to step 4's checkpoint
    assert trainer.global_step == 8
    assert all(torch.isfinite(p).all() for p in module.parameters())


def test_a_halt_stops_the_trainer(tmp_path: Path) -> None:
    callback = _callback(tmp_path)

    class Halt(lightning.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 2:
                request = {"reason": "test", "incident_id": None, "step": 2, "mode": "flag"}
                callback.agent.actions.action("halt").request = request

    trainer = _trainer(callback, max_steps=8)
    trainer.callbacks.append(Halt())
    trainer.fit(Regression(), _data())
    assert trainer.global_step == 3
