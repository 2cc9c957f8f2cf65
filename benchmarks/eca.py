"""Exact Causal Attention products vs the plain matmul they replace.

Times ``eca_masked_matmul(a, b)`` against ``torch.matmul(a, b^T).tril_()`` (Stage I) and
``eca_tril_matmul(p, v)`` against ``torch.matmul(p, v)`` with a lower-triangular ``p`` (Stage II), float32, on
the CPU and, when one is present, on the GPU; prints the time ratios next to the multiply-add ratios and
appends to ``logs/benchmarks/eca_<device>_<yyyymmdd>.csv`` (``--out`` another directory; one file per device
and day; the
``threads`` column tells runs apart).

    OMP_NUM_THREADS=1 python benchmarks/eca.py                    # the sweep on CPU (+ CUDA when available)
    python benchmarks/eca.py --devices cuda --depths 1 2          # a chosen device and depths
    python benchmarks/eca.py --devices cpu --lengths 2048 --dims 512   # one point of the sweep

Multiply-adds: ``L^2 d`` for ``matmul`` (+ ``tril_``), ``eca_multiply_adds(L, d, depth)`` for ECA
(~0.458 ``L^2 d`` at depth 1, ~0.447 ``L^2 d`` at depth 2).
"""

from __future__ import annotations

import argparse
import csv
import datetime as dt
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from elsa_vision.kernels.eca import eca_masked_matmul, eca_multiply_adds, eca_tril_matmul


@dataclass(frozen=True)
class Case:
    op: str  # "masked" (Stage I) or "tril" (Stage II)
    length: int
    d: int


# The sweep: every (op, L, d); depths and devices come from the command line.
SWEEP = tuple(
    Case(op, length, d) for op in ("masked", "tril") for length in (512, 1024, 2048) for d in (64, 128, 512))
FIELDS = ("device", "op", "L", "d", "depth", "dtype", "baseline_ms", "eca_ms", "time_ratio", "baseline_madds",
          "eca_madds", "madd_ratio", "reps", "threads", "torch", "load_avg_1min")


def _timer(device: torch.device):
    if device.type == "cuda":
        def sync():
            torch.cuda.synchronize(device)
    else:
        def sync():
            return None

    def measure(fn, reps: int) -> float:
        fn()  # warm-up (allocator, kernels, caches)
        sync()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e3

    return measure


def run_case(case: Case, depth: int, device: torch.device, reps: int, measure) -> dict:
    g = torch.Generator(device=device).manual_seed(case.length * 1000 + case.d)
    a = torch.randn(case.length, case.d, device=device, generator=g)
    b = torch.randn(case.length, case.d, device=device, generator=g)
    if case.op == "masked":
        baseline = lambda: torch.matmul(a, b.T).tril_()  # noqa: E731
        eca = lambda: eca_masked_matmul(a, b, depth=depth)  # noqa: E731
    else:
        p = torch.randn(case.length, case.length, device=device, generator=g).tril_()
        baseline = lambda: torch.matmul(p, b)  # noqa: E731
        eca = lambda: eca_tril_matmul(p, b, depth=depth)  # noqa: E731
    ref, out = baseline(), eca()
    err = ((out - ref).norm() / ref.norm()).item()
    if not err < 1e-4:
        raise RuntimeError(f"ECA {case} depth={depth} disagrees with the baseline: relative error {err:.2e}")
    base_ms, eca_ms = measure(baseline, reps), measure(eca, reps)
    base_madds = case.length * case.length * case.d
    eca_madds = eca_multiply_adds(case.length, case.d, depth)
    return {
        "device": device.type, "op": case.op, "L": case.length, "d": case.d, "depth": depth,
        "dtype": "float32",
        "baseline_ms": f"{base_ms:.3f}", "eca_ms": f"{eca_ms:.3f}", "time_ratio": f"{eca_ms / base_ms:.3f}",
        "baseline_madds": base_madds, "eca_madds": eca_madds, "madd_ratio": f"{eca_madds / base_madds:.4f}",
        "reps": reps, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "load_avg_1min": f"{os.getloadavg()[0]:.2f}",
    }


def main(argv: list[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"],
                        help="devices to time; cuda is skipped when no GPU is present")
    parser.add_argument("--depths", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--lengths", nargs="+", type=int, default=None, help="restrict the sweep to these L")
    parser.add_argument("--dims", nargs="+", type=int, default=None, help="restrict the sweep to these d")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median reported)")
    parser.add_argument("--out", type=Path, help="output directory (default logs/benchmarks)",
                        default=Path(__file__).resolve().parents[1] / "logs" / "benchmarks")
    args = parser.parse_args(argv)

    written = []
    stamp = dt.date.today().strftime("%Y%m%d")
    for name in args.devices:
        if name == "cuda" and not torch.cuda.is_available():
            print("cuda: no GPU present, skipped")
            continue
        device = torch.device(name)
        measure = _timer(device)
        print(f"{name}: torch {torch.__version__}, threads {torch.get_num_threads()}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        print(f"{'op':>7} {'L':>5} {'d':>4} {'depth':>5} {'baseline ms':>12} {'eca ms':>9} "
              f"{'time ratio':>10} {'madd ratio':>10}")
        rows = []
        with torch.no_grad():
            for case in SWEEP:
                if args.lengths and case.length not in args.lengths:
                    continue
                if args.dims and case.d not in args.dims:
                    continue
                for depth in args.depths:
                    row = run_case(case, depth, device, args.reps, measure)
                    rows.append(row)
                    print(f"{row['op']:>7} {row['L']:>5} {row['d']:>4} {depth:>5} {row['baseline_ms']:>12} "
                          f"{row['eca_ms']:>9} {row['time_ratio']:>10} {row['madd_ratio']:>10}", flush=True)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"eca_{name}_{stamp}.csv"
        fresh = not path.exists()
        with path.open("a", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=FIELDS)
            if fresh:
                writer.writeheader()
            writer.writerows(rows)
        print(f"wrote {path}")
        written.append(path)
    return written


if __name__ == "__main__":
    main()
