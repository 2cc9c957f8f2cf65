"""Whole-image high-resolution ViT inference, FP32: ELSA vs timm's stock model (SDPA).

The headline case is ViT-B/16 on a 4096 x 4096 single-channel image: 256 x 256 patches + cls = 65,537 tokens,
global attention in every block. Both models hold the same (random, seeded) weights; the stock model is timm's
``vit_base_patch16_224`` built for the same image size, its attention forced to SDPA's memory-efficient kernel
on CUDA. TF32 is disabled (FP32 end to end). Reported per case: median seconds of one forward, peak allocated
memory, the speed ratio (stock / ELSA), and the deviation of the final tokens.

    python -m benchmarks.highres               # CUDA: the sweep below, CSV in logs/benchmarks/ (or --out)
    python -m benchmarks.highres --quick       # CPU-sized smoke run (tiny ViT, small images)

Goal (H100): 4096^2 ViT-B/16 FP32 with peak memory < 16 GB and >= 2x faster than the stock model.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys

import torch

from benchmarks.common import (
    LOGS,
    Results,
    columns,
    device_tag,
    relerr,
    run_info,
    sdpa_context,
    wall_ms_peak,
)


@dataclasses.dataclass(frozen=True)
class Case:
    model: str
    img_size: int
    in_chans: int = 1
    num_classes: int = 1000


# The declared sweeps: the goal case last, smaller sizes first to show the scaling.
FULL = [
    Case("elsa_vit_base_patch16_224", 1024),
    Case("elsa_vit_base_patch16_224", 2048),
    Case("elsa_vit_base_patch16_224", 4096),
]
QUICK = [
    Case("elsa_vit_tiny_patch16_224", 128),
    Case("elsa_vit_tiny_patch16_224", 256),
]
GOAL = {"img_size": 4096, "peak_mb": 16 * 1024, "speed_ratio": 2.0}
COLUMNS = columns("model", "img_size", "in_chans", "tokens", "precision", "elsa_backend", "elsa_mode",
                  "sdpa_kernel", "elsa_s", "sdpa_s", "speed_ratio", "elsa_peak_mb", "sdpa_peak_mb",
                  "max_abs_dev", "relerr", "repeats")


def run_case(case: Case, dev: torch.device, repeats: int, attn_backend: str) -> dict:
    import timm

    from elsa_vision.inference.highres import build_model, forward_tokens, plan_execution
    from elsa_vision.ops.attention import resolve_backend

    torch.manual_seed(0)
    sd = timm.create_model(case.model, num_classes=case.num_classes, in_chans=case.in_chans).state_dict()
    size = (case.img_size, case.img_size)
    elsa = build_model(case.model, sd, size, attn_backend=attn_backend).to(dev)
    plan = plan_execution(elsa, size, device=dev)
    if plan.mode == "tiled":
        raise RuntimeError(f"{case}: global attention does not fit this device ({plan.reason})")
    x = torch.randn(1, case.in_chans, *size, device=dev)

    def run_elsa():
        with torch.no_grad():
            return forward_tokens(elsa, x, query_chunk=plan.query_chunk)

    elsa_ms, elsa_peak, out = wall_ms_peak(run_elsa, dev, repeats)
    out = out.float().cpu()
    elsa.cpu()  # frees the device for the stock model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    stock = build_model(case.model, sd, size, stock=True).to(dev)
    kernel = "efficient" if dev.type == "cuda" else "default"

    def run_stock():
        with torch.no_grad(), sdpa_context("sdpa_efficient", dev):
            return stock.forward_features(x)

    sdpa_ms, sdpa_peak, ref = wall_ms_peak(run_stock, dev, repeats)
    ref = ref.float().cpu()
    return {
        "model": case.model,
        "img_size": case.img_size,
        "in_chans": case.in_chans,
        "tokens": out.shape[1],
        "precision": "fp32",
        "elsa_backend": resolve_backend(attn_backend, x),
        "elsa_mode": plan.mode,
        "sdpa_kernel": kernel,
        "elsa_s": round(elsa_ms / 1e3, 5),
        "sdpa_s": round(sdpa_ms / 1e3, 5),
        "speed_ratio": round(sdpa_ms / elsa_ms, 3),
        "elsa_peak_mb": round(elsa_peak, 1),
        "sdpa_peak_mb": round(sdpa_peak, 1),
        "max_abs_dev": float((out - ref).abs().max()),
        "relerr": relerr(out, ref),
        "repeats": repeats,
    }


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny ViT at 128/256 px (runs on CPU)")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--attn-backend", default="auto", choices=("auto", "torch", "triton"))
    p.add_argument(
        "--out", default=None, help="CSV path (default logs/benchmarks/highres[_quick]_<device>.csv)"
    )
    args = p.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cases = QUICK if args.quick else FULL
    path = args.out or LOGS / f"highres{'_quick' if args.quick else ''}_{device_tag(dev)}.csv"
    meta = run_info(dev, __file__, argv)
    with Results(path, COLUMNS, meta) as out:
        for case in cases:
            row = out.write(run_case(case, dev, args.repeats, args.attn_backend))
            print(
                f"{row['model']} {row['img_size']}px {row['tokens']} tokens: ELSA {row['elsa_s']:.4f}s "
                f"({row['elsa_peak_mb']} MiB, {row['elsa_backend']}/{row['elsa_mode']}) vs SDPA "
                f"{row['sdpa_s']:.4f}s ({row['sdpa_peak_mb']} MiB) -> {row['speed_ratio']}x, "
                f"max|dev| {row['max_abs_dev']:.2e}, relerr {row['relerr']:.2e}"
            )
    for row in out.rows:
        if row["img_size"] == GOAL["img_size"] and dev.type == "cuda":
            ok = row["elsa_peak_mb"] < GOAL["peak_mb"] and row["speed_ratio"] >= GOAL["speed_ratio"]
            print(f"goal (peak < 16 GB, >= 2x stock): {'MET' if ok else 'NOT MET'}")
    print(f"wrote {out.path}")
    return out.rows


if __name__ == "__main__":
    main()
