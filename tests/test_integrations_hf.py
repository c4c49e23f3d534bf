"""MechwatchCallback really trains a tiny Llama with ``transformers.Trainer``: the agent steps at
every optimizer step, its state rides along in the Trainer's checkpoints and comes back on
resume, a non-finite loss rolls model, optimizer and scheduler back and training continues,
and a halt stops the Trainer.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")  # the Trainer needs it

from agent.config import AgentConfig  # noqa: E402
from agent.integrations.hf import STATE_FILE, MechwatchCallback  # noqa: E402
from remediations.attention_switch import AttentionPrecisionSwitch  # noqa: E402
from remediations.hf_attention import installed_layers  # noqa: E402


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=32,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


def _data(n: int = 32) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 64, (n, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in ids]


def _trainer(tmp_path: Path, callback: MechwatchCallback, max_steps: int, model=None):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"),
        per_device_train_batch_size=4,
        max_steps=max_steps,
        save_strategy="steps",
        save_steps=3,
        logging_steps=1000,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    return transformers.Trainer(
        model=model or _model(), args=args, train_dataset=_data(), callbacks=[callback]
    )


def _callback(tmp_path: Path, switch: AttentionPrecisionSwitch | None = None) -> MechwatchCallback:
    config = AgentConfig.model_validate(
        {
            "run_dir": str(tmp_path / "mechwatch"),
            "checkpoints": {"enabled": True, "every": 2},
            "symptoms": {"every": 1},
            "watchdog": {"enabled": False},
        }
    )
    return MechwatchCallback(config, attention_switch=switch or AttentionPrecisionSwitch())


def test_agent_steps_with_the_trainer_and_its_state_resumes(tmp_path: Path) -> None:
    switch = AttentionPrecisionSwitch()
    callback = _callback(tmp_path, switch)
    trainer = _trainer(tmp_path, callback, max_steps=6)
    trainer.train()
    agent = callback.agent
    assert agent is not None and agent._last_step == 5 and callback.next_step == 6
    assert installed_layers(trainer.model) == [
        "model.layers.0.self_attn",
        "model.layers.1.self_attn",
    ]
    assert agent.latest_metrics()["loss"] > 0  # the model's own loss reached the agent
    # on_optimizer_step comes before zero_grad: the agent's own grad norm is measured
    assert [s for s, _ in agent.store.series("grad_norm")] == list(range(6))
    assert all(v > 0 for _, v in agent.store.series("grad_norm"))
    for step in (3, 6):
        assert (tmp_path / "out" / f"checkpoint-{step}" / STATE_FILE).exists()
    # Resume from checkpoint 3 in a fresh Trainer: the agent's step counter comes back.
    resumed = _callback(tmp_path / "again")
    seen: list[int] = []

    class Spy(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            seen.append(resumed.next_step)

    trainer = _trainer(tmp_path, resumed, max_steps=6)
    trainer.add_callback(Spy())
    trainer.train(resume_from_checkpoint=str(tmp_path / "out" / "checkpoint-3"))
    assert seen == [3] and resumed.next_step == 6


class _NaNOnce(transformers.TrainerCallback):
    """Makes the model's loss NaN in the forwards of one optimizer step."""

    def __init__(self, model: torch.nn.Module, at_step: int) -> None:
        self.at_step = at_step
        self.step = 0
        model.register_forward_hook(self._hook)

    def on_step_end(self, args, state, control, **kwargs):
        self.step = state.global_step
        return control

    def _hook(self, module, args, output):
        if module.training and self.step == self.at_step:
            output["loss"] = output["loss"] * math.nan
        return output


def test_a_non_finite_loss_rolls_back_and_training_continues(tmp_path: Path) -> None:
    callback = _callback(tmp_path)
    model = _model()
    trainer = _trainer(tmp_path, callback, max_steps=8, model=model)
    trainer.add_callback(_NaNOnce(model, at_step=5))
    trainer.train()
    assert callback.restores == [(5, 4)]  # at Trainer step 5, back to the checkpoint of step 4
    assert trainer.state.global_step == 8  # and on to the end, with fresh batches
    assert all(torch.isfinite(p).all() for p in model.parameters())
    # The agent counts on from the restored step: steps 5 and 6 at Trainer steps 6 and 7.
    assert callback.next_step == 7


def test_a_halt_stops_the_trainer(tmp_path: Path) -> None:
    callback = _callback(tmp_path)

    class Halt(transformers.TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2:
                request = {"reason": "test", "incident_id": None, "step": 2, "mode": "raise"}
                callback.agent.actions.action("halt").request = request
            return control

    trainer = _trainer(tmp_path, callback, max_steps=8)
    trainer.add_callback(Halt())
    trainer.train()
    assert trainer.state.global_step == 3  # stopped at the optimizer step after the request
