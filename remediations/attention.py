"""FP32 attention backward: a drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

The fix for the ``fa_precision`` fault family (DESIGN.md 1a, 1d). A low-precision attention
kernel can round ``O = P V`` and the backward's ``delta = rowsum(dO * O)`` with a *bias*; the
biased term lands in dW_q / dW_k every step. ``fp32_backward_attention`` keeps the forward as it
was (the usual kernel, in the input dtype) and replaces only the backward: it recomputes the
scores, the probabilities, ``O`` and ``delta`` in fp32 from the saved q, k, v and returns
gradients in the input dtypes. That removes the biased term without touching the forward.

``scaled_dot_product_attention`` takes the same arguments as torch's, plus ``layer`` (a name for
the per-layer switch) and ``fallback`` (the kernel used when the switch is off, and for the
forward when it is on). ``attention_precision`` is the process-wide switch the
``attention_fp32_backward`` action flips; it can be on for every layer or for selected ones.

Dropout: torch's kernels do not expose their dropout mask, so with ``dropout_p > 0`` under
autograd the forward also runs here, in the fp32 math path, with a mask drawn from a seed taken
from torch's default CPU generator; the backward regenerates the same mask from the seed. That
costs O(B * H * L * S) memory like torch's math backend; models without attention dropout (most
LLM pre-training) keep their fast forward kernel.

torch.compile: the switch is a Python-level branch (``switch.fp32_backward(layer)`` reads a
bool and a dict). Dynamo guards on that state, so a compiled model recompiles at most once per
flip of the switch, never per step.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from pydantic import ConfigDict, Field
from torch.autograd.function import once_differentiable

from remediations.base import Action, ActionContext, ActionOutcome, ActionParams

AttentionKernel = Callable[..., torch.Tensor]


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
        names = _as_names(layers)
        old = self.state_dict()
        if names is None:
            self._all, self._excluded = True, set()
        else:
            self._included |= names
            self._excluded -= names
        self._changed(old)

    def disable_fp32_backward(self, layers: Iterable[str] | None = None) -> None:
        """Switch the fp32 backward off for ``layers``, or off everywhere (``None``)."""
        names = _as_names(layers)
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
                "included": _as_names(state.get("included", [])),
                "excluded": _as_names(state.get("excluded", [])),
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


def _as_names(layers: Iterable[str] | None) -> set[str] | None:
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


# -- the attention functions ------------------------------------------------------------------
def scaled_dot_product_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    layer: str | None = None,
    fallback: AttentionKernel = F.scaled_dot_product_attention,
    switch: AttentionPrecisionSwitch = attention_precision,
) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` with a switchable fp32 backward.

    When ``switch.fp32_backward(layer)`` is on and autograd will differentiate the call, the
    forward runs ``fallback`` as usual and the backward is recomputed in fp32
    (``fp32_backward_attention``). Otherwise ``fallback`` runs alone. ``fallback`` is called as
    ``fallback(q, k, v, is_causal=..., scale=...)`` plus ``attn_mask``, ``dropout_p`` and
    ``enable_gqa`` when they differ from their defaults, so a kernel without mask or GQA
    support works for calls that do not use them.
    """
    if switch.fp32_backward(layer) and _needs_grad(query, key, value):
        return fp32_backward_attention(
            query,
            key,
            value,
            attn_mask,
            dropout_p,
            is_causal,
            scale,
            enable_gqa,
            forward_kernel=fallback,
        )
    return _call_kernel(
        fallback, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa
    )


def fp32_backward_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    forward_kernel: AttentionKernel | None = None,
) -> torch.Tensor:
    """Attention whose forward is ``forward_kernel`` (default torch's SDPA) in the input dtype and
    whose backward recomputes attention in fp32 from the saved q, k, v.

    Shapes follow torch: query (..., H, L, E), key (..., H_kv, S, E), value (..., H_kv, S, Ev),
    attn_mask broadcastable to (..., H, L, S) (bool: True = attend; float: added to the scores),
    H_kv == H unless ``enable_gqa`` (H % H_kv == 0, query head h uses KV head h // (H / H_kv)).
    ``is_causal`` is top-left aligned (query i attends to keys j <= i), as in torch; like torch,
    a mask and ``is_causal`` together are an error. Returns (..., H, L, Ev) in the query dtype.
    The backward computes in fp32 (fp64 for fp64 inputs).
    """
    _check_shapes(query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
    kernel = F.scaled_dot_product_attention if forward_kernel is None else forward_kernel
    return _FP32BackwardAttention.apply(
        query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, enable_gqa, kernel
    )


class _FP32BackwardAttention(torch.autograd.Function):
    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None,
        dropout_p: float,
        is_causal: bool,
        scale: float | None,
        enable_gqa: bool,
        kernel: AttentionKernel,
    ) -> torch.Tensor:
        seed = None
        if dropout_p > 0.0:
            # torch's kernels hide their dropout mask: draw our own, reproducibly from a seed.
            seed = int(torch.randint(0, 2**62, (1,)).item())  # CPU generator: no device sync
            out = _math_forward(
                query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, seed
            ).to(query.dtype)
        else:
            out = _call_kernel(
                kernel, query, key, value, attn_mask, 0.0, is_causal, scale, enable_gqa
            )
        ctx.save_for_backward(query, key, value, attn_mask)
        ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
        ctx.enable_gqa, ctx.seed = enable_gqa, seed
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        query, key, value, attn_mask = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        f32 = _compute_dtype(query)
        q = query.to(f32)  # (..., H, L, E)
        k = _repeat_kv(key.to(f32), query, ctx.enable_gqa)  # (..., H, S, E)
        v = _repeat_kv(value.to(f32), query, ctx.enable_gqa)  # (..., H, S, Ev)
        scale = _scale(query, ctx.scale)
        p = _probs(q, k, attn_mask, ctx.is_causal, scale)  # (..., H, L, S), fp32
        if ctx.seed is not None:
            kept = _dropout_keep(p, ctx.dropout_p, ctx.seed) / (1.0 - ctx.dropout_p)
            p_used = p * kept  # (..., H, L, S): the probabilities after dropout
        else:
            kept, p_used = None, p
        do = grad_out.to(f32)  # (..., H, L, Ev)
        grad_v = p_used.transpose(-1, -2) @ do if need_v else None  # (..., H, S, Ev)
        grad_q = grad_k = None
        if need_q or need_k:
            out = p_used @ v  # (..., H, L, Ev): O recomputed in fp32
            delta = (do * out).sum(-1, keepdim=True)  # (..., H, L, 1) = rowsum(dO * O)
            ds = do @ v.transpose(-1, -2)  # (..., H, L, S): dP (after dropout)
            if kept is not None:
                ds.mul_(kept)
            ds.sub_(delta).mul_(p)  # dS = P * (dP - delta), in place
            if need_q:
                grad_q = (ds @ k).mul_(scale)  # (..., H, L, E)
            if need_k:
                grad_k = (ds.transpose(-1, -2) @ q).mul_(scale)  # (..., H, S, E)
        grad_k = _sum_kv_groups(grad_k, key, ctx.enable_gqa)
        grad_v = _sum_kv_groups(grad_v, value, ctx.enable_gqa)
        return (
            None if grad_q is None else grad_q.to(query.dtype),
            None if grad_k is None else grad_k.to(key.dtype),
            None if grad_v is None else grad_v.to(value.dtype),
            None,
            None,
            None,
            None,
            None,
            None,
        )


# -- helpers ----------------------------------------------------------------------------------
def _needs_grad(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    return torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )


def _call_kernel(
    kernel: AttentionKernel,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    kwargs: dict[str, Any] = {"is_causal": is_causal, "scale": scale}
    if attn_mask is not None:
        kwargs["attn_mask"] = attn_mask
    if dropout_p:
        kwargs["dropout_p"] = dropout_p
    if enable_gqa:
        kwargs["enable_gqa"] = True
    return kernel(query, key, value, **kwargs)


def _check_shapes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> None:
    if query.dim() < 2 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError(
            "query, key, value must have the same number (>= 2) of dimensions, got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if query.shape[-1] != key.shape[-1] or key.shape[-2] != value.shape[-2]:
        raise ValueError(
            "expected query (..., L, E), key (..., S, E), value (..., S, Ev), got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if key.shape[:-2] != value.shape[:-2]:
        raise ValueError(
            f"key and value batch dims differ: {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if enable_gqa:
        if query.dim() < 3 or query.shape[-3] % key.shape[-3] != 0:
            raise ValueError(
                f"enable_gqa: query heads ({query.shape[-3] if query.dim() >= 3 else '?'}) must be "
                f"a multiple of key/value heads ({key.shape[-3] if key.dim() >= 3 else '?'})"
            )
        if query.shape[:-3] != key.shape[:-3]:
            raise ValueError(
                f"query and key batch dims differ: {tuple(query.shape)}, {tuple(key.shape)}"
            )
    elif query.shape[:-2] != key.shape[:-2]:
        raise ValueError(
            f"query and key batch/head dims differ: {tuple(query.shape)}, {tuple(key.shape)} "
            "(pass enable_gqa=True for fewer key/value heads)"
        )
    if (
        attn_mask is not None
        and attn_mask.dtype != torch.bool
        and not attn_mask.is_floating_point()
    ):
        raise ValueError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal are both set: pass one (as torch requires)")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")


def _compute_dtype(query: torch.Tensor) -> torch.dtype:
    """fp32, or fp64 for fp64 inputs (never less precise than the inputs)."""
    return torch.promote_types(query.dtype, torch.float32)


def _scale(query: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(query.shape[-1]) if scale is None else float(scale)


def _repeat_kv(kv: torch.Tensor, query: torch.Tensor, enable_gqa: bool) -> torch.Tensor:
    """(..., H_kv, S, E) -> (..., H, S, E): KV head g serves query heads g*G .. g*G + G-1."""
    if not enable_gqa or kv.shape[-3] == query.shape[-3]:
        return kv
    return kv.repeat_interleave(query.shape[-3] // kv.shape[-3], dim=-3)


def _sum_kv_groups(
    grad: torch.Tensor | None, kv: torch.Tensor, enable_gqa: bool
) -> torch.Tensor | None:
    """(..., H, S, E) -> (..., H_kv, S, E): sum over the query heads that share a KV head."""
    if grad is None or not enable_gqa or grad.shape[-3] == kv.shape[-3]:
        return grad
    return grad.unflatten(-3, (kv.shape[-3], grad.shape[-3] // kv.shape[-3])).sum(-3)


def _probs(
    q: torch.Tensor,
    k: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float,
) -> torch.Tensor:
    """softmax(scale * q k^T + mask) in fp32, (..., H, L, S); fully masked rows are zero."""
    scores = (q @ k.transpose(-1, -2)).mul_(scale)  # (..., H, L, S)
    if attn_mask is not None:
        in_place = torch.broadcast_shapes(scores.shape, attn_mask.shape) == scores.shape
        if attn_mask.dtype == torch.bool:
            drop = attn_mask.logical_not()
            scores = (
                scores.masked_fill_(drop, -math.inf)
                if in_place
                else scores.masked_fill(drop, -math.inf)
            )
        else:
            mask = attn_mask.to(scores.dtype)
            scores = scores.add_(mask) if in_place else scores + mask
    if is_causal:
        L, S = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(L, S, dtype=torch.bool, device=scores.device).tril_()  # (L, S)
        scores.masked_fill_(causal.logical_not_(), -math.inf)
    p = torch.softmax(scores, dim=-1)
    if attn_mask is not None:  # a row with every key masked attends to nothing (as torch)
        p.masked_fill_(scores.amax(dim=-1, keepdim=True) == -math.inf, 0.0)
    return p


def _dropout_keep(p: torch.Tensor, dropout_p: float, seed: int) -> torch.Tensor:
    """The dropout keep-mask (float 0/1, shape of ``p``), regenerated identically from ``seed``."""
    gen = torch.Generator(device=p.device)
    gen.manual_seed(seed)
    return (torch.rand(p.shape, generator=gen, device=p.device) >= dropout_p).to(p.dtype)


def _math_forward(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    seed: int,
) -> torch.Tensor:
    """Attention with dropout in fp32 (used only when dropout_p > 0): (..., H, L, Ev)."""
    f32 = _compute_dtype(query)
    q = query.to(f32)
    k = _repeat_kv(key.to(f32), query, enable_gqa)
    v = _repeat_kv(value.to(f32), query, enable_gqa)
    p = _probs(q, k, attn_mask, is_causal, _scale(query, scale))
    p.mul_(_dropout_keep(p, dropout_p, seed)).div_(1.0 - dropout_p)
    return p @ v


# -- the action ---------------------------------------------------------------------------------
class AttentionFP32BackwardParams(ActionParams):
    model_config = ConfigDict(strict=True)  # YAML "0.5" is not a number

    layers: list[str] | None = Field(
        None,
        description="layer names or glob patterns ('model.layers.*.self_attn'); null: every layer",
    )


class AttentionFP32Backward(Action):
    """Switch the attention backward to fp32 (all layers, or those matching ``layers``).

    Takes effect for attention that runs through ``scaled_dot_product_attention`` of this
    module (directly, or via ``install_hf_attention``) and for kernels driven by a listener of
    the switch. The switch is the run's (``ActionContext.attention``, what ``Agent(...,
    attention_switch=...)`` was given), else the one this action was built with (the
    process-wide ``attention_precision``). What it switched on is kept in its state and
    re-imposed by ``reapply``.
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
        layers = None if params.layers is None else _as_names(params.layers)
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
        self.enabled_layers = _as_names(state.get("layers", [])) or set()
