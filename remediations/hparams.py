"""The run's hyper-parameter requests: named values the agent asks for and the training loop
reads each step (``agent.hparams.get("balance_loss_coef", 0.01)``); see
``remediations.requests`` for the actions that set them."""

from __future__ import annotations

import math
import re
from typing import Any

HPARAM_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]*$")


class HyperparameterRequests:
    """Named values the agent requests and the training loop reads each step."""

    def __init__(self) -> None:
        self._values: dict[str, float] = {}  # requested values
        self._defaults: dict[str, float] = {}  # what the loop passed to get() last

    def get(self, name: str, default: float) -> float:
        """The requested value of ``name``, else ``default``. Cheap: two dict operations."""
        self._defaults[name] = default
        return self._values.get(name, default)

    def current(self, name: str) -> float | None:
        """The requested value, else the loop's last default, else None."""
        return self._values.get(name, self._defaults.get(name))

    def requested(self) -> dict[str, float]:
        return dict(self._values)

    def set(self, name: str, value: float) -> None:
        if not HPARAM_NAME.match(name):
            raise ValueError(f"hyper-parameter name {name!r} is not an identifier")
        if not math.isfinite(value):
            raise ValueError(f"hyper-parameter {name}: value must be finite, got {value}")
        self._values[name] = value

    def clear(self, name: str | None = None) -> None:
        """Drop one request (or all): the loop's defaults apply again."""
        if name is None:
            self._values.clear()
        else:
            self._values.pop(name, None)

    def state_dict(self) -> dict[str, Any]:
        return {"values": dict(self._values)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        values = state.get("values", {})
        if not isinstance(values, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) for k, v in values.items()
        ):
            raise ValueError(f"hyper-parameter requests state: bad values {values!r}")
        self._values = {k: v for k, v in values.items()}
