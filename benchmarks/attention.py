"""Attention forward benchmark: ELSA's Triton kernels against PyTorch's attention backends, in one run.

Usage (on a CUDA machine, from the repository root)::

    python -m benchmarks.attention                 # the full sweep, writes CSV and plot
    python -m benchmarks.attention --quick         # headline shapes only
    python -m benchmarks.attention --dtype float32 --shapes 1,8,4096,64 1,8,16384,64
    python -m benchmarks.attention --tune          # time the kernel's candidate configs
    python -m benchmarks.attention --tune-hopper --dtype bfloat16 --shapes 1,8,4096,64 1,8,16384,128
    python -m benchmarks.attention --dtype float32 --peers sdpa_efficient elsa elsa_tf32x3 \
        --shapes 1,8,4096,64                                       # fp16x3 (auto on sm90) against tf32x3
    python -m benchmarks.attention --quick --backward  # also forward+backward rows
    python -m benchmarks.attention --plot-only benchmarks/results/attention_h100.csv

The CSV and the plot go to ``logs/benchmarks/attention_<gpu>.{csv,png}`` (ignored by git) unless ``--out`` /
``--png`` say otherwise; ``benchmarks/results/attention_<gpu>.csv`` and ``docs/img/attention_<gpu>.png`` are
the current published ones (``docs/benchmarks/attention.md``).

Each (shape, dtype) is run by every peer on the same inputs: ``sdpa_math``, ``sdpa_efficient``,
``sdpa_flash``, ``sdpa_cudnn`` (``torch.nn.attention.sdpa_kernel``), ``flex``
(``torch.compile(flex_attention)``), ``elsa`` (default precision), ``elsa_ieee``, ``elsa_fp16x3`` (three
float16 products of scaled two-part splits) and ``elsa_tf32`` (float32 only); ``elsa_tf32x3`` (Triton's tf32x3
by name, whatever ``auto`` resolves to) and ``elsa_generic`` (``elsa`` on the generic Triton kernels in both
passes, the A/B of the warp-specialised Hopper ones) run when named in ``--peers``. A peer that cannot run a
case (flash/cudnn in float32, out of memory) is skipped with a note. Times: below; TFLOP/s counts
``4 B H N^2 D`` (halved for causal); ``extra_mb`` is the peak allocation of one call above what was allocated
before it (output included); ``relerr`` is ``||out - ref|| / ||ref||`` against a float64 reference computed on
the GPU in query chunks.

``--backward`` adds a ``pass=fwdbwd`` row per peer and case (same ``peer`` names): forward plus
``backward()`` of a fixed output gradient, the ELSA peers through the autograd op ``elsa_attention``
(``backend="triton"``, the peer's precision for both passes). TFLOP/s then counts ``14 B H N^2 D`` (4 for
the forward, 10 for the backward's five products), ``extra_mb`` includes the gradients, and ``relerr`` is
the largest of dq, dk, dv's relative errors on batch 0, head 0 against the float64 reference.

Every call is timed twice, side by side (``benchmarks.common.timings``): ``ms``, the eager call
(``do_bench`` median, the host's launch work included), and ``graph_ms``, CUDA-graph replays of the same call
(forward, or forward + ``backward()``): the GPU's time alone. Where the two differ the host sets the eager
time. ``--no-graph`` skips the replays.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import math
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import torch

from benchmarks.common import (
    LOGS,
    Results,
    bench_ms,
    columns,
    device_tag,
    flex,
    generic_kernels,
    max_grad_relerr,
    peak_mb,
    reference,
    relerr,
    run_info,
    sdpa,
    timings,
)

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
PEERS = ["sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "flex", "elsa", "elsa_ieee",
         "elsa_fp16x3", "elsa_tf32"]
# Peers that name a float32 precision: not run for half dtypes (where the precision does not apply).
FP32_PEERS = ("elsa_ieee", "elsa_tf32x3", "elsa_fp16x3", "elsa_tf32")
# Largest problem (B*H*N^2) for which the float64 reference is computed; beyond, relerr stays empty.
REF_LIMIT = 2 * 16 * 16385**2
COLUMNS = columns("B", "H", "N", "D", "dtype", "peer", "ms", "tflops", "extra_mb", "relerr", "pass", "causal",
                  "note", "graph_ms")


def _sdpa(peer):
    call = sdpa(peer)
    return lambda q, k, v, causal: call(q, k, v, is_causal=causal)


_FLEX = None


def _flex(q, k, v, causal):
    global _FLEX
    if _FLEX is None:
        _FLEX = flex()
    return _FLEX(q, k, v, is_causal=causal)


def _elsa(precision):
    def run(q, k, v, causal):
        from elsa_vision.kernels import elsa_fwd

        return elsa_fwd(q, k, v, causal=causal, precision=precision)[0]

    return run


def _generic(fn):
    """``fn`` run with the generic Triton kernels on Hopper too (``benchmarks.common.generic_kernels``): the
    A/B of the warp-specialised forward (peer ``elsa_generic``)."""
    def run(q, k, v, causal):
        with generic_kernels():
            return fn(q, k, v, causal)

    return run


RUNNERS = {
    "sdpa_math": _sdpa("sdpa_math"),
    "sdpa_efficient": _sdpa("sdpa_efficient"),
    "sdpa_flash": _sdpa("sdpa_flash"),
    "sdpa_cudnn": _sdpa("sdpa_cudnn"),
    "flex": _flex,
    "elsa": _elsa("auto"),
    "elsa_generic": _generic(_elsa("auto")),
    "elsa_ieee": _elsa("ieee"),
    "elsa_tf32x3": _elsa("tf32x3"),
    "elsa_fp16x3": _elsa("fp16x3"),
    "elsa_tf32": _elsa("tf32"),
}

# --no-graph: eager times only (no CUDA-graph replays).
GRAPH = True


def measure(fn, q, k, v, causal, ref):
    """(timings, extra MB, relerr) of one forward; timings: ``{"ms", "graph_ms"}``."""
    extra, out = peak_mb(lambda: fn(q, k, v, causal), "cuda", extra=True)
    err = "" if ref is None else f"{relerr(out, ref):.3e}"
    del out
    return timings(lambda: fn(q, k, v, causal), warmup=25, rep=100, graph=GRAPH), extra, err


def _elsa_autograd(precision):
    def run(q, k, v, causal):
        from elsa_vision.ops import elsa_attention

        return elsa_attention(q, k, v, causal=causal, precision=precision, backend="triton")

    return run


def train_runner(peer):
    """The peer as a differentiable function: the SDPA backends and flex as they are, the ELSA peers
    through the autograd op with the peer's precision."""
    if peer.startswith("elsa"):  # elsa_generic: measure_fwdbwd switches the kernels
        return _elsa_autograd("auto" if peer in ("elsa", "elsa_generic") else peer[len("elsa_"):])
    return RUNNERS[peer]


def reference_grads(q, k, v, do, causal):
    """float64 (dq, dk, dv) of batch 0, head 0."""
    return reference(*(t[:1, :1] for t in (q, k, v)), causal=causal, dout=do[:1, :1])[1]


def measure_fwdbwd(fn, q, k, v, causal, do, ref_grads, generic=False):
    """(timings, extra MB, relerr) of forward + ``backward(do)``; relerr over dq, dk, dv of batch 0,
    head 0. ``generic``: both passes on the generic kernels (peer ``elsa_generic``)."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def step():
        qg.grad = kg.grad = vg.grad = None
        with generic_kernels() if generic else contextlib.nullcontext():
            fn(qg, kg, vg, causal).backward(do)

    extra, _ = peak_mb(step, "cuda", extra=True)
    err = "" if ref_grads is None else f"{max_grad_relerr((qg.grad, kg.grad, vg.grad), ref_grads):.3e}"
    return timings(step, warmup=10, rep=60, graph=GRAPH), extra, err


def run_sweep(cases, dtypes, peers, out: Results, flex_cases=None, autotune=(), backward=False):
    """Every peer on every (case, dtype), rows written to ``out`` as they are measured."""
    from benchmarks.autotune import autotune_fwd

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    for c in cases:
        for dname in dtypes:
            dtype = DTYPES[dname]
            g = torch.Generator(device="cuda").manual_seed(c.N + c.D)
            q, k, v = (
                torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=dtype, generator=g) for _ in range(3)
            )
            ref = reference(q, k, v, causal=c.causal)[0] if c.B * c.H * c.N**2 <= REF_LIMIT else None
            do = ref_grads = None
            if backward:
                do = torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=dtype, generator=g)
                ref_grads = reference_grads(q, k, v, do, c.causal) if c.N <= 16384 else None
            for dt_name, dim, prec in autotune:
                if dt_name == dname and dim == c.D:  # tuned once per key, on the first case that has it
                    cfg = autotune_fwd(q, k, v, causal=c.causal, precision=prec)
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
                note = ""
                ms = extra = None
                graph = math.nan
                err = ""
                try:
                    if pas == "fwd":
                        t, extra, err = measure(RUNNERS[peer], q, k, v, c.causal, ref)
                    else:
                        t, extra, err = measure_fwdbwd(train_runner(peer), q, k, v, c.causal, do, ref_grads,
                                                       generic=peer == "elsa_generic")
                    ms, graph = t["ms"], t["graph_ms"]
                except torch.cuda.OutOfMemoryError:
                    note = "out of memory"
                except Exception as exc:  # noqa: BLE001 - an unsupported peer/case is recorded and skipped
                    note = f"unsupported: {type(exc).__name__}: {str(exc).splitlines()[0][:80]}"
                torch.cuda.empty_cache()
                row = out.write({"pass": pas}, B=c.B, H=c.H, N=c.N, D=c.D, dtype=dname, peer=peer,
                                ms=f"{ms:.4f}" if ms is not None else "",
                                tflops=f"{flops / ms / 1e9:.1f}" if ms is not None else "",
                                extra_mb=f"{extra:.1f}" if extra is not None else "",
                                relerr=err, causal=int(c.causal), note=note,
                                graph_ms=f"{graph:.4f}" if graph == graph else "")
                print(
                    f"{dname:9s} {c.B},{c.H},{c.N},{c.D}{'c' if c.causal else ''} {peer:15s} {pas:6s} "
                    f"{row['ms']:>9s} ms (graph {row['graph_ms']:>9s}) {row['tflops']:>7s} TF/s "
                    f"{row['extra_mb']:>9s} MB {err:>10s} {note}",
                    flush=True,
                )
            del q, k, v, ref, do, ref_grads
    return out.rows


def ratio_table(rows):
    """elsa's speedup over sdpa_efficient, sdpa_cudnn and flex per (pass, shape, dtype); memory vs
    efficient."""
    by = {}
    for r in rows:
        if r["ms"]:
            by[(r["pass"], r["dtype"], r["B"], r["H"], r["N"], r["D"], r["causal"], r["peer"])] = r
    keys = sorted({k[:7] for k in by}, key=lambda k: (k[0], k[1]) + tuple(int(x) for x in k[2:]))
    print(
        "\n| pass | dtype | B,H,N,D | elsa ms | elsa graph ms | relerr | x sdpa_efficient | x cudnn | x flex "
        "| x sdpa_efficient, graph | x cudnn, graph | ieee x eff | tf32 x eff | mem / eff |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for k in keys:
        e = by.get(k + ("elsa",))
        if e is None:
            continue

        def ratio(peer, num=e, key=k, col="ms"):
            p = by.get(key + (peer,))
            if not p or not p.get(col) or not num.get(col):
                return "-"
            return f"{float(p[col]) / float(num[col]):.2f}"

        ie, tf = by.get(k + ("elsa_ieee",)), by.get(k + ("elsa_tf32",))
        eff = by.get(k + ("sdpa_efficient",))
        mem = (
            f"{float(e['extra_mb']) / float(eff['extra_mb']):.2f}"
            if eff and float(eff["extra_mb"]) > 0
            else "-"
        )
        print(
            f"| {k[0]} | {k[1]} | {k[2]},{k[3]},{k[4]},{k[5]}{'c' if int(k[6]) else ''} | {e['ms']} | "
            f"{e.get('graph_ms') or '-'} | {e['relerr']} | {ratio('sdpa_efficient')} | "
            f"{ratio('sdpa_cudnn')} | {ratio('flex')} | {ratio('sdpa_efficient', col='graph_ms')} | "
            f"{ratio('sdpa_cudnn', col='graph_ms')} | "
            f"{ratio('sdpa_efficient', ie) if ie else '-'} | "
            f"{ratio('sdpa_efficient', tf) if tf else '-'} | {mem} |"
        )


def plot(csv_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = [r for r in csv.DictReader(f) if r["ms"] and r["B"] == "1" and r["H"] == "8"
                and r.get("pass", "fwd") == "fwd" and r.get("note") != "cuda graph"]
    # A results file may hold several runs (the date column): per dtype, plot the run with the most points.
    runs = Counter((r["dtype"], r["date"]) for r in rows)
    sweep = {d: max((n, date) for (dt, date), n in runs.items() if dt == d)[1] for d, _ in runs}
    rows = [r for r in rows if r["date"] == sweep[r["dtype"]]]
    dtypes = [d for d in DTYPES if any(r["dtype"] == d for r in rows)]
    if not dtypes:
        print(f"no plot: {csv_path} has no forward rows of the plotted B=1, H=8 sweep")
        return
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
    Path(png_path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png_path, dpi=110)
    print(f"wrote {png_path}")


def tune(cases, dtypes, precisions, configs=None):
    """Time every pruned candidate config of the fused kernel on each case; print the ranking."""
    from benchmarks.autotune import candidates
    from elsa_vision.kernels import fwd
    from elsa_vision.kernels.host import device_info

    torch.backends.cuda.matmul.allow_tf32 = False
    for dname in dtypes:
        dtype = DTYPES[dname]
        for prec in precisions if dtype == torch.float32 else ["auto"]:
            for c in cases:
                q, k, v = (torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=dtype) for _ in range(3))
                p = fwd.plan(c.B, c.H, c.N, c.N, c.D, c.D, dtype, c.causal, device=q.device, precision=prec)
                _, cc, smem = device_info(q.device)
                key = fwd.tuning_key(dtype, c.D, c.D, c.causal, False, q.device, prec)
                results = []
                for cfg in configs or candidates(dtype, p.precision, p.block_d, p.block_dv, smem):
                    fwd.set_config(key, cfg)
                    try:
                        ms = bench_ms(lambda q=q, k=k, v=v, c=c, prec=prec: fwd.elsa_fwd(
                            q, k, v, causal=c.causal, precision=prec, partitions=1), warmup=10, rep=30)
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


# --tune-hopper's default candidates per head dim: (BLOCK_N, STAGES, CONSUMERS)
HOPPER_CANDIDATES = {
    64: [(128, 3, 2), (128, 3, 3), (128, 2, 2), (64, 4, 2), (64, 3, 3)],
    128: [(128, 3, 2), (64, 3, 2), (64, 4, 2), (128, 2, 2)],
}


def tune_hopper(cases, dtypes, configs=None):
    """Time ``fwd_sm90``'s tile and schedule configs (``HOPPER_CANDIDATES``, or ``configs``) on each case,
    next to cuDNN and the generic kernel of the same process: GPU time (``do_bench``), the ratio to cuDNN,
    the relative difference to the generic kernel's output and whether any query tile was flagged for the
    redo (finite inputs must flag none). Prints one ranking line per (case, dtype)."""
    from elsa_vision.kernels import fwd

    if fwd.fwd_sm90 is None:
        sys.exit("--tune-hopper needs a Triton with Gluon")
    for dname in dtypes:
        if DTYPES[dname] != torch.float32:  # the Hopper forward is half precision
            for c in cases:
                _tune_hopper_case(c, dname, configs)


def _tune_hopper_case(c, dname, configs):
    from elsa_vision.kernels import fwd

    sm90 = fwd.fwd_sm90
    q, k, v = (torch.randn(c.B, c.H, c.N, c.D, device="cuda", dtype=DTYPES[dname]) for _ in range(3))
    flops = 4 * c.B * c.H * c.N**2 * c.D
    cudnn = bench_ms(lambda: RUNNERS["sdpa_cudnn"](q, k, v, False))
    generic_out = RUNNERS["elsa_generic"](q, k, v, False)
    generic = bench_ms(lambda: RUNNERS["elsa_generic"](q, k, v, False))
    saved = dict(sm90.CONFIGS), dict(sm90.LARGE)
    results = []
    try:
        for cfg in configs or HOPPER_CANDIDATES.get(c.D, []):
            sm90.CONFIGS[c.D] = tuple(cfg)
            sm90.LARGE.pop(c.D, None)
            fwd._PROGRAMS.clear()
            program = fwd.fwd_program(q, k, v, None, None, False, c.D ** -0.5, "auto")
            if program.hopper is None:
                sys.exit(f"--tune-hopper: {c} does not take the Hopper forward (fwd.HOPPER_MIN_KEYS, one key "
                         "partition, head dim 64 or 128)")
            try:
                out = fwd.empty_output(c.B, c.H, c.N, c.D, q)
                flagged = int(program.hopper(q, k, v, out, out, 1).sum())
                note = f"diff {relerr(out, generic_out):.1e}" + (f", {flagged} flagged" if flagged else "")
                results.append((bench_ms(lambda: RUNNERS["elsa"](q, k, v, False)), cfg, note))
            except Exception as exc:  # noqa: BLE001 - configs the compiler rejects are listed
                results.append((math.inf, cfg, type(exc).__name__))
    finally:
        for table, old in zip((sm90.CONFIGS, sm90.LARGE), saved):
            table.clear()
            table.update(old)
        fwd._PROGRAMS.clear()
    results.sort(key=lambda r: r[0])
    ranking = " | ".join(f"{cfg}: {ms:.4f} ms ({cudnn / ms:.3f}x cuDNN, {note})" for ms, cfg, note in results)
    print(f"TUNE-HOPPER {dname} {c}: cuDNN {cudnn:.4f} ms ({flops / cudnn / 1e9:.0f} TF/s), generic "
          f"{generic:.4f} ms ({cudnn / generic:.3f}x) | {ranking}", flush=True)


def parse_case(s: str) -> Case:
    parts = s.split(",")
    if len(parts) not in (4, 5):
        raise argparse.ArgumentTypeError(f"shape must be B,H,N,D[,causal], got {s!r}")
    return Case(*(int(x) for x in parts[:4]), causal=len(parts) == 5 and parts[4] in ("1", "causal", "c"))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
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
    ap.add_argument("--no-graph", action="store_true",
                    help="eager times only: skip the CUDA-graph replays (graph_ms column)")
    ap.add_argument(
        "--out", default=None, help="CSV path (default logs/benchmarks/attention_<gpu>.csv)"
    )
    ap.add_argument("--png", default=None, help="plot path (default logs/benchmarks/attention_<gpu>.png)")
    ap.add_argument("--tune", action="store_true", help="time the candidate kernel configs instead")
    ap.add_argument("--tune-hopper", action="store_true",
                    help="time the Hopper forward's configs (HOPPER_CANDIDATES, or --configs as BLOCK_N,"
                         "STAGES,CONSUMERS) against cuDNN and the generic kernel instead")
    ap.add_argument("--tune-precisions", nargs="+", default=["tf32x3", "ieee", "tf32"],
                    help="float32 precisions to tune (any of auto, ieee, tf32x3, fp16x3, tf32)")
    ap.add_argument(
        "--configs",
        nargs="+",
        default=None,
        help="BLOCK_M,BLOCK_N,warps,stages configs to time with --tune (default: the pruned candidates)",
    )
    ap.add_argument("--plot-only", default=None, help="only draw the plot of an existing CSV")
    args = ap.parse_args(argv)
    if args.plot_only:
        gpu = Path(args.plot_only).stem.split("_")[-1]
        plot(args.plot_only, args.png or LOGS / f"attention_{gpu}.png")
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks.attention needs a CUDA GPU")
    global GRAPH
    GRAPH = not args.no_graph
    cases = args.shapes or (QUICK if args.quick else SHAPES)
    if args.causal:
        cases = cases + [Case(c.B, c.H, c.N, c.D, True) for c in cases]
    if args.tune:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else None
        tune(cases, args.dtype, args.tune_precisions, configs)
        return
    if args.tune_hopper:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else None
        tune_hopper(cases, args.dtype, configs)
        return
    gpu = device_tag("cuda")
    autotune = [(a.split(":")[0], int(a.split(":")[1]), a.split(":")[2]) for a in args.autotune]
    meta = run_info("cuda", __file__, argv)
    with Results(args.out or LOGS / f"attention_{gpu}.csv", COLUMNS, meta) as out:
        rows = run_sweep(cases, args.dtype, args.peers, out, args.flex_shapes, autotune, args.backward)
    print(f"wrote {out.path}")
    ratio_table(rows)
    with contextlib.suppress(ImportError):
        plot(out.path, args.png or LOGS / f"attention_{gpu}.png")


if __name__ == "__main__":
    main()
