"""``ema_rise`` (the 0.1-nat loss alarm) on falling, rising and noisy series, exact indices."""

from __future__ import annotations

import math

from agent.detectors.ema_rise import EMARiseDetector
from agent.detectors.signals import noise_series
from agent.testbed.loss_baselines import ema_rise_step


def fired(d: EMARiseDetector, values: list[float]) -> list[int]:
    return [i for i, v in enumerate(values) if d.update(i, v).triggered]


def test_a_loss_that_only_improves_never_fires_even_when_noisy():
    falling = [3.0 * math.exp(-i / 300) for i in range(1500)]
    noise = noise_series(1500, 1.0, 0.05, seed=4)
    noisy = [v + e - 1.0 for v, e in zip(falling, noise, strict=True)]
    assert fired(EMARiseDetector(), falling) == []
    assert fired(EMARiseDetector(), noisy) == []


def test_it_fires_when_the_ema_is_margin_above_its_best_and_agrees_with_the_yardstick():
    values = [2.0 - 0.001 * i for i in range(500)] + [1.5 + 0.002 * i for i in range(300)]
    d = EMARiseDetector(span=50, margin=0.1)
    steps = fired(d, values)
    # The same definition as the benchmark's loss yardstick (agent.testbed.loss_baselines).
    assert steps[0] == ema_rise_step(values) and steps == list(range(steps[0], 800))
    assert 500 + 50 < steps[0] < 500 + 100  # 0.1 nats at 0.002 per step, plus the EMA lag
    assert d.onset_step < steps[0] and abs(d.baseline - 1.52) < 0.03  # the EMA's lowest


def test_the_warmup_holds_it_and_falling_watches_the_running_maximum():
    assert fired(EMARiseDetector(span=1, warmup=5), [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]) == [4, 5]
    d = EMARiseDetector(span=1, margin=0.5, warmup=1, direction="falling")
    assert fired(d, [1.0, 2.0, 1.6, 1.4, 2.5]) == [3] and d.baseline == 2.5


def test_a_rollback_starts_it_over_the_abandoned_best_says_nothing():
    d = EMARiseDetector(span=1, margin=0.1, warmup=3)
    for step, v in enumerate([3.0, 2.5, 2.2, 2.0]):  # trained on to 2.0
        d.update(step, v)
    # Rolled back to step 2: the restored, earlier path's loss (2.3) is no damage.
    assert not d.update(2, 2.3).triggered and not d.update(3, 2.25).triggered
    assert not d.update(4, 2.2).triggered and d.baseline == 2.2
    assert d.update(5, 2.4).triggered  # a real rise on the restored path still fires
