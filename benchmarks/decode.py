"""Few-query (decode) attention benchmark: ELSA's stream-K path against PyTorch's attention backends.

One query row (a decode step) against a long key/value cache, ``B * H = 8`` heads, ``D = 128``::

    PYTHONPATH=$PWD python benchmarks/decode.py                       # GPU: Nk in {64K, 256K}, bf16 + fp32
    PYTHONPATH=$PWD python benchmarks/decode.py --nk 65536 --dtype bfloat16
    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/decode.py --device cpu --quick  # smoke run

Peers on the same inputs: ``sdpa_math``, ``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn``
(``torch.nn.attention.sdpa_kernel``), ``elsa_fwd`` (the regular two-level forward) and ``elsa_decode`` (the
stream-K path that ``backend="auto"`` takes for these shapes). A peer that cannot run a case (flash/cudnn in
float32, a backend missing on the device) is recorded with a note. One query sees the whole cache, so every
peer runs without a causal mask (SDPA's ``is_causal`` is top-left aligned and would hide all but key 0).

Times: GPU, the median of ``triton.testing.do_bench``; CPU, the median of ``--reps`` wall-clock runs (the
Triton kernels run in the interpreter there: the CPU numbers check that the script works, not speed).
``relerr`` is ``||out - ref|| / ||ref||`` against float64 attention. Writes
``logs/benchmarks/decode_<device>_<yyyymmdd>.csv`` (or ``--out``) and prints ``elsa_decode``'s speed-up
over the best SDPA backend and over ``elsa_fwd``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import os
import re
import statistics
import sys
import time

DTYPES = ("float32", "bfloat16")
PEERS = ("sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "elsa_fwd", "elsa_decode")
SDPA_PEERS = PEERS[:4]
COLUMNS = ("device", "torch", "triton", "date", "B", "H", "Nq", "Nk", "D", "dtype", "peer", "ms", "relerr",
           "decode_speedup", "note")


def _parse():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="one small case (Nk=2048, B*H=2, D=64)")
    ap.add_argument("--nk", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--dtype", choices=DTYPES, nargs="+", default=list(DTYPES))
    ap.add_argument("--heads", type=int, default=8, help="B * H (B = 1)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="CPU timing repetitions")
    ap.add_argument("--out", default=None,
                    help="CSV path (default: logs/benchmarks/decode_<device>_<date>.csv)")
    return ap.parse_args()


def main() -> int:
    args = _parse()
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
    import torch
    import triton

    from elsa_vision.kernels.decode import choose_forward, elsa_decode
    from elsa_vision.kernels.fwd import elsa_fwd

    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --device cpu --quick for the interpreter smoke run", file=sys.stderr)
        return 2
    for name, val in (("--heads", args.heads), ("--dim", args.dim), ("--nq", args.nq), ("--reps", args.reps)):
        if val < 1:
            raise ValueError(f"{name} must be >= 1, got {val}")
    if any(n < 1 for n in args.nk):
        raise ValueError(f"--nk values must be >= 1, got {args.nk}")
    if args.quick:
        args.nk, args.heads, args.dim = [2048], 2, 64
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        dev_name = torch.cuda.get_device_name()
    else:
        dev_name = "cpu"
    slug = re.sub(r"[^a-z0-9]+", "_", dev_name.lower()).strip("_")
    date = datetime.date.today().strftime("%Y%m%d")
    out_csv = args.out or os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "logs", "benchmarks",
        f"decode_{slug}_{date}.csv")
    os.makedirs(os.path.dirname(out_csv) or ".", exist_ok=True)

    def sdpa(backend_name):
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = getattr(SDPBackend, backend_name)

        def run(q, k, v):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v)

        return run

    runners = {
        "sdpa_math": sdpa("MATH"),
        "sdpa_efficient": sdpa("EFFICIENT_ATTENTION"),
        "sdpa_flash": sdpa("FLASH_ATTENTION"),
        "sdpa_cudnn": sdpa("CUDNN_ATTENTION"),
        "elsa_fwd": lambda q, k, v: elsa_fwd(q, k, v)[0],
        "elsa_decode": lambda q, k, v: elsa_decode(q, k, v)[0],
    }

    def timed(fn, q, k, v) -> float:
        if device.type == "cuda":
            return triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")
        fn(q, k, v)
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            fn(q, k, v)
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    rows = []
    with open(out_csv, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        for nk in args.nk:
            for dname in args.dtype:
                dtype = getattr(torch, dname)
                g = torch.Generator(device=device).manual_seed(nk)
                q = torch.randn(1, args.heads, args.nq, args.dim, device=device, dtype=dtype, generator=g)
                k = torch.randn(1, args.heads, nk, args.dim, device=device, dtype=dtype, generator=g)
                v = torch.randn(1, args.heads, nk, args.dim, device=device, dtype=dtype, generator=g)
                s = (q.double() @ k.double().transpose(-1, -2)) * args.dim ** -0.5
                ref = torch.softmax(s, -1) @ v.double()
                del s
                route = choose_forward(1, args.heads, args.nq, nk, device=device)
                case = {}
                for peer in PEERS:
                    row = {"device": dev_name, "torch": torch.__version__, "triton": triton.__version__,
                           "date": date, "B": 1, "H": args.heads, "Nq": args.nq, "Nk": nk, "D": args.dim,
                           "dtype": dname, "peer": peer, "ms": "", "relerr": "", "decode_speedup": "",
                           "note": f"auto routes to {route}" if peer == "elsa_decode" else ""}
                    try:
                        out = runners[peer](q, k, v)
                        row["relerr"] = f"{((out.double() - ref).norm() / ref.norm()).item():.3e}"
                        del out
                        ms = timed(runners[peer], q, k, v)
                        row["ms"] = f"{ms:.4f}"
                        case[peer] = ms
                    except RuntimeError as err:  # a backend without a kernel for this device or dtype
                        row["note"] = str(err).splitlines()[0][:160]
                    rows.append(row)
                if "elsa_decode" in case:
                    for row in rows[-len(PEERS):]:
                        if row["peer"] in case:
                            row["decode_speedup"] = f"{case[row['peer']] / case['elsa_decode']:.3f}"
                for row in rows[-len(PEERS):]:
                    writer.writerow(row)
                f.flush()
                sdpa_ms = {p: case[p] for p in SDPA_PEERS if p in case}
                line = f"Nk={nk:>7} {dname:>8} B*H={args.heads} D={args.dim} Nq={args.nq}: " + "  ".join(
                    f"{p}={case[p]:.4f}ms" for p in PEERS if p in case)
                print(line, flush=True)
                if "elsa_decode" in case and sdpa_ms:
                    best = min(sdpa_ms, key=sdpa_ms.get)
                    speedup = sdpa_ms[best] / case["elsa_decode"]
                    print(f"    elsa_decode vs best SDPA ({best}): {speedup:.3g}x;"
                          f" vs elsa_fwd: {case.get('elsa_fwd', float('nan')) / case['elsa_decode']:.3g}x",
                          flush=True)
    print(f"wrote {out_csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
