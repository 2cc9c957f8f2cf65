"""FP32 matrix products: PyTorch's FP32, TF32 and bf16 GEMMs vs the FP32-accurate split GEMM, in one run.

Every case is one product ``C = A @ B^T (+ bias)`` of a linear layer at a model's shapes (the forward
``x @ w.T``, the input gradient ``dy @ w`` and the weight gradient ``dy.T @ x``, with the operand layouts
autograd passes: ``w`` of the input gradient and ``dy``, ``x`` of the weight gradient are transposed views)
or a square one; the peers:

* ``torch_fp32`` -- ``torch.addmm`` in IEEE FP32 (``allow_tf32`` off): what an FP32 ``nn.Linear`` runs,
* ``torch_tf32`` -- the same with TF32 on (one TF32 pass, ~1e-3),
* ``torch_bf16`` -- bfloat16 operands (float32 accumulation; the error of bf16 inputs, ~3e-3),
* ``elsa``       -- ``elsa_vision.kernels.gemm.gemm`` at ``--precision`` (default ``auto``: ``fp16x3`` on
  sm90), the operand splits included (what ``elsa_linear`` runs with autograd),
* ``elsa_inference`` -- forward products (neither operand transposed): the same with ``B`` split once and
  kept (``reuse_b``: what ``elsa_linear`` runs without autograd, the weight's parts reused while it is
  unchanged). Its eager time is the product's without the weight's split pass; its CUDA-graph time keeps
  the pass (a graph splits at every replay).

The ``*_mlp`` cases are a whole GELU MLP, ``fc2(gelu(fc1(x)))`` (timm's ``Mlp``; FLOPs of both products):
the torch peers run ``F.linear``, ``F.gelu``, ``F.linear``; ``elsa`` the fused operator of ``elsa_mlp``
without gradients (GELU in the first product's epilogue, the hidden activation kept as float16 parts, the
weights split once as ``elsa_inference``'s), and ``elsa_unfused`` the two ``elsa_linear`` products around
``F.gelu`` (what runs with gradients).

Reported per peer: eager ms (``do_bench`` median) and CUDA-graph ms, TFLOP/s (``2 M N K``) and the relative
error ``||C - C64|| / ||C64||`` against float64 on the same inputs. The summary prints, per case, the speed
over ``torch_fp32`` (goal ``--goal``, default 3) and whether ``elsa``'s error is at most ``torch_fp32``'s.
Rows go to ``logs/benchmarks/gemm_<gpu>.csv`` (or ``--out``).

    python -m benchmarks.gemm                      # every case
    python -m benchmarks.gemm --cases vit_b        # a regex on the case name
    python -m benchmarks.gemm --device cpu --quick # a smoke run (interpreter; times mean nothing)
    python -m benchmarks.gemm --tune-widths 768,1024,2048,4096   # weight gradients at each A_T_MAX_N

``--tune-widths`` times the ViT-B and ViT-L weight gradients (``dy.T @ x``, both operands transposed views)
with ``kernels.gemm.A_T_MAX_N`` set to each width in turn: up to that width the Hopper loop splits the
transposed ``dy.T`` in its registers, wider ones with at most that many rows are computed transposed. One line
per product: torch FP32's time, then per width the time, the speed-up, whether ``dy.T`` was split in
registers (``ta``) or the product swapped (``sw``), and the error against float64.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import torch

from benchmarks.common import Results, add_out_dir, bench_ms, columns, device_tag, relerr, run_info, timings

COLUMNS = columns("case", "M", "N", "K", "peer", "ms", "graph_ms", "tflops", "relerr", "precision")
PEERS = ("torch_fp32", "torch_tf32", "torch_bf16", "elsa")


@dataclass(frozen=True)
class Case:
    name: str
    M: int
    N: int
    K: int
    transpose_a: bool = False  # A is a transposed view (the weight gradient's dy.T)
    transpose_b: bool = False  # B is a transposed view (the weight gradient's x.T, the input gradient's w.T)
    bias: bool = True
    mlp: bool = False  # fc2(gelu(fc1(x))): x [M, K], fc1 [N, K], fc2 [K, N]


def _layer_cases(model: str, tokens: int, width: int, hidden: int) -> list[Case]:
    """The GEMMs of one ViT block at ``tokens`` rows: qkv, proj, fc1, fc2 forward; the input and weight
    gradients of qkv and fc2."""
    return [
        Case(f"{model}_qkv", tokens, 3 * width, width),
        Case(f"{model}_proj", tokens, width, width),
        Case(f"{model}_fc1", tokens, hidden, width),
        Case(f"{model}_fc2", tokens, width, hidden),
        Case(f"{model}_qkv_dx", tokens, width, 3 * width, transpose_b=True, bias=False),
        Case(f"{model}_qkv_dw", 3 * width, width, tokens, transpose_a=True, transpose_b=True, bias=False),
        Case(f"{model}_fc2_dw", width, hidden, tokens, transpose_a=True, transpose_b=True, bias=False),
        Case(f"{model}_mlp", tokens, hidden, width, mlp=True),
    ]


CASES = [
    *_layer_cases("vit_b_224_b64", 64 * 197, 768, 3072),
    *_layer_cases("vit_l_224_b32", 32 * 197, 1024, 4096),
    Case("square_8192", 8192, 8192, 8192, bias=False),
    Case("head_b64", 64, 1000, 768),
    Case("swin_t_stage1_b32_mlp", 32 * 64 * 64, 384, 96, mlp=True),
    Case("vit_s_1024_b2_mlp", 2 * 4097, 1536, 384, mlp=True),
]
# --tune-widths: the weight gradients of ViT-B (b64) and ViT-L (b32) qkv, fc1 and fc2 at 224 px
WIDTH_CASES = [Case(f"{model}_{layer}_dw", fout, fin, tokens, transpose_a=True, transpose_b=True, bias=False)
               for model, tokens, width, hidden in (("vit_b_224_b64", 64 * 197, 768, 3072),
                                                    ("vit_l_224_b32", 32 * 197, 1024, 4096))
               for layer, fin, fout in (("qkv", width, 3 * width), ("fc1", width, hidden),
                                        ("fc2", hidden, width))]
QUICK_CASES = [Case("quick", 37, 29, 45), Case("quick_dw", 29, 23, 70, transpose_a=True, transpose_b=True),
               Case("quick_mlp", 37, 70, 45, mlp=True)]


def _operands(case: Case, device):
    g = torch.Generator(device="cpu").manual_seed(case.M * 31 + case.N * 7 + case.K)
    if case.transpose_a:
        a = torch.randn(case.K, case.M, generator=g).to(device).t()
    else:
        a = torch.randn(case.M, case.K, generator=g).to(device)
    if case.transpose_b:
        b = torch.randn(case.K, case.N, generator=g).to(device).t()
    else:
        b = torch.randn(case.N, case.K, generator=g).to(device)
    bias = torch.randn(case.N, generator=g).to(device) if case.bias else None
    return a, b, bias


def _tf32(tf32: bool, fn):
    def call():
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            return fn()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    return call


def _torch(a, b, bias, tf32: bool):
    return _tf32(tf32, lambda: torch.addmm(bias, a, b.t()) if bias is not None else a @ b.t())


def _torch_mlp(x, w1, b1, w2, b2, tf32: bool):
    F = torch.nn.functional
    return _tf32(tf32, lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2))


def _calls(case: Case, device, precision: str, peers: tuple[str, ...]):
    """``(calls by peer, float64 reference, FLOPs)`` of one case."""
    from elsa_vision.kernels.gemm import gemm
    from elsa_vision.ops.linear import _mlp_fwd, elsa_linear

    a, b, bias = _operands(case, device)
    if case.mlp:
        F = torch.nn.functional
        g = torch.Generator(device="cpu").manual_seed(case.N * 13 + case.K)
        w2 = torch.randn(case.K, case.N, generator=g).to(device) / case.N ** 0.5
        b2 = torch.randn(case.K, generator=g).to(device)
        ops = (a, b / case.K ** 0.5, bias, w2, b2)
        ref = F.linear(F.gelu(F.linear(*(t.double() for t in ops[:3]))), w2.double(), b2.double())
        calls = {
            "torch_fp32": _torch_mlp(*ops, False),
            "torch_tf32": _torch_mlp(*ops, True),
            "elsa": lambda: _mlp_fwd(*ops, precision),
            "elsa_unfused": lambda: elsa_linear(F.gelu(elsa_linear(*ops[:3], precision=precision)), w2, b2,
                                                precision=precision),
        }
        if "torch_bf16" in peers:  # cast once, outside the timed call
            half = [t.bfloat16() for t in ops]
            calls["torch_bf16"] = _torch_mlp(*half, False)
        return calls, ref, 4 * case.M * case.N * case.K
    ref = a.double() @ b.double().t()
    if bias is not None:
        ref += bias.double()
    calls = {
        "torch_fp32": _torch(a, b, bias, False),
        "torch_tf32": _torch(a, b, bias, True),
        "elsa": lambda: gemm(a, b, bias, precision=precision),
    }
    if not (case.transpose_a or case.transpose_b):  # a forward product: B is a weight kept between calls
        calls["elsa_inference"] = lambda: gemm(a, b, bias, precision=precision, reuse_b=True)
    if "torch_bf16" in peers:
        ab, bb = a.bfloat16(), b.bfloat16()
        biasb = bias.bfloat16() if bias is not None else None
        calls["torch_bf16"] = _torch(ab, bb, biasb, False)
    return calls, ref, 2 * case.M * case.N * case.K


def run_case(case: Case, device: torch.device, precision: str, peers: tuple[str, ...]) -> list[dict]:
    from elsa_vision.kernels.gemm import gemm_plan

    calls, ref, flops = _calls(case, device, precision, peers)
    peers = (*peers, *(extra for extra in ("elsa_unfused", "elsa_inference") if extra in calls))
    rows = []
    for peer in peers:
        call = calls[peer]
        out = call()
        err = relerr(out.float(), ref)
        t = timings(call, device)
        resolved = gemm_plan(case.M, case.N, case.K, device, precision).precision if "elsa" in peer else ""
        rows.append(dict(case=case.name, M=case.M, N=case.N, K=case.K, peer=peer, ms=t["ms"],
                         graph_ms=t["graph_ms"], tflops=flops / t["ms"] / 1e9, relerr=err,
                         precision=resolved))
        print(f"  {peer:12s} {t['ms']:9.4f} ms  graph {t['graph_ms']:9.4f} ms  {flops / t['ms'] / 1e9:7.1f} "
              f"TFLOP/s  relerr {err:.2e}", flush=True)
    del ref
    return rows


def tune_widths(cases: list[Case], widths: list[int], device) -> None:
    """Time each weight gradient at every ``A_T_MAX_N`` in ``widths`` (module docstring)."""
    from elsa_vision.kernels import gemm as g

    saved = g.A_T_MAX_N
    try:
        for case in cases:
            a, b, _ = _operands(case, device)
            ref = a.double() @ b.double().t()
            base = bench_ms(_torch(a, b, None, False), device)
            parts = []
            for width in widths:
                g.A_T_MAX_N = width
                g._PROGRAMS.clear()
                err = relerr(g.gemm(a, b), ref)
                ms = bench_ms(lambda a=a, b=b: g.gemm(a, b), device)
                program = g._PROGRAMS(g._GemmProgram, (a, b, None), ("auto", None, None, 0, False))
                parts.append(f"{width}: {ms:.4f} ms ({base / ms:.2f}x, ta={int(program.trans_a)} "
                             f"sw={int(program.swap)} {err:.2e})")
            print(f"{case.name} {case.M}x{case.N} K={case.K}: torch {base:.4f} ms | " + " | ".join(parts),
                  flush=True)
    finally:
        g.A_T_MAX_N = saved
        g._PROGRAMS.clear()


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny smoke cases (CPU-friendly)")
    p.add_argument("--cases", default="", help="regex on the case name")
    p.add_argument("--precision", default="auto", help="elsa's float32 precision")
    p.add_argument("--goal", type=float, default=3.0, help="elsa's speed over torch_fp32 to reach")
    p.add_argument("--tune-widths", default="",
                   help="comma list of A_T_MAX_N values: time the weight gradients at each instead")
    add_out_dir(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda given but CUDA is not available")
    if args.tune_widths:
        try:
            widths = [int(w) for w in args.tune_widths.split(",")]
        except ValueError:
            p.error(f"--tune-widths takes a comma list of integers, got {args.tune_widths!r}")
        cases = [c for c in (QUICK_CASES if args.quick else WIDTH_CASES) if c.transpose_a]
        tune_widths([c for c in cases if re.search(args.cases, c.name)], widths, device)
        return ""
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.name)]
    # bf16 has no meaning in the interpreter's smoke run
    peers = PEERS if device.type == "cuda" else ("torch_fp32", "elsa")
    meta = run_info(device, __file__, argv)
    results = []
    with Results(args.out / f"gemm_{device_tag(device)}.csv", COLUMNS, meta) as out:
        for case in cases:
            shape = f"[{case.M}, {case.K}] @ [{case.K}, {case.N}]"
            shape += f" @ [{case.N}, {case.K}]" if case.mlp else ""
            print(f"{case.name}: {shape}", flush=True)
            rows = run_case(case, device, args.precision, peers)
            for r in rows:
                out.write({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
            results.append((case, {r["peer"]: r for r in rows}))
    print(f"\nelsa vs torch_fp32, {meta['device']}, torch {meta['torch']}, triton {meta['triton']}")
    print(f"{'case':24s} {'eager':>7s} {'graph':>7s} {'TFLOP/s':>8s} {'relerr':>9s} {'torch err':>9s}"
          "  status")
    for case, r in results:
        e, f = r["elsa"], r["torch_fp32"]
        speed, graph = f["ms"] / e["ms"], f["graph_ms"] / e["graph_ms"]
        misses = [what for what, bad in (("speed", not speed >= args.goal),
                                         ("error", not e["relerr"] <= f["relerr"])) if bad]
        print(f"{case.name:24s} {speed:7.2f} {graph:7.2f} "
              f"{e['tflops']:8.1f} {e['relerr']:9.2e} {f['relerr']:9.2e}  "
              f"{'below goal (' + ', '.join(misses) + ')' if misses else 'meets goal'}"
              + "".join(f"; {name.removeprefix('elsa_')} {f['ms'] / r[name]['ms']:.2f}x eager"
                        for name in ("elsa_unfused", "elsa_inference") if name in r))
    print(f"\nwrote {out.path}")
    return str(out.path)


if __name__ == "__main__":
    main()
