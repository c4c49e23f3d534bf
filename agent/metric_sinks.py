"""Metrics where users look: the agent's samples in TensorBoard, Weights & Biases or a callback.

Each decision round's samples (already host floats: nothing more is synchronized) become
scalars named ``mechwatch/<metric>/<place>``: the place is the layer or router module name,
with per-head (and per-KV-head, per-control) values averaged per layer, so a 32-layer model
gives 32 curves per metric, not 1,024; series without labels are ``mechwatch/<metric>``
(``mechwatch/loss``). For example ``mechwatch/qk_delta2_entropy/model.layers.3.self_attn`` or
``mechwatch/router_entropy_norm/model.layers.3.mlp.gate``.

- ``CallbackSink(fn)``: ``fn(step, {name: value})`` (``Agent(..., on_metrics=fn)``);
- ``TensorBoardSink(log_dir)``: ``torch.utils.tensorboard.SummaryWriter`` (needs the
  ``tensorboard`` package: ``pip install 'mechwatch[tensorboard]'``);
- ``WandbSink()``: ``wandb.log`` into the run the user started (``pip install wandb``).

A sink that fails is reported once by the agent and skipped; training goes on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, Protocol

from agent.samples import Sample

PREFIX = "mechwatch"
_PLACE_LABELS = ("layer", "router")  # the label that names the place; the others are averaged


class MetricSink(Protocol):
    def write(self, step: int, metrics: dict[str, float]) -> None: ...

    def close(self) -> None: ...


def scalar_metrics(samples: Iterable[Sample]) -> dict[str, dict[int, float]]:
    """{name: {step: value}}: the samples of one round as named scalars (see the module
    docstring); samples of several steps keep their own steps."""
    sums: dict[tuple[str, int], list[float]] = {}
    for s in samples:
        labels = s.label_dict
        place = next((labels[k] for k in _PLACE_LABELS if k in labels), None)
        name = f"{PREFIX}/{s.metric}" + (f"/{place}" if place is not None else "")
        sums.setdefault((name, s.step), []).append(s.value)
    out: dict[str, dict[int, float]] = {}
    for (name, step), values in sums.items():
        out.setdefault(name, {})[step] = sum(values) / len(values)
    return out


def by_step(metrics: dict[str, dict[int, float]]) -> dict[int, dict[str, float]]:
    """The same scalars grouped by step, in step order."""
    out: dict[int, dict[str, float]] = {}
    for name, points in metrics.items():
        for step, value in points.items():
            out.setdefault(step, {})[name] = value
    return dict(sorted(out.items()))


class CallbackSink:
    def __init__(self, fn: Callable[[int, dict[str, float]], Any]) -> None:
        self.fn = fn

    def write(self, step: int, metrics: dict[str, float]) -> None:
        self.fn(step, metrics)

    def close(self) -> None:
        pass


class TensorBoardSink:
    def __init__(self, log_dir: str) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

        self.writer = SummaryWriter(log_dir=log_dir)

    def write(self, step: int, metrics: dict[str, float]) -> None:
        for name, value in metrics.items():
            self.writer.add_scalar(name, value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self) -> None:
        import wandb  # the user's run: wandb.init() is theirs

        self.wandb = wandb

    def write(self, step: int, metrics: dict[str, float]) -> None:
        # The user's own wandb.log calls own the step counter; ours ride along without one.
        self.wandb.log({**metrics, f"{PREFIX}/step": step})

    def close(self) -> None:
        pass


def write_round(sink: MetricSink, samples: list[Sample]) -> None:
    """One decision round's samples to ``sink``, step by step."""
    for step, metrics in by_step(scalar_metrics(samples)).items():
        sink.write(step, metrics)


def build_sinks(
    config: Any, run_dir: str, on_metrics: Callable[[int, dict[str, float]], Any] | None
) -> list[MetricSink]:
    """The sinks an ``AgentConfig.metrics`` section and an ``on_metrics`` callback ask for."""
    sinks: list[MetricSink] = []
    if on_metrics is not None:
        sinks.append(CallbackSink(on_metrics))
    if config.tensorboard is not None:
        from pathlib import Path

        log_dir = Path(config.tensorboard)
        sinks.append(TensorBoardSink(str(log_dir if log_dir.is_absolute() else run_dir / log_dir)))
    if config.wandb:
        sinks.append(WandbSink())
    return sinks
