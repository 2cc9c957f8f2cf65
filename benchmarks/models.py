"""Full models: timm's ViT and Swin-v2 as shipped vs the same weights in ElsaViT / ElsaSwinV2, in one run.

For every case the timm model is built once (random init) and measured as a forward (eval, no grad) or, for
``train`` cases, a training step (train mode, forward + backward of a mean-square loss + an AdamW step):

* ``timm_sdpa``  -- timm as shipped (ViT: ``fused_attn``, ``F.scaled_dot_product_attention``; Swin-v2: its
  ``WindowAttention``, which always forms the softmax explicitly),
* ``timm_math``  -- ViT only: the same module with ``fused_attn = False`` (timm's explicit softmax path),
* ``timm_noattn`` -- the model with free attention (``benchmarks/ceiling.py``: every attention call returns
  ``v``, no attention work at all; ViT: timm's fused path, Swin-v2: ``ElsaSwinV2``, i.e. timm's Swin-v2 with
  the window attention as one op). Not a model anyone would run: its speed over ``timm_sdpa`` is the
  ceiling that any attention kernel can give the model (printed as ``ceiling``); its ``max_dev`` is
  meaningless.
* ``elsa``       -- ``ElsaViT.from_timm(model)`` / ``ElsaSwinV2.from_timm(model)``: identical weights, ELSA
  attention (Swin-v2 on CUDA: the fused W-ELSA window op).

Reported per peer: images/s and median ms per batch, peak allocated memory of one forward (CUDA), the max
absolute deviation of the logits from ``timm_sdpa``, and (CUDA) ``gpu_ms``: the summed duration of the GPU
kernels of one call (``torch.profiler``, mean of three), i.e. the GPU work alone. Where the host enqueues
kernels slower than the GPU runs them (small batches, Swin's many small ops), the wall time measures the
host's Python and launch speed, and ``gpu ratio`` (timm's ``gpu_ms`` over ELSA's) says what the kernels
changed; ``graph_ms`` is the median of CUDA-graph replays (GPU time without the host's launch work). Wall
times are the median of synchronised calls, the peers timed in turns (``wall_ms_in_turns``: five rounds of
every peer, all on the device), so that every peer meets the same drift of the host's speed. Rows go to
``logs/benchmarks/models_<gpu>.csv`` (or ``--out``); ratios vs timm (and the targets of the cases) are
printed.
CUDA float32 matmuls run in IEEE FP32 (TF32 off) so that every peer computes the same thing.

``--fp32`` runs the FP32 table instead: what a user who needs float32 can choose, for whole models (the
attention and every linear layer). The peers, all from one set of random weights:

* ``timm_fp32``  -- timm as shipped, float32, TF32 off (PyTorch's FP32 GEMMs on the SIMT cores),
* ``timm_tf32``  -- the same with TF32 on (matmuls and convolutions: one TF32 pass, ~1e-3),
* ``timm_bf16``  -- the same under ``torch.autocast(dtype=torch.bfloat16)``,
* ``elsa``       -- ``ElsaViT`` / ``ElsaSwinV2.from_timm`` at ``--precision`` (default ``auto``: attention and
  linear layers FP32-accurate on tensor cores),

each with eager ms, CUDA-graph ms and ``relerr``: the logits' ``||out - ref|| / ||ref||`` against a float64
copy of the model on the same input. Goals: elsa's speed over ``timm_fp32`` and an error at most
``timm_fp32``'s. Rows go to ``logs/benchmarks/models_fp32_<gpu>.csv``.

    python -m benchmarks.models                         # the declared GPU cases
    python -m benchmarks.models --fp32                  # the FP32 table
    python -m benchmarks.models --device cpu --quick    # tiny smoke run (add --fp32 for the FP32 table's)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import re
import sys
from dataclasses import dataclass, field

import torch

from benchmarks.ceiling import free_attention
from benchmarks.common import (
    Results,
    add_out_dir,
    columns,
    device_tag,
    graph_ms,
    kernel_ms,
    peak_mb,
    run_info,
    wall_ms_in_turns,
)

COLUMNS = columns("model", "img", "batch", "dtype", "peer", "img_per_s", "ms", "peak_mb", "max_dev", "mode",
                  "gpu_ms", "graph_ms")
PEERS = ("timm_sdpa", "timm_math", "timm_noattn", "elsa")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Case:
    model: str
    img: int
    batch: int
    dtype: str
    goal: float = 1.0  # elsa img/s over timm_sdpa img/s to reach
    mem_goal: bool = False  # elsa peak memory must not exceed timm_sdpa's
    train: bool = False  # time a training step (forward + backward) instead of an inference forward
    kwargs: dict = field(default_factory=dict, hash=False)


# The targets of the model-level and eager-speed issues (H100, forward, eval).
CASES = [
    Case("vit_base_patch16_224", 224, 8, "fp32", goal=1.0),
    Case("vit_base_patch16_224", 224, 8, "bf16", goal=1.0),
    Case("vit_base_patch16_224", 448, 8, "fp32", goal=1.25),
    Case("vit_base_patch16_224", 896, 2, "fp32", goal=1.35, mem_goal=True),
    Case("vit_small_patch16_224", 1024, 2, "fp32", goal=1.35, mem_goal=True),
    Case("vit_base_patch16_224", 448, 8, "bf16", goal=1.0),
    Case("vit_base_patch16_224", 896, 2, "bf16", goal=1.0),
    # Training steps (forward + backward + optimizer): the backward issue's target at 448 px, and the
    # ImageNet recipe's shape (224 px, batch 64; the training issue's throughput goal).
    Case("vit_base_patch16_224", 448, 8, "fp32", goal=1.2, train=True),
    Case("vit_base_patch16_224", 224, 64, "fp32", goal=1.1, train=True),
    # W-ELSA (Swin-v2 window attention), goals vs timm as shipped.
    Case("swinv2_tiny_window8_256", 256, 8, "fp32", goal=1.1),
    Case("swinv2_small_window16_256", 256, 8, "fp32", goal=1.1),
    Case("swinv2_tiny_window8_256", 256, 8, "bf16", goal=1.05),
    Case("swinv2_tiny_window8_256", 256, 8, "fp32", goal=1.0, train=True),
    # timm Swin v1 with its window attentions patched in place (patch_attention).
    Case("swin_tiny_patch4_window7_224", 224, 8, "fp32", goal=1.05),
    Case("swin_tiny_patch4_window7_224", 224, 8, "bf16", goal=1.05),
]

# Smoke run: tiny models and images, every code path (fp32 + bf16, several sequence lengths).
QUICK_CASES = [
    Case("vit_tiny_patch16_224", 64, 2, "fp32", kwargs=dict(depth=2)),
    Case("vit_small_patch16_224", 96, 2, "fp32", kwargs=dict(depth=2)),
    Case("vit_tiny_patch16_224", 64, 2, "bf16", kwargs=dict(depth=2)),
    Case("swinv2_tiny_window8_256", 64, 2, "fp32", kwargs=dict(depths=(1, 2, 1, 1), embed_dim=24)),
    Case("swinv2_tiny_window8_256", 64, 2, "fp32", train=True,
         kwargs=dict(depths=(1, 2, 1, 1), embed_dim=24, drop_path_rate=0.0)),
    Case("swin_tiny_patch4_window7_224", 56, 2, "fp32", kwargs=dict(depths=(1, 1, 1, 1), embed_dim=24)),
]


# The FP32 table (``--fp32``): goals of elsa over timm_fp32 (H100).
FP32_CASES = [
    Case("vit_base_patch16_224", 224, 64, "fp32", goal=2.2),
    Case("vit_base_patch16_224", 448, 8, "fp32", goal=2.2),
    Case("vit_base_patch16_224", 896, 2, "fp32", goal=2.2),
    Case("vit_large_patch16_224", 224, 32, "fp32", goal=2.2),
    Case("vit_small_patch16_224", 1024, 2, "fp32", goal=2.2),
    Case("swinv2_tiny_window8_256", 256, 32, "fp32", goal=2.0),
    Case("vit_base_patch16_224", 224, 64, "fp32", goal=1.8, train=True),
]
QUICK_FP32_CASES = [
    Case("vit_tiny_patch16_224", 64, 2, "fp32", kwargs=dict(depth=2)),
    Case("swinv2_tiny_window8_256", 64, 2, "fp32", kwargs=dict(depths=(1, 2, 1, 1), embed_dim=24)),
    Case("vit_tiny_patch16_224", 64, 2, "fp32", train=True, kwargs=dict(depth=2)),
]
FP32_PEERS = ("timm_fp32", "timm_tf32", "timm_bf16", "elsa")
FP32_COLUMNS = columns("model", "img", "batch", "mode", "peer", "img_per_s", "ms", "graph_ms", "relerr")


def _mode(case: Case) -> str:
    return "train" if case.train else "fwd"


def _select(cases: list[Case], pattern: str) -> list[Case]:
    """The cases whose ``model/img/batch/dtype/mode`` matches the regex ``pattern`` (all for "")."""
    return [c for c in cases if re.search(pattern, f"{c.model}/{c.img}/{c.batch}/{c.dtype}/{_mode(c)}")]


class NoAttention(torch.nn.Module):
    """``model`` with every attention answered by ``v`` while it runs (``timm_noattn``)."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, x):
        with free_attention():
            return self.model(x)


def build_peers(case: Case, precision: str) -> dict[str, torch.nn.Module]:
    """The peers on the CPU, sharing one set of random weights (Swin-v2 has no fused timm path: two peers)."""
    import timm
    from timm.models.swin_transformer import SwinTransformer
    from timm.models.swin_transformer_v2 import SwinTransformerV2

    from elsa_vision import ElsaViT, patch_attention
    from elsa_vision.models import ElsaSwinV2

    torch.manual_seed(0)
    timm_model = timm.create_model(case.model, img_size=case.img, **case.kwargs).eval()
    if isinstance(timm_model, SwinTransformer):  # v1: timm's own model, window attentions patched
        elsa_model = copy.deepcopy(timm_model)
        patch_attention(elsa_model, precision=precision)
        no_attn = NoAttention(copy.deepcopy(timm_model))
        return {"timm_sdpa": timm_model, "timm_noattn": no_attn, "elsa": elsa_model}
    if isinstance(timm_model, SwinTransformerV2):
        # timm zero-initialises the res-post-norm weights, which would hide the attention from max_dev.
        for name, p in timm_model.named_parameters():
            if name.endswith(("norm1.weight", "norm2.weight")):
                torch.nn.init.ones_(p)
        elsa_model = ElsaSwinV2.from_timm(timm_model, attn_precision=precision)
        no_attn = NoAttention(copy.deepcopy(elsa_model))
        return {"timm_sdpa": timm_model, "timm_noattn": no_attn, "elsa": elsa_model}
    math_model = copy.deepcopy(timm_model)
    for blk in math_model.blocks:
        blk.attn.fused_attn = False
    elsa_model = ElsaViT.from_timm(timm_model, attn_precision=precision)
    no_attn = NoAttention(copy.deepcopy(timm_model))
    return {"timm_sdpa": timm_model, "timm_math": math_model, "timm_noattn": no_attn, "elsa": elsa_model}


def _step(case: Case, model, x):
    """One timed call: an inference forward, or (``train``) forward + backward + AdamW step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6) if case.train else None

    def fwd():
        if case.train:
            out = model(x)
            out.float().square().mean().backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return out.detach()
        with torch.inference_mode():
            return model(x)

    return fwd


def _eager_ms(names: list[str], peers: dict, case: Case, x: torch.Tensor, device: torch.device, warmup: int,
              reps: int, together: bool) -> dict[str, float]:
    """Eager wall ms of each peer: all on the device, in turns (``together``), or one on the device at a
    time (a case whose peers fit only alone)."""
    groups = [names] if together else [[name] for name in names]
    eager: dict[str, float] = {}
    for group in groups:
        models = {}
        try:
            for name in group:
                models[name] = peers[name].to(device=device, dtype=DTYPES[case.dtype]).train(case.train)
            torch.manual_seed(0)
            eager.update(wall_ms_in_turns({n: _step(case, m, x) for n, m in models.items()}, device,
                                          warmup=warmup, reps=reps))
        finally:
            for name, m in models.items():
                peers[name] = m.to("cpu")
            del models
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return eager


def run_case(case: Case, device: torch.device, warmup: int, reps: int, precision: str) -> list[dict]:
    peers = build_peers(case, precision)
    x = torch.randn(case.batch, 3, case.img, case.img, device=device, dtype=DTYPES[case.dtype])
    rows, ref = [], None
    names = [p for p in PEERS if p in peers]
    out_of_memory = set()
    for name in names:
        # One model on the device at a time: peak memory is that of the peer alone (weights + activations).
        model = peers[name].to(device=device, dtype=DTYPES[case.dtype]).train(case.train)
        fwd = _step(case, model, x)
        try:
            torch.manual_seed(0)  # the same drop-path draws for every peer's compared (first) output
            out = fwd()
            peak = peak_mb(fwd, device)[0]
            gpu_ms = kernel_ms(fwd, device)
        except torch.cuda.OutOfMemoryError:
            print(f"  {name}: out of memory", flush=True)
            out_of_memory.add(name)
            rows.append(dict(peer=name, img_per_s=math.nan, ms=math.nan, peak_mb=math.nan, max_dev=math.nan,
                             gpu_ms=math.nan, graph_ms=math.nan))
            continue
        finally:
            peers[name] = model.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()
        if name == "timm_sdpa":
            # Kept on the CPU: a reference left on the device would count in the next peers' peak memory
            # (B x classes float32: 8 KiB at batch 2, 32 KiB at batch 8).
            ref = out.float().cpu()
        max_dev = (out.float().cpu() - ref).abs().max().item() if ref is not None else math.nan
        rows.append(dict(peer=name, img_per_s=math.nan, ms=math.nan, peak_mb=peak, max_dev=max_dev,
                         gpu_ms=gpu_ms, graph_ms=math.nan))
    # Eager wall time with every peer on the device, in turns: a host-bound eager forward moves with the
    # machine's host speed, which drifts over the seconds one peer after another would take.
    timed = [row for row in rows if row["peer"] not in out_of_memory]
    names = [row["peer"] for row in timed]
    try:
        eager = _eager_ms(names, peers, case, x, device, warmup, reps, together=True)
    except torch.cuda.OutOfMemoryError:  # each peer fits alone, not all at once: one after another
        print("  peers do not fit on the device together: eager times taken one peer after another",
              flush=True)
        eager = _eager_ms(names, peers, case, x, device, warmup, reps, together=False)
    for row in timed:
        row["ms"] = eager[row["peer"]]
        row["img_per_s"] = case.batch / (row["ms"] / 1e3)
        print(f"  {row['peer']:10s} {row['img_per_s']:10.1f} img/s  {row['ms']:9.3f} ms  peak "
              f"{row['peak_mb']:9.1f} MB  max_dev {row['max_dev']:.3e}  gpu {row['gpu_ms']:8.3f} ms",
              flush=True)
    # CUDA-graph replays after every peak was taken: a captured graph's private memory pool would otherwise
    # count in the next peer's peak.
    if device.type == "cuda" and not case.train:
        for row in rows:
            if math.isnan(row["ms"]):
                continue
            model = peers[row["peer"]].to(device=device, dtype=DTYPES[case.dtype]).eval()
            try:
                row["graph_ms"] = graph_ms(_step(case, model, x), rep=200)
            finally:
                peers[row["peer"]] = model.to("cpu")
                torch.cuda.empty_cache()
            print(f"  {row['peer']:10s} graph {row['graph_ms']:8.3f} ms", flush=True)
    return rows


@contextlib.contextmanager
def _tf32(on: bool):
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = on
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def _fp32_peer_step(case: Case, peer: str, model, x):
    """One timed call of an FP32-table peer: TF32 switched on or off around it, autocast for bf16."""
    step = _step(case, model, x)
    device_type = x.device.type

    def call():
        with _tf32(peer == "timm_tf32"):
            if peer == "timm_bf16":
                with torch.autocast(device_type, dtype=torch.bfloat16):
                    return step()
            return step()

    return call


def run_fp32_case(case: Case, device: torch.device, warmup: int, reps: int, precision: str) -> list[dict]:
    """The FP32 table's row of one case: every peer's eager and graph time and its error against float64."""
    peers = build_peers(case, precision)
    timm_model, elsa = peers["timm_sdpa"], peers["elsa"]
    # one copy per timm peer: a training step changes the weights the next peer's error is measured with
    models = {"timm_fp32": timm_model, "timm_tf32": copy.deepcopy(timm_model),
              "timm_bf16": copy.deepcopy(timm_model), "elsa": elsa}
    x = torch.randn(case.batch, 3, case.img, case.img, device=device)
    with torch.no_grad():
        ref = copy.deepcopy(timm_model).to(device=device, dtype=torch.float64).eval()(x.double()).cpu()
    rows = []
    for peer in FP32_PEERS:
        model = models[peer].to(device).train(case.train)
        with torch.no_grad(), _tf32(peer == "timm_tf32"):
            model.eval()
            if peer == "timm_bf16":
                with torch.autocast(device.type, dtype=torch.bfloat16):
                    out = model(x)
            else:
                out = model(x)
            model.train(case.train)
        err = (out.double().cpu() - ref).norm().item() / ref.norm().item()
        call = _fp32_peer_step(case, peer, model, x)
        ms = wall_ms_in_turns({peer: call}, device, warmup=warmup, reps=reps)[peer]
        gms = math.nan
        if device.type == "cuda" and not case.train:
            gms = graph_ms(call, rep=200)
        models[peer] = model.to("cpu")
        if device.type == "cuda":
            torch.cuda.empty_cache()
        rows.append(dict(peer=peer, img_per_s=case.batch / (ms / 1e3), ms=ms, graph_ms=gms, relerr=err))
        print(f"  {peer:10s} {case.batch / (ms / 1e3):10.1f} img/s  {ms:9.3f} ms  graph {gms:8.3f} ms  "
              f"relerr {err:.2e}", flush=True)
    return rows


def _run_cases(args, device, argv, cases, name: str, columns, run, defaults: tuple[int, int], fp32: bool):
    """Run ``run(case, device, warmup, reps, precision)`` for every case (``defaults``: warmup and reps
    unless given), writing its rows to ``<out>/<name>_<gpu>.csv``. Returns ``(meta, path, [(case, rows by
    peer)])``."""
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else defaults[0])
    reps = args.reps if args.reps is not None else (3 if args.quick else defaults[1])
    meta = run_info(device, __file__, argv)
    results = []
    with Results(args.out / f"{name}_{device_tag(device)}.csv", columns, meta) as out:
        for case in cases:
            dtype = "fp32" if fp32 else case.dtype
            print(f"{case.model} img {case.img} batch {case.batch} {dtype} {_mode(case)}", flush=True)
            rows = run(case, device, warmup, reps, args.precision)
            fields = dict(model=case.model, img=case.img, batch=case.batch, mode=_mode(case))
            if not fp32:
                fields["dtype"] = case.dtype
            for r in rows:
                out.write({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()}, **fields)
            results.append((case, {r["peer"]: r for r in rows}))
    return meta, out.path, results


def main_fp32(args, device, argv) -> str:
    cases = _select(QUICK_FP32_CASES if args.quick else FP32_CASES, args.cases)
    meta, path, results = _run_cases(args, device, argv, cases, "models_fp32", FP32_COLUMNS, run_fp32_case,
                                     (5, 20), fp32=True)
    print(f"\nFP32 table (speed over timm_fp32; relerr vs float64), {meta['device']}, torch {meta['torch']}, "
          f"triton {meta['triton']}")
    print(f"{'case':44s} {'tf32':>6s} {'bf16':>6s} {'elsa':>6s} {'graph':>6s} {'goal':>5s} {'err fp32':>9s} "
          f"{'err tf32':>9s} {'err bf16':>9s} {'err elsa':>9s}  status")
    for case, r in results:
        f = r["timm_fp32"]
        speed = {p: f["ms"] / r[p]["ms"] for p in FP32_PEERS}
        graph = f["graph_ms"] / r["elsa"]["graph_ms"]
        misses = [what for what, bad in (("speed", not speed["elsa"] >= case.goal),
                                         ("error", not r["elsa"]["relerr"] <= f["relerr"])) if bad]
        name = f"{case.model} {case.img}px b{case.batch}{' train' if case.train else ''}"
        print(f"{name:44s} {speed['timm_tf32']:6.2f} {speed['timm_bf16']:6.2f} {speed['elsa']:6.2f} "
              f"{graph:6.2f} {case.goal:5.2f} {f['relerr']:9.2e} {r['timm_tf32']['relerr']:9.2e} "
              f"{r['timm_bf16']['relerr']:9.2e} {r['elsa']['relerr']:9.2e}  "
              f"{'below goal (' + ', '.join(misses) + ')' if misses else 'meets goal'}")
    print(f"\nwrote {path}")
    return str(path)


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny smoke cases (CPU-friendly)")
    p.add_argument("--cases", default="",
                   help="regex on 'model/img/batch/dtype/mode' (mode: fwd | train) selecting cases")
    p.add_argument("--precision", default="auto", help="ElsaViT attn_precision for float32")
    p.add_argument("--fp32", action="store_true",
                   help="the FP32 table: timm FP32 / TF32 / bf16 autocast vs elsa, with errors vs float64")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    add_out_dir(p)
    args = p.parse_args(argv)

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda given but CUDA is not available")
    if device.type == "cuda":
        # Every peer in IEEE FP32: TF32 would change the numbers of timm and ELSA differently.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    if args.fp32:
        return main_fp32(args, device, argv)
    cases = _select(QUICK_CASES if args.quick else CASES, args.cases)
    meta, path, results = _run_cases(args, device, argv, cases, "models", COLUMNS, run_case, (10, 30),
                                     fp32=False)

    print(f"\nratios (elsa vs timm), {meta['device']}, torch {meta['torch']}, triton {meta['triton']}")
    print(f"{'case':46s} {'vs timm':>8s} {'goal':>6s} {'vs math':>8s} {'mem/timm':>9s} {'ceiling':>8s}"
          f" {'gpu ratio':>9s} {'graph':>7s} {'eager/graph':>11s}  status")
    nan_row = dict(img_per_s=math.nan)
    for case, r in results:
        e, s, m = r["elsa"], r["timm_sdpa"], r.get("timm_math", nan_row)
        ceiling = r.get("timm_noattn", nan_row)["img_per_s"] / s["img_per_s"]
        speed = e["img_per_s"] / s["img_per_s"]
        mem = e["peak_mb"] / s["peak_mb"] if s["peak_mb"] == s["peak_mb"] else math.nan
        misses = [what for what, bad in (("speed", not speed >= case.goal),
                                         ("memory", case.mem_goal and mem > 1.0)) if bad]
        name = f"{case.model} {case.img}px b{case.batch} {case.dtype}{' train' if case.train else ''}"
        graph = s["graph_ms"] / e["graph_ms"]
        print(f"{name:46s} {speed:8.3f} {case.goal:6.2f} {e['img_per_s'] / m['img_per_s']:8.3f} {mem:9.4f} "
              f"{ceiling:8.3f} {s['gpu_ms'] / e['gpu_ms']:9.3f} {graph:7.3f} {speed / graph:11.3f}  "
              f"{'below goal (' + ', '.join(misses) + ')' if misses else 'meets goal'}")
    print(f"\nwrote {path}")
    return str(path)


if __name__ == "__main__":
    main()
