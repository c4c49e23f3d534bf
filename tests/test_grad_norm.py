"""The agent's own gradient norm (loops that do not pass ``grad_norm``): the value
``clip_grad_norm_`` reports, and a loop that clears the gradients before ``agent.step`` is
told so once instead of getting a silently empty (or zero) ``grad_norm`` series."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from symptom_agent import symptoms_only

from agent.agent import Agent
from agent.eventlog import read_events
from agent.grad_norm import NO_GRADIENTS, REFRESH_CALLS, ZEROED, OwnGradNorm


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.b = torch.nn.Linear(5, 3, bias=False)
        self.frozen = torch.nn.Linear(3, 3)
        self.frozen.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.frozen(self.b(torch.tanh(self.a(x))))


def _backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(8, 6, generator=g)
    (model(x) ** 2).mean().backward()


def test_the_own_grad_norm_is_the_global_norm_clip_grad_norm_reports():
    torch.manual_seed(0)
    model = _Net()
    own = OwnGradNorm(model)
    for seed in range(3):
        model.zero_grad(set_to_none=True)
        _backward(model, seed)
        grads = [p.grad.double() for p in model.parameters() if p.grad is not None]
        reference = torch.sqrt(sum((g**2).sum() for g in grads))  # float64, dense
        got = own.measure()
        assert got is not None and got.dtype == torch.float32
        assert float(got) == pytest.approx(float(reference), rel=1e-6)
        assert float(got) == pytest.approx(
            float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))), rel=1e-6
        )
    assert own.problem is None


def test_a_parameter_added_later_is_counted_from_the_next_refresh():
    model = _Net()
    own = OwnGradNorm(model)
    _backward(model, 0)
    before = float(own.measure())
    model.extra = torch.nn.Parameter(torch.zeros(4))
    model.extra.grad = torch.full((4,), 10.0)  # norm 20
    for _ in range(REFRESH_CALLS - 1):
        assert float(own.measure()) == pytest.approx(before)
    assert float(own.measure()) == pytest.approx((before**2 + 400.0) ** 0.5, rel=1e-6)


def test_no_gradient_at_all_is_none_with_the_reason():
    model = _Net()
    own = OwnGradNorm(model)
    assert own.measure() is None
    assert own.problem == NO_GRADIENTS


def _loop(
    tmp_path: Path, *, set_to_none: bool | None, steps: int = 25
) -> tuple[Agent, list[float], list[str]]:
    """A hand-written loop that passes the loss only; ``set_to_none`` None: ``agent.step`` runs
    before ``zero_grad``, else ``zero_grad(set_to_none=...)`` runs first."""
    torch.manual_seed(0)
    model = _Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = symptoms_only(tmp_path / "run", 5)
    agent = Agent(model, optimizer, config=config)
    norms = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            _backward(model, step)
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))))
            optimizer.step()
            if set_to_none is not None:
                optimizer.zero_grad(set_to_none=set_to_none)
            loss = torch.tensor(1.0)
            assert agent.step(step, loss=loss) == step + 1
            if set_to_none is None:
                optimizer.zero_grad(set_to_none=True)
    agent.close()
    texts = [str(w.message) for w in caught if "mechwatch" in str(w.message)]
    return agent, norms, texts


def test_a_loop_that_steps_the_agent_before_zero_grad_gets_the_grad_norm_series(tmp_path):
    agent, norms, texts = _loop(tmp_path, set_to_none=None)
    series = dict(agent.store.series("grad_norm"))
    assert sorted(series) == [0, 5, 10, 15, 20]
    for step, value in series.items():
        assert value == pytest.approx(norms[step], rel=1e-5)
    assert texts == []


@pytest.mark.parametrize(("set_to_none", "reason"), [(True, NO_GRADIENTS), (False, ZEROED)])
def test_a_loop_that_clears_the_gradients_first_is_told_once(tmp_path, set_to_none, reason):
    agent, _, texts = _loop(tmp_path, set_to_none=set_to_none)
    series = dict(agent.store.series("grad_norm"))
    assert all(v == 0.0 for v in series.values())  # none (set to None) or exact zeros
    assert len(texts) == 1 and reason in texts[0], texts
    errors = [e for e in read_events(tmp_path / "run/events.jsonl") if e["kind"] == "error"]
    assert len(errors) == 1 and reason in errors[0]["error"]
