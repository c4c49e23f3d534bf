"""``StateFields``: a detector's own state declared once, saved and restored from it."""

from __future__ import annotations

import json
import math

import pytest

from agent.detectors.base import Detector, StateFields


class _RunningMax(Detector):
    """A user's detector whose whole state is declared: triggered above the running max."""

    type = "running_max"
    _state_fields = StateFields(ints=("count",), floats=("top",), as_saved=("since",))

    def _reset_state(self) -> None:
        self._count = 0
        self._top = -math.inf
        self._since: int | None = None

    def _update_finite(self, step: int, value: float) -> None:
        self._count += 1
        above = self._count > 1 and value > self._top
        self._since = (self._since if self._since is not None else step) if above else None
        self._top = max(self._top, value)
        self._set_verdict("rising" if above else None, self._since)


def test_declared_fields_round_trip_through_strict_json() -> None:
    d = _RunningMax()
    for step, value in enumerate([1.0, 0.5, 2.0, 3.0]):
        d.update(step, value)
    state = d.state_dict()
    assert state["state"] == {"count": 4, "top": 3.0, "since": 2}
    fresh = _RunningMax()
    fresh.load_state_dict(json.loads(json.dumps(state, allow_nan=False)))
    assert (fresh.triggered, fresh.onset_step) == (True, 2)
    assert [fresh.update(4, 5.0).onset_step, d.update(4, 5.0).onset_step] == [2, 2]


def test_values_are_read_back_as_declared() -> None:
    d = _RunningMax()
    d.update(0, 1.0)  # top is 1.0; before it, -inf is saved as "-inf"
    assert _RunningMax().state_dict()["state"]["top"] == "-inf"
    state = d.state_dict()
    state["state"] = {"count": 3.0, "top": 7, "since": None}  # as a hand-edited file might
    d.load_state_dict(state)
    assert (type(d._count), d._count, type(d._top), d._top, d._since) == (int, 3, float, 7.0, None)
    with pytest.raises(KeyError):
        state["state"] = {"count": 3, "top": 7.0}
        d.load_state_dict(state)
