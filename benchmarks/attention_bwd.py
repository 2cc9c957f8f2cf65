"""Backward benchmark: ELSA's Triton backward next to the peers' forward+backward, in one run on one GPU.

Rows (CSV ``logs/benchmarks/attention_bwd_<gpu>.csv``, ignored by git; ``--out DIR`` another directory)::

    device,torch,triton,date,B,H,N,D,dtype,peer,pass,ms,tflops,extra_mb,relerr,graph_ms,command

    python -m benchmarks.attention_bwd                                  # the declared sweep
    python -m benchmarks.attention_bwd --dtypes bfloat16 --peers sdpa_cudnn elsa elsa_generic  # Hopper A/B
    python -m benchmarks.attention_bwd --dtypes float32 --peers sdpa_efficient elsa --tiles
    python -m benchmarks.attention_bwd --tune-hopper --dtypes bfloat16 --shapes 1,8,16384,64 1,8,4096,128

* ``pass=fwdbwd``: a peer's forward + ``backward`` (``sdpa_math``, ``sdpa_efficient``, ``sdpa_flash``,
  ``sdpa_cudnn`` through ``torch.nn.attention.sdpa_kernel``; ``flex`` = ``torch.compile(flex_attention)``).
* ``pass=bwd``: backward only. For a peer: its forward+backward minus its forward (both medians). For
  ``elsa*``: ``elsa_bwd`` given the saved ``(out, lse)`` (the dQ kernel, which forms ``Delta``, then dK/dV),
  precision ``auto`` (``elsa``: ``fp16x3`` on sm90, else ``tf32x3``), ``tf32x3``, ``ieee``, ``tf32``;
  ``elsa_generic`` (named with ``--peers``): ``elsa`` on the generic kernels where the Hopper backward
  (``kernels/bwd_sm90.py``: half precision, and float32's five-product kernel) would run
  (``benchmarks.common.generic_kernels``).

Timing (``benchmarks.common.timings``): ``ms``, the eager call (``triton.testing.do_bench`` median), and
``graph_ms``, CUDA-graph replays of the same call (the GPU's time alone), side by side. TFLOP/s counts ``4 B H
N^2 D`` per forward and 2.5x that per backward (five N^2 D products), i.e. ``14 B H N^2 D`` for fwd+bwd.
``extra_mb``: peak allocation above the inputs during the pass (outputs and workspace included). ``relerr``:
max over dq, dk, dv of ``||g - g64|| / ||g64||`` on the first head of the first batch, g64 the float64
reference. float32 matmul TF32 is disabled for the peers, as in the forward benchmark.

Sweep declared below (``SHAPES``, ``DTYPES``, ``PEERS``); ``--tiles`` also times a list of tile configs of
the ELSA backward per case (printed, not written to the CSV) to choose ``bwd_config``'s defaults.
``--tune-hopper`` times the Hopper backward's configs instead (``bwd_sm90.CONFIGS`` of the two passes and
``bwd_sm90.FUSED_CONFIGS`` of the five-product backward: streamed rows and stages;
``HOPPER_CANDIDATES`` or ``--configs``) against the generic kernels and cuDNN, per pass.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from dataclasses import asdict, replace

import torch

from benchmarks.common import (
    Results,
    add_out_dir,
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

SHAPES = [(1, 8, 4096, 64), (1, 8, 16384, 64), (8, 12, 785, 64)]
DTYPES = ["float32", "bfloat16"]
PEERS = ["sdpa_math", "sdpa_efficient", "sdpa_flash", "sdpa_cudnn", "flex", "elsa", "elsa_tf32x3",
         "elsa_ieee", "elsa_tf32"]
ELSA = {"elsa": "auto", "elsa_tf32x3": "tf32x3", "elsa_ieee": "ieee", "elsa_tf32": "tf32",
        "elsa_generic": "auto"}
TILES = {  # candidate (dkdv BM, BN, warps, stages; dq BM, BN, warps, stages), per dtype
    "float32": [
        (64, 128, 8, 3, 128, 128, 8, 2),
        (64, 64, 4, 2, 64, 64, 4, 2),
        (32, 128, 8, 3, 128, 32, 8, 3),
        (64, 128, 8, 2, 128, 64, 8, 2),
        (64, 128, 8, 3, 128, 64, 8, 3),
        (32, 64, 4, 2, 64, 32, 4, 2),
        (32, 128, 8, 2, 128, 32, 8, 2),
        (32, 128, 4, 3, 128, 32, 4, 3),
        (64, 64, 4, 2, 128, 64, 8, 2),
        (64, 64, 4, 3, 64, 64, 4, 3),
        (64, 128, 4, 2, 128, 64, 4, 2),
        (64, 64, 4, 3, 128, 64, 8, 3),
        (32, 64, 4, 2, 128, 64, 8, 2),
        (32, 128, 8, 3, 128, 32, 8, 3),
    ],
    "bfloat16": [
        (32, 128, 4, 3, 128, 32, 4, 3),
        (32, 128, 4, 4, 128, 32, 4, 4),
        (32, 128, 4, 5, 128, 32, 4, 5),
        (64, 128, 4, 3, 128, 64, 4, 3),
        (32, 128, 4, 3, 128, 64, 4, 3),
        (64, 128, 8, 3, 128, 64, 8, 3),
        (32, 128, 4, 3, 128, 64, 8, 3),
        (64, 64, 4, 3, 64, 64, 4, 3),
        (32, 64, 4, 3, 64, 32, 4, 3),
        (64, 128, 8, 2, 128, 64, 8, 2),
        (32, 128, 4, 3, 64, 64, 4, 3),
        (64, 64, 4, 3, 128, 32, 4, 3),
    ],
}
COLUMNS = columns("B", "H", "N", "D", "dtype", "peer", "pass", "ms", "tflops", "extra_mb", "relerr",
                  "graph_ms")


def _peer_fn(peer):
    return flex() if peer == "flex" else sdpa(peer)


def _time_peer(f, q, k, v, do, refs):
    """(fwd+bwd timings, fwd timings with autograd recording, fwd+bwd extra MB, relerr) of one peer;
    timings: ``{"ms", "graph_ms"}`` (``benchmarks.common.timings``)."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def fwd():
        return f(qg, kg, vg)

    def fwdbwd():
        qg.grad = kg.grad = vg.grad = None
        out = f(qg, kg, vg)
        out.backward(do)
        return out

    fwdbwd()
    err = max_grad_relerr([qg.grad, kg.grad, vg.grad], refs)
    t_fb = timings(fwdbwd)
    qg.grad = kg.grad = vg.grad = None
    extra = peak_mb(fwdbwd, "cuda", extra=True)[0]
    t_f = timings(fwd)  # the forward half of a training step (autograd records)
    return t_fb, t_f, extra, err


def run_case(B, H, N, D, dtype_name, peers, tiles, results: Results, configs=None):
    from elsa_vision.kernels.bwd import bwd_config, elsa_bwd
    from elsa_vision.kernels.precision import resolve_precision
    from elsa_vision.kernels.reference import scan_attention

    dtype = getattr(torch, dtype_name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, generator=gen) for _ in range(4))
    fl_fwd = 4.0 * B * H * N * N * D
    fl_bwd = 2.5 * fl_fwd
    refs = reference(q[:1, :1], k[:1, :1], v[:1, :1], dout=do[:1, :1])[1]  # float64, batch 0, head 0
    torch.cuda.empty_cache()

    bwd_times = {}  # peer -> backward timings, for the closing ratios

    def add(peer, pas, t, flops, extra, err):
        ms, graph = t["ms"], t["graph_ms"]
        if pas == "bwd":
            bwd_times[peer] = t
        results.write({"pass": pas}, B=B, H=H, N=N, D=D, dtype=dtype_name, peer=peer, ms=f"{ms:.4f}",
                      tflops=f"{flops / ms / 1e9:.2f}", extra_mb="" if extra is None else f"{extra:.1f}",
                      relerr="" if err is None else f"{err:.3e}",
                      graph_ms="" if graph != graph else f"{graph:.4f}")
        nan = float("nan")
        print(f"{B},{H},{N},{D} {dtype_name:9s} {peer:15s} {pas:7s} {ms:9.3f} ms (graph {graph:9.3f}) "
              f"{flops / ms / 1e9:7.1f} TFLOP/s extra {nan if extra is None else extra:8.1f} MB "
              f"relerr {nan if err is None else err:.2e}", flush=True)

    for peer in peers:
        if peer in ELSA:
            continue
        if peer in ("sdpa_flash", "sdpa_cudnn") and dtype == torch.float32:
            continue  # float32 is not supported by these backends
        if peer == "sdpa_math" and N > 8192:
            continue  # materialises several [B, H, N, N] float tensors
        try:
            t_fb, t_f, extra_fb, err = _time_peer(_peer_fn(peer), q, k, v, do, refs)
            add(peer, "fwdbwd", t_fb, fl_fwd + fl_bwd, extra_fb, err)
            add(peer, "bwd", {key: t_fb[key] - t_f[key] for key in t_fb}, fl_bwd, None, err)
        except Exception as exc:  # a backend that refuses the case is reported, not fatal
            print(f"{B},{H},{N},{D} {dtype_name} {peer}: skipped ({type(exc).__name__}: {str(exc)[:120]})",
                  flush=True)
        torch.cuda.empty_cache()

    with torch.no_grad():
        out, lse = scan_attention(q.float(), k.float(), v.float(), query_chunk=1024, return_lse=True)
    out = out.to(dtype)
    torch.cuda.empty_cache()
    for peer in peers:
        if peer not in ELSA or (peer in ("elsa_tf32x3", "elsa_ieee", "elsa_tf32") and dtype != torch.float32):
            continue
        precision = ELSA[peer]
        cfg = (configs or {}).get(dtype_name)

        def bwd(precision=precision, cfg=cfg, generic=peer == "elsa_generic"):
            with generic_kernels() if generic else contextlib.nullcontext():
                return elsa_bwd(do, q, k, v, out, lse, precision=precision, config=cfg)

        try:
            grads = bwd()
            err = max_grad_relerr(grads[:3], refs)
            del grads
            t = timings(bwd)
            add(peer, "bwd", t, fl_bwd, peak_mb(bwd, "cuda", extra=True)[0], err)
        except Exception as exc:  # reported, so that one failing variant does not lose the run
            print(f"{B},{H},{N},{D} {dtype_name} {peer}: FAILED ({type(exc).__name__}: {str(exc)[:160]})",
                  flush=True)

    for elsa in (p for p in ELSA if p in bwd_times):
        e = bwd_times[elsa]
        parts = [f"{p} {t['ms'] / e['ms']:.2f}x (graph {t['graph_ms'] / e['graph_ms']:.2f}x)"
                 for p, t in bwd_times.items() if p not in ELSA]
        if parts:
            print(f"  backward, peer / {elsa}: " + ", ".join(parts), flush=True)

    best = None
    if tiles:
        prec = resolve_precision("auto", dtype, q.device, "bwd", D)
        base = bwd_config(dtype, D, D, q.device, prec, n_k=N, heads=B * H)
        print(f"  default tiles {base}")
        for t in tiles:
            cfg = replace(base, block_m1=t[0], block_n1=t[1], warps1=t[2], stages1=t[3], block_m2=t[4],
                          block_n2=t[5], warps2=t[6], stages2=t[7])
            try:
                fn = lambda cfg=cfg: elsa_bwd(do, q, k, v, out, lse, config=cfg)  # noqa: E731
                err = max_grad_relerr(fn()[:3], refs)
                ms = bench_ms(fn)
                print(f"  tiles {t}: {ms:8.3f} ms relerr {err:.2e}", flush=True)
                if best is None or ms < best[0]:
                    best = (ms, cfg)
            except Exception as exc:
                print(f"  tiles {t}: failed ({type(exc).__name__}: {str(exc)[:100]})", flush=True)
        print(f"  best {best}", flush=True)
    return best


# --tune-hopper's default candidates per head dim: (BLOCK_S, STAGES) of ``bwd_sm90.CONFIGS``
HOPPER_CANDIDATES = {
    64: [(128, 2), (64, 2), (128, 3)],
    128: [(64, 2), (32, 2), (64, 3)],
}


def tune_hopper(shapes, dtypes, configs=None):
    """Time ``bwd_sm90``'s configs (``HOPPER_CANDIDATES``, or ``configs``) of the two passes and of the
    five-product backward on each half-precision case, next to the generic kernels and cuDNN's backward (its
    forward + backward minus its forward) in the same process: ``elsa_bwd`` given ``(out, lse)``, GPU time
    (``do_bench``) of the whole backward and (two passes) of each pass alone, the largest relative
    difference of dq, dk, dv to the generic kernels' and the number of 64-row
    tiles flagged for the redo (finite inputs must flag none). One ranking line per (case, dtype)."""
    from elsa_vision.kernels import bwd as bwd_module

    if bwd_module.bwd_sm90 is None:
        raise SystemExit("--tune-hopper needs a Triton with Gluon")
    for dtype_name in dtypes:
        if getattr(torch, dtype_name) != torch.float32:  # the Hopper passes are half precision
            for B, H, N, D in shapes:
                _tune_hopper_case(B, H, N, D, dtype_name, configs)
                torch.cuda.empty_cache()


def _tune_hopper_case(B, H, N, D, dtype_name, configs):
    from elsa_vision.kernels import bwd as bwd_module
    from elsa_vision.kernels.fwd import elsa_fwd

    sm90 = bwd_module.bwd_sm90
    dtype = getattr(torch, dtype_name)
    q, k, v, do = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(4))
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1)
    flops = 10.0 * B * H * N * N * D
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    cudnn = _peer_fn("sdpa_cudnn")

    def cudnn_fwdbwd():
        qg.grad = kg.grad = vg.grad = None
        cudnn(qg, kg, vg).backward(do)

    t_cudnn = bench_ms(cudnn_fwdbwd) - bench_ms(lambda: cudnn(qg, kg, vg))
    bwd = lambda **kw: _bwd(do, q, k, v, out, lse, **kw)  # noqa: E731
    with generic_kernels():
        generic = bwd()
        t_generic = bench_ms(bwd)
    results = []
    # the two passes (bwd_sm90.CONFIGS; each pass alone too), then the five-product one (FUSED_CONFIGS)
    for fused, table in ((False, sm90.CONFIGS), (True, sm90.FUSED_CONFIGS)):
        saved, was = dict(table), bwd_module.HOPPER_FUSED
        bwd_module.HOPPER_FUSED = fused
        try:
            for cfg in configs or HOPPER_CANDIDATES.get(D, []):
                table[D] = tuple(cfg)
                bwd_module._PROGRAMS.clear()
                program = bwd_module.bwd_program(do, q, k, v, out, lse)
                routed = program.hopper_fused is not None if fused else (
                    program.hopper_dq is not None and program.hopper_dkdv is not None)
                if not routed:
                    raise SystemExit(f"--tune-hopper: {B},{H},{N},{D} does not take the Hopper backward "
                                     "(bwd.HOPPER_MIN_KEYS, head dim 64 or 128)")
                label = ("fused", *cfg) if fused else ("two", *cfg)
                try:
                    grads = bwd()
                    diff = max(relerr(g, r.double()) for g, r in zip(grads, generic))  # every head
                    outs = (torch.empty_like(g) for g in grads)
                    flags = program.run_hopper(do, q, k, v, out, lse, delta, *outs)
                    flagged = sum(int(f.sum()) for f in flags)
                    note = f"diff {diff:.1e}" + (f", {flagged} flagged" if flagged else "")
                    if not fused:
                        t_dq = bench_ms(lambda: bwd(compute_dkdv=False))
                        t_kv = bench_ms(lambda: bwd(compute_dq=False))
                        note = f"dQ {t_dq:.4f}, dK/dV {t_kv:.4f}, " + note
                    results.append((bench_ms(bwd), label, note))
                except Exception as exc:  # noqa: BLE001 - configs the compiler rejects are listed
                    results.append((math.inf, label, f"{type(exc).__name__}: {str(exc)[:80]}"))
        finally:
            table.clear()
            table.update(saved)
            bwd_module.HOPPER_FUSED = was
            bwd_module._PROGRAMS.clear()
    results.sort(key=lambda r: r[0])
    ranking = " | ".join(f"{cfg}: {ms:.4f} ms ({flops / ms / 1e9:.0f} TF/s, {t_cudnn / ms:.3f}x cuDNN, "
                         f"{t_generic / ms:.3f}x generic; {note})" for ms, cfg, note in results)
    print(f"TUNE-HOPPER {dtype_name} {B},{H},{N},{D}: cuDNN bwd {t_cudnn:.4f} ms, generic {t_generic:.4f} "
          f"ms | {ranking}", flush=True)


def _bwd(do, q, k, v, out, lse, **kw):
    """``(dq, dk, dv)`` of ``elsa_bwd`` given the saved ``(out, lse)`` (``None`` for a pass not run)."""
    from elsa_vision.kernels.bwd import elsa_bwd

    return elsa_bwd(do, q, k, v, out, lse, **kw)[:3]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="*", default=[",".join(map(str, s)) for s in SHAPES],
                    help="B,H,N,D ...")
    ap.add_argument("--dtypes", nargs="*", default=DTYPES)
    ap.add_argument("--peers", nargs="*", default=PEERS)
    ap.add_argument("--tiles", action="store_true", help="also time the candidate tile configs")
    ap.add_argument("--save-best", default=None, help="with --tiles: JSON file for the fastest config")
    ap.add_argument("--config-json", default=None, help="per-dtype BwdConfig JSON for the elsa rows")
    ap.add_argument("--append", action="store_true", help="append to the CSV instead of replacing it")
    ap.add_argument("--tune-hopper", action="store_true",
                    help="time the Hopper backward's configs (HOPPER_CANDIDATES, or --configs as "
                         "BLOCK_S,STAGES) instead of the sweep; printed, nothing written")
    ap.add_argument("--configs", nargs="*", default=None, help="with --tune-hopper: e.g. 64,3 128,2")
    add_out_dir(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("attention_bwd.py needs a CUDA GPU")
    if args.tune_hopper:
        configs = [tuple(int(x) for x in c.split(",")) for c in args.configs] if args.configs else None
        if configs and any(len(c) != 2 for c in configs):
            ap.error("--configs: BLOCK_S,STAGES pairs, e.g. 128,2")
        tune_hopper([tuple(int(x) for x in s.split(",")) for s in args.shapes], args.dtypes, configs)
        return None
    from elsa_vision.kernels.bwd import BwdConfig

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    configs = {}
    if args.config_json:
        with open(args.config_json) as fh:
            configs = {k: BwdConfig(**v) for k, v in json.load(fh).items()}
        print(f"tile configs: {configs}")
    chosen = {}
    meta = run_info("cuda", __file__, argv)
    path = args.out / f"attention_bwd_{device_tag('cuda')}.csv"
    with Results(path, COLUMNS, meta, append=args.append) as out:
        for dtype_name in args.dtypes:
            for s in args.shapes:
                B, H, N, D = (int(x) for x in s.split(","))
                best = run_case(B, H, N, D, dtype_name, args.peers, TILES[dtype_name] if args.tiles else [],
                                out, configs)
                if best is not None and dtype_name not in chosen:
                    chosen[dtype_name] = asdict(best[1])
    if args.tiles and args.save_best:
        with open(args.save_best, "w") as fh:
            json.dump(chosen, fh, indent=1)
        print(f"best tiles -> {args.save_best}: {chosen}")
    print(f"wrote {out.path} ({len(out.rows)} rows)")
    return str(out.path)


if __name__ == "__main__":
    main()
