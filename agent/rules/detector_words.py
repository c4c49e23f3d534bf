"""A detector's thresholds and timing in plain words (``mechwatch explain``).

One sentence builder per built-in detector type, from the parameters as a rule writes them
(defaults filled in by the detector's own parameter model); any other type (a user's
registered detector) gets a generic sentence that lists its parameters with their documented
meaning. "An evaluation" is one value of the rule's (reduced) series.

>>> describe_detector("log_cusum", {"direction": "falling", "k": 0.05, "h": 0.3})
'fires when the value keeps falling faster than 5% per evaluation until the excess adds up \
to 26% (a CUSUM on log-changes: k = 0.05, h = 0.3); a slower drift never adds up, a one-time \
fall of less than 30% is forgiven, and there is no baseline to learn, so it can fire from its \
second value'
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel

from agent.detectors.log_cusum import SPARSE_NOISE_CHANGES

Sentence = Callable[[Any], str]


def describe_detector(
    type_name: str, params: Mapping[str, Any], model: type[BaseModel] | None = None
) -> str:
    """Plain words for detector ``type_name`` with ``params`` (as written in the rule).
    ``model``: its parameter model (default: the built-in registry's), for the defaults."""
    if model is None:
        from agent.detectors import DETECTORS

        cls = DETECTORS.get(type_name)
        model = cls.Params if cls is not None else None
    if model is None:
        return _generic(type_name, dict(params), None)
    full = model.model_validate(dict(params))
    builder = _SENTENCES.get(type_name)
    return builder(full) if builder is not None else _generic(type_name, dict(params), full)


def _pct(x: float) -> str:
    return f"{x:.0%}" if abs(x) >= 0.01 else f"{x:.2%}"


def _num(x: float) -> str:
    return f"{x:g}"


def _log_cusum(p: Any) -> str:
    # a one-time step d (then flat) leaves the sum at d - k x min_updates when it may fire
    largest = p.h + p.k * p.min_updates  # the largest one-time step that is forgiven (log)
    fall = (1 - math.exp(-p.k), 1 - math.exp(-p.h), 1 - math.exp(-largest))
    rise = (math.exp(p.k) - 1, math.exp(p.h) - 1, math.exp(largest) - 1)
    ways = {
        "falling": [("falling", "fall", fall)],
        "rising": [("rising", "rise", rise)],
        "both": [("falling", "fall", fall), ("rising", "rise", rise)],
    }[p.direction]
    unit = "per evaluation" if p.per_steps is None else f"per {p.per_steps} steps"
    parts = [
        f"keeps {verb} faster than {_pct(per)} {unit} until the excess adds up to {_pct(total)}"
        for verb, _, (per, total, _) in ways
    ]
    forgiven = " or ".join(f"{noun} of less than {_pct(step)}" for _, noun, (_, _, step) in ways)
    first = _ORDINALS.get(p.min_updates + 1, f"value number {p.min_updates + 1}")
    return (
        f"fires when the value {' or '.join(parts)} (a CUSUM on log-changes: k = {_num(p.k)}, "
        f"h = {_num(p.h)}){_min_updates(p.min_updates, p.per_steps)}; a slower drift never "
        "adds up, a "
        f"one-time {forgiven} is forgiven, and there is no baseline to learn, so "
        + (f"it can fire from its {first}" if not p.scaled else _noise(p))
    )


def _noise(p: Any) -> str:
    """The end of a noise-scaled log_cusum's sentence (``noise_k`` / ``noise_h``)."""
    raised = [
        f"{name} to {_num(times)} x sigma"
        for name, times in (("k", p.noise_k), ("h", p.noise_h))
        if times is not None
    ]
    return (
        f"nothing the series did before can disarm it; it raises {' and '.join(raised)} where the "
        f"series is noisier (sigma: the robust spread of its last {p.noise_window} log-changes "
        f"that were noise), and it cannot fire before {p.noise_changes_needed()} of them "
        "are known"
        + (
            ""
            if p.per_steps is None
            else f" (where values come more than {p.per_steps} steps apart, as many steps' "
            f"worth, but at least {min(SPARSE_NOISE_CHANGES, p.noise_changes_needed())})"
        )
    )


_ORDINALS = {2: "second value", 3: "third value", 4: "fourth value"}


def _min_updates(n: int, per_steps: int | None = None) -> str:
    """The ``min_updates`` clause of a CUSUM's sentence ("" for 1, the default; with
    ``per_steps``, in steps, and the rescaling said)."""
    rescaled = (
        ""
        if per_steps is None
        else f"; k and this span are given per {per_steps} steps and rescaled to the steps "
        "between two values"
    )
    if n == 1:
        return rescaled
    lasted = f"{n} evaluations in a row" if per_steps is None else f"about {n * per_steps} steps"
    return (
        f", once the departure has lasted {lasted} (a single outlying value cannot fire it on "
        f"the evaluation it arrives){rescaled}"
    )


def levels(above: float | None, below: float | None, fmt: str = "{:g}") -> list[str]:
    """["above X", "below Y"] for the levels that are set (threshold, clear conditions)."""
    pairs = (("above", above), ("below", below))
    return [f"{word} {fmt.format(level)}" for word, level in pairs if level is not None]


def _threshold(p: Any) -> str:
    sides = levels(p.above, p.below)
    return (
        f"fires while the value is {' or '.join(sides)} (strictly; no warm-up, no baseline; "
        "NaN is neither above nor below anything)"
    )


def _ema_rise(p: Any) -> str:
    worse, best = ("above", "lowest") if p.direction == "rising" else ("below", "highest")
    return (
        f"fires while the exponential moving average over about {p.span} values (weight "
        f"2/{p.span + 1} on the newest) is more than {_num(p.margin)} {worse} its {best} level "
        f"so far, once {p.warmup} values were seen; a series that only improves never fires, "
        "and it starts over after a rollback"
    )


def _side(direction: str, falling: str = "below", rising: str = "above") -> str:
    return {"falling": falling, "rising": rising}.get(direction, f"{rising} or {falling}")


def _ewma(p: Any) -> str:
    weight = f"alpha {_num(p.alpha)}" if p.alpha is not None else f"halflife {_num(p.halflife)}"
    floor = f", at least {_num(p.min_std)}" if p.min_std else ""
    return (
        f"fires when a value is more than {_num(p.z)} standard deviations "
        f"{_side(p.direction)} the exponentially weighted mean ({weight}; the first "
        f"{p.warmup} values seed it; the standard deviation is exponentially weighted "
        f"too{floor}); values of a departure are not learned, so a lasting shift keeps it firing"
    )


def _baseline(p: Any) -> str:
    criteria = []
    if p.rel is not None:
        criteria.append(f"by more than {_pct(p.rel)} of the baseline")
    if p.z is not None or p.rel is None:
        z = p.z if p.z is not None else 5.0
        criteria.append(f"by more than {_num(z)} robust standard deviations (1.4826 MAD)")
    kind = (
        f"a rolling median of the last {p.window} learned values"
        if p.window is not None
        else f"the median of the first {p.warmup} values, then frozen"
    )
    move = {"drop": "falls", "rise": "rises"}.get(p.direction, "falls or rises")
    return f"fires when the value {move} {' and '.join(criteria)} from its baseline ({kind})"


def _cusum(p: Any) -> str:
    return (
        f"fires when the cumulative sum of deviations {_side(p.direction)} the warm-up mean, "
        f"beyond a slack of {_num(p.k)} standard deviations per value, exceeds {_num(p.h)} "
        f"standard deviations (mean and std of the first {p.warmup} values, then frozen)"
        f"{_min_updates(p.min_updates)}"
    )


def _page_hinkley(p: Any) -> str:
    unit = " warm-up standard deviations" if p.standardize else " (metric units)"
    change = {"falling": "decrease", "rising": "increase"}.get(p.direction, "change")
    return (
        f"fires when the Page-Hinkley statistic of a {change} in the mean exceeds "
        f"{_num(p.threshold)}{unit}, tolerating {_num(p.delta)} per value (after {p.warmup} "
        f"values; forgetting factor {_num(p.alpha)})"
    )


def _slope(p: Any) -> str:
    extra = []
    if p.min_slope is not None:
        extra.append(f"|slope| >= {_num(p.min_slope)} per step")
    if p.min_rel_change is not None:
        extra.append(f"a change over the window of at least {_pct(p.min_rel_change)} of its level")
    also = f", with {' and '.join(extra)}" if extra else ""
    trend = {"falling": "falling", "rising": "rising"}.get(p.direction, "falling or rising")
    return (
        f"fires when the last {p.window} values trend {trend} (Mann-Kendall test, p < "
        f"{_num(p.alpha)}){also}"
    )


def _drawdown(p: Any) -> str:
    fall = f"at most 1/{_num(p.ratio)} ({_pct(1 / p.ratio)}) of the highest value"
    rise = f"at least {_num(p.ratio)} times the lowest value"
    where = {"falling": fall, "rising": rise}.get(p.direction, f"{fall} or {rise}")
    return (
        f"fires while the value is {where} measured within the last {p.span} steps, however "
        "slowly it got there (the depth reached, not a rate)"
    )


_SENTENCES: dict[str, Sentence] = {
    "log_cusum": _log_cusum,
    "drawdown": _drawdown,
    "threshold": _threshold,
    "ema_rise": _ema_rise,
    "ewma": _ewma,
    "baseline": _baseline,
    "cusum": _cusum,
    "page_hinkley": _page_hinkley,
    "slope": _slope,
}


def _generic(type_name: str, params: dict[str, Any], full: BaseModel | None) -> str:
    """Any other detector: its parameters and what its model says they mean."""
    values = full.model_dump() if full is not None else params
    fields = type(full).model_fields if full is not None else {}
    parts = []
    for name, value in values.items():
        doc = fields[name].description if name in fields else None
        parts.append(f"{name} = {value!r}" + (f" ({doc.rstrip('.')})" if doc else ""))
    listed = "; ".join(parts) if parts else "no parameters"
    return f"fires when the '{type_name}' detector triggers: {listed}"
