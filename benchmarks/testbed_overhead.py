"""What the runner's monitors and per-step record cost, relative to bare training steps.

    python benchmarks/testbed_overhead.py --steps 300

Times three loops over the same seeded run (default preset, one torch thread), interleaved in
blocks so that load from other processes hits all of them alike:
bare ``TestbedRun.step()`` with the monitors off (``record_monitors=False``), steps with the
monitors at the preset cadence, and the full ``run_scenario`` work per step (monitors plus the
JSON record and its line in metrics.jsonl). Prints ms/step and the overhead in percent.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

from agent.testbed.runner import OTHER_GROUP, ROUTER_GROUP, TestbedRun
from agent.testbed.scenarios import ScenarioConfig


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=300, help="timed steps per variant")
    p.add_argument("--block", type=int, default=50, help="steps per interleaved block")
    args = p.parse_args()
    torch.set_num_threads(1)
    base = ScenarioConfig.preset("clean", seed=0)
    runs = {
        "bare steps": TestbedRun(base, record_monitors=False),
        "steps + monitors": TestbedRun(base),
        "steps + monitors + record": TestbedRun(base),
    }
    for run in runs.values():  # warm-up: first steps, first monitor evaluation
        for _ in range(base.monitor_every + 1):
            run.step()
    elapsed = dict.fromkeys(runs, 0.0)
    with tempfile.TemporaryDirectory() as tmp, open(os.path.join(tmp, "m.jsonl"), "w") as f:
        for _ in range(max(1, args.steps // args.block)):
            for name, run in runs.items():
                start = time.perf_counter()
                for _ in range(args.block):
                    if name.endswith("record"):
                        lr, lr_router = run.lr(OTHER_GROUP), run.lr(ROUTER_GROUP)
                        run.step()
                        f.write(json.dumps(run.record(lr, lr_router)) + "\n")
                    else:
                        run.step()
                elapsed[name] += time.perf_counter() - start
    steps = max(1, args.steps // args.block) * args.block
    bare = elapsed["bare steps"] / steps
    for name, total in elapsed.items():
        per = total / steps
        print(f"{name:28s} {1000 * per:7.2f} ms/step  overhead {100 * (per / bare - 1):+5.1f}%")


if __name__ == "__main__":
    main()
