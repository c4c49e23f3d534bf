"""Route a module's own calls of torch's SDPA through the FP32-backward switch.

Some attention layers never consult transformers' attention interface: they call
``torch.nn.functional.scaled_dot_product_attention`` themselves (Falcon, many research models).
``install_sdpa_redirect(model)`` gives each such module a forward pre-hook that enters a
``TorchFunctionMode`` for the duration of its forward (a forward hook with ``always_call=True``
leaves it, also when the forward raises); inside, every call of torch's SDPA becomes
``remediations.fp32_attention.scaled_dot_product_attention(..., layer=<module name>)``, which
calls torch's SDPA with the same arguments when the switch is off for that layer (the same
forward and backward) and runs the fp32 backward when it is on. No model code changes.

Only calls of ``scaled_dot_product_attention`` made directly in the module's forward are
routed (a call nested inside another torch function, e.g. ``nn.MultiheadAttention``'s, is not).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from remediations.attention_switch import AttentionPrecisionSwitch, attention_precision
from remediations.fp32_attention import scaled_dot_product_attention
from remediations.hf_layers import attention_modules

_HANDLES = "_mechwatch_sdpa_redirect"  # module attribute holding the hook handles


class _Redirect(TorchFunctionMode):
    """Sends torch's SDPA to the switchable one, for one layer."""

    def __init__(self, layer: str, switch: AttentionPrecisionSwitch) -> None:
        super().__init__()
        self.layer, self.switch = layer, switch

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            return scaled_dot_product_attention(
                *args, layer=self.layer, switch=self.switch, **kwargs
            )
        return func(*args, **kwargs)


def install_sdpa_redirect(
    model: torch.nn.Module,
    modules: Iterable[str] | None = None,
    *,
    switch: AttentionPrecisionSwitch = attention_precision,
) -> list[str]:
    """Route torch SDPA calls of ``modules`` (names in ``model``; default: every attention-like
    module whose class calls torch's SDPA itself and does not consult transformers' interface)
    through ``switch``. Returns the names routed. Raises ``ValueError`` for an unknown name or
    when there is nothing to route."""
    named = dict(model.named_modules())
    if modules is None:
        names = attention_modules(model).calling_torch_sdpa()
    else:
        names = list(modules)
        missing = [n for n in names if n not in named]
        if missing:
            raise ValueError(f"install_sdpa_redirect: no module named {missing} in the model")
    if not names:
        raise ValueError(
            f"install_sdpa_redirect: no module of {type(model).__name__} calls torch's "
            "scaled_dot_product_attention itself; name the modules to route"
        )
    for name in names:
        module = named[name]
        if getattr(module, _HANDLES, None):
            continue
        stack: list[_Redirect] = []

        def enter(_m: torch.nn.Module, _args: Any, name: str = name, stack=stack) -> None:
            mode = _Redirect(name, switch)
            mode.__enter__()
            stack.append(mode)

        def leave(_m: torch.nn.Module, _args: Any, _out: Any, stack=stack) -> None:
            if stack:
                stack.pop().__exit__(None, None, None)

        handles = [
            module.register_forward_pre_hook(enter),
            module.register_forward_hook(leave, always_call=True),
        ]
        setattr(module, _HANDLES, handles)
    return names


def uninstall_sdpa_redirect(model: torch.nn.Module) -> int:
    """Remove every redirect of ``model``; returns how many modules it released."""
    count = 0
    for module in model.modules():
        handles = getattr(module, _HANDLES, None)
        if handles:
            for handle in handles:
                handle.remove()
            delattr(module, _HANDLES)
            count += 1
    return count
