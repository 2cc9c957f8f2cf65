"""Training throughput of the ImageNet recipe: ElsaViT-B/16 vs timm's stock ViT-B/16, same recipe, one run.

Both peers are built from the project's Hydra configs (`configs/`): `data=imagefolder` (timm transforms,
workers, batch size), `model=elsa_vit_b` (ClassificationModule, AdamW, cosine warm-up schedule, label
smoothing, drop path). The only difference is the backbone: `elsa_vit_base_patch16_224` (ELSA attention) or
timm's `vit_base_patch16_224` (`F.scaled_dot_product_attention`). FP32 (`precision=32-true`, TF32 off) on one
device. The data is a synthetic ImageFolder of ImageNet-sized JPEGs (500 x 375 px noise images) written to a
temporary folder, or an existing `root/{train,val}/<class>/*` tree given with `--root`.

Per peer: the median time of one training step (forward, backward, optimiser; device-synchronised, after
`--warmup` steps) as `compute` images/s, and images over wall time from the first timed step to the last as
`end_to_end` images/s (includes waiting for the data loader). Rows go to
`logs/benchmarks/train_throughput_<device>.csv` (or `--out`); the ratio elsa / timm is printed.

    python -m benchmarks.train_throughput                       # CUDA: ViT-B/16, 224 px, batch 64
    python -m benchmarks.train_throughput --quick --device cpu  # smoke run: ViT-Ti, 64 px, a few steps

Goal (H100): ElsaViT-B fp32 training images/s >= 1.1x timm's stock ViT-B with the same recipe.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks.common import ROOT, Results, add_out_dir, columns, device_tag, run_info, step_timer

COLUMNS = columns("peer", "backbone", "img_size", "batch", "steps", "step_ms", "img_per_s_compute",
                  "img_per_s_end_to_end")
# The recipe (model config, backbones, data geometry) and the step counts of the full and the smoke run.
FULL = dict(model="elsa_vit_b", elsa="elsa_vit_base_patch16_224", timm="vit_base_patch16_224",
            img_size=224, batch=64, classes=10, per_class=160, steps=30, warmup=5, workers=8)  # fmt: skip
QUICK = dict(model="elsa_vit_t", elsa="elsa_vit_tiny_patch16_224", timm="vit_tiny_patch16_224",
             img_size=64, batch=4, classes=2, per_class=8, steps=3, warmup=1, workers=0)  # fmt: skip


def make_imagefolder(root: Path, classes: int, per_class: int, size=(500, 375), seed: int = 0) -> Path:
    """``root/{train,val}/class_<i>/<n>.jpg`` of random-noise JPEGs (quality 90), decoded like ImageNet's."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", max(2, per_class // 8))):
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                Image.fromarray(pixels).save(folder / f"{i}.jpg", quality=90)
    return root


def run_peer(peer: str, spec: dict, root: Path, device: torch.device) -> dict:
    """Fit ``warmup + steps`` steps of the recipe with one backbone; return the timing row."""
    import hydra
    import lightning as L
    from hydra import compose, initialize_config_dir

    from elsa_vision.tasks.train import instantiate_data

    overrides = [
        "data=imagefolder",
        f"data.root={root}",
        f"data.batch_size={spec['batch']}",
        f"data.num_workers={spec['workers']}",
        f"data.persistent_workers={spec['workers'] > 0}",
        f"data.pin_memory={device.type == 'cuda'}",
        f"data.img_size={spec['img_size']}",
        f"model={spec['model']}",
    ]
    if peer == "timm":
        overrides += [
            f"model.net.model_name={spec['timm']}",
            "~model.net.attn_backend",
            "~model.net.attn_precision",
            "~model.net.linear_backend",
        ]
    else:
        overrides += [f"model.net.model_name={spec['elsa']}"]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        cfg = compose(config_name="train", overrides=overrides)
    L.seed_everything(0, workers=True)
    datamodule = instantiate_data(cfg)
    model = hydra.utils.instantiate(cfg.model, _convert_="partial")
    timer = step_timer(spec["warmup"])
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=1,
        precision="32-true",
        max_steps=spec["warmup"] + spec["steps"],
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(model=model, datamodule=datamodule)
    if len(timer.steps) < spec["steps"]:
        raise RuntimeError(
            f"{peer}: {len(timer.steps)} timed steps, expected {spec['steps']} (too few images "
            f"for warmup + steps at batch {spec['batch']}?)"
        )
    step = statistics.median(timer.steps)
    wall = timer.last - timer.first
    return {
        "peer": peer,
        "backbone": cfg.model.net.model_name,
        "img_size": spec["img_size"],
        "batch": spec["batch"],
        "steps": len(timer.steps),
        "step_ms": round(step * 1e3, 3),
        "img_per_s_compute": round(spec["batch"] / step, 2),
        "img_per_s_end_to_end": round(spec["batch"] * len(timer.steps) / wall, 2),
    }


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="ViT-Ti at 64 px, a few steps (any device)")
    p.add_argument(
        "--root", default=None, help="existing root/{train,val}/<class>/* tree (default: synthetic)"
    )
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--steps", type=int, default=None, help="timed steps per peer")
    p.add_argument("--workers", type=int, default=None, help="data loader workers")
    add_out_dir(p)
    a = p.parse_args(argv)
    device = torch.device(a.device)
    spec = dict(QUICK if a.quick else FULL)
    for key, val in (("batch", a.batch_size), ("steps", a.steps), ("workers", a.workers)):
        if val is not None:
            spec[key] = val
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("PROJECT_ROOT", str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        if a.root is None:
            per_class = max(
                spec["per_class"], -(-spec["batch"] * (spec["warmup"] + spec["steps"]) // spec["classes"])
            )
            size = (96, 72) if a.quick else (500, 375)
            root = make_imagefolder(Path(tmp) / "imagefolder", spec["classes"], per_class, size=size)
        else:
            root = Path(a.root)
            if not (root / "train").is_dir():
                raise SystemExit(f"--root {root}: expected a train/ folder of class folders")
        rows = [run_peer(peer, spec, root, device) for peer in ("timm", "elsa")]
    meta = run_info(device, __file__, argv)
    path = a.out / f"train_throughput_{device_tag(device)}{'_quick' if a.quick else ''}.csv"
    with Results(path, COLUMNS, meta) as out:
        out.write_all(rows)
    for r in rows:
        print(
            f"{r['peer']:5s} {r['backbone']:28s} {r['img_per_s_compute']:9.2f} img/s compute "
            f"({r['step_ms']} ms/step), {r['img_per_s_end_to_end']:9.2f} img/s end to end"
        )
    t, e = rows
    print(
        f"elsa / timm: {e['img_per_s_compute'] / t['img_per_s_compute']:.3f}x compute, "
        f"{e['img_per_s_end_to_end'] / t['img_per_s_end_to_end']:.3f}x end to end (goal 1.1x); wrote {path}"
    )
    return str(path)


if __name__ == "__main__":
    main()
