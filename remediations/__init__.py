"""mechwatch remediations: what the agent does about a failing mechanism.

Actions (YAML names): ``attention_fp32_backward``, ``lower_lr``, ``rollback``, ``halt``,
``page``, ``request_hparam``, ``raise_balance_coef``, ``raise_grad_accum``. See
``docs/remediations.md``. Submodules are imported lazily, so importing ``remediations.base``
stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "attention_precision": "remediations.attention",
    "AttentionPrecisionSwitch": "remediations.attention",
    "scaled_dot_product_attention": "remediations.attention",
    "fp32_backward_attention": "remediations.attention",
    "install_hf_attention": "remediations.hf_attention",
    "LRControl": "remediations.lr",
    "TrainingHalted": "remediations.halt",
    "HyperparameterRequests": "remediations.hparams",
    "ACTIONS": "remediations.registry",
    "register_action": "remediations.registry",
    "register_callable": "remediations.registry",
    "validate_action": "remediations.registry",
    "ActionRunner": "remediations.runner",
    "ActionResult": "remediations.runner",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'remediations' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
