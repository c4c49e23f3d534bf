"""``attention_fp32_backward``: the action that switches attention backward to fp32.

The fix for the ``fa_precision`` fault family (DESIGN.md 1a, 1d). The action flips an
``AttentionPrecisionSwitch`` (``remediations.attention_switch``: which layers run their backward
in fp32); attention that runs through ``scaled_dot_product_attention``
(``remediations.fp32_attention``: torch's SDPA with a switchable fp32 backward) or
``install_hf_attention`` consults it on every call.

This module is also the package's front door for attention: ``AttentionPrecisionSwitch``,
``attention_precision``, ``scaled_dot_product_attention``, ``fp32_backward_attention`` and
``AttentionKernel`` are importable from here.
"""

from __future__ import annotations

from typing import Any

from pydantic import ConfigDict, Field

from remediations.attention_switch import (
    AttentionPrecisionSwitch,
    as_layer_names,
    attention_precision,
)
from remediations.base import Action, ActionContext, ActionOutcome, ActionParams
from remediations.fp32_attention import (
    AttentionKernel,
    fp32_backward_attention,
    scaled_dot_product_attention,
)

__all__ = [
    "AttentionFP32Backward",
    "AttentionFP32BackwardParams",
    "AttentionKernel",
    "AttentionPrecisionSwitch",
    "attention_precision",
    "fp32_backward_attention",
    "scaled_dot_product_attention",
]


class AttentionFP32BackwardParams(ActionParams):
    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    layers: list[str] | None = Field(
        None,
        description="layer names or glob patterns ('model.layers.*.self_attn'); null: every layer",
    )


class AttentionFP32Backward(Action):
    """Switch the attention backward to fp32 (all layers, or those matching ``layers``).

    Takes effect for attention that runs through ``scaled_dot_product_attention``
    (``remediations.fp32_attention``, directly or via ``install_hf_attention``) and for kernels
    driven by a listener of the switch. The switch is the run's (``ActionContext.attention``,
    what ``Agent(..., attention_switch=...)`` was given), else the one this action was built
    with (the process-wide ``attention_precision``). What it switched on is kept in its state
    and re-imposed by ``reapply``.
    """

    name = "attention_fp32_backward"
    Params = AttentionFP32BackwardParams

    def __init__(self, switch: AttentionPrecisionSwitch = attention_precision) -> None:
        self.switch = switch
        self.enabled_all = False  # what this action switched on, re-imposed by reapply
        self.enabled_layers: set[str] = set()

    def _switch(self, ctx: ActionContext) -> AttentionPrecisionSwitch:
        return ctx.attention if ctx.attention is not None else self.switch

    def apply(self, ctx: ActionContext, params: ActionParams) -> ActionOutcome:
        assert isinstance(params, AttentionFP32BackwardParams)
        switch = self._switch(ctx)
        layers = None if params.layers is None else as_layer_names(params.layers)
        before = switch.state_dict()
        where = "every layer" if layers is None else f"layers {sorted(layers)}"
        consulted = switch.consulted_layers
        detail = f"attention backward in fp32 for {where}"
        if not consulted and not switch.listener_count:
            detail += (
                " (warning: no attention call has consulted the switch yet; route attention "
                "through remediations.attention.scaled_dot_product_attention or "
                "install_hf_attention, or add a listener)"
            )
        if ctx.dry_run:
            preview = AttentionPrecisionSwitch()
            preview.load_state_dict(before)
            preview.enable_fp32_backward(layers)
            return ActionOutcome(detail, {"precision": before}, {"precision": preview.state_dict()})
        switch.enable_fp32_backward(layers)  # restores itself if a listener fails
        if layers is None:
            self.enabled_all = True
        else:
            self.enabled_layers |= layers
        return ActionOutcome(detail, {"precision": before}, {"precision": switch.state_dict()})

    def reapply(self, ctx: ActionContext) -> None:
        switch = self._switch(ctx)
        state = switch.state_dict()
        if self.enabled_all and not state["all"]:
            switch.enable_fp32_backward()
        missing = self.enabled_layers - set(state["included"])
        if missing:
            switch.enable_fp32_backward(missing)

    def state_dict(self) -> dict[str, Any]:
        return {"all": self.enabled_all, "layers": sorted(self.enabled_layers)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        unknown = set(state) - {"all", "layers"}
        if unknown or not isinstance(state.get("all", False), bool):
            raise ValueError(
                f"attention_fp32_backward state: expected {{'all': bool, 'layers': [...]}}, "
                f"got keys {sorted(state)}"
            )
        self.enabled_all = state.get("all", False)
        self.enabled_layers = as_layer_names(state.get("layers", [])) or set()
