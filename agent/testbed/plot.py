"""One run on one page: the loss and the mechanism monitors on a shared step axis (PNG)."""

from __future__ import annotations

import math
from pathlib import Path

from agent import samples as names
from agent.testbed.divergence import degradation_step, divergence_step, ema
from agent.testbed.metrics_file import monitor_series, read_metrics


def plot_run(metrics_path: str | Path, png_path: str | Path, *, title: str = "") -> Path:
    """Plot metrics.jsonl to ``png_path`` (matplotlib, Agg backend) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    if not records:
        raise ValueError(f"{metrics_path}: no records to plot")
    steps = [r["step"] for r in records]
    losses = [r["loss"] for r in records]
    fault_steps = [r["step"] for r in records if r.get("fa_fault") or r.get("router_fault")]

    fig, axes = plt.subplots(5, 1, figsize=(10, 13), sharex=True)
    ax = axes[0]
    ax.plot(steps, losses, color="0.8", lw=0.6, label="loss")
    ax.plot(steps, ema(losses), color="k", lw=1.2, label="loss EMA")
    finite = [v for v in losses if math.isfinite(v)]
    if finite:
        ax.set_ylim(min(finite) - 0.1, min(max(finite), min(finite) + 4.0) + 0.1)
    for step, label, color in (
        (divergence_step(losses), "divergence", "red"),
        (degradation_step(losses), "degradation", "orange"),
    ):
        if step is not None:
            ax.axvline(step, color=color, ls="--", lw=1, label=f"{label} @ {step}")
    ax.set_ylabel("cross-entropy (nats)")

    panels = [
        (axes[1], names.QK_DELTA2_ENTROPY, "mean", "-", "H(Delta_2), head mean (nats)"),
        (axes[1], names.DWQ_ENTROPY, "mean", ":", None),
        (axes[2], names.WQ_SPECTRAL_NORM, "max", "-", "max_h ||W_q^h||_2"),
        (axes[3], names.ROUTER_ENTROPY, "mean", "-", "routing entropy (nats)"),
        (axes[4], names.ROUTER_EPS, "mean", "-", "router eps"),
        (axes[4], names.ROUTER_LOAD_MAX, "mean", ":", None),
    ]
    for axis, metric, reduce, style, ylabel in panels:
        for module, (xs, ys) in monitor_series(records, metric, reduce=reduce).items():
            axis.plot(xs, ys, style, lw=1.2, label=f"{metric} {module}")
        if ylabel:
            axis.set_ylabel(ylabel)
    axes[2].set_yscale("log")
    axes[4].set_yscale("log")
    axes[1].set_title("solid: H(Delta_2); dotted: H(dW_q)", fontsize=8)
    axes[4].set_title("solid: eps; dotted: max load fraction", fontsize=8)
    for axis in axes:
        if fault_steps:
            axis.axvspan(fault_steps[0], steps[-1], color="red", alpha=0.06)
        axis.legend(fontsize=6, loc="best")
        axis.grid(alpha=0.3)
    axes[-1].set_xlabel("step (shaded: fault on)")
    fig.suptitle(title or str(metrics_path), fontsize=10)
    fig.tight_layout()
    png = Path(png_path)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png, dpi=90)
    plt.close(fig)
    return png
