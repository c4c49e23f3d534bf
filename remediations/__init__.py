"""mechwatch remediations: what the agent does about a failing mechanism.

Actions (YAML names): ``attention_fp32_backward``, ``lower_lr``, ``rollback``, ``halt``,
``page``, ``request_hparam``, ``raise_balance_coef``, ``raise_grad_accum``. See
``docs/remediations.md``. Submodules are imported lazily, so importing ``remediations.base``
stays cheap.
"""

from __future__ import annotations

from agent.lazy_exports import lazy_exports

# Public name -> submodule of remediations that defines it.
__all__, __getattr__ = lazy_exports(
    __name__,
    {
        "attention_precision": ".attention_switch",
        "AttentionPrecisionSwitch": ".attention_switch",
        "scaled_dot_product_attention": ".fp32_attention",
        "fp32_backward_attention": ".fp32_attention",
        "install_hf_attention": ".hf_attention",
        "uninstall_hf_attention": ".hf_attention",
        "install_sdpa_redirect": ".sdpa_redirect",
        "LRControl": ".lr",
        "TrainingHalted": ".halt",
        "HyperparameterRequests": ".hparams",
        "ACTIONS": ".registry",
        "register_action": ".registry",
        "register_callable": ".registry",
        "validate_action": ".registry",
        "ActionRunner": ".runner",
        "ActionResult": ".runner",
    },
)
