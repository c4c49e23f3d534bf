"""How early could any detector on H(Delta_2) see a fault? An oracle that knows the clean twin.

    python benchmarks/qk_twin_separation.py --root out/e4 out/e5 --seeds 112 113 114 115
        [--out FILE]

The lead-share target of issue 13 asks the first mechanism alert to come three quarters of the
way from the fault to the divergence. This measures the ceiling the signal itself sets, apart
from any rule: the first evaluation at which the faulty run's H(Delta_2) (head mean, per layer)
is lower than its clean twin's (same seed, same data, same schedule, recorded with the agent)
by more than unbiased low-precision arithmetic ever moved it. No user has the twin, so no rule
can do better than this oracle, only as well.

The envelope: the control runs (``control_dS_3``, ``control_dS_6``, ``control_dQK_3``,
``control_dQK_6``: unbiased rounding switched on at the same step, harmless) against the clean
run of the same seed, every layer, every evaluation from the fault's start: the deepest fall
below the twin a harmless change of the arithmetic produced (the maximum over every seed and
root given).
The oracle's separation step is the first evaluation from the fault's start at which any
layer's head mean falls deeper than that below the twin's.

Per harmful FA run with a recorded clean twin (the benign run of the same seed whose
configuration is the fault's twin: ``clean``, ``big_model``, ``gqa_model``, ``lr_low``,
``sweep_lr0.02_clean``): the fault's start, the oracle's separation, the first mechanism
alert (the shipped rules, replayed), the twin's loss degradation (an oracle of the loss), the
earliest loss detector, the divergence, the oracle's window (loss detector - separation: how
long the signal was ahead of the loss, 25 steps per evaluation), the alert's delay after the
separation (the rules need about three evaluations), and the lead shares (divergence - step)
/ (divergence - fault) of the oracle and of the alert. A measurement for issue 13, not a rule.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from detection import twin_losses  # noqa: E402
from provenance import provenance  # noqa: E402

from agent.eventlog import read_events  # noqa: E402
from agent.replay import replay  # noqa: E402
from agent.testbed.catalog import CATALOG, Entry, twin_key  # noqa: E402
from agent.testbed.divergence import degradation_step, divergence_step  # noqa: E402
from agent.testbed.loss_baselines import earliest_loss_alarm  # noqa: E402
from agent.testbed.scenarios import ScenarioConfig  # noqa: E402
from remediations.registry import validate_action  # noqa: E402

CONTROLS = ("control_dS_3", "control_dS_6", "control_dQK_3", "control_dQK_6")
LayerMeans = dict[str, dict[int, float]]  # layer -> step -> head-mean H(Delta_2), nats


def head_means(events: Path) -> LayerMeans:
    """layer -> step -> the mean over heads of H(Delta_2) in nats."""
    per_head: dict[str, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for record in read_events(events, "metrics"):
        for step, name, labels, value in record["samples"]:
            if name == "qk_delta2_entropy":
                per_head[labels["layer"]][step].append(value)
    return {
        layer: {step: statistics.fmean(v) for step, v in steps.items()}
        for layer, steps in per_head.items()
    }


def below_twin(run: LayerMeans, twin: LayerMeans, start: int) -> dict[int, float]:
    """step -> how far the deepest layer's head mean lies below the twin's (nats; > 0: below),
    at every evaluation from ``start`` that both runs have."""
    out: dict[int, float] = {}
    for layer, steps in run.items():
        for step, value in steps.items():
            if step >= start and step in twin.get(layer, {}):
                gap = twin[layer][step] - value
                out[step] = max(out.get(step, -float("inf")), gap)
    return dict(sorted(out.items()))


def _config(root: Path, name: str, seed: int) -> ScenarioConfig | None:
    path = root / f"{name}_s{seed}" / "result.json"
    if not path.exists():
        return None
    return ScenarioConfig.model_validate(json.loads(path.read_text())["config"])


def twin_run(root: Path, config: ScenarioConfig, benign: list[Entry]) -> str | None:
    """The recorded benign run (name) that is ``config``'s clean twin, or None."""
    key = twin_key(config)
    for entry in benign:
        other = _config(root, entry.name, config.seed)
        if other is not None and not other.has_fa_fault and twin_key(other) == key:
            return entry.name  # the key holds the steps: the schedule is the same
    return None


def envelope(roots: list[Path], seeds: list[int]) -> tuple[float, list[str]]:
    """The deepest fall below the clean twin of any control run (nats), and what it came from."""
    deepest, lines = 0.0, []
    for root, seed in ((root, seed) for root in roots for seed in seeds):
        clean = root / f"clean_s{seed}" / "events.jsonl"
        if not clean.exists():
            continue
        twin = head_means(clean)
        for name in CONTROLS:
            config = _config(root, name, seed)
            if config is None:
                continue
            gaps = below_twin(
                head_means(root / f"{name}_s{seed}" / "events.jsonl"), twin, config.fault_start
            )
            worst = max(gaps.values(), default=0.0)
            lines.append(f"{name} s{seed}: {worst:.3f}")
            deepest = max(deepest, worst)
    return deepest, lines


def evaluate(
    root: Path, entry: Entry, seed: int, benign: list[Entry], limit: float, rules: list[Path] | None
) -> dict[str, Any] | None:
    folder = root / f"{entry.name}_s{seed}"
    config = _config(root, entry.name, seed)
    if config is None:
        return None
    twin_name = twin_run(root, config, benign)
    losses = json.loads((folder / "result.json").read_text())["losses"]
    reference = twin_losses(root, config)
    start = config.fault_start
    degraded = degradation_step(losses, reference, min_step=start) if reference else None
    if twin_name is None or degraded is None:
        return None  # no recorded twin, or harmless
    gaps = below_twin(
        head_means(folder / "events.jsonl"),
        head_means(root / f"{twin_name}_s{seed}" / "events.jsonl"),
        start,
    )
    separated = next((step for step, gap in gaps.items() if gap > limit), None)
    first = replay(folder / "events.jsonl", rules, action_validator=validate_action)
    alert = first.first_firing().get("fa_precision")
    loss_alarm, _ = earliest_loss_alarm(losses, min_step=start)
    divergence = divergence_step(losses, min_step=start)

    def after(step: int | None, since: int | None) -> int | None:
        return None if step is None or since is None else step - since

    def share(step: int | None) -> float | None:
        if step is None or divergence is None or divergence <= start:
            return None
        return (divergence - step) / (divergence - start)

    return {
        "run": f"{entry.name} s{seed}",
        "twin": twin_name,
        "fault": start,
        "separation": separated,
        "alert": alert,
        "twin_degradation": degraded,
        "loss_alarm": loss_alarm,
        "divergence": divergence,
        "window": after(loss_alarm, separated),
        "delay": after(alert, separated),
        "oracle_share": share(separated),
        "alert_share": share(alert),
    }


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)


def rows_of(
    roots: list[Path], seeds: list[int], rules: list[Path] | None
) -> tuple[float, list[str], list[dict[str, Any]]]:
    """The envelope, where it came from, and one row per harmful FA run with a recorded twin."""
    benign = [e for e in CATALOG if e.group == "benign" and e.name not in CONTROLS]
    limit, sources = envelope(roots, seeds)
    rows = [
        row
        for root in roots
        for seed in seeds
        for entry in CATALOG
        if entry.group in ("fa", "sweep")
        and (row := evaluate(root, entry, seed, benign, limit, rules)) is not None
    ]
    return limit, sources, rows


def report(limit: float, sources: list[str], rows: list[dict[str, Any]]) -> str:
    columns = list(rows[0]) if rows else []
    lines = [
        f"Envelope (deepest fall of a control run's head mean below its clean twin, any layer, "
        f"any evaluation from the control's start): **{limit:.3f} nats** "
        f"({'; '.join(sources)}).",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
        *("| " + " | ".join(_fmt(row[c]) for c in columns) + " |" for row in rows),
        "",
    ]
    seen = [r for r in rows if r["separation"] is not None]
    before_loss = [r for r in seen if r["loss_alarm"] is None or r["separation"] < r["loss_alarm"]]
    alert_before = [
        r
        for r in rows
        if r["alert"] is not None and (r["loss_alarm"] is None or r["alert"] < r["loss_alarm"])
    ]
    oracle_shares = [r["oracle_share"] for r in rows if r["oracle_share"] is not None]
    alert_shares = [r["alert_share"] for r in rows if r["alert_share"] is not None]
    delays = [r["delay"] for r in rows if r["delay"] is not None]
    typical = statistics.median(delays) if delays else 0
    short = [r for r in rows if r["window"] is not None and r["window"] <= typical]
    short_lost = [r for r in short if r not in alert_before]
    long_lost = [r for r in rows if r not in short and r not in alert_before]
    lines += [
        f"- harmful FA runs with a recorded twin: {len(rows)}; the oracle separated "
        f"{len(seen)} of them",
        f"- oracle separation before every loss detector: {len(before_loss)} of {len(rows)}; "
        f"the shipped rules' first alert: {len(alert_before)} of {len(rows)}",
        f"- oracle separation before the twin's loss degradation: "
        f"{sum(r['separation'] < r['twin_degradation'] for r in seen)} of {len(rows)}",
        f"- median lead share: oracle {_median(oracle_shares)} ({len(oracle_shares)} runs that "
        f"diverged), the shipped rules' alert {_median(alert_shares)} ({len(alert_shares)} runs)",
        f"- the alert after the oracle's separation: median {_median(delays)} steps "
        f"(range {_range(delays)})",
        f"- runs whose oracle window was no longer than that median delay: {len(short)} "
        f"({', '.join(r['run'] for r in short) or 'none'}), the alert lost to the loss in "
        f"{len(short_lost)} of them; with a longer window it lost in {len(long_lost)} of "
        f"{len(rows) - len(short)} ({', '.join(r['run'] for r in long_lost) or 'none'})",
    ]
    return "\n".join(lines)


def _median(values: list[float]) -> str:
    return _fmt(float(statistics.median(values))) if values else "-"


def _range(values: list[float]) -> str:
    return f"{min(values)} to {max(values)}" if values else "-"


def figure(rows: list[dict[str, Any]], path: Path) -> Path:
    """One line per run, steps after the fault: the oracle's separation, the rules' first
    alert and the first loss detector."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ordered = sorted(rows, key=lambda r: (r["run"].split(" s")[0], r["run"]))
    fig, ax = plt.subplots(figsize=(8, 0.17 * len(ordered) + 1.2))
    marks = (
        ("separation", "o", "tab:green", "oracle: below the clean twin beyond the envelope"),
        ("alert", "^", "tab:red", "shipped rules: first fa_precision alert"),
        ("loss_alarm", "x", "black", "first loss detector"),
    )
    for y, row in enumerate(ordered):
        ends = [row[k] - row["fault"] for k, *_ in marks if row[k] is not None]
        ax.plot([0, max(ends)], [y, y], color="0.85", lw=1, zorder=0)
    for key, marker, color, label in marks:
        points = [(row[key] - row["fault"], y) for y, row in enumerate(ordered) if row[key]]
        ax.scatter(*zip(*points, strict=True), marker=marker, color=color, s=22, label=label)
    ax.set_yticks(range(len(ordered)), [r["run"] for r in ordered], fontsize=6)
    ax.invert_yaxis()
    ax.set_xlabel("steps after the fault began")
    ax.legend(fontsize=7, loc="lower right")
    ax.set_title("How early could a detector on H(Delta_2) see the fault?", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, nargs="+", required=True)
    p.add_argument("--seeds", type=int, nargs="+", required=True)
    p.add_argument("--rules", type=Path, nargs="+", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--figure", type=Path, default=None, help="draw the runs into this PNG")
    args = p.parse_args(argv)
    limit, sources, rows = rows_of(args.root, args.seeds, args.rules)
    text = report(limit, sources, rows)
    if args.figure:
        print(f"figure: {figure(rows, args.figure)}")
    text = "\n".join([text, "", *provenance()])
    print(text)
    if args.out:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
