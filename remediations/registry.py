"""The action registry: YAML action name -> Action class, and parameter validation.

Built-ins: ``attention_fp32_backward``, ``lower_lr``, ``halt``, ``page``, ``request_hparam``,
``raise_balance_coef``, ``raise_grad_accum`` and ``rollback``. Register your own with
``register_action`` (an ``Action`` subclass) or ``register_callable`` (a plain function and a
pydantic parameter model).

A rule's action mapping may also carry the pacing keys (``remediations.pacing.PACING_KEYS``:
``dry_run``, ``cooldown``, ``max_per_window``, ``window_steps``, ``on_limit``) next to the
action's own parameters; ``split_action_params`` tells them apart. An action's parameter model
may not declare a pacing key: pacing belongs to one policy (``remediations.pacing``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from pydantic import ValidationError

from remediations.attention import AttentionFP32Backward
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.halt import HaltAction
from remediations.lr import LowerLR
from remediations.pacing import PACING_KEYS, PacingLimits, split_pacing
from remediations.page import PageAction
from remediations.requests import RaiseBalanceCoef, RaiseGradAccum, RequestHparam
from remediations.rollback import RollbackAction

ACTIONS: dict[str, type[Action]] = {}


def register_action(cls: type[Action], *, replace: bool = False) -> type[Action]:
    """Add an ``Action`` subclass under ``cls.name`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Action)):
        raise ValueError(f"register_action: expected an Action subclass, got {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(
            f"register_action: {cls.__name__}.name must be an identifier, got {name!r}"
        )
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, ActionParams)):
        raise ValueError(f"register_action: {cls.__name__}.Params must subclass ActionParams")
    owned = sorted(set(params.model_fields) & set(PACING_KEYS))
    if owned:
        raise ValueError(
            f"register_action: {cls.__name__}.Params declares {owned}, which pacing owns "
            "(remediations.pacing; apply reads ActionContext.dry_run)"
        )
    if name in ACTIONS and ACTIONS[name] is not cls and not replace:
        raise ValueError(
            f"register_action: an action named {name!r} is already registered "
            f"({ACTIONS[name].__qualname__}); pass replace=True to override it"
        )
    ACTIONS[name] = cls
    return cls


def register_callable(
    name: str,
    fn: Callable[[ActionContext, Any], ActionOutcome | str | dict[str, Any] | None],
    params_model: type[ActionParams] = ActionParams,
    *,
    replace: bool = False,
) -> type[Action]:
    """Register a plain function as an action.

    ``fn(ctx, params)`` gets the ``ActionContext`` and the validated ``params_model`` instance
    and returns an ``ActionOutcome``, a one-line description, a dict (the ``after`` values) or
    None. It must honour ``ctx.dry_run`` (change nothing) and be all or nothing. Returns the
    generated ``Action`` class.
    """
    if not callable(fn):
        raise ValueError(f"register_callable: fn for {name!r} is not callable")

    def apply(self: Action, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        result = fn(ctx, params)
        if isinstance(result, ActionOutcome):
            return result
        if isinstance(result, str):
            return ActionOutcome(result)
        if isinstance(result, dict):
            return ActionOutcome(f"{name} ran", after=dict(result))
        if result is None:
            return ActionOutcome(f"{name} ran")
        raise TypeError(
            f"action {name!r}: the function returned {type(result).__name__}; expected an "
            "ActionOutcome, a str, a dict or None"
        )

    cls = type(
        f"CallableAction_{name}",
        (Action,),
        {
            "name": name,
            "Params": params_model,
            "apply": apply,
            "__doc__": fn.__doc__,
            "function": staticmethod(fn),
        },
    )
    return register_action(cls, replace=replace)


def action_class(name: str) -> type[Action]:
    """The registered class for ``name``; ValueError listing the valid names otherwise."""
    cls = ACTIONS.get(name)
    if cls is None:
        raise ValueError(
            f"unknown action {name!r}; registered actions: {', '.join(sorted(ACTIONS))}"
        )
    return cls


def split_action_params(
    name: str, params: Mapping[str, Any] | None
) -> tuple[ActionParams, dict[str, Any]]:
    """Validate a rule's parameters for action ``name``: returns (the action's params, the
    pacing keys). Raises ValueError (unknown action) or pydantic ``ValidationError`` (bad
    parameters; ``loc`` names the field)."""
    cls = action_class(name)
    own, pacing = split_pacing(params)
    return cls.Params.model_validate(own), pacing


def validate_action(name: str, params: Mapping[str, Any] | None = None) -> ActionParams:
    """Validate ``params`` (pacing keys allowed) for action ``name``; returns the action's
    params. Raises ValueError for an unknown action, ``ValidationError`` for bad params."""
    return split_action_params(name, params)[0]


def pacing_limits(cls: type[Action], overrides: Mapping[str, Any] | None = None) -> PacingLimits:
    """``PacingLimits`` defaults, then the class's ``pacing`` defaults, then ``overrides``."""
    return PacingLimits.model_validate({**cls.pacing, **dict(overrides or {})})


def _register_builtins() -> None:
    for cls in (
        AttentionFP32Backward,
        LowerLR,
        HaltAction,
        PageAction,
        RequestHparam,
        RaiseBalanceCoef,
        RaiseGradAccum,
        RollbackAction,
    ):
        register_action(cls)


_register_builtins()

__all__ = [
    "ACTIONS",
    "ValidationError",
    "action_class",
    "pacing_limits",
    "register_action",
    "register_callable",
    "split_action_params",
    "validate_action",
]
