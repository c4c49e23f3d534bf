"""The pictures of docs/detection.md, from runs recorded by ``benchmarks/detection.py record``.

    python benchmarks/detection_figures.py [--root out/detection] [--seed 0] [--out docs/img]

Each panel shows the series the shipped rules watch (the same samples the agent measured), the
step at which a rule fired (replayed through the shipped packs) and, for contrast, when the
loss detectors people use today fired on the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.eventlog import read_events
from agent.replay import replay
from agent.testbed.divergence import ema
from agent.testbed.loss_baselines import earliest_loss_alarm
from remediations.registry import validate_action


def layer_series(folder: Path, metric: str, key: str) -> dict[str, tuple[list, list]]:
    """{label value of ``key``: (steps, mean of the samples of that step)} from a run's event
    log (the head mean of a layer, the param mean of its controls)."""
    points: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for e in read_events(folder / "events.jsonl"):
        if e["kind"] != "metrics":
            continue
        for step, name, labels, value in e["samples"]:
            if name == metric:
                points[labels.get(key, "")][step].append(value)
    return {k: (sorted(v), [sum(v[s]) / len(v[s]) for s in sorted(v)]) for k, v in points.items()}


def first_alert(folder: Path, family: str) -> int | None:
    return (
        replay(folder / "events.jsonl", action_validator=validate_action).first_firing().get(family)
    )


def _mark(ax, step, label, color, style="--") -> None:
    if step is not None:
        ax.axvline(step, color=color, ls=style, lw=1.2, label=f"{label} @ {step}")


def fa_panels(root: Path, seed: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [
        ("fa_floor_6", "biased attention backward (floor, 6 bits, from step 500)"),
        ("data_shift", "data shift at step 900 (healthy: the model relearns)"),
        ("lr_x0.3", "learning rate x0.3 at step 900 (healthy)"),
    ]
    fig, axes = plt.subplots(len(cases), 2, figsize=(12, 3.3 * len(cases)))
    for row, (name, title) in enumerate(cases):
        folder = root / f"{name}_s{seed}"
        run = json.loads((folder / "result.json").read_text())
        qk = layer_series(folder, "qk_delta2_entropy", "layer")
        controls = layer_series(folder, "control_update_entropy", "layer")
        ax = axes[row][0]
        for layer, (steps, values) in sorted(qk.items()):
            ax.plot(steps, values, lw=1.4, label=f"H(Delta_2) {layer}")
        for layer, (steps, values) in sorted(controls.items()):
            ax.plot(steps, values, lw=1.0, ls=":", label=f"controls {layer}")
        alert = first_alert(folder, "fa_precision")
        _mark(ax, alert, "fa_precision alert", "red")
        start = run["config"]["fault_start"] if name.startswith("fa_") else 100
        loss_step, loss_name = earliest_loss_alarm(run["losses"], min_step=start)
        _mark(ax, loss_step, f"first loss detector ({loss_name})", "black", ":")
        ax.set_title(title, fontsize=9)
        ax.set_ylabel("spectral entropy (nats)")
        ax.legend(fontsize=6)
        ax2 = axes[row][1]
        ax2.plot(ema(run["losses"]), color="k", lw=1.2, label="loss (EMA 50)")
        _mark(ax2, alert, "fa_precision alert", "red")
        _mark(ax2, loss_step, "first loss detector", "black", ":")
        ax2.set_ylabel("cross-entropy (nats)")
        ax2.legend(fontsize=6)
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.tight_layout()
    path = out / "detection_fa.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def router_panel(root: Path, seed: int, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = ["clean", "big_model", "router_x3", "router_x10", "router_x30"]
    fig, ax = plt.subplots(figsize=(10, 4))
    for name in cases:
        folder = root / f"{name}_s{seed}"
        series = layer_series(folder, "router_entropy_norm", "router")
        steps, values = series["blocks.0.moe.gate"]
        (line,) = ax.plot(steps, values, lw=1.3, label=f"{name} (layer 0)")
        alert = first_alert(folder, "router_instability")
        if alert is not None:
            ax.axvline(alert, color=line.get_color(), ls="--", lw=1)
    ax.axvspan(0, 200, color="0.9", label="warm-up: the rule starts at 200")
    ax.set_xlabel("step (dashed: the router rule fired)")
    ax.set_ylabel("routing entropy / ln E")
    ax.set_xlim(0, 1200)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out / "detection_router.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _push_ratio(steps: list[int], values: list[float], window: int = 8) -> list[float]:
    """Each read-out's update over the median of the previous ``window`` (a picture of what the
    rule's ``requires`` detector compares; it does not learn the values it triggered on)."""
    out = []
    for i, v in enumerate(values):
        before = sorted(values[max(0, i - window) : i])
        out.append(v / before[len(before) // 2] if before else float("nan"))
    return out


def router_push_panel(cases: list[tuple[Path, str, str]], out: Path) -> Path:
    """Routing entropy (top) and the router's update against its recent median (bottom) for
    ``cases`` (folder, router, label): a router that sharpens on its own and one that is pushed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for folder, router, label in cases:
        steps, values = layer_series(folder, "router_entropy_norm", "router")[router]
        (line,) = top.plot(steps, values, lw=1.2, label=label)
        u_steps, u = layer_series(folder, "router_update_rel_norm", "router")[router]
        keep = [i for i, st in enumerate(u_steps) if st >= 200]
        ratio = _push_ratio([u_steps[i] for i in keep], [u[i] for i in keep])
        bottom.plot([u_steps[i] for i in keep], ratio, lw=1.2, color=line.get_color())
        alert = first_alert(folder, "router_instability")
        if alert is not None:
            for ax in (top, bottom):
                ax.axvline(alert, color=line.get_color(), ls="--", lw=1)
    top.set_yscale("log")
    top.set_ylabel("routing entropy / ln E (log)")
    top.legend(fontsize=7)
    bottom.axhline(2.0, color="0.4", ls=":", lw=1, label="the rule requires x2")
    bottom.set_ylabel("router update / its median\nof the 8 read-outs before")
    bottom.set_xlabel("step (dashed: the router rule fired)")
    bottom.legend(fontsize=7)
    bottom.set_xlim(200, 2000)
    fig.tight_layout()
    path = out / "detection_router_push.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path("out/detection"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("docs/img"))
    p.add_argument(
        "--hf-root", type=Path, default=None, help="benchmarks/detection_hf.py runs (seed 7)"
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    print(fa_panels(args.root, args.seed, args.out))
    print(router_panel(args.root, args.seed, args.out))
    if args.hf_root is not None:
        cases = [
            (args.hf_root / "hf_clean_s7", "model.layers.2.mlp.gate", "HF Mixtral, healthy"),
            (
                args.hf_root / "hf_router_x30_nobal_s7",
                "model.layers.0.mlp.gate",
                "HF Mixtral, router LR x30 from 500",
            ),
            (args.root / f"router_x3_s{args.seed}", "blocks.0.moe.gate", "test bed, router LR x3"),
        ]
        print(router_push_panel(cases, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
