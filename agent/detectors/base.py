"""The contract every detector follows.

A detector turns a series of floats, fed one value at a time with the training step it was
measured at, into a verdict: is the series departing from its normal behaviour right now, in
which direction, and since when. Detectors import no torch; they are fed one value per monitor
evaluation (every 10-50 training steps), and cost O(1) or O(window) per update.

Shared behaviour, implemented here once:

- ``update(step, value)`` feeds one value and returns the detector (``river`` style).
- Non-finite values (NaN, +inf, -inf) are *gaps* for the statistical detectors: they are
  counted in ``n_nonfinite`` and change nothing else, not the baseline, not the running sums,
  not the verdict of the previous finite update. A NaN loss is the business of a dedicated
  symptom rule (``loss_nonfinite``), not of a drop detector. ``threshold`` is the exception
  and says so: it compares the raw value (NaN is neither above nor below anything, +inf is
  above every ``above``).
- Finite values of magnitude beyond ~1e150 may overflow a detector's sums and variances to
  inf or NaN; that never raises (not even under ``-W error``), it only spoils that detector's
  verdicts (build a new one). Real metrics are nowhere near.
- Steps are expected to increase. A step that goes back (after a rollback) is accepted as is;
  load the state saved with the checkpoint, or call ``reset()``.
- ``state_dict()`` is JSON-serializable (``json.dumps(..., allow_nan=False)`` works; non-finite
  floats, such as a threshold's latest value or sums overflowed by values beyond ~1e150, are
  stored as the strings ``"nan"``, ``"inf"``, ``"-inf"``) and ``load_state_dict``
  restores it exactly: the detector then produces the same outputs as the one that saved it.
  A state saved with other parameters is refused with a ``ValueError`` (build the detector
  from the saved parameters with ``agent.detectors.detector_from_state`` instead).

Two types, one contract: ``DetectorProtocol`` is what the rule engine depends on (any object
with those members will do, such as a test's fake passed in a ``DetectorCatalog``); the
``Detector`` base class implements it, plus the behaviour above, for every built-in detector.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol

from pydantic import BaseModel, ConfigDict

Trend = Literal["falling", "rising"]
TREND_FALLING: Trend = "falling"
TREND_RISING: Trend = "rising"

# Smallest positive scale used when every other floor is 0 (a constant all-zero warm-up):
# any later departure then has an enormous but finite z-score for ordinary values.
TINY_SCALE = 2.2250738585072014e-308  # sys.float_info.min
# Scale floor relative to the baseline's magnitude: far above float64 rounding (2.2e-16).
RELATIVE_SCALE_FLOOR = 1e-12

STATE_VERSION = 1


class DetectorParams(BaseModel):
    """Base of every detector's parameter model: unknown keys, NaN and inf are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


def encode_float(x: float | None) -> float | str | None:
    """A float for a strict-JSON state dict: non-finite values become strings."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


def decode_float(x: float | str | None) -> float | None:
    """Inverse of ``encode_float``."""
    return None if x is None else float(x)


def encode_tree(x: Any) -> Any:
    """``encode_float`` applied to every float inside nested lists and dicts."""
    if isinstance(x, float):
        return encode_float(x)
    if isinstance(x, list | tuple):
        return [encode_tree(v) for v in x]
    if isinstance(x, dict):
        return {k: encode_tree(v) for k, v in x.items()}
    return x


def decode_tree(x: Any) -> Any:
    """Inverse of ``encode_tree``: the strings "nan", "inf", "-inf" become floats again."""
    if isinstance(x, str) and x in _NONFINITE_STRINGS:
        return float(x)
    if isinstance(x, list):
        return [decode_tree(v) for v in x]
    if isinstance(x, dict):
        return {k: decode_tree(v) for k, v in x.items()}
    return x


_NONFINITE_STRINGS = frozenset({"nan", "inf", "-inf"})


def scale_floor(scale: float, minimum: float, center: float) -> float:
    """``scale`` floored by a user minimum, by 1e-12 * |center| and by the tiniest float."""
    return max(scale, minimum, RELATIVE_SCALE_FLOOR * abs(center), TINY_SCALE)


def welford(n: int, mean: float, m2: float, value: float) -> tuple[float, float]:
    """Welford's update of a running mean and M2 (the sum of squared deviations) with the
    ``n``-th value (``n`` counts it); the sample variance is ``M2 / (n - 1)``."""
    delta = value - mean
    mean += delta / n
    return mean, m2 + delta * (value - mean)


def default_when_neither(data: Any, keys: tuple[str, str], default: Mapping[str, Any]) -> Any:
    """For a "before" model validator: raw parameters ``data`` with ``default`` added when it
    is a mapping that names neither of two alternative ``keys``."""
    if isinstance(data, Mapping) and keys[0] not in data and keys[1] not in data:
        return {**data, **default}
    return data


@dataclass(frozen=True)
class StateFields:
    """A detector's own scalar state, declared once for saving and restoring: the names of its
    attributes (each stored as ``_<name>``, saved under ``<name>``) by how a saved value is read
    back: ``ints`` with ``int``, ``floats`` with ``float``, ``as_saved`` as it is (None or a
    number: an optional step, a statistic not known yet)."""

    ints: tuple[str, ...] = ()
    floats: tuple[str, ...] = ()
    as_saved: tuple[str, ...] = ()
    # fields added after states were saved without them: name -> the value such a state means
    # (saved and read back as they are)
    added: Mapping[str, Any] = field(default_factory=dict)

    def save(self, obj: object) -> dict[str, Any]:
        names = self.ints + self.floats + self.as_saved + tuple(self.added)
        return {name: getattr(obj, f"_{name}") for name in names}

    def load(self, obj: object, state: Mapping[str, Any]) -> None:
        for names, read in ((self.ints, int), (self.floats, float), (self.as_saved, None)):
            for name in names:
                setattr(obj, f"_{name}", state[name] if read is None else read(state[name]))
        for name, before in self.added.items():
            setattr(obj, f"_{name}", state.get(name, before))


class DetectorProtocol(Protocol):
    """What the rule engine needs from a detector: feed values, read the verdict, save it."""

    def update(self, step: int, value: float) -> DetectorProtocol:
        """Feed the value measured at ``step``; returns the detector."""
        ...

    @property
    def triggered(self) -> bool: ...

    @property
    def onset_step(self) -> int | None: ...

    @property
    def direction(self) -> str | None: ...

    @property
    def statistic(self) -> float | None: ...

    @property
    def baseline(self) -> float | None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class Detector(ABC):
    """One change detector, implementing ``DetectorProtocol``. Subclasses set ``type`` and
    ``Params``, implement the hooks ``_reset_state`` and ``_update_finite``, and declare their
    own state in ``_state_fields`` (state of other kinds: extend ``_get_state`` and
    ``_set_state``)."""

    type: ClassVar[str]
    Params: ClassVar[type[DetectorParams]] = DetectorParams
    # True for detectors that fire on a jump and track a slow drift instead (a z-score against
    # recent values): their alert on the loss says the run changed abruptly, from outside the
    # mechanisms (agent/attribution.py). Custom detectors without it count as not abrupt.
    abrupt: ClassVar[bool] = False
    _state_fields: ClassVar[StateFields] = StateFields()

    def __init__(
        self, params: DetectorParams | Mapping[str, Any] | None = None, **kwargs: Any
    ) -> None:
        if params is None:
            params = self.Params(**kwargs)
        elif kwargs:
            raise ValueError(
                f"{type(self).__name__}: pass either a params object or keyword arguments, "
                f"not both (got keywords {sorted(kwargs)})"
            )
        elif isinstance(params, Mapping):
            params = self.Params.model_validate(dict(params))
        elif not isinstance(params, self.Params):
            raise ValueError(
                f"{type(self).__name__}: params must be a {self.Params.__name__} or a mapping, "
                f"got {type(params).__name__}"
            )
        self.params = params
        self._n_updates = 0  # every update, finite or not
        self._n_nonfinite = 0
        self._last_step: int | None = None
        self._clear_verdict()
        self._reset_state()

    # ----------------------------------------------------------------- feeding
    def update(self, step: int, value: float) -> Detector:
        """Feed the value measured at ``step``; returns ``self``."""
        step = int(step)
        value = float(value)
        self._n_updates += 1
        if self._last_step is not None and step < self._last_step:
            self._rewound(step)
        self._last_step = step
        if math.isfinite(value):
            self._update_finite(step, value)
        else:
            self._n_nonfinite += 1
            self._update_nonfinite(step, value)
        return self

    def _rewound(self, step: int) -> None:  # noqa: B027 - optional hook
        """The series went back to ``step`` (the run was rolled back): a detector whose state
        describes training progress (a running best) starts over here; default: nothing."""

    def reset(self) -> None:
        """Forget the current departure; keep what was learned (see each detector)."""
        self._clear_verdict()
        self._forget_departure()

    # ----------------------------------------------------------------- verdict
    @property
    def triggered(self) -> bool:
        """The detector's condition holds at the latest (finite) update."""
        return self._triggered

    @property
    def onset_step(self) -> int | None:
        """Estimated first step of the current departure; None while not triggered."""
        return self._onset_step if self._triggered else None

    @property
    def direction(self) -> Trend | None:
        """``"falling"`` or ``"rising"`` while triggered, else None."""
        return self._direction if self._triggered else None

    @property
    def statistic(self) -> float | None:
        """The detector's current statistic (z, cusum, slope ...) for evidence."""
        return self._statistic

    @property
    def baseline(self) -> float | None:
        """The learned baseline (for example the warm-up median), if the detector has one."""
        return None

    @property
    def ready(self) -> bool:
        """Warm-up is over: the detector can trigger."""
        return True

    @property
    def n_updates(self) -> int:
        """Number of updates, finite or not."""
        return self._n_updates

    @property
    def n_nonfinite(self) -> int:
        """Number of non-finite values received (ignored, see the module docstring)."""
        return self._n_nonfinite

    @property
    def last_step(self) -> int | None:
        return self._last_step

    # ----------------------------------------------------------------- state
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly where this detector is (strict JSON)."""
        return {
            "version": STATE_VERSION,
            "type": self.type,
            "params": self.params.model_dump(mode="json"),
            "n_updates": self._n_updates,
            "n_nonfinite": self._n_nonfinite,
            "last_step": self._last_step,
            "triggered": self._triggered,
            "onset_step": self._onset_step,
            "direction": self._direction,
            "statistic": encode_float(self._statistic),
            "state": encode_tree(self._get_state()),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore what ``state_dict`` returned. Raises ValueError for another type, version
        or parameter set."""
        if state.get("type") != self.type:
            raise ValueError(
                f"detector state is for type {state.get('type')!r}, this detector is {self.type!r}"
            )
        if state.get("version") != STATE_VERSION:
            raise ValueError(
                f"detector state version {state.get('version')!r} is not supported "
                f"(expected {STATE_VERSION})"
            )
        saved = self.Params.model_validate(state["params"])
        if saved != self.params:
            raise ValueError(
                f"{self.type} detector state was saved with params "
                f"{saved.model_dump(mode='json')}, this detector has "
                f"{self.params.model_dump(mode='json')}; build it from the saved state or reset"
            )
        self._n_updates = int(state["n_updates"])
        self._n_nonfinite = int(state["n_nonfinite"])
        self._last_step = state["last_step"]
        self._triggered = bool(state["triggered"])
        self._onset_step = state["onset_step"]
        self._direction = state["direction"]
        self._statistic = decode_float(state["statistic"])
        self._set_state(decode_tree(state["state"]))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.params.model_dump().items())
        return f"{type(self).__name__}({args})"

    # ----------------------------------------------------------------- hooks
    def _clear_verdict(self) -> None:
        self._triggered = False
        self._onset_step: int | None = None
        self._direction: Trend | None = None
        self._statistic: float | None = None

    def _set_verdict(self, trend: Trend | None, onset_step: int | None) -> None:
        """Triggered in ``trend`` since ``onset_step``, or not triggered when trend is None."""
        self._triggered = trend is not None
        self._direction = trend
        self._onset_step = onset_step if trend is not None else None
        assert trend is None or onset_step is not None, "a triggered detector needs an onset"

    def _set_larger_side_verdict(
        self,
        direction: str,
        limit: float,
        high: tuple[float, int | None],
        low: tuple[float, int | None],
    ) -> None:
        """The verdict of a detector with one statistic >= 0 per side (CUSUM's sums, Page-
        Hinkley's PH), each with the onset of its current excursion: triggered on a side
        ``direction`` watches whose statistic exceeds ``limit`` (the larger one when both
        do); the statistic shown is the larger, signed (+ rising, - falling)."""
        (high_stat, high_onset), (low_stat, low_onset) = high, low
        self._statistic = high_stat if high_stat >= low_stat else -low_stat
        high_fires = direction in ("rising", "both") and high_stat > limit
        low_fires = direction in ("falling", "both") and low_stat > limit
        if high_fires and (not low_fires or high_stat >= low_stat):
            self._set_verdict(TREND_RISING, high_onset)
        elif low_fires:
            self._set_verdict(TREND_FALLING, low_onset)
        else:
            self._set_verdict(None, None)

    @abstractmethod
    def _reset_state(self) -> None:
        """Initialise everything the detector learns and tracks (called by __init__)."""

    def _forget_departure(self) -> None:
        """Forget the departure tracked so far (called by ``reset``); default: nothing more."""
        return None

    @abstractmethod
    def _update_finite(self, step: int, value: float) -> None:
        """Consume one finite value and set the verdict."""

    def _update_nonfinite(self, step: int, value: float) -> None:
        """Default for NaN / inf: a gap that changes nothing (see the module docstring)."""
        return None

    def _get_state(self) -> dict[str, Any]:
        """The subclass's own state (``encode_tree`` makes it strict JSON): by default the
        attributes that ``_state_fields`` names."""
        return self._state_fields.save(self)

    def _set_state(self, state: Mapping[str, Any]) -> None:
        """Inverse of ``_get_state``."""
        self._state_fields.load(self, state)
