"""benchmarks/gpu.py: its dry run (every measurement at tiny shapes on the CPU, through the
same code as on a GPU) writes the expected table, and without CUDA the plain command skips."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu.py"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )


def _rows(markdown: str) -> list[list[str]]:
    """The body rows of every markdown table, as lists of stripped cells."""
    rows = []
    for line in markdown.splitlines():
        if not line.startswith("|") or line.startswith("|---"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if cells[0] in ("shape", "run", "kernel", "loop", "op"):  # header rows
            continue
        rows.append(cells)
    return rows


def _number(text: str) -> float:
    return float(text.rstrip("x%"))


@pytest.fixture(scope="module")
def dry_run_table(tmp_path_factory: pytest.TempPathFactory) -> str:
    out = tmp_path_factory.mktemp("gpu") / "gpu.md"
    proc = _run("--dry-run", "--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert out.exists(), proc.stdout
    return out.read_text()


def test_dry_run_has_every_qk_row(dry_run_table: str) -> None:
    rows = [r for r in _rows(dry_run_table) if r[0].startswith("dry:")]
    paths = {(r[0], r[1]): r[2] for r in rows}
    shapes = {r[0] for r in rows}
    assert len(shapes) == 2, shapes
    expected = [
        "qk_monitor_spectra, layer by layer",
        "agent: compute_qk_samples, all layers and heads",
        "agent: snapshot copy, training thread",
        "agent: 4 controls of one layer",
        "agent: controls, all 2 layers",
    ]
    if importlib.util.find_spec("agent.monitors.batched") is not None:
        expected += [
            "qk_monitor_spectra_batched, method=qr",
            "qk_monitor_spectra_batched, method=gram",
        ]
    for shape in shapes:
        for path in expected:
            value = _number(paths[(shape, path)])
            assert math.isfinite(value) and value > 0, (shape, path, value)


def test_dry_run_has_training_and_attention_rows(dry_run_table: str) -> None:
    rows = {r[0]: r[1:] for r in _rows(dry_run_table) if not r[0].startswith("dry:")}
    for name in (
        "without the agent",
        "with the agent",
        "flash SDPA (torch)",
        "FP32 backward (remediations.attention)",
        "ratio FP32 / flash",
    ):
        value = _number(rows[name][0])
        assert math.isfinite(value) and value > 0, (name, value)
    assert math.isfinite(_number(rows["overhead (whole-run wall time)"][0]))
    assert "found by the agent" in dry_run_table
    assert "2 attention layers and 1 router(s)" in dry_run_table  # discovery saw the model
    # the model's attention goes through the switch's wrapper: the agent's audit is timed too
    assert "the kernel audit every 50 steps" in dry_run_table
    assert "1 call(s) audited in the 3-step warm-up run" in dry_run_table
    # the sync count ran its loops (with and without the agent) and says why it counts nothing
    assert "Host-device synchronizations over 6 training steps" in dry_run_table
    assert "Not counted on a CPU" in dry_run_table
    # the linear-algebra table: every op timed on the host (the device column is empty)
    linalg = [
        r for r in _rows(dry_run_table) if r[0].startswith(("qr ", "gram ", "svdvals", "eig"))
    ]
    assert {r[2] for r in linalg} == {"float32", "float64"} and len(linalg) == 10
    assert all(r[3] == "-" and _number(r[4]) > 0 for r in linalg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA the plain command benchmarks")
def test_without_cuda_it_skips_cleanly(tmp_path: Path) -> None:
    out = tmp_path / "gpu.md"
    proc = _run("--out", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "no GPU found" in proc.stdout and "skipped" in proc.stdout
    assert not out.exists()


def test_dry_run_audits_the_sdpa_backends(dry_run_table: str) -> None:
    """The kernel audit's table: torch's CPU backends, round to nearest, audit to exactly 0
    and repeat their backward bit for bit; a backend without a CPU kernel (efficient, in
    torch 2.13) says so."""
    rows = [r for r in _rows(dry_run_table) if r[0] in ("flash", "efficient", "math")]
    assert [(r[0], r[1]) for r in rows] == [
        (b, d) for b in ("flash", "efficient", "math") for d in ("torch.bfloat16", "torch.float16")
    ]
    served = [r for r in rows if r[2] != "not served"]
    assert {r[0] for r in served} >= {"flash", "math"}
    for _, _, asymmetry, gap, ms in served:
        assert _number(asymmetry) == 0.0 and _number(gap) == 0.0 and _number(ms) > 0
