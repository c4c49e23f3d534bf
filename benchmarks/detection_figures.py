"""The pictures of docs/detection.md, from runs recorded by ``benchmarks/detection.py record``.

    python benchmarks/detection_figures.py [--root out/detection] [--seed 0] [--out docs/img]
    python benchmarks/detection_figures.py --only-persistence --persistence-root out/e4
    python benchmarks/detection_figures.py --only-persistence --slow out/s4slow/fa_floor_8_s154 \
        out/s3eval2/lr_cosine_s138 out/s4slow/lr_x0.1_s154
    python benchmarks/detection_figures.py --only-persistence --margin \
        out/s6tune/big_model_s113:blocks.0.attn:"healthy s113":healthy ...

Each panel shows the series the shipped rules watch (the same samples the agent measured), the
step at which a rule fired (replayed through the shipped packs) and, for contrast, when the
loss detectors people use today fired on the same run.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
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


@dataclass(frozen=True)
class GatePicture:
    """A two-row picture: a rule's signal (top, log scale) and the second signal the rule
    ``requires`` (bottom, with its bar), per case (folder, label value, legend)."""

    key: str  # the label that names a series: router | layer
    signal: str  # the top row's metric
    gate: Callable[[Path, str], tuple[list[int], list[float]]]  # the bottom row's series
    family: str  # whose first alert is marked (dashed)
    top_label: str
    bottom_label: str
    bar: float
    bar_label: str
    xlabel: str
    xlim: tuple[int, int]
    file: str


def gate_picture(cases: list[tuple[Path, str, str]], spec: GatePicture, out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    for folder, name, label in cases:
        steps, values = layer_series(folder, spec.signal, spec.key)[name]
        (line,) = top.plot(steps, values, lw=1.2, label=label)
        bottom.plot(*spec.gate(folder, name), lw=1.1, color=line.get_color())
        alert = first_alert(folder, spec.family)
        if alert is not None:
            for ax in (top, bottom):
                ax.axvline(alert, color=line.get_color(), ls="--", lw=1)
    top.set_yscale("log")
    top.set_ylabel(spec.top_label)
    top.legend(fontsize=7)
    bottom.axhline(spec.bar, color="0.4", ls=":", lw=1, label=spec.bar_label)
    bottom.set_ylabel(spec.bottom_label)
    bottom.set_xlabel(spec.xlabel)
    bottom.legend(fontsize=7)
    bottom.set_xlim(*spec.xlim)
    fig.tight_layout()
    path = out / spec.file
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _router_push(folder: Path, router: str) -> tuple[list[int], list[float]]:
    u_steps, u = layer_series(folder, "router_update_rel_norm", "router")[router]
    keep = [i for i, st in enumerate(u_steps) if st >= 200]
    return [u_steps[i] for i in keep], _push_ratio([u_steps[i] for i in keep], [u[i] for i in keep])


# Routing entropy and the router's update against its recent median: a router that sharpens on
# its own and one that is pushed.
ROUTER_PUSH = GatePicture(
    key="router",
    signal="router_entropy_norm",
    gate=_router_push,
    family="router_instability",
    top_label="routing entropy / ln E (log)",
    bottom_label="router update / its median\nof the 8 read-outs before",
    bar=2.0,
    bar_label="the rule requires x2",
    xlabel="step (dashed: the router rule fired)",
    xlim=(200, 2000),
    file="detection_router_push.png",
)

# H(Delta_2) and the persistence of its top direction (head means of one layer): a healthy QK
# phase transition turns its direction, a biased backward holds it (the QK rule's `requires`), a
# fault whose direction wanders is left to the deep rule.
PERSISTENCE = GatePicture(
    key="layer",
    signal="qk_delta2_entropy",
    gate=lambda folder, layer: layer_series(folder, "qk_delta2_persistence", "layer")[layer],
    family="fa_precision",
    top_label="H(Delta_2), head mean (nats, log)",
    bottom_label="|cos| of Delta_2's top direction\nbetween two evaluations",
    bar=0.9,
    bar_label="the QK rule requires > 0.9",
    xlabel="step (dashed: fa_precision alert, the shipped rules)",
    xlim=(300, 2000),
    file="detection_persistence.png",
)


def slow_picture(folders: list[Path], out: Path, layer: str = "blocks.0.attn") -> Path:
    """The slow-collapse rule's three signals, layer ``layer`` of each run: H(Delta_2) (top,
    log), the persistence of its top direction (middle), the schedule's learning rate of the
    first group (bottom); dashed: the run's first fa_precision alert (the shipped rules)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(10, 7.5), sharex=True)
    for folder in folders:
        (line,) = top.plot(*layer_series(folder, "qk_delta2_entropy", "layer")[layer], lw=1.2)
        line.set_label(folder.name)
        color = line.get_color()
        middle.plot(*layer_series(folder, "qk_delta2_persistence", "layer")[layer], lw=1, c=color)
        lrs = layer_series(folder, "lr", "group")
        bottom.plot(*lrs[sorted(lrs)[0]], lw=1.2, color=color)
        alert = first_alert(folder, "fa_precision")
        if alert is not None:
            for ax in (top, middle, bottom):
                ax.axvline(alert, color=color, ls="--", lw=1)
    top.set_yscale("log")
    top.set_ylabel("H(Delta_2), head mean\n(nats, log)")
    top.legend(fontsize=7)
    middle.axhline(0.95, color="0.4", ls=":", lw=1, label="held: > 0.95 at every evaluation")
    middle.set_ylabel("|cos| of Delta_2's top\ndirection, two evaluations")
    middle.legend(fontsize=7)
    bottom.set_yscale("log")
    bottom.set_ylabel("learning rate (log)")
    bottom.set_xlabel("step (dashed: the run's first fa_precision alert, the shipped rules)")
    bottom.set_xlim(100, 2000)
    fig.tight_layout()
    path = out / "detection_slow.png"
    fig.savefig(path, dpi=80)
    plt.close(fig)
    return path


def _held_depth(folder: Path, layer: str, span: int = 100, within: int = 50):
    """Per evaluation of ``layer``: (step, highest head-mean persistence within ``within``
    steps (the gated rule's `requires`), H(Delta_2)'s highest value within ``span`` steps over
    its value now (how deep the collapse is))."""
    steps, h = layer_series(folder, "qk_delta2_entropy", "layer")[layer]
    p_steps, p = layer_series(folder, "qk_delta2_persistence", "layer")[layer]
    out = []
    for s, value in zip(steps, h, strict=True):
        held = [v for t, v in zip(p_steps, p, strict=True) if s - within <= t <= s]
        high = max(v for t, v in zip(steps, h, strict=True) if s - span <= t <= s)
        if held and value > 0:
            out.append((s, max(held), high / value))
    return out


def margin_picture(
    cases: list[tuple[Path, str, str, bool]], out: Path, steps: tuple[int, int] = (500, 900)
) -> Path:
    """Each case's layer as a path through (held direction, depth), one point per evaluation
    in ``steps``: healthy runs (grey, dashed) against FA faults (warm colours); shaded, where
    the gated rate rule accepts a collapse its CUSUM has seen (persistence above 0.9)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    ax.axvspan(0.9, 1.0, color="tab:red", alpha=0.08, label="the gated rule's gate: held > 0.9")
    faults = iter(plt.get_cmap("autumn")([i / 6 for i in range(7)]))
    for folder, layer, label, healthy in cases:
        points = [q for q in _held_depth(folder, layer) if steps[0] <= q[0] <= steps[1]]
        ax.plot(
            [q[1] for q in points],
            [q[2] for q in points],
            marker="o",
            ms=3,
            lw=1.2,
            c="0.35" if healthy else next(faults),
            ls="--" if healthy else "-",
            label=label,
        )
    ax.set_yscale("log")
    ax.set_ylim(0.9, 200)
    ax.set_xlim(0.4, 1.0)
    ax.set_xlabel("highest head-mean persistence of Delta_2's top direction, last 50 steps")
    ax.set_ylabel("H(Delta_2): highest of the last 100 steps / now (log)")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    path = out / "detection_margin.png"
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
    p.add_argument(
        "--persistence-root",
        type=Path,
        default=None,
        help="runs with big_model, fa_big_model and fa_dQK_6 of --persistence-seed",
    )
    p.add_argument("--persistence-seed", type=int, default=113)
    p.add_argument(
        "--only-persistence",
        action="store_true",
        help="draw that picture (or those of --slow and --margin) alone",
    )
    p.add_argument(
        "--slow",
        type=Path,
        nargs="+",
        default=None,
        help="run folders (with lr samples) for the slow-collapse picture, layer 0 of each",
    )
    p.add_argument(
        "--margin",
        type=Path,
        nargs="+",
        default=None,
        help="FOLDER:LAYER:LABEL[:healthy] cases for the gate-margin picture",
    )
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if not args.only_persistence:
        print(fa_panels(args.root, args.seed, args.out))
        print(router_panel(args.root, args.seed, args.out))
    if args.hf_root is not None and not args.only_persistence:
        cases = [
            (args.hf_root / "hf_clean_s7", "model.layers.2.mlp.gate", "HF Mixtral, healthy"),
            (
                args.hf_root / "hf_router_x30_nobal_s7",
                "model.layers.0.mlp.gate",
                "HF Mixtral, router LR x30 from 500",
            ),
            (args.root / f"router_x3_s{args.seed}", "blocks.0.moe.gate", "test bed, router LR x3"),
        ]
        print(gate_picture(cases, ROUTER_PUSH, args.out))
    if args.persistence_root is not None:
        root, seed = args.persistence_root, args.persistence_seed
        cases = [
            (root / f"big_model_s{seed}", "blocks.0.attn", "bigger model, healthy (layer 0)"),
            (
                root / f"fa_big_model_s{seed}",
                "blocks.1.attn",
                "bigger model, dS floor 6 bits from 500 (layer 1)",
            ),
            (root / f"fa_dQK_6_s{seed}", "blocks.0.attn", "dQ / dK floor 6 bits (layer 0)"),
        ]
        print(gate_picture(cases, PERSISTENCE, args.out))
    if args.slow is not None:
        print(slow_picture(args.slow, args.out))
    if args.margin is not None:
        cases = []
        for spec in args.margin:
            folder, layer, label, *kind = str(spec).split(":")
            cases.append((Path(folder), layer, label, kind == ["healthy"]))
        print(margin_picture(cases, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
