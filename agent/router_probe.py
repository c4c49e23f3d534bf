"""The router probe: how the agent measures MoE routers without slowing the forward.

A forward pre-hook per router computes the routing logits from the router's own input
(z = x W^T + b; a plain ``nn.Linear`` router's output is z, and a forward hook copies it
instead) into a device buffer (``agent.router_buffer``) that is reduced *on the device*,
a batch of forwards at a time, to a few running sums (entropy, p10, margin, expert load);
nothing is copied to the host. ``read()`` turns the sums into samples with one host transfer
for all routers, every ``router_every`` steps, and names (once) every router that has produced
no data.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import torch

from agent import samples as m
from agent.costs import Costs
from agent.discovery import RouterSite
from agent.host_read import HostRead
from agent.monitors import router_conditioning_ratio, router_similarity
from agent.monitors.router import ROUTING_SUM_FIELDS
from agent.router_buffer import HandedBatch, RouterLogitBuffer
from agent.router_output import router_input
from agent.samples import Sample

# Running sums kept per router (``ROUTING_SUM_FIELDS``): entropy mean, normalized entropy, p10,
# margin, number of forwards counted.
_ROUTER_SUMS = len(ROUTING_SUM_FIELDS)
# A router's weight statistics (``RouterProbe.weight_stats``): the conditioning ratio, the expert
# similarity, the relative update of the router and that of its MoE block's other weights.
WEIGHT_STATS = 4
# Columns of the fixed Gaussian sketch G [n, K] through which a block weight W [m, n] is
# remembered between read-outs (W G, K per row, not W): ||(W - W') G||_F^2 estimates
# K ||W - W'||_F^2 with a relative error of about sqrt(2 / (K m)) (JL), at K / n of the memory.
_SKETCH_COLUMNS = 8
_SKETCH_SEED = 20261204


class RouterProbe:
    """Device-side routing statistics for every discovered router.

    The logits are computed in the hooks from the router's input and weight, z = x W^T + b,
    never guessed from what the router returns (Llama 4 returns sigmoid scores first). A
    forward pre-hook on the router module does it; when the weight is applied by the router's
    parent (``RouterSite.owner``, e.g. ``F.linear(x, self.classifier.weight)``), the parent is
    hooked too and uses its own input whenever the router module was not called during its
    forward. The one exception: a router that is exactly ``nn.Linear`` (not a subclass, which
    may return something else) returns z itself, so a forward hook copies its output (a copy
    instead of a second product: half the hook's time on the test bed). Only training-mode
    forwards count.
    """

    def __init__(
        self, sites: list[RouterSite], default_top_k: int = 1, costs: Costs | None = None
    ) -> None:
        self.sites = sites
        self.hook_seconds = 0.0  # wall seconds in the hooks (training thread only)
        if costs is not None:
            costs.source("router hooks", lambda: self.hook_seconds)
        self.default_top_k = default_top_k
        for site in sites:
            top_k = site.top_k or default_top_k
            if not 1 <= top_k <= site.num_experts:
                raise ValueError(
                    f"router {site.name}: top_k must be in [1, {site.num_experts}], got {top_k}"
                )
        self._buffers = [
            RouterLogitBuffer(site.num_experts, site.top_k or default_top_k) for site in sites
        ]
        self._seen = [False] * len(sites)  # the router produced data at least once
        self._called = [False] * len(sites)  # router module called in its owner's forward
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        self._checked = False  # the first read-out named the routers without data
        self._capture: dict[int, int] = {}  # router index -> step of the stats to capture
        self._captured: dict[int, tuple[int, torch.Tensor]] = {}  # -> (step, (3,) stats)
        # Each router's weight (E, d) at its last ``weight_stats``, in the work dtype: the
        # start of the next read-out's update (None: none yet, or the run restarted).
        self._previous: list[torch.Tensor | None] = [None] * len(sites)
        # Each router's block weights at its last ``weight_stats``, sketched (W G, [m, K] each):
        # the start of the next read-out's block update (None: none yet, or restarted).
        self._block_previous: list[list[torch.Tensor] | None] = [None] * len(sites)
        self._sketches: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}  # G^T
        self.errors: list[str] = []

    def attach(self) -> None:
        if self._handles:
            return
        for i, site in enumerate(self.sites):
            if _returns_logits(site):
                hook = self._output_hook(i, site)
                self._handles.append(site.module.register_forward_hook(hook))
                continue
            hook = self._router_hook(i, site)
            self._handles.append(site.module.register_forward_pre_hook(hook, with_kwargs=True))
            if site.owner is not None:
                self._handles += [
                    site.owner.register_forward_pre_hook(self._owner_enter(i)),
                    site.owner.register_forward_hook(self._owner_exit(i, site), with_kwargs=True),
                ]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _router_hook(self, index: int, site: RouterSite):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            self._called[index] = True
            if module.training:  # evaluation passes would mix another distribution in
                self._record(index, site, args, kwargs)

        return hook

    def _output_hook(self, index: int, site: RouterSite):
        def hook(module: torch.nn.Module, args: tuple, output: object) -> None:
            if module.training:
                self._record(index, site, args, {}, output)

        return hook

    def _owner_enter(self, index: int):
        def hook(module: torch.nn.Module, args: tuple) -> None:
            self._called[index] = False

        return hook

    def _owner_exit(self, index: int, site: RouterSite):
        def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: object) -> None:
            if not self._called[index] and module.training:
                self._record(index, site, args, kwargs)

        return hook

    def _record(
        self, index: int, site: RouterSite, args: tuple, kwargs: dict, output: object = None
    ) -> None:
        """Buffer one forward's z = x W^T + b (on the device; reduced in batches): the
        router's ``output`` when it is z (an ``nn.Linear`` router's), else computed from its
        input. Runs in every training forward: detached tensors (no autograd context needed),
        few calls."""
        start = time.perf_counter()
        try:
            e = site.num_experts
            if isinstance(output, torch.Tensor) and output.shape[-1] == e and output.numel():
                self._buffers[index].add_logits(output.detach().reshape(-1, e))
            else:
                x = router_input(args, kwargs, site.d_model)  # (..., d)
                if x is None or x.numel() == 0:
                    return
                x = x.detach().reshape(-1, x.shape[-1])
                self._buffers[index].add(x, site.weight().detach(), _detached(site.bias()))
            self._seen[index] = True
            if self._capture and index in self._capture:  # the weight is whole in the forward
                self._captured[index] = (self._capture.pop(index), self.weight_stats(index))
        except Exception as exc:  # never break the user's forward
            if len(self.errors) < 10:
                self.errors.append(f"router probe {site.name}: {exc!r}")
        finally:
            self.hook_seconds += time.perf_counter() - start

    def _name_silent_routers(self) -> None:
        """Once, at the first read-out: warn about every router that produced no data."""
        self._checked = True
        pairs = zip(self.sites, self._seen, strict=True)
        silent = [site.name for site, seen in pairs if not seen]
        if not silent:
            return
        message = (
            f"mechwatch router probe: no routing data from {', '.join(silent)} by the first "
            "read-out: the router module was never called in a training forward with an input "
            "of its width (a router applied functionally by a module other than its parent, or "
            "never run); its router metrics stay empty"
        )
        warnings.warn(message, stacklevel=3)
        self.errors.append(message)

    def take(self, index: int) -> torch.Tensor | None:
        """Router ``index``'s sums since the last read-out, (5 + E,) on the device: the
        ``_ROUTER_SUMS`` running sums, then the summed load fractions (None: no data yet).
        Resets them."""
        try:
            return self._buffers[index].take()
        except Exception as exc:  # a batch that cannot be reduced is dropped, never raised
            self._buffers[index].reset()
            if len(self.errors) < 10:
                self.errors.append(f"router probe {self.sites[index].name}: {exc!r}")
            return None

    def reset(self) -> None:
        """Drop what the hooks buffered and the weights of the last read-out (the run
        continues from another state: an update across the jump would be no update)."""
        for buffer in self._buffers:
            buffer.reset()
        self._previous = [None] * len(self.sites)
        self._block_previous = [None] * len(self.sites)

    def weight_stats(self, index: int) -> torch.Tensor:
        """(WEIGHT_STATS,) on the device: the conditioning ratio, the expert similarity and the
        relative update of router ``index``'s weight as it is now (the whole [E, d] weight),
        then the relative update of its MoE block's other weights (``_block_update_rel_norm``)."""
        weight = self.sites[index].weight().detach()
        eps = router_conditioning_ratio(weight).reshape(1)
        sim = router_similarity(weight).reshape(1)
        update = self._update_rel_norm(index, weight).to(eps.dtype)
        block = self._block_update_rel_norm(index, eps)
        return torch.cat([eps, sim, update, block])

    def _update_rel_norm(self, index: int, weight: torch.Tensor) -> torch.Tensor:
        """(1,) ||W - W_prev||_F / ||W||_F since the router's last ``weight_stats`` (one
        read-out: ``router.every`` steps), NaN the first time; keeps W for the next one (a
        copy into a buffer allocated once)."""
        w = weight.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)
        previous = self._previous[index]
        if previous is None or previous.shape != w.shape or previous.device != w.device:
            self._previous[index] = w.clone()
            return torch.full((1,), math.nan, dtype=w.dtype, device=w.device)
        norm = torch.linalg.vector_norm(w)
        moved = torch.linalg.vector_norm(w - previous)
        previous.copy_(w)
        rel = moved / torch.where(norm > 0, norm, torch.ones_like(norm))
        return torch.where(norm > 0, rel, torch.full_like(rel, math.nan)).reshape(1)

    def _block_update_rel_norm(self, index: int, like: torch.Tensor) -> torch.Tensor:
        """(1,) like ``like``: ||B - B_prev||_F / ||B||_F over the MoE block's other weights B
        (``RouterSite.block_weights``, all of them as one vector) since the last call, from
        their sketches W G; NaN the first time, without a block, or when it cannot be measured
        (a weight not held whole on this rank: named in ``errors``)."""
        nan = torch.full((1,), math.nan, dtype=like.dtype, device=like.device)
        try:
            weights = self.sites[index].block_weights()
            if not weights:
                return nan
            sketches = self._sketch_all([w.detach() for w in weights])  # [m, K] float32+ each
        except Exception as exc:  # a sharded or odd block weight: no block update, no crash
            self._block_previous[index] = None
            if len(self.errors) < 10:
                self.errors.append(f"router probe {self.sites[index].name} block: {exc!r}")
            return nan
        previous = self._block_previous[index]
        self._block_previous[index] = sketches
        if previous is None or [p.shape for p in previous] != [s.shape for s in sketches]:
            return nan
        pairs = zip(sketches, previous, strict=True)
        moved = sum(torch.sum((s - p.to(s.device)) ** 2) for s, p in pairs)
        norm = sum(torch.sum(s**2) for s in sketches)
        rel = torch.sqrt(moved / torch.where(norm > 0, norm, torch.ones_like(norm)))
        rel = torch.where(norm > 0, rel, torch.full_like(rel, math.nan))
        return rel.reshape(1).to(like.dtype).to(like.device)

    def _sketch_all(self, weights: list[torch.Tensor]) -> list[torch.Tensor]:
        """The sketches of ``weights``: one product per group of weights that share their last
        dimension, dtype and device (a MoE block's experts have two or three weight shapes,
        instead of one product per expert weight), the groups' rows stacked in the order of
        first appearance, [sum of their m, K]; one tensor when every group's sketch has the
        same dtype and device. The sum of squares over the sketches is that of the per-weight
        sketches."""
        groups: dict[tuple[int, torch.dtype, torch.device], list[torch.Tensor]] = {}
        for w in weights:
            rows = w.reshape(-1, w.shape[-1])
            groups.setdefault((w.shape[-1], w.dtype, w.device), []).append(rows)
        sketches = [self._sketch(torch.cat(r) if len(r) > 1 else r[0]) for r in groups.values()]
        if len({(x.dtype, x.device) for x in sketches}) == 1 and len(sketches) > 1:
            return [torch.cat(sketches)]
        return sketches

    def _sketch(self, weight: torch.Tensor) -> torch.Tensor:
        """W G for ``weight`` viewed as [m, n] (its last dimension n): [m, K], float32 or
        float64. G is a fixed Gaussian [n, K] per (n, dtype, device), the same every call (kept
        as G^T, [K, n])."""
        n = weight.shape[-1]
        key = (n, weight.dtype, weight.device)
        g = self._sketches.get(key)
        if g is None:
            generator = torch.Generator().manual_seed(_SKETCH_SEED + n)
            g = torch.randn(n, _SKETCH_COLUMNS, generator=generator, dtype=torch.float64)
            g = g.to(device=weight.device, dtype=weight.dtype).t().contiguous()  # [K, n]
            self._sketches[key] = g
        # [m, K] in the weight's dtype, as (G^T W^T)^T: a CPU's BLAS takes [m, n] @ [n, 8]
        # through a slow skinny path (0.08-0.2 ms at m 512-1024, n 64-128; this form 0.02)
        out = (g @ weight.reshape(-1, n).t()).t()
        return out.to(torch.float64 if weight.dtype == torch.float64 else torch.float32)

    def capture_weight_stats(self, index: int, step: int) -> None:
        """Compute ``weight_stats(index)`` in the next training forward, where a sharded
        weight (FSDP2) is whole, and keep it as the stats of ``step`` (``take_captured``)."""
        self._capture[index] = step

    def take_captured(self, index: int) -> tuple[int, torch.Tensor] | None:
        """(step, (3,) stats) captured since the last call, or None."""
        return self._captured.pop(index, None)

    def check_silent(self) -> None:
        """At the first read-out: name (once) every router that has produced no data."""
        if not self._checked:
            self._name_silent_routers()

    def allocate_cpu_with(
        self, allocate: Callable[[tuple[int, ...], torch.dtype], torch.Tensor]
    ) -> None:
        """Allocate the routers' CPU logit buffers with ``allocate`` from now on (the monitor
        process's shared files: the reductions then run there)."""
        for buffer in self._buffers:
            buffer.allocate_cpu = allocate

    def hand_over(self) -> list[HandedBatch]:
        """Every router's forwards since its last take or hand-over, to reduce on the monitor
        thread (``HandedBatch.reduce``); the hooks go on in each router's spare buffer."""
        return [buffer.hand_over() for buffer in self._buffers]

    def recycle(self, batches: list[HandedBatch]) -> None:
        """The handed batches were reduced: their buffers may take forwards again."""
        for buffer, batch in zip(self._buffers, batches, strict=True):
            buffer.recycle(batch)

    def read(self, step: int, rows: list[torch.Tensor | None] | None = None) -> list[Sample]:
        """Samples of read-out ``step`` (one host transfer): from ``rows`` (per router, the
        reduced sums of a hand-over, ``HandedBatch.reduce``) or, when None, from everything
        buffered since the last read (``take``)."""
        pending = self.start_read(step, rows)
        return [] if pending is None else pending.samples()

    def start_read(
        self, step: int, rows: list[torch.Tensor | None] | None = None
    ) -> RouterRead | None:
        """``read`` in two halves: the device work and the start of the one host transfer now,
        the samples from ``RouterRead.samples()`` (later, when the transfer is in flight from
        a GPU: ``agent.host_read``). None: no router has data."""
        self.check_silent()
        if rows is None:
            rows = [self.take(i) for i in range(len(self.sites))]
        device_rows, names = [], []
        for i, (site, row) in enumerate(zip(self.sites, rows, strict=True)):
            if row is None:
                continue
            stats = self.weight_stats(i)
            # float64 holds every router's float32 or float64 values exactly
            device_rows.append(torch.cat([row.to(stats.device, stats.dtype), stats]).double())
            names.append(site)
        if not device_rows:
            return None
        lengths = [len(r) for r in device_rows]
        if len({r.device for r in device_rows}) > 1:  # routers on several devices: gather
            device_rows = [r.to(device_rows[0].device) for r in device_rows]
        return RouterRead(step, names, lengths, HostRead(torch.cat(device_rows)))


class RouterRead:
    """A router read-out whose host transfer was started (``RouterProbe.start_read``)."""

    def __init__(
        self, step: int, sites: list[RouterSite], lengths: list[int], values: HostRead
    ) -> None:
        self.step, self.sites, self.lengths, self.values = step, sites, lengths, values

    @property
    def in_flight(self) -> bool:
        return self.values.in_flight

    def samples(self) -> list[Sample]:
        flat = self.values.tolist()  # (sum of lengths,)
        out: list[Sample] = []
        start = 0
        for site, n in zip(self.sites, self.lengths, strict=True):
            values = flat[start : start + n]
            start += n
            stats = (self.step, *values[-WEIGHT_STATS:])
            out += router_samples(self.step, site, values[:-WEIGHT_STATS], stats)
        return out


def _returns_logits(site: RouterSite) -> bool:
    """Does the router module return its logits z = x W^T + b itself? Exactly ``nn.Linear``
    (a subclass may override ``forward``), applying its own weight (no owner)."""
    return type(site.module) is torch.nn.Linear and site.owner is None


def _detached(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach()


def router_samples(
    step: int,
    site: RouterSite,
    sums: list[float],
    stats: tuple[int, float, float, float, float] | None,
) -> list[Sample]:
    """One router's samples at read-out ``step`` from its sums (``RouterProbe.take``: the
    running sums, then the summed load) and its weight stats ``(step, eps, similarity,
    relative update, block's relative update)`` (None: none this time; a NaN update: none
    yet); nothing when no forward was counted."""
    n = sums[_ROUTER_SUMS - 1]
    if n <= 0:
        return []
    e = site.num_experts
    load = [x / n for x in sums[_ROUTER_SUMS : _ROUTER_SUMS + e]]
    load_entropy = -sum(x * math.log(x) for x in load if x > 0)
    lab = {"router": site.name}
    out = [
        Sample.make(step, m.ROUTER_ENTROPY, sums[0] / n, **lab),
        Sample.make(step, m.ROUTER_ENTROPY_NORM, sums[1] / n, **lab),
        Sample.make(step, m.ROUTER_ENTROPY_P10, sums[2] / n, **lab),
        Sample.make(step, m.ROUTER_MARGIN, sums[3] / n, **lab),
        Sample.make(step, m.ROUTER_LOAD_MAX, max(load), **lab),
        Sample.make(step, m.ROUTER_LOAD_ENTROPY, load_entropy, **lab),
        Sample.make(step, m.ROUTER_DEAD_EXPERTS, sum(1 for x in load if x == 0), **lab),
    ]
    if stats is not None:
        at, eps, sim, update, block = stats
        out += [
            Sample.make(at, m.ROUTER_EPS, eps, **lab),
            Sample.make(at, m.ROUTER_SIMILARITY, sim, **lab),
        ]
        if math.isfinite(update):
            out.append(Sample.make(at, m.ROUTER_UPDATE_REL_NORM, update, **lab))
        if math.isfinite(block):
            out.append(Sample.make(at, m.ROUTER_BLOCK_UPDATE_REL_NORM, block, **lab))
            if math.isfinite(update) and block > 0:
                out.append(Sample.make(at, m.ROUTER_UPDATE_RATIO, update / block, **lab))
    return out
