"""Detection benchmark: an evaluation that cannot flatter (issue 13).

    python benchmarks/detection.py record [--seeds tuning|evaluation|all|N...] [--groups ...]
    python benchmarks/detection.py report [--seeds evaluation] [--rules FILES...] [--out MD]

``record``: every scenario of the catalogue (``agent.testbed.catalog``: benign disturbances,
FA faults, router faults, the bits x LR sweep) on each seed, with the agent inside the loop in
detect-only mode (actions are dry runs: the run is exactly the unwatched run), into
``--root/<scenario>_s<seed>/`` (``events.jsonl``: every measurement; ``result.json``: the
per-step losses). Each fault run's clean twin (same seed and knobs, no fault) is recorded too
(losses only, ``twins/``). Runs already recorded are reused. ``--workers 2`` training
processes at a time, one torch thread each.

``report``: replays every recorded run through the rule files (``mechwatch replay``: the same
decisions the live agent makes) and puts, side by side per run: the first mechanism alert
(``first_alert``) and its family, the first page that names a mechanism (``first_mech``: what
the lead times count; an alert the attribution writes off pages nothing), the family of the
first page and at the end of the run, the loss detectors people
use today on the same losses (``agent.testbed.loss_baselines``), the clean twin's degradation
step and the loss divergence; then the totals against the targets. Tune on ``--seeds tuning``,
report on ``--seeds evaluation`` (the default).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent.testbed.catalog import BY_NAME, CATALOG, EVALUATION_SEEDS, TUNING_SEEDS, twin, twin_key
from agent.testbed.scenarios import ScenarioConfig

ROOT = Path("out/detection")


def seeds_of(spec: list[str]) -> list[int]:
    named = {"tuning": TUNING_SEEDS, "evaluation": EVALUATION_SEEDS}
    named["all"] = TUNING_SEEDS + EVALUATION_SEEDS
    out: list[int] = []
    for item in spec:
        out += list(named[item]) if item in named else [int(item)]
    return out


# -- recording -----------------------------------------------------------------------------------
def _record_agent_run(job: tuple) -> str:
    name, seed, root, qk = (*job, None)[:4]  # (name, seed, root[, qk settings])
    from agent.testbed.supervised import default_agent_config, run_supervised, set_threads

    set_threads(1)
    folder = Path(root) / f"{name}_s{seed}"
    result_file = folder / "result.json"
    if result_file.exists():
        return f"{name} s{seed}: kept"
    config = BY_NAME[name].config(seed)
    cadence = {"qk": qk} if qk else {}
    agent_config = default_agent_config(
        folder, remediate=False, checkpoints={"enabled": False}, **cadence
    )
    t0 = time.perf_counter()
    result = run_supervised(config, agent_config)
    out = result.to_dict()
    out["config"] = config.model_dump(mode="json")
    result_file.write_text(json.dumps(out, default=str))
    return f"{name} s{seed}: recorded in {time.perf_counter() - t0:.0f} s"


def _record_twin(job: tuple[str, int, str]) -> str:
    name, seed, root = job
    import torch

    from agent.testbed.runner import TestbedRun

    torch.set_num_threads(1)
    config = twin(BY_NAME[name].config(seed))
    path = Path(root) / "twins" / f"{twin_key(config)}_s{seed}.json"
    if path.exists():
        return f"twin of {name} s{seed}: kept"
    run = TestbedRun(config, record_monitors=False)
    losses = [float(run.step()) for _ in range(config.steps)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"config": config.model_dump(mode="json"), "losses": losses}))
    return f"twin of {name} s{seed}: recorded"


def record(
    root: Path, names: list[str], seeds: list[int], workers: int, qk: dict | None = None
) -> None:
    """Record ``names`` x ``seeds`` under ``root`` (``qk``: AgentConfig ``qk`` settings that
    differ from the default, e.g. ``{"delta": 12}``) and the fault runs' clean twins."""
    jobs = [(_record_agent_run, (n, s, str(root), qk)) for s in seeds for n in names]
    jobs += [
        (_record_twin, (n, s, str(root)))
        for s in seeds
        for n in names
        if BY_NAME[n].expected is not None
    ]
    ctx = mp.get_context("spawn")
    with ctx.Pool(workers, maxtasksperchild=1) as pool:
        pending = [pool.apply_async(fn, (args,)) for fn, args in jobs]
        for p in pending:
            print(p.get(), flush=True)


def twin_losses(root: Path, config: ScenarioConfig) -> list[float] | None:
    path = root / "twins" / f"{twin_key(config)}_s{config.seed}.json"
    return json.loads(path.read_text())["losses"] if path.exists() else None


def add_sampling_options(p: argparse.ArgumentParser) -> None:
    """``--qk-layers-per-eval N`` and ``--qk-heads-per-layer N``: record with layers or heads
    measured in turn (shared with ``detection_hf.py``); ``sampling(args)`` reads them."""
    p.add_argument(
        "--qk-layers-per-eval",
        type=int,
        default=None,
        help="record measuring this many attention layers per evaluation, in turn "
        "(qk.layers_per_eval) instead of all",
    )
    p.add_argument(
        "--qk-heads-per-layer",
        type=int,
        default=None,
        help="record measuring this many query heads per layer and evaluation, in turn "
        "(qk.heads_per_layer) instead of all",
    )


def sampling(args: argparse.Namespace) -> dict[str, int]:
    """The ``qk`` settings of ``add_sampling_options`` that were given."""
    given = {"layers_per_eval": args.qk_layers_per_eval, "heads_per_layer": args.qk_heads_per_layer}
    return {key: value for key, value in given.items() if value is not None}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=["record", "report"])
    p.add_argument("--seeds", nargs="+", default=None)
    p.add_argument("--groups", nargs="+", default=["benign", "fa", "router", "sweep"])
    p.add_argument("--names", nargs="+", default=None)
    p.add_argument("--root", type=Path, default=ROOT)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--rules", type=Path, nargs="+", default=None)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument(
        "--qk-delta",
        type=int,
        default=None,
        help="record with this QK cadence (qk.delta, steps) instead of the default",
    )
    add_sampling_options(p)
    args = p.parse_args(argv)
    names = args.names or [e.name for e in CATALOG if e.group in args.groups]
    if args.command == "record":
        qk = sampling(args)
        if args.qk_delta is not None:
            qk["delta"] = args.qk_delta
        record(args.root, names, seeds_of(args.seeds or ["all"]), args.workers, qk)
        return 0
    from detection_report import report

    text = report(args.root, names, seeds_of(args.seeds or ["evaluation"]), args.rules)
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
