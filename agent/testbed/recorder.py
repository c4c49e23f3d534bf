"""Mechanism monitors of the test-bed model at a fixed cadence, as plain JSON-ready numbers.

Every ``every`` steps, at the start of a step (weights W(t), before that step's update):

- attention layer ``blocks.{i}.attn``: fp32 per-head factors W_q^h, W_k^g(h) (d, d_h) are
  compared with the snapshot taken ``every`` steps earlier: H(Delta_1), H(Delta_2),
  H(Delta_3), the stable rank and Frobenius norm of Delta_2, H(dW_q^h), H(dW_k^g) and
  ||W_q^h||_2 (one value per query head; per KV head for dW_k);
- router ``blocks.{i}.moe.gate``: the routing logits of that step's forward (captured by a
  forward hook registered for that step only) give the routing entropy (mean, normalized,
  p10), load statistics and margin; the router weight gives eps and the row similarity.

Heavy work happens only on cadence steps; other steps cost nothing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from agent import samples as names
from agent.monitors import (
    qk_increment_spectrum,
    router_conditioning_ratio,
    router_similarity,
    routing_entropy,
    routing_load,
    spectrum_stats,
    update_spectrum,
)
from agent.testbed.model import CausalSelfAttention, MoETransformer

Monitors = dict[str, dict[str, Any]]  # metric -> module name -> value or per-head list


def head_factors(attn: CausalSelfAttention) -> tuple[Tensor, Tensor]:
    """fp32 copies of the per-head factors: W_q (H, d, d_h) and the paired W_k (H, d, d_h)."""
    h, h_kv, d_h = attn.num_heads, attn.num_kv_heads, attn.head_dim
    wq = attn.q_proj.weight.detach().float()  # (H*d_h, d)
    wk = attn.k_proj.weight.detach().float()  # (H_kv*d_h, d)
    wq = wq.view(h, d_h, -1).transpose(1, 2).clone()  # (H, d, d_h)
    wk = wk.view(h_kv, d_h, -1).transpose(1, 2)  # (H_kv, d, d_h)
    wk = wk.repeat_interleave(h // h_kv, dim=0).clone()  # (H, d, d_h): key factor of head h
    return wq, wk


def _entropy(s: Tensor) -> list[float]:
    return spectrum_stats(s).entropy.tolist()


class MonitorRecorder:
    """Computes the monitors of ``model`` every ``every`` steps (see module docstring);
    ``every = 0`` switches it off."""

    def __init__(self, model: MoETransformer, every: int) -> None:
        if every < 0:
            raise ValueError(f"MonitorRecorder: every must be >= 0, got {every}")
        self.model = model
        self.every = every
        self._snapshots: dict[str, tuple[Tensor, Tensor]] = {}
        self._snapshot_step: int | None = None
        self._logits: dict[str, Tensor] = {}
        self._hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._pending: Monitors | None = None

    def due(self, step: int) -> bool:
        return self.every > 0 and step % self.every == 0

    def before_step(self, step: int) -> None:
        """Measure the weights and arm the router hooks if ``step`` is a cadence step."""
        if not self.due(step):
            return
        monitors: Monitors = {}
        self._measure_attention(step, monitors)
        self._measure_router_weights(monitors)
        self._pending = monitors
        for name, moe in self._routers():
            self._hooks.append(moe.gate.register_forward_hook(self._capture(name)))

    def after_step(self, step: int) -> Monitors | None:
        """The monitors of ``step`` (None off cadence); removes the hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        monitors, self._pending = self._pending, None
        if monitors is None:
            return None
        for name, logits in self._logits.items():
            top_k = dict(self._routers())[name].top_k
            ent = routing_entropy(logits)
            load = routing_load(logits, top_k)
            values = {
                names.ROUTER_ENTROPY: ent.mean,
                names.ROUTER_ENTROPY_NORM: ent.normalized,
                names.ROUTER_ENTROPY_P10: ent.p10,
                names.ROUTER_LOAD_MAX: load.max_load,
                names.ROUTER_LOAD_ENTROPY: load.load_entropy,
                names.ROUTER_MARGIN: load.margin,
                names.ROUTER_DEAD_EXPERTS: load.dead_experts,
            }
            for metric, value in values.items():
                monitors.setdefault(metric, {})[name] = float(value)
        self._logits.clear()
        return monitors

    def reset(self) -> None:
        """Forget the snapshots (after a rollback the previous snapshot is no longer valid)."""
        self._snapshots.clear()
        self._snapshot_step = None

    def _routers(self) -> list[tuple[str, nn.Module]]:
        return [(f"blocks.{i}.moe.gate", moe) for i, moe in enumerate(self.model.moe_modules())]

    def _capture(self, name: str) -> Callable[[nn.Module, Any, Tensor], None]:
        def hook(_module: nn.Module, _inputs: Any, output: Tensor) -> None:
            self._logits[name] = output.detach()  # (N, E)

        return hook

    def _measure_attention(self, step: int, monitors: Monitors) -> None:
        consecutive = self._snapshot_step == step - self.every
        for attn in self.model.attention_modules():
            wq, wk = head_factors(attn)  # (H, d, d_h) each
            previous = self._snapshots.get(attn.name)
            self._snapshots[attn.name] = (wq, wk)
            monitors.setdefault(names.WQ_SPECTRAL_NORM, {})[attn.name] = torch.linalg.matrix_norm(
                wq, ord=2
            ).tolist()
            if previous is None or not consecutive:
                continue
            wq_prev, wk_prev = previous
            delta2 = qk_increment_spectrum(wq_prev, wk_prev, wq, wk, order=2)  # (H, 2 d_h)
            stats2 = spectrum_stats(delta2)
            g = attn.num_heads // attn.num_kv_heads
            values = {
                names.QK_DELTA2_ENTROPY: stats2.entropy.tolist(),
                names.QK_DELTA2_STABLE_RANK: stats2.stable_rank.tolist(),
                names.QK_DELTA2_FROBENIUS: stats2.frobenius.tolist(),
                names.QK_DELTA1_ENTROPY: _entropy(
                    qk_increment_spectrum(wq_prev, wk_prev, wq, wk, order=1)
                ),
                names.QK_DELTA3_ENTROPY: _entropy(
                    qk_increment_spectrum(wq_prev, wk_prev, wq, wk, order=3)
                ),
                names.DWQ_ENTROPY: _entropy(update_spectrum(wq_prev, wq)),
                names.DWK_ENTROPY: _entropy(update_spectrum(wk_prev[::g], wk[::g])),
            }
            for metric, value in values.items():
                monitors.setdefault(metric, {})[attn.name] = value
        self._snapshot_step = step

    def _measure_router_weights(self, monitors: Monitors) -> None:
        for name, moe in self._routers():
            w = moe.gate.weight.detach().float()  # (E, d)
            monitors.setdefault(names.ROUTER_EPS, {})[name] = float(router_conditioning_ratio(w))
            monitors.setdefault(names.ROUTER_SIMILARITY, {})[name] = float(router_similarity(w))
