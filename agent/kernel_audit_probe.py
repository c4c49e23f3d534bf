"""The agent's side of the kernel audit (``remediations.kernel_audit``): which layer to audit
when, and the samples its audits give.

Every ``kernel_audit.every`` steps the next attention layer in turn is armed on the run's
FP32-backward switch; its next training call through a switch-aware wrapper is captured (one
batch row by default), and at the first step boundary after that call's backward the kernel's
backward is run again on it for dO and -dO (training thread, a fraction of one layer's
attention on one sequence): ``attention_backward_asymmetry`` for that layer at that step.

Cost: a forward and two backward passes of one layer's attention on one sequence per audit,
and one host read of the result (on a GPU, a synchronization of the training thread once per
audit, every 50 steps by default, not per step; the other read-outs defer theirs by
``scheduling.apply_lag`` through ``agent.host_read``, which this one does not do yet).

A layer whose calls never reach a switch-aware wrapper (a Hugging Face model without
``install_hf_attention``, a model that calls a fused kernel itself) cannot be audited: when an
armed layer was not called by the next audit, or a wrapper could not capture its call, the
agent says so once (``report``) and audits the other layers. One process only: in a
distributed run each rank's audit would give its own samples, and the ranks decide on the
same samples (``agent.distributed``), so the audit stays off there and says so once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agent import samples as m
from agent.samples import Sample, labels_of
from remediations.kernel_audit import KernelAudit, sign_asymmetry

if TYPE_CHECKING:
    from agent.config import KernelAuditConfig

Report = Callable[[str, str], None]
NOT_CALLED = (
    "its calls do not go through the FP32-backward switch's attention wrappers "
    "(install_hf_attention for a Hugging Face model, with audit_any_implementation=True for "
    "flash, flex or a custom kernel; "
    "remediations.fp32_attention.scaled_dot_product_attention for your own attention)"
)


class KernelAuditProbe:
    """Arms the layers in turn and measures what was captured (see the module docstring)."""

    def __init__(
        self, audit: KernelAudit, layers: list[str], every: int, sequences: int, report: Report
    ) -> None:
        self.audit = audit
        self.audit.sequences = sequences
        self.layers = list(layers)
        self.every = every
        self.report = report
        self._labels = {name: labels_of(layer=name) for name in self.layers}
        self._next = 0  # index of the layer the next audit arms
        self._said: set[str] = set()  # layers already reported as not auditable
        self._measured = False  # whether any audit has been measured yet

    def on_step(self, step: int) -> list[Sample]:
        """The samples of the audits whose backward has arrived; arms the next layer on audit
        steps. Runs the replays (training thread, between steps)."""
        out = [
            Sample(step, m.ATTENTION_BACKWARD_ASYMMETRY, sign_asymmetry(c), self._labels[c.layer])
            for c in self.audit.take()
            if c.layer in self._labels
        ]
        for layer, why in list(self.audit.unaudited.items()):
            self._unauditable(layer, f"a wrapper could not capture its call: {why}")
        self._measured = self._measured or bool(out)
        if step % self.every == 0 and self.layers:
            for layer in self.audit.pending() & set(self.layers):
                if not self._measured:  # no layer ever reached a wrapper: none will
                    for other in list(self.layers):
                        self._unauditable(other, NOT_CALLED, say=False)
                    self.report("kernel audit", f"no attention layer is audited: {NOT_CALLED}")
                    return out
                self._unauditable(layer, NOT_CALLED)
            if self.layers:
                self.audit.arm([self.layers[self._next % len(self.layers)]])
                self._next = (self._next + 1) % len(self.layers)
        return out

    def _unauditable(self, layer: str, why: str, *, say: bool = True) -> None:
        """Stop auditing ``layer``; say why once."""
        self.audit.unaudited.pop(layer, None)
        if layer in self.layers:
            self.layers.remove(layer)
            self._next = self._next % len(self.layers) if self.layers else 0
        self.audit.disarm_layer(layer)
        if say and layer not in self._said:
            self._said.add(layer)
            self.report("kernel audit", f"{layer} is not audited: {why}")

    def restart(self) -> None:
        """After a rollback: what was armed or captured belongs to the abandoned path."""
        self.audit.disarm()

    def close(self) -> None:
        self.audit.disarm()


def build_kernel_audit(
    config: KernelAuditConfig,
    layers: list[str],
    audit: KernelAudit,
    *,
    distributed: bool,
    report: Report,
) -> tuple[KernelAuditProbe | None, str]:
    """The agent's probe on ``audit`` (its switch's) and the state its ``start`` event records
    (``kernel_audit``: "on", "off", "off: no attention layer", "off: a distributed run": each
    rank would audit alone, and the ranks decide alike)."""
    if not config.enabled:
        return None, "off"
    if not layers:
        return None, "off: no attention layer"
    if distributed:
        return None, "off: a distributed run"
    return KernelAuditProbe(audit, layers, config.every, config.sequences, report), "on"
