"""Detectors on synthetic series: false alarms on noise, detection delay and onset error on
steps and ramps, cost per update. Defaults of every registered detector (threshold: +-4 std).

Run: python benchmarks/bench_detectors.py [--series N]
"""

from __future__ import annotations

import argparse
import statistics
import time

from agent.detectors import DETECTORS, build_detector
from agent.detectors.signals import noise_series, ramp_series, step_series

PARAMS = {"threshold": {"below": -4.0, "above": 4.0}}
AT = 100  # index of the change


def false_alarms(name: str, n_series: int, length: int) -> tuple[float, float, float]:
    """(alarms per 1e4 updates, fraction of series with an alarm, microseconds per update);
    the detector is reset after each alarm, as a rule engine would after handling it."""
    alarms = fired_series = 0
    t0 = time.perf_counter()
    for seed in range(n_series):
        d = build_detector(name, PARAMS.get(name, {}))
        fired = False
        for i, v in enumerate(noise_series(length, noise=1.0, seed=10_000 + seed)):
            if d.update(i, v).triggered:
                alarms += 1
                fired = True
                d.reset()
        fired_series += fired
    seconds = time.perf_counter() - t0
    total = n_series * length
    return 1e4 * alarms / total, fired_series / n_series, 1e6 * seconds / total


def detection(name: str, make_series, n_series: int) -> tuple[float, float, float]:
    """(fraction detected, median delay in updates, median onset error in updates)."""
    delays, onset_errors = [], []
    for seed in range(n_series):
        d = build_detector(name, PARAMS.get(name, {}))
        for i, v in enumerate(make_series(seed)):
            d.update(i, v)
            if d.triggered and i >= AT:
                delays.append(i - AT)
                onset_errors.append(d.onset_step - AT)
                break
    if not delays:
        return 0.0, float("nan"), float("nan")
    return len(delays) / n_series, statistics.median(delays), statistics.median(onset_errors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--series", type=int, default=100, help="series per measurement")
    args = parser.parse_args()
    n = args.series
    cases = {
        "step -3sd": lambda s: step_series(300, AT, 0.0, -3.0, noise=1.0, seed=s),
        "step -6sd": lambda s: step_series(300, AT, 0.0, -6.0, noise=1.0, seed=s),
        "ramp -0.1sd/upd": lambda s: ramp_series(300, AT, -0.1, level=0.0, noise=1.0, seed=s),
    }
    print(f"{n} series each; noise: N(0,1) x 2000 updates; changes at update {AT}")
    header = f"{'detector':13s} {'FA/1e4':>7s} {'FA ser':>6s} {'us/upd':>6s}"
    for case in cases:
        header += f" | {case + ': det delay onset':>32s}"
    print(header)
    for name in sorted(DETECTORS):
        rate, frac, us = false_alarms(name, n, 2000)
        row = f"{name:13s} {rate:7.2f} {frac:6.2f} {us:6.1f}"
        for make in cases.values():
            det, delay, onset = detection(name, make, n)
            row += f" | {det:20.2f} {delay:5.1f} {onset:5.1f}"
        print(row)


if __name__ == "__main__":
    main()
