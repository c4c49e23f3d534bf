"""Hugging Face ``Trainer`` integration: ``MechwatchCallback``.

    trainer = Trainer(model, args, train_dataset=data, callbacks=[MechwatchCallback(config)])
    trainer.train()

- ``on_train_begin``: builds the :class:`~agent.agent.Agent` on the Trainer's model, optimizer
  and LR scheduler, and routes the model's attention through the FP32-backward switch
  (``remediations.hf_attention.install_hf_attention``; a model it cannot serve exactly gets a
  warning naming why, and trains on without the switch).
- ``on_optimizer_step`` (after ``optimizer.step()``, before the scheduler's step and
  ``zero_grad``: the gradients are still there for the agent's grad norm, and a checkpoint and
  its restore both sit at that point): ``agent.step`` with the mean training loss of the
  step's forwards (the ``loss`` the model returns, read by a forward hook, summed on the
  device; a loss the Trainer computes outside the model, e.g. with label smoothing, is not seen
  and the loss rules stay idle).
- A halt (``raise`` or ``flag`` mode) sets ``control.should_training_stop``. A rollback restores
  model, optimizer and scheduler in place from the agent's checkpoint; the Trainer continues
  with its next (fresh) batches and the agent's step counter continues from the restored step
  (``restores`` lists them).
- ``on_save``: the agent's state and step counter go into the Trainer's checkpoint folder as
  ``mechwatch_state.pt`` (primitive types only, loaded with ``weights_only=True``);
  ``trainer.train(resume_from_checkpoint=...)`` reads them back at ``on_train_begin``.
- ``on_train_end``: closes the agent (``close()`` does it after a crash).
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from agent.config import AgentConfig
from agent.integrations.bridge import AgentBridge, BridgedCallback

STATE_FILE = "mechwatch_state.pt"
STATE_VERSION = 1


class MechwatchCallback(BridgedCallback, TrainerCallback):
    """Runs a mechwatch agent inside a ``transformers.Trainer`` (module docstring).

    ``config``: an :class:`AgentConfig`, a YAML path, or None (defaults). ``agent_kwargs`` go
    to ``agent.Agent`` (``notifiers``, ``checkpoints``, ``attention_switch``, ``on_metrics``,
    ...). ``install_attention``: route attention through the FP32-backward switch.
    """

    def __init__(
        self,
        config: AgentConfig | str | Path | None = None,
        *,
        install_attention: bool = True,
        **agent_kwargs: Any,
    ) -> None:
        self.bridge = AgentBridge(config, install_attention, agent_kwargs)
        self._hook: torch.utils.hooks.RemovableHandle | None = None

    # -- Trainer events ----------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        if self.bridge.agent is None:
            self.bridge.build(model, optimizer, kwargs.get("lr_scheduler"), model)
            self._hook = model.register_forward_hook(self._record_loss)
        self.bridge.next_step = state.global_step
        if state.global_step > 0:
            self._resume(args.output_dir, state.global_step)
        return control

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self.bridge.step(state.global_step):
            control.should_training_stop = True
        return control

    def on_save(self, args, state, control, **kwargs):
        if self.bridge.agent is not None and state.is_world_process_zero:
            folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
            _save_state(folder, self.bridge.state_dict())
        return control

    def on_train_end(self, args, state, control, **kwargs):
        self.close()
        return control

    # -- parts -------------------------------------------------------------------------------
    def close(self) -> None:
        """Remove the loss hook and close the agent."""
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self.bridge.close()

    def _record_loss(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        if module.training:
            loss = output.get("loss") if isinstance(output, Mapping) else None
            self.bridge.add_loss(loss if loss is not None else getattr(output, "loss", None))

    def _resume(self, output_dir: str, global_step: int) -> None:
        path = Path(output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{global_step}" / STATE_FILE
        if not path.exists():
            warnings.warn(
                f"mechwatch: resuming at step {global_step} without the agent's state ({path} "
                "is missing): alerts and actions start afresh",
                stacklevel=3,
            )
            return
        saved = torch.load(path, map_location="cpu", weights_only=True)
        if saved.get("version") != STATE_VERSION:
            raise ValueError(f"{path}: mechwatch state version {saved.get('version')!r}")
        self.bridge.load_state_dict(saved)


def _save_state(folder: str, state: dict[str, Any]) -> None:
    """Write ``state`` atomically into ``folder`` (a crash leaves the old file or none)."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, STATE_FILE)
    tmp = path + ".tmp"
    torch.save({"version": STATE_VERSION, **state}, tmp)
    os.replace(tmp, path)
