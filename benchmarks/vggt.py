"""VGGT global attention and multi-frame inference: ELSA vs PyTorch SDPA, FP32.

Two declared sweeps (``SWEEPS``):

* ``attention``: the aggregator's global attention, ``B = 1``, ``H = 16``, ``D = 64``, ``N = frames × 1041``
  tokens (1041 = camera + 4 registers + 37×28 patches of a 518×392 frame); providers ``elsa``
  (``elsa_attention``, FP32-accurate), ``elsa_tf32x3``, ``sdpa_efficient`` (PyTorch's memory-efficient kernel)
  and ``flex`` (``torch.compile(flex_attention)``) -- plus ``sdpa_math`` where its ``N²`` matrix fits. Median
  time, TFLOP/s (``4·B·H·N²·D``), and ``relerr`` = ‖out − ref‖/‖ref‖ on 256 query rows against a float64
  reference. Target at 100 frames: ELSA >= 2.0× faster than ``sdpa_efficient``.
* ``model``: peak memory and latency of the full ElsaVGGT multi-frame forward (``torch.no_grad``, FP32) at
  100 frames of 518×392 -- the small config with ``img_size = 518`` (target < 40 GB) and, with ``--full``,
  VGGT-1B (``elsa_vggt``, random weights).

With ``--scale``, the sweep at the sizes VGGT's users ask for instead: VGGT-1B (``elsa_vggt``, random FP32
weights) on 336×518 frames (VGGT's own timing table), ``torch.no_grad``, at 1, 20, 100, 200, 500 and 1000
frames (``--frames`` picks some), in bf16 autocast (every frame count) and FP32 (FP32-accurate, 100 frames):
the aggregator alone and the whole model (camera and depth heads), each with ELSA attention and with the
same model's attention swapped for ``F.scaled_dot_product_attention`` (cuDNN / flash / memory-efficient
backends: PyTorch's fastest exact attention), both chunked alike (``ElsaVGGT.set_chunks(32, 65536)``). Per
run: seconds (median of the repeats after a warm-up; one cold run at 200 frames and more), the peak of
allocated memory (weights and inputs included) and the weights' share; a run that does not fit says so.
``--frames``, ``--parts``, ``--providers`` and ``--dtypes`` pick cases (a 1000-frame pass takes minutes); each
row is written as it is measured.

TF32 matmuls are disabled for the whole run (FP32 means IEEE-accurate FP32 here).

    python -m benchmarks.vggt                 # CUDA: the targets above
    python -m benchmarks.vggt --full          # also VGGT-1B at 100 frames
    python -m benchmarks.vggt --scale --frames 1,20,100   # VGGT-1B at scale (split the frames over runs)
    python -m benchmarks.vggt --scale --frames 1000 --parts aggregator --providers elsa   # one run of it
    python -m benchmarks.vggt --quick         # CPU smoke run: tiny shapes, torch backend
    python -m benchmarks.vggt --scale --quick # CPU smoke run of the scale sweep

Rows go to ``logs/benchmarks/vggt_<device>.csv`` (or ``--out``); the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from benchmarks.common import (
    Results,
    add_out_dir,
    bench_ms,
    columns,
    device_tag,
    flex,
    peak_mb,
    reference,
    relerr,
    run_info,
    sdpa,
)
from elsa_vision.layers import ElsaAttention
from elsa_vision.models.vggt import ElsaVGGT
from elsa_vision.ops.attention import elsa_attention

TOKENS_PER_FRAME = 1041  # 1 camera + 4 register + 37·28 patches (518×392)
COLUMNS = columns("kind", "frames", "tokens", "heads", "head_dim", "provider", "ms", "tflops", "relerr",
                  "extra_mb", "speedup_vs_sdpa_efficient", "config", "hw", "backend", "params_m", "peak_gb",
                  "finite", "error", "part", "dtype", "weights_gb")


@dataclass(frozen=True)
class AttnCase:
    frames: int
    tokens_per_frame: int = TOKENS_PER_FRAME
    heads: int = 16
    head_dim: int = 64
    providers: tuple[str, ...] = ("elsa", "elsa_tf32x3", "sdpa_efficient", "flex")


@dataclass(frozen=True)
class ModelCase:
    config: str
    frames: int
    height: int = 392
    width: int = 518
    overrides: tuple = ()
    backend: str = "triton"  # elsa_attention backend on CUDA ("torch": the chunked reference scan)


SWEEPS = {
    "attention": [AttnCase(f) for f in (10, 25, 50, 100)]
    + [AttnCase(4, providers=("elsa", "sdpa_efficient", "sdpa_math"))],
    "model": [
        ModelCase("elsa_vggt_small", 25, overrides=(("img_size", 518),)),
        ModelCase("elsa_vggt_small", 100, overrides=(("img_size", 518),)),
        # the same forward through the reference scan (head dim 12 may be outside the Triton kernels' range)
        ModelCase("elsa_vggt_small", 100, overrides=(("img_size", 518),), backend="torch"),
    ],
    "model_full": [ModelCase("elsa_vggt", 100)],
    "attention_quick": [
        AttnCase(1, 97, 2, 64, ("elsa", "sdpa_default")),
        AttnCase(2, 97, 2, 64, ("elsa", "sdpa_default")),
    ],
    "model_quick": [ModelCase("elsa_vggt_small", 2, 56, 56), ModelCase("elsa_vggt_small", 4, 56, 70)],
}


@dataclass(frozen=True)
class ScaleCase:
    frames: int
    dtype: str  # "bf16" (autocast over FP32 weights) or "fp32" (FP32-accurate)
    part: str  # "aggregator" or "model" (aggregator, camera and depth heads)
    attention: str  # "elsa" or "sdpa" (the same model, attention through F.scaled_dot_product_attention)
    config: str = "elsa_vggt"
    height: int = 336
    width: int = 518
    repeats: int = 2  # timed runs after one warm-up; 1: one cold run


def _scale_sweep() -> list[ScaleCase]:
    cases = []
    for f in (1, 20, 100, 200, 500, 1000):
        repeats = 2 if f <= 100 else 1
        for part in ("aggregator", "model"):
            for attention in ("elsa", "sdpa"):
                cases.append(ScaleCase(f, "bf16", part, attention, repeats=repeats))
    cases += [ScaleCase(100, "fp32", "aggregator", a) for a in ("elsa", "sdpa")]
    cases.append(ScaleCase(100, "fp32", "model", "elsa"))
    return cases


SCALE = {
    "scale": _scale_sweep(),
    "scale_quick": [ScaleCase(f, d, part, a, config="elsa_vggt_small", height=56, width=70)
                    for f in (1, 3) for d in ("bf16", "fp32") for part in ("aggregator", "model")
                    for a in ("elsa", "sdpa")],  # fmt: skip
}
SCALE_CHUNKS = {"frames": 32, "tokens": 65536}


def _sdpa_attend(self, x, q, k, v, attn_mask, causal, rotated):
    """``ElsaAttention._attend`` through ``F.scaled_dot_product_attention`` (the peer of the scale sweep);
    on CUDA restricted to the cuDNN, flash and memory-efficient backends (no ``N^2`` score matrix)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def call():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask, is_causal=causal,
                                              scale=self.scale)

    if q.is_cuda:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION,
                          SDPBackend.EFFICIENT_ATTENTION]):  # fmt: skip
            return call()
    return call()


@contextmanager
def sdpa_attention(model: torch.nn.Module):
    """Every ``ElsaAttention`` of ``model`` attends through SDPA inside the block (same weights, same
    projections, norms and RoPE)."""
    layers = [m for m in model.modules() if isinstance(m, ElsaAttention)]
    for m in layers:
        m._attend = types.MethodType(_sdpa_attend, m)
    try:
        yield
    finally:
        for m in layers:
            del m._attend


def bench_scale(case: ScaleCase, model: ElsaVGGT, device: str) -> dict:
    """One run of the scale sweep on ``model`` (built once per config)."""
    p = model.patch_size
    per_frame = model.aggregator.patch_start_idx + (case.height // p) * (case.width // p)
    weights = sum(t.numel() * t.element_size() for t in model.parameters())
    row = {"kind": "scale", "config": case.config, "frames": case.frames, "hw": f"{case.height}x{case.width}",
           "part": case.part, "dtype": case.dtype, "provider": case.attention,
           "tokens": case.frames * per_frame, "weights_gb": round(weights / 2**30, 3)}  # fmt: skip
    cuda = device == "cuda"
    attention = sdpa_attention(model) if case.attention == "sdpa" else nullcontext()
    autocast = torch.autocast(device, torch.bfloat16, enabled=case.dtype == "bf16")
    x = None
    try:
        x = torch.rand(1, case.frames, 3, case.height, case.width, device=device)

        def run():
            out = model.aggregator(x)[0] if case.part == "aggregator" else model(x)
            if cuda:
                torch.cuda.synchronize()
            return out

        with torch.no_grad(), attention, autocast:
            if case.repeats > 1:
                run()  # warm-up: compilation and the allocator's blocks
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            times, out = [], None
            for _ in range(case.repeats):
                out = None
                t0 = time.perf_counter()
                out = run()
                times.append(time.perf_counter() - t0)
        row["ms"] = round(statistics.median(times) * 1e3, 2)
        if cuda:
            row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
        last = [t for t in out if t is not None][-1] if case.part == "aggregator" else out["depth"]
        row["finite"] = bool(torch.isfinite(last).all())
    except torch.OutOfMemoryError as exc:
        row["error"] = f"out of memory: {str(exc).splitlines()[0][:160]}"
    except Exception as exc:  # noqa: BLE001 - any failure of one case is recorded, the sweep goes on
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    finally:
        out = x = None
        if cuda:
            torch.cuda.empty_cache()
    return row


def _attention_fn(provider: str, q, k, v, device: str):
    backend = "triton" if device == "cuda" else "torch"
    if provider == "elsa":
        return lambda: elsa_attention(q, k, v, backend=backend, precision="auto")
    if provider == "elsa_tf32x3":
        return lambda: elsa_attention(q, k, v, backend=backend, precision="tf32x3")
    if provider in ("sdpa_efficient", "sdpa_math"):
        call = sdpa(provider)
        return lambda: call(q, k, v)
    if provider == "flex":
        if device != "cuda":
            raise ValueError("flex is timed on CUDA only")
        call = flex()
        return lambda: call(q, k, v)
    if provider == "sdpa_default":
        return lambda: F.scaled_dot_product_attention(q, k, v)
    raise ValueError(f"unknown provider {provider!r}")


def bench_attention(case: AttnCase, device: str, reps: int) -> list[dict]:
    n = case.frames * case.tokens_per_frame
    g = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(1, case.heads, n, case.head_dim, device=device, generator=g) for _ in range(3))
    rows_ref = min(256, n)
    ref = reference(q, k, v, rows=torch.arange(rows_ref))[0]  # float64, the first 256 query rows
    flops = 4 * case.heads * n * n * case.head_dim
    rows = []
    for prov in case.providers:
        if prov == "sdpa_math" and case.heads * n * n * 4 > 20e9:
            continue
        try:
            fn = _attention_fn(prov, q, k, v, device)
            fn()  # warm-up: compilation, then the memory of a steady call
            extra_mb, out = peak_mb(fn, device, extra=True)
            ms = bench_ms(fn, device, rep=max(100, reps * 10), cpu_reps=reps)
        except (RuntimeError, ImportError, ValueError) as exc:  # a provider that does not cover the case
            rows.append(
                {
                    "kind": "attention",
                    "frames": case.frames,
                    "tokens": n,
                    "provider": prov,
                    "error": f"{type(exc).__name__}: {str(exc)[:160]}",
                }
            )
            continue
        err = relerr(out[:, :, :rows_ref], ref)
        rows.append(
            {
                "kind": "attention",
                "frames": case.frames,
                "tokens": n,
                "heads": case.heads,
                "head_dim": case.head_dim,
                "provider": prov,
                "ms": round(ms, 4),
                "tflops": round(flops / ms / 1e9, 2),
                "relerr": f"{err:.2e}",
                "extra_mb": round(extra_mb, 1),
            }
        )
    base = {r["frames"]: r["ms"] for r in rows if r.get("provider") == "sdpa_efficient" and "ms" in r}
    for r in rows:
        if r.get("provider") != "sdpa_efficient" and "ms" in r and r["frames"] in base:
            r["speedup_vs_sdpa_efficient"] = round(base[r["frames"]] / r["ms"], 3)
    return rows


def bench_model(case: ModelCase, device: str, reps: int) -> dict:
    torch.manual_seed(0)
    model = ElsaVGGT.from_config(case.config, **dict(case.overrides))
    backend = case.backend if device == "cuda" else "torch"
    model.set_attention(backend=backend)
    model = model.to(device).eval()
    x = torch.rand(1, case.frames, 3, case.height, case.width, device=device)
    row = {
        "kind": "model",
        "config": case.config,
        "frames": case.frames,
        "hw": f"{case.height}x{case.width}",
        "backend": backend,
        "tokens": case.frames
        * (1 + model.config["num_register_tokens"] + (case.height // 14) * (case.width // 14)),
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 2),
    }
    try:
        with torch.no_grad():
            peak, out = peak_mb(lambda: model(x), device)
            if device == "cuda":
                row["peak_gb"] = round(peak / 2**10, 3)
            row["ms"] = round(bench_ms(lambda: model(x), device, rep=max(100, reps * 10), cpu_reps=reps), 2)
            row["finite"] = bool(torch.isfinite(out["depth"]).all() and torch.isfinite(out["pose_enc"]).all())
    except (RuntimeError, ImportError, ValueError) as exc:
        row["error"] = f"{type(exc).__name__}: {str(exc)[:160]}"
    model.cpu()
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="CPU smoke run with tiny shapes")
    ap.add_argument("--full", action="store_true", help="also VGGT-1B at 100 frames")
    ap.add_argument("--scale", action="store_true",
                    help="only the scale sweep: VGGT-1B at 1-1000 frames of 336x518, ELSA vs SDPA")
    ap.add_argument("--frames", default=None, help="scale sweep: comma list of frame counts (default all)")
    ap.add_argument("--parts", default=None,
                    help="scale sweep: comma list of aggregator, model (default both)")
    ap.add_argument("--providers", default=None, help="scale sweep: comma list of elsa, sdpa (default both)")
    ap.add_argument("--dtypes", default=None, help="scale sweep: comma list of bf16, fp32 (default both)")
    ap.add_argument("--device", default=None)
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions; with --scale: timed runs after one warm-up at every size "
                    "(default 2 up to 100 frames, one cold run above)")
    add_out_dir(ap)
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    reps = args.reps or (3 if args.quick else 10)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if args.scale:
        return _main_scale(args, device, argv)
    for flag in ("frames", "parts", "providers", "dtypes"):
        if getattr(args, flag) is not None:
            raise SystemExit(f"--{flag} goes with --scale")
    attn_cases = SWEEPS["attention_quick" if args.quick else "attention"]
    model_cases = SWEEPS["model_quick" if args.quick else "model"] + (
        SWEEPS["model_full"] if args.full else []
    )
    rows = []
    for c in attn_cases:
        for r in bench_attention(c, device, reps):
            rows.append(r)
            print(r, flush=True)
    for c in model_cases:
        r = bench_model(c, device, max(1, reps // 3))
        rows.append(r)
        print(r, flush=True)
    meta = run_info(device, __file__, argv)
    path = args.out / f"vggt_{device_tag(device)}{'_quick' if args.quick else ''}.csv"
    with Results(path, COLUMNS, meta) as out:
        out.write_all(rows)
    top = max((r["frames"] for r in rows if r["kind"] == "attention" and "ms" in r), default=None)
    speed = [
        r for r in rows if r["kind"] == "attention" and r.get("frames") == top and r.get("provider") == "elsa"
    ]
    summary = {
        **meta,
        "csv": str(path),
        "max_frames": top,
        "elsa_speedup_vs_sdpa_efficient": speed[0].get("speedup_vs_sdpa_efficient") if speed else None,
        "model": [
            {k: r.get(k) for k in ("config", "frames", "backend", "peak_gb", "ms", "error") if k in r}
            for r in rows
            if r["kind"] == "model"
        ],
    }
    print(json.dumps(summary))
    return summary



def _pick(cases: list[ScaleCase], flag: str, field: str, value: str | None) -> list[ScaleCase]:
    """The ``cases`` whose ``field`` is in the comma list ``value`` of ``--flag`` (None: all)."""
    if value is None:
        return cases
    known = sorted({getattr(c, field) for c in cases})
    try:
        wanted = {type(known[0])(v.strip()) for v in value.split(",") if v.strip()}
    except ValueError:
        raise SystemExit(f"--{flag}: expected a comma list of integers, got {value!r}") from None
    if not wanted or not wanted <= set(known):
        raise SystemExit(f"--{flag}: expected some of {known}, got {value!r}")
    return [c for c in cases if getattr(c, field) in wanted]


def _main_scale(args, device: str, argv: list[str]) -> dict:
    cases = SCALE["scale_quick" if args.quick else "scale"]
    picks = (("frames", "frames"), ("parts", "part"), ("providers", "attention"), ("dtypes", "dtype"))
    for flag, field in picks:
        cases = _pick(cases, flag, field, getattr(args, flag))
    if not cases:
        raise SystemExit("no case of the scale sweep has these --frames, --parts, --providers and --dtypes")
    if args.reps is not None:  # timed runs after one warm-up at every size (1: one cold run)
        if args.reps < 1:
            raise SystemExit(f"--reps must be >= 1, got {args.reps}")
        cases = [replace(c, repeats=args.reps) for c in cases]
    meta = run_info(device, __file__, argv)
    path = args.out / f"vggt_scale_{device_tag(device)}{'_quick' if args.quick else ''}.csv"
    models = {}
    with Results(path, COLUMNS, meta) as out:  # each row written as it is measured
        for case in cases:
            if case.config not in models:
                models = {}
                torch.manual_seed(0)
                model = ElsaVGGT.from_config(case.config)
                model.set_attention(backend="triton" if device == "cuda" else "torch")
                model.set_chunks(**SCALE_CHUNKS)
                models = {case.config: model.to(device).eval()}  # one model on the device at a time
            row = bench_scale(case, models[case.config], device)
            out.write(row)
            print(json.dumps(row), flush=True)
        rows = out.rows
    failed = [f"{r['frames']} {r['dtype']} {r['part']} {r['provider']}" for r in rows if "error" in r]
    summary = {**meta, "csv": str(path), "runs": len(rows), "failed": failed}
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main()
