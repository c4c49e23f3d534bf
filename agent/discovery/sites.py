"""What monitors consume: one attention layer's per-head Q/K factors, one MoE router's weight.

An :class:`AttentionSite` reads the factor W_q^h = W[h*d_h:(h+1)*d_h].T, shape (d, d_h), of
each query head h (and W_k^g(h) of its KV head, g(h) = h // (H / H_kv)) out of the live
parameters or out of a snapshot keyed like :meth:`AttentionSite.parameters_to_snapshot`, with
any QK-norm scale folded in. For multi-head latent attention the weight reads a latent
(:class:`LatentInput`) and the factor is the product W_a[:rank]^T diag(g) W_b,h^T. A
:class:`RouterSite` holds a router's live [E, d] weight.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class LatentInput:
    """The low-rank first stage of a latent projection (MLA, DESIGN.md 1d): the heads read the
    latent c = diag(g) W_a[:rank] x / rms, so a head's factor is W_a[:rank]^T diag(g) W_b,h^T."""

    weight_name: str  # qualified name of W_a, [rank (+ other rows, e.g. the RoPE key), d]
    weight_shape: tuple[int, int]
    rank: int  # the latent is rows [0, rank) of W_a x
    norm_name: str | None = None  # qualified name of the RMSNorm scale g [rank], if any
    norm_offset: float = 0.0  # 1.0 when the norm multiplies by (1 + weight), else 0.0


@dataclass(frozen=True)
class HeadSlices:
    """Where each head of one projection (query or key) lives inside a weight."""

    weight_name: str  # qualified parameter name, as in model.named_parameters()
    weight_shape: tuple[int, int]
    input_major: bool  # weight stored [d, out] (GPT-2 Conv1D) instead of [out, d]
    starts: tuple[int, ...]  # first output feature of each head's d_h block
    norm_name: str | None = None  # qualified name of the QK-norm scale folded in, if any
    norm_numel: int = 0  # d_h (one scale shared by all heads) or n_heads * d_h
    norm_offset: float = 0.0  # 1.0 when the norm multiplies by (1 + weight) (Gemma), else 0.0
    latent: LatentInput | None = None  # the weight reads a latent, not x (MLA's q_b / kv_b)
    scale: float = 1.0  # a constant the projection's output is multiplied by (LongcatFlash)


@dataclass(frozen=True)
class AttentionSite:
    """One attention layer: its head layout and how to read per-head Q/K factors."""

    name: str  # module name, used as the "layer" label
    num_heads: int  # H
    num_kv_heads: int  # H_kv (H for MHA, 1 for MQA)
    head_dim: int  # d_h
    d_model: int  # d, the input width of the projections
    layout: str  # "separate", "gated", "concat", "per_head", "grouped" or "latent"
    q: HeadSlices
    k: HeadSlices
    module: nn.Module = field(compare=False, repr=False)
    live_parameters: Mapping[str, nn.Parameter] = field(compare=False, repr=False)

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, (self.num_heads, self.num_kv_heads)
        assert len(self.q.starts) == self.num_heads and len(self.k.starts) == self.num_kv_heads

    @property
    def group_size(self) -> int:
        """Query heads per KV head, H / H_kv."""
        return self.num_heads // self.num_kv_heads

    def kv_head(self, h: int) -> int:
        """The KV head g(h) that query head ``h`` attends with."""
        h = _head_index(h, self.num_heads, f"{self.name}: query head")
        return h // self.group_size

    def parameters_to_snapshot(self) -> dict[str, nn.Parameter]:
        """The live parameters (projection weights, QK-norm scales) the factors are read from,
        keyed by qualified parameter name. Cloning these (e.g. to fp32) is a full snapshot."""
        return dict(self.live_parameters)

    def factors(
        self,
        params: Mapping[str, torch.Tensor] | None = None,
        heads: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-head factor pairs from ``params`` (a snapshot keyed like
        :meth:`parameters_to_snapshot`, or any state dict holding those keys; the live
        parameters when None).

        Returns ``(wq, wk)``, both (n_sel, d, d_h) in ``dtype``, fresh tensors: wq[i] is
        W_q^h for the i-th selected query head h (all heads in order when ``heads`` is None)
        and wk[i] is W_k^g(h), its KV head's factor.
        """
        q_heads = self._select(heads, self.num_heads, "query head")
        wq = self._head_factors(self.q, params, q_heads, dtype)
        wk = self._head_factors(self.k, params, [h // self.group_size for h in q_heads], dtype)
        return wq, wk

    def factors_kv(
        self,
        params: Mapping[str, torch.Tensor] | None = None,
        kv_heads: Sequence[int] | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """The distinct key factors W_k^g, (n_sel, d, d_h) (all H_kv in order when
        ``kv_heads`` is None), for the dW_k spectra."""
        selected = self._select(kv_heads, self.num_kv_heads, "KV head")
        return self._head_factors(self.k, params, selected, dtype)

    def _select(self, heads: Sequence[int] | None, count: int, what: str) -> list[int]:
        if heads is None:
            return list(range(count))
        return [_head_index(h, count, f"{self.name}: {what}") for h in heads]

    def _tensor(
        self, key: str, params: Mapping[str, torch.Tensor] | None, shape: tuple[int, ...]
    ) -> torch.Tensor:
        """``params[key]`` (live when None), checked against ``shape``; a 1-D ``shape`` only
        fixes the element count (QK-norm scales may be [d_h], [H * d_h] or [H, d_h])."""
        source = self.live_parameters if params is None else params
        try:
            tensor = source[key]
        except KeyError:
            raise ValueError(
                f"{self.name}: params has no entry {key!r}; pass the mapping returned by "
                "parameters_to_snapshot() (or a clone of it)"
            ) from None
        fits = tensor.numel() == shape[0] if len(shape) == 1 else tuple(tensor.shape) == shape
        if not fits:
            raise ValueError(
                f"{self.name}: params[{key!r}] has shape {tuple(tensor.shape)}, expected {shape}"
            )
        return tensor.detach()

    def _head_factors(
        self,
        spec: HeadSlices,
        params: Mapping[str, torch.Tensor] | None,
        indices: Sequence[int],
        dtype: torch.dtype,
    ) -> torch.Tensor:
        d_h = self.head_dim
        d = self.d_model if spec.latent is None else spec.latent.rank  # the weight's input width
        weight = self._tensor(spec.weight_name, params, spec.weight_shape)  # [out, d] or [d, out]
        out = torch.empty((len(indices), d, d_h), dtype=dtype, device=weight.device)
        for i, head in enumerate(indices):
            start = spec.starts[head]
            if spec.input_major:
                out[i].copy_(weight[:, start : start + d_h])  # (d, d_h)
            else:
                out[i].copy_(weight[start : start + d_h].T)  # (d, d_h)
        if spec.latent is not None:  # (d_model, r) @ (n, r, d_h) -> (n, d_model, d_h)
            out = self._latent_factor(spec.latent, params, dtype, weight.device) @ out
        if spec.scale != 1.0:
            out.mul_(spec.scale)
        if spec.norm_name is not None:
            scale = self._tensor(spec.norm_name, params, (spec.norm_numel,))
            scale = scale.to(device=weight.device, dtype=dtype).reshape(-1, d_h)  # (1|n, d_h)
            if spec.norm_offset:
                scale = scale + spec.norm_offset
            rows = scale.expand(len(indices), d_h) if scale.shape[0] == 1 else scale[indices]
            out.mul_(rows[:, None, :])  # scales the columns of each head's factor
        return out

    def _latent_factor(
        self,
        latent: LatentInput,
        params: Mapping[str, torch.Tensor] | None,
        dtype: torch.dtype,
        device: torch.device,
    ) -> torch.Tensor:
        """W_a[:rank]^T diag(g), (d, rank): the first stage of a latent projection."""
        w_a = self._tensor(latent.weight_name, params, latent.weight_shape)  # [rows, d]
        factor = w_a[: latent.rank].T.to(device=device, dtype=dtype)  # (d, rank)
        if latent.norm_name is not None:
            g = self._tensor(latent.norm_name, params, (latent.rank,)).reshape(-1)
            factor = factor * (g.to(device=device, dtype=dtype) + latent.norm_offset)
        return factor


@dataclass(frozen=True)
class RouterSite:
    """One MoE router: a module whose [E, d] weight produces the routing logits z = x W^T + b.

    ``owner`` is set when the module that applies the weight is not ``module`` itself: its
    parent's forward uses ``<child>.weight`` functionally (LongcatFlash's router applies
    ``F.linear`` to ``classifier.weight``), so ``module`` may never be called; the router's
    input is then the owner's input.
    """

    name: str  # module name, used as the "router" label
    module: nn.Module = field(compare=False, repr=False)
    num_experts: int  # E
    d_model: int  # d
    top_k: int | None  # experts chosen per token, when declared
    weight_name: str  # qualified parameter name of the [E, d] weight
    owner: nn.Module | None = field(default=None, compare=False, repr=False)
    owner_name: str | None = None  # name of ``owner``
    # The MoE block that holds the router and its experts (None: none found): the router's
    # push is measured against the block's other weights (``block_weights``).
    block: nn.Module | None = field(default=None, compare=False, repr=False)
    block_name: str | None = None  # name of ``block``

    def weight(self) -> torch.Tensor:
        """The live router weight [E, d]."""
        return self.module.weight

    def block_weights(self) -> list[torch.Tensor]:
        """The live weights of the MoE block other than the router's own: every parameter of
        ``block`` with at least 2 dimensions (experts, shared experts), in module order; none
        without a block."""
        if self.block is None:
            return []
        own = {id(p) for m in (self.module, self.owner) if m is not None for p in m.parameters()}
        return [p for p in self.block.parameters() if p.dim() >= 2 and id(p) not in own]

    def bias(self) -> torch.Tensor | None:
        """The live logit bias [E] (an ``nn.Linear`` gate with bias), else None."""
        bias = getattr(self.module, "bias", None)
        if isinstance(bias, torch.Tensor) and tuple(bias.shape) == (self.num_experts,):
            return bias
        return None


def _head_index(h: object, count: int, what: str) -> int:
    try:
        index = operator.index(h)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {h!r}") from None
    if not 0 <= index < count:
        raise ValueError(f"{what} {index} is out of range [0, {count})")
    return index
