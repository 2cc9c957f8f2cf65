"""Multi-frame 3D reconstruction with ElsaVGGT: depth maps, cameras and a coloured point cloud.

    python -m elsa_vision.inference.multiview --frames DIR --weights FILE [--config elsa_vggt_small|elsa_vggt]
        --out OUT [--width 518] [--conf-percentile 50] [--device cpu|cuda] [--dtype float32]
        [--frames-chunk 32] [--token-chunk 65536] [--memory-budget-gb G] [--no-progress]

``--weights``: a VGGT checkpoint (``model.safetensors``/``model.pt``) or an ElsaVGGT/Lightning state_dict
(``.safetensors``/``.pt``/``.ckpt`` read with ``weights_only=True``); the architecture (``--config``) is read
from the weights unless given, and weights that fit no config are refused in one line naming the configs
and why. Frames: every ``.png``/``.jpg``/
``.jpeg`` in ``DIR`` (sorted; the first is the reference frame), centre-cropped to a common aspect and resized
to ``width`` (height a multiple of the patch size, at most ``width``). A frame is named by its file's stem
(``0001.png`` -> ``0001``), or by its whole file name where two frames share a stem (``a.jpg``, ``a.png``).

Writes ``OUT/depth/<frame>.npy`` (float32 depth), ``OUT/depth/<frame>.png`` (16-bit, ``depth = value ·
depth_png_scale`` from ``cameras.json``), ``OUT/cameras.json`` (camera-from-world extrinsics, intrinsics,
confidence statistics) and ``OUT/points.ply`` (binary, world points of the pixels whose depth confidence is
above the given percentile, coloured by the frames). The last stdout line is a JSON summary. FP32 by default.
Long sequences: the model's per-frame parts run ``--frames-chunk`` frames at a time and its MLPs
``--token-chunk`` tokens at a time (``ElsaVGGT.set_chunks``; the results are the same, 0 turns a chunking
off), so that what one forward holds at once grows with the frames only through the global attention's
inputs and the kept layer outputs. Before the model runs, :func:`plan_memory` checks the run against
``--memory-budget-gb`` (on CUDA by default the device's free memory) by :func:`estimate_memory`, halving
the chunks until it fits, and refuses a run that cannot fit in one line with the most frames that do; the
summary gives the estimate beside the measured peak. A progress bar on stderr follows the reading of the
frames, the aggregator's layers and the writing of the depth maps (``--no-progress`` hides it).
``--out`` is checked before the model is built: it must be writable, and the outputs of an earlier run there
are replaced only with ``--overwrite`` (which, once the reconstruction is done, removes what the earlier
run wrote: the depth maps of the frames its ``cameras.json`` lists, that file and ``points.ply``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from ..data.geometry import depth_to_world_points, pose_encoding_to_extri_intri, write_ply
from ..data.multiview import resize_frame
from ..data.readers import read_rgb
from ..files import add_output_arguments, prepare_output_dir, remove_outputs
from ..models.vggt import (
    VGGT_CONFIGS,
    ElsaVGGT,
    find_vggt_config,
    load_vggt_state_dict,
    vggt_checkpoint_filter_fn,
    vggt_config_mismatch,
)
from ..utils.accelerator import add_device_argument, resolve_device

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
OUTPUTS = ("depth", "cameras.json", "points.ply")
_EXTS = (".png", ".jpg", ".jpeg")
_POINTS_CHUNK = 32  # frames at a time from depth to world points (float64 temporaries of that many frames)


def load_frames(
    frames_dir: Path, width: int, patch_size: int, max_frames: int | None = None, progress: bool = False
) -> tuple[list[str], torch.Tensor]:
    """Images of ``frames_dir`` -> (names (:func:`frame_names`), ``[S, 3, H, W]`` in [0, 1]), read one by
    one into one preallocated tensor (``progress``: a bar on stderr)."""
    paths = list_frames(frames_dir, max_frames)
    names = frame_names(paths)
    if width % patch_size:
        raise ValueError(f"--width must be a multiple of the patch size {patch_size}, got {width}")
    first = read_rgb(paths[0])
    h0, w0 = first.shape[1:]
    height = min(width, max(patch_size, round(h0 * width / w0 / patch_size) * patch_size))
    eye = torch.eye(3, dtype=torch.float64)
    imgs = None
    for i, p in enumerate(_bar(paths, progress, "reading frames", "frame")):
        img = resize_frame(read_rgb(p) if i else first, eye, (height, width))[0]
        if imgs is None:
            imgs = img.new_empty((len(paths), *img.shape))
        imgs[i] = img
    return names, imgs


# What a block holds per token while it forms its attention's inputs, in elements of ``embed_dim`` (the
# accounting of ``estimate_memory``): its input (the frame block's output, kept by the aggregator),
# ``norm1``'s output, the fused q, k, v, the normalised q and k, the rotated q, and the rotation of k in
# flight (the products of its two halves and their sum).
_ATTENTION_WORKSET = 1 + 1 + 3 + 2 + 1 + 3
_HEAD_CHANNELS = 2  # a DPT head's full-resolution working set per pixel, in multiples of its ``features``


def _tokens_per_frame(model: ElsaVGGT, hw: tuple[int, int]) -> int:
    """The aggregator's tokens per frame of ``hw``: camera and register tokens, then the patches."""
    agg = model.aggregator
    return agg.patch_start_idx + (hw[0] // agg.patch_size) * (hw[1] // agg.patch_size)


def estimate_memory(
    model: ElsaVGGT, frames: int, hw: tuple[int, int], dtype: torch.dtype,
    frames_chunk: int | None = None, token_chunk: int | None = None,
) -> dict[str, int]:
    """Bytes the CLI's reconstruction holds at its peak for ``frames`` frames of ``hw`` with ``model`` cast
    to ``dtype`` (:func:`reconstruct` under :meth:`ElsaVGGT.set_chunks` of ``frames_chunk`` /
    ``token_chunk``), by an accounting of its largest tensors: ``weights``; ``frames`` (the float32 frames
    on the device, their ``dtype`` copy and the aggregator's normalised copy); ``activations``, the largest
    of the phases a forward passes through; and ``total``.

    Phases: the last global block's attention inputs (the kept layer outputs before it, ``2 * embed_dim``
    per token each, and its own working set: ``_ATTENTION_WORKSET``, plus the float16 parts of the keys and
    values where the FP32-accurate kernels split them); its MLP (``token_chunk`` tokens at a time through the
    hidden layer); the last frame block (``frames_chunk`` frames of the same working set beside the whole
    input and output); and the heads (every kept output, the depth / point maps and
    ``DPTHead.frames_chunk_size`` frames of full-resolution features). Attention itself holds O(tokens).
    An estimate, not a bound: the measurements it was checked against are in ``docs/vggt.md``."""
    agg = model.aggregator
    b = torch.finfo(dtype).bits // 8
    S, (H, W) = int(frames), hw
    P = _tokens_per_frame(model, hw)
    C = agg.camera_token.shape[-1]
    hidden = agg.global_blocks[0].mlp.fc1.out_features
    kept_layers = range(agg.depth) if agg.keep_layers is None else agg.keep_layers
    kept = len(kept_layers)
    before = 2 * sum(i < agg.depth - 1 for i in kept_layers) * C * S * P  # kept when the last block runs
    split = 2 if dtype == torch.float32 else 0  # k, v as two float16 parts each: 4 C halves = 2 C floats
    tokens = S * P
    weights = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    pixels = S * 3 * H * W
    frames_bytes = pixels * 4 + (pixels * b if dtype != torch.float32 else 0) + pixels * b
    attention = (before + (_ATTENTION_WORKSET + split) * C * tokens) * b
    rows = tokens if token_chunk is None else min(tokens, token_chunk)
    mlp = (before + 3 * C * tokens + (2 * hidden + 2 * C) * rows) * b  # input, residual, output; a chunk
    chunk = S if frames_chunk is None else min(S, frames_chunk)
    per_frame = (before + 2 * C * tokens + (_ATTENTION_WORKSET + split) * C * chunk * P) * b
    heads = [h for h in (model.depth_head, model.point_head) if h is not None]
    # depth (+ points) and confidence maps; full-resolution features of one chunk of frames
    maps = sum(h.scratch.output_conv2[-1].out_channels for h in heads) * S * H * W * b
    head_chunk = min(S, heads[0].frames_chunk_size or S) if heads else 0
    features = heads[0].scratch.output_conv1.in_channels if heads else 0
    head_work = _HEAD_CHANNELS * features * head_chunk * H * W * b
    heads_phase = 2 * kept * C * tokens * b + maps + head_work
    activations = max(attention, mlp, per_frame, heads_phase)
    return {"weights": weights, "frames": frames_bytes, "activations": activations,
            "total": weights + frames_bytes + activations}


def plan_memory(
    model: ElsaVGGT, frames: int, hw: tuple[int, int], dtype: torch.dtype, budget: int,
    frames_chunk: int | None = None, token_chunk: int | None = None,
) -> tuple[int | None, int | None, dict[str, int]]:
    """The chunk sizes for ``frames`` frames within ``budget`` bytes by :func:`estimate_memory`: the given
    ``frames_chunk`` / ``token_chunk`` if they fit, else the largest halvings of them that do (down to one
    frame and 4,096 tokens; None, all at once, starts at the frame count / token count). Returns
    ``(frames_chunk, token_chunk, estimate)``. Raises ValueError, in one line, when even the smallest chunks
    do not fit: the estimate, the budget and the most frames that fit."""
    if frames < 1 or budget <= 0:
        raise ValueError(f"plan_memory: frames must be >= 1 and budget > 0 bytes, got {frames} and {budget}")
    P = _tokens_per_frame(model, hw)
    fc = frames if frames_chunk is None else frames_chunk
    tc = frames * P if token_chunk is None else token_chunk
    first = None
    while True:
        est = estimate_memory(model, frames, hw, dtype, fc, tc)
        first = first or est
        if est["total"] <= budget:
            return (None if frames_chunk is None and fc == frames else fc,
                    None if token_chunk is None and tc == frames * P else tc, est)
        if fc > 1 or tc > 4096:
            fc, tc = max(1, fc // 2), max(min(tc, 4096), tc // 2)
            continue
        lo, hi = 0, frames  # the most frames that fit with these smallest chunks
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if estimate_memory(model, mid, hw, dtype, fc, tc)["total"] <= budget:
                lo = mid
            else:
                hi = mid - 1
        gib = 2**30
        raise ValueError(
            f"{frames:,} frames of {hw[0]}x{hw[1]} in {str(dtype).replace('torch.', '')} need about "
            f"{first['total'] / gib:.1f} GiB by the memory estimate (weights {first['weights'] / gib:.1f}, "
            f"frames {first['frames'] / gib:.1f}, activations {first['activations'] / gib:.1f}), "
            f"{est['total'] / gib:.1f} GiB with the smallest chunks, more than the budget of "
            f"{budget / gib:.1f} GiB (--memory-budget-gb; default: the device's free memory); "
            + (f"at most {lo:,} frames fit: --max-frames {lo}" if lo else "not even one frame fits")
            + (", or a smaller --width" + (" or --dtype bfloat16" if dtype == torch.float32 else "")))


def _bar(items, progress: bool, desc: str, unit: str, total: int | None = None):
    """``items`` under a tqdm bar on stderr when ``progress``."""
    if not progress:
        return items
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit=unit, total=total, file=sys.stderr)


def list_frames(frames_dir: Path, max_frames: int | None = None) -> list[Path]:
    """The frame files of ``frames_dir`` in order (the first ``max_frames``); errors name ``--frames``."""
    if not frames_dir.is_dir():
        raise FileNotFoundError(f"--frames: {frames_dir} is not a directory")
    paths = sorted(p for p in frames_dir.iterdir() if p.suffix.lower() in _EXTS)
    if max_frames:
        paths = paths[:max_frames]
    if not paths:
        raise ValueError(f"--frames: no {'/'.join(_EXTS)} images in {frames_dir}")
    return paths


def frame_names(paths: list[Path]) -> list[str]:
    """The names of the frames in the outputs (``depth/<name>.npy``, ``cameras.json``): the file's stem, or
    its whole name where two frames share a stem (``a.jpg`` and ``a.png``). Names are compared ignoring
    letter case (a case-insensitive filesystem keeps one ``A.npy`` for ``a`` and ``A``); two frames whose
    names still coincide are refused in one line."""
    stems = Counter(p.stem.casefold() for p in paths)
    names = [p.name if stems[p.stem.casefold()] > 1 else p.stem for p in paths]
    seen: dict[str, Path] = {}
    for name, p in zip(names, paths):
        other = seen.setdefault(name.casefold(), p)
        if other is not p:
            raise ValueError(
                f"--frames: {other.name!r} and {p.name!r} would write the same depth map "
                f"(depth/{name}.npy); rename one of them"
            )
    return names


def build_model(
    weights: Path, config: str | None = None, merge_ratio: float = 0.0
) -> tuple[ElsaVGGT, list[str], str]:
    """The model of ``weights`` in eval mode, the dropped checkpoint keys and the config name (read from the
    weights when ``config`` is None). Weights that do not fit raise one ``ValueError`` line."""
    sd = load_vggt_state_dict(weights, arg="--weights")
    if config is None:
        config = find_vggt_config(sd, f"--weights {weights}")
    else:
        mismatch = vggt_config_mismatch(sd, config)
        if mismatch is not None:
            fits = [name for name in VGGT_CONFIGS if vggt_config_mismatch(sd, name) is None]
            raise ValueError(f"--weights {weights} does not fit --config {config} ({mismatch}); configs that "
                             f"fit: {', '.join(fits) or 'none'}")
    has_point = any(k.startswith("point_head.") for k in sd)
    model = ElsaVGGT.from_config(config, enable_point=has_point, merge_ratio=merge_ratio)
    sd, dropped = vggt_checkpoint_filter_fn(sd, model)
    model.load_state_dict(sd, strict=True)
    return model.eval(), dropped, config


@torch.no_grad()
def reconstruct(
    model: ElsaVGGT, images: torch.Tensor, dtype: torch.dtype = torch.float32, progress: bool = False
) -> dict[str, torch.Tensor]:
    """``images [S, 3, H, W]`` -> depth ``[S, H, W]``, conf, extrinsics ``[S, 3, 4]``, intrinsics, points
    (``progress``: a bar on stderr over the aggregator's layers)."""
    H, W = images.shape[-2:]
    hooks = []
    if progress:
        bar = _bar(None, True, "aggregator", "layer", total=len(model.aggregator.global_blocks))

        def tick(*_) -> None:  # a forward hook that returns something replaces the block's output
            bar.update()

        hooks = [b.register_forward_hook(tick) for b in model.aggregator.global_blocks]
    try:
        out = model(images[None].to(dtype))
    finally:
        for h in hooks:
            h.remove()
        if progress:
            bar.close()
    ext, intr = pose_encoding_to_extri_intri(out["pose_enc"][0].double(), (H, W))
    depth = out["depth"][0, ..., 0]
    pts = depth.new_empty((*depth.shape, 3), dtype=torch.float32)
    for s in range(0, depth.shape[0], _POINTS_CHUNK):  # float64 products, a chunk of frames at a time
        e = s + _POINTS_CHUNK
        pts[s:e] = depth_to_world_points(depth[s:e].double(), ext[s:e], intr[s:e])
    return {
        "depth": depth.float(),
        "conf": out["depth_conf"][0].float(),
        "extrinsics": ext.float(),
        "intrinsics": intr.float(),
        "points": pts,
    }


def confidence_threshold(conf: torch.Tensor, percentile: float) -> float:
    """The ``percentile`` (0-100) of ``conf``, linearly interpolated as ``torch.quantile``, in float64, of any
    size (``torch.quantile`` has refused inputs of more than 2^24 elements; 1,000 frames of 336x518 are
    174M)."""
    if not conf.numel():
        return 0.0
    return float(np.quantile(conf.detach().cpu().reshape(-1).double().numpy(), percentile / 100.0))


def _remove_earlier_outputs(out: Path) -> None:
    """What an earlier run wrote in ``out``: the ``depth/<frame>.npy|png`` of the frames its
    ``cameras.json`` lists (other files in ``depth/``, a dataset's own depth maps, stay), ``cameras.json``
    and ``points.ply``."""
    cams = out / "cameras.json"
    try:
        frames = json.loads(cams.read_text()).get("frames", []) if cams.is_file() else []
        names = [f["name"] for f in frames if isinstance(f, dict) and isinstance(f.get("name"), str)]
    except (OSError, ValueError, AttributeError):  # not one this tool wrote: nothing of it is removed
        names = []
    for name in names:
        if Path(name).name != name or name in ("", ".", ".."):
            continue  # a frame name is a file name, never a path
        for suffix in (".npy", ".png"):
            path = out / "depth" / f"{name}{suffix}"
            if path.is_file() and not path.is_symlink():
                path.unlink()
    remove_outputs(out, ("cameras.json", "points.ply"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(
        prog="python -m elsa_vision.inference.multiview", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--frames", required=True, type=Path, help="directory of frames (png/jpg)")
    ap.add_argument(
        "--weights", required=True, type=Path, help="VGGT or ElsaVGGT weights (.safetensors/.pt/.ckpt)"
    )
    ap.add_argument("--config", default=None, choices=sorted(VGGT_CONFIGS),
                    help="architecture of --weights (default: read from the weights)")
    add_output_arguments(ap, "output directory", required=True, type=Path)
    ap.add_argument(
        "--width", type=int, default=None, help="model input width (default: the config's img_size)"
    )
    ap.add_argument("--max-frames", type=int, default=None)
    ap.add_argument(
        "--conf-percentile", type=float, default=50.0, help="keep points above this confidence percentile"
    )
    add_device_argument(ap)
    ap.add_argument("--dtype", default="float32", choices=sorted(_DTYPES))
    ap.add_argument("--frames-chunk", type=int, default=32,
                    help="frames at a time through the per-frame parts of the model (0: all at once)")
    ap.add_argument("--token-chunk", type=int, default=65536,
                    help="tokens at a time through every MLP (0: all at once)")
    ap.add_argument("--memory-budget-gb", type=float, default=None,
                    help="GiB the reconstruction may hold (default on CUDA: the device's free memory with "
                         "the model on it); the chunks are halved until the memory estimate fits, else the "
                         "run is refused before it starts")
    ap.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    ap.add_argument(
        "--merge-ratio",
        type=float,
        default=0.0,
        help="FastVGGT token merging in the global blocks (approximate attention); 0 = exact (default)",
    )
    args = ap.parse_args(argv)
    if not 0.0 <= args.conf_percentile < 100.0:
        ap.error(f"--conf-percentile must be in [0, 100), got {args.conf_percentile}")
    t0 = time.perf_counter()
    if not 0.0 <= args.merge_ratio < 1.0:
        ap.error(f"--merge-ratio must be in [0, 1), got {args.merge_ratio}")
    for flag in ("frames_chunk", "token_chunk"):
        if getattr(args, flag) < 0:
            ap.error(f"--{flag.replace('_', '-')} must be >= 0 (0: all at once), got {getattr(args, flag)}")
    if args.memory_budget_gb is not None and not args.memory_budget_gb > 0:
        ap.error(f"--memory-budget-gb must be > 0, got {args.memory_budget_gb}")
    progress = not args.no_progress
    try:  # before anything is read or computed
        args.out = prepare_output_dir(args.out, OUTPUTS, overwrite=args.overwrite)
        device = resolve_device(args.device)
    except ValueError as e:
        ap.error(str(e))
    frame_names(list_frames(args.frames, args.max_frames))  # before the model is built
    model, dropped, config = build_model(args.weights, args.config, args.merge_ratio)
    cfg = VGGT_CONFIGS[config]
    dtype = _DTYPES[args.dtype]
    model = model.to(device=device, dtype=dtype)
    names, images = load_frames(
        args.frames, args.width or cfg["img_size"], cfg["patch_size"], args.max_frames, progress
    )
    budget = None if args.memory_budget_gb is None else int(args.memory_budget_gb * 2**30)
    if budget is None and device.type == "cuda":  # what is free, and what this process holds (the model)
        budget = torch.cuda.mem_get_info(device)[0] + torch.cuda.memory_allocated(device)
    frames_chunk, token_chunk = args.frames_chunk or None, args.token_chunk or None
    hw = tuple(images.shape[-2:])
    if budget is not None:
        frames_chunk, token_chunk, estimate = plan_memory(model, len(names), hw, dtype, budget, frames_chunk,
                                                          token_chunk)
    else:
        estimate = estimate_memory(model, len(names), hw, dtype, frames_chunk, token_chunk)
    model.set_chunks(frames=frames_chunk, tokens=token_chunk)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t_model = time.perf_counter()
    res = reconstruct(model, images.to(device), _DTYPES[args.dtype], progress)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t_model = time.perf_counter() - t_model
    res = {k: v.cpu() for k, v in res.items()}
    out = args.out
    if args.overwrite:  # no depth map of a longer earlier sequence stays beside the new ones
        _remove_earlier_outputs(out)
    (out / "depth").mkdir(parents=True, exist_ok=True)
    depth = res["depth"].numpy()
    dmax = float(depth.max()) if depth.size else 1.0
    png_scale = dmax / 65535.0 if dmax > 0 else 1.0
    from PIL import Image

    for i, name in enumerate(_bar(names, progress, "writing depth maps", "frame")):
        np.save(out / "depth" / f"{name}.npy", depth[i])
        Image.fromarray(np.clip(np.rint(depth[i] / png_scale), 0, 65535).astype(np.uint16)).save(
            out / "depth" / f"{name}.png"
        )
    cams = {
        "convention": "extrinsics: camera-from-world [R|t], OpenCV axes; "
        "intrinsics: pixel (u, v) = column/row index",
        "image_size_hw": list(images.shape[-2:]),
        "depth_png_scale": png_scale,
        "frames": [
            {
                "name": n,
                "extrinsics": res["extrinsics"][i].tolist(),
                "intrinsics": res["intrinsics"][i].tolist(),
                "depth_conf_mean": float(res["conf"][i].mean()),
            }
            for i, n in enumerate(names)
        ],
    }
    (out / "cameras.json").write_text(json.dumps(cams, indent=1))
    thresh = confidence_threshold(res["conf"], args.conf_percentile)
    keep = (res["conf"] >= thresh) & torch.isfinite(res["points"]).all(-1)
    colors = (images.permute(0, 2, 3, 1)[keep].numpy() * 255).round().clip(0, 255).astype(np.uint8)
    write_ply(out / "points.ply", res["points"][keep], colors)
    summary = {
        "frames": len(names),
        "image_size_hw": list(images.shape[-2:]),
        "config": config,
        "dtype": args.dtype,
        "exact_attention": args.merge_ratio == 0.0,
        "device": str(device),
        "points": int(keep.sum()),
        "out": str(out),
        "dropped_checkpoint_keys": len(dropped),
        "frames_chunk": frames_chunk,
        "token_chunk": token_chunk,
        "memory_estimate_gb": round(estimate["total"] / 2**30, 3),
        "memory_budget_gb": None if budget is None else round(budget / 2**30, 3),
        "reconstruct_seconds": round(t_model, 3),
        "seconds": round(time.perf_counter() - t0, 3),
    }
    if device.type == "cuda":  # weights, frames and every activation: the largest amount allocated at once
        summary["peak_gpu_gb"] = round(torch.cuda.max_memory_allocated(device) / 2**30, 3)
    print(json.dumps(summary))
    sys.stdout.flush()
    return summary


def cli() -> None:
    """``python -m elsa_vision.inference.multiview``: errors in the inputs end the run with one line."""
    try:
        main()
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    cli()
