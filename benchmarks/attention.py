"""Attention forward benchmark: ELSA's Triton kernels against PyTorch's attention backends, in one run.

Usage (on a CUDA machine, from the repository root)::

    PYTHONPATH=$PWD python benchmarks/attention.py                 # the full sweep, writes CSV and plot
    PYTHONPATH=$PWD python benchmarks/attention.py --quick         # headline shapes only
    PYTHONPATH=$PWD python benchmarks/attention.py --dtype float32 --shapes 1,8,4096,64 1,8,16384,64
    PYTHONPATH=$PWD python benchmarks/attention.py --tune          # time the kernel's candidate configs
    PYTHONPATH=$PWD python benchmarks/attention.py --dtype float32 --peers elsa_tf32x3 elsa_tf32x3s \
        --shapes 1,8,4096,64                                       # tf32x3 against tf32x3s
    PYTHONPATH=$PWD python benchmarks/attention.py --quick --backward  # also forward+backward rows
    python benchmarks/attention.py --plot-only benchmarks/results/attention_h100_20261122.csv

The CSV and the plot go to ``logs/benchmarks/`` (ignored by git) unless ``--out`` / ``--png`` say otherwise;
the published ones were written with ``--out benchmarks/results/attention_<gpu>_<date>.csv --png
docs/img/attention_<gpu>.png``.

Each (shape, dtype) is run by every peer on the same inputs: ``sdpa_math``, ``sdpa_efficient``,
``sdpa_flash``, ``sdpa_cudnn`` (``torch.nn.attention.sdpa_kernel``), ``flex``
(``torch.compile(flex_attention)``), ``elsa`` (default precision), ``elsa_ieee``, ``elsa_tf32x3s`` (the
kernel's own TF32 split, the query tile split once), ``elsa_fp16x3`` (three float16 products of scaled
two-part splits) and ``elsa_tf32`` (float32 only); ``elsa_tf32x3``
(Triton's tf32x3 by name, whatever ``auto`` resolves to) runs when named in ``--peers``. A peer that cannot
run a case (flash/cudnn in float32, out of memory) is skipped with a note. Times are the median of
``triton.testing.do_bench``; TFLOP/s counts ``4 B H N^2 D`` (halved for causal); ``extra_mb`` is the peak
allocation of one call above what was allocated before it (output included); ``relerr`` is
``||out - ref|| / ||ref||`` against a float64 reference computed on the GPU in query chunks.

``--backward`` adds a ``pass=fwdbwd`` row per peer and case (same ``peer`` names): forward plus
``backward()`` of a fixed output gradient, the ELSA peers through the autograd op ``elsa_attention``
(``backend="triton"``, the peer's precision for both passes). TFLOP/s then counts ``14 B H N^2 D`` (4 for
the forward, 10 for the backward's five products), ``extra_mb`` includes the gradients, and ``relerr`` is
the largest of dq, dk, dv's relative errors on batch 0, head 0 against float64 autograd.

``--cuda-graph`` times the replay of a CUDA graph of each peer's call (forward, or forward + ``backward()``)
instead of the eager call: the GPU's time without the host's launch work, for cases where the host, not the
GPU, sets the eager time (rows noted ``cuda graph``).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import datetime
import math
import os
import sys
from dataclasses import dataclass

import torch

# ----------------------------------------------------------------------------------------- the sweep


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    N: int
    D: int
    causal: bool = False


# The shapes of the peers table, plus D=128; headline cases first (rows are written as they are measured).
SHAPES = [
    Case(1, 8, 4096, 64),
    Case(1, 8, 16384, 64),
    Case(8, 12, 197, 64),
    Case(8, 12, 785, 64),
    Case(8, 12, 3137, 64),
    Case(1, 8, 1024, 64),
    Case(1, 8, 32768, 64),
    Case(2, 16, 16385, 64),
    Case(1, 8, 4096, 128),
    Case(1, 8, 16384, 128),
    Case(8, 12, 785, 128),
]
QUICK = [Case(1, 8, 4096, 64), Case(1, 8, 16384, 64), Case(8, 12, 197, 64), Case(8, 12, 785, 64)]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# default output directory: the repository's logs/benchmarks (ignored by git)
LOGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "logs", "benchmarks")
PEERS = ["sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "flex", "elsa", "elsa_ieee",
         "elsa_tf32x3s", "elsa_fp16x3", "elsa_tf32"]
# Peers that name a float32 precision: not run for half dtypes (where the precision does not apply).
FP32_PEERS = ("elsa_ieee", "elsa_tf32x3", "elsa_tf32x3s", "elsa_fp16x3", "elsa_tf32")
# Largest problem (B*H*N^2) for which the float64 reference is computed; beyond, relerr stays empty.
REF_LIMIT = 2 * 16 * 16385**2
COLUMNS = [
    "device",
    "torch",
    "triton",
    "date",
    "B",
    "H",
    "N",
    "D",
    "dtype",
    "peer",
    "ms",
    "tflops",
    "extra_mb",
    "relerr",
    "pass",
    "causal",
    "note",
]


def _sdpa(backend_name):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = getattr(SDPBackend, backend_name)

    def run(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return run


_FLEX = None


def _flex(q, k, v, causal):
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
        _FLEX = torch.compile(flex_attention, dynamic=False)
    if causal:
        n = q.shape[-2]
        mask = create_block_mask(lambda b, h, i, j: j <= i, None, None, n, n, device=q.device)
        return _FLEX(q, k, v, block_mask=mask)
    return _FLEX(q, k, v)


def _elsa(precision):
    from elsa_vision.kernels import elsa_fwd

    def run(q, k, v, causal):
        return elsa_fwd(q, k, v, causal=causal, precision=precision)[0]

    return run


RUNNERS = {
    "sdpa_math": _sdpa("MATH"),
    "sdpa_efficient": _sdpa("EFFICIENT_ATTENTION"),
    "sdpa_flash": _sdpa("FLASH_ATTENTION"),
    "sdpa_cudnn": _sdpa("CUDNN_ATTENTION"),
    "flex": _flex,
    "elsa": _elsa("auto"),
    "elsa_ieee": _elsa("ieee"),
    "elsa_tf32x3": _elsa("tf32x3"),
    "elsa_tf32x3s": _elsa("tf32x3s"),
    "elsa_fp16x3": _elsa("fp16x3"),
    "elsa_tf32": _elsa("tf32"),
}


def reference(q, k, v, causal, chunk=1024):
    """float64 attention on the GPU, ``chunk`` query rows at a time (O(chunk * N) memory)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5
    out = torch.empty(q.shape[:-1] + (v.shape[-1],), dtype=torch.float64, device=q.device)
    n = k.shape[-2]
    for r0 in range(0, q.shape[-2], chunk):
        r1 = min(q.shape[-2], r0 + chunk)
        s = (q64[..., r0:r1, :] @ k64.transpose(-1, -2)) * scale
        if causal:
            rows = torch.arange(r0, r1, device=q.device)[:, None] + (n - q.shape[-2])
            s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > rows, -math.inf)
        out[..., r0:r1, :] = torch.softmax(s, -1) @ v64
    return out


# --cuda-graph: time CUDA-graph replays of each call instead of eager calls (the GPU's time without the host's
# launch work; every peer is captured the same way).
CUDA_GRAPH = False


def _timed(step):
    """``step`` itself, or under ``CUDA_GRAPH`` the replay of a CUDA graph of it (captured after a warm-up
    on a side stream, as torch.cuda.graphs requires)."""
    if not CUDA_GRAPH:
        return step
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph.replay


def measure(fn, q, k, v, causal, ref):
    import triton

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fn(q, k, v, causal)
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    err = ""
    if ref is not None:
        err = f"{((out.double() - ref).norm() / ref.norm()).item():.3e}"
    del out
    ms = triton.testing.do_bench(_timed(lambda: fn(q, k, v, causal)), warmup=25, rep=100,
                                 return_mode="median")
    return ms, extra, err


def _elsa_autograd(precision):
    from elsa_vision.ops import elsa_attention

    def run(q, k, v, causal):
        return elsa_attention(q, k, v, causal=causal, precision=precision, backend="triton")

    return run


def train_runner(peer):
    """The peer as a differentiable function: the SDPA backends and flex as they are, the ELSA peers
    through the autograd op with the peer's precision."""
    if peer.startswith("elsa"):
        return _elsa_autograd("auto" if peer == "elsa" else peer[len("elsa_"):])
    return RUNNERS[peer]


def reference_grads(q, k, v, do, causal):
    """float64 autograd (dq, dk, dv) of batch 0, head 0 (one ``[N, N]`` float64 score matrix)."""
    from elsa_vision.kernels.reference import softmax_attention

    leaves = [t[:1, :1].detach().double().requires_grad_() for t in (q, k, v)]
    softmax_attention(*leaves, causal=causal).backward(do[:1, :1].double())
    return [t.grad for t in leaves]


def measure_fwdbwd(fn, q, k, v, causal, do, ref_grads):
    """(ms, extra MB, relerr) of forward + ``backward(do)``; relerr over dq, dk, dv of batch 0, head 0."""
    import triton

    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        fn(qg, kg, vg, causal).backward(do)

    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    extra = (torch.cuda.max_memory_allocated() - base) / 2**20
    err = ""
    if ref_grads is not None:
        errs = [((g[:1, :1].double() - r).norm() / r.norm()).item()
                for g, r in zip((qg.grad, kg.grad, vg.grad), ref_grads)]
        err = f"{max(errs):.3e}"
    ms = triton.testing.do_bench(_timed(step), warmup=10, rep=60, return_mode="median")
    return ms, extra, err


def run_sweep(cases, dtypes, peers, out_csv, flex_cases=None, autotune=(), backward=False):
    import triton

    from elsa_vision.kernels import fwd

    os.makedirs(os.path.dirname(out_csv) or ".", exist_ok=True)
    f = open(out_csv, "w", newline="")  # rows are flushed as they come: a cut-off run keeps what it measured
    writer = csv.DictWriter(f, fieldnames=COLUMNS)
    writer.writeheader()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = torch.cuda.get_device_name()
    date = datetime.date.today().strftime("%Y-%m-%d")
    rows = []
    for c in cases:
        for dname in dtypes:
            dtype = DTYPES[dname]
            g = torch.Generator(device="cuda").manual_seed(c.N + c.D)
            q, k, v = (
                torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=dtype, generator=g) for _ in range(3)
            )
            ref = reference(q, k, v, c.causal) if c.B * c.H * c.N**2 <= REF_LIMIT else None
            do = ref_grads = None
            if backward:
                do = torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=dtype, generator=g)
                ref_grads = reference_grads(q, k, v, do, c.causal) if c.N <= 16384 else None
            for dt_name, dim, prec in autotune:
                if dt_name == dname and dim == c.D:  # tuned once per key, on the first case that has it
                    cfg = fwd.autotune_fwd(q, k, v, causal=c.causal, precision=prec)
                    print(f"autotune {dname} D={c.D} {prec}: {cfg}", flush=True)
            passes = [(peer, pas) for pas in (("fwd", "fwdbwd") if backward else ("fwd",)) for peer in peers]
            for peer, pas in passes:
                if peer in FP32_PEERS and dtype != torch.float32:
                    continue  # precisions exist for float32 only
                if peer == "flex" and flex_cases is not None and c not in flex_cases:
                    continue  # each flex shape is a fresh torch.compile: limited to the selected shapes
                if pas == "fwdbwd" and peer == "sdpa_math" and c.N > 8192:
                    continue  # its backward keeps several [B, H, N, N] float tensors
                flops = (4 if pas == "fwd" else 14) * c.B * c.H * c.N**2 * c.D * (0.5 if c.causal else 1.0)
                note = "cuda graph" if CUDA_GRAPH else ""
                ms = extra = None
                err = ""
                try:
                    if pas == "fwd":
                        ms, extra, err = measure(RUNNERS[peer], q, k, v, c.causal, ref)
                    else:
                        ms, extra, err = measure_fwdbwd(train_runner(peer), q, k, v, c.causal, do, ref_grads)
                except torch.cuda.OutOfMemoryError:
                    note = "out of memory"
                except Exception as exc:  # noqa: BLE001 - an unsupported peer/case is recorded and skipped
                    note = f"unsupported: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                torch.cuda.empty_cache()
                row = dict(
                    device=dev,
                    torch=torch.__version__,
                    triton=triton.__version__,
                    date=date,
                    B=c.B,
                    H=c.H,
                    N=c.N,
                    D=c.D,
                    dtype=dname,
                    peer=peer,
                    ms=f"{ms:.4f}" if ms is not None else "",
                    tflops=f"{flops / ms / 1e9:.1f}" if ms is not None else "",
                    extra_mb=f"{extra:.1f}" if extra is not None else "",
                    relerr=err,
                    causal=int(c.causal),
                    note=note,
                )
                row["pass"] = pas
                rows.append(row)
                writer.writerow(row)
                f.flush()
                print(
                    f"{dname:9s} {c.B},{c.H},{c.N},{c.D}{'c' if c.causal else ''} {peer:15s} {pas:6s} "
                    f"{row['ms']:>9s} ms {row['tflops']:>7s} TF/s {row['extra_mb']:>9s} MB {err:>10s} {note}",
                    flush=True,
                )
            del q, k, v, ref, do, ref_grads
    f.close()
    return rows


def ratio_table(rows):
    """elsa's speedup over sdpa_efficient, sdpa_cudnn and flex per (pass, shape, dtype); memory vs
    efficient."""
    by = {}
    for r in rows:
        if r["ms"]:
            by[(r["pass"], r["dtype"], r["B"], r["H"], r["N"], r["D"], r["causal"], r["peer"])] = r
    keys = sorted({k[:7] for k in by}, key=lambda k: (k[0], k[1]) + tuple(int(x) for x in k[2:]))
    print(
        "\n| pass | dtype | B,H,N,D | elsa ms | relerr | x sdpa_efficient | x cudnn | x flex | ieee x eff "
        "| tf32 x eff "
        "| mem / eff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for k in keys:
        e = by.get(k + ("elsa",))
        if e is None:
            continue

        def ratio(peer, num=e, key=k):
            p = by.get(key + (peer,))
            return f"{float(p['ms']) / float(num['ms']):.2f}" if p else "-"

        ie, tf = by.get(k + ("elsa_ieee",)), by.get(k + ("elsa_tf32",))
        eff = by.get(k + ("sdpa_efficient",))
        mem = (
            f"{float(e['extra_mb']) / float(eff['extra_mb']):.2f}"
            if eff and float(eff["extra_mb"]) > 0
            else "-"
        )
        print(
            f"| {k[0]} | {k[1]} | {k[2]},{k[3]},{k[4]},{k[5]}{'c' if int(k[6]) else ''} | {e['ms']} | "
            f"{e['relerr']} | {ratio('sdpa_efficient')} | {ratio('sdpa_cudnn')} | {ratio('flex')} | "
            f"{ratio('sdpa_efficient', ie) if ie else '-'} | "
            f"{ratio('sdpa_efficient', tf) if tf else '-'} | {mem} |"
        )


def plot(csv_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["ms"] and r["B"] == "1" and r["H"] == "8"
                and r.get("pass", "fwd") == "fwd"]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6 * len(dtypes), 4.5), squeeze=False)
    for ax, dname in zip(axes[0], dtypes):
        for color, peer in enumerate(RUNNERS):
            for D in sorted({int(r["D"]) for r in rows}):
                pts = sorted(
                    (int(r["N"]), float(r["tflops"]))
                    for r in rows
                    if r["dtype"] == dname and r["peer"] == peer and int(r["D"]) == D
                )
                if pts:
                    ax.plot(*zip(*pts), marker="o", color=plt.cm.tab20(color % 20),
                            linestyle="-" if D == 64 else "--", label=f"{peer} D={D}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("N (B=1, H=8)")
        ax.set_ylabel("TFLOP/s (4 B H N^2 D / time)")
        ax.set_title(f"{dname}: attention forward, {rows[0]['device'] if rows else ''}")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(png_path) or ".", exist_ok=True)
    os.makedirs(os.path.dirname(png_path) or ".", exist_ok=True)
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def tune(cases, dtypes, precisions, configs=None):
    """Time every pruned candidate config of the fused kernel on each case; print the ranking."""
    import triton

    from elsa_vision.kernels import fwd

    torch.backends.cuda.matmul.allow_tf32 = False
    for dname in dtypes:
        dtype = DTYPES[dname]
        for prec in precisions if dtype == torch.float32 else ["auto"]:
            for c in cases:
                q, k, v = (torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=dtype) for _ in range(3))
                p = fwd.plan(c.B, c.H, c.N, c.N, c.D, c.D, dtype, c.causal, device=q.device, precision=prec)
                _, cc, smem = fwd._device_info(q.device)
                key = fwd.tuning_key(dtype, c.D, c.D, c.causal, False, q.device, prec)
                results = []
                for cfg in configs or fwd._candidates(dtype, p.precision, p.block_d, p.block_dv, smem):
                    fwd.set_config(key, cfg)
                    try:
                        ms = triton.testing.do_bench(
                            lambda q=q, k=k, v=v, c=c, prec=prec: fwd.elsa_fwd(
                                q, k, v, causal=c.causal, precision=prec, partitions=1
                            ),
                            warmup=10,
                            rep=30,
                            return_mode="median",
                        )
                    except Exception as exc:  # noqa: BLE001 - configs the compiler rejects are listed
                        results.append((math.inf, cfg, type(exc).__name__))
                        continue
                    results.append((ms, cfg, ""))
                fwd.set_config(key, None)
                results.sort(key=lambda r: r[0])
                best = ", ".join(f"{cfg}:{ms:.3f}" for ms, cfg, _ in results[:6])
                flops = 4 * c.B * c.H * c.N**2 * c.D * (0.5 if c.causal else 1.0)
                print(
                    f"TUNE {dname} {prec} {c} default={(p.block_m, p.block_n, p.num_warps, p.num_stages)} "
                    f"best={results[0][1]} {flops / results[0][0] / 1e9:.0f} TF/s | {best}",
                    flush=True,
                )


def parse_case(s: str) -> Case:
    parts = s.split(",")
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(f"shape must be B,H,N,D[,causal], got {s!r}")
    return Case(*(int(x) for x in parts[:4]), causal=len(parts) == 5 and parts[4] in ("1", "causal", "c"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="headline shapes only")
    ap.add_argument(
        "--shapes", nargs="+", type=parse_case, help="B,H,N,D[,causal] cases (default: the sweep)"
    )
    ap.add_argument("--dtype", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    ap.add_argument("--peers", nargs="+", choices=list(RUNNERS), default=PEERS)
    ap.add_argument(
        "--flex-shapes",
        nargs="+",
        type=parse_case,
        default=None,
        help="run flex only on these cases (each shape costs a torch.compile)",
    )
    ap.add_argument("--autotune", nargs="+", default=[],
                    help="dtype:D:precision keys to autotune (on their first case) before timing elsa")
    ap.add_argument("--causal", action="store_true", help="also run every shape causal")
    ap.add_argument("--backward", action="store_true", help="also time forward+backward (pass=fwdbwd rows)")
    ap.add_argument("--cuda-graph", action="store_true",
                    help="time CUDA-graph replays of every peer's call (GPU time without host launch work; "
                         "the rows' note says 'cuda graph')")
    ap.add_argument(
        "--out", default=None, help="CSV path (default logs/benchmarks/attention_<gpu>_<date>.csv)"
    )
    ap.add_argument("--png", default=None, help="plot path (default logs/benchmarks/attention_<gpu>.png)")
    ap.add_argument("--tune", action="store_true", help="time the candidate kernel configs instead")
    ap.add_argument("--tune-precisions", nargs="+", default=["tf32x3", "ieee", "tf32"],
                    help="float32 precisions to tune (any of auto, ieee, tf32x3, tf32x3s, fp16x3, tf32)")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="BLOCK_M,BLOCK_N,warps,stages configs to time with --tune (default: the pruned candidates)",
    )
    ap.add_argument("--plot-only", default=None, help="only draw the plot of an existing CSV")
    args = ap.parse_args(argv)
    if args.plot_only:
        gpu = os.path.basename(args.plot_only).split("_")[1]
        plot(args.plot_only, args.png or os.path.join(LOGS, f"attention_{gpu}.png"))
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/attention.py needs a CUDA GPU")
    global CUDA_GRAPH
    CUDA_GRAPH = args.cuda_graph
    cases = args.shapes or (QUICK if args.quick else SHAPES)
    if args.causal:
        cases = cases + [Case(c.B, c.H, c.N, c.D, True) for c in cases]
    if args.tune:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else None
        tune(cases, args.dtype, args.tune_precisions, configs)
        return
    gpu = torch.cuda.get_device_name().lower().replace("nvidia", "").strip().split()[0]
    day = datetime.date.today().strftime("%Y%m%d")
    out_csv = args.out or os.path.join(LOGS, f"attention_{gpu}_{day}.csv")
    autotune = [(a.split(":")[0], int(a.split(":")[1]), a.split(":")[2]) for a in args.autotune]
    rows = run_sweep(cases, args.dtype, args.peers, out_csv, args.flex_shapes, autotune, args.backward)
    print(f"wrote {out_csv}")
    ratio_table(rows)
    with contextlib.suppress(ImportError):
        plot(out_csv, args.png or os.path.join(LOGS, f"attention_{gpu}.png"))


if __name__ == "__main__":
    main()
