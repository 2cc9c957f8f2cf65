"""Training throughput of the ImageNet recipe on 1..N devices: ElsaViT vs timm's ViT, same recipe, one run.

Both peers are built from the project's Hydra configs (`configs/`): `data=imagefolder` (timm transforms,
workers, batch size per device), `model=elsa_vit_b` or `model=elsa_vit_l` (ClassificationModule, AdamW,
cosine warm-up schedule, label smoothing, drop path) and, on several devices, `trainer=ddp` or `trainer=fsdp`
(the strategy those configs instantiate). The only difference is the backbone: `elsa_vit_base_patch16_224`
(ELSA attention, FP32-accurate split GEMMs in float32) or timm's `vit_base_patch16_224`
(`F.scaled_dot_product_attention`, PyTorch's GEMMs). Precisions are Lightning's (`32-true` with TF32 off,
`bf16-mixed`). The data is a synthetic ImageFolder of ImageNet-sized JPEGs (500 x 375 px noise images) written
once to a temporary folder, or an existing `root/{train,val}/<class>/*` tree given with `--root`.

`--devices 1,2,4` runs every world size in turn: one device in this process, N devices as N processes of
`torchrun` (one per GPU, NCCL; gloo processes with `--device cpu`), each rank with the per-device batch size.
Per world size, precision and peer: the median time of one training step on rank 0 (forward, backward,
gradient reduction, optimiser; the GPU's time between CUDA events, nothing synchronised between the steps:
``common.step_timer``; after `--warmup` steps) as `img_per_s_compute` (all
ranks' images per step over it) and `img_per_s_per_device`; images over the wall time from the first timed
step to the last as `img_per_s_end_to_end` (includes waiting for the data loaders); the largest peak of
allocated memory over the ranks, counted above what was allocated when the run started (the earlier runs'
memory is collected first: a finished DDP or FSDP fit leaves part of its training state allocated until
the cyclic garbage collector frees it); the peers run in turns of alternating order (a process's first DDP
run peaks about one copy of the parameters below the runs after it, whichever model it trains);
`scaling` (images/s over the world size times the one-device images/s of the same peer and precision) and
`vs_timm` (ELSA over timm at the same world size and precision; a precision listed several times runs the
peers in turns, each turn's rows paired with each other, and the median and range of the turns' `vs_timm`
are printed at the end: a host-bound case moves with the host's load). Rows go to
`logs/benchmarks/train_throughput_<device>.csv` (or `--out`).

`--profile` also records `PROFILED_STEPS` more steps after the timed ones with `torch.profiler` (steady
steps, never a timed one) and reports, per step and rank, how long the GPU was busy with communication
kernels (NCCL), with other kernels, and with both at once: communication that no computation hides is
`exposed`; `idle_ms` is the part of a profiled step's wall time the GPU did nothing (waiting for the host),
and `waits_ms` the idle time between its kernels by the host work that ended each wait (forward, backward,
optimiser: `idle_by_phase`). Each rank writes its Chrome trace
(`trace_<peer>_<precision>_w<world>_r<rank>.json`), rank 0 the summaries (`train_profile_<device>.json`).

    python -m benchmarks.train_throughput                                 # one GPU: ViT-B/16 224 px b64 FP32
    python -m benchmarks.train_throughput --devices 1,2,4 --precisions 32-true,bf16-mixed   # DDP scaling
    python -m benchmarks.train_throughput --precisions bf16-mixed,bf16-mixed,bf16-mixed   # peers in turns
    python -m benchmarks.train_throughput --devices 1,2,4 --model elsa_vit_l --strategy fsdp --batch-size 32
    python -m benchmarks.train_throughput --quick --device cpu              # smoke run: ViT-Ti, 64 px
    python -m benchmarks.train_throughput --quick --device cpu --devices 1,2  # the DDP path on gloo processes
    python -m benchmarks.train_throughput --devices 4 --model elsa_vit_l --strategy fsdp --profile  # overlap

Goals (H100): ElsaViT-B FP32 images/s >= 1.1x timm's with the same recipe; DDP on 2 / 4 GPUs >= 1.9x / 3.7x
one GPU's images/s.
"""

from __future__ import annotations

import argparse
import bisect
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import (
    ROOT,
    Results,
    add_out_dir,
    columns,
    device_tag,
    gpu_work,
    run_info,
    step_timer,
    sync,
)

COLUMNS = columns("world", "strategy", "precision", "peer", "backbone", "img_size", "batch_per_device",
                  "steps", "step_ms", "img_per_s_compute", "img_per_s_per_device", "img_per_s_end_to_end",
                  "peak_mb_per_rank", "scaling", "vs_timm")  # fmt: skip
# The timm peer of each ELSA backbone (same architecture, stock attention and GEMMs).
TIMM_PEER = {
    "elsa_vit_tiny_patch16_224": "vit_tiny_patch16_224",
    "elsa_vit_base_patch16_224": "vit_base_patch16_224",
    "elsa_vit_large_patch16_224": "vit_large_patch16_224",
}
# The recipe (model config, data geometry) and the step counts of the full and the smoke run.
FULL = dict(model="elsa_vit_b", img_size=224, batch=64, classes=10, steps=20, warmup=5, workers=8)
QUICK = dict(model="elsa_vit_t", img_size=64, batch=4, classes=2, steps=3, warmup=1, workers=0)
PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
PROFILED_STEPS = 2  # --profile: steps recorded after the timed ones
STRATEGIES = ("ddp", "fsdp")
UNIQUE_IMAGES = 64  # distinct JPEGs per split; the rest of the tree links to them (decoded all the same)


def make_imagefolder(root: Path, classes: int, per_class: int, size=(500, 375), seed: int = 0) -> Path:
    """``root/{train,val}/class_<i>/<n>.jpg`` of random-noise JPEGs (quality 90), decoded like ImageNet's.
    At most ``UNIQUE_IMAGES`` files per split are encoded; the others are hard links to them (a copy where
    the file system has none), so that a tree of thousands of images is written in seconds."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    for split, n in (("train", per_class), ("val", max(2, per_class // 8))):
        written: list[Path] = []
        for c in range(classes):
            folder = root / split / f"class_{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(n):
                path = folder / f"{i}.jpg"
                if len(written) < UNIQUE_IMAGES:
                    pixels = rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
                    Image.fromarray(pixels).save(path, quality=90)
                    written.append(path)
                    continue
                source = written[(c * n + i) % len(written)]
                try:
                    os.link(source, path)
                except OSError:
                    shutil.copyfile(source, path)
    return root


def _union(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Disjoint sorted intervals covering the same points as ``intervals``."""
    merged: list[tuple[float, float]] = []
    for lo, hi in sorted(intervals):
        if merged and lo <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], hi))
        else:
            merged.append((lo, hi))
    return merged


def _length(intervals: list[tuple[float, float]]) -> float:
    return sum(hi - lo for lo, hi in intervals)


def _intersection(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the points two lists of disjoint sorted intervals share."""
    i = j = 0
    shared = 0.0
    while i < len(a) and j < len(b):
        shared += max(0.0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return shared


def overlap_summary(kernels: list[tuple[str, float, float]], steps: int) -> dict:
    """Per step (ms): the GPU time busy with communication kernels (NCCL: ``comm_ms``), with the others
    (``compute_ms``), with either (``busy_ms``) and with both at once (``overlap_ms``); ``exposed_comm_ms``
    is the communication no computation hides. ``kernels``: ``(name, start_us, end_us)`` over ``steps``
    steps; ``top``: the ten kernels of most GPU time per step."""
    comm = _union([(lo, hi) for name, lo, hi in kernels if "nccl" in name.lower()])
    compute = _union([(lo, hi) for name, lo, hi in kernels if "nccl" not in name.lower()])
    both = _intersection(comm, compute)
    comm_us, compute_us = _length(comm), _length(compute)
    per = 1e3 * max(steps, 1)
    totals: dict[str, float] = {}
    for name, lo, hi in kernels:
        totals[name] = totals.get(name, 0.0) + hi - lo
    top = sorted(totals.items(), key=lambda kv: -kv[1])[:10]
    return {
        "kernels_per_step": round(len(kernels) / max(steps, 1), 1),
        "busy_ms": round((comm_us + compute_us - both) / per, 3),
        "compute_ms": round(compute_us / per, 3),
        "comm_ms": round(comm_us / per, 3),
        "overlap_ms": round(both / per, 3),
        "exposed_comm_ms": round((comm_us - both) / per, 3),
        "top": [[name[:120], round(us / per, 3)] for name, us in top],
    }


# The host work a GPU waits for, by the name of the host ops around the launch that ends the wait.
WAIT_PHASES = ("forward", "backward", "optimizer")


def idle_by_phase(trace_events: list[dict], steps: int) -> dict[str, float]:
    """Per step (ms): the GPU's idle time between its first and last kernel of a profiled span, split by the
    host work it waited for -- the phase of the launch that ended each idle interval: ``backward`` where the
    launch runs inside an autograd node (``autograd::engine::evaluate_function``), ``optimizer`` where its
    innermost host op is a ``_foreach`` operator (the optimiser's, gradient clipping's), ``forward`` otherwise
    (the forward, the loss, metrics, the batch's copy, the trainer's hooks). ``trace_events``: a Chrome
    trace's ``traceEvents`` from ``torch.profiler`` (kernels, copies and memsets tied to their launches by
    ``args.correlation``)."""
    spans = [e for e in trace_events if e.get("ph") == "X"]
    gpu = sorted((e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    launch = {e["args"]["correlation"]: e for e in spans
              if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    ops: dict = {}
    for e in spans:
        if e.get("cat") == "cpu_op":
            ops.setdefault(e["tid"], []).append(e)
    starts, nodes = {}, {}
    for tid, v in ops.items():
        v.sort(key=lambda e: e["ts"])
        starts[tid] = [e["ts"] for e in v]
        nodes[tid] = _union([(e["ts"], e["ts"] + e["dur"]) for e in v
                             if e["name"].startswith("autograd::engine::evaluate_function")])
    waits = dict.fromkeys(WAIT_PHASES, 0.0)
    end = gpu[0]["ts"] + gpu[0]["dur"] if gpu else 0.0
    for e in gpu[1:]:
        if e["ts"] > end:
            waits[_wait_phase(launch.get(e.get("args", {}).get("correlation")), ops, starts, nodes)] += (
                e["ts"] - end)
        end = max(end, e["ts"] + e["dur"])
    return {k: round(v / 1e3 / max(steps, 1), 3) for k, v in waits.items()}


def _wait_phase(launch: dict | None, ops: dict, starts: dict, nodes: dict) -> str:
    if launch is None:
        return "forward"
    tid, t = launch["tid"], launch["ts"]
    i = bisect.bisect_right(nodes.get(tid, []), (t, math.inf))
    if i and nodes[tid][i - 1][1] >= t:
        return "backward"
    j = bisect.bisect_right(starts.get(tid, []), t)  # the host ops begun by the launch, the latest last
    for e in reversed(ops.get(tid, [])[max(0, j - 64):j]):
        if e["ts"] + e["dur"] >= t:  # the innermost host op around the launch
            return "optimizer" if e["name"].startswith("aten::_foreach") else "forward"
    return "forward"


def step_profiler(first: int, count: int, trace: Path | None):
    """A Lightning callback recording steps ``first .. first + count - 1`` with ``torch.profiler`` (host and
    CUDA activity): ``summary`` is their :func:`overlap_summary` with ``wall_ms``, the device-synchronised
    wall time per profiled step, and ``idle_ms``, the part of it the GPU did nothing (waiting for the host:
    its launches, the profiler's own work); the Chrome trace goes to ``trace``."""
    import lightning as L
    from torch.profiler import ProfilerActivity, profile

    class StepProfiler(L.Callback):
        def __init__(self) -> None:
            self.prof = None
            self.summary: dict | None = None

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == first:
                sync(pl_module.device)
                activities = [ProfilerActivity.CPU]
                if pl_module.device.type == "cuda":
                    activities.append(ProfilerActivity.CUDA)
                self.prof = profile(activities=activities)
                self.prof.__enter__()
                self.t0 = time.perf_counter()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == first + count - 1 and self.prof is not None:
                sync(pl_module.device)
                wall_ms = (time.perf_counter() - self.t0) * 1e3 / count
                self.prof.__exit__(None, None, None)
                summary = overlap_summary(gpu_work(self.prof.events()), count)
                self.summary = dict(summary, wall_ms=round(wall_ms, 3),
                                    idle_ms=round(max(wall_ms - summary["busy_ms"], 0.0), 3))
                if trace is not None:
                    self.prof.export_chrome_trace(str(trace))
                    events = json.loads(trace.read_text())["traceEvents"]
                    self.summary["waits_ms"] = idle_by_phase(events, count)
                self.prof = None

    return StepProfiler()


def compose_recipe(spec: dict, root: Path, device: torch.device):
    """The recipe's Hydra config for ``spec`` on the ImageFolder at ``root``, with ``spec["overrides"]``
    (``--override``, Hydra syntax) applied last."""
    from hydra import compose, initialize_config_dir

    overrides = [
        "data=imagefolder",
        f"data.root={root}",
        f"data.batch_size={spec['batch']}",
        f"data.num_workers={spec['workers']}",
        f"data.persistent_workers={spec['workers'] > 0}",
        f"data.pin_memory={device.type == 'cuda'}",
        f"data.img_size={spec['img_size']}",
        f"model={spec['model']}",
        f"trainer={spec['strategy']}",
        *spec.get("overrides", ()),
    ]
    with initialize_config_dir(config_dir=str(ROOT / "configs"), version_base="1.3"):
        return compose(config_name="train", overrides=overrides)


def run_peer(peer: str, precision: str, spec: dict, root: Path, device: torch.device,
             profile_dir: Path | None = None) -> dict:
    """Fit ``warmup + steps`` steps (``PROFILED_STEPS`` more with ``profile_dir``) of the recipe with one
    backbone on this process's share of the world (every rank calls it); return rank 0's timing row, with
    the largest peak memory over the ranks."""
    import hydra
    import lightning as L
    import torch.distributed as dist
    from omegaconf import open_dict

    from elsa_vision.tasks.train import instantiate_data

    world = dist.get_world_size() if dist.is_initialized() else 1
    cfg = compose_recipe(spec, root, device)
    if peer == "timm":  # the same recipe around timm's stock model of the ELSA backbone's architecture
        net = cfg.model.net
        if net.model_name not in TIMM_PEER:
            raise SystemExit(f"no timm peer for {net.model_name} (known: {', '.join(TIMM_PEER)})")
        with open_dict(cfg):
            net.model_name = TIMM_PEER[net.model_name]
            for key in ("attn_backend", "attn_precision", "linear_backend"):
                net.pop(key)
    L.seed_everything(0, workers=True)
    datamodule = instantiate_data(cfg)
    model = hydra.utils.instantiate(cfg.model, _convert_="partial")
    # One device: Lightning's plain single-device loop; several: the strategy of trainer=ddp|fsdp.
    strategy = hydra.utils.instantiate(cfg.trainer.strategy) if world > 1 else "auto"
    timer = step_timer(spec["warmup"], spec["steps"])
    callbacks = [timer]
    profiler = None
    if profile_dir is not None:
        rank = dist.get_rank() if dist.is_initialized() else 0
        trace = profile_dir / f"trace_{peer}_{precision}_w{world}_r{rank}.json"
        profiler = step_profiler(spec["warmup"] + spec["steps"], PROFILED_STEPS, trace)
        callbacks.append(profiler)
    base = 0
    if device.type == "cuda":
        gc.collect()  # what earlier runs in this process left behind (their DDP buckets: see peak below)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    trainer = L.Trainer(
        accelerator="gpu" if device.type == "cuda" else "cpu",
        devices=world,
        num_nodes=1,
        strategy=strategy,
        precision=precision,
        max_steps=spec["warmup"] + spec["steps"] + (0 if profiler is None else PROFILED_STEPS),
        limit_val_batches=0,
        num_sanity_val_steps=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=callbacks,
    )
    trainer.fit(model=model, datamodule=datamodule)
    if len(timer.steps) < spec["steps"]:
        raise RuntimeError(
            f"{peer}: {len(timer.steps)} timed steps, expected {spec['steps']} (too few images "
            f"for warmup + steps at batch {spec['batch']} on {world} device(s)?)"
        )
    # This run's own peak: what it allocated above what was allocated when it started (0 once the earlier
    # runs' reference cycles are collected; without that, a DDP run of ViT-B left ~330 MB and an FSDP run of
    # ViT-L its rank's shard of the training state allocated for the next peer's peak to carry). A process's
    # first DDP run peaks ~one copy of the parameters below every later run of either model
    # (docs/benchmarks/train_throughput.md, "Per-rank peak memory").
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else None
    peaks = [peak]
    summaries = [None if profiler is None else profiler.summary]
    if world > 1:
        peaks = [None] * world
        dist.all_gather_object(peaks, peak)
        if profiler is not None:
            summaries = [None] * world
            dist.all_gather_object(summaries, profiler.summary)
    step = statistics.median(timer.steps)
    wall = timer.last - timer.first
    del trainer, model, datamodule
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {
        "world": world,
        "strategy": spec["strategy"] if world > 1 else "single",
        "precision": precision,
        "peer": peer,
        "backbone": cfg.model.net.model_name,
        "img_size": spec["img_size"],
        "batch_per_device": spec["batch"],
        "steps": len(timer.steps),
        "step_ms": round(step * 1e3, 3),
        "img_per_s_compute": round(world * spec["batch"] / step, 2),
        "img_per_s_per_device": round(spec["batch"] / step, 2),
        "img_per_s_end_to_end": round(world * spec["batch"] * len(timer.steps) / wall, 2),
        "peak_mb_per_rank": None if peaks[0] is None else round(max(peaks), 1),
        "earlier_mb": round(base / 2**20, 1),  # allocated at the start on this rank (printed, not a column)
        **({} if profiler is None else {"profile": summaries}),
    }


def run_world(spec: dict, precisions: list[str], root: Path, device: torch.device,
              profile_dir: Path | None = None) -> list[dict]:
    """Every precision and peer on this process (one device, or one rank of a torchrun world), the peers in
    turns whose order alternates (timm first, then ELSA first, ...): a process's first DDP run peaks lower
    than the runs after it, whichever model it trains (see ``run_peer``)."""
    return [run_peer(peer, precision, spec, root, device, profile_dir)
            for turn, precision in enumerate(precisions)
            for peer in (("timm", "elsa") if turn % 2 == 0 else ("elsa", "timm"))]  # fmt: skip


def _worker(a, spec: dict) -> None:
    """One rank of a ``torchrun`` world: join the group, run every case, rank 0 writes the rows as JSON."""
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    if a.device == "cuda":
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        rows = run_world(spec, a.precisions, Path(a.root), device, a.out if a.profile else None)
        if dist.get_rank() == 0:
            Path(a.worker_json).write_text(json.dumps(rows))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _launch(world: int, argv: list[str], root: Path, tmp: Path, device: str) -> list[dict]:
    """Run this script as ``world`` torchrun processes on the same arguments; return rank 0's rows."""
    out = tmp / f"rows_{world}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
           "-m", "benchmarks.train_throughput", *argv,
           "--root", str(root), "--worker-json", str(out)]  # fmt: skip
    env = dict(os.environ, PROJECT_ROOT=str(ROOT))
    if device == "cuda" and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(world))
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode != 0 or not out.exists():
        raise SystemExit(f"{world} processes: torchrun exited with {done.returncode} ({' '.join(cmd)})")
    return json.loads(out.read_text())


def _ratios(rows: list[dict]) -> None:
    """``scaling`` against the one-device row and ``vs_timm`` against timm's row, in place. A precision
    given more than once (``--precisions bf16-mixed,bf16-mixed``: the peers in turns) pairs rows by turn:
    the k-th row of a peer, world size and precision with the k-th timm row of that world size and
    precision and with the k-th one-device row of that peer and precision."""
    turns: dict[tuple, int] = {}
    keyed = []
    for r in rows:
        key = (r["world"], r["precision"], r["peer"])
        turn = turns[key] = turns.get(key, -1) + 1
        keyed.append((key, turn))
    index = {(key, turn): r for r, (key, turn) in zip(rows, keyed)}
    for r, ((world, precision, peer), turn) in zip(rows, keyed):
        base = index.get(((1, precision, peer), turn))
        if base is not None:
            r["scaling"] = round(r["img_per_s_compute"] / (world * base["img_per_s_compute"]), 3)
        timm = index.get(((world, precision, "timm"), turn))
        if timm is not None and peer == "elsa":
            r["vs_timm"] = round(r["img_per_s_compute"] / timm["img_per_s_compute"], 3)


def turn_summary(rows: list[dict]) -> list[str]:
    """One line per world size and precision measured in several turns (a precision repeated in
    ``--precisions``): the median, lowest and highest ``vs_timm`` over the turns. A host-bound case moves
    from turn to turn with the host's load, so one turn's ratio says little there."""
    turns: dict[tuple, list[float]] = {}
    for r in rows:
        if r.get("vs_timm") is not None:
            turns.setdefault((r["world"], r["precision"]), []).append(r["vs_timm"])
    return [f"{world} x {precision}: vs timm over {len(v)} turns: median {statistics.median(v):.3f}, "
            f"{min(v):.3f} to {max(v):.3f}" for (world, precision), v in turns.items() if len(v) > 1]


def _parse(argv: list[str]):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cuda", "cpu"),
                   default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="ViT-Ti at 64 px, a few steps (any device)")
    p.add_argument("--devices", default="1",
                   help="comma list of world sizes, run in turn (N > 1: N torchrun processes; default 1)")
    p.add_argument("--precisions", default="32-true",
                   help=f"comma list of Lightning precisions ({', '.join(PRECISIONS)}; default 32-true)")
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp", help="trainer config of N > 1 devices")
    p.add_argument("--model", default=None,
                   help="model config (elsa_vit_t/b/l; default elsa_vit_b, elsa_vit_t with --quick)")
    p.add_argument(
        "--root", default=None, help="existing root/{train,val}/<class>/* tree (default: synthetic)"
    )
    p.add_argument("--batch-size", type=int, default=None, help="images per device and step")
    p.add_argument("--steps", type=int, default=None, help="timed steps per peer")
    p.add_argument("--workers", type=int, default=None, help="data loader workers per device")
    p.add_argument("--override", action="append", default=[], metavar="KEY=VALUE",
                   help="a Hydra override of the recipe for both peers, applied last (repeatable), e.g. "
                   "+trainer.strategy.forward_prefetch=true")
    p.add_argument("--profile", action="store_true",
                   help="also profile steps after the timed ones: GPU time in communication, computation and "
                   "both (train_profile_<device>.json, a Chrome trace per rank)")
    p.add_argument("--worker-json", default=None, help=argparse.SUPPRESS)  # a torchrun rank of _launch
    add_out_dir(p)
    a = p.parse_args(argv)
    try:
        a.devices = sorted({int(n) for n in a.devices.split(",") if n.strip()})
    except ValueError:
        raise SystemExit(f"--devices: expected a comma list of integers, got {a.devices!r}") from None
    if not a.devices or a.devices[0] < 1:
        raise SystemExit(f"--devices: world sizes must be >= 1, got {a.devices}")
    a.precisions = [s.strip() for s in a.precisions.split(",") if s.strip()]
    bad = [s for s in a.precisions if s not in PRECISIONS]
    if bad or not a.precisions:
        raise SystemExit(f"--precisions: expected some of {', '.join(PRECISIONS)}, got {bad or a.precisions}")
    if a.strategy == "fsdp" and a.device == "cpu" and a.devices[-1] > 1:
        raise SystemExit("--strategy fsdp runs on CUDA devices only (Lightning's FSDP); use ddp on the CPU")
    if a.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device (use --device cpu)")
        if a.devices[-1] > torch.cuda.device_count() and a.worker_json is None:
            raise SystemExit(f"--devices {a.devices[-1]}: only {torch.cuda.device_count()} GPU(s) visible")
    return a


def main(argv: list[str] | None = None) -> str | None:
    argv = sys.argv[1:] if argv is None else list(argv)
    a = _parse(argv)
    spec = dict(QUICK if a.quick else FULL, strategy=a.strategy, overrides=a.override)
    for key, val in (("model", a.model), ("batch", a.batch_size), ("steps", a.steps), ("workers", a.workers)):
        if val is not None:
            spec[key] = val
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    os.environ.setdefault("PROJECT_ROOT", str(ROOT))
    if a.worker_json is not None:
        _worker(a, spec)
        # The rank's rows are written and its process group is gone. Past this point a gloo rank's interpreter
        # teardown has aborted now and then ("terminate called without an active exception": SIGABRT after
        # its last Python frame, a C++ thread still joinable at exit; about one world-2 CPU run in eight on a
        # loaded two-core machine), which torchrun reports as the run failing. Nothing is left to do: end the
        # process here, without the C++ teardown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    device = torch.device(a.device)
    with tempfile.TemporaryDirectory() as tmp:
        if a.root is None:
            # enough training images for every rank of the largest world to reach its last step in one epoch
            steps = spec["warmup"] + spec["steps"] + a.profile * PROFILED_STEPS
            need = a.devices[-1] * spec["batch"] * steps
            per_class = -(-need // spec["classes"])
            size = (96, 72) if a.quick else (500, 375)
            root = make_imagefolder(Path(tmp) / "imagefolder", spec["classes"], per_class, size=size)
        else:
            root = Path(a.root)
            if not (root / "train").is_dir():
                raise SystemExit(f"--root {root}: expected a train/ folder of class folders")
        rows: list[dict] = []
        meta = run_info(device, __file__, argv)
        suffix = f"{device_tag(device)}{'_quick' if a.quick else ''}"
        path = a.out / f"train_throughput_{suffix}.csv"
        profiles: list[dict] = []
        # each world size's rows are written once it is done: a run cut off keeps the world sizes it measured
        with Results(path, COLUMNS, meta) as out:
            for world in a.devices:
                new = (run_world(spec, a.precisions, root, device, a.out if a.profile else None) if world == 1
                       else _launch(world, argv, root, Path(tmp), a.device))
                rows += new
                _ratios(rows)  # one device's rows come first (--devices is sorted)
                out.write_all(new)
                for r in new:
                    print(
                        f"{r['world']} x {r['precision']:10s} {r['peer']:5s} {r['backbone']:28s} "
                        f"{r['img_per_s_compute']:9.2f} img/s ({r['img_per_s_per_device']:.2f} per device, "
                        f"{r['step_ms']} ms/step), {r['img_per_s_end_to_end']:9.2f} end to end, "
                        f"peak {r['peak_mb_per_rank']} MB/rank (above {r.get('earlier_mb')} MB left by "
                        f"earlier runs on rank 0), scaling {r.get('scaling')}, "
                        f"vs timm {r.get('vs_timm')}", flush=True)
                    for rank, summary in enumerate(r.get("profile") or []):
                        profiles.append({"world": r["world"], "precision": r["precision"], "peer": r["peer"],
                                         "rank": rank, "step_ms": r["step_ms"], **summary})
                        print(f"  rank {rank}: per profiled step of {summary['wall_ms']} ms: GPU idle "
                              f"{summary['idle_ms']}, busy {summary['busy_ms']}: compute "
                              f"{summary['compute_ms']}, communication {summary['comm_ms']} (hidden "
                              f"{summary['overlap_ms']}, exposed {summary['exposed_comm_ms']}), "
                              f"{summary['kernels_per_step']} kernels", flush=True)
                        if "waits_ms" in summary:
                            print("    GPU idle between kernels, waiting for the host's " + ", ".join(
                                f"{k} {v}" for k, v in summary["waits_ms"].items()) + " ms", flush=True)
                if profiles:
                    (a.out / f"train_profile_{suffix}.json").write_text(json.dumps(profiles, indent=1))
    for line in turn_summary(rows):
        print(line)
    print(f"wrote {path}")
    return str(path)


if __name__ == "__main__":
    main()
