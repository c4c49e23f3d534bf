"""Hugging Face transformers adapter for the switchable fp32 attention backward.

``install_hf_attention(model)`` makes the model's attention consult the FP32-backward switch
without changing what the model runs. Nothing is renamed: the model keeps its attention
implementation (``"sdpa"`` or ``"eager"``), so masks and the code paths that models choose by
that name (DeepSeek-V3.2's sparse mask, Falcon's SDPA branch, ...) stay as they were. The
adapter wraps the function that ``AttentionInterface.get_interface`` hands to the installed
attention modules:

- switch off for the layer (or no gradient needed): the model's own attention function is
  called with the very same arguments (bit for bit the same forward and backward);
- switch on: the forward is still the model's own function (or, with attention dropout, its
  eager function in fp32, so that the backward can replay the dropout mask), and the backward
  recomputes the model's *eager* attention function in fp32 from the saved inputs
  (``remediations.fp32_recompute``). Everything the model's attention honours is honoured:
  attention sinks (``s_aux``, ``module.sinks``), logit soft-capping, sliding windows and sparse
  masks, learned masks and position biases (with their gradients), dropout, scaling, GQA.

``install_hf_attention`` refuses, with a ``ValueError`` that names the module and the reason,
models it cannot serve exactly: attention implementations other than ``"sdpa"`` and
``"eager"`` (flash and flex kernels: call ``model.set_attn_implementation("sdpa")`` first),
SDPA layers passed arguments SDPA ignores (``s_aux``, ``sinks``), and models none of whose
attention modules consult the interface (Falcon in earlier transformers 5.x computes attention
itself: ``remediations.sdpa_redirect.install_sdpa_redirect`` covers layers that call torch's
SDPA directly). Attention-like modules that do not consult the interface (linear attention, state
space mixers) are named in one warning.

The layer name the switch sees is the attention module's name in the model
(``"model.layers.3.self_attn"``). ``hf_attention_forward`` is an SDPA-equivalent attention
function for registering under a name of your own; it refuses arguments it cannot honour.

transformers is imported only inside ``install_hf_attention``; this module imports without it.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from remediations.attention_switch import AttentionPrecisionSwitch, attention_precision
from remediations.fp32_attention import scaled_dot_product_attention
from remediations.fp32_recompute import recompute_attention
from remediations.hf_layers import attention_modules, interface_keywords
from remediations.hf_sdpa import sdpa_call_as_eager
from remediations.kernel_audit import batch_rows

HF_ATTENTION_NAME = "mechwatch_fp32_backward"
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")
# Arguments transformers' SDPA function ignores: an fp32 backward of the eager math would honour
# what the forward did not.
_SDPA_IGNORES = ("s_aux", "sinks")
# Arguments hf_attention_forward cannot honour.
_UNSUPPORTED_KWARGS = ("s_aux", "sinks", "softcap", "indices", "block_indices", "position_bias")


@dataclass(frozen=True)
class _Layer:
    """An installed attention module: its switch name and the parameters its math reads."""

    name: str
    switch: AttentionPrecisionSwitch
    params: tuple[torch.nn.Parameter, ...]  # the module's own parameters (e.g. GPT-OSS sinks)


# attention module -> its installation (weak: a deleted model takes its entries with it).
_installed: weakref.WeakKeyDictionary[torch.nn.Module, _Layer] = weakref.WeakKeyDictionary()
# attention module -> its name in the model, for layer_name.
_module_names: weakref.WeakKeyDictionary[torch.nn.Module, str] = weakref.WeakKeyDictionary()
# (model's function, model's eager function) -> its dispatcher.
_dispatchers: dict[tuple[Callable[..., Any], Callable[..., Any]], _Dispatch] = {}
_warned: set[str] = set()
# The switch and kernel hf_attention_forward uses (set them to change its behaviour).
_config: dict[str, Any] = {
    "switch": attention_precision,
    "fallback": F.scaled_dot_product_attention,
}


def layer_name(module: torch.nn.Module) -> str | None:
    """The switch's name for an attention module: its name in the model when installed or
    registered, else ``"layer{module.layer_idx}"``, else None (only the global switch)."""
    name = _module_names.get(module)
    if name is not None:
        return name
    idx = getattr(module, "layer_idx", None)
    return None if idx is None else f"layer{idx}"


def register_module_names(model: torch.nn.Module) -> int:
    """Record the name of every module of ``model`` for ``layer_name``; returns how many."""
    count = 0
    for name, module in model.named_modules():
        if name:
            _module_names[module] = name
            count += 1
    return count


# -- installation -----------------------------------------------------------------------------
def install_hf_attention(
    model: torch.nn.Module,
    *,
    switch: AttentionPrecisionSwitch = attention_precision,
    audit_any_implementation: bool = False,
) -> str | None:
    """Make every attention module of ``model`` that consults transformers' attention interface
    consult ``switch`` too (see the module docstring). Returns the model's attention
    implementation, which it keeps. Raises ``ValueError`` naming the module and the argument or
    implementation it cannot honour.

    ``audit_any_implementation``: also install on an implementation the FP32 backward cannot
    reproduce (flash, flex, a kernel registered under a name of your own) instead of refusing
    it: its calls go through the switch, so the kernel audit (``remediations.kernel_audit``)
    covers them, and switching such a layer to FP32 leaves its backward as it was, with a
    warning (the dispatcher's). The other refusals stand."""
    interface = _attention_interface()
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(
            f"install_hf_attention: {type(model).__name__} has no .config; "
            "expected a transformers PreTrainedModel"
        )
    found = attention_modules(model)
    if not found.consulting:
        raise ValueError(
            f"install_hf_attention: no attention module of {type(model).__name__} consults "
            "transformers' attention interface, so the FP32-backward switch could never take "
            f"effect: {found.describe_unread()}.{found.redirect_hint()}"
        )
    problems = []
    for name, module in found.consulting:
        problems += _refusals(name, module, model, any_implementation=audit_any_implementation)
    if problems:
        raise ValueError("install_hf_attention: " + "; ".join(problems))
    if found.unread:
        warnings.warn(
            "install_hf_attention: these attention-like modules do not consult the attention "
            f"interface and stay outside the FP32-backward switch: {found.describe_unread()}."
            f"{found.redirect_hint()}",
            stacklevel=2,
        )
    register_module_names(model)
    for name, module in found.consulting:
        own = tuple(p for p in module.parameters(recurse=False) if p.is_floating_point())
        _installed[module] = _Layer(name, switch, own)
    _patch(interface)
    return getattr(config, "_attn_implementation", None)


def uninstall_hf_attention(model: torch.nn.Module) -> int:
    """Undo ``install_hf_attention`` for ``model``; returns how many modules it released."""
    count = 0
    for module in model.modules():
        if _installed.pop(module, None) is not None:
            count += 1
    return count


def installed_layers(model: torch.nn.Module) -> list[str]:
    """Names of the attention modules of ``model`` that consult the switch."""
    return [layer.name for m in model.modules() if (layer := _installed.get(m)) is not None]


def _attention_interface() -> type:
    try:
        from transformers import AttentionInterface
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ValueError(
            "install_hf_attention needs Hugging Face transformers; it is not importable here"
        ) from exc
    if not hasattr(AttentionInterface, "get_interface"):
        raise ValueError(
            "install_hf_attention needs a transformers version whose attention layers call "
            "AttentionInterface.get_interface (5.x)"
        )
    return AttentionInterface


def _implementation(module: torch.nn.Module, model: torch.nn.Module) -> object:
    for owner in (module, model):
        config = getattr(owner, "config", None)
        if config is not None and hasattr(config, "_attn_implementation"):
            return config._attn_implementation
    return None


def _refusals(
    name: str, module: torch.nn.Module, model: torch.nn.Module, *, any_implementation: bool = False
) -> list[str]:
    where = f"{name} ({type(module).__name__})"
    impl = _implementation(module, model)
    if impl not in SUPPORTED_IMPLEMENTATIONS and not any_implementation:
        return [
            f"{where} runs attention implementation {impl!r}; the FP32 backward reproduces "
            f"only {' and '.join(map(repr, SUPPORTED_IMPLEMENTATIONS))} exactly: call "
            "model.set_attn_implementation('sdpa') before installing"
        ]
    passed = interface_keywords(type(module))
    if impl == "sdpa":
        ignored = [k for k in _SDPA_IGNORES if k in passed]
        if ignored:
            return [
                f"{where} passes {', '.join(ignored)} (attention sinks) to 'sdpa', which ignores "
                "them; the FP32 backward would honour what the forward did not: use 'eager'"
            ]
    return []


# -- dispatch ---------------------------------------------------------------------------------
def _patch(interface: type) -> None:
    """Wrap ``interface.get_interface`` once: it hands installed modules a dispatcher."""
    original = interface.get_interface
    if getattr(original, "_mechwatch", False):
        return

    def get_interface(self: Any, attn_implementation: str, default: Callable[..., Any]) -> Any:
        fn = original(self, attn_implementation, default)
        if not _installed:
            return fn
        dispatch = _dispatchers.get((fn, default))
        if dispatch is None:
            dispatch = _dispatchers[(fn, default)] = _Dispatch(fn, default)
        return dispatch

    get_interface._mechwatch = True  # type: ignore[attr-defined]
    get_interface.__wrapped__ = original  # type: ignore[attr-defined]
    interface.get_interface = get_interface


class _Dispatch:
    """Stands in for the model's attention function: the function itself unless the module is
    installed and its layer is switched on."""

    def __init__(self, kernel: Callable[..., Any], eager: Callable[..., Any]) -> None:
        self.kernel = kernel  # what the model runs ("sdpa" or its eager function)
        self.eager = eager  # the model's eager function: the reference math
        self.signature = _signature(kernel)

    def __call__(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        result = self._attend(module, args, kwargs)
        layer = _installed.get(module)
        if layer is not None and layer.switch.audit.armed(layer.name):
            self._capture(layer, module, args, kwargs, result)
        return result

    def _capture(
        self, layer: _Layer, module: torch.nn.Module, args: tuple, kwargs: dict, result: Any
    ) -> None:
        """Hand an armed call to the kernel audit (``remediations.kernel_audit``): q, k, v are
        the first three arguments after the module; every other per-row tensor argument (the
        mask) is sliced to the audited rows."""
        output = result[0] if isinstance(result, tuple) else result
        if len(args) < 3 or not all(torch.is_tensor(t) for t in (*args[:3], output)):
            layer.switch.audit.skip(layer.name, "its attention call passes q, k, v by name")
            return
        batch = args[0].shape[0]

        def replay(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rows: int) -> torch.Tensor:
            rest = tuple(batch_rows(a, rows, batch) for a in args[3:])
            named = {name: batch_rows(a, rows, batch) for name, a in kwargs.items()}
            out = self._attend(module, (q, k, v, *rest), named)
            return out[0] if isinstance(out, tuple) else out

        layer.switch.audit.capture(layer.name, *args[:3], output, replay)

    def _attend(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
        layer = _installed.get(module)
        if layer is None or not layer.switch.fp32_backward(layer.name):
            return self.kernel(module, *args, **kwargs)
        if not _needs_grad(args, kwargs, layer.params):
            return self.kernel(module, *args, **kwargs)
        if not callable(self.eager):
            _warn_once(
                layer.name,
                f"mechwatch: {layer.name} names no eager attention function to recompute; its "
                "attention backward stays as it was",
            )
            return self.kernel(module, *args, **kwargs)
        to_reference = None
        if self.kernel is not self.eager:
            if not _is_transformers_sdpa(self.kernel):
                _warn_once(
                    layer.name,
                    f"mechwatch: {layer.name} now runs {getattr(self.kernel, '__name__', '?')}, "
                    "not 'sdpa' or 'eager'; its attention backward stays as it was",
                )
                return self.kernel(module, *args, **kwargs)
            to_reference = sdpa_call_as_eager(module)
        bound = self.signature.bind(module, *args, **kwargs).arguments if self.signature else {}
        dropout = float(bound.get("dropout", 0.0) or 0.0) > 0.0 and module.training
        return recompute_attention(
            self.kernel,
            self.eager,
            module,
            args,
            kwargs,
            params=layer.params,
            to_reference=to_reference,
            dropout=dropout,
        )


def _signature(fn: Callable[..., Any]) -> inspect.Signature | None:
    try:
        return inspect.signature(fn)
    except (TypeError, ValueError):
        return None


def _needs_grad(args: tuple[Any, ...], kwargs: dict[str, Any], params: tuple[Any, ...]) -> bool:
    if not torch.is_grad_enabled():
        return False
    values = (*args, *kwargs.values(), *params)
    return any(isinstance(v, torch.Tensor) and v.requires_grad for v in values)


def _is_transformers_sdpa(fn: Callable[..., Any]) -> bool:
    try:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
    except ImportError:  # pragma: no cover - depends on the environment
        return False
    return fn is sdpa_attention_forward


def _warn_once(key: str, message: str) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, stacklevel=3)


# -- an SDPA-equivalent attention function for a name of your own -------------------------------
def _repeat_kv(hidden: torch.Tensor, n_rep: int) -> torch.Tensor:
    """(B, H_kv, S, D) -> (B, H_kv * n_rep, S, D), KV head g serving query heads g*n_rep.."""
    if n_rep == 1:
        return hidden
    b, h_kv, s, d = hidden.shape
    return hidden[:, :, None, :, :].expand(b, h_kv, n_rep, s, d).reshape(b, h_kv * n_rep, s, d)


def hf_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function computing what ``"sdpa"`` computes (query (B, H, L, D),
    key/value (B, H_kv, S, D), mask broadcastable to (B, H, L, S) -> ((B, L, H, D), None)), with
    the switch's fp32 backward. Raises ``ValueError`` for arguments it cannot honour
    (``s_aux``, ``sinks``, ``softcap``, sparse ``indices``, ``position_bias``, a mask that needs
    a gradient while the switch is on): prefer ``install_hf_attention``."""
    refused = [k for k in _UNSUPPORTED_KWARGS if kwargs.get(k) is not None]
    if refused:
        raise ValueError(
            f"hf_attention_forward cannot honour {', '.join(refused)} (passed by "
            f"{type(module).__name__}); use install_hf_attention, which keeps the model's own "
            "attention"
        )
    switch: AttentionPrecisionSwitch = _config["switch"]
    layer = layer_name(module)
    if attention_mask is not None and attention_mask.requires_grad:
        if torch.is_grad_enabled() and switch.fp32_backward(layer):
            raise ValueError(
                f"hf_attention_forward: {type(module).__name__} passes a learned attention mask; "
                "its gradient needs install_hf_attention"
            )
    gqa = False
    n_rep = getattr(module, "num_key_value_groups", None)
    if n_rep is not None:
        if attention_mask is None:  # as transformers: native GQA only without a mask
            gqa = key.shape[1] != query.shape[1]
        else:
            key = _repeat_kv(key, int(n_rep))
            value = _repeat_kv(value, int(n_rep))
    if attention_mask is not None and attention_mask.ndim == 4:
        attention_mask = attention_mask[:, :, :, : key.shape[-2]]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # Causal only when there is more than one query and no explicit mask (as transformers).
    is_causal = bool(query.shape[2] > 1 and attention_mask is None and is_causal)
    out = scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=dropout,
        is_causal=is_causal,
        scale=scaling,
        enable_gqa=gqa,
        layer=layer,
        fallback=_config["fallback"],
        switch=switch,
    )  # (B, H, L, D)
    return out.transpose(1, 2).contiguous(), None
