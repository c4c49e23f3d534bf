"""A plain PyTorch training loop with mechwatch: the test-bed MoE model on synthetic data,
with the emulated biased attention fault switched on at step 500.

    python examples/train_with_mechwatch.py [--steps 1200] [--no-fault]

The agent is three lines (construct, step, close); the rest is an ordinary loop. The two data
hooks let a rollback put the data stream back where the restored checkpoint was taken, and the
loop continues from the step that ``agent.step`` returns.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from agent import Agent
from agent.testbed.attention import AttentionFault
from agent.testbed.data import MarkovSource
from agent.testbed.model import MoETransformer, TestbedConfig


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--no-fault", action="store_true")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)

    config = TestbedConfig()
    model = MoETransformer(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 100))
    source = MarkovSource(config.vocab, seed=1234)
    generator = torch.Generator().manual_seed(0)

    def data_state() -> dict:
        return {"generator": generator.get_state()}

    def restore_data(state: dict, skip_batches: int) -> None:
        generator.set_state(state["generator"])

    agent = Agent.from_config(
        Path(__file__).with_name("mechwatch.yaml"),
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        data_state=data_state,
        restore_data=restore_data,
    )
    step = 0
    with agent:
        while step < args.steps:
            if step == 500 and not args.no_fault:  # the "hardware" starts rounding badly
                model.set_attention_fault(AttentionFault(sites=("dS",), bits=5, mode="floor"))
            batch = source.batch(16, config.seq_len, generator)  # (B, T + 1)
            logits, aux = model(batch[:, :-1])
            loss = F.cross_entropy(logits.reshape(-1, config.vocab), batch[:, 1:].reshape(-1))
            (loss + aux).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step = agent.step(step, loss=loss, grad_norm=grad_norm)
            if step % 100 == 0:
                family = agent.incident.family if agent.incident else None
                print(f"step {step}: loss {loss.item():.3f}, open incident: {family}")


if __name__ == "__main__":
    main()
