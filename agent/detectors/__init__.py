"""Detectors: torch-free code that turns a series of floats into a verdict.

The registry maps a rule's YAML ``type`` to a detector class::

    >>> from agent.detectors import build_detector
    >>> d = build_detector("baseline", {"warmup": 4, "rel": 0.5})
    >>> [d.update(s, v).triggered for s, v in enumerate([2.0, 2.0, 2.0, 2.0, 0.9])]
    [False, False, False, False, True]

``build_detector`` raises ``ValueError`` for an unknown type and lets pydantic's
``ValidationError`` through for bad parameters (the rules loader turns it into a
file:line error). ``register_detector`` adds a user's own ``Detector`` subclass.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

# ``np.median`` imports numpy.ma at its first call (~27 ms): that call comes from a rule
# evaluation inside a training step; importing it here puts the cost at import time.
import numpy.ma  # noqa: F401

from agent.detectors.base import Detector, DetectorParams, DetectorProtocol, Trend
from agent.detectors.baseline import BaselineDetector
from agent.detectors.cusum import CUSUMDetector
from agent.detectors.drawdown import DrawdownDetector
from agent.detectors.ema_rise import EMARiseDetector
from agent.detectors.ewma import EWMADetector
from agent.detectors.log_cusum import LogCUSUMDetector
from agent.detectors.page_hinkley import PageHinkleyDetector
from agent.detectors.slope import SlopeDetector
from agent.detectors.threshold import ThresholdDetector

DETECTORS: dict[str, type[Detector]] = {}


def register_detector(cls: type[Detector], *, replace: bool = False) -> type[Detector]:
    """Register ``cls`` under ``cls.type`` (usable as a class decorator). Registering another
    class under a taken name is a ValueError unless ``replace``."""
    if not (isinstance(cls, type) and issubclass(cls, Detector)):
        raise ValueError(f"register_detector needs a Detector subclass, got {cls!r}")
    name = getattr(cls, "type", None)
    if not isinstance(name, str) or not name:
        raise ValueError(f"{cls.__name__} needs a non-empty class attribute `type` (a str)")
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, DetectorParams)):
        raise ValueError(f"{cls.__name__}.Params must be a DetectorParams subclass")
    taken = DETECTORS.get(name)
    if taken is not None and taken is not cls and not replace:
        raise ValueError(
            f"detector type {name!r} is already registered by {taken.__module__}."
            f"{taken.__qualname__}"
        )
    DETECTORS[name] = cls
    return cls


def build_detector(type_name: str, params: Mapping[str, Any] | None = None) -> Detector:
    """A new detector of YAML type ``type_name`` with ``params``."""
    cls = DETECTORS.get(type_name) if isinstance(type_name, str) else None
    if cls is None:
        raise ValueError(
            f"unknown detector type {type_name!r}; valid types: {', '.join(sorted(DETECTORS))}"
        )
    if params is None:
        params = {}
    if not isinstance(params, Mapping):
        raise ValueError(
            f"{type_name} detector params must be a mapping, got {type(params).__name__}"
        )
    return cls(cls.Params.model_validate(dict(params)))


def detector_from_state(state: Mapping[str, Any]) -> Detector:
    """Rebuild a detector, parameters included, from its ``state_dict()``."""
    detector = build_detector(state["type"], state["params"])
    detector.load_state_dict(state)
    return detector


for _cls in (
    ThresholdDetector,
    BaselineDetector,
    SlopeDetector,
    EWMADetector,
    CUSUMDetector,
    EMARiseDetector,
    LogCUSUMDetector,
    PageHinkleyDetector,
    DrawdownDetector,
):
    register_detector(_cls)

__all__ = [
    "DETECTORS",
    "BaselineDetector",
    "CUSUMDetector",
    "Detector",
    "DetectorParams",
    "DetectorProtocol",
    "DrawdownDetector",
    "EMARiseDetector",
    "EWMADetector",
    "LogCUSUMDetector",
    "PageHinkleyDetector",
    "SlopeDetector",
    "ThresholdDetector",
    "Trend",
    "build_detector",
    "detector_from_state",
    "register_detector",
]
