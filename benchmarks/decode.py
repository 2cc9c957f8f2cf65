"""Few-query (decode) attention benchmark: ELSA's stream-K path against PyTorch's attention backends.

One query row (a decode step) against a long key/value cache, ``B * H = 8`` heads, ``D = 128``::

    python -m benchmarks.decode                       # GPU: Nk in {64K, 256K}, bf16 + fp32
    python -m benchmarks.decode --nk 65536 --dtype bfloat16
    OMP_NUM_THREADS=1 python -m benchmarks.decode --device cpu --quick  # smoke run

Peers on the same inputs: ``sdpa_math``, ``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn``
(``torch.nn.attention.sdpa_kernel``), ``flex`` (``torch.compile(flex_attention)``, CUDA only), ``elsa_fwd``
(the regular two-level forward) and ``elsa_decode`` (the stream-K path that ``backend="auto"`` takes for these
shapes). A peer that cannot run a case (flash/cudnn in float32, a backend missing on the device) is recorded
with a note. One query sees the whole cache, so every peer runs without a causal mask (SDPA's ``is_causal`` is
top-left aligned and would hide all but key 0).

Times (``benchmarks.common.timings``): ``ms``, on the GPU the median of ``triton.testing.do_bench`` (eager),
on the CPU the median of ``--reps`` wall-clock runs (the Triton kernels run in the interpreter there: the CPU
numbers check that the script works, not speed); ``graph_ms`` beside it on the GPU, the median of CUDA-graph
replays (the GPU's time alone, which for a single decode step can be well below the eager time).
``relerr`` is ``||out - ref|| / ||ref||`` against float64 attention. Writes
``logs/benchmarks/decode_<device>.csv`` (or ``--out``) and prints ``elsa_decode``'s speed-up
over the best SDPA backend and over ``elsa_fwd``.
"""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial

from benchmarks.common import (
    LOGS,
    SDPA_BACKENDS,
    Results,
    columns,
    device_tag,
    flex,
    reference,
    relerr,
    run_info,
    sdpa,
    timings,
)

DTYPES = ("float32", "bfloat16")
SDPA_PEERS = tuple(SDPA_BACKENDS)
PEERS = (*SDPA_PEERS, "flex", "elsa_fwd", "elsa_decode")
COLUMNS = columns("B", "H", "Nq", "Nk", "D", "dtype", "peer", "ms", "relerr", "decode_speedup", "note",
                  "graph_ms")


def _parse(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="one small case (Nk=2048, B*H=2, D=64)")
    ap.add_argument("--nk", type=int, nargs="+", default=[65536, 262144])
    ap.add_argument("--dtype", choices=DTYPES, nargs="+", default=list(DTYPES))
    ap.add_argument("--heads", type=int, default=8, help="B * H (B = 1)")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--nq", type=int, default=1)
    ap.add_argument("--reps", type=int, default=3, help="CPU timing repetitions")
    ap.add_argument("--out", default=None, help="CSV path (default: logs/benchmarks/decode_<device>.csv)")
    return ap.parse_args(argv)


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = _parse(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the first `import triton`
    import torch

    from elsa_vision.kernels.decode import choose_forward, elsa_decode
    from elsa_vision.kernels.fwd import elsa_fwd

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu --quick for the interpreter smoke run")
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
    runners = {peer: sdpa(peer) for peer in SDPA_PEERS}
    if device.type == "cuda":  # on the CPU a fresh compilation per shape would be most of a smoke run
        runners["flex"] = flex()
    runners["elsa_fwd"] = lambda q, k, v: elsa_fwd(q, k, v)[0]
    runners["elsa_decode"] = lambda q, k, v: elsa_decode(q, k, v)[0]

    meta = run_info(device, __file__, argv)
    with Results(args.out or LOGS / f"decode_{device_tag(device)}.csv", COLUMNS, meta) as out:
        for nk in args.nk:
            for dname in args.dtype:
                dtype = getattr(torch, dname)
                g = torch.Generator(device=device).manual_seed(nk)
                q = torch.randn(1, args.heads, args.nq, args.dim, device=device, dtype=dtype, generator=g)
                k = torch.randn(1, args.heads, nk, args.dim, device=device, dtype=dtype, generator=g)
                v = torch.randn(1, args.heads, nk, args.dim, device=device, dtype=dtype, generator=g)
                ref = reference(q, k, v)[0]
                route = choose_forward(1, args.heads, args.nq, nk, device=device)
                case, graph, rows = {}, {}, []
                for peer in (p for p in PEERS if p in runners):
                    row = {"B": 1, "H": args.heads, "Nq": args.nq, "Nk": nk, "D": args.dim, "dtype": dname,
                           "peer": peer, "ms": "", "relerr": "", "decode_speedup": "", "graph_ms": "",
                           "note": f"auto routes to {route}" if peer == "elsa_decode" else ""}
                    try:
                        call = partial(runners[peer], q, k, v)
                        row["relerr"] = f"{relerr(call(), ref):.3e}"
                        t = timings(call, device, cpu_reps=args.reps)
                        row["ms"] = f"{t['ms']:.4f}"
                        if t["graph_ms"] == t["graph_ms"]:
                            row["graph_ms"] = f"{t['graph_ms']:.4f}"
                            graph[peer] = t["graph_ms"]
                        case[peer] = t["ms"]
                    except Exception as err:  # noqa: BLE001 - a backend without a kernel for this device/dtype
                        row["note"] = f"{type(err).__name__}: {str(err).splitlines()[0][:140]}"
                    rows.append(row)
                for row in rows:
                    if "elsa_decode" in case and row["peer"] in case:
                        row["decode_speedup"] = f"{case[row['peer']] / case['elsa_decode']:.3f}"
                    out.write(row)
                sdpa_ms = {p: case[p] for p in SDPA_PEERS if p in case}
                line = f"Nk={nk:>7} {dname:>8} B*H={args.heads} D={args.dim} Nq={args.nq}: " + "  ".join(
                    f"{p}={case[p]:.4f}ms" for p in PEERS if p in case)
                print(line, flush=True)
                if "elsa_decode" in case and sdpa_ms:
                    best = min(sdpa_ms, key=sdpa_ms.get)
                    speedup = sdpa_ms[best] / case["elsa_decode"]
                    others = "".join(f"; vs {p}: {case[p] / case['elsa_decode']:.3g}x"
                                     for p in ("flex", "elsa_fwd") if p in case)
                    print(f"    elsa_decode vs best SDPA ({best}): {speedup:.3g}x{others}", flush=True)
                if "elsa_decode" in graph:
                    ratios = "  ".join(f"{p} {graph[p] / graph['elsa_decode']:.3g}x"
                                       for p in PEERS if p in graph)
                    print(f"    CUDA-graph replays, peer / elsa_decode: {ratios}", flush=True)
    print(f"wrote {out.path}")
    return str(out.path)


if __name__ == "__main__":
    main()
