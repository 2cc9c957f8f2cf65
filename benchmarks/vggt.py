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

TF32 matmuls are disabled for the whole run (FP32 means IEEE-accurate FP32 here).

    python -m benchmarks.vggt                 # CUDA: the targets above
    python -m benchmarks.vggt --full          # also VGGT-1B at 100 frames
    python -m benchmarks.vggt --quick         # CPU smoke run: tiny shapes, torch backend

Rows go to ``logs/benchmarks/vggt_<device>.csv`` (or ``--out``); the last stdout line is a JSON summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass

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
from elsa_vision.models.vggt import ElsaVGGT
from elsa_vision.ops.attention import elsa_attention

TOKENS_PER_FRAME = 1041  # 1 camera + 4 register + 37·28 patches (518×392)
COLUMNS = columns("kind", "frames", "tokens", "heads", "head_dim", "provider", "ms", "tflops", "relerr",
                  "extra_mb", "speedup_vs_sdpa_efficient", "config", "hw", "backend", "params_m", "peak_gb",
                  "finite", "error")


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
    ap.add_argument("--device", default=None)
    ap.add_argument("--reps", type=int, default=None)
    add_out_dir(ap)
    args = ap.parse_args(argv)
    device = args.device or ("cpu" if args.quick or not torch.cuda.is_available() else "cuda")
    reps = args.reps or (3 if args.quick else 10)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
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


if __name__ == "__main__":
    main()
