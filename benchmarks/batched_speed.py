"""Batched QK monitor spectra: qr vs gram vs head by head, time and accuracy (issue #17 item 1).

Run: python benchmarks/batched_speed.py [--device cuda] [--out benchmarks/results/batched_speed.md]

Two layer shapes, d = 1024, d_h = 128 x 16 heads and d = 4096, d_h = 128 x 8 heads, float32
factors. Methods: the existing ``qk_monitor_spectra`` (head by head on a CPU), and
``qk_monitor_spectra_batched`` with ``method="qr"``, ``"gram"`` (float32 Grams) and ``"gram"``
with ``gram_dtype=float64``, each with one chunk of all heads and with chunks of one head.
Speed: median wall time per call (one torch thread on a CPU; synchronized on CUDA), shown per
head. Accuracy: the statistics the probe computes (``spectrum_stats`` with shape=(d, d), alpha
= 2) from the float32 result, against those of ``qk_monitor_spectra`` on the same factors in
float64 (exact to ~1e-15; tests/test_monitors_spectrum.py checks it against dense SVDs), for
update scenarios from "healthy" (full rank, 1e-3 of W) to "small LR, collapsing" (1e-6, low
rank); "rank 4 exactly" is the worst case for a Gram (Delta_2 of rank 8, every other value
zero: the Gram's noise floor, about sqrt(eps32) * s_max, is not).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

import torch
from provenance import provenance
from timing import median_seconds

from agent.monitors import qk_monitor_spectra, qk_monitor_spectra_batched, spectrum_stats

WQ_NORM = "spectral norm of W_q'"
SHAPES = [(1024, 128, 16), (4096, 128, 8)]  # (d, d_h, heads)
SCENARIOS = {
    # name: (update scale relative to W, rank of the update or None for full rank, noise
    # added to a low-rank update relative to it, decaying W spectrum)
    "full 1e-3": (1e-3, None, 0.0, False),
    "full 1e-6": (1e-6, None, 0.0, False),
    "rank 4 (+1% noise) 1e-6": (1e-6, 4, 1e-2, False),
    "rank 4 exactly, 1e-6": (1e-6, 4, 0.0, False),
    "decaying W, full 1e-6": (1e-6, None, 0.0, True),
}


def _factors(heads: int, d: int, dh: int, scenario: str, device: torch.device, seed: int = 0):
    """float32 (wq_prev, wk_prev, wq, wk), each (heads, d, dh), W of spectral norm ~1."""
    scale, rank, noise_level, decaying = SCENARIOS[scenario]
    g = torch.Generator(device="cpu").manual_seed(seed)

    def weight() -> torch.Tensor:
        w = torch.randn(heads, d, dh, generator=g, dtype=torch.float64) / d**0.5
        if not decaying:
            return w
        u, _, vh = torch.linalg.svd(w, full_matrices=False)
        s = torch.logspace(0, -3, dh, dtype=torch.float64)  # singular values 1 .. 1e-3
        return u * s.unsqueeze(-2) @ vh

    def update() -> torch.Tensor:
        noise = torch.randn(heads, d, dh, generator=g, dtype=torch.float64) / d**0.5
        if rank is None:
            return scale * noise
        left = torch.randn(heads, d, rank, generator=g, dtype=torch.float64) / d**0.5
        right = torch.randn(heads, rank, dh, generator=g, dtype=torch.float64) / rank**0.5
        return scale * (left @ right + noise_level * noise)

    wq, wk = weight(), weight()
    factors = [wq, wk, wq + update(), wk + update()]
    return [t.float().to(device) for t in factors]


def _methods(heads: int) -> dict[str, Callable[..., object]]:
    def batched(chunk: int, method: str, gram_dtype=None):
        return lambda *f: qk_monitor_spectra_batched(
            *f, chunk_size=chunk, method=method, gram_dtype=gram_dtype
        )

    return {
        "qk_monitor_spectra (head by head on a CPU)": qk_monitor_spectra,
        f"qr, chunk {heads}": batched(heads, "qr"),
        "qr, chunk 1": batched(1, "qr"),
        f"gram fp32, chunk {heads}": batched(heads, "gram"),
        "gram fp32, chunk 1": batched(1, "gram"),
        f"gram fp64 Gram, chunk {heads}": batched(heads, "gram", torch.float64),
    }


def _stats(spectra, d: int, dh: int) -> dict[str, torch.Tensor]:
    """The probe's statistics of one result, as float64 tensors (heads,)."""
    out = {}
    for name in ("delta1", "delta2", "delta3", "dwq", "dwk"):
        shape = (d, d) if name.startswith("delta") else (d, dh)
        stats = spectrum_stats(getattr(spectra, name), shape=shape)
        out[f"H({name})"] = stats.entropy.double().cpu()
        if name == "delta2":
            out["srank(delta2)"] = stats.stable_rank.double().cpu()
            out["fro(delta2)"] = stats.frobenius.double().cpu()
    out[WQ_NORM] = spectra.wq_norm.double().cpu()
    return out


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float(((ours - ref).abs() / ref.abs()).max())


def run(device: torch.device, repeats: int) -> list[str]:
    speed = [
        f"Speed on {device.type}, float32 factors: wall time per head (median of {repeats} "
        "calls of a whole layer).",
        "",
        "| d | d_h | heads | method | ms / head | vs qk_monitor_spectra |",
        "|---|---|---|---|---|---|",
    ]
    accuracy = [
        "",
        "Accuracy: max over heads of the relative error of each statistic (spectrum_stats, "
        "alpha = 2, shape = (d, d)) from the float32 result vs float64. 'other H' is the worst "
        "of H(Delta_1), H(Delta_3), H(dW_q), H(dW_k).",
        "",
        "| d | scenario | method | H(Delta_2) | other H | stable rank(Delta_2) | "
        "Frobenius(Delta_2) | spectral norm W_q' |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for d, dh, heads in SHAPES:
        methods = _methods(heads)
        factors = _factors(heads, d, dh, "full 1e-3", device)
        base = None
        for name, fn in methods.items():
            seconds = median_seconds(lambda fn=fn, f=factors: fn(*f), repeats, device)
            base = seconds if base is None else base
            speed.append(
                f"| {d} | {dh} | {heads} | {name} | {1e3 * seconds / heads:.2f} | "
                f"{seconds / base:.2f}x |"
            )
            print(speed[-1], flush=True)
        for scenario in SCENARIOS:
            factors = _factors(heads, d, dh, scenario, device, seed=1)
            ref = _stats(qk_monitor_spectra(*(t.double() for t in factors)), d, dh)
            for name, fn in methods.items():
                if name.endswith("chunk 1"):  # same arithmetic as the whole-layer chunk
                    continue
                ours = _stats(fn(*factors), d, dh)
                other = max(
                    _rel(ours[k], ref[k]) for k in ref if k.startswith("H(") and k != "H(delta2)"
                )
                accuracy.append(
                    f"| {d} | {scenario} | {name} | {_rel(ours['H(delta2)'], ref['H(delta2)']):.1e}"
                    f" | {other:.1e} | {_rel(ours['srank(delta2)'], ref['srank(delta2)']):.1e} | "
                    f"{_rel(ours['fro(delta2)'], ref['fro(delta2)']):.1e} | "
                    f"{_rel(ours[WQ_NORM], ref[WQ_NORM]):.1e} |"
                )
                print(accuracy[-1], flush=True)
    return speed + accuracy


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per method")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: stable on a shared machine)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    header = provenance()
    print("\n".join(header), flush=True)
    rows = run(device, args.repeats)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(header + rows) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
