"""Exact Causal Attention products vs the plain matmul they replace.

Times ``eca_masked_matmul(a, b)`` against ``torch.matmul(a, b^T).tril_()`` (Stage I) and ``eca_tril_matmul(p,
v)`` against ``torch.matmul(p, v)`` with a lower-triangular ``p`` (Stage II), float32, on the CPU and, when
one is present, on the GPU; prints the time ratios next to the multiply-add ratios and appends to
``logs/benchmarks/eca.csv`` (``--out`` another directory; the ``device`` and ``threads`` columns tell runs
apart). Times: median wall time of synchronised calls after a warm-up.

    OMP_NUM_THREADS=1 python -m benchmarks.eca                    # the sweep on CPU (+ CUDA when available)
    python -m benchmarks.eca --devices cuda --depths 1 2          # a chosen device and depths
    python -m benchmarks.eca --devices cpu --lengths 2048 --dims 512   # one point of the sweep

Multiply-adds: ``L^2 d`` for ``matmul`` (+ ``tril_``), ``eca_multiply_adds(L, d, depth)`` for ECA
(~0.458 ``L^2 d`` at depth 1, ~0.447 ``L^2 d`` at depth 2).
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import Results, add_out_dir, columns, relerr, run_info, wall_ms


@dataclass(frozen=True)
class Case:
    op: str  # "masked" (Stage I) or "tril" (Stage II)
    length: int
    d: int


# The sweep: every (op, L, d); depths and devices come from the command line.
SWEEP = tuple(
    Case(op, length, d) for op in ("masked", "tril") for length in (512, 1024, 2048) for d in (64, 128, 512))
COLUMNS = columns("op", "L", "d", "depth", "dtype", "baseline_ms", "eca_ms", "time_ratio", "baseline_madds",
                  "eca_madds", "madd_ratio", "reps", "threads", "load_avg_1min")


def run_case(case: Case, depth: int, device: torch.device, reps: int) -> dict:
    from elsa_vision.kernels.eca import eca_masked_matmul, eca_multiply_adds, eca_tril_matmul

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
    err = relerr(eca(), baseline())
    if not err < 1e-4:
        raise RuntimeError(f"ECA {case} depth={depth} disagrees with the baseline: relative error {err:.2e}")
    base_ms = wall_ms(baseline, device, reps=reps)
    eca_ms = wall_ms(eca, device, reps=reps)
    base_madds = case.length * case.length * case.d
    eca_madds = eca_multiply_adds(case.length, case.d, depth)
    return {
        "op": case.op, "L": case.length, "d": case.d, "depth": depth, "dtype": "float32",
        "baseline_ms": f"{base_ms:.3f}", "eca_ms": f"{eca_ms:.3f}", "time_ratio": f"{eca_ms / base_ms:.3f}",
        "baseline_madds": base_madds, "eca_madds": eca_madds, "madd_ratio": f"{eca_madds / base_madds:.4f}",
        "reps": reps, "threads": torch.get_num_threads(),
        "load_avg_1min": f"{os.getloadavg()[0]:.2f}",
    }


def main(argv: list[str] | None = None) -> list[Path]:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", nargs="+", default=["cpu", "cuda"],
                        help="devices to time; cuda is skipped when no GPU is present")
    parser.add_argument("--depths", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--lengths", nargs="+", type=int, default=None, help="restrict the sweep to these L")
    parser.add_argument("--dims", nargs="+", type=int, default=None, help="restrict the sweep to these d")
    parser.add_argument("--reps", type=int, default=5, help="timed repetitions per point (median reported)")
    add_out_dir(parser)
    args = parser.parse_args(argv)

    written = []
    for name in args.devices:
        if name == "cuda" and not torch.cuda.is_available():
            print("cuda: no GPU present, skipped")
            continue
        device = torch.device(name)
        print(f"{name}: torch {torch.__version__}, threads {torch.get_num_threads()}, "
              f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}")
        print(f"{'op':>7} {'L':>5} {'d':>4} {'depth':>5} {'baseline ms':>12} {'eca ms':>9} "
              f"{'time ratio':>10} {'madd ratio':>10}")
        meta = run_info(device, __file__, argv)
        # appended: runs of one device with other thread counts or depths land in the same file
        with Results(args.out / "eca.csv", COLUMNS, meta, append=True) as out, torch.no_grad():
            for case in SWEEP:
                if args.lengths and case.length not in args.lengths:
                    continue
                if args.dims and case.d not in args.dims:
                    continue
                for depth in args.depths:
                    row = out.write(run_case(case, depth, device, args.reps))
                    print(f"{row['op']:>7} {row['L']:>5} {row['d']:>4} {depth:>5} {row['baseline_ms']:>12} "
                          f"{row['eca_ms']:>9} {row['time_ratio']:>10} {row['madd_ratio']:>10}", flush=True)
        print(f"wrote {out.path}")
        written.append(out.path)
    return written


if __name__ == "__main__":
    main()
