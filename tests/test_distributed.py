"""One agent per rank under DDP, FSDP2 and tensor parallelism, on 2 and 4 ranks (gloo,
file:// rendezvous, spawned processes): one decision for the whole job, the monitor work
spread over the ranks, sharded rollback with torch.distributed.checkpoint, pages from rank 0
naming the ranks involved, a hung rank named by the watchdog, a killed rank failing the job
cleanly. What each rank runs is in tests/distributed_worker.py."""

from __future__ import annotations

import json
import multiprocessing
import os
from pathlib import Path

import distributed_worker as worker
import pytest
import torch.multiprocessing as mp

from agent.distributed.checkpoint_format import MANIFEST, read_manifest, verify_file

DDP = ["fault:ddp:spike", "fault:ddp:nan", "fault:ddp:raise", "fault:ddp:stall", "audit:ddp"]
SHARDED = [
    "fault:fsdp:spike", "fault:tp:spike", "fetch:gqa", "fetch:mqa", "fetch:tp", "audit:fsdp",
    "audit:tp",
]  # fmt: skip
FOUR = ["fault:ddp:spike", "fault:fsdp:spike"]
QK_METRICS = ("qk_delta2_entropy", "dwq_entropy", "wq_spectral_norm")


def _spawn(tmp: Path, world: int, scenarios: list[str]) -> dict[str, list[dict]]:
    mp.spawn(
        worker.main, args=(world, f"file://{tmp}/rendezvous", str(tmp), scenarios), nprocs=world
    )
    return {
        s: [json.loads((tmp / f"{s}.rank{r}.json").read_text()) for r in range(world)]
        for s in scenarios
    }


@pytest.fixture(scope="module")
def ddp(tmp_path_factory) -> dict[str, list[dict]]:
    return _spawn(tmp_path_factory.mktemp("ddp"), 2, DDP)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> dict[str, list[dict]]:
    """FSDP2 and tensor-parallel runs."""
    return _spawn(tmp_path_factory.mktemp("sharded"), 2, SHARDED)


@pytest.fixture(scope="module")
def four(tmp_path_factory) -> dict[str, list[dict]]:
    """DDP and FSDP2 on 4 ranks."""
    return _spawn(tmp_path_factory.mktemp("four"), 4, FOUR)


def _samples(result: dict) -> dict[tuple, float]:
    """(step, metric, labels without DDP's "module." prefix) -> value, from the metrics log."""
    out = {}
    for record in result["metrics"]:
        for step, metric, labels, value in record:
            key = tuple(sorted((k, v.replace("module.", "")) for k, v in labels.items()))
            out[(step, metric, key)] = value
    return out


def _same_everywhere(ranks: list[dict], *keys: str) -> None:
    for key in keys:
        assert all(r[key] == ranks[0][key] for r in ranks), key


def _without_watchdog(ranks: list[dict]) -> list[dict]:
    """The ranks' results without rank 0's watchdog (``hung_run``): it is rank 0's alone, and
    several processes on a loaded 2-core machine can lag seconds behind each other (a full
    test run under load once saw a one-rank hung_run alert here)."""
    for r in ranks:
        r["alerts"] = [a for a in r["alerts"] if a[1] != "hung_run"]
        r["pages"] = [p for p in r["pages"] if not p[1].startswith("run-hung")]
    return ranks


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "tp"])
def test_a_loss_spike_on_one_rank_gives_one_decision_on_every_rank(wrap, ddp, sharded):
    """Rank 1 alone reports a 20x loss at step 23: the mean over the ranks crosses the rule's
    level, so every rank rolls back at step 25 (to the checkpoint of step 20, onset 23 -
    margin 3: torch.distributed.checkpoint, each rank's data position) and then lowers the
    LR, at the same steps, ending with the same parameters and learning rates; only rank 0
    pages, naming rank 1's loss."""
    ranks = _without_watchdog((ddp if wrap == "ddp" else sharded)[f"fault:{wrap}:spike"])
    _same_everywhere(ranks, "moves", "actions", "alerts", "metrics", "params", "lr")
    assert ranks[0]["moves"] == [[25, 21]]  # and the restored weights are step 20's (worker)
    assert ranks[0]["actions"] == [["rollback", "applied", 25], ["lower_lr", "applied", 20]]
    no_fault = ddp["fault:ddp:stall"][0]["lr"]
    assert ranks[0]["lr"] == pytest.approx([no_fault[0] / 2], rel=1e-12)
    pages = ranks[0]["pages"]
    assert [p[0] for p in pages] == ["opened", "action", "action", "resolved"]
    assert pages[0][2].startswith("local loss over steps 21-25: rank 1 19.9")
    assert ranks[1]["pages"] == []
    assert ranks[0]["checkpoints"] == [
        "ckpt-0.dcp", "ckpt-0.dcp.json", "ckpt-20.dcp", "ckpt-20.dcp.json",
        "ckpt-30.dcp", "ckpt-30.dcp.json",
    ]  # fmt: skip


@pytest.mark.parametrize("wrap", ["ddp", "fsdp"])
def test_four_ranks_take_one_decision_and_split_the_qk_work_in_four(wrap, four):
    """The same spike on rank 1 of 4 (the mean of the local losses still crosses 20): every
    rank rolls back at step 25 and lowers the LR, ending with the same parameters and
    learning rates; rank 0 pages naming all four ranks' losses, rank 1's first; each rank
    measures one head of each layer (2 of the 8), all 8 measured once per evaluation."""
    ranks = _without_watchdog(four[f"fault:{wrap}:spike"])
    _same_everywhere(ranks, "moves", "actions", "alerts", "metrics", "params", "lr")
    assert ranks[0]["moves"] == [[25, 21]]
    assert ranks[0]["actions"] == [["rollback", "applied", 25], ["lower_lr", "applied", 20]]
    assert len(ranks[0]["lr"]) == 1 and ranks[0]["lr"] == ranks[3]["lr"]
    pages = ranks[0]["pages"]
    assert [p[0] for p in pages] == ["opened", "action", "action", "resolved"]
    assert pages[0][2].startswith("local loss over steps 21-25: rank 1 19.9")
    assert all(f"rank {r} 4." in pages[0][2] for r in (0, 2, 3))
    assert all(r["pages"] == [] for r in ranks[1:])
    assert ranks[0]["checkpoints"][-2:] == ["ckpt-30.dcp", "ckpt-30.dcp.json"]
    by_rank = [{(s, layer, h) for s, layer, heads in r["measured"] for h in heads} for r in ranks]
    steps = {s for s, _, _ in ranks[0]["measured"] if s <= 30}  # 35's: cut short by close()
    assert steps == {5, 10, 15, 20, 25, 30}
    for step in steps:
        heads = [{(layer, h) for s, layer, h in mine if s == step} for mine in by_rank]
        assert [len(h) for h in heads] == [2, 2, 2, 2], step  # one head of each of 2 layers
        assert len(set().union(*heads)) == 8
    qk = {k[2] for k in _samples(ranks[0]) if k[1] == "qk_delta2_entropy" and k[0] == 10}
    assert len(qk) == 8  # gathered from all four ranks


def test_fsdp_on_four_ranks_measures_exactly_what_ddp_measures(four):
    """4 ranks: the FSDP2 run's q_proj shards hold one head each and k_proj's KV heads
    straddle two shards (round robin, rows sent point to point); its samples equal the DDP
    run's up to the rollback, to rounding: over 4 ranks DDP's all-reduce and FSDP2's
    reduce-scatter sum the gradients in different orders, so the weights differ in the last
    bits from step 1 (measured: at most 2.4e-6 relative); over 2 ranks they agree bit for
    bit (test_fsdp_measures_exactly_what_ddp_measures)."""
    a = _samples(four["fault:ddp:spike"][0])
    b = _samples(four["fault:fsdp:spike"][0])
    early = [k for k in a if k[0] <= 20]
    assert len(early) > 300 and set(early) <= set(b)
    assert [b[k] for k in early] == pytest.approx([a[k] for k in early], rel=1e-4, abs=1e-7)


def test_fsdp_measures_exactly_what_ddp_measures(ddp, sharded):
    """Same model, same batches: every sample of the FSDP2 run (each rank holding only its
    heads' rows of the sharded weights) equals the DDP run's, bit for bit, up to the
    rollback; the router weight statistics of the sharded routers included. The agent's own
    grad norm (the loop passes none) to rounding: each rank's share of the squares sums over
    its shards in FSDP2 and over the whole replica in DDP, in other orders."""
    a, b = _samples(ddp["fault:ddp:spike"][0]), _samples(sharded["fault:fsdp:spike"][0])
    early = [k for k in a if k[0] <= 20]
    assert len(early) > 300
    assert {k[1] for k in early} >= {
        "router_eps",
        "router_update_rel_norm",
        "qk_delta2_entropy",
        "control_update_entropy",
        "grad_norm",
    }
    norms = [k for k in early if k[1] == "grad_norm"]
    assert [k[0] for k in norms] == [0, 5, 10, 15, 20] and all(a[k] > 0 for k in norms)
    assert [b[k] for k in norms] == pytest.approx([a[k] for k in norms], rel=1e-6)
    assert all(a[k] == b[k] for k in early if k[1] != "grad_norm")


@pytest.mark.parametrize(
    ("layout", "owners", "k_rows"),
    [
        ("gqa", [[0, 0, 1, 1]] * 2, 8),  # FSDP2 shards on head boundaries: local heads
        ("mqa", [None, None], 8),  # the one KV head on both ranks: round robin, sent
        ("tp", [[0, 0, 1, 1]] * 2, 8),  # column-parallel heads: each rank its own
    ],
)
def test_a_rank_holds_and_measures_only_its_heads_of_a_sharded_weight(
    sharded, layout, owners, k_rows
):
    """Each rank's snapshot holds exactly the full weight's rows of its heads (half of
    q_proj's 32 rows, its KV heads' rows of k_proj), and the monitors measure on them what
    they measure on the full weights; the control matrices of the layer a rank owns come
    whole (o_proj row-parallel under TP: its columns from both ranks)."""
    ranks = sharded[f"fetch:{layout}"]
    measured = [set(map(tuple, r["measured"])) for r in ranks]
    assert not measured[0] & measured[1] and len(measured[0] | measured[1]) == 8
    for rank, result in enumerate(ranks):
        assert result["mismatches"] == [] and result["same_samples"] and result["jobs"] == 2
        assert result["owners"] == owners
        held = result["rows_held"]
        assert held["blocks.0.attn.q_proj.weight"] == held["blocks.1.attn.q_proj.weight"] == 16
        assert held["blocks.0.attn.k_proj.weight"] == k_rows
        assert held[f"blocks.{rank}.attn.o_proj.weight"] == 32  # this rank's layer: whole
        assert f"blocks.{1 - rank}.attn.o_proj.weight" not in held


def test_the_qk_work_is_split_over_the_ranks(ddp):
    """Each rank measures half of each layer's heads; together all of them, once."""
    ranks = ddp["fault:ddp:spike"]
    by_rank = [{(s, layer, h) for s, layer, heads in r["measured"] for h in heads} for r in ranks]
    assert not by_rank[0] & by_rank[1]
    evaluated = {(s, layer) for s, layer, _ in ranks[0]["measured"]} & {
        (s, layer) for s, layer, _ in ranks[1]["measured"]
    }
    for s, layer in evaluated:
        assert {h for r in by_rank for (s2, l2, h) in r if (s2, l2) == (s, layer)} == {0, 1, 2, 3}
        assert len([h for (s2, l2, h) in by_rank[0] if (s2, l2) == (s, layer)]) == 2
    heads = {k[2] for k in _samples(ranks[0]) if k[1] == "qk_delta2_entropy" and k[0] == 10}
    assert len(heads) == 8  # 2 layers x 4 heads, gathered from both ranks


def test_a_non_finite_loss_on_one_rank_rolls_every_rank_back(ddp):
    ranks = ddp["fault:ddp:nan"]
    _same_everywhere(ranks, "moves", "actions", "alerts", "metrics", "params", "lr")
    assert ranks[0]["moves"] == [[25, 21]]
    assert ranks[0]["actions"] == [["rollback", "applied", 25]]
    assert ranks[0]["alerts"][1][:3] == [25, "loss_nonfinite", "pending->firing"]
    assert ranks[0]["pages"][0][2].startswith("non-finite loss on rank 1; local loss over")


def test_a_monitor_that_raises_on_one_rank_leaves_its_heads_out_everywhere(ddp):
    """Rank 1's QK job of step 15 raises: at the apply step (17) both ranks get rank 0's heads
    only, and carry on identically; rank 1 logs the error, rank 0 names rank 1."""
    ranks = ddp["fault:ddp:raise"]
    _same_everywhere(ranks, "moves", "actions", "alerts", "metrics", "params")
    samples = _samples(ranks[0])
    heads = {(k[2]) for k in samples if k[0] == 15 and k[1] == "qk_delta2_entropy"}
    assert heads == {
        (("head", "0"), ("layer", "blocks.0.attn")),
        (("head", "2"), ("layer", "blocks.0.attn")),
        (("head", "0"), ("layer", "blocks.1.attn")),
        (("head", "2"), ("layer", "blocks.1.attn")),
    }  # rank 0's heads: (layer x 4 + head) % 2 == 0
    assert len({k[2] for k in samples if k[0] == 20 and k[1] == "qk_delta2_entropy"}) == 8
    assert ranks[1]["errors"] == [["qk monitor", "RuntimeError: monitor exploded on rank 1"]]
    assert [e[0] for e in ranks[0]["errors"]] == ["rank 1"]


def test_the_watchdog_names_a_rank_that_stops_stepping(ddp):
    """Rank 1 sleeps 4 s before reporting step 23 while rank 0 waits in the next step:
    rank 0's watchdog sees rank 1 behind and pages hung_run for rank 1 (not for itself), and
    resolves it when rank 1 is back; the watchdog never touches the shared decisions."""
    ranks = ddp["fault:ddp:stall"]
    _same_everywhere(ranks, "moves", "actions", "metrics", "params", "lr")
    hung = [a for a in ranks[0]["alerts"] if a[1] == "hung_run"]
    assert [a[2] for a in hung] == ["inactive->pending", "pending->firing", "firing->inactive"]
    assert all(a[3] == {"rank": "1"} for a in hung)
    assert [(p[0], p[3]) for p in ranks[0]["pages"]] == [
        ("opened", {"rank": "1"}),
        ("resolved", {"rank": "1"}),
    ]
    assert ranks[0]["pages"][0][1].startswith("run-hung1-s")
    assert ranks[1]["alerts"] == [] and ranks[1]["moves"] == []


@pytest.mark.parametrize("wrap", ["ddp", "fsdp", "tp"])
def test_a_kernel_that_rounds_one_way_on_one_rank_is_found_by_every_rank(wrap, ddp, sharded):
    """From step 12 rank 1's attention backward rounds dS toward -inf; rank 0's is exact.
    Every rank audits its own calls (every 5 steps, the layers in turn) and takes the largest
    value over the ranks: before the fault every audit is exactly 0; the first audit after it
    (armed at 15, measured at 16) is rank 1's bias on every rank, so every rank fires at 16,
    switches the attention backward to fp32, and the later audits (through the fp32
    backward) are 0 again. Rank 0 pages fa_precision once; the replicas stay identical."""
    ranks = (ddp if wrap == "ddp" else sharded)[f"audit:{wrap}"]
    _same_everywhere(ranks, "asymmetry", "alerts", "actions", "switched", "params")
    assert [r["kernel_audit"] for r in ranks] == ["on", "on"]
    assert all(r["errors"] == [] for r in ranks)
    series = ranks[0]["asymmetry"]
    layers = ["blocks.0.attn", "blocks.1.attn"]
    assert [(s, layer) for s, layer, _ in series] == [
        (1, layers[0]), (6, layers[1]), (11, layers[0]), (16, layers[1]), (21, layers[0]),
        (26, layers[1]),
    ]  # fmt: skip
    values = [v for _, _, v in series]
    assert values[:3] == [0.0, 0.0, 0.0] and values[4:] == [0.0, 0.0]
    assert values[3] > 1e-3  # 4-bit floor rounding of dS: about 3e-2 on the test bed
    assert ranks[0]["alerts"][:2] == [
        [16, "one_way_rounding", "inactive->pending"], [16, "one_way_rounding", "pending->firing"],
    ]  # fmt: skip
    assert ranks[0]["actions"][0] == ["attention_fp32_backward", "applied", 16]
    assert ranks[0]["switched"] == [True, []]
    assert [tuple(p) for p in ranks[0]["pages"]][:1] == [("opened", "fa_precision")]
    assert ranks[1]["pages"] == []


def test_a_killed_rank_fails_the_job_cleanly_and_leaves_nothing_that_counts(tmp_path):
    """Rank 1 dies during the step-20 checkpoint, after its shard was written: rank 0 stops
    with RankFailure within seconds; step 20 has no manifest (never counts), the committed
    checkpoints verify, and a new store removes the leftover."""
    ctx = multiprocessing.get_context("spawn")
    init = f"file://{tmp_path}/rendezvous"
    procs = [ctx.Process(target=worker.killed, args=(r, 2, init, str(tmp_path))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [0, 1]
    outcome = (tmp_path / "killed.rank0.txt").read_text()
    assert outcome.startswith("RankFailure: mechwatch: all_gather_object across 2 ranks failed")
    ckpt = tmp_path / "killed" / "ckpt"
    manifests = sorted(p.name for p in ckpt.iterdir() if MANIFEST.match(p.name))
    assert manifests == ["ckpt-0.dcp.json", "ckpt-10.dcp.json"]
    leftover = ckpt / "ckpt-20.dcp.tmp"
    assert {"rank-0.pt", "rank-1.pt", ".metadata"} <= set(os.listdir(leftover))
    for name in manifests:
        info, manifest = read_manifest(ckpt / name)
        for file, (sha256, size) in manifest["files"].items():
            verify_file(info.path / file, sha256, size)
    from agent.distributed import World
    from agent.distributed.checkpoints import DistributedCheckpointStore
    from agent.testbed.model import MoETransformer

    store = DistributedCheckpointStore(ckpt, world=World(0, 1), model=MoETransformer(worker.SHAPE))
    assert not leftover.exists() and [i.step for i in store.checkpoints()] == [10, 0]
