from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import pytest
import torch

from agent import samples as names
from agent.testbed.bands import Band, clean_band, departure_step, earliest_departure
from agent.testbed.cli import cli_testbed
from agent.testbed.data import MarkovSource
from agent.testbed.divergence import degradation_step, divergence_step, ema
from agent.testbed.metrics_file import monitor_series, read_metrics
from agent.testbed.model import MoETransformer, TestbedConfig
from agent.testbed.runner import ROUTER_GROUP, TestbedRun, run_scenario
from agent.testbed.scenarios import SCENARIOS, ScenarioConfig

SMALL = TestbedConfig(
    vocab=32,
    d_model=16,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    n_experts=4,
    top_k=2,
    d_expert=16,
    seq_len=8,
)


# --- data ---------------------------------------------------------------------------------
def test_markov_source_is_deterministic_and_follows_its_chain() -> None:
    src = MarkovSource(16, seed=3, order=2, pool=5, branching=3)
    a = src.batch(4, 20, torch.Generator().manual_seed(0))
    b = src.batch(4, 20, torch.Generator().manual_seed(0))
    assert a.shape == (4, 21) and a.dtype == torch.int64 and torch.equal(a, b)
    assert a.min() >= 0 and a.max() < 16
    # every transition is one of the context's successors, which lie in the last token's pool
    succ = src._successors.view(16, 16, 3)
    for row in a.tolist():
        for t in range(2, len(row)):
            assert row[t] in succ[row[t - 2], row[t - 1]].tolist()
    other = MarkovSource(16, seed=4, order=2, pool=5, branching=3)
    assert not torch.equal(other.batch(4, 20, torch.Generator().manual_seed(0)), a)
    assert 0 < src.entropy_floor < math.log(3) + 1e-9


def test_markov_source_bad_arguments() -> None:
    with pytest.raises(ValueError, match="branching"):
        MarkovSource(16, 0, pool=4, branching=5)
    with pytest.raises(ValueError, match="too large"):
        MarkovSource(4096, 0, order=2)
    with pytest.raises(ValueError, match="batch_size"):
        MarkovSource(16, 0, pool=4, branching=2).batch(0, 4, torch.Generator())


# --- model --------------------------------------------------------------------------------
def test_model_layout_shapes_and_names() -> None:
    model = MoETransformer(SMALL)
    logits, aux = model(torch.randint(0, 32, (3, 8)))
    assert logits.shape == (3, 8, 32) and aux.shape == ()
    modules = dict(model.named_modules())
    attn = modules["blocks.1.attn"]
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 4)
    assert modules["blocks.1.attn.q_proj"].weight.shape == (16, 16)  # [H*d_h, d]
    assert modules["blocks.1.attn.k_proj"].weight.shape == (8, 16)  # [H_kv*d_h, d]
    moe = modules["blocks.0.moe"]
    assert isinstance(modules["blocks.0.moe.gate"], torch.nn.Linear)
    assert modules["blocks.0.moe.gate"].weight.shape == (4, 16)  # [E, d]
    assert isinstance(moe.experts, torch.nn.ModuleList) and len(moe.experts) == moe.num_experts
    assert moe.top_k == 2


def test_moe_dispatch_matches_dense_reference_and_balance_loss() -> None:
    torch.manual_seed(0)
    moe = MoETransformer(SMALL).blocks[0].moe
    x = torch.randn(2, 8, 16)
    y, balance, z_loss = moe(x)
    flat = x.reshape(-1, 16)
    logits = moe.gate(flat)  # (N, E)
    probs = torch.softmax(logits, dim=-1)
    top_p, top_i = probs.topk(2, dim=-1)
    want = torch.zeros_like(flat)
    for n in range(flat.shape[0]):
        for slot in range(2):
            w = top_p[n, slot] / top_p[n].sum()
            want[n] += w * moe.experts[int(top_i[n, slot])](flat[n : n + 1])[0]
    torch.testing.assert_close(y.reshape(-1, 16), want, rtol=1e-5, atol=1e-6)
    fraction = torch.bincount(top_i.reshape(-1), minlength=4).float() / top_i.numel()
    torch.testing.assert_close(balance, 4 * (fraction * probs.mean(0)).sum())
    torch.testing.assert_close(z_loss, (torch.logsumexp(logits, dim=-1) ** 2).mean())


def test_moe_without_top_k_renormalization_weights_experts_by_their_probability() -> None:
    torch.manual_seed(0)
    moe = MoETransformer(SMALL.model_copy(update={"norm_topk": False})).blocks[0].moe
    x = torch.randn(1, 4, 16)
    y, _, _ = moe(x)
    flat = x.reshape(-1, 16)
    top_p, top_i = torch.softmax(moe.gate(flat), dim=-1).topk(2, dim=-1)
    want = torch.stack(
        [
            sum(top_p[n, s] * moe.experts[int(top_i[n, s])](flat[n : n + 1])[0] for s in range(2))
            for n in range(flat.shape[0])
        ]
    )
    torch.testing.assert_close(y.reshape(-1, 16), want, rtol=1e-5, atol=1e-6)


def test_balance_coefficient_weights_the_aux_loss() -> None:
    idx = torch.randint(0, 32, (2, 8))
    torch.manual_seed(0)
    on = MoETransformer(SMALL.model_copy(update={"balance_coef": 0.5, "router_z_coef": 0.0}))
    _, aux = on(idx)
    assert 0.45 < aux.item() < 1.0  # 0.5 * (1.0 when balanced, up to E when collapsed)
    on.balance_coef = 0.0
    assert on(idx)[1].item() == 0.0


def test_router_z_coefficient_adds_the_mean_squared_logsumexp() -> None:
    idx = torch.randint(0, 32, (2, 8))
    torch.manual_seed(0)
    model = MoETransformer(SMALL.model_copy(update={"balance_coef": 0.0, "router_z_coef": 0.5}))
    z_per_layer = []
    hooks = [
        moe.gate.register_forward_hook(
            lambda _m, _i, out: z_per_layer.append((torch.logsumexp(out, -1) ** 2).mean())
        )
        for moe in model.moe_modules()
    ]
    _, aux = model(idx)
    for h in hooks:
        h.remove()
    want = 0.5 * torch.stack(z_per_layer).mean()  # mean over layers, like the balancing loss
    torch.testing.assert_close(aux, want)
    assert aux.item() > 0.0


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="divisible by n_heads"):
        TestbedConfig(d_model=30, n_heads=4)
    with pytest.raises(ValueError, match="top_k"):
        TestbedConfig(n_experts=2, top_k=3)
    with pytest.raises(ValueError, match="seq_len"):
        MoETransformer(SMALL)(torch.zeros(1, 9, dtype=torch.long))


# --- divergence and bands -----------------------------------------------------------------
def test_divergence_step_on_synthetic_series() -> None:
    falling = [5.0 - 0.001 * i for i in range(1000)]
    assert divergence_step(falling) is None
    with_nan = falling[:300] + [math.nan] + falling[301:]
    assert divergence_step(with_nan) == 300
    jump = falling[:500] + [falling[499] + 2.0] * 500  # EMA crosses +0.5 after a few steps
    # w = 2/51; before the jump the EMA lags the falling line by (1-w)/w * 0.001 = 0.0245, its
    # running minimum. After n steps at L + 2: (2 - 0.0245)(1 - (1-w)^n) > 0.5 first at n = 8.
    assert divergence_step(jump) == 500 + 7
    assert divergence_step(jump, min_step=600) == 600


def test_degradation_step_against_reference_and_own_minimum() -> None:
    ref = [3.0] * 400
    worse = [3.0] * 100 + [3.2] * 300
    step = degradation_step(worse, ref, patience=50)
    # the EMA gap exceeds 0.05 once 0.2 (1 - (1-w)^n) > 0.05, w = 2/51: n = 8, so step 100 + 7
    assert step == 107
    assert degradation_step(worse[:150], ref, patience=50) is None  # stretch too short
    assert degradation_step([3.0] * 400, ref) is None
    assert degradation_step(worse, patience=50) == 107  # own running minimum = 3.0
    with pytest.raises(ValueError, match="reference"):
        degradation_step(worse, ref[:10])


def test_ema_and_band_departure() -> None:
    assert ema([1.0, 3.0], span=1) == [1.0, 3.0]
    runs = [([0, 10, 20, 30], [2.0, 2.0, 2.0, 2.0]), ([0, 10, 20, 30], [2.2, 2.2, 2.2, 2.2])]
    band = clean_band(runs, rel_margin=0.1)
    assert band.bounds[10] == pytest.approx((1.8, 2.42))
    series = ([0, 10, 20, 30], [2.0, 1.5, 2.0, 1.0])
    assert departure_step(series, band, consecutive=1) == 10
    assert departure_step(series, band, consecutive=2) is None
    assert departure_step(([0, 10, 20, 30], [2, 1.5, 1.5, 1.0]), band) == 10
    assert departure_step(([0, 10], [3.0, 3.0]), band, side="below") is None
    assert departure_step(([0, 10], [3.0, 3.0]), band, side="above") == 0
    assert Band({}).contains(5, 1.0) is None


# --- scenarios, runner, plot, cli ---------------------------------------------------------
def test_presets_and_validation() -> None:
    for name in SCENARIOS:
        cfg = ScenarioConfig.preset(name, seed=7, steps=10)
        assert cfg.scenario == name and cfg.seed == 7 and cfg.steps == 10
    assert ScenarioConfig.preset("control").fa_mode == "rne"
    assert ScenarioConfig.preset("fa_precision").fa_mode == "floor"
    with pytest.raises(ValueError, match="unbiased"):
        ScenarioConfig(scenario="control", fa_mode="floor")
    with pytest.raises(ValueError, match="biased"):
        ScenarioConfig(scenario="fa_precision", fa_mode="rne")
    with pytest.raises(ValueError, match="unknown scenario"):
        ScenarioConfig.preset("nope")
    with pytest.raises(ValueError, match="Extra inputs"):
        ScenarioConfig(scenario="clean", learning_rate=1.0)


def _tiny_run(scenario: str, **overrides) -> TestbedRun:
    cfg = ScenarioConfig.preset(
        scenario,
        model=SMALL,
        batch_size=2,
        warmup_steps=2,
        monitor_every=3,
        markov_pool=4,
        markov_branching=2,
        fault_start=4,
        **overrides,
    )
    return TestbedRun(cfg)


def test_faults_switch_on_at_fault_start() -> None:
    run = _tiny_run("combined", fault_batch_size=1, fault_balance_coef=0.0, router_lr_mult=10.0)
    router_lrs, other_lrs = [], []  # the learning rates each step uses
    for step in range(6):
        router_lrs.append(run.lr(ROUTER_GROUP))
        other_lrs.append(run.lr())
        run.step()
        faulty = step >= 4
        assert run.fa_fault_active == faulty and run.router_fault_active == faulty
    assert all(
        a.fault is not None and a.fault.mode == "floor" for a in run.model.attention_modules()
    )
    assert run.batch_size == 1 and run.model.balance_coef == 0.0
    base = ScenarioConfig().lr
    assert other_lrs == pytest.approx([base / 2, base, base, base, base, base])  # warm-up 2
    assert router_lrs == pytest.approx(other_lrs[:4] + [10 * base, 10 * base])
    assert run.step_index == 6 and run.last_loss is not None and run.last_loss.shape == ()


def test_record_has_scalars_every_step_and_the_agents_samples_on_cadence(tmp_path: Path) -> None:
    cfg = ScenarioConfig.preset(
        "fa_precision",
        steps=8,
        model=SMALL,
        batch_size=2,
        warmup_steps=2,
        monitor_every=3,
        markov_pool=4,
        markov_branching=2,
        fault_start=4,
    )
    summary = run_scenario(cfg, tmp_path, plot=True)
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(8))
    for r in records:
        assert math.isfinite(r["loss"]) and r["grad_norm"] > 0 and r["weight_norm"] > 0
        assert r["fa_fault"] == (r["step"] >= 4)
        assert ("samples" in r) == (r["step"] % 3 == 0)
    by_metric: dict[str, list] = {}
    for step, metric, labels, value in records[3]["samples"]:
        assert step == 3
        by_metric.setdefault(metric, []).append((labels, value))
    layer0 = [
        lab for lab, _ in by_metric[names.QK_DELTA2_ENTROPY] if lab["layer"] == "blocks.0.attn"
    ]
    assert sorted(int(lab["head"]) for lab in layer0) == [0, 1, 2, 3]  # one per query head
    kv = [lab for lab, _ in by_metric[names.DWK_ENTROPY] if lab["layer"] == "blocks.0.attn"]
    assert sorted(int(lab["kv_head"]) for lab in kv) == [0, 1]  # one per KV head
    entropy = dict((lab["router"], v) for lab, v in by_metric[names.ROUTER_ENTROPY])
    assert 0 <= entropy["blocks.1.moe.gate"] <= math.log(4) + 1e-6
    first = {metric for _, metric, _, _ in records[0]["samples"]}
    assert names.QK_DELTA2_ENTROPY not in first and names.ROUTER_ENTROPY in first  # no pair yet
    assert summary.steps == 8 and (tmp_path / "plot.png").stat().st_size > 10_000
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["scenario"] == "fa_precision" and saved["files"]["plot"].endswith("plot.png")
    series = monitor_series(records, names.ROUTER_ENTROPY)
    assert series["blocks.0.moe.gate"][0] == [0, 3, 6]


def test_the_test_bed_measures_exactly_what_the_agent_measures(tmp_path: Path) -> None:
    """One measurement pipeline: the recorder's samples equal the agent's for the same run."""
    from agent.agent import Agent
    from agent.config import AgentConfig

    cfg = ScenarioConfig.preset(
        "fa_precision",
        steps=12,
        model=SMALL,
        batch_size=2,
        warmup_steps=2,
        monitor_every=4,
        markov_pool=4,
        markov_branching=2,
        fault_start=4,
    )
    recorded = TestbedRun(cfg)
    watched = TestbedRun(cfg, record_monitors=False)
    agent_cfg = AgentConfig.model_validate(
        {
            "run_dir": tmp_path / "run",
            "rules": [],
            "qk": {"delta": 4},
            "router": {"every": 4},
            "scheduling": {"apply_lag": 0},
            "notify": {"console": "never"},
            "watchdog": {"enabled": False},
        }
    )
    ours: dict[tuple, float] = {}
    with Agent(watched.model, watched.optimizer, config=agent_cfg) as agent:
        for step in range(12):
            recorded.step()
            for s, metric, labels, value in recorded.last_samples or []:
                ours[(s, metric, tuple(sorted(labels.items())))] = value
            watched.step()
            agent.step(step)
        theirs = {
            (s, metric, labels): v
            for metric in agent.store.metrics()
            # the loop's inputs and the optimizer's learning rates and skipped steps are not
            # monitors; the kernel audit replays a call the agent captured
            # (tests/test_kernel_audit.py)
            if metric
            not in ("loss", "loss_nonfinite", "grad_norm", "lr", "optimizer_skipped_share")
            and metric != "attention_backward_asymmetry"
            for labels, points in agent.store.select(metric).items()
            for s, v in points
        }
    assert theirs.keys() == ours.keys() and len(ours) > 50
    assert all(theirs[k] == pytest.approx(ours[k], rel=1e-6, abs=1e-9) for k in ours)


def test_read_metrics_names_the_bad_line(tmp_path: Path) -> None:
    p = tmp_path / "m.jsonl"
    p.write_text('{"step": 0}\n{oops\n')
    with pytest.raises(ValueError, match=r"m.jsonl:2"):
        read_metrics(p)


def test_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run"
    assert (
        cli_testbed(
            ["--scenario", "clean", "--scale", "tiny", "--steps", "3", "--out", str(out), "--quiet"]
        )
        == 0
    )
    assert json.loads((out / "summary.json").read_text())["steps"] == 3
    assert cli_testbed(["--scenario", "control", "--set", "fa_mode=floor", "--out", str(out)]) == 2
    assert "unbiased" in capsys.readouterr().out


# --- the orderings, on the shortened scenario set (fixed seed) ----------------------------
@pytest.fixture(scope="module")
def tiny_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict]]:
    root = tmp_path_factory.mktemp("orderings")
    runs = {}
    for name in ("clean", "control", "fa_precision", "router_instability"):
        cfg = ScenarioConfig.preset(name, seed=0, scale="tiny")
        run_scenario(cfg, root / name)
        runs[name] = read_metrics(root / name / "metrics.jsonl")
    return runs


def _losses(records: list[dict]) -> list[float]:
    return [r["loss"] for r in records]


def test_clean_and_control_stay_healthy(tiny_runs: dict[str, list[dict]]) -> None:
    clean, control = tiny_runs["clean"], tiny_runs["control"]
    for recs in (clean, control):
        losses = _losses(recs)
        assert divergence_step(losses) is None
        assert ema(losses)[-1] < ema(losses)[150] - 0.3  # still learning after the fault start
    assert degradation_step(_losses(control), _losses(clean)) is None
    for metric in (names.QK_DELTA2_ENTROPY, names.ROUTER_ENTROPY):
        assert earliest_departure(control, [clean], metric) is None


# The tiny runs are 400 steps long: a degraded stretch of 50 steps (not the default 100) counts.
TINY_PATIENCE = 50
TINY_FAULT_START = 150


def test_fa_fault_drops_delta2_entropy_before_the_loss(tiny_runs: dict[str, list[dict]]) -> None:
    clean, fa = tiny_runs["clean"], tiny_runs["fa_precision"]
    h2 = earliest_departure(fa, [clean], names.QK_DELTA2_ENTROPY)
    loss_degraded = degradation_step(_losses(fa), _losses(clean), patience=TINY_PATIENCE)
    assert h2 is not None and loss_degraded is not None
    assert TINY_FAULT_START <= h2[0] <= TINY_FAULT_START + 60  # the monitor moves at once
    assert loss_degraded - h2[0] >= 50  # ... and well before the loss
    gap = ema(_losses(fa))[-1] - ema(_losses(clean))[-1]
    assert gap > 0.1  # the damage to the loss is real
    # the collapse is deep, not a wobble: some layer ends two orders of magnitude below clean
    last = {m: v[1][-1] for m, v in monitor_series(fa, names.QK_DELTA2_ENTROPY).items()}
    assert min(last.values()) < 0.1
    # routing entropy stays in its clean band long after H(Delta_2) has left its own
    route = earliest_departure(fa, [clean], names.ROUTER_ENTROPY)
    assert route is None or route[0] >= h2[0] + 150


def test_router_fault_collapses_routing_entropy_with_attention_quiet(
    tiny_runs: dict[str, list[dict]],
) -> None:
    clean, router = tiny_runs["clean"], tiny_runs["router_instability"]
    route = earliest_departure(router, [clean], names.ROUTER_ENTROPY)
    assert route is not None and TINY_FAULT_START <= route[0] <= TINY_FAULT_START + 30
    loss_degraded = degradation_step(_losses(router), _losses(clean), patience=TINY_PATIENCE)
    assert loss_degraded is None or loss_degraded >= route[0] + 100
    assert divergence_step(_losses(router)) is None
    # H(Delta_2) stays in its clean band long after the routing entropy left its own
    h2 = earliest_departure(router, [clean], names.QK_DELTA2_ENTROPY)
    assert h2 is None or h2[0] >= route[0] + 200


def test_fp32_backward_remediation_removes_the_fault_per_layer() -> None:
    from agent.testbed.attention import AttentionFault
    from remediations.attention import attention_precision

    torch.manual_seed(0)
    model = MoETransformer(SMALL)
    idx = torch.randint(0, 32, (2, 8))

    def q_grads() -> list[torch.Tensor]:
        model.zero_grad(set_to_none=True)
        logits, aux = model(idx)
        (logits.square().mean() + aux).backward()
        return [a.q_proj.weight.grad.clone() for a in model.attention_modules()]

    model.set_attention_fault(None)
    exact = q_grads()
    model.set_attention_fault(AttentionFault(sites=("dQK",), bits=2, mode="floor"))
    faulty = q_grads()
    attention_precision.enable_fp32_backward(["blocks.0.attn"])
    try:
        fixed = q_grads()
    finally:
        attention_precision.disable_fp32_backward(["blocks.0.attn"])
    assert not torch.allclose(faulty[0], exact[0], rtol=1e-3, atol=0)
    torch.testing.assert_close(fixed[0], exact[0], rtol=1e-4, atol=1e-7)  # layer 0: fp32 backward
    assert torch.equal(fixed[1], faulty[1])  # layer 1 still runs the faulty emulation


def test_state_dict_resumes_the_run_exactly() -> None:
    a = _tiny_run("fa_precision")
    for _ in range(3):
        a.step()
    saved = copy.deepcopy(a.state_dict())
    losses_a = [float(a.step()) for _ in range(4)]  # crosses fault_start = 4
    b = _tiny_run("fa_precision")
    b.load_state_dict(saved)
    losses_b = [float(b.step()) for _ in range(4)]
    assert losses_a == losses_b and b.step_index == 7 and b.fa_fault_active
    quiet = TestbedRun(a.config, record_monitors=False)
    quiet.step()
    assert quiet.last_samples is None
