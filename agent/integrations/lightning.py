"""PyTorch Lightning integration: ``MechwatchLightningCallback``.

    trainer = lightning.Trainer(max_steps=..., callbacks=[MechwatchLightningCallback(config)])
    trainer.fit(module, data)

- ``on_fit_start``: builds the :class:`~agent.agent.Agent` on the LightningModule, its first
  optimizer and LR scheduler; when the module holds a Hugging Face model, routes its attention
  through the FP32-backward switch (``install_hf_attention``; a model it cannot serve gets a
  warning and trains on).
- ``on_train_batch_end`` after each optimizer step (``trainer.global_step`` moved; with
  gradient accumulation the batches in between only add their loss): ``agent.step`` with the
  mean of the ``loss`` the ``training_step`` returned over the step's batches (on the device;
  Lightning divides each by ``accumulate_grad_batches``, which is undone).
- A halt (``raise`` or ``flag`` mode) sets ``trainer.should_stop``. A rollback restores module,
  optimizer and scheduler in place from the agent's checkpoint; Lightning continues with its
  next (fresh) batches and the agent's step counter continues from the restored step
  (``restores`` lists them).
- ``state_dict`` / ``load_state_dict``: the agent's state and step counter travel in the
  Lightning checkpoint under ``callbacks``; a state loaded before the agent exists is applied
  when it is built.
- ``teardown``: closes the agent.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import lightning

from agent.config import AgentConfig
from agent.integrations.bridge import AgentBridge, BridgedCallback, find_hf_model


class MechwatchLightningCallback(BridgedCallback, lightning.Callback):
    """Runs a mechwatch agent inside a ``lightning.Trainer`` (module docstring).

    ``config``: an :class:`AgentConfig`, a YAML path, or None (defaults). ``agent_kwargs`` go
    to ``agent.Agent``. ``install_attention``: route a Hugging Face model's attention through the
    FP32-backward switch.
    """

    def __init__(
        self,
        config: AgentConfig | str | Path | None = None,
        *,
        install_attention: bool = True,
        **agent_kwargs: Any,
    ) -> None:
        self.bridge = AgentBridge(config, install_attention, agent_kwargs)
        self._pending: dict[str, Any] | None = None  # loaded before the agent existed
        self._seen_step: int | None = None  # trainer.global_step at the last agent step

    # -- Lightning hooks ---------------------------------------------------------------------
    def on_fit_start(self, trainer: lightning.Trainer, pl_module: lightning.LightningModule):
        if self.bridge.agent is None:
            optimizer = trainer.optimizers[0] if trainer.optimizers else None
            configs = trainer.lr_scheduler_configs
            scheduler = configs[0].scheduler if configs else None
            self.bridge.build(pl_module, optimizer, scheduler, find_hf_model(pl_module))
        if self._pending is not None:
            self.bridge.load_state_dict(self._pending)
            self._pending = None
        self._seen_step = trainer.global_step

    def on_train_batch_end(
        self,
        trainer: lightning.Trainer,
        pl_module: lightning.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        self.bridge.add_loss(outputs.get("loss") if isinstance(outputs, Mapping) else outputs)
        if trainer.global_step == self._seen_step:
            return  # accumulating: no optimizer step in this batch
        self._seen_step = trainer.global_step
        if self.bridge.step(trainer.global_step, loss_scale=trainer.accumulate_grad_batches):
            trainer.should_stop = True

    def teardown(self, trainer: lightning.Trainer, pl_module: Any, stage: str) -> None:
        self.bridge.close()

    def state_dict(self) -> dict[str, Any]:
        if self.bridge.agent is None:
            return dict(self._pending or {})
        return self.bridge.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if not state_dict:
            return
        if self.bridge.agent is None:
            self._pending = dict(state_dict)
        else:
            self.bridge.load_state_dict(state_dict)
