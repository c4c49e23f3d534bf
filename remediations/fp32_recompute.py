"""FP32-recompute backward for an attention *function*: the core of the Hugging Face adapter.

``recompute_attention(kernel, reference, module, args, kwargs)`` returns what
``kernel(module, *args, **kwargs)`` returns (the model's own attention, in its dtype, bit for
bit), but its backward is ``torch.autograd.grad`` of ``reference(module, *args32, **kwargs32)``:
the model's eager attention recomputed in fp32 (fp64 stays fp64) from the saved inputs. Whatever
the reference honours is honoured by the backward, because it *is* the reference: attention
sinks, logit soft-capping, sliding windows and sparse masks (in the mask), position biases,
scaling, GQA. Every floating-point tensor argument gets its gradient (learned masks, position
biases, ``s_aux``), and so does every parameter in ``params`` (the attention module's own
parameters that the reference reads from the module, e.g. GPT-OSS's ``module.sinks``): those
enter the recompute as themselves, everything else as fp32 copies.

The forward calls the kernel under grad mode on detached inputs that require grad as the
originals do (the graph it builds is dropped at once): kernels choose their backend by that
(torch's CPU SDPA does for a learned mask), and the forward must stay bit for bit the model's.

Tensors are found at the top level of ``args`` and ``kwargs`` (a tensor inside a list or tuple
is passed through unchanged and gets no gradient).

``to_reference(args, kwargs) -> (args, kwargs, dead)`` translates a call of ``kernel`` into the
equivalent call of ``reference`` (e.g. SDPA's boolean mask and ``is_causal`` into an additive
mask); ``dead`` is None or a bool tensor broadcastable to the output, True where the kernel's
output row is defined as zero (every key masked): those rows' output gradients are dropped, as
the kernel's own backward does.

Dropout: a kernel's dropout mask cannot be replayed, so with ``dropout=True`` the forward runs
the reference in fp32 too, with the CPU and device RNG states saved; the backward restores them
and draws the same mask (as ``torch.utils.checkpoint`` does).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import get_device_states, set_device_states

AttentionFunction = Callable[..., tuple[torch.Tensor, Any]]
ToReference = Callable[
    [tuple[Any, ...], dict[str, Any]], tuple[tuple[Any, ...], dict[str, Any], torch.Tensor | None]
]


@dataclass(frozen=True)
class _Slot:
    """Placeholder for the tensor at ``index`` of the call's tensor list."""

    index: int


@dataclass
class _Plan:
    """One attention call, its tensors pulled out (they are the autograd Function's inputs)."""

    kernel: AttentionFunction
    reference: AttentionFunction
    module: torch.nn.Module
    args: tuple[Any, ...]  # positional arguments after ``module``, tensors as _Slot
    kwargs: dict[str, Any]  # keyword arguments, tensors as _Slot
    live: list[torch.Tensor | None]  # per tensor: the parameter itself when it is one, else None
    to_reference: ToReference | None
    dropout: bool
    weights: Any = None  # the kernel's second output (attention weights or None), detached
    rng: tuple[torch.Tensor, list[int], list[torch.Tensor]] | None = field(default=None)

    def fill(self, tensors: Sequence[torch.Tensor]) -> tuple[tuple[Any, ...], dict[str, Any]]:
        def put(value: Any) -> Any:
            return tensors[value.index] if isinstance(value, _Slot) else value

        return tuple(put(a) for a in self.args), {k: put(v) for k, v in self.kwargs.items()}

    def run_reference(
        self, tensors: Sequence[torch.Tensor]
    ) -> tuple[torch.Tensor, Any, torch.Tensor | None]:
        """The reference on ``tensors`` (already fp32); returns (output, weights, dead rows)."""
        args, kwargs = self.fill(tensors)
        dead = None
        if self.to_reference is not None:
            args, kwargs, dead = self.to_reference(args, kwargs)
        out, weights = self.reference(self.module, *args, **kwargs)
        return out, weights, dead


def recompute_attention(
    kernel: AttentionFunction,
    reference: AttentionFunction,
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    *,
    params: Sequence[torch.nn.Parameter] = (),
    to_reference: ToReference | None = None,
    dropout: bool = False,
) -> tuple[torch.Tensor, Any]:
    """``kernel(module, *args, **kwargs)`` with the backward of ``reference`` recomputed in fp32
    (see the module docstring). Returns ``(output, weights)``; ``weights`` (the kernel's second
    output, usually None) carries no gradient."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}
    param_ids = {id(p) for p in params}

    def slot(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if id(value) not in index:
            index[id(value)] = len(tensors)
            tensors.append(value)
        return _Slot(index[id(value)])

    template_args = tuple(slot(a) for a in args)
    template_kwargs = {k: slot(v) for k, v in kwargs.items()}
    for p in params:  # read by the reference from the module: inputs too, for their gradient
        slot(p)
    live = [t if id(t) in param_ids else None for t in tensors]
    plan = _Plan(
        kernel, reference, module, template_args, template_kwargs, live, to_reference, dropout
    )
    out = _FP32Recompute.apply(plan, *tensors)
    return out, plan.weights


def _fp32(t: torch.Tensor) -> torch.dtype:
    return torch.promote_types(t.dtype, torch.float32)


def _upcast(
    tensors: Sequence[torch.Tensor],
    live: Sequence[torch.Tensor | None],
    needs: Sequence[bool] | None = None,
) -> list[torch.Tensor]:
    """fp32 copies of the floating tensors (parameters stay themselves), requiring grad where
    ``needs`` says so."""
    out = []
    for i, (t, param) in enumerate(zip(tensors, live, strict=True)):
        if param is not None:
            out.append(param)
        elif t.is_floating_point():
            copy = t.detach().to(_fp32(t))
            out.append(copy.requires_grad_(bool(needs[i])) if needs is not None else copy)
        else:
            out.append(t)
    return out


class _FP32Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, plan: _Plan, *tensors: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        ctx.plan = plan
        # Parameters are kept by the plan (the recompute must use the very objects the module
        # holds); everything else is saved.
        ctx.save_for_backward(
            *[t if p is None else None for t, p in zip(tensors, plan.live, strict=True)]
        )
        if plan.dropout:
            plan.rng = (torch.get_rng_state(), *get_device_states(*tensors))
            out, weights, _ = plan.run_reference(_upcast(tensors, plan.live))
            query = next(t for t in tensors if t.is_floating_point())
            out = out.to(query.dtype)
        else:
            # Under grad mode, with inputs that require grad as the originals do: a kernel may
            # pick another backend without them (torch's CPU SDPA does, for a learned mask).
            with torch.enable_grad():
                leaves = [
                    t.detach().requires_grad_(t.requires_grad) if p is None else t
                    for t, p in zip(tensors, plan.live, strict=True)
                ]
                args, kwargs = plan.fill(leaves)
                out, weights = plan.kernel(plan.module, *args, **kwargs)
            out = out.detach()
        plan.weights = weights.detach() if isinstance(weights, torch.Tensor) else weights
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        plan: _Plan = ctx.plan
        saved = ctx.saved_tensors
        tensors = [s if p is None else p for s, p in zip(saved, plan.live, strict=True)]
        needs = ctx.needs_input_grad[1:]
        inputs = _upcast(tensors, plan.live, needs)
        with torch.enable_grad(), _replayed_rng(plan):
            out, _, dead = plan.run_reference(inputs)
        g = grad_out.to(out.dtype)
        if dead is not None:
            g = g.masked_fill(dead, 0.0)
        wanted = [i for i, x in enumerate(inputs) if needs[i] and x.requires_grad]
        found = torch.autograd.grad(out, [inputs[i] for i in wanted], g, allow_unused=True)
        grads: list[torch.Tensor | None] = [None] * len(tensors)
        for i, grad in zip(wanted, found, strict=True):
            grads[i] = None if grad is None else grad.to(tensors[i].dtype)
        return (None, *grads)


@contextlib.contextmanager
def _replayed_rng(plan: _Plan) -> Iterator[None]:
    """Inside a forked RNG, the CPU and device RNG states the forward saved (dropout)."""
    if plan.rng is None:
        yield
        return
    cpu_state, devices, states = plan.rng
    with torch.random.fork_rng(devices=devices):
        torch.set_rng_state(cpu_state)
        set_device_states(devices, states)
        yield
