"""The action registry: YAML action name -> Action class, and parameter validation.

Built-ins: ``attention_fp32_backward``, ``lower_lr``, ``halt``, ``page``, ``request_hparam``,
``raise_balance_coef``, ``raise_grad_accum`` and, when ``remediations.rollback`` is importable,
``rollback``. Register your own with ``register_action`` (an ``Action`` subclass) or
``register_callable`` (a plain function and a pydantic parameter model).

A rule's action parameters may also carry the runner's common keys (``RUNNER_KEYS``:
``dry_run``, ``cooldown``, ``max_per_window``, ``window_steps``) next to the action's own; see
``split_action_params`` for how they are told apart.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from remediations.attention import AttentionFP32Backward
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.halt import HaltAction
from remediations.lr import LowerLR
from remediations.page import PageAction
from remediations.requests import RaiseBalanceCoef, RaiseGradAccum, RequestHparam

ACTIONS: dict[str, type[Action]] = {}

RUNNER_KEYS: tuple[str, ...] = ("dry_run", "cooldown", "max_per_window", "window_steps")


class RunPolicy(BaseModel):
    """How the runner runs one action: the common keys a rule may set next to its params."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    dry_run: bool = Field(False, description="record what would be done; change nothing")
    cooldown: int = Field(
        500, ge=0, description="training steps after a run before the action may run again"
    )
    max_per_window: int = Field(3, ge=1, description="runs allowed within window_steps")
    window_steps: int = Field(10_000, ge=1, description="the window of max_per_window, in steps")


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
    if "dry_run" in params.model_fields:
        raise ValueError(
            f"register_action: {cls.__name__}.Params declares 'dry_run', which the runner owns "
            "(apply reads ActionContext.dry_run)"
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
    runner overrides).

    A key in ``RUNNER_KEYS`` belongs to the runner, unless the action's own parameter model
    declares it (``rollback`` has its own ``max_per_window`` / ``window_steps`` loop guard):
    then it belongs to the action, and the runner leaves that limit to the action.
    ``dry_run`` always belongs to the runner. Raises ValueError (unknown action) or pydantic
    ``ValidationError`` (bad parameters; ``loc`` names the field).
    """
    cls = action_class(name)
    raw = dict(params or {})
    own = cls.Params.model_fields
    runner = {k: raw.pop(k) for k in RUNNER_KEYS if k in raw and (k == "dry_run" or k not in own)}
    RunPolicy.model_validate(runner)  # check the overrides (partial: defaults fill the rest)
    return cls.Params.model_validate(raw), runner


def validate_action(name: str, params: Mapping[str, Any] | None = None) -> ActionParams:
    """Validate ``params`` (runner keys allowed) for action ``name``; returns the action's
    params. Raises ValueError for an unknown action, ``ValidationError`` for bad params."""
    return split_action_params(name, params)[0]


def runner_limits_owned_by_action(cls: type[Action]) -> frozenset[str]:
    """Runner keys the action's own parameter model declares (the action enforces them)."""
    return frozenset(k for k in RUNNER_KEYS if k != "dry_run" and k in cls.Params.model_fields)


def default_policy(cls: type[Action]) -> RunPolicy:
    """``RunPolicy`` defaults, adjusted by the class's ``runner_defaults`` (if any)."""
    overrides: Mapping[str, Any] = getattr(cls, "runner_defaults", {})
    return RunPolicy.model_validate(dict(overrides))


def _register_builtins() -> None:
    for cls in (
        AttentionFP32Backward,
        LowerLR,
        HaltAction,
        PageAction,
        RequestHparam,
        RaiseBalanceCoef,
        RaiseGradAccum,
    ):
        register_action(cls)
    try:  # written alongside; optional so that the registry works without it
        rollback = importlib.import_module("remediations.rollback")
    except Exception as exc:  # a missing or broken module must not take the others down
        warnings.warn(f"mechwatch: the rollback action is unavailable: {exc!r}", stacklevel=2)
        return
    register_action(rollback.RollbackAction)


_register_builtins()

__all__ = [
    "ACTIONS",
    "RUNNER_KEYS",
    "RunPolicy",
    "ValidationError",
    "action_class",
    "default_policy",
    "register_action",
    "register_callable",
    "runner_limits_owned_by_action",
    "split_action_params",
    "validate_action",
]
