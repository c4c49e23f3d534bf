"""RouterProbe computes the routing logits from the router's own input, z = x W^T + b.

Routers built like real ones: Llama 4's (an ``nn.Linear`` returning sigmoid scores *before*
the logits), LongcatFlash's (the weight lives in a ``classifier`` child that is never called:
its parent applies ``F.linear`` to it), and a router whose weight is applied somewhere the probe
cannot see (named in a warning at the first read-out).
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from agent import samples as m
from agent.discovery import find_routers
from agent.monitors import routing_stats
from agent.probes import RouterProbe

D, E, T = 8, 4, 10  # width, experts, tokens


class Llama4LikeRouter(nn.Linear):
    """transformers' Llama4Router: returns (sigmoid top-k scores, logits)."""

    def __init__(self) -> None:
        super().__init__(D, E, bias=False)
        self.num_experts, self.top_k = E, 1

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = super().forward(x)  # (tokens, E)
        top, idx = torch.topk(logits, self.top_k, dim=1)
        scores = torch.full_like(logits, -math.inf).scatter_(1, idx, top).sigmoid()
        return scores, logits


class LongcatLikeRouter(nn.Module):
    """transformers' LongcatFlashTopkRouter: ``classifier`` holds the weight, never called."""

    def __init__(self) -> None:
        super().__init__()
        self.top_k, self.n_routed_experts = 2, E
        self.classifier = nn.Linear(D, E, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.view(-1, D)
        logits = F.linear(x, self.classifier.weight, self.classifier.bias)
        return logits.softmax(-1)


def _route_elsewhere(x: torch.Tensor, gate: nn.Linear) -> torch.Tensor:
    return x @ gate.weight.T  # the gate's module is never called


class Block(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        if kind == "llama4":
            self.router = Llama4LikeRouter()
        elif kind == "longcat":
            self.router = LongcatLikeRouter()
        else:
            self.gate = nn.Linear(D, E, bias=False)
        self.experts = nn.ModuleList(nn.Linear(D, D) for _ in range(E))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "hidden":
            return _route_elsewhere(x, self.gate)
        out = self.router(x.reshape(-1, D))
        return out[0] if isinstance(out, tuple) else out


class Model(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.mlp = Block(kind)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(x)


def _values(samples: list, metric: str) -> list[float]:
    return [s.value for s in samples if s.metric == metric]


@pytest.mark.parametrize("kind", ["llama4", "longcat"])
def test_statistics_are_those_of_x_w_plus_b(kind: str) -> None:
    model = Model(kind).double()
    (site,) = find_routers(model)
    assert (site.owner_name is not None) == (kind == "longcat")
    probe = RouterProbe([site])
    probe.attach()
    xs = [torch.randn(2, T // 2, D, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        model(x)
    model.eval()(xs[0])  # evaluation passes do not count
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the router has data: no warning
        samples = probe.read(step=5)
    bias = site.bias()
    stats = [
        routing_stats(x.reshape(-1, D) @ site.weight().T + (0 if bias is None else bias), k)
        for x in xs
        for k in [site.top_k]
    ]
    want_entropy = sum(float(s[0].mean) for s in stats) / len(stats)
    want_margin = sum(float(s[1].margin) for s in stats) / len(stats)
    assert _values(samples, m.ROUTER_ENTROPY) == [pytest.approx(want_entropy, rel=1e-12)]
    assert _values(samples, m.ROUTER_MARGIN) == [pytest.approx(want_margin, rel=1e-12)]
    load = sum(s[1].load for s in stats) / len(stats)  # (E,)
    assert _values(samples, m.ROUTER_LOAD_MAX) == [pytest.approx(float(load.max()), rel=1e-12)]
    if kind == "llama4":  # the sigmoid scores the router returns first would give another value
        scores = model.mlp.router(xs[0].reshape(-1, D))[0]
        assert float(routing_stats(scores.clamp_min(-1e9), 1)[0].mean) != pytest.approx(
            float(stats[0][0].mean)
        )
    probe.detach()


def test_owner_does_not_count_a_forward_twice() -> None:
    """The router module is called inside its owner: its own hook counts, the owner's does not."""

    class CalledInside(LongcatLikeRouter):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            _ = self.classifier.weight  # the owner names the weight and calls the module too
            return self.classifier(x.view(-1, D)).softmax(-1)

    model = Model("longcat")
    model.mlp.router = CalledInside()
    (site,) = find_routers(model)
    assert site.owner is model.mlp.router
    probe = RouterProbe([site])
    probe.attach()
    model(torch.randn(1, T, D))
    model(torch.randn(1, T, D))
    sums = probe.take(0)
    assert sums is not None and float(sums[4]) == 2.0  # two forwards counted, not four


def test_a_router_without_data_is_named_once_at_the_first_read_out() -> None:
    model = Model("hidden")
    (site,) = find_routers(model)
    assert site.name == "mlp.gate" and site.owner is None
    probe = RouterProbe([site])
    probe.attach()
    model(torch.randn(1, T, D))
    with pytest.warns(UserWarning, match=r"no routing data from mlp\.gate by the first read-out"):
        assert probe.read(step=1) == []
    assert any("mlp.gate" in e for e in probe.errors)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert probe.read(step=2) == []  # named once


def test_a_plain_linear_router_is_read_from_its_output() -> None:
    """An exact nn.Linear gate returns z: the probe copies its output (a forward hook) and
    gets the statistics of x W^T + b; a subclass (Llama 4's) keeps the input path above."""
    model = Model("gate").double()
    model.mlp.gate.bias = nn.Parameter(torch.randn(E, dtype=torch.float64))
    model.mlp.forward = lambda x: model.mlp.gate(x.reshape(-1, D))  # the gate is called
    (site,) = find_routers(model)
    probe = RouterProbe([site])
    probe.attach()
    assert model.mlp.gate._forward_hooks and not model.mlp.gate._forward_pre_hooks
    xs = [torch.randn(2, T // 2, D, dtype=torch.float64) for _ in range(3)]
    for x in xs:
        model(x)
    model.eval()(xs[0])  # evaluation passes do not count
    samples = probe.read(step=5)
    stats = [
        routing_stats(x.reshape(-1, D) @ site.weight().T + site.bias(), site.top_k or 1) for x in xs
    ]
    want = sum(float(s[0].mean) for s in stats) / len(stats)
    assert _values(samples, m.ROUTER_ENTROPY) == [pytest.approx(want, rel=1e-12)]
    probe.detach()
    assert not model.mlp.gate._forward_hooks


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_relative_update_is_the_weights_move_between_read_outs(dtype: torch.dtype) -> None:
    """router_update_rel_norm = ||W_t - W_prev||_F / ||W_t||_F between two read-outs; none at
    the first read-out and none right after a restart (the update would cross the jump)."""
    model = Model("longcat").to(dtype)
    (site,) = find_routers(model)
    probe = RouterProbe([site])
    probe.attach()
    x = torch.randn(2, T // 2, D, dtype=dtype)
    weight = site.weight()

    def read_out(step: int) -> list[float]:
        model(x)
        return _values(probe.read(step=step), m.ROUTER_UPDATE_REL_NORM)

    assert read_out(25) == []  # nothing to compare with yet
    before = weight.detach().double().clone()
    with torch.no_grad():
        weight.add_(torch.randn_like(weight) * 0.01)
        weight[0].mul_(3.0)
    after = weight.detach().double()
    want = float((after - before).norm() / after.norm())
    tol = 1e-12 if dtype == torch.float64 else 1e-6
    assert read_out(50) == [pytest.approx(want, rel=tol)]
    assert read_out(75) == [pytest.approx(0.0, abs=tol)]  # it did not move
    probe.reset()
    with torch.no_grad():
        weight.mul_(2.0)
    assert read_out(100) == []  # a restart: no update across it
    assert read_out(125) == [pytest.approx(0.0, abs=tol)]
    probe.detach()


def test_the_block_update_is_the_experts_move_and_the_ratio_compares_the_router_with_it() -> None:
    """router_block_update_rel_norm: ||B_t - B_prev|| / ||B_t|| over the MoE block's weights
    other than the router's (the experts), from fixed Gaussian sketches: exact for a move along
    the weights themselves (a sketch is linear), close to the dense value for a random move;
    router_update_ratio = the router's relative update / the block's."""

    class Routed(Model):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.mlp.gate(x)

    model = Routed("plain").double()
    (site,) = find_routers(model)
    assert site.block is model.mlp and site.block_name == "mlp"
    experts = [p for p in model.mlp.experts.parameters() if p.dim() == 2]
    assert [id(p) for p in site.block_weights()] == [id(p) for p in experts]  # not the gate's
    probe = RouterProbe([site])
    probe.attach()
    x = torch.randn(2, T // 2, D, dtype=torch.float64)

    def read_out(step: int) -> dict[str, list[float]]:
        model(x)
        samples = probe.read(step=step)
        names = (m.ROUTER_UPDATE_REL_NORM, m.ROUTER_BLOCK_UPDATE_REL_NORM, m.ROUTER_UPDATE_RATIO)
        return {name: _values(samples, name) for name in names}

    assert all(v == [] for v in read_out(25).values())  # nothing to compare with yet
    with torch.no_grad():
        for p in experts:
            p.mul_(1.25)  # the block moved by 0.25 / 1.25 of itself, exactly
        model.mlp.gate.weight.mul_(1.5)  # the router by 0.5 / 1.5
    got = read_out(50)
    assert got[m.ROUTER_BLOCK_UPDATE_REL_NORM] == [pytest.approx(0.2, rel=1e-9)]
    assert got[m.ROUTER_UPDATE_RATIO] == [pytest.approx((1 / 3) / 0.2, rel=1e-9)]

    before = torch.cat([p.detach().flatten() for p in experts]).clone()
    with torch.no_grad():
        for p in experts:
            p.add_(torch.randn_like(p) * 0.05)
    after = torch.cat([p.detach().flatten() for p in experts])
    want = float((after - before).norm() / after.norm())
    got = read_out(75)
    (block,) = got[m.ROUTER_BLOCK_UPDATE_REL_NORM]
    assert block == pytest.approx(want, rel=0.3)  # a sketch of 8 columns: an estimate
    assert got[m.ROUTER_UPDATE_RATIO] == [0.0]  # the router did not move
    probe.detach()
