"""Hyperspectral benchmarks: ElsaHSIViT throughput (ELSA vs SDPA) and FP32 whole-scene inference time.

Two declared sweeps:

* ``THROUGHPUT``: one ``ElsaHSIViT`` per case, built twice with the same weights -- the default attention
  (ElsaAttention, backend ``auto``: Triton on CUDA) and ``attn_layer=timm.layers.Attention`` (run under
  ``sdpa_kernel(EFFICIENT_ATTENTION)`` on CUDA; PyTorch's default CPU kernel on CPU). Patches per second,
  forward (eval, no grad) or a training step (forward + backward), FP32 with TF32 off; ``ceiling`` is the
  SDPA time over the ELSA model's time with free attention (``benchmarks/ceiling.py``), the most any attention
  kernel can give the case.
* ``SCENES``: a synthetic scene (``synthetic_scene``) classified pixel by pixel with
  ``elsa_vision.inference.hsi.predict_scene`` -- the code path of ``python -m elsa_vision.inference.hsi`` --
  timing the batched patch classification of the whole scene and its peak memory.

``--quick`` swaps in small CPU-sized declarations (a smoke run that exercises every path). Both sweeps go to
one JSON file, ``logs/benchmarks/hsi_<device>.json`` (``--json PATH`` or ``--out DIR`` elsewhere), with the
run's device, versions, date and command.

    python -m benchmarks.hsi                   # GPU: full sweeps
    python -m benchmarks.hsi --part scenes --scene-reps 1   # GPU: the whole-scene timings alone
    python -m benchmarks.hsi --quick --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import timm
import torch

from benchmarks.ceiling import free_attention
from benchmarks.common import (
    add_out_dir,
    bench_ms,
    device_tag,
    peak_since_reset_mb,
    relerr,
    reset_peak,
    run_info,
    sdpa_context,
    wall_ms_peak,
)
from elsa_vision.data.hyperspectral import SpectralTransform, synthetic_scene
from elsa_vision.inference.hsi import predict_scene, strict_fp32
from elsa_vision.models.hsi_vit import HSI_PRESETS, ElsaHSIViT


@dataclass(frozen=True)
class ThroughputCase:
    name: str
    preset: str  # key of HSI_PRESETS
    bands: int  # bands reaching the model (after PCA, if any)
    patch: int  # patch side P
    spatial_patch: int  # token side s
    band_group: int
    batch: int

    def tokens(self) -> tuple[int, int]:
        """(spectral groups G, spatial positions S): fusion blocks attend over G*S tokens."""
        return -(-self.bands // self.band_group), (self.patch // self.spatial_patch) ** 2


@dataclass(frozen=True)
class SceneCase:
    name: str
    preset: str
    height: int
    width: int
    bands: int
    classes: int
    patch: int
    spatial_patch: int
    band_group: int
    pca: int | None  # PCA components (None: raw bands)
    batch: int


# Pavia University: 610 x 340 pixels, 103 bands, 9 classes.
THROUGHPUT = [
    ThroughputCase("paviau_raw103_p9_s3", "base", 103, 9, 3, 8, 256),  # G=13, S=9: 117 tokens
    ThroughputCase("paviau_pca32_p9_s1", "base", 32, 9, 1, 8, 256),  # G=4, S=81: 324 tokens
    ThroughputCase("paviau_raw103_p9_s1", "base", 103, 9, 1, 8, 64),  # G=13, S=81: 1053 tokens
    ThroughputCase("paviau_raw103_p15_s1", "base", 103, 15, 1, 8, 16),  # G=13, S=225: 2925 tokens
]
SCENES = [
    SceneCase("paviau_elsa_hsi_config", "config", 610, 340, 103, 9, 9, 3, 8, 32, 4096),
    SceneCase("paviau_base_raw103", "base", 610, 340, 103, 9, 9, 3, 8, None, 2048),
]
QUICK_THROUGHPUT = [
    ThroughputCase("quick_raw103_p9_s3", "tiny", 103, 9, 3, 8, 32),
    ThroughputCase("quick_pca32_p9_s1", "tiny", 32, 9, 1, 8, 16),
]
QUICK_SCENES = [SceneCase("quick_61x34x103", "tiny", 61, 34, 103, 9, 9, 3, 8, 32, 512)]

# The defaults of configs/model/elsa_hsi.yaml.
CONFIG_NET = dict(embed_dim=192, num_heads=3, branch_depth=2, fusion_depth=2)


def _net_kwargs(preset: str) -> dict:
    return dict(CONFIG_NET) if preset == "config" else dict(HSI_PRESETS[preset])


def _peak_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory since the last ``reset_peak``; on CPU the process's peak resident size."""
    if device.type == "cuda":
        return peak_since_reset_mb(device)
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def bench_throughput(case: ThroughputCase, device: torch.device, mode: str, warmup: int, reps: int) -> dict:
    torch.manual_seed(0)
    kw = dict(
        img_size=case.patch,
        band_group=case.band_group,
        spatial_patch=case.spatial_patch,
        **_net_kwargs(case.preset),
    )
    sdpa = ElsaHSIViT(case.bands, 9, attn_layer=timm.layers.Attention, **kw).to(device)
    elsa = ElsaHSIViT(case.bands, 9, **kw).to(device)
    elsa.load_state_dict(sdpa.state_dict())
    x = torch.randn(case.batch, case.bands, case.patch, case.patch, device=device)
    y = torch.randint(0, 9, (case.batch,), device=device)
    g, s = case.tokens()
    row = {**asdict(case), "tokens": f"{g}x{s}={g * s}", "mode": mode, "device": str(device)}
    outs = {}
    for name, net in (("elsa", elsa), ("sdpa", sdpa)):
        ctx = sdpa_context("sdpa_efficient", device) if name == "sdpa" else contextlib.nullcontext()
        if mode == "fwd":
            net.eval()

            def fn(net=net):
                with torch.no_grad():
                    return net(x)
        else:
            net.train()
            opt = torch.optim.SGD(net.parameters(), lr=0.0)

            def fn(net=net, opt=opt):
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(net(x), y).backward()

        reset_peak(device)
        with strict_fp32(), ctx:
            sec = bench_ms(fn, device, warmup=25 * warmup, rep=100 * reps, cpu_reps=reps) / 1e3
            if mode == "fwd":
                with torch.no_grad():
                    outs[name] = net.eval()(x).double()
        row[f"{name}_ms"] = round(sec * 1e3, 3)
        if name == "elsa":
            fn_elsa = fn
        row[f"{name}_patches_per_s"] = round(case.batch / sec, 1)
        row[f"{name}_peak_mb"] = round(_peak_mb(device), 1)
    # The ceiling: the ELSA model with free attention (benchmarks/ceiling.py), the most any kernel can give.
    with strict_fp32(), free_attention():
        sec = bench_ms(fn_elsa, device, warmup=25 * warmup, rep=100 * reps, cpu_reps=reps) / 1e3
    row["free_attention_ms"] = round(sec * 1e3, 3)
    row["speedup_elsa_over_sdpa"] = round(row["sdpa_ms"] / row["elsa_ms"], 3)
    row["ceiling"] = round(row["sdpa_ms"] / row["free_attention_ms"], 3)
    if outs:
        ref = outs["sdpa"]
        row["relerr_elsa_vs_sdpa"] = f"{relerr(outs['elsa'], ref):.1e}"
    return row


def bench_scene(case: SceneCase, device: torch.device, reps: int) -> dict:
    cube, gt = synthetic_scene(case.height, case.width, case.bands, case.classes, block=10, seed=0)
    train = cube[gt > 0][:: max(1, int((gt > 0).sum()) // 2000)]  # a training-pixel sample for the stats
    t = SpectralTransform(normalize=True, n_components=case.pca, groups=4 if case.pca else 1).fit(train)
    x = t.apply(cube)
    torch.manual_seed(0)
    net = ElsaHSIViT(
        t.num_bands_out,
        case.classes,
        img_size=case.patch,
        band_group=case.band_group,
        spatial_patch=case.spatial_patch,
        **_net_kwargs(case.preset),
    ).to(device)
    predict_scene(net, x[: min(32, case.height)], case.patch, case.batch, device)  # warm-up (kernel compile)
    ms, peak, labels = wall_ms_peak(lambda: predict_scene(net, x, case.patch, case.batch, device)[0], device,
                                    reps, warmup=False)
    sec = ms / 1e3
    assert labels.shape == (case.height, case.width) and (labels >= 0).all()
    return {
        **asdict(case),
        "device": str(device),
        "params_m": round(sum(p.numel() for p in net.parameters()) / 1e6, 2),
        "scene_seconds": round(sec, 3),
        "pixels_per_s": round(case.height * case.width / sec, 1),
        "peak_mb": round(peak if device.type == "cuda" else _peak_mb(device), 1),
    }


def _table(rows: list[dict], cols: list[str]) -> str:
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(str(r.get(c, "")) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="small CPU-sized cases (smoke run)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--mode", choices=("fwd", "train"), default="fwd", help="forward or train step")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions (default 10, quick 3)")
    ap.add_argument("--json", default=None,
                    help="results file (default: logs/benchmarks/hsi_<device>[_quick].json under --out)")
    ap.add_argument("--part", choices=("all", "throughput", "scenes"), default="all",
                    help="run both sweeps or one of them")
    ap.add_argument("--scene-reps", type=int, default=None,
                    help="timed whole-scene runs per case (default: reps // 3, at least 1)")
    add_out_dir(ap)
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    reps = a.reps or (3 if a.quick else 10)
    tp_cases, scene_cases = (QUICK_THROUGHPUT, QUICK_SCENES) if a.quick else (THROUGHPUT, SCENES)
    tp_cases = tp_cases if a.part in ("all", "throughput") else []
    scene_cases = scene_cases if a.part in ("all", "scenes") else []
    tp = [bench_throughput(c, device, a.mode, warmup=1 if a.quick else 3, reps=reps) for c in tp_cases]
    if tp:
        print(f"## ElsaHSIViT throughput, {a.mode}, FP32 (TF32 off), {device}")
        print(_table(tp, ["name", "preset", "batch", "tokens", "elsa_patches_per_s", "sdpa_patches_per_s",
                          "speedup_elsa_over_sdpa", "ceiling", "elsa_peak_mb", "sdpa_peak_mb",
                          "relerr_elsa_vs_sdpa"]))  # fmt: skip
    sc = [bench_scene(c, device, reps=a.scene_reps or max(1, reps // 3)) for c in scene_cases]
    if sc:
        print(f"\n## Whole-scene FP32 inference (batched patches), {device}")
        print(_table(sc, ["name", "preset", "height", "width", "bands", "pca", "patch", "params_m", "batch",
                          "scene_seconds", "pixels_per_s", "peak_mb"]))  # fmt: skip
    # Two sweeps with different fields: one JSON file with the run's environment and command.
    result = {**run_info(device, __file__, argv), "throughput": tp, "scenes": sc}
    path = Path(a.json) if a.json else a.out / f"hsi_{device_tag(device)}{'_quick' if a.quick else ''}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {path}")
    return result


if __name__ == "__main__":
    main()
