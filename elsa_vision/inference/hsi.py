"""Full-scene hyperspectral classification in FP32.

``python -m elsa_vision.inference.hsi --checkpoint CKPT --input PaviaU.mat [--key paviaU] [--gt PaviaU_gt.mat]
[--out DIR] [--batch-size 1024] [--device cuda]`` classifies every pixel of the scene: the checkpoint's
normalisation statistics and PCA are applied to the cube, which is reflect-padded, and patches around all
pixels go through the network in batches. Writes into ``--out``:

* ``class_map.png``: the predicted map (and the ground truth next to it when given), with a class legend;
* ``labels.npy``: ``(H, W)`` int64 class ids ``0..K-1``, ``-1`` where not predicted (``--labelled-only``);
* ``probs.npy``: ``(H, W, K)`` float32 softmax probabilities (0 where not predicted).

With ``--gt`` it prints OA / AA / kappa over the labelled pixels. The last stdout line is a JSON summary
(time, peak memory, metrics). Matmuls and convolutions run in strict FP32 (TF32 off). ``--out`` is checked
before anything is read or computed (writable; earlier outputs replaced only with ``--overwrite``); a cube
declaring more than ``--max-input-gib`` of data is refused before it is read.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import resource
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ..data.hyperspectral import SpectralTransform, encode_labels, extract_patches, pad_cube
from ..data.readers import load_cube, load_gt
from ..files import add_max_input_argument, add_output_arguments, prepare_output_dir
from ..layers import set_linear
from ..utils.accelerator import add_device_argument, resolve_device

__all__ = ["predict_scene", "confusion_metrics", "save_class_map", "run", "main"]

OUTPUTS = ("labels.npy", "probs.npy", "class_map.png")


@contextlib.contextmanager
def strict_fp32():
    """Disable TF32 for CUDA matmuls and cuDNN convolutions; restores the settings on exit."""
    mm, cd = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = mm, cd


@torch.no_grad()
def predict_scene(
    net: nn.Module,
    cube: np.ndarray,
    patch_size: int,
    batch_size: int = 1024,
    device: str | torch.device = "cpu",
    mask: np.ndarray | None = None,
    progress: bool = False,
) -> tuple[np.ndarray, np.ndarray]:
    """Classify the pixels of a transformed cube.

    Args:
        net: maps ``(B, C, p, p)`` float32 patches to logits ``(B, K)``; run in eval mode, FP32.
        cube: ``(H, W, C)`` float32, already normalised / PCA-projected.
        patch_size: odd patch side (reflect padding at the borders).
        batch_size: patches per forward pass.
        mask: ``(H, W)`` bool, pixels to classify (default: all).
        progress: show a tqdm bar on stderr.

    Returns:
        ``labels (H, W)`` int64 (``-1`` outside ``mask``), ``probs (H, W, K)`` float32 (0 outside ``mask``).
    """
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    h, w, _ = cube.shape
    if mask is not None and mask.shape != (h, w):
        raise ValueError(f"mask must have shape {(h, w)}, got {mask.shape}")
    device = torch.device(device)
    net = net.to(device).float().eval()
    padded = pad_cube(cube, patch_size).to(device)
    flat = np.flatnonzero(mask.ravel()) if mask is not None else np.arange(h * w)
    flat_t = torch.from_numpy(flat).to(device)
    labels = np.full(h * w, -1, dtype=np.int64)
    probs_out: np.ndarray | None = None
    starts = range(0, flat.size, batch_size)
    if progress:
        from tqdm import tqdm

        starts = tqdm(
            starts, total=-(-flat.size // batch_size), desc="classifying", unit="batch", file=sys.stderr
        )
    with strict_fp32():
        for s in starts:
            idx = flat_t[s : s + batch_size]
            x = extract_patches(padded, idx // w, idx % w, patch_size)
            p = torch.softmax(net(x).float(), dim=-1)
            if probs_out is None:
                probs_out = np.zeros((h * w, p.shape[1]), dtype=np.float32)
            sel = flat[s : s + batch_size]
            probs_out[sel] = p.cpu().numpy()
            labels[sel] = p.argmax(-1).cpu().numpy()
    if probs_out is None:  # empty mask: no forward pass ran, so the class count comes from the head
        k = int(getattr(net, "num_classes", 0))
        probs_out = np.zeros((h * w, k), dtype=np.float32)
    return labels.reshape(h, w), probs_out.reshape(h, w, -1)


def confusion_metrics(y_true: np.ndarray, y_pred: np.ndarray, num_classes: int) -> dict:
    """OA, AA (mean recall over the classes present in ``y_true``), Cohen's kappa, per-class accuracy."""
    y_true, y_pred = np.asarray(y_true).ravel(), np.asarray(y_pred).ravel()
    if y_true.shape != y_pred.shape or y_true.size == 0:
        raise ValueError(
            f"y_true and y_pred must be non-empty and equal in size, got {y_true.size}, {y_pred.size}"
        )
    cm = np.bincount(y_true * num_classes + y_pred, minlength=num_classes**2).reshape(
        num_classes, num_classes
    )
    cm = cm.astype(np.float64)
    n = cm.sum()
    oa = np.trace(cm) / n
    support = cm.sum(1)
    per_class = np.divide(np.diag(cm), support, out=np.full(num_classes, np.nan), where=support > 0)
    pe = float((cm.sum(0) * cm.sum(1)).sum() / n**2)
    kappa = (oa - pe) / (1 - pe) if pe < 1 else 1.0
    return {
        "oa": float(oa),
        "aa": float(np.nanmean(per_class)),
        "kappa": float(kappa),
        "per_class": per_class.tolist(),
        "confusion": cm.astype(np.int64),
    }


def _colors(k: int) -> np.ndarray:
    """``(k, 3)`` distinct RGB colours: tab20's entries for up to 20 classes, else samples of gist_ncar."""
    import matplotlib

    if k <= 20:
        return np.asarray(matplotlib.colormaps["tab20"].colors[:k])
    return matplotlib.colormaps["gist_ncar"](np.linspace(0.05, 0.95, k))[:, :3]


def save_class_map(
    path: str | Path,
    labels: np.ndarray,
    class_names: Sequence[str],
    gt: np.ndarray | None = None,
    title: str = "prediction",
) -> None:
    """Write a colour class map with a legend (pixels with label -1 are black); ``gt`` (encoded, -1 =
    unlabelled) is drawn next to it when given."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    k = len(class_names)
    lut = np.concatenate([np.zeros((1, 3)), _colors(k)], 0)
    panels = [(title, labels)] + ([("ground truth", gt)] if gt is not None else [])
    h, w = labels.shape
    scale = 6.0 / max(h, w)
    fig, axes = plt.subplots(
        1, len(panels), figsize=(len(panels) * max(w * scale, 2.5) + 2.8, max(h * scale, 2.5)), squeeze=False
    )
    for ax, (name, lab) in zip(axes[0], panels):
        ax.imshow(lut[np.clip(lab, -1, k - 1) + 1], interpolation="nearest")
        ax.set_title(name)
        ax.axis("off")
    handles = [Patch(color=lut[i + 1], label=n) for i, n in enumerate(class_names)]
    handles.append(Patch(color=lut[0], label="not predicted / unlabelled"))
    fig.legend(handles=handles, loc="center right", fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0, 1 - 2.6 / fig.get_figwidth(), 1))
    fig.savefig(path, dpi=150)
    plt.close(fig)


def _peak_memory(device: torch.device) -> tuple[float, str]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_memory_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, "cpu_peak_rss"


def run(
    checkpoint: str,
    input: str,
    key: str | None = None,
    gt: str | None = None,
    gt_key: str | None = None,
    out: str = "hsi_inference",
    batch_size: int = 1024,
    device: str | None = None,
    labelled_only: bool = False,
    progress: bool = True,
    nan_policy: str | None = None,
    overwrite: bool = False,
    max_bytes: int | None = None,
    linear_backend: str = "auto",
) -> dict:
    """Classify a full scene with a ``HSIClassificationModule`` checkpoint; returns the JSON summary dict.

    ``out`` must be writable and must not hold the outputs of an earlier run unless ``overwrite``; this is
    checked first. ``max_bytes`` limits the declared size of the cube and ground-truth arrays
    (default :data:`elsa_vision.files.DEFAULT_MAX_ARRAY_BYTES`). ``linear_backend``: ``"auto"`` (the
    network's linear layers as FP32-accurate split GEMMs on CUDA) or ``"torch"`` (PyTorch's own FP32 GEMMs).
    """
    from ..tasks.hsi import load_hsi_checkpoint

    out_dir = prepare_output_dir(out, OUTPUTS, overwrite=overwrite)
    t0 = time.perf_counter()
    dev = resolve_device(device, "device")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    if labelled_only and gt is None:
        raise ValueError("--labelled-only needs --gt")
    net, meta = load_hsi_checkpoint(checkpoint)
    set_linear(net, backend=linear_backend, who="--linear-backend")
    transform = SpectralTransform.from_state_dict(meta["transform"])
    cube = load_cube(
        input,
        key=key,
        nan_policy=nan_policy or meta.get("nan_policy", "raise"),
        max_bytes=max_bytes,
    )
    if cube.shape[-1] != transform.num_bands_in:
        raise ValueError(
            f"input: {input} has {cube.shape[-1]} bands, the checkpoint expects {transform.num_bands_in}"
        )
    class_values = np.asarray(meta["class_values"], dtype=np.int64)
    names = meta.get("class_names") or [f"class {v}" for v in class_values.tolist()]
    gt_enc = None
    if gt is not None:
        gt_raw = load_gt(gt, key=gt_key, max_bytes=max_bytes)
        if gt_raw.shape != cube.shape[:2]:
            raise ValueError(
                f"gt/image size mismatch: gt {gt} is {gt_raw.shape}, cube {input} is {cube.shape[:2]}"
            )
        gt_enc, _ = encode_labels(gt_raw, class_values)
    x = transform.apply(cube)
    t1 = time.perf_counter()
    labels, probs = predict_scene(
        net,
        x,
        int(meta["patch_size"]),
        batch_size=batch_size,
        device=dev,
        mask=(gt_enc >= 0) if labelled_only else None,
        progress=progress,
    )
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    t2 = time.perf_counter()
    out_dir.mkdir(parents=True, exist_ok=True)
    np.save(out_dir / "labels.npy", labels)
    np.save(out_dir / "probs.npy", probs)
    save_class_map(out_dir / "class_map.png", labels, names, gt=gt_enc)
    peak, kind = _peak_memory(dev)
    h, w = labels.shape
    summary = {
        "out": str(out_dir),
        "height": h,
        "width": w,
        "bands": int(cube.shape[-1]),
        "num_classes": len(names),
        "predicted_pixels": int((labels >= 0).sum()),
        "device": str(dev),
        "batch_size": batch_size,
        "predict_seconds": round(t2 - t1, 4),
        "total_seconds": round(time.perf_counter() - t0, 4),
        "pixels_per_second": round(float((labels >= 0).sum()) / max(t2 - t1, 1e-9), 1),
        "peak_memory_mb": round(peak, 1),
        "memory_kind": kind,
    }
    if gt_enc is not None:
        sel = (gt_enc >= 0) & (labels >= 0)
        m = confusion_metrics(gt_enc[sel], labels[sel], len(names))
        summary.update(
            oa=m["oa"],
            aa=m["aa"],
            kappa=m["kappa"],
            evaluated_pixels=int(sel.sum()),
            per_class={n: a for n, a in zip(names, m["per_class"])},
        )
    return summary


def main(argv: Sequence[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m elsa_vision.inference.hsi", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--checkpoint", required=True, help="HSIClassificationModule checkpoint (.ckpt)")
    ap.add_argument("--input", required=True, help="cube: .mat (v5/v7.3), ENVI .hdr, .tif, .npy/.npz")
    ap.add_argument("--key", default=None, help="cube array name (auto-detected when the file has one cube)")
    ap.add_argument("--gt", default=None, help="ground-truth file: prints OA/AA/kappa over labelled pixels")
    ap.add_argument("--gt-key", default=None, help="ground-truth array name (auto-detected)")
    add_output_arguments(ap, "output directory", default="hsi_inference")
    add_max_input_argument(ap, "cube / ground-truth files")
    ap.add_argument("--batch-size", type=int, default=1024, help="patches per forward pass")
    add_device_argument(ap)
    ap.add_argument("--labelled-only", action="store_true", help="classify only pixels labelled in --gt")
    ap.add_argument(
        "--nan-policy", choices=("raise", "fill"), default=None, help="non-finite values in the cube"
    )
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ap.add_argument(
        "--linear-backend", choices=("auto", "torch"), default="auto",
        help="linear layers: auto = FP32-accurate split GEMMs on CUDA float32 (error below PyTorch FP32's), "
        "torch = PyTorch's own FP32 GEMMs",
    )
    a = ap.parse_args(argv)
    summary = run(
        a.checkpoint,
        a.input,
        key=a.key,
        gt=a.gt,
        gt_key=a.gt_key,
        out=a.out,
        batch_size=a.batch_size,
        device=a.device,
        labelled_only=a.labelled_only,
        progress=not a.no_progress,
        nan_policy=a.nan_policy,
        overwrite=a.overwrite,
        max_bytes=int(a.max_input_gib * 2**30),
        linear_backend=a.linear_backend,
    )
    print(
        f"classified {summary['predicted_pixels']} pixels ({summary['height']}x{summary['width']}) in "
        f"{summary['predict_seconds']:.2f} s on {summary['device']}; "
        f"peak memory {summary['peak_memory_mb']:.0f} MB "
        f"({summary['memory_kind']}); outputs in {summary['out']}"
    )
    if "oa" in summary:
        print(
            f"OA {100 * summary['oa']:.2f}  AA {100 * summary['aa']:.2f}  kappa {100 * summary['kappa']:.2f} "
            f"(over {summary['evaluated_pixels']} labelled pixels)"
        )
    print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
