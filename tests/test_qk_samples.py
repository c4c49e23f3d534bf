"""The agent's QK samples (``compute_qk_samples``) against dense float64 references: the
entropies of Delta_2 and Delta_3 and the persistence of Delta_2's top direction between two
evaluations, through the batched path (d >= 2 d_h) and the separate monitors (d < 2 d_h)."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from agent import samples as m
from agent.discovery import find_attention
from agent.monitors import spectrum_stats
from agent.probes import QKSnapshots, compute_qk_samples, qk_chunk_size


class _Attention(nn.Module):
    def __init__(self, d: int, heads: int, dh: int) -> None:
        super().__init__()
        self.num_heads, self.num_key_value_heads, self.head_dim = heads, heads, dh
        self.q_proj = nn.Linear(d, heads * dh, bias=False, dtype=torch.float64)
        self.k_proj = nn.Linear(d, heads * dh, bias=False, dtype=torch.float64)


def _dense(wq0, wk0, wq1, wk1, order):  # (d, d_h) each -> singular values of the d x d matrix
    dq, dk = wq1 - wq0, wk1 - wk0
    mat = dq @ dk.T if order == 3 else dq @ wk0.T + wq0 @ dk.T
    return torch.linalg.svdvals(mat)


def _top_left(wq0, wk0, wq1, wk1):
    dq, dk = wq1 - wq0, wk1 - wk0
    u, _, _ = torch.linalg.svd(dq @ wk0.T + wq0 @ dk.T)
    return u[:, 0]


@pytest.mark.parametrize(("d", "heads", "dh"), [(24, 3, 4), (6, 2, 4)])
def test_samples_match_dense_references_and_persistence(d: int, heads: int, dh: int) -> None:
    torch.manual_seed(0)
    model = nn.Module()
    model.attn = _Attention(d, heads, dh)
    (site,) = find_attention(model)
    snaps = QKSnapshots([site], delta=1)
    factors = []
    samples = []
    for step in range(3):
        snapshot = {name: p.detach().double().clone() for name, p in model.named_parameters()}
        factors.append(site.factors(snapshot, list(range(heads))))
        for job in snaps.on_step(step):
            samples += compute_qk_samples(job)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-2 * torch.randn_like(p))
    by = {
        (s.step, s.metric, dict(s.labels)["head"]): s.value
        for s in samples
        if "head" in dict(s.labels)
    }
    for step in (1, 2):
        (wq0, wk0), (wq1, wk1) = factors[step - 1], factors[step]
        for h in range(heads):
            for order, metric in ((2, m.QK_DELTA2_ENTROPY), (3, m.QK_DELTA3_ENTROPY)):
                ref = _dense(wq0[h], wk0[h], wq1[h], wk1[h], order)
                want = float(spectrum_stats(ref, shape=(d, d)).entropy)
                assert by[(step, metric, str(h))] == pytest.approx(
                    want, rel=2e-5, abs=1e-6
                )  # fp32 snapshots
    for h in range(heads):  # persistence: |cos| of the top directions of steps 1 and 2
        u1 = _top_left(*(f[h] for f in factors[0]), *(f[h] for f in factors[1]))
        u2 = _top_left(*(f[h] for f in factors[1]), *(f[h] for f in factors[2]))
        assert by[(2, m.QK_DELTA2_PERSISTENCE, str(h))] == pytest.approx(
            abs(float(u1 @ u2)), abs=2e-5
        )
        assert (1, m.QK_DELTA2_PERSISTENCE, str(h)) not in by  # first evaluation: none
    assert all(math.isfinite(v) for v in by.values())


def test_chunk_size() -> None:
    assert qk_chunk_size(torch.zeros(5, 64, 16)) == 5  # small d: every head in one call
    assert qk_chunk_size(torch.zeros(5, 4096, 128)) == 1  # large d: one head at a time
    meta = torch.device("meta")  # a non-CPU device without memory: no padding beyond n heads
    assert qk_chunk_size(torch.zeros(8, 1024, 128, device=meta)) == 8
    assert qk_chunk_size(torch.zeros(96, 1024, 128, device=meta)) == 32


@pytest.mark.parametrize(
    ("shape", "measured"), [((40, 30), (8, 30)), ((40, 6), (40, 6)), ((12, 50), (8, 50))]
)
def test_large_controls_are_measured_on_their_first_rows(shape, measured) -> None:
    """``qk.control_rows``: a control with both dimensions above it is measured on its first
    rows (the update entropy and relative size of exactly that block); a thin one whole."""
    torch.manual_seed(1)
    model = nn.Module()
    model.attn = _Attention(24, 3, 4)
    model.attn.v_proj = nn.Linear(shape[1], shape[0], bias=False, dtype=torch.float64)
    (site,) = find_attention(model)
    controls = {"attn.v_proj.weight": model.attn.v_proj.weight}
    snaps = QKSnapshots([site], delta=1, controls={site.name: controls}, control_rows=8)
    w0 = model.attn.v_proj.weight.detach().clone()
    assert snaps.on_step(0) == []
    with torch.no_grad():
        model.attn.v_proj.weight.add_(1e-2 * torch.randn(shape, dtype=torch.float64))
    w1 = model.attn.v_proj.weight.detach().clone()
    (job,) = snaps.on_step(1)
    assert tuple(job.current["attn.v_proj.weight"].shape) == measured  # only that is copied
    got = {s.metric: s.value for s in compute_qk_samples(job) if dict(s.labels).get("param")}
    rows = measured[0]
    diff = (w1 - w0)[:rows]
    ref = spectrum_stats(torch.linalg.svdvals(diff), shape=measured)
    assert got[m.CONTROL_UPDATE_ENTROPY] == pytest.approx(float(ref.entropy), rel=2e-5)
    size = float(torch.linalg.matrix_norm(diff) / torch.linalg.matrix_norm(w0[:rows]))
    assert got[m.CONTROL_UPDATE_REL_NORM] == pytest.approx(size, rel=2e-5)


def test_controls_of_different_shapes_in_one_job_each_get_their_own_values() -> None:
    """The controls of a job are summarized together (their spectra padded to one width, one
    statistics call): each still gets the entropy and relative size of its own update."""
    torch.manual_seed(4)
    model = nn.Module()
    model.attn = _Attention(24, 3, 4)
    shapes = {"v_proj": (40, 30), "o_proj": (40, 6), "w_proj": (12, 50)}
    for name, (rows, cols) in shapes.items():
        setattr(model.attn, name, nn.Linear(cols, rows, bias=False, dtype=torch.float64))
    (site,) = find_attention(model)
    controls = {f"attn.{name}.weight": getattr(model.attn, name).weight for name in shapes}
    snaps = QKSnapshots([site], delta=1, controls={site.name: controls}, control_rows=8)
    before = {name: w.detach().clone() for name, w in controls.items()}
    assert snaps.on_step(0) == []
    with torch.no_grad():
        for w in controls.values():
            w.add_(1e-2 * torch.randn_like(w))
    (job,) = snaps.on_step(1)
    got = {
        (dict(s.labels)["param"], s.metric): s.value
        for s in compute_qk_samples(job)
        if "param" in dict(s.labels)
    }
    for name, w in controls.items():
        rows = 8 if min(w.shape) > 8 else w.shape[0]
        w0, diff = before[name][:rows], (w.detach() - before[name])[:rows]
        ref = spectrum_stats(torch.linalg.svdvals(diff), shape=tuple(diff.shape))
        entropy = got[(name, m.CONTROL_UPDATE_ENTROPY)]
        assert entropy == pytest.approx(float(ref.entropy), rel=2e-5), name
        size = float(torch.linalg.matrix_norm(diff) / torch.linalg.matrix_norm(w0))
        assert got[(name, m.CONTROL_UPDATE_REL_NORM)] == pytest.approx(size, rel=2e-5), name


def test_snapshot_buffers_are_reused_once_their_jobs_finished() -> None:
    """After a warm-up, a snapshot is a copy into a buffer a finished job gave back: the same
    storage, never one still read by a job or kept as a layer's previous snapshot."""
    torch.manual_seed(2)
    model = nn.Module()
    model.attn = _Attention(24, 3, 4)
    (site,) = find_attention(model)
    snaps = QKSnapshots([site], delta=1)
    pointers: list[set[int]] = []
    for step in range(6):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1e-2 * torch.randn_like(p))
        jobs = snaps.on_step(step)
        held = {t.data_ptr() for snap in snaps._previous.values() for t in snap.values()}
        for job in jobs:
            live = {t.data_ptr() for t in job.current.values()}
            assert not live & {t.data_ptr() for t in job.previous.values()}
            compute_qk_samples(job)
            snaps.buffers.finished(job)
        pointers.append(held)
    # two snapshots alive at a time (previous and current): two buffers per parameter in turn
    assert pointers[2] == pointers[4] and pointers[3] == pointers[5]
    assert pointers[2] != pointers[3]
