"""CLIP image encoder throughput: ElsaCLIPVision vs open_clip's stock VisionTransformer (same weights).

The sweep is declared in ``SWEEPS``; each case builds open_clip's tower at its resolution (random init),
converts it with ``from_open_clip`` (identical weights) and times ``forward`` of both in ``torch.no_grad``.
A third row times the ELSA tower with free attention (``benchmarks/ceiling.py``: every attention returns
``v``): its speedup is the ceiling of the case, the most any attention kernel can give this encoder.
Rows are appended to ``logs/benchmarks/clip_<device>.csv`` (``--out`` another directory) with the median
wall time of a synchronised forward, images/s, the speedup over open_clip and the relative difference of the
two outputs.

    python -m benchmarks.clip                       # CUDA: ViT-L/14, fp32, 336 px and 672 px, batch 8
    python -m benchmarks.clip --device cpu --quick  # smoke run with a tiny tower
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass

import torch

from benchmarks.ceiling import free_attention
from benchmarks.common import Results, add_out_dir, columns, device_tag, relerr, run_info, wall_ms


@dataclass(frozen=True)
class Case:
    name: str  # label of the architecture
    vision_cfg: tuple  # open_clip CLIPVisionCfg fields as (key, value) pairs, without image_size
    embed_dim: int
    image_size: int
    batch: int
    dtype: str = "float32"


_L14 = (("layers", 24), ("width", 1024), ("head_width", 64), ("patch_size", 14))
_TINY = (("layers", 2), ("width", 64), ("head_width", 16), ("patch_size", 8))

SWEEPS = {
    # targets: fp32 ViT-L/14 image encoder at 336 px (577 tokens) and 672 px (2305 tokens), batch 8
    "full": [Case("ViT-L-14", _L14, 768, 336, 8), Case("ViT-L-14", _L14, 768, 672, 8)],
    "quick": [Case("tiny", _TINY, 32, 32, 2), Case("tiny", _TINY, 32, 64, 2)],
}

COLUMNS = columns("arch", "image_size", "tokens", "batch", "dtype", "tf32", "impl", "ms", "images_per_s",
                  "speedup_vs_open_clip", "relerr_vs_open_clip")


def run_case(
    case: Case, device: torch.device, warmup: int, reps: int, backend: str, precision: str
) -> list[dict]:
    from open_clip.model import CLIPVisionCfg, _build_vision_tower

    from elsa_vision.models.clip_vision import from_open_clip

    dtype = getattr(torch, case.dtype)
    torch.manual_seed(0)
    stock = _build_vision_tower(
        case.embed_dim, CLIPVisionCfg(**dict(case.vision_cfg), image_size=case.image_size)
    )
    stock = stock.to(device=device, dtype=dtype).eval()
    elsa = (
        from_open_clip(stock, attn_backend=backend, attn_precision=precision)
        .to(device=device, dtype=dtype)
        .eval()
    )
    x = torch.randn(case.batch, 3, case.image_size, case.image_size, device=device, dtype=dtype)
    with torch.no_grad():
        ref = stock(x)
        err = relerr(elsa(x), ref)
        ms_stock = wall_ms(lambda: stock(x), device, warmup=warmup, reps=reps)
        ms_elsa = wall_ms(lambda: elsa(x), device, warmup=warmup, reps=reps)
        with free_attention():
            ms_free = wall_ms(lambda: elsa(x), device, warmup=warmup, reps=reps)
    patch = dict(case.vision_cfg)["patch_size"]
    common = dict(
        arch=case.name,
        image_size=case.image_size,
        tokens=(case.image_size // patch) ** 2 + 1,
        batch=case.batch,
        dtype=case.dtype,
        tf32=torch.backends.cuda.matmul.allow_tf32 if device.type == "cuda" else False,
    )
    return [
        dict(
            common,
            impl="open_clip",
            ms=round(ms_stock, 3),
            images_per_s=round(case.batch / ms_stock * 1e3, 2),
            speedup_vs_open_clip=1.0,
            relerr_vs_open_clip=0.0,
        ),
        dict(
            common,
            impl=f"elsa[{backend},{precision}]",
            ms=round(ms_elsa, 3),
            images_per_s=round(case.batch / ms_elsa * 1e3, 2),
            speedup_vs_open_clip=round(ms_stock / ms_elsa, 3),
            relerr_vs_open_clip=f"{err:.2e}",
        ),
        dict(
            common,
            impl="ceiling[free attention]",
            ms=round(ms_free, 3),
            images_per_s=round(case.batch / ms_free * 1e3, 2),
            speedup_vs_open_clip=round(ms_stock / ms_free, 3),
            relerr_vs_open_clip="n/a",
        ),
    ]


def main(argv=None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny tower smoke run (any device)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--backend", default="auto", help="elsa_attention backend")
    p.add_argument("--precision", default="auto", help="elsa_attention float32 precision")
    p.add_argument(
        "--tf32", action="store_true", help="allow TF32 matmuls in both models (default: IEEE fp32)"
    )
    add_out_dir(p)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda requested but CUDA is not available (use --device cpu --quick)")
    torch.backends.cuda.matmul.allow_tf32 = a.tf32
    torch.backends.cudnn.allow_tf32 = a.tf32
    cases = SWEEPS["quick" if a.quick else "full"]
    warmup = a.warmup if a.warmup is not None else (1 if a.quick else 5)
    reps = a.reps if a.reps is not None else (3 if a.quick else 20)
    meta = run_info(device, __file__, argv)
    path = a.out / f"clip_{device_tag(device)}{'_quick' if a.quick else ''}.csv"
    with Results(path, COLUMNS, meta, append=True) as out:  # appended: runs with and without --tf32
        for case in cases:
            out.write_all(run_case(case, device, warmup, reps, a.backend, a.precision))
    rows = out.rows
    width = max(len(r["impl"]) for r in rows)
    print(
        f"{'arch':<9} {'px':>4} {'tok':>5} {'B':>2}  {'impl':<{width}} {'ms':>9} {'img/s':>9} "
        f"{'speedup':>7} relerr"
    )
    for r in rows:
        print(
            f"{r['arch']:<9} {r['image_size']:>4} {r['tokens']:>5} {r['batch']:>2}  {r['impl']:<{width}} "
            f"{r['ms']:>9.3f} {r['images_per_s']:>9.2f} {r['speedup_vs_open_clip']:>7.3f} "
            f"{r['relerr_vs_open_clip']}"
        )
    print(f"wrote {os.path.relpath(path)}")
    return rows


if __name__ == "__main__":
    main()
