"""``KernelAudit``: does an attention layer's backward round one way? A test of the arithmetic.

The attention backward is linear in the upstream gradient dO (dV = P^T dO, dP = dO V^T,
delta = rowsum(dO * O), dS = P * (dP - delta), dQ = dS K, dK = dS^T Q). Arithmetic that rounds
symmetrically in sign (round to nearest even, what real kernels use; also rounding toward or
away from zero) keeps that map odd bit for bit: the gradients for -dO are exactly the negated
gradients for dO. Rounding that always goes one way (toward -inf or +inf: the biased rounding
of DESIGN.md 1a) breaks the symmetry by exactly the bias it adds. So, on one call's own q, k, v
and upstream gradient, run the layer's kernel backward for dO and for -dO:

    asymmetry = ||g(dO) + g(-dO)|| / ||g(dO) - g(-dO)||      (g: the gradients of q and k)

the even part (what one-way rounding added) against the odd part (the gradient). It is 0 for a
sign-symmetric kernel with a fixed accumulation order, whatever its precision, and about the
bias's relative size otherwise (2e-3 for the test bed's 8-bit floor rounding of dS, 3e-2 at
4 bits). No reference, no threshold that depends on the dtype, no training dynamics: a data
shift or a phase transition cannot move it. What it cannot see: an error that is itself odd in
dO (a forward value rounded and then read linearly, like O in delta), and a bias that acts
only on calls it did not audit. Measured in ``benchmarks/backward_audit.py``.

How it runs (``AttentionPrecisionSwitch.audit``): the agent arms a layer (``arm``); the next
call of that layer through a switch-aware attention wrapper
(``remediations.fp32_attention.scaled_dot_product_attention``, the Hugging Face adapter)
hands its inputs and a way to run its backward again (``capture``): detached copies of the
first ``sequences`` sequences (batch rows) and a hook on the output that keeps the upstream
gradient of those rows when the training step's backward reaches it. The agent then measures
(``measure``) at its next step boundary, on the training thread: one forward and two backward
passes of the kernel on those rows. Between audits the wrappers pay one set lookup per call.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

Replay = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Capture:
    """One audited call: copies of its q, k, v rows, how to run it again, its upstream grad."""

    layer: str
    query: torch.Tensor  # (n, ..., L, E) the first n batch rows, detached
    key: torch.Tensor
    value: torch.Tensor
    replay: Replay  # (q, k, v) -> output, the call's kernel and options (masks sliced alike)
    upstream: torch.Tensor | None = None  # the output's gradient, set during the backward
    rows: int = 0


@dataclass
class KernelAudit:
    """Which layers are armed for an audit, and what their calls captured."""

    sequences: int = 1  # batch rows kept per audited call
    unaudited: dict[str, str] = field(default_factory=dict)  # layer -> why it cannot be
    _armed: set[str] = field(default_factory=set)
    _captured: dict[str, Capture] = field(default_factory=dict)

    # -- the hot path ------------------------------------------------------------------------
    def armed(self, layer: str | None) -> bool:
        """Whether the next call of ``layer`` is to be captured (one set lookup)."""
        return layer in self._armed if self._armed else False

    # -- the wrappers' side ------------------------------------------------------------------
    def capture(
        self,
        layer: str,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        output: torch.Tensor,
        replay: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor],
    ) -> None:
        """Keep the first rows of an armed call. ``replay(q, k, v, rows)`` runs the call's
        kernel again on ``rows`` batch rows (the wrapper slices its masks to match);
        ``output`` is the call's output as the model sees it ((B, ...) batch first)."""
        if not output.requires_grad:
            return  # a forward without a backward (evaluation): wait for a training call
        if query.dim() < 3:
            self.skip(layer, f"its q has no batch dimension ({tuple(query.shape)})")
            return
        self._armed.discard(layer)
        rows = min(self.sequences, query.shape[0])
        copies = [t[:rows].detach().clone() for t in (query, key, value)]
        slot = Capture(layer, *copies, replay=lambda q, k, v: replay(q, k, v, rows), rows=rows)
        self._captured[layer] = slot

        def keep(grad: torch.Tensor) -> None:
            slot.upstream = grad[:rows].detach().clone()

        output.register_hook(keep)

    def skip(self, layer: str, why: str) -> None:
        """An armed call that cannot be audited: disarmed, and the reason kept."""
        self._armed.discard(layer)
        self.unaudited[layer] = why

    # -- the agent's side --------------------------------------------------------------------
    def arm(self, layers: Iterable[str]) -> None:
        self._armed.update(layers)

    def pending(self) -> frozenset[str]:
        """Layers armed and not called yet."""
        return frozenset(self._armed)

    def disarm_layer(self, layer: str) -> None:
        self._armed.discard(layer)
        self._captured.pop(layer, None)

    def disarm(self) -> None:
        self._armed.clear()
        self._captured.clear()

    def take(self) -> list[Capture]:
        """The captures whose upstream gradient has arrived (removed from the audit)."""
        done = [c for c in self._captured.values() if c.upstream is not None]
        for c in done:
            del self._captured[c.layer]
        return done


def batch_rows(value: Any, rows: int, batch: int) -> Any:
    """The first ``rows`` batch rows of a call's argument that has one per batch row (a tensor
    whose first dimension is ``batch``, with more than two dimensions: a per-row mask);
    anything else (a (L, S) mask, a (1, 1, L, S) one broadcast over the batch, a number, a
    tensor of another shape) as it is."""
    if torch.is_tensor(value) and value.dim() > 2 and value.shape[0] == batch and batch > 1:
        return value[:rows]
    return value


def sign_asymmetry(capture: Capture) -> float:
    """||g(dO) + g(-dO)|| / ||g(dO) - g(-dO)|| over the gradients of q and k (module
    docstring); nan when the gradient is zero. Reads the result on the host at once (on a GPU
    a synchronization: the agent takes ``sign_parts`` through ``agent.host_read`` instead)."""
    return asymmetry(*sign_parts(capture).tolist())


def sign_parts(capture: Capture) -> torch.Tensor:
    """(2,) on the capture's device: the squared norms of the even and the odd parts,
    ||g(dO) + g(-dO)||^2 and ||g(dO) - g(-dO)||^2 (float64; float32 where the device has no
    float64). Queues the replay's kernels; reads nothing back."""
    upstream = capture.upstream
    if upstream is None:
        raise ValueError(f"{capture.layer}: the upstream gradient never arrived")
    device = capture.query.device
    cuda = [device.index or 0] if device.type == "cuda" else []
    wide = torch.float32 if device.type == "mps" else torch.float64
    # The replay draws no random numbers from the run (a kernel's dropout would): forked.
    with torch.random.fork_rng(devices=cuda), torch.enable_grad():
        q, k, v = (t.detach().requires_grad_() for t in (capture.query, capture.key, capture.value))
        out = capture.replay(q, k, v)
        plus = torch.autograd.grad(out, (q, k), upstream, retain_graph=True, allow_unused=True)
        minus = torch.autograd.grad(out, (q, k), -upstream, allow_unused=True)
    parts = torch.zeros(2, dtype=wide, device=device)
    for g_plus, g_minus in zip(plus, minus, strict=True):
        if g_plus is None or g_minus is None:
            continue
        a, b = g_plus.to(wide), g_minus.to(wide)
        parts += torch.stack(((a + b).square().sum(), (a - b).square().sum()))
    return parts


def asymmetry(even: float, odd: float) -> float:
    """The statistic from ``sign_parts``' two squared norms; nan when the gradient is 0."""
    return (even / odd) ** 0.5 if odd > 0 else float("nan")
