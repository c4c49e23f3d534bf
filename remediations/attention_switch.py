"""``AttentionPrecisionSwitch``: which attention layers run their backward in fp32.

``attention_precision`` is the process-wide switch that the ``attention_fp32_backward`` action
flips and that ``remediations.fp32_attention.scaled_dot_product_attention`` consults on every
call (an agent may be given a switch of its own instead). It can be on for every layer or for
selected ones, by exact layer name or glob pattern.

torch.compile: ``fp32_backward(layer)`` reads a bool and a dict; Dynamo guards on that state,
so a compiled model recompiles at most once per flip of the switch, never per step.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Iterable
from typing import Any

from remediations.kernel_audit import KernelAudit


class AttentionPrecisionSwitch:
    """Which attention layers run their backward in fp32. Layer names are exact names or glob
    patterns (``"model.layers.*.self_attn"``); ``None`` means every layer (global).

    ``fp32_backward(layer)`` is called on every attention forward: one dict lookup (each layer
    name is matched against the patterns the first time it asks, and again at each change).
    """

    def __init__(self) -> None:
        self._all = False  # global: every layer, except those in _excluded
        self._included: set[str] = set()  # names or glob patterns switched on
        self._excluded: set[str] = set()  # names or glob patterns switched off while global
        self._decided: dict[str | None, bool] = {}  # layer name -> decision (cache)
        self._consulted: set[str | None] = set()  # call sites that have asked (diagnostics)
        self._listeners: list[Callable[[AttentionPrecisionSwitch], None]] = []
        self.audit = KernelAudit()  # the sign audit of the layers' backward (kernel_audit.py)

    # -- the hot path ------------------------------------------------------------------------
    def fp32_backward(self, layer: str | None) -> bool:
        """Whether ``layer`` (or an unnamed call site, ``None``) runs the fp32 backward."""
        decided = self._decided.get(layer)
        if decided is None:
            decided = self._decide(layer)
            self._decided[layer] = decided
            self._consulted.add(layer)
        return decided

    def _redecide(self) -> None:
        # Decide at once for every layer seen so far, so that the hot path stays a pure lookup
        # (under torch.compile a flip then changes guarded state once: one recompile per flip).
        self._decided = {layer: self._decide(layer) for layer in self._consulted}

    def _decide(self, layer: str | None) -> bool:
        if layer is None:
            return self._all
        if self._all:
            return not _matches_any(layer, self._excluded)
        return _matches_any(layer, self._included)

    # -- changes -----------------------------------------------------------------------------
    @property
    def any_enabled(self) -> bool:
        """True when some layer (or all) runs the fp32 backward."""
        return self._all or bool(self._included)

    @property
    def global_enabled(self) -> bool:
        return self._all

    @property
    def consulted_layers(self) -> frozenset[str | None]:
        """Layer names (``None``: unnamed call sites) whose attention has consulted the switch:
        empty means no attention call runs through it, so switching changes nothing."""
        return frozenset(self._consulted)

    @property
    def listener_count(self) -> int:
        return len(self._listeners)

    def enable_fp32_backward(self, layers: Iterable[str] | None = None) -> None:
        """Switch the fp32 backward on for ``layers`` (names or glob patterns), or for all."""
        names = as_layer_names(layers)
        old = self.state_dict()
        if names is None:
            self._all, self._excluded = True, set()
        else:
            self._included |= names
            self._excluded -= names
        self._changed(old)

    def disable_fp32_backward(self, layers: Iterable[str] | None = None) -> None:
        """Switch the fp32 backward off for ``layers``, or off everywhere (``None``)."""
        names = as_layer_names(layers)
        old = self.state_dict()
        if names is None:
            self._all, self._included, self._excluded = False, set(), set()
        else:
            self._included -= names
            if self._all:
                self._excluded |= names
        self._changed(old)

    def add_listener(self, fn: Callable[[AttentionPrecisionSwitch], None]) -> None:
        """Call ``fn(switch)`` after every change (to drive a kernel flag of your own). A
        listener that raises undoes the change, and the error propagates."""
        if not callable(fn):
            raise ValueError(f"listener must be callable, got {type(fn).__name__}")
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[AttentionPrecisionSwitch], None]) -> None:
        self._listeners.remove(fn)

    def _changed(self, old: dict[str, Any]) -> None:
        self._redecide()
        try:
            for fn in self._listeners:
                fn(self)
        except BaseException:
            self._restore(old)
            for fn in self._listeners:  # tell every listener the state is back
                try:
                    fn(self)
                except Exception:  # noqa: S110 - the first error is the one to report
                    pass
            raise

    # -- state -------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "all": self._all,
            "included": sorted(self._included),
            "excluded": sorted(self._excluded),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"all", "included", "excluded"}
        if unknown:
            raise ValueError(f"attention precision state: unknown keys {sorted(unknown)}")
        if not isinstance(state.get("all", False), bool):
            raise ValueError("attention precision state: 'all' must be a bool")
        old = self.state_dict()
        self._restore(
            {
                "all": state.get("all", False),
                "included": as_layer_names(state.get("included", [])),
                "excluded": as_layer_names(state.get("excluded", [])),
            }
        )
        self._changed(old)

    def _restore(self, state: dict[str, Any]) -> None:
        self._all = bool(state["all"])
        self._included = set(state["included"])
        self._excluded = set(state["excluded"])
        self._redecide()

    def __repr__(self) -> str:
        s = self.state_dict()
        return (
            f"AttentionPrecisionSwitch(all={s['all']}, included={s['included']}, "
            f"excluded={s['excluded']})"
        )


def as_layer_names(layers: Iterable[str] | None) -> set[str] | None:
    """Layer names or glob patterns as a set (one string is one name); None stays None.
    Raises ValueError for an empty or non-string name."""
    if layers is None:
        return None
    if isinstance(layers, str):
        layers = [layers]
    names = set()
    for name in layers:
        if not isinstance(name, str) or not name:
            raise ValueError(f"layer names must be non-empty strings, got {name!r}")
        names.add(name)
    return names


def _matches_any(layer: str, patterns: set[str]) -> bool:
    if layer in patterns:
        return True
    return any(fnmatch.fnmatchcase(layer, p) for p in patterns)


attention_precision = AttentionPrecisionSwitch()
