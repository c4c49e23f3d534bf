"""A Hugging Face ``Trainer`` run with mechwatch: a tiny Mixtral (MoE, GQA) built from a config,
trained on random tokens on the CPU.

    pip install 'mechwatch[hf]'
    python examples/hf_trainer.py [--steps 40] [--out hf_run]

One line adds the agent: ``callbacks=[MechwatchCallback(config)]``. It steps the agent at every
optimizer step, routes attention through the FP32-backward switch, keeps the agent's state in
the Trainer's checkpoints, and halts or rolls back the run when a rule says so.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers

from agent.config import AgentConfig
from agent.integrations.hf import MechwatchCallback


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--out", type=Path, default=Path("hf_run"))
    args = parser.parse_args()
    torch.manual_seed(0)
    model = transformers.MixtralForCausalLM(
        transformers.MixtralConfig(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
        )
    )
    ids = torch.randint(0, 128, (256, 32))
    data = [{"input_ids": row, "labels": row} for row in ids]
    config = AgentConfig.model_validate(
        {
            "run_dir": str(args.out / "mechwatch"),
            "checkpoints": {"enabled": True, "every": 10},
            "router": {"every": 5},
        }
    )
    trainer = transformers.Trainer(
        model=model,
        args=transformers.TrainingArguments(
            output_dir=str(args.out / "trainer"),
            per_device_train_batch_size=8,
            max_steps=args.steps,
            save_steps=20,
            logging_steps=10,
            learning_rate=1e-3,
            report_to=[],
            use_cpu=True,
        ),
        train_dataset=data,
        callbacks=[MechwatchCallback(config)],
    )
    callback = next(
        c for c in trainer.callback_handler.callbacks if isinstance(c, MechwatchCallback)
    )
    trainer.train()
    metrics = callback.agent.latest_metrics() if callback.agent is not None else {}
    for name, value in sorted(metrics.items()):
        if name.startswith(("router_entropy_norm", "loss")):
            print(f"{name} = {value:.4f}")


if __name__ == "__main__":
    main()
