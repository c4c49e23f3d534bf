"""The report of ``benchmarks/detection.py``: replay every recorded run through the rules and
put the mechanism alerts next to the loss detectors, the clean twin and the divergence."""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from provenance import provenance

from agent.replay import replay
from agent.testbed.catalog import BY_NAME
from agent.testbed.divergence import degradation_step, divergence_step
from agent.testbed.loss_baselines import BASELINES, earliest_loss_alarm
from agent.testbed.scenarios import ScenarioConfig
from remediations.registry import validate_action

MECHANISMS = ("fa_precision", "router_instability")
NAMING = (*MECHANISMS, "combined")  # incident families that name a mechanism
WARMUP = 100  # loss detectors on benign runs count from here (the LR warm-up)


def evaluate_run(
    root: Path, name: str, seed: int, rules: list[Path] | None
) -> dict[str, Any] | None:
    """One row of the table, or None when the run is not recorded."""
    from detection import twin_losses

    folder = root / f"{name}_s{seed}"
    if not (folder / "result.json").exists():
        return None
    entry = BY_NAME[name]
    run = json.loads((folder / "result.json").read_text())
    config = ScenarioConfig.model_validate(run["config"])
    losses: list[float] = run["losses"]
    harmful_entry = entry.expected is not None
    start = config.fault_start if harmful_entry else WARMUP
    replayed = replay(folder / "events.jsonl", rules, action_validator=validate_action)
    first = replayed.first_firing()
    mech = {f: first[f] for f in MECHANISMS if f in first}
    first_alert = min(mech.values()) if mech else None
    # What a user sees: the first page that names a mechanism (an alert the attribution writes
    # off, such as one a schedule step explains, pages nothing).
    first_mech = min(
        (e["step"] for e in replayed.incidents if e["incident"]["family"] in NAMING),
        default=None,
    )
    opened = [i for i in replayed.incidents if i["event"] == "opened"]
    mechanism_incidents = sorted(
        {
            e["incident"]["family"]
            for e in replayed.incidents
            if e["incident"]["family"] in (*MECHANISMS, "combined")
        }
    )
    twin = twin_losses(root, config) if harmful_entry else None
    degraded = degradation_step(losses, twin, min_step=start) if twin is not None else None
    divergence = divergence_step(losses, min_step=start)
    loss_alarm, loss_detector = earliest_loss_alarm(losses, min_step=start)
    row: dict[str, Any] = {
        "scenario": name,
        "group": entry.group,
        "seed": seed,
        "expected": entry.expected,
        "fault_start": config.fault_start if harmful_entry else None,
        "first_alert": first_alert,
        "first_family": min(mech, key=mech.get) if mech else None,
        "first_mech": first_mech,
        "onset": opened[0]["incident"]["onset_step"] if opened else None,
        "paged_as": replayed.paged_attribution(),
        "at_end": replayed.attribution(),
        "mech_incidents": mechanism_incidents,
        "lr": config.lr,
        "bits": config.fa_bits if config.has_fa_fault else None,
        "twin_degradation": degraded,
        "divergence": divergence,
        "loss_alarm": loss_alarm,
        "loss_detector": loss_detector,
        **{name: detect(losses, min_step=start) for name, detect in BASELINES.items()},
    }
    row["harmful"] = harmful_entry and degraded is not None
    if first_mech is not None and loss_alarm is not None:
        row["lead_vs_loss"] = loss_alarm - first_mech
    else:
        row["lead_vs_loss"] = None
    if first_mech is not None and divergence is not None and divergence > start:
        row["lead_share"] = (divergence - first_mech) / (divergence - start)
    else:
        row["lead_share"] = None
    return row


def _fmt(x: Any) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, float):
        return f"{x:.2f}"
    if isinstance(x, list):
        return ",".join(x) or "-"
    return str(x)


COLUMNS = [
    "scenario",
    "seed",
    "fault_start",
    "first_alert",
    "first_family",
    "first_mech",
    "onset",
    "paged_as",
    "at_end",
    "mech_incidents",
    "twin_degradation",
    *BASELINES,
    "divergence",
    "harmful",
    "lead_vs_loss",
    "lead_share",
]


def table(rows: list[dict[str, Any]], columns: Sequence[str] = COLUMNS) -> list[str]:
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_fmt(r[c]) for c in columns) + " |" for r in rows]
    return lines


def totals(rows: list[dict[str, Any]]) -> list[str]:
    benign = [r for r in rows if r["expected"] is None]
    false = [r for r in benign if r["mech_incidents"]]
    harmful = [r for r in rows if r["harmful"]]
    right_first = [r for r in harmful if r["paged_as"] == r["expected"]]
    right_end = [r for r in harmful if r["at_end"] == r["expected"]]
    fa = [r for r in harmful if r["expected"] == "fa_precision"]
    fa_ahead = [r for r in fa if _ahead_of_loss(r)]
    no_loss_alarm = [r for r in fa_ahead if r["loss_alarm"] is None]
    shares = [r["lead_share"] for r in fa if r["lead_share"] is not None]
    router = [r for r in harmful if r["expected"] == "router_instability"]
    router_fast = [r for r in router if _caught_within(r, 100)]
    harmless = [r for r in rows if r["expected"] is not None and not r["harmful"]]
    false_runs = ", ".join(f"{r['scenario']} s{r['seed']}" for r in false)
    lines = [
        "",
        "## Totals (targets in brackets)",
        "",
        f"- benign runs with a mechanism incident: {len(false)} of {len(benign)} [0]"
        + (f" ({false_runs})" if false else ""),
        f"- harmful faults attributed right at the first page: {len(right_first)} of "
        f"{len(harmful)}; at the end of the run: {len(right_end)} of {len(harmful)} [all]",
        f"- harmful FA runs whose first page naming a mechanism beat every loss detector: "
        f"{len(fa_ahead)} of {len(fa)} [90%] ({len(no_loss_alarm)} of them: no loss detector "
        "fired in the run)",
        f"- median lead share (divergence - first alert) / (divergence - fault), FA runs that "
        f"diverged: {statistics.median(shares):.2f} over {len(shares)} runs [0.75]"
        if shares
        else "- no FA run diverged",
        f"- harmful router faults caught within 100 steps of the fault: {len(router_fast)} of "
        f"{len(router)} [all]",
        f"- faults that did not degrade the loss against their clean twin (harmless): "
        f"{len(harmless)}; detected anyway: "
        f"{sum(1 for r in harmless if r['first_mech'] is not None)}",
    ]
    return lines


def silent_phase(rows: list[dict[str, Any]]) -> list[str]:
    """Fault strength (bits) x LR: median steps from the first page naming a mechanism to the
    earliest loss detector, the clean twin's degradation and the divergence (positive: the
    mechanism came first), and how many runs of the cell were harmful."""
    cells: dict[tuple[float, int], list[dict[str, Any]]] = {}
    for r in rows:
        if not r["scenario"].startswith(("fa_floor_", "sweep_lr")) or r["bits"] is None:
            continue  # the cells: floor rounding of dS from step 500, by bits and LR
        cells.setdefault((r["lr"], r["bits"]), []).append(r)
    lines = [
        "",
        "## Where the silent phase is (floor rounding of dS from step 500; median over seeds)",
        "",
        "| LR | bits | harmful | first alert - fault | to loss detector | to twin degradation "
        "| to divergence |",
        "|---|---|---|---|---|---|---|",
    ]
    for (lr, bits), group in sorted(cells.items()):

        def med(key: str, group: list[dict[str, Any]] = group) -> str:
            values = [
                r[key] - r["first_mech"]
                for r in group
                if r[key] is not None and r["first_mech"] is not None
            ]
            return f"{statistics.median(values):.0f} ({len(values)})" if values else "-"

        alerts = [r["first_mech"] - r["fault_start"] for r in group if r["first_mech"]]
        first = f"{statistics.median(alerts):.0f} ({len(alerts)})" if alerts else "-"
        harmful = sum(r["harmful"] for r in group)
        lines.append(
            f"| {lr:g} | {bits} | {harmful} of {len(group)} | {first} | {med('loss_alarm')} | "
            f"{med('twin_degradation')} | {med('divergence')} |"
        )
    lines.append("")
    lines.append("(n): runs with both steps. A negative number: the loss moved first.")
    return lines


def _ahead_of_loss(row: dict[str, Any]) -> bool:
    """A mechanism alert came before every loss detector: earlier than the first loss alarm,
    or in a run where no loss detector fired at all."""
    if row["first_mech"] is None:
        return False
    return row["loss_alarm"] is None or row["loss_alarm"] > row["first_mech"]


def _caught_within(row: dict[str, Any], steps: int) -> bool:
    return row["first_mech"] is not None and row["first_mech"] - row["fault_start"] <= steps


def report(root: Path, names: list[str], seeds: list[int], rules: list[Path] | None) -> str:
    rows = []
    missing = []
    for name in names:
        for seed in seeds:
            row = evaluate_run(root, name, seed, rules)
            if row is None:
                missing.append(f"{name} s{seed}")
            else:
                rows.append(row)
    header = provenance() + [
        "",
        f"Seeds: {', '.join(map(str, seeds))}; rules: "
        f"{', '.join(map(str, rules)) if rules else 'the shipped packs'}.",
        "",
    ]
    if missing:
        header.append(f"Not recorded (skipped): {', '.join(missing)}")
    return "\n".join(header + table(rows) + totals(rows) + silent_phase(rows))
