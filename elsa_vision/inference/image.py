"""High-resolution FP32 ViT inference on one medical or large image.

Usage::

    python -m elsa_vision.inference.image --model elsa_vit_b_patch16 --weights x.safetensors \\
        --input scan.dcm --img-size 2048 [--precision fp32|tf32|bf16] [--linear-backend auto|torch] \\
        [--device cuda] \\
        [--memory-budget-mb N | --query-chunk N] [--compare-sdpa] --out DIR

    torchrun --nproc-per-node 2 -m elsa_vision.inference.image --context-parallel \\
        --model elsa_vit_b_patch16 --weights x.safetensors --input slide.tif --img-size 8192 --out DIR

    python -m elsa_vision.inference.image --save-random-weights w.safetensors \\
        --model elsa_vit_tiny_patch16_224 \\
        [--num-classes 1000] [--in-chans 1]

Writes ``prediction.json``, ``features.safetensors``, ``overlay.png`` and ``report.json`` in ``--out`` (one
sub-folder ``slice_<index>`` per image when several slices/frames are selected; they are decoded one at a
time as they are run), and records every file it writes in ``--out/outputs.json``. ``--out`` is checked
before anything is computed: it must be writable, and outputs of an earlier run there are replaced only with
``--overwrite`` (which removes the files the earlier run recorded, and the ``slice_*`` folders they leave
empty, when the new run starts writing; nothing else in ``--out``).
Inputs declaring more than ``--max-input-gib`` of decoded data (TIFF, DICOM, NIfTI) or more
than ``--max-image-pixels`` pixels (PNG/JPEG) are refused before decoding. The last stdout line is a JSON
summary.

With ``--context-parallel`` (under ``torchrun``, one process per GPU; gloo processes on CPU) every rank reads
the same image and holds ``1/world`` of its tokens; attention is global (ring attention over the ranks) and
rank 0 writes the outputs and prints the summary.

Memory is planned before the model is built (on the meta device): an ``--img-size`` that fits no mode of
the budget (``--memory-budget-mb``, default 90% of the free device memory; with ``--context-parallel`` each
rank's, on CPU the host's RAM shared by its ranks) is refused in one line with the estimate.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
import time
from typing import Any

import numpy as np
import torch

from ..data.readers import NAN_POLICIES, NORMALIZATIONS, detect_format, iter_images, load_image
from ..files import (
    add_max_input_argument,
    add_output_arguments,
    prepare_output_dir,
    record_outputs,
    remove_outputs,
    save_safetensors,
)
from ..utils.accelerator import add_device_argument, resolve_device
from .highres import (
    MODEL_ALIASES,
    Plan,
    build_model,
    default_budget_mb,
    forward_tokens,
    load_weights,
    plan_execution,
    resize_image,
    resolve_model_name,
    run_context_parallel,
    run_plan,
    weights_shape_info,
)

__all__ = ["main", "cli", "build_parser", "heatmap_overlay", "save_random_weights"]

# what a run writes for one image, into --out or (several slices) into --out/slice_<index>
IMAGE_OUTPUTS = ("prediction.json", "features.safetensors", "overlay.png", "report.json")
# what a run writes into --out (a trailing * matches the per-slice sub-folders); every file is recorded in
# --out/outputs.json (elsa_vision.files.record_outputs), and --overwrite removes only what is recorded there
OUTPUTS = (*IMAGE_OUTPUTS, "slice_*")

PRECISIONS = ("fp32", "tf32", "bf16")
# (position, RGB) anchors of a dark-to-bright perceptual colour map (black - purple - orange - yellow).
_CMAP = np.array(
    [
        [0.00, 0.00, 0.00, 0.02],
        [0.25, 0.34, 0.06, 0.43],
        [0.50, 0.73, 0.21, 0.33],
        [0.75, 0.98, 0.55, 0.04],
        [1.00, 0.99, 1.00, 0.64],
    ],
    dtype=np.float32,
)


def _index_arg(s: str) -> int | str:
    if s == "all":
        return s
    try:
        return int(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"expected an integer or 'all', got {s!r}") from e


def _window_arg(s: str) -> str | tuple[float, float]:
    if s == "file":
        return s
    try:
        c, w = (float(v) for v in s.split(","))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--window expects 'file' or 'CENTER,WIDTH', got {s!r}") from e
    return c, w


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m elsa_vision.inference.image",
        description="Whole-image FP32 ViT inference with global ELSA attention on DICOM/NIfTI/TIFF/PNG/JPEG.",
    )
    p.add_argument(
        "--model",
        required=True,
        help=f"registered elsa_* model name or alias ({', '.join(sorted(MODEL_ALIASES))})",
    )
    p.add_argument("--weights", help=".safetensors or .pth state_dict (omit: random init, for demos only)")
    p.add_argument(
        "--save-random-weights",
        metavar="PATH",
        help="write a randomly initialised state_dict of --model to PATH (.safetensors) and exit",
    )
    p.add_argument("--num-classes", type=int, default=None, help="head size without --weights (default 1000)")
    p.add_argument(
        "--in-chans",
        type=int,
        default=None,
        help="input channels without --weights (default: the image's channel count)",
    )
    p.add_argument("--input", help="image file: .dcm .nii .nii.gz .tif .ome.tif .png .jpg")
    add_output_arguments(p, "output directory (--overwrite also replaces the file of --save-random-weights)")
    p.add_argument(
        "--img-size",
        type=int,
        nargs="+",
        default=None,
        help="H [W] in pixels, multiples of the patch size (default: the image's, rounded)",
    )
    p.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="fp32",
        help="fp32: FP32-accurate everywhere (attention and linear layers on tensor cores, error below "
        "PyTorch FP32's; TF32 off); tf32: TF32 matmuls and attention; bf16: autocast",
    )
    add_device_argument(p)
    p.add_argument(
        "--attn-backend",
        choices=("auto", "torch", "triton"),
        default="auto",
        help="ELSA attention backend (auto: Triton on CUDA, torch otherwise)",
    )
    p.add_argument(
        "--linear-backend",
        choices=("auto", "torch"),
        default="auto",
        help="linear layers and patch embedding: auto = FP32-accurate split GEMMs on CUDA float32 (error "
        "below PyTorch FP32's), torch = PyTorch's own FP32 GEMMs (the plain PyTorch result)",
    )
    mem = p.add_mutually_exclusive_group()
    mem.add_argument(
        "--memory-budget-mb",
        type=float,
        default=None,
        help="plan against this budget (default: 90%% of free device memory; with --context-parallel, "
        "each rank's, by default its share of the host's RAM on CPU); tiles only if forced",
    )
    mem.add_argument(
        "--query-chunk",
        type=int,
        default=None,
        help="global attention with this many query rows per step (no tiling; refused only when its "
        "estimate exceeds the memory)",
    )
    p.add_argument(
        "--context-parallel",
        action="store_true",
        help="split the image's tokens over the ranks of torch.distributed (launch with torchrun; nccl on "
        "GPUs, gloo on CPU); every process uses cuda:LOCAL_RANK on GPUs; rank 0 writes the outputs",
    )
    p.add_argument(
        "--cp-layout",
        choices=("contiguous", "zigzag"),
        default="contiguous",
        help="token shards of --context-parallel",
    )
    p.add_argument("--tile-overlap", type=float, default=0.25, help="tile overlap as a fraction of the tile")
    p.add_argument(
        "--compare-sdpa",
        action="store_true",
        help="also run timm's stock model (SDPA) with the same weights; report deviation and speed",
    )
    rd = p.add_argument_group("reading")
    rd.add_argument(
        "--slice",
        type=_index_arg,
        default=None,
        help="NIfTI slice index (default middle) / TIFF stack index (default 0), or 'all'",
    )
    rd.add_argument("--slice-axis", type=int, default=2, help="NIfTI voxel axis the slices cut across")
    rd.add_argument(
        "--frame",
        type=_index_arg,
        default=None,
        help="DICOM multi-frame index (default 0) / NIfTI 4th-axis index, or 'all'",
    )
    rd.add_argument("--series", type=int, default=0, help="TIFF series")
    rd.add_argument("--level", type=int, default=0, help="TIFF pyramid level (0 = full resolution)")
    rd.add_argument(
        "--window",
        type=_window_arg,
        default=None,
        help="DICOM-style window: 'file' or 'CENTER,WIDTH' (rescaled units, e.g. HU) -> [0, 1]",
    )
    rd.add_argument("--no-invert-monochrome1", action="store_true", help="keep MONOCHROME1 values as stored")
    add_max_input_argument(rd, "TIFF/DICOM/NIfTI inputs (decoded, or one image of them in float32)")
    rd.add_argument(
        "--max-image-pixels",
        type=int,
        default=None,
        help="refuse a PNG/JPEG input whose header declares more pixels, before decoding (default: "
        "Pillow's PIL.Image.MAX_IMAGE_PIXELS, 89,478,485)",
    )
    rd.add_argument(
        "--nan-policy",
        choices=NAN_POLICIES,
        default="error",
        help="NaN/inf values: error (default), or replace by zero / the mean of the finite values",
    )
    rd.add_argument(
        "--norm",
        choices=NORMALIZATIONS,
        default="pretrained",
        help="value normalisation (pretrained: [0,1] then the model's mean/std)",
    )
    rd.add_argument("--percentiles", type=float, nargs=2, default=(0.5, 99.5), help="for --norm percentile")
    rd.add_argument(
        "--gray",
        choices=("replicate", "adapt"),
        default="replicate",
        help="grey image, RGB weights: replicate to 3 channels, or sum the patch-embedding "
        "weights over channels (identical result, one input channel)",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="timed runs (after a small warm-up that triggers kernel compilation); the fastest is reported",
    )
    p.add_argument("--overlay-max-side", type=int, default=1024, help="longest side of overlay.png")
    p.add_argument(
        "--overlay",
        choices=("norm", "cls-attn"),
        default="norm",
        help="heat map: per-patch feature norm, or the last block's class-token attention (global modes; "
        "falls back to norm when tiled)",
    )
    return p


def save_random_weights(path: str, model_name: str, *, num_classes: int | None, in_chans: int | None) -> dict:
    """Randomly initialised weights of ``model_name`` saved with safetensors; returns their shape info."""
    import timm

    name = resolve_model_name(model_name)
    model = timm.create_model(
        name,
        pretrained=False,
        num_classes=1000 if num_classes is None else num_classes,
        in_chans=3 if in_chans is None else in_chans,
    )
    sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    save_safetensors(sd, path, metadata={"model": name, "init": "random"})
    return dict(weights_shape_info(sd), model=name, path=path)


def _saved_as_random(path: str) -> bool:
    from ..files import read_safetensors_metadata

    return read_safetensors_metadata(path).get("init") == "random"


def heatmap_overlay(
    image: np.ndarray, heat: np.ndarray, max_side: int = 1024, alpha: float = 0.5
) -> np.ndarray:
    """RGB uint8 overlay of ``heat [h, w]`` (any range) on ``image [C, H, W]`` (display only: 8-bit)."""
    from PIL import Image

    gray = image.mean(axis=0)
    lo, hi = float(gray.min()), float(gray.max())
    gray = (gray - lo) / (hi - lo) if hi > lo else np.zeros_like(gray)
    H, W = gray.shape
    s = min(1.0, max_side / max(H, W))
    size = (max(1, round(W * s)), max(1, round(H * s)))
    g = np.asarray(Image.fromarray(gray.astype(np.float32), mode="F").resize(size, Image.BILINEAR))
    hlo, hhi = float(heat.min()), float(heat.max())
    hn = (heat - hlo) / (hhi - hlo) if hhi > hlo else np.zeros_like(heat)
    hn = np.asarray(Image.fromarray(hn.astype(np.float32), mode="F").resize(size, Image.BILINEAR)).clip(0, 1)
    rgb = np.stack([np.interp(hn, _CMAP[:, 0], _CMAP[:, i]) for i in (1, 2, 3)], axis=-1)
    out = (1 - alpha) * g[..., None] + alpha * rgb
    return (out.clip(0, 1) * 255 + 0.5).astype(np.uint8)


@contextlib.contextmanager
def _precision(precision: str):
    cm, cd = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = precision == "tf32"
    torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = cm, cd


def _img_size(arg: list[int] | None, hw: tuple[int, int], patch: int) -> tuple[int, int]:
    if arg is None:
        return tuple(max(patch, round(s / patch) * patch) for s in hw)
    if len(arg) not in (1, 2):
        raise ValueError(f"--img-size takes H or H W, got {arg}")
    size = (arg[0], arg[-1])
    for s in size:
        if s < patch or s % patch:
            raise ValueError(f"--img-size must be a positive multiple of the patch size {patch}, got {s}")
    return size


def _timed_stock(stock, x: torch.Tensor, amp) -> tuple[torch.Tensor, torch.Tensor | None, float, float]:
    dev = x.device
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    with torch.no_grad(), amp():
        tokens = stock.forward_features(x[None])
        logits = stock.forward_head(tokens)[0] if stock.num_classes else None
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    sec = time.perf_counter() - t0
    peak = torch.cuda.max_memory_allocated(dev) / 2**20 if dev.type == "cuda" else None  # not measured
    return tokens[0].float(), None if logits is None else logits.float(), sec, peak


def _json_ready(obj: Any) -> Any:
    """``obj`` with every non-finite float as None: the JSON files and the summary line are standard JSON
    (``null``), not Python's ``NaN`` / ``Infinity`` extension."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    if isinstance(obj, dict):
        return {k: _json_ready(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_json_ready(v) for v in obj]
    return obj


def _write_outputs(
    out_dir: str, res, model, img: torch.Tensor, args, extra: dict[str, Any]
) -> dict[str, Any]:
    from PIL import Image

    os.makedirs(out_dir, exist_ok=True)
    feats = res.features.cpu().contiguous()
    tensors = {"features": feats, "prefix": res.prefix.cpu().contiguous()}
    if model.cls_token is not None:
        tensors["cls"] = res.prefix[0].cpu().clone()
    if res.cls_attention is not None:
        tensors["cls_attention"] = res.cls_attention.cpu().contiguous()
    save_safetensors(
        tensors,
        os.path.join(out_dir, "features.safetensors"),
        metadata={
            "layout": "features [C, h, w]; prefix [P, C] (cls first); cls [C]; cls_attention [h, w]",
            "model": extra["model"],
            "img_size": json.dumps(list(img.shape[-2:])),
        },
    )
    pred: dict[str, Any] = {
        "model": extra["model"],
        "num_classes": int(model.num_classes),
        "random_weights": extra["random_weights"],
    }
    if res.logits is not None:
        probs = torch.softmax(res.logits.double(), dim=-1)
        k = min(5, probs.numel())
        top = torch.topk(probs, k)
        pred["probabilities"] = probs.tolist()
        pred["top5"] = [{"class": int(i), "probability": float(v)} for v, i in zip(top.values, top.indices)]
    else:
        pred["probabilities"] = None
        pred["top5"] = []
        pred["note"] = "the weights have no classification head (num_classes=0); see features.safetensors"
    with open(os.path.join(out_dir, "prediction.json"), "w") as f:
        json.dump(_json_ready(pred), f, indent=1, allow_nan=False)
    heat = (res.cls_attention if res.cls_attention is not None else feats.norm(dim=0)).cpu().numpy()
    Image.fromarray(heatmap_overlay(img.float().cpu().numpy(), heat, args.overlay_max_side)).save(
        os.path.join(out_dir, "overlay.png")
    )
    plan: Plan = res.plan
    p = model.patch_embed.patch_size[0]
    report = {
        "tokens": int(feats.shape[1] * feats.shape[2] + model.num_prefix_tokens),
        "seconds": res.seconds,
        "peak_memory_mb": res.peak_memory_mb,
        "peak_memory_kind": res.peak_memory_kind,
        "precision": args.precision,
        "linear_backend": args.linear_backend,
        "tiled": plan.mode == "tiled",
        "mode": plan.mode,
        "global_attention": plan.mode != "tiled",
        "query_chunk": plan.query_chunk,
        "tile_size": plan.tile,
        "tile_overlap": plan.overlap,
        "tiles": res.tiles,
        "plan_reason": plan.reason,
        "overlay": "cls_attention_last_block" if res.cls_attention is not None else "feature_norm",
        "estimated_peak_mb": plan.estimated_peak_mb,
        "memory_budget_mb": plan.budget_mb,
        "img_size": list(img.shape[-2:]),
        "grid": [int(feats.shape[1]), int(feats.shape[2])],
        "patch_size": p,
        **extra,
    }
    with open(os.path.join(out_dir, "report.json"), "w") as f:
        json.dump(_json_ready(report), f, indent=1, allow_nan=False)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.save_random_weights:
        if os.path.exists(args.save_random_weights) and not args.overwrite:
            raise ValueError(
                f"--save-random-weights {args.save_random_weights!r} exists; pass --overwrite to replace it"
            )
        info = save_random_weights(
            args.save_random_weights, args.model, num_classes=args.num_classes, in_chans=args.in_chans
        )
        print(json.dumps(info))
        return info
    for flag in ("input", "out"):
        if getattr(args, flag) is None:
            raise SystemExit(f"error: --{flag} is required")
    if args.max_image_pixels is not None and args.max_image_pixels < 1:
        raise ValueError(f"--max-image-pixels must be >= 1, got {args.max_image_pixels}")
    # before any reading or computing: an unwritable --out, or earlier outputs, fail now
    args.out = str(prepare_output_dir(args.out, OUTPUTS, overwrite=args.overwrite))
    device = resolve_device(args.device)
    cp_group, owns_group = None, False
    if args.context_parallel:
        device, cp_group, owns_group = _init_context_parallel(device)
        for flag, bad in (("compare-sdpa", args.compare_sdpa), ("query-chunk", args.query_chunk is not None)):
            if bad:
                raise ValueError(f"--{flag} does not combine with --context-parallel")
        if args.overlay == "cls-attn":
            raise ValueError(
                "--overlay cls-attn does not combine with --context-parallel (use --overlay norm)")
    from PIL import Image

    pixel_limit = Image.MAX_IMAGE_PIXELS
    if args.max_image_pixels is not None:
        Image.MAX_IMAGE_PIXELS = args.max_image_pixels  # for this run (Pillow's limit is process-wide)
    try:
        return _run(args, device, cp_group)
    finally:
        Image.MAX_IMAGE_PIXELS = pixel_limit
        if owns_group:
            torch.distributed.destroy_process_group()


def _init_context_parallel(device: torch.device) -> tuple[torch.device, Any, bool]:
    """The process group of ``--context-parallel`` (initialised from torchrun's environment unless one is
    already up) and this rank's device (``cuda:LOCAL_RANK`` on GPUs)."""
    import torch.distributed as dist

    if device.type == "cuda":
        if device.index is None:
            device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    owns = False
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise ValueError(
                "--context-parallel needs torchrun (RANK/WORLD_SIZE are not set), e.g. "
                "torchrun --nproc-per-node 2 -m elsa_vision.inference.image --context-parallel ...")
        # NCCL is told this rank's device (otherwise it guesses it from the global rank)
        cuda = device.type == "cuda"
        dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
        owns = True
    return device, dist.group.WORLD, owns


def _run(args, device: torch.device, cp_group) -> dict[str, Any]:
    is_writer = cp_group is None or torch.distributed.get_rank() == 0
    name = resolve_model_name(args.model)
    selected = iter_images(
        args.input,
        slice_index=args.slice,
        slice_axis=args.slice_axis,
        frame=0 if args.frame is None and detect_format(args.input) == "dicom" else args.frame,
        series=args.series,
        level=args.level,
        max_bytes=int(args.max_input_gib * 2**30),
    )
    # One slice decoded ahead at a time (not the whole selection): the first two tell the model's input and
    # whether the outputs go to slice_* folders.
    first, second = next(selected, None), next(selected, None)
    if first is None:
        raise ValueError(f"input file {args.input!r}: no image selected")
    several = second is not None
    images = itertools.chain([first] if second is None else [first, second], selected)
    source_chans, source_hw = first.data.shape[0], first.data.shape[-2:]
    del first, second  # held by the chain alone: each is freed once it has been run
    sd = load_weights(args.weights) if args.weights else None
    random_weights = sd is None or _saved_as_random(args.weights)
    if sd is not None and random_weights:
        print(
            f"WARNING: {args.weights} holds randomly initialised weights (saved by --save-random-weights); "
            "predictions and heat maps are meaningless (demo only)",
            file=sys.stderr,
        )
    if sd is None:
        print(
            "WARNING: no --weights given: the model is RANDOMLY INITIALISED; predictions and heat maps are "
            "meaningless (demo only)",
            file=sys.stderr,
        )
        in_chans = args.in_chans or source_chans
        num_classes = args.num_classes
    else:
        info = weights_shape_info(sd, source=f"--weights: {args.weights!r}")
        in_chans, num_classes = info["in_chans"], info["num_classes"]
        for flag, given, actual in (
            ("in-chans", args.in_chans, in_chans),
            ("num-classes", args.num_classes, num_classes),
        ):
            if given is not None and given != actual:
                raise ValueError(f"--{flag} {given} contradicts the weights, which have {actual}")
        if args.gray == "adapt" and source_chans == 1:
            in_chans = 1
    import timm

    cfg = timm.models.get_pretrained_cfg(name)
    patch = timm.create_model(name, pretrained=False, num_classes=0, depth=1).patch_embed.patch_size[0]
    size = _img_size(args.img_size, source_hw, patch)
    attn_precision = "tf32" if args.precision == "tf32" else "auto"
    amp_dtype = torch.bfloat16 if args.precision == "bf16" else None
    build = dict(
        in_chans=in_chans,
        num_classes=num_classes,
        gray_adapt=args.gray == "adapt" and source_chans == 1,
        attn_backend=args.attn_backend,
        attn_precision=attn_precision,
        linear_backend=args.linear_backend,
    )
    with torch.device("meta"):  # the plan reads shapes only: a size that cannot fit is refused unbuilt
        shapes = build_model(name, None, size, **{**build, "gray_adapt": False})
    plan = _plan(args, shapes, size, device, cp_group, amp_dtype)
    del shapes
    model = build_model(name, sd, size, **build).to(device)
    if cp_group is not None:  # every rank must hold rank 0's weights (random initialisation included)
        for t in model.state_dict().values():
            torch.distributed.broadcast(t, 0, group=cp_group)
    in_chans = model.patch_embed.proj.in_channels
    mean, std = cfg.mean, cfg.std

    def amp():
        return (
            torch.autocast(device.type, dtype=amp_dtype)
            if amp_dtype is not None
            else torch.autocast(device.type, enabled=False)
        )

    stock = None
    if args.compare_sdpa:
        stock = build_model(name, model.state_dict(), size, stock=True)  # on the device only while it runs
    want_cls = args.overlay == "cls-attn" and plan.mode != "tiled"
    if args.overlay == "cls-attn" and model.cls_token is None:
        raise ValueError(f"--overlay cls-attn needs a class token; {name} has none (use --overlay norm)")
    summaries = []
    with _precision(args.precision):
        for im in images:
            arr, facts = load_image(
                im,
                in_chans=in_chans,
                window=args.window,
                invert_monochrome1=not args.no_invert_monochrome1,
                nan_policy=args.nan_policy,
                norm=args.norm,
                percentiles=tuple(args.percentiles),
                mean=mean,
                std=std,
                min_size=patch,
            )
            img = resize_image(torch.from_numpy(arr), size).to(device)
            if args.repeats < 1:
                raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
            with amp():  # warm-up on a 2x2-patch crop: kernel compilation is not timed
                forward_tokens(model, img[None, :, : 2 * patch, : 2 * patch], query_chunk=plan.query_chunk)
            if cp_group is not None:
                runs = (
                    run_context_parallel(
                        model, img, cp_group, layout=args.cp_layout, autocast_dtype=amp_dtype
                    )
                    for _ in range(args.repeats)
                )
            else:
                runs = (
                    run_plan(model, img, plan, autocast_dtype=amp_dtype, with_cls_attention=want_cls)
                    for _ in range(args.repeats)
                )
            res = min(runs, key=lambda r: r.seconds)
            extra: dict[str, Any] = {
                "model": name,
                "weights": args.weights,
                "random_weights": random_weights,
                "device": str(device),
                "input": os.path.abspath(args.input),
                "format": im.format,
                "index": im.index,
                "count": im.count,
                "source_shape": list(im.data.shape),
                "reader": {k: v for k, v in im.meta.items()},
                "preprocess": facts,
                "attn_backend": args.attn_backend,
            }
            if stock is not None:
                stock.to(device)
                runs = [_timed_stock(stock, img, amp) for _ in range(args.repeats)]
                stock.cpu()
                ref_tokens, ref_logits, sdpa_sec, sdpa_peak = min(runs, key=lambda r: r[2])
                del runs
                npt = model.num_prefix_tokens
                ref_feats = (
                    ref_tokens[npt:]
                    .reshape(res.features.shape[1], res.features.shape[2], -1)
                    .permute(2, 0, 1)
                )
                dev = max(
                    float((res.features - ref_feats).abs().max()),
                    float((res.prefix - ref_tokens[:npt]).abs().max()) if npt else 0.0,
                )
                extra.update(
                    {
                        "max_deviation_vs_sdpa": dev,
                        "max_logit_deviation_vs_sdpa": (
                            float((res.logits - ref_logits).abs().max()) if res.logits is not None else None
                        ),
                        "sdpa_seconds": sdpa_sec,
                        "sdpa_peak_memory_mb": sdpa_peak,
                        "speed_ratio": sdpa_sec / res.seconds if res.seconds > 0 else math.inf,
                        "sdpa_model": "timm " + name[len("elsa_") :],
                        "deviation_note": (
                            "includes tiling (ELSA run was tiled, SDPA run global)"
                            if res.plan.mode == "tiled"
                            else "global attention in both"
                        ),
                    }
                )
                print(
                    f"compare-sdpa: max deviation {dev:.3e}, speed ratio (sdpa/elsa) "
                    f"{extra['speed_ratio']:.2f}x ({sdpa_sec:.3f}s vs {res.seconds:.3f}s)"
                )
            sub = f"slice_{im.index:04d}" if several else ""
            out_dir = os.path.join(args.out, sub) if sub else args.out
            if cp_group is not None:
                extra["context_parallel"] = {
                    "world_size": torch.distributed.get_world_size(cp_group),
                    "layout": args.cp_layout,
                    "peak_memory_mb_per_rank": _gather_floats(res.peak_memory_mb, cp_group),
                }
            if not is_writer:
                continue
            if args.overwrite and not summaries:  # the first write: an earlier run's outputs go first
                remove_outputs(args.out, OUTPUTS)
            record_outputs(args.out, [os.path.join(sub, name) for name in IMAGE_OUTPUTS])
            report = _write_outputs(out_dir, res, model, img, args, extra)
            if plan.mode == "tiled":
                print(f"TILED: {plan.reason}; {res.tiles} tiles (attention is local to each tile)")
            else:
                print(f"global attention over {report['tokens']} tokens ({plan.mode}), {res.seconds:.3f}s")
            summaries.append(
                {
                    k: report[k]
                    for k in ("tokens", "seconds", "peak_memory_mb", "precision", "linear_backend", "tiled",
                              "mode")
                    if k in report
                }
                | {"out": out_dir}
                | (
                    {k: report[k] for k in ("max_deviation_vs_sdpa", "sdpa_seconds", "speed_ratio")}
                    if stock is not None
                    else {}
                )
            )
    if not is_writer:
        return {"rank": torch.distributed.get_rank(), "written": False}
    summary = summaries[0] if len(summaries) == 1 else {"images": len(summaries), "results": summaries}
    print(json.dumps(_json_ready(summary), allow_nan=False))
    return summary


def _plan(args, model: torch.nn.Module, size: tuple[int, int], device: torch.device, cp_group,
          amp_dtype) -> Plan:
    """The execution plan of ``model`` (built on the meta device) at ``size``, before the real model is
    built: whole, query-chunked or tiled against ``--memory-budget-mb`` (default: 90% of the free device
    memory), or one context-parallel rank's estimate against its share of the memory. A size that fits no
    mode is refused in one line naming ``--img-size`` and the estimate."""
    budget = args.memory_budget_mb
    world = None
    if cp_group is not None:
        world = torch.distributed.get_world_size(cp_group)
        if budget is None:
            # ranks on one host share its RAM; each GPU rank has a device of its own
            sharing = 1 if device.type == "cuda" else int(os.environ.get("LOCAL_WORLD_SIZE", world))
            budget = default_budget_mb(device) / max(1, sharing)
    elif budget is None:
        budget = default_budget_mb(device)
    try:
        return plan_execution(
            model,
            size,
            device=device,
            budget_mb=budget,
            query_chunk=args.query_chunk,
            overlap_frac=args.tile_overlap,
            act_bytes=2 if amp_dtype is not None else 4,
            context_parallel=world,
        )
    except ValueError as e:
        p = model.patch_embed.patch_size[0]
        raise ValueError(
            f"--img-size {size[0]} {size[1]} ({size[0] // p}x{size[1] // p} patches of {p}px"
            f"{', --context-parallel' if world else ''}): {e}; lower --img-size"
            + (" or run on more ranks" if world else "")
            + (" or raise --memory-budget-mb" if args.memory_budget_mb is not None else "")
        ) from None


def _gather_floats(value: float, group) -> list[float]:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    bufs = [torch.zeros(1, dtype=torch.float64, device=dev) for _ in range(world)]
    dist.all_gather(bufs, torch.tensor([value], dtype=torch.float64, device=dev), group=group)
    return [float(b) for b in bufs]


def cli() -> None:
    try:
        main()
    except (ValueError, TypeError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        print(json.dumps({"error": str(e)}))
        raise SystemExit(2) from e


if __name__ == "__main__":
    cli()
