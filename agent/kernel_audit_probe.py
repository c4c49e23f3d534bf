"""The agent's side of the kernel audit (``remediations.kernel_audit``): which layer to audit
when, and the samples its audits give.

Every ``kernel_audit.every`` steps (by default ``sweep_steps`` / the layers, at most 50: every
layer within 100 steps) the next attention layer in turn is armed on the run's
FP32-backward switch; its next training call through a switch-aware wrapper is captured (one
batch row by default), and at the first step boundary after that call's backward the kernel's
backward is run again on it for dO and -dO (training thread, a fraction of one layer's
attention on one sequence): ``attention_backward_asymmetry`` for that layer at that step.

Cost: a forward and two backward passes of one layer's attention on one sequence per audit,
and one host read of two numbers. From a GPU that read is started at the audit and taken
``scheduling.apply_lag`` steps later (``agent.host_read``: the training thread never waits
for the device); the sample keeps the audit's step.

A layer whose calls never reach a switch-aware wrapper (a Hugging Face model without
``install_hf_attention``, a model that calls a fused kernel itself) cannot be audited: when an
armed layer was not called by the next audit, or a wrapper could not capture its call, the
agent says so once (``report``) and audits the other layers. In a distributed job each rank
audits its own calls and the ranks exchange their values (``agent.distributed.kernel_audit``:
the largest per layer), so every rank decides on the same samples.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from agent import samples as m
from agent.host_read import HostRead
from agent.samples import Sample, labels_of
from remediations.kernel_audit import KernelAudit, asymmetry, sign_parts

if TYPE_CHECKING:
    from agent.config import KernelAuditConfig
    from agent.distributed.world import World
    from remediations.attention_switch import AttentionPrecisionSwitch

Report = Callable[[str, str], None]
CallNames = Callable[[], frozenset[str | None]]  # the layer names wrappers have called
NOT_CALLED = (
    "its calls do not go through the FP32-backward switch's attention wrappers "
    "(install_hf_attention for a Hugging Face model, with audit_any_implementation=True for "
    "flash, flex or a custom kernel; remediations.sdpa_redirect.install_sdpa_redirect for "
    "modules that call torch's scaled_dot_product_attention themselves; "
    "remediations.fp32_attention.scaled_dot_product_attention for your own attention)"
)


class KernelAuditProbe:
    """Arms the layers in turn and measures what was captured (see the module docstring)."""

    def __init__(
        self,
        audit: KernelAudit,
        layers: list[str],
        every: int,
        sequences: int,
        report: Report,
        *,
        call_names: CallNames = frozenset,
        lag: int = 0,
    ) -> None:
        self.audit = audit
        self.audit.sequences = sequences
        self.layers = list(layers)
        self.every = every
        self.report = report
        self.call_names = call_names
        self.lag = lag  # steps before a result in flight from a GPU is read (apply_lag)
        # results on their way to the host: (due step, measured step, layer, read)
        self._reads: list[tuple[int, int, str, HostRead]] = []
        self._labels = {name: labels_of(layer=name) for name in self.layers}
        self._call: dict[str, str] = {}  # layer -> the name its wrapper calls it by, once known
        self._layer_of: dict[str, str] = {}  # the reverse
        self._next = 0  # index of the layer the next audit arms
        self._said: set[str] = set()  # layers already reported as not auditable
        self.audits = 0  # calls audited so far (diagnostics)

    def on_step(self, step: int) -> list[Sample]:
        """The samples of the audits whose backward has arrived; arms the next layer on audit
        steps. Runs the replays (training thread, between steps)."""
        for c in self.audit.take():
            layer = self._layer(c.layer)
            if layer in self._labels:
                read = HostRead(sign_parts(c))
                due = step + self.lag if read.in_flight else step
                self._reads.append((due, step, layer, read))
                self.audits += 1
        out = self._arrived(step)
        for called, why in list(self.audit.unaudited.items()):
            self.audit.unaudited.pop(called)
            self._unauditable(self._layer(called), f"a wrapper could not capture its call: {why}")
        if step % self.every == 0 and self.layers:
            for called in self.audit.pending():
                layer = self._layer(called)
                if layer not in self.layers:
                    continue
                if not self.audits:  # no layer ever reached a wrapper: none will
                    for other in list(self.layers):
                        self._unauditable(other, NOT_CALLED, say=False)
                    self.report("kernel audit", f"no attention layer is audited: {NOT_CALLED}")
                    return out
                self._unauditable(layer, NOT_CALLED)
            if self.layers:
                self.audit.arm([self._called(self.layers[self._next % len(self.layers)])])
                self._next = (self._next + 1) % len(self.layers)
        return out

    def _arrived(self, step: int) -> list[Sample]:
        """The samples of the results due by ``step``: at once on a CPU, ``lag`` steps after
        their audit from a GPU (the copy has long arrived: no wait)."""
        out, keep = [], []
        for due, measured, layer, read in self._reads:
            if due > step:
                keep.append((due, measured, layer, read))
                continue
            value = asymmetry(*read.tolist())
            out.append(Sample(measured, m.ATTENTION_BACKWARD_ASYMMETRY, value, self._labels[layer]))
        self._reads = keep
        return out

    def _layer(self, called: str) -> str:
        """The agent's name of the layer a wrapper calls ``called``."""
        return self._layer_of.get(called, called)

    def _called(self, layer: str) -> str:
        """The name ``layer``'s wrapper calls it by: the agent's module path, or, when the
        model was wrapped after its attention was named (DDP's ``module.``, torch.compile's
        ``_orig_mod.``), the one name the wrappers used that ends that path (or that the path
        ends), once they have been called."""
        known = self._call.get(layer)
        if known is not None:
            return known
        names = {n for n in self.call_names() if n is not None}
        if layer in names:
            found = [layer]
        else:
            found = [n for n in names if layer.endswith("." + n) or n.endswith("." + layer)]
        if len(found) != 1:
            return layer  # not called yet, or ambiguous: armed under its own name
        self._call[layer] = found[0]
        self._layer_of[found[0]] = layer
        return found[0]

    def _unauditable(self, layer: str, why: str, *, say: bool = True) -> None:
        """Stop auditing ``layer``; say why once."""
        if layer in self.layers:
            self.layers.remove(layer)
            self._next = self._next % len(self.layers) if self.layers else 0
        self.audit.disarm_layer(self._call.get(layer, layer))
        if say and layer not in self._said:
            self._said.add(layer)
            self.report("kernel audit", f"{layer} is not audited: {why}")

    def restart(self) -> None:
        """After a rollback: what was armed, captured or measured belongs to the abandoned
        path."""
        self.audit.disarm()
        self._reads.clear()

    def close(self) -> None:
        self.audit.disarm()
        self._reads.clear()


def build_kernel_audit(
    config: KernelAuditConfig,
    layers: list[str],
    switch: AttentionPrecisionSwitch,
    world: World,
    *,
    report: Report,
    lag: int = 0,
) -> tuple[KernelAuditProbe | None, str]:
    """The agent's probe on ``switch.audit`` and the state its ``start`` event records
    (``kernel_audit``: "on", "off", "off: no attention layer"); ``lag`` is
    ``scheduling.apply_lag``. In a distributed job every rank audits its own calls and the
    ranks exchange what they measured (``agent.distributed.kernel_audit``): every rank gets
    the same samples."""
    if not config.enabled:
        return None, "off"
    if not layers:
        return None, "off: no attention layer"
    every = config.steps_between(len(layers))
    if every * len(layers) > config.sweep_steps:
        report(
            "kernel audit",
            f"each of the {len(layers)} attention layers is audited every "
            f"{every * len(layers)} steps (kernel_audit.every {every}), more than "
            f"kernel_audit.sweep_steps ({config.sweep_steps}): a fault in one layer may be "
            "found after a rollback margin of sweep_steps has passed its onset",
        )
    args = (switch.audit, layers, every, config.sequences, report)
    names = {"call_names": lambda: switch.consulted_layers, "lag": lag}
    if world.collective:
        from agent.distributed.kernel_audit import DistributedKernelAuditProbe

        return DistributedKernelAuditProbe(*args, world=world, **names), "on"
    return KernelAuditProbe(*args, **names), "on"
