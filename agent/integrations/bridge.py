"""What every trainer callback does with the agent, without any trainer imported.

``AgentBridge`` builds the :class:`~agent.agent.Agent` once the trainer has its optimizer and
scheduler (and routes a Hugging Face model's attention through the FP32-backward switch), sums
the step's losses on the device, steps the agent once per optimizer step, follows rollbacks
(the agent's step counter continues from the restored step; ``restores`` lists them) and tells
the callback when training must stop (a halt in ``raise`` or ``flag`` mode). Its state (the
agent's state and step counter, primitive types only) is what the callbacks save.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from agent.agent import Agent
from agent.config import AgentConfig
from agent.config_file import load_agent_config
from remediations.attention_switch import attention_precision
from remediations.halt import TrainingHalted


class AgentBridge:
    """The agent between a trainer's hooks (module docstring)."""

    def __init__(
        self,
        config: AgentConfig | str | Path | None,
        install_attention: bool,
        agent_kwargs: dict[str, Any],
    ) -> None:
        self.config = config
        self.install_attention = install_attention
        self.agent_kwargs = agent_kwargs
        self.agent: Agent | None = None
        self.next_step = 0  # the step the agent expects next
        self.restores: list[tuple[int, int]] = []  # (trainer step, restored agent step)
        self._loss_sum: torch.Tensor | None = None  # () on the device: no host sync
        self._loss_count = 0

    def build(
        self,
        module: torch.nn.Module,
        optimizer: Any,
        scheduler: Any,
        hf_model: torch.nn.Module | None,
    ) -> Agent:
        """The agent on ``module``; ``hf_model`` (if any) gets the FP32-backward switch."""
        config = self.config
        if config is None:
            config = AgentConfig()
        elif not isinstance(config, AgentConfig):
            config = load_agent_config(config)
        switch = self.agent_kwargs.setdefault("attention_switch", attention_precision)
        if self.install_attention and hf_model is not None:
            from remediations.hf_attention import install_hf_attention

            try:
                install_hf_attention(hf_model, switch=switch)
            except ValueError as exc:  # the run goes on, without the switch
                warnings.warn(f"mechwatch: attention stays as it is: {exc}", stacklevel=3)
        self.agent = Agent(module, optimizer, scheduler, config, **self.agent_kwargs)
        return self.agent

    def add_loss(self, loss: object) -> None:
        """Count one forward's scalar loss towards this optimizer step's mean."""
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().float().reshape(())
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_count += 1

    def step(self, trainer_step: int, loss_scale: float = 1.0) -> bool:
        """One optimizer step done: step the agent with the mean loss (times ``loss_scale``).
        Returns True when training must stop."""
        if self.agent is None:
            return False
        loss = None
        if self._loss_sum is not None and self._loss_count:
            loss = self._loss_sum * (loss_scale / self._loss_count)
        self._loss_sum, self._loss_count = None, 0
        expected = self.next_step + 1
        try:
            self.next_step = self.agent.step(self.next_step, loss=loss)
        except TrainingHalted:
            return True
        if self.next_step != expected:  # rolled back: model, optimizer, scheduler restored
            self.restores.append((trainer_step, self.next_step - 1))
        return self.agent.should_stop

    def state_dict(self) -> dict[str, Any]:
        assert self.agent is not None
        return {"next_step": self.next_step, "agent": self.agent.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        assert self.agent is not None
        self.agent.load_state_dict(state["agent"])
        self.next_step = int(state["next_step"])

    def close(self) -> None:
        if self.agent is not None:
            self.agent.close()


class BridgedCallback:
    """What a callback built on an :class:`AgentBridge` shows of it."""

    bridge: AgentBridge

    @property
    def agent(self) -> Agent | None:
        return self.bridge.agent

    @property
    def next_step(self) -> int:
        """The step the agent expects next."""
        return self.bridge.next_step

    @property
    def restores(self) -> list[tuple[int, int]]:
        """(trainer step, restored agent step) of every rollback."""
        return self.bridge.restores


def find_hf_model(module: torch.nn.Module) -> torch.nn.Module | None:
    """The first Hugging Face model inside ``module`` (itself included), else None."""
    return next((m for m in module.modules() if _is_hf_model(m)), None)


def _is_hf_model(module: torch.nn.Module) -> bool:
    return hasattr(module, "config") and hasattr(module, "set_attn_implementation")
