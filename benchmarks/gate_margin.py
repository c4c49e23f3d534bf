"""The persistence gate's margin, measured on recorded runs (issue 13).

    python benchmarks/gate_margin.py RUN_DIR [RUN_DIR ...] [--rules FILES] [--out MD]

The gated FA rate rule (``qk_delta2_entropy_collapse`` in ``rules/fa_precision.yaml``) pages a
fast fall of H(Delta_2) only while the collapse's top direction holds (the head-mean
``qk_delta2_persistence`` above its threshold within ``within`` steps). A healthy QK phase
transition falls as fast as a fault; the gate is what holds it back. This replays each run
(``benchmarks/detection.py record`` or ``benchmarks/detection_hf.py`` folders) twice: through
the rule files as given (default: the shipped packs) and through a copy in which that rule's
``requires`` is removed. Every layer whose ungated rule fired is a collapse the rate CUSUM
saw; for each, the table gives when, the highest head-mean persistence within the gate's
window at that evaluation and over the episode (while it kept firing), how deep H(Delta_2)
went (its highest value of the last 100 steps over its value then), and when the gated rule
fired on that layer, if it did. A run whose folder name holds ``fa_`` or ``combined`` is a
fault; any other is healthy (its collapses are the ones the gate must hold back).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))

from detection_figures import layer_series

from agent.replay import replay
from agent.rules.loader import default_rule_files

GATED_RULE = "qk_delta2_entropy_collapse"
PERSISTENCE = "qk_delta2_persistence"
ENTROPY = "qk_delta2_entropy"
DEPTH_SPAN = 100  # steps: the depth is the highest H(Delta_2) of this many steps over now


@dataclass
class Collapse:
    run: str
    layer: str
    fault: bool
    fired: int  # step the ungated rule fired on this layer
    held_at_fire: float  # highest head-mean persistence within the gate's window then
    held_episode: float  # ... at any evaluation while the ungated rule kept firing
    depth: float  # highest H(Delta_2) of the last DEPTH_SPAN steps / H now, at its deepest
    gated: int | None  # step the gated rule fired on this layer (the rule files as given)


def ungated_copy(rule_files: list[Path], folder: Path) -> tuple[list[Path], float, int]:
    """Copies of ``rule_files`` in ``folder`` with the gated rule's ``requires`` removed; the
    gate's threshold and window."""
    out: list[Path] = []
    gate: tuple[float, int] | None = None
    for path in rule_files:
        doc = yaml.safe_load(path.read_text())
        for group in doc.get("groups", []):
            for rule in group.get("rules", []):
                if rule.get("name") == GATED_RULE and "requires" in rule:
                    signal = rule.pop("requires")
                    signal = signal[0] if isinstance(signal, list) else signal
                    gate = (float(signal["detector"]["above"]), int(signal["within"]))
        copy = folder / path.name
        copy.write_text(yaml.safe_dump(doc, sort_keys=False))
        out.append(copy)
    if gate is None:
        raise SystemExit(
            f"no rule {GATED_RULE!r} with `requires` in {', '.join(map(str, rule_files))}"
        )
    return out, gate[0], gate[1]


def layer_means(run: Path, metric: str) -> dict[str, dict[int, float]]:
    """{layer: {step: head mean of ``metric``}} from a run's event log."""
    return {k: dict(zip(*v, strict=True)) for k, v in layer_series(run, metric, "layer").items()}


def _episodes(alerts: list[dict], rule: str) -> dict[str, tuple[int, int | None]]:
    """{layer: (first firing step, the step it resolved, or None)} of ``rule``'s first episode."""
    out: dict[str, tuple[int, int | None]] = {}
    for a in alerts:
        if a["rule"] != rule:
            continue
        layer = a["labels"].get("layer", "")
        if a["to"] == "firing" and layer not in out:
            out[layer] = (a["step"], None)
        elif a["to"] == "resolved" and layer in out and out[layer][1] is None:
            out[layer] = (out[layer][0], a["step"])
    return out


def held_within(persistence: dict[int, float], step: int, within: int) -> float:
    """The highest head-mean persistence measured within ``within`` steps up to ``step``."""
    values = [v for s, v in persistence.items() if step - within <= s <= step]
    return max(values, default=float("nan"))


def depth(entropy: dict[int, float], step: int) -> float:
    """H(Delta_2)'s highest value of the DEPTH_SPAN steps up to ``step`` over its value then."""
    now = [v for s, v in sorted(entropy.items()) if s <= step]
    window = [v for s, v in entropy.items() if step - DEPTH_SPAN <= s <= step]
    return max(window) / now[-1] if now and now[-1] > 0 else float("nan")


def collapses(run: Path, rules: list[Path], ungated: list[Path], within: int) -> list[Collapse]:
    events = run / "events.jsonl"
    fired = _episodes(replay(events, ungated).alerts, GATED_RULE)
    gated = _episodes(replay(events, rules).alerts, GATED_RULE)
    held = layer_means(run, PERSISTENCE)
    entropy = layer_means(run, ENTROPY)
    fault = "fa_" in run.name or "combined" in run.name
    out = []
    for layer, (start, end) in sorted(fired.items(), key=lambda kv: kv[1][0]):
        p, h = held.get(layer, {}), entropy.get(layer, {})

        last = end if end is not None else max(h, default=start)
        episode = [s for s in sorted(h) if start - 5 <= s <= last]
        out.append(
            Collapse(
                run=run.name,
                layer=layer,
                fault=fault,
                fired=start,
                held_at_fire=held_within(p, start, within),
                held_episode=max(
                    (held_within(p, s, within) for s in episode), default=float("nan")
                ),
                depth=max((depth(h, s) for s in episode), default=float("nan")),
                gated=gated.get(layer, (None,))[0],
            )
        )
    return out


def table(rows: list[Collapse], gate: float) -> str:
    lines = [
        "| run | kind | layer | ungated rule fired | held then | held, episode | deepest (x) "
        "| gated rule fired |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.run} | {'fault' if r.fault else 'healthy'} | {r.layer} | {r.fired} "
            f"| {r.held_at_fire:.3f} | {r.held_episode:.3f} | {r.depth:.2f} "
            f"| {r.gated if r.gated is not None else '-'} |"
        )
    healthy = [r.held_episode for r in rows if not r.fault]
    faults = [r.held_at_fire for r in rows if r.fault]
    lines += [
        "",
        f"- gate: head-mean persistence above {gate}",
        f"- healthy collapses the rate CUSUM saw: {len(healthy)}; the highest persistence any held "
        f"in the gate's window: {max(healthy, default=float('nan')):.3f} "
        f"(margin {gate - max(healthy, default=float('nan')):.3f})",
        f"- fault collapses: {len(faults)}; persistence at the ungated rule's firing: "
        f"{min(faults, default=float('nan')):.3f}-{max(faults, default=float('nan')):.3f}, "
        f"{sum(v > gate for v in faults)} above the gate then",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", type=Path, nargs="+", help="recorded run folders (events.jsonl)")
    p.add_argument("--rules", type=Path, nargs="+", default=None, help="default: the shipped packs")
    p.add_argument("--out", type=Path, default=None, help="write the table here too")
    args = p.parse_args(argv)
    rules = list(args.rules) if args.rules else default_rule_files()
    with tempfile.TemporaryDirectory() as tmp:
        ungated, gate, within = ungated_copy(rules, Path(tmp))
        rows = [
            c
            for run in args.runs
            if (run / "events.jsonl").exists()
            for c in collapses(run, rules, ungated, within)
        ]
    text = table(rows, gate)
    print(text)
    if args.out is not None:
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
