"""``mechwatch testbed``: run one test-bed scenario from the command line."""

from __future__ import annotations

import argparse
import json

from pydantic import ValidationError

from agent.testbed.scenarios import SCENARIOS, ScenarioConfig


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="mechwatch testbed",
        description="Train the CPU test-bed MoE transformer with an optional injected fault and "
        "write metrics.jsonl, summary.json (and plot.png).",
    )
    p.add_argument("--scenario", choices=SCENARIOS, default="clean", help="fault scenario")
    p.add_argument("--seed", type=int, default=0, help="model init and sampling seed")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps (preset default)")
    p.add_argument(
        "--scale", choices=["default", "tiny"], default="default", help="tiny: a shortened run"
    )
    p.add_argument("--out", default="out/testbed", help="output folder")
    p.add_argument("--plot", action="store_true", help="also write plot.png")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="FIELD=JSON",
        help="override a ScenarioConfig field, value as JSON (e.g. --set fa_bits=4 "
        '--set \'fa_sites=["dS","O_delta"]\'); repeatable',
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _overrides(items: list[str]) -> dict[str, object]:
    out: dict[str, object] = {}
    for item in items:
        field, sep, raw = item.partition("=")
        if not sep or not field:
            raise ValueError(f"--set {item!r}: expected FIELD=JSON")
        try:
            out[field] = json.loads(raw)
        except json.JSONDecodeError:
            out[field] = raw  # a bare word such as floor
    return out


def cli_testbed(argv: list[str]) -> int:
    """Run a scenario; returns a process exit code (0 ok, 2 bad arguments)."""
    args = _parser().parse_args(argv)
    try:
        config = ScenarioConfig.preset(
            args.scenario,
            seed=args.seed,
            steps=args.steps,
            scale=args.scale,
            **_overrides(args.set),
        )
    except (ValueError, ValidationError) as e:
        print(f"mechwatch testbed: invalid configuration: {e}")
        return 2
    import torch

    from agent.testbed.runner import run_scenario

    torch.set_num_threads(max(1, args.threads))
    summary = run_scenario(
        config, args.out, plot=args.plot, progress_every=0 if args.quiet else 250
    )
    shown = {k: v for k, v in summary.to_dict().items() if k != "config"}
    print(json.dumps(shown, indent=2))
    return 0


if __name__ == "__main__":
    import sys

    raise SystemExit(cli_testbed(sys.argv[1:]))
