"""Compressed-core QK monitor vs a dense SVD: time, ratio and agreement (issue: math core).

Run: python benchmarks/monitor_speed.py [--out benchmarks/results/monitor_speed.md] [--quick]

For one head at d in {1024, 2048, 4096}, d_h in {64, 128}: the dense path materializes the
d x d matrix Delta_2 = dW_q W_k^T + W_q dW_k^T and takes its singular values; the core path
uses ``qk_increment_spectrum`` (two thin QRs and a 2 d_h x 2 d_h SVD). Then a whole layer of
32 heads batched through the core path. fp32 on CPU, and on CUDA when present. Prints the
ratios (dense / core, layer / one head) and the largest entropy difference.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from provenance import provenance

from agent.monitors import qk_increment_spectrum, spectrum_stats


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time(fn, device: torch.device, repeats: int) -> float:
    """Median wall time of ``fn`` in seconds, after one warm-up call."""
    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _factors(heads: int, d: int, dh: int, device: torch.device, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    wq = torch.randn(heads, d, dh, generator=g) / d**0.5
    wk = torch.randn(heads, d, dh, generator=g) / d**0.5
    dq = 1e-3 * torch.randn(heads, d, dh, generator=g) / d**0.5
    dk = 1e-3 * torch.randn(heads, d, dh, generator=g) / d**0.5
    return [t.to(device) for t in (wq, wk, wq + dq, wk + dk)]


def _dense_spectrum(wq0, wk0, wq1, wk1) -> torch.Tensor:
    delta2 = (wq1 - wq0) @ wk0.mT + wq0 @ (wk1 - wk0).mT  # (heads, d, d): what the core avoids
    return torch.linalg.svdvals(delta2)


def run(device: torch.device, dims: list[int], head_dims: list[int], layer_heads: int) -> list[str]:
    rows = [
        f"| device | d | d_h | dense SVD (s) | core (s) | dense / core | "
        f"layer of {layer_heads} heads (s) | layer / one head | max abs dH |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for d in dims:
        for dh in head_dims:
            one = _factors(1, d, dh, device)
            dense_s = _time(
                lambda one=one: _dense_spectrum(*one), device, repeats=1 if d >= 4096 else 3
            )
            core_s = _time(lambda one=one: qk_increment_spectrum(*one), device, repeats=5)
            h_dense = spectrum_stats(_dense_spectrum(*one), shape=(d, d)).entropy
            h_core = spectrum_stats(qk_increment_spectrum(*one), shape=(d, d)).entropy
            dh_err = float((h_dense - h_core).abs().max())
            layer = _factors(layer_heads, d, dh, device, seed=1)
            layer_s = _time(lambda layer=layer: qk_increment_spectrum(*layer), device, repeats=3)
            rows.append(
                f"| {device.type} | {d} | {dh} | {dense_s:.3f} | {core_s:.4f} | "
                f"{dense_s / core_s:.0f}x | {layer_s:.3f} | {layer_s / core_s:.1f}x | "
                f"{dh_err:.1e} |"
            )
            print(rows[-1], flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None, help="write the markdown table here")
    parser.add_argument("--quick", action="store_true", help="d in {1024, 2048} only")
    parser.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (1: stable on a shared machine)"
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    dims = [1024, 2048] if args.quick else [1024, 2048, 4096]
    header = provenance()
    print("\n".join(header), flush=True)
    rows = run(torch.device("cpu"), dims, [64, 128], layer_heads=32)
    if torch.cuda.is_available():
        rows += run(torch.device("cuda"), dims, [64, 128], layer_heads=32)[2:]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text("\n".join(header + rows) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
