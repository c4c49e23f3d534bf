"""``lower_lr``: multiply the learning rate by a factor, with a floor, and make it stick.

A direct edit of ``group["lr"]`` does not last: torch schedulers recompute the LR every step
(LambdaLR and OneCycleLR from ``base_lrs`` / group keys, CosineAnnealingLR and StepLR from the
current ``group["lr"]``, recursively), and nanoGPT-style loops assign the LR themselves. So
``LRControl`` keeps a scale (and a floor) per parameter group and applies it in the way each
case needs:

- a torch scheduler (any ``LRScheduler`` incl. OneCycleLR, CyclicLR, ReduceLROnPlateau,
  SequentialLR, ChainedScheduler): automatic. The scheduler's ``step`` runs on the *scheduled*
  (unscaled) LRs, exactly as if nothing had happened, and the scale is applied after it, so
  recursive and closed forms alike give ``scheduled * scale`` (``get_last_lr()`` returns the
  scaled values, as the optimizer uses them). The scheduled value of a scaled group lives in
  the group itself under ``SCHEDULED_LR_KEY``, so it is saved with ``optimizer.state_dict()``
  and a rollback that loads an older optimizer state brings the matching value back.
- no scheduler: ``group["lr"]`` is scaled once in place. A loop that sets the LR itself must
  multiply by ``lr_scale`` (or call ``scaled_lr(lr, group_index)``, which also applies the floor).

The scaled LR of a group is ``max(scheduled * scale, min(scheduled, min_lr))``: the reduction
never takes the LR below ``min_lr``, and never raises it above what the schedule says.
Tensor-valued LRs are updated in place (``copy_``), with tensor arithmetic: no host sync.

With ``relax_above`` a cut is watched afterwards and relaxed once, by half (log scale), if the
mechanism it was meant to calm settles beyond its pre-onset level on the other side
(``remediations.relax``).
"""

from __future__ import annotations

import copyreg
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from pydantic import ConfigDict, Field

from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.relax import OvershootWatch, watched_series

if TYPE_CHECKING:
    from agent.samples import Sample

SCHEDULED_LR_KEY = "mechwatch_scheduled_lr"  # param-group key: the LR the schedule set

LR = float | torch.Tensor


def _scaled(scheduled: LR, scale: float, floor: float) -> LR:
    """max(scheduled * scale, min(scheduled, floor)); a tensor in gives a new tensor out."""
    if isinstance(scheduled, torch.Tensor):
        return torch.maximum(scheduled * scale, torch.clamp(scheduled, max=floor))
    return max(scheduled * scale, min(scheduled, floor))


def _copy(lr: LR) -> LR:
    return lr.detach().clone() if isinstance(lr, torch.Tensor) else lr


def _set_lr(group: dict[str, Any], value: LR) -> None:
    """Write ``group["lr"]``; a tensor LR keeps its identity (updated in place)."""
    current = group["lr"]
    if isinstance(current, torch.Tensor):
        current.copy_(value)
    else:
        group["lr"] = float(value) if isinstance(value, torch.Tensor) else value


def _as_float(lr: LR) -> float:
    return float(lr)  # for audit records only (a host sync when the LR lives on a device)


def _lr_record(optimizer: torch.optim.Optimizer, scales: list[float]) -> dict[str, Any]:
    """An audit record's before/after values: every group's LR and scale."""
    return {"lr": [_as_float(g["lr"]) for g in optimizer.param_groups], "lr_scale": scales}


# scheduler -> the LRControl that scales its optimizer (weak: a dropped scheduler goes away)
_controls: weakref.WeakKeyDictionary[Any, LRControl] = weakref.WeakKeyDictionary()
_scaled_classes: dict[type, type] = {}


def _scaled_scheduler_class(base: type) -> type:
    """A subclass of ``base`` whose ``step`` runs on scheduled LRs and re-applies the scale.

    The class of the scheduler instance is swapped (instead of setting an instance attribute)
    so that ``scheduler.state_dict()``, which copies ``__dict__``, stays free of our wrapper.
    """
    if getattr(base, "_mechwatch_scaled", False):
        return base
    cls = _scaled_classes.get(base)
    if cls is None:

        def step(self: Any, *args: Any, **kwargs: Any) -> Any:
            control = _controls.get(self)
            if control is None:
                return base.step(self, *args, **kwargs)
            control._restore_scheduled(self.optimizer)
            try:
                return base.step(self, *args, **kwargs)
            finally:
                control._apply_scales(self.optimizer, self, after_step=True)

        def __reduce_ex__(self: Any, protocol: Any) -> Any:
            # Pickle (and deepcopy) as the plain scheduler class: the scaling is not its state.
            reduced = base.__reduce_ex__(self, protocol)
            if isinstance(reduced, tuple) and reduced[0] is copyreg.__newobj__:
                if reduced[1] == (cls,):
                    return (copyreg._reconstructor, (base, object, None), *reduced[2:])
            return reduced

        cls = type(
            base.__name__,
            (base,),
            {"step": step, "__reduce_ex__": __reduce_ex__, "_mechwatch_scaled": True},
        )
        cls.__qualname__ = base.__qualname__
        cls.__module__ = base.__module__
        cls.__doc__ = base.__doc__
        _scaled_classes[base] = cls
    return cls


class LRControl:
    """Per-group LR scales and floors for one optimizer (and its scheduler, if any)."""

    def __init__(self) -> None:
        self._scales: dict[int, float] = {}  # group index -> scale (absent = 1.0)
        self._floors: dict[int, float] = {}  # group index -> min_lr (absent = 0.0)

    # -- what a loop reads -----------------------------------------------------------------
    def scale_for(self, group_index: int) -> float:
        return self._scales.get(group_index, 1.0)

    def floor_for(self, group_index: int) -> float:
        return self._floors.get(group_index, 0.0)

    @property
    def lr_scale(self) -> float:
        """Group 0's scale: the scale of every group unless ``lower_lr`` selected some groups
        (a loop with per-group LRs reads ``scale_for(i)``)."""
        return self.scale_for(0)

    @property
    def active(self) -> bool:
        return any(s != 1.0 for s in self._scales.values())

    def scaled_lr(self, lr: LR, group_index: int = 0) -> LR:
        """What a hand-written loop should use: ``lr`` scaled for the group, floor applied."""
        return _scaled(lr, self.scale_for(group_index), self.floor_for(group_index))

    # -- changes -----------------------------------------------------------------------------
    def plan(
        self, optimizer: torch.optim.Optimizer, groups: list[int], factor: float, min_lr: float
    ) -> tuple[dict[int, float], dict[int, float]]:
        """New (scales, floors) after multiplying ``groups`` by ``factor``; changes nothing."""
        if not 0.0 < factor <= 1.0:
            raise ValueError(f"factor must be in (0, 1], got {factor}")
        if min_lr < 0.0:
            raise ValueError(f"min_lr must be >= 0, got {min_lr}")
        n = len(optimizer.param_groups)
        bad = [g for g in groups if not 0 <= g < n]
        if bad:
            raise ValueError(f"param group indices {bad} out of range (optimizer has {n})")
        scales, floors = dict(self._scales), dict(self._floors)
        for g in groups:
            scales[g] = self.scale_for(g) * factor
            floors[g] = min_lr
        return scales, floors

    def plan_scales(self, new: dict[int, float]) -> tuple[dict[int, float], dict[int, float]]:
        """New (scales, floors) with the groups of ``new`` set to its scales (in (0, 1]), the
        other groups and every floor unchanged; changes nothing."""
        bad = {g: s for g, s in new.items() if not 0.0 < s <= 1.0}
        if bad:
            raise ValueError(f"scales must be in (0, 1], got {bad}")
        return {**self._scales, **new}, dict(self._floors)

    def commit(
        self,
        optimizer: torch.optim.Optimizer,
        scheduler: Any | None,
        scales: dict[int, float],
        floors: dict[int, float],
    ) -> None:
        """Adopt ``scales``/``floors`` and impose them on ``optimizer`` (and ``scheduler``).
        All or nothing: on an exception the optimizer, scheduler and control are restored."""
        saved = self._snapshot(optimizer, scheduler)
        try:
            self._scales, self._floors = dict(scales), dict(floors)
            self.reapply(optimizer, scheduler)
        except BaseException:
            self._restore(optimizer, scheduler, saved)
            raise

    def reapply(self, optimizer: torch.optim.Optimizer | None, scheduler: Any | None) -> None:
        """Re-impose the scales (after a restart or after loading an older optimizer and
        scheduler state), and make ``scheduler`` keep them from now on."""
        if scheduler is not None:
            self.attach(scheduler)
        if optimizer is not None:
            self._apply_scales(optimizer, scheduler)

    def attach(self, scheduler: Any) -> None:
        """Make ``scheduler.step`` compute from scheduled LRs and re-apply the scales."""
        if not hasattr(scheduler, "step") or not hasattr(scheduler, "optimizer"):
            raise ValueError(
                f"{type(scheduler).__name__} is not a torch LR scheduler (needs .step and "
                ".optimizer); pass scheduler=None and use lr_scale in the loop"
            )
        cls = _scaled_scheduler_class(type(scheduler))
        if type(scheduler) is not cls:
            scheduler.__class__ = cls
        _controls[scheduler] = self

    # -- mechanics ---------------------------------------------------------------------------
    def _restore_scheduled(self, optimizer: torch.optim.Optimizer) -> None:
        """Put the schedule's own LR back into every scaled group (before a scheduler step)."""
        for group in optimizer.param_groups:
            if SCHEDULED_LR_KEY in group:
                _set_lr(group, group[SCHEDULED_LR_KEY])

    def _apply_scales(
        self, optimizer: torch.optim.Optimizer, scheduler: Any | None, after_step: bool = False
    ) -> None:
        """Record the scheduled LR of each scaled group and write the scaled LR."""
        for i, group in enumerate(optimizer.param_groups):
            scale = self.scale_for(i)
            if scale == 1.0 and SCHEDULED_LR_KEY not in group:
                continue
            # Right after a scheduler step group["lr"] is the schedule's new value; otherwise
            # the stored one is (a group never scaled before holds the schedule's value).
            scheduled = group["lr"] if after_step else group.get(SCHEDULED_LR_KEY, group["lr"])
            group[SCHEDULED_LR_KEY] = _copy(scheduled)
            _set_lr(group, _scaled(scheduled, scale, self.floor_for(i)))
        if scheduler is not None and hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [_copy(g["lr"]) for g in optimizer.param_groups]

    def _snapshot(self, optimizer: torch.optim.Optimizer, scheduler: Any | None) -> dict[str, Any]:
        return {
            "scales": dict(self._scales),
            "floors": dict(self._floors),
            "lrs": [_copy(g["lr"]) for g in optimizer.param_groups],
            "scheduled": [
                _copy(g[SCHEDULED_LR_KEY]) if SCHEDULED_LR_KEY in g else None
                for g in optimizer.param_groups
            ],
            "scheduler_class": None if scheduler is None else type(scheduler),
            "scheduler_control": None if scheduler is None else _controls.get(scheduler),
            "last_lr": None if scheduler is None else getattr(scheduler, "_last_lr", None),
        }

    def _restore(
        self, optimizer: torch.optim.Optimizer, scheduler: Any | None, saved: dict[str, Any]
    ) -> None:
        self._scales, self._floors = saved["scales"], saved["floors"]
        for group, lr, scheduled in zip(
            optimizer.param_groups, saved["lrs"], saved["scheduled"], strict=True
        ):
            _set_lr(group, lr)
            if scheduled is None:
                group.pop(SCHEDULED_LR_KEY, None)
            else:
                group[SCHEDULED_LR_KEY] = scheduled
        if scheduler is not None:
            scheduler.__class__ = saved["scheduler_class"]
            if saved["scheduler_control"] is None:
                _controls.pop(scheduler, None)
            else:
                _controls[scheduler] = saved["scheduler_control"]
            if saved["last_lr"] is not None:
                scheduler._last_lr = saved["last_lr"]

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        groups = sorted(set(self._scales) | set(self._floors))
        return {"groups": [[g, self.scale_for(g), self.floor_for(g)] for g in groups]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        scales: dict[int, float] = {}
        floors: dict[int, float] = {}
        try:
            for g, scale, floor in state["groups"]:
                if not (isinstance(g, int) and g >= 0 and 0.0 < scale <= 1.0 and floor >= 0.0):
                    raise ValueError(f"bad entry {[g, scale, floor]}")
                scales[g], floors[g] = float(scale), float(floor)
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"LR control state: expected {{'groups': [[index, scale, min_lr], ...]}}: {exc}"
            ) from exc
        self._scales, self._floors = scales, floors


# -- the action ---------------------------------------------------------------------------------
class LowerLRParams(ActionParams):
    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    factor: float = Field(0.5, gt=0.0, le=1.0, description="multiply the LR by this, in (0, 1]")
    min_lr: float = Field(0.0, ge=0.0, description="never lower a group's LR below this")
    groups: Literal["all", "router"] | list[int | str] = Field(
        "all",
        description=(
            "'all'; 'router' (groups holding any router parameter); or a list of group indices "
            "and group names (the param group's 'name' key)"
        ),
    )
    relax_above: float | None = Field(
        None,
        gt=1.0,
        description=(
            "relax the cut once, by half in log scale, when every series of the incident's "
            "evidence settles beyond this many times its pre-onset baseline on the side "
            "opposite to the fault (over-damped); None = never"
        ),
    )
    relax_for: int = Field(4, ge=1, description="read-outs in a row beyond relax_above")


def select_groups(
    optimizer: torch.optim.Optimizer,
    groups: Literal["all", "router"] | list[int | str],
    router_parameters: Any | None = None,
) -> list[int]:
    """Indices of the param groups named by ``groups`` (see ``LowerLRParams.groups``)."""
    n = len(optimizer.param_groups)
    if groups == "all":
        return list(range(n))
    if groups == "router":
        if not router_parameters:
            raise ValueError(
                "groups: 'router' needs the router parameters (ActionContext."
                "router_parameters); none were given"
            )
        router_ids = {id(p) for p in router_parameters}
        chosen = [
            i
            for i, g in enumerate(optimizer.param_groups)
            if any(id(p) in router_ids for p in g["params"])
        ]
        if not chosen:
            raise ValueError("groups: 'router': no param group holds a router parameter")
        return chosen
    names = {g.get("name"): i for i, g in enumerate(optimizer.param_groups) if "name" in g}
    chosen = []
    for item in groups:
        if isinstance(item, int):
            if not 0 <= item < n:
                raise ValueError(f"groups: index {item} out of range (optimizer has {n} groups)")
            chosen.append(item)
        elif item in names:
            chosen.append(names[item])
        else:
            raise ValueError(f"groups: no param group named {item!r} (named: {sorted(names)})")
    if not chosen:
        raise ValueError("groups: empty selection")
    return sorted(set(chosen))


class LowerLR(Action):
    """Multiply the LR of all (or selected) param groups by ``factor``, never below ``min_lr``."""

    name = "lower_lr"
    Params = LowerLRParams

    def __init__(self, control: LRControl | None = None) -> None:
        self.control = control if control is not None else LRControl()
        self.watches: list[OvershootWatch] = []  # cuts that may be relaxed once

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        assert isinstance(params, LowerLRParams)
        optimizer = ctx.optimizer
        if optimizer is None:
            raise ValueError("lower_lr needs the optimizer (ActionContext.optimizer is None)")
        chosen = select_groups(optimizer, params.groups, ctx.router_parameters)
        scales, floors = self.control.plan(optimizer, chosen, params.factor, params.min_lr)
        before = _lr_record(
            optimizer, [self.control.scale_for(i) for i in range(len(optimizer.param_groups))]
        )
        after_scales = [scales.get(i, 1.0) for i in range(len(optimizer.param_groups))]
        detail = f"LR x{params.factor:g} (floor {params.min_lr:g}) on param groups {chosen}" + (
            "" if ctx.scheduler is None else f", kept by {type(ctx.scheduler).__name__}"
        )
        if ctx.dry_run:
            planned = [
                _as_float(
                    _scaled(
                        g.get(SCHEDULED_LR_KEY, g["lr"]), scales.get(i, 1.0), floors.get(i, 0.0)
                    )
                )
                for i, g in enumerate(optimizer.param_groups)
            ]
            return ActionOutcome(detail, before, {"lr": planned, "lr_scale": after_scales})
        scale_before = {g: self.control.scale_for(g) for g in chosen}
        self.control.commit(optimizer, ctx.scheduler, scales, floors)
        after = _lr_record(optimizer, after_scales)
        # A new cut of a group replaces its watch: the fault came back, the scale was too high.
        self.watches = [w for w in self.watches if not set(w.groups) & set(chosen)]
        if params.relax_above is not None:
            series = watched_series(ctx.incident.evidence if ctx.incident is not None else [])
            if series:
                watch = OvershootWatch(
                    groups=chosen,
                    scale_before=scale_before,
                    series=series,
                    ratio=params.relax_above,
                    needed=params.relax_for,
                    incident=ctx.incident.id if ctx.incident is not None else None,
                )
                self.watches.append(watch)
                after["relax_if"] = watch.why()
            else:
                detail += "; not watched for overshoot (no evidence with a baseline)"
        return ActionOutcome(detail, before, after)

    # -- the follow-up: relax a cut that overshot ----------------------------------------------
    @property
    def watching(self) -> bool:
        return bool(self.watches)

    def observe(self, ctx: ActionContext, samples: Sequence[Sample]) -> ActionOutcome | None:
        """Feed one evaluation's samples to the watches; relax the first cut that overshot."""
        for watch in list(self.watches):
            if not watch.observe(samples):
                continue
            self.watches.remove(watch)  # one relaxation per cut, applied or not
            optimizer = ctx.optimizer
            if optimizer is None:
                raise ValueError("relaxing lower_lr needs the optimizer (ActionContext.optimizer)")
            n = len(optimizer.param_groups)
            current = {g: self.control.scale_for(g) for g in range(n)}
            relaxed = watch.relaxed_scales(current)
            before = _lr_record(optimizer, [current[g] for g in range(n)])
            self.control.commit(optimizer, ctx.scheduler, *self.control.plan_scales(relaxed))
            after = _lr_record(optimizer, [self.control.scale_for(g) for g in range(n)])
            moves = ", ".join(
                f"group {g} x{current[g]:.3g} -> x{relaxed[g]:.3g}" for g in watch.groups
            )
            incident = f" of incident {watch.incident}" if watch.incident else ""
            detail = f"relaxed the LR cut{incident} by half (log scale): {moves}; {watch.why()}"
            return ActionOutcome(detail, before, after)
        return None

    def reapply(self, ctx: ActionContext) -> None:
        for watch in self.watches:  # the run was restored: count read-outs afresh
            watch.run = 0
        optimizer = ctx.optimizer
        if optimizer is None:
            return
        if self.control.active or any(SCHEDULED_LR_KEY in g for g in optimizer.param_groups):
            self.control.reapply(optimizer, ctx.scheduler)

    def state_dict(self) -> dict[str, Any]:
        return {**self.control.state_dict(), "watches": [w.to_dict() for w in self.watches]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        watches = [OvershootWatch.from_dict(w) for w in state.get("watches", [])]
        self.control.load_state_dict(state)
        self.watches = watches
