"""Context-parallel ELSA: one sequence over several GPUs vs one GPU, FP32 (FP32-accurate) and bf16.

Launched with torchrun, one process per device; every case is measured twice in the same job: on rank 0 alone
(the one-device baseline, the other ranks wait at a barrier) and split over all ranks
(:func:`elsa_vision.distributed.context_parallel_attention`, ring of K/V shards). Reported per case: median
seconds (forward, and forward + backward for attention), the speed-up (one device / all ranks), the peak
allocated memory of every rank and of the baseline, the relative error of the context-parallel output
against the one-device output (gathered on rank 0), and of both against float64 on ``REF_ROWS`` query rows
(``reference_rows``; at lengths one device does not run, the context-parallel output's only). Attention
cases above ``--one-device-max-tokens`` (the
``long`` sweep's 512K and 1M tokens) are not run on one device: its time is extrapolated from the largest
measured case of the same kind (work as ``H * N^2``, memory as ``H * N``; column ``one_device``).

    torchrun --nproc-per-node 2 -m benchmarks.context_parallel                    # GPUs: attention and vit
    torchrun --nproc-per-node 2 -m benchmarks.context_parallel --cases attention  # one sweep per call
    torchrun --nproc-per-node 4 -m benchmarks.context_parallel --cases long       # 256K, 512K, 1M tokens
    torchrun --nproc-per-node 2 -m benchmarks.context_parallel --device cpu --quick  # gloo smoke run

Goals: 256K-token FP32 attention (B=1, H=16, D=64) forward+backward on 2 GPUs >= 1.9x one GPU with a per-GPU
peak <= 0.55 of one GPU's; 1M tokens on 4 GPUs >= 3.5x one GPU's (extrapolated) time with a per-GPU peak
<= 0.3 of its memory; ViT-B/16 forward on an 8192 x 8192 image (262,145 tokens) split over 2 GPUs.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys

import torch
import torch.distributed as dist

from benchmarks.common import (
    LOGS,
    Results,
    columns,
    device_tag,
    peak_since_reset_mb,
    reset_peak,
    run_info,
    wall_ms,
)
from elsa_vision import elsa_attention
from elsa_vision.distributed import (
    context_parallel_attention,
    gather_sequence,
    shard_sequence,
)


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    B: int
    H: int
    N: int
    D: int
    causal: bool = False
    layout: str = "contiguous"
    backward: bool = True
    dtype: str = "float32"

    @property
    def name(self) -> str:
        causal = " causal" if self.causal else ""
        dtype = "" if self.dtype == "float32" else f" {self.dtype}"
        return f"attention B{self.B} H{self.H} N{self.N} D{self.D}{causal} {self.layout}{dtype}"

    def scale_to(self, other: AttentionCase) -> tuple[float, float]:
        """The factors from this case's one-device time and memory to ``other``'s: work grows as
        ``B * H * N^2`` (``N^2 / 2`` causal, for both), memory as ``B * H * N``."""
        heads = (other.B * other.H) / (self.B * self.H)
        return heads * (other.N / self.N) ** 2, heads * other.N / self.N


@dataclasses.dataclass(frozen=True)
class ViTCase:
    model: str
    img_size: int
    in_chans: int = 3

    @property
    def name(self) -> str:
        return f"{self.model} {self.img_size}x{self.img_size} forward"


# The declared sweeps. `long` starts with the one-device reference of its larger cases, which one device
# is not run on (see --one-device-max-tokens): their one-device time and memory are extrapolated from it.
FULL = {
    "attention": [
        AttentionCase(1, 16, 65536, 64),
        AttentionCase(1, 16, 65536, 64, causal=True, layout="zigzag"),
        AttentionCase(1, 16, 262144, 64),
        AttentionCase(1, 16, 262144, 64, dtype="bfloat16"),
    ],
    "long": [
        *(AttentionCase(1, 8, n, 64, dtype=dtype)
          for dtype in ("float32", "bfloat16") for n in (262144, 524288, 1048576)),  # fmt: skip
    ],
    "vit": [ViTCase("elsa_vit_base_patch16_224", 4096), ViTCase("elsa_vit_base_patch16_224", 8192)],
}
QUICK = {
    "attention": [AttentionCase(1, 2, 1031, 16), AttentionCase(1, 2, 1031, 16, causal=True, layout="zigzag")],
    "long": [AttentionCase(1, 2, n, 16, dtype=d) for d in ("float32", "bfloat16") for n in (1031, 2062)],
    "vit": [ViTCase("elsa_vit_tiny_patch16_224", 112)],
}
ONE_DEVICE_MAX_TOKENS = {"full": 262144, "quick": 1031}
REF_ROWS = 256  # query rows of each attention case checked against float64 (reference_rows)
GOAL = {"attention_tokens": 262144, "peak_fraction": 0.5, "speed_up": 1.7, "vit_img_size": 8192}
COLUMNS = columns("case", "world", "precision", "dtype", "tokens", "one_device", "fwd_s_1dev", "fwd_s_cp",
                  "fwd_speed_up", "fwdbwd_s_1dev", "fwdbwd_s_cp", "fwdbwd_speed_up", "peak_mb_1dev",
                  "peak_mb_cp_per_rank", "peak_fraction", "relerr_vs_1dev", "relerr_1dev_vs_f64",
                  "relerr_cp_vs_f64", "host")


def _peak_mb(device: torch.device) -> float | None:
    return peak_since_reset_mb(device) if device.type == "cuda" else None


def _world_barrier() -> None:
    """Every context-parallel timed run starts and ends at a barrier of all ranks (``wall_ms``'s
    ``barrier``)."""
    dist.barrier(group=dist.group.WORLD)


def _all_peaks(value: float | None, device: torch.device) -> list[float | None]:
    world = dist.get_world_size()
    t = torch.tensor([-1.0 if value is None else value], dtype=torch.float64, device=device)
    bufs = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(bufs, t)
    return [None if float(b) < 0 else round(float(b), 1) for b in bufs]


def whole_input(case: AttentionCase, i: int) -> torch.Tensor:
    """Input ``i`` of the case (0-3: q, k, v, dO), whole, on the host, in the case's dtype: the same tensor
    for the one-device run, every rank's shard and the float64 reference."""
    shape = (case.B, case.H, case.N, case.D)
    return torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(getattr(torch, case.dtype))


def run_attention(case: AttentionCase, device: torch.device, precision: str, repeats: int,
                  one_device: bool = True) -> dict:
    """One case on all ranks, and first (``one_device``) on rank 0 alone."""
    rank = dist.get_rank()

    row: dict = {"case": case.name, "tokens": case.N, "dtype": case.dtype,
                 "one_device": "measured" if one_device else None}  # fmt: skip
    # One device: rank 0 alone.
    out_1 = None
    if rank == 0 and one_device:
        q, k, v, do = (whole_input(case, i).to(device) for i in range(4))
        reset_peak(device)

        def fwd1():
            return elsa_attention(q, k, v, causal=case.causal, precision=precision)

        row["fwd_s_1dev"] = wall_ms(fwd1, device, reps=repeats) / 1e3
        if case.backward:
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]

            def fb1():
                elsa_attention(*leaves, causal=case.causal, precision=precision).backward(do)

            row["fwdbwd_s_1dev"] = wall_ms(fb1, device, reps=repeats) / 1e3
            del leaves
        out_1 = fwd1().cpu()  # on the host: rank 0's context-parallel peak must not carry it
        row["peak_mb_1dev"] = _peak_mb(device)
        del q, k, v, do
    dist.barrier()
    # All ranks: this rank's shards only (generated whole on the host, sharded, then moved).
    q, k, v, do = (shard_sequence(whole_input(case, i), None, layout=case.layout).to(device)
                   for i in range(4))
    reset_peak(device)

    def fwd():
        return context_parallel_attention(
            q, k, v, seq_len=case.N, causal=case.causal, precision=precision, layout=case.layout
        )

    row["fwd_s_cp"] = wall_ms(fwd, device, reps=repeats, barrier=_world_barrier) / 1e3
    if case.backward:
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]

        def fb():
            context_parallel_attention(
                *leaves, seq_len=case.N, causal=case.causal, precision=precision, layout=case.layout
            ).backward(do)

        row["fwdbwd_s_cp"] = wall_ms(fb, device, reps=repeats, barrier=_world_barrier) / 1e3
        del leaves
    out = fwd()
    row["peak_mb_cp_per_rank"] = _all_peaks(_peak_mb(device), device)
    gathered = gather_sequence(out, case.N, None, layout=case.layout)
    del out
    if rank == 0:
        gathered = gathered.cpu().double()
        if out_1 is not None:
            ref = out_1.double()
            row["relerr_vs_1dev"] = float((gathered - ref).norm() / ref.norm())
        rows, ref_rows = reference_rows(case, device)
        row["relerr_cp_vs_f64"] = _relerr(gathered[..., rows, :], ref_rows)
        if out_1 is not None:
            row["relerr_1dev_vs_f64"] = _relerr(out_1.double()[..., rows, :], ref_rows)
    return row


def _relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def reference_rows(case: AttentionCase, device: torch.device, count: int = REF_ROWS) -> tuple:
    """``(rows, out)``: ``count`` query rows of the case (a quarter of them at each end of the sequence, the
    rest spread over it) and their attention over every key in float64, from the same inputs
    as ``run_attention`` (``whole_input``), one head at a time on ``device``."""
    q, k, v = (whole_input(case, i) for i in range(3))
    end = min(count // 4, case.N)
    spread = torch.randint(0, case.N, (count - 2 * end,), generator=torch.Generator().manual_seed(4))
    rows = torch.cat([torch.arange(end), spread,
                      torch.arange(case.N - end, case.N)]).unique()
    out = torch.empty(case.B, case.H, len(rows), case.D, dtype=torch.float64)
    for b in range(case.B):
        for h in range(case.H):
            qh = q[b, h, rows].to(device, torch.float64)
            s = (qh @ k[b, h].to(device, torch.float64).T) * case.D ** -0.5
            if case.causal:
                later = torch.arange(case.N, device=device)[None, :] > rows.to(device)[:, None]
                s.masked_fill_(later, -torch.inf)
            out[b, h] = (torch.softmax(s, -1) @ v[b, h].to(device, torch.float64)).cpu()
            del s
    return rows, out


def extrapolate(row: dict, case: AttentionCase, measured: dict[AttentionCase, dict]) -> None:
    """Fill the one-device columns of ``row`` (a case one device did not run) from the largest measured case
    of the same kind (batch, head dim, causality, dtype), scaled by :meth:`AttentionCase.scale_to`."""
    same = [c for c in measured if (c.B, c.D, c.causal, c.dtype) == (case.B, case.D, case.causal, case.dtype)]
    if not same:
        row["one_device"] = "not run"
        return
    ref = max(same, key=lambda c: (c.N, c.H))
    work, memory = ref.scale_to(case)
    base = measured[ref]
    for what in ("fwd", "fwdbwd"):
        if base.get(f"{what}_s_1dev") is not None:
            row[f"{what}_s_1dev"] = base[f"{what}_s_1dev"] * work
    if base.get("peak_mb_1dev") is not None:
        row["peak_mb_1dev"] = base["peak_mb_1dev"] * memory
    row["one_device"] = f"extrapolated from N{ref.N} H{ref.H}"


def run_vit(case: ViTCase, device: torch.device, precision: str, repeats: int) -> dict:
    from elsa_vision.inference.highres import Plan, build_model, run_context_parallel, run_plan

    rank = dist.get_rank()
    torch.manual_seed(0)
    model = (
        build_model(
            case.model,
            None,
            (case.img_size, case.img_size),
            in_chans=case.in_chans,
            num_classes=1000,
            attn_precision=precision,
        )
        .to(device)
        .eval()
    )
    for t in model.state_dict().values():  # identical weights on every rank
        dist.broadcast(t, 0)
    gen = torch.Generator().manual_seed(1)
    img = torch.randn(case.in_chans, case.img_size, case.img_size, generator=gen).to(device)
    p = model.patch_embed.patch_size[0]
    row: dict = {"case": case.name, "tokens": (case.img_size // p) ** 2 + model.num_prefix_tokens,
                 "dtype": "float32", "one_device": "measured"}  # fmt: skip
    feats_1 = None
    if rank == 0:
        reset_peak(device)
        plan = Plan("whole", 0.0, None)
        res = None

        def one():
            nonlocal res
            res = run_plan(model, img, plan)

        row["fwd_s_1dev"] = wall_ms(one, device, reps=repeats) / 1e3
        row["peak_mb_1dev"] = _peak_mb(device)
        feats_1 = res.features.cpu()  # on the host, as for attention
        del res
    dist.barrier()
    reset_peak(device)
    res_cp = None

    def cp():
        nonlocal res_cp
        res_cp = run_context_parallel(model, img, dist.group.WORLD)

    row["fwd_s_cp"] = wall_ms(cp, device, reps=repeats, barrier=_world_barrier) / 1e3
    row["peak_mb_cp_per_rank"] = _all_peaks(_peak_mb(device), device)
    if rank == 0:
        row["relerr_vs_1dev"] = float((res_cp.features.cpu() - feats_1).norm() / feats_1.norm())
    return row


def main(argv: list[str] | None = None) -> list[dict]:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--quick", action="store_true", help="small CPU-sized cases (smoke run)")
    ap.add_argument("--cases", default="attention,vit", help="comma list of: attention, long, vit")
    ap.add_argument("--dtypes", default="float32,bfloat16",
                    help="attention cases of these dtypes only (comma list of float32, bfloat16)")
    ap.add_argument(
        "--one-device-max-tokens",
        type=int,
        default=None,
        help="attention cases above this many tokens are not run on one device: its time and memory are "
        "extrapolated from the largest measured case of the same kind (default 262144; 1031 with --quick)",
    )
    ap.add_argument("--tokens", default=None,
                    help="attention cases of these sequence lengths only (comma list, e.g. 262144,1048576)")
    ap.add_argument("--precision", default="auto", help="ELSA float32 precision (auto, ieee, tf32x3, tf32)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per measurement (median; one warm-up)")
    ap.add_argument(
        "--out", default=None, help="CSV path (default logs/benchmarks/context_parallel_<world>x<gpu>.csv)"
    )
    args = ap.parse_args(argv)
    kinds = [c.strip() for c in args.cases.split(",") if c.strip()]
    for kind in kinds:
        if kind not in FULL:
            raise SystemExit(f"--cases: unknown case kind {kind!r}; expected some of {', '.join(FULL)}")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    if not dtypes or any(d not in ("float32", "bfloat16") for d in dtypes):
        raise SystemExit(f"--dtypes: expected some of float32, bfloat16, got {args.dtypes!r}")
    try:
        tokens = {int(t) for t in args.tokens.split(",") if t.strip()} if args.tokens else None
    except ValueError:
        raise SystemExit(f"--tokens: expected a comma list of integers, got {args.tokens!r}") from None
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device (use --device cpu --quick for the gloo smoke run)")
    owns = not dist.is_initialized()
    if owns:
        if "RANK" not in os.environ:
            raise SystemExit(
                "launch with torchrun, e.g. torchrun --nproc-per-node 2 -m benchmarks.context_parallel"
            )
    if args.device == "cuda":
        rank = int(os.environ["RANK"]) if owns else dist.get_rank()
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank)))
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 end to end outside the attention kernels
    else:
        device = torch.device("cpu")
    if owns:  # NCCL is told this rank's device (otherwise it guesses it from the global rank)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo",
                                device_id=device if args.device == "cuda" else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    sweep = QUICK if args.quick else FULL
    max_tokens = args.one_device_max_tokens or ONE_DEVICE_MAX_TOKENS["quick" if args.quick else "full"]
    rows = []
    measured: dict[AttentionCase, dict] = {}  # rank 0: the attention cases one device ran
    try:
        for kind in kinds:
            for case in sweep[kind]:
                if isinstance(case, AttentionCase):
                    if case.dtype not in dtypes or (tokens is not None and case.N not in tokens):
                        continue
                    one = case.N <= max_tokens
                    row = run_attention(case, device, args.precision, args.repeats, one_device=one)
                    if rank == 0:
                        if one:
                            measured[case] = row
                        else:
                            extrapolate(row, case, measured)
                else:
                    row = run_vit(case, device, args.precision, args.repeats)
                if rank == 0:
                    row.update(world=world, precision=args.precision)
                    for what in ("fwd", "fwdbwd"):
                        one, cp = row.get(f"{what}_s_1dev"), row.get(f"{what}_s_cp")
                        if one is not None and cp:
                            row[f"{what}_speed_up"] = round(one / cp, 3)
                    peaks, one = row.get("peak_mb_cp_per_rank"), row.get("peak_mb_1dev")
                    if one and peaks and all(p is not None for p in peaks):
                        row["peak_fraction"] = round(max(peaks) / one, 3)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                dist.barrier()
    finally:
        if owns:
            dist.destroy_process_group()
    if rank != 0:
        return rows
    meta = run_info(device, __file__, argv)
    meta.update(command=meta["command"].replace("python -m", f"torchrun --nproc-per-node {world} -m", 1),
                host=platform.node())
    quick = "_quick" if args.quick else ""
    path = args.out or LOGS / f"context_parallel_{device_tag(device, world)}{quick}.csv"
    with Results(path, COLUMNS, meta) as out:
        for r in rows:
            r.update(meta)
            out.write({k: (json.dumps(v) if isinstance(v, list) else v) for k, v in r.items()})
    goal = [r for r in rows if r["case"].startswith("attention") and r["tokens"] == GOAL["attention_tokens"]]
    if goal:
        g = goal[0]
        print(
            json.dumps(
                {
                    "goal_attention_256k": {
                        "fwd_speed_up": g.get("fwd_speed_up"),
                        "fwdbwd_speed_up": g.get("fwdbwd_speed_up"),
                        "peak_fraction": g.get("peak_fraction"),
                        "met": bool(
                            (g.get("fwd_speed_up") or 0) >= GOAL["speed_up"]
                            and (g.get("peak_fraction") or 1) <= GOAL["peak_fraction"] + 0.1
                        ),
                    }
                }
            )
        )
    print(f"wrote {out.path}")
    return rows


if __name__ == "__main__":
    main()
