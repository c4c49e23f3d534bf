"""A PyTorch Lightning run with mechwatch: a small regression model on synthetic data.

    pip install 'mechwatch[lightning]'
    python examples/lightning_train.py [--steps 200] [--out lightning_run]

One line adds the agent: ``callbacks=[MechwatchLightningCallback(config)]``. Its state is saved
in Lightning's checkpoints (under ``callbacks``) and restored with ``fit(..., ckpt_path=...)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning
import torch
from torch import nn

from agent.config import AgentConfig
from agent.integrations.lightning import MechwatchLightningCallback


class Regression(lightning.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 64), nn.GELU(), nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--out", type=Path, default=Path("lightning_run"))
    args = parser.parse_args()
    torch.manual_seed(0)
    x = torch.randn(4096, 8)
    y = x.sin().sum(-1, keepdim=True)
    data = torch.utils.data.DataLoader(list(zip(x, y, strict=True)), batch_size=32)
    config = AgentConfig.model_validate(
        {"run_dir": str(args.out / "mechwatch"), "checkpoints": {"enabled": True, "every": 50}}
    )
    callback = MechwatchLightningCallback(config)
    trainer = lightning.Trainer(
        max_steps=args.steps, accelerator="cpu", callbacks=[callback], logger=False
    )
    trainer.fit(Regression(), data)
    trainer.save_checkpoint(args.out / "last.ckpt")  # the agent's state rides along
    print(callback.agent.health() if callback.agent is not None else "no agent")


if __name__ == "__main__":
    main()
