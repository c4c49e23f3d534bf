"""Hyper-parameter requests: router fixes that only the training loop can carry out.

Raising the load-balancing (or z-loss) coefficient or the gradient accumulation changes code
the agent does not own, so the agent *requests* a new value and the loop reads it each step::

    coef = agent.hparams.get("balance_loss_coef", 0.01)
    accum = int(agent.hparams.get("grad_accum_steps", 8))
    loss = lm_loss + coef * balance_loss

``get(name, default)`` returns the requested value, or ``default`` while nothing was requested
(and remembers ``default`` as the value a first "multiply" request starts from). Actions:

- ``request_hparam``: ``{name, op: multiply|set, value, max, min, integer, base}``.
- ``raise_balance_coef``: multiply ``balance_loss_coef`` by ``factor`` (default 2), capped by
  ``max`` (default 1.0).
- ``raise_grad_accum``: multiply ``grad_accum_steps`` by ``factor`` (default 2), rounded up to
  an integer, capped by ``max`` (default 64).

The values live in the run's ``HyperparameterRequests`` (``remediations.hparams``), which the
agent saves with its state, so they survive restarts and rollbacks; actions reach it as
``ActionContext.hparams``.
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Any, Literal

from pydantic import ConfigDict, Field, model_validator

from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.hparams import HPARAM_NAME

BALANCE_COEF = "balance_loss_coef"
GRAD_ACCUM = "grad_accum_steps"


class RequestHparamParams(ActionParams):
    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    name: str = Field(pattern=HPARAM_NAME.pattern, description="the name the loop reads")
    op: Literal["multiply", "set"] = Field("multiply", description="multiply or set the value")
    value: float = Field(description="the factor (multiply) or the new value (set)")
    max: float | None = Field(None, description="cap: never request more than this")
    min: float | None = Field(None, description="never request less than this")
    integer: bool = Field(False, description="round up to an integer (accumulation steps)")
    base: float | None = Field(
        None,
        description="start value for multiply when neither a request nor a loop default exists",
    )

    @model_validator(mode="after")
    def _check(self) -> RequestHparamParams:
        if not math.isfinite(self.value) or (self.op == "multiply" and self.value <= 0):
            raise ValueError(f"value must be finite (and > 0 to multiply), got {self.value}")
        if self.max is not None and self.min is not None and self.min > self.max:
            raise ValueError(f"min ({self.min}) > max ({self.max})")
        return self


def _new_value(current: float | None, p: RequestHparamParams) -> float:
    if p.op == "set":
        value = p.value
    else:
        start = current if current is not None else p.base
        if start is None:
            raise ValueError(
                f"cannot multiply {p.name!r}: nothing requested yet, the loop has not read it "
                "(hparams.get) and no 'base' was given"
            )
        value = start * p.value
    if p.integer:
        value = float(math.ceil(value - 1e-9))
    if p.max is not None:
        value = min(value, p.max)
    if p.min is not None:
        value = max(value, p.min)
    return value


class RequestHparam(Action):
    """Request a new value for a named hyper-parameter the training loop reads."""

    name = "request_hparam"
    Params = RequestHparamParams

    def _params(self, params: ActionParams) -> RequestHparamParams:
        if isinstance(params, _ShortcutParams):
            return params.request()
        assert isinstance(params, RequestHparamParams)
        return params

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        p = self._params(params)
        store = ctx.hparams
        current = store.current(p.name)
        value = _new_value(current, p)
        capped = p.max is not None and value == p.max
        detail = (
            f"request {p.name} = {value:g} (was {current if current is None else f'{current:g}'})"
        )
        if capped:
            detail += f" [at cap {p.max:g}]"
        if not ctx.dry_run:
            store.set(p.name, value)
        return ActionOutcome(detail, {p.name: current}, {p.name: value})


class _ShortcutParams(ActionParams):
    """Parameters of a fixed-purpose shortcut: ``request()`` is the equivalent request."""

    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    @abstractmethod
    def request(self) -> RequestHparamParams: ...


def _loop_name(default: str) -> Any:
    """A shortcut's ``name`` field: the hyper-parameter it requests, as the loop reads it."""
    return Field(default, pattern=HPARAM_NAME.pattern, description="the name the loop reads")


class RaiseBalanceCoefParams(_ShortcutParams):
    factor: float = Field(2.0, gt=1.0, description="multiply the balancing-loss coefficient")
    max: float = Field(1.0, gt=0.0, description="cap")
    min: float = Field(
        0.0, ge=0.0, description="request at least this (a coefficient of 0 times a factor is 0)"
    )
    name: str = _loop_name(BALANCE_COEF)

    def request(self) -> RequestHparamParams:
        return RequestHparamParams(
            name=self.name, value=self.factor, max=self.max, min=self.min or None
        )


class RaiseGradAccumParams(_ShortcutParams):
    factor: float = Field(2.0, gt=1.0, description="multiply the gradient accumulation steps")
    max: int = Field(64, ge=1, description="cap")
    name: str = _loop_name(GRAD_ACCUM)

    def request(self) -> RequestHparamParams:
        return RequestHparamParams(
            name=self.name, value=self.factor, max=float(self.max), integer=True
        )


class RaiseBalanceCoef(RequestHparam):
    """Multiply the load-balancing loss coefficient (the loop reads ``balance_loss_coef``)."""

    name = "raise_balance_coef"
    Params = RaiseBalanceCoefParams


class RaiseGradAccum(RequestHparam):
    """Multiply the gradient accumulation (global batch); the loop reads ``grad_accum_steps``."""

    name = "raise_grad_accum"
    Params = RaiseGradAccumParams
