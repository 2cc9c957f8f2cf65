"""FP32 matrix products: PyTorch's FP32, TF32 and bf16 GEMMs vs the FP32-accurate split GEMM, in one run.

Every case is one product ``C = A @ B^T (+ bias)`` of a linear layer at a model's shapes (the forward
``x @ w.T``, the input gradient ``dy @ w`` and the weight gradient ``dy.T @ x``) or a square one; the peers:

* ``torch_fp32`` -- ``torch.addmm`` in IEEE FP32 (``allow_tf32`` off): what an FP32 ``nn.Linear`` runs,
* ``torch_tf32`` -- the same with TF32 on (one TF32 pass, ~1e-3),
* ``torch_bf16`` -- bfloat16 operands (float32 accumulation; the error of bf16 inputs, ~3e-3),
* ``elsa``       -- ``elsa_vision.kernels.gemm.gemm`` at ``--precision`` (default ``auto``: ``fp16x3`` on
  sm90), the operand splits included (what ``elsa_linear`` runs).

Reported per peer: eager ms (``do_bench`` median) and CUDA-graph ms, TFLOP/s (``2 M N K``) and the relative
error ``||C - C64|| / ||C64||`` against float64 on the same inputs. The summary prints, per case, the speed
over ``torch_fp32`` (goal ``--goal``, default 3) and whether ``elsa``'s error is at most ``torch_fp32``'s.
Rows go to ``logs/benchmarks/gemm_<gpu>.csv`` (or ``--out``).

    python -m benchmarks.gemm                      # every case
    python -m benchmarks.gemm --cases vit_b        # a regex on the case name
    python -m benchmarks.gemm --device cpu --quick # a smoke run (interpreter; times mean nothing)
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import torch

from benchmarks.common import Results, add_out_dir, columns, device_tag, relerr, run_info, timings

COLUMNS = columns("case", "M", "N", "K", "peer", "ms", "graph_ms", "tflops", "relerr", "precision")
PEERS = ("torch_fp32", "torch_tf32", "torch_bf16", "elsa")


@dataclass(frozen=True)
class Case:
    name: str
    M: int
    N: int
    K: int
    transpose_a: bool = False  # A is a transposed view (the weight gradient's dy.T)
    bias: bool = True


def _layer_cases(model: str, tokens: int, width: int, hidden: int) -> list[Case]:
    """The GEMMs of one ViT block at ``tokens`` rows: qkv, proj, fc1, fc2 forward; the input and weight
    gradients of qkv and fc2."""
    return [
        Case(f"{model}_qkv", tokens, 3 * width, width),
        Case(f"{model}_proj", tokens, width, width),
        Case(f"{model}_fc1", tokens, hidden, width),
        Case(f"{model}_fc2", tokens, width, hidden),
        Case(f"{model}_qkv_dx", tokens, width, 3 * width, bias=False),
        Case(f"{model}_qkv_dw", 3 * width, width, tokens, transpose_a=True, bias=False),
        Case(f"{model}_fc2_dw", width, hidden, tokens, transpose_a=True, bias=False),
    ]


CASES = [
    *_layer_cases("vit_b_224_b64", 64 * 197, 768, 3072),
    *_layer_cases("vit_l_224_b32", 32 * 197, 1024, 4096),
    Case("square_8192", 8192, 8192, 8192, bias=False),
    Case("head_b64", 64, 1000, 768),
]
QUICK_CASES = [Case("quick", 37, 29, 45), Case("quick_dw", 29, 23, 70, transpose_a=True)]


def _operands(case: Case, device):
    g = torch.Generator(device="cpu").manual_seed(case.M * 31 + case.N * 7 + case.K)
    if case.transpose_a:
        a = torch.randn(case.K, case.M, generator=g).to(device).t()
    else:
        a = torch.randn(case.M, case.K, generator=g).to(device)
    b = torch.randn(case.N, case.K, generator=g).to(device)
    bias = torch.randn(case.N, generator=g).to(device) if case.bias else None
    return a, b, bias


def _torch(a, b, bias, tf32: bool):
    def call():
        old = torch.backends.cuda.matmul.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = tf32
        try:
            return torch.addmm(bias, a, b.t()) if bias is not None else a @ b.t()
        finally:
            torch.backends.cuda.matmul.allow_tf32 = old

    return call


def run_case(case: Case, device: torch.device, precision: str, peers: tuple[str, ...]) -> list[dict]:
    from elsa_vision.kernels.gemm import gemm, gemm_plan

    a, b, bias = _operands(case, device)
    ref = a.double() @ b.double().t()
    if bias is not None:
        ref += bias.double()
    calls = {
        "torch_fp32": _torch(a, b, bias, False),
        "torch_tf32": _torch(a, b, bias, True),
        "elsa": lambda: gemm(a, b, bias, precision=precision),
    }
    if "torch_bf16" in peers:
        ab, bb = a.bfloat16(), b.bfloat16()
        biasb = bias.bfloat16() if bias is not None else None
        calls["torch_bf16"] = _torch(ab, bb, biasb, False)
    flops = 2 * case.M * case.N * case.K
    rows = []
    for peer in peers:
        call = calls[peer]
        out = call()
        err = relerr(out.float(), ref)
        t = timings(call, device)
        resolved = gemm_plan(case.M, case.N, case.K, device, precision).precision if peer == "elsa" else ""
        rows.append(dict(case=case.name, M=case.M, N=case.N, K=case.K, peer=peer, ms=t["ms"],
                         graph_ms=t["graph_ms"], tflops=flops / t["ms"] / 1e9, relerr=err,
                         precision=resolved))
        print(f"  {peer:11s} {t['ms']:9.4f} ms  graph {t['graph_ms']:9.4f} ms  {flops / t['ms'] / 1e9:7.1f} "
              f"TFLOP/s  relerr {err:.2e}", flush=True)
    del ref
    return rows


def main(argv: list[str] | None = None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--quick", action="store_true", help="tiny smoke cases (CPU-friendly)")
    p.add_argument("--cases", default="", help="regex on the case name")
    p.add_argument("--precision", default="auto", help="elsa's float32 precision")
    p.add_argument("--goal", type=float, default=3.0, help="elsa's speed over torch_fp32 to reach")
    add_out_dir(p)
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda given but CUDA is not available")
    cases = QUICK_CASES if args.quick else CASES
    if args.cases:
        cases = [c for c in cases if re.search(args.cases, c.name)]
    # bf16 has no meaning in the interpreter's smoke run
    peers = PEERS if device.type == "cuda" else ("torch_fp32", "elsa")
    meta = run_info(device, __file__, argv)
    results = []
    with Results(args.out / f"gemm_{device_tag(device)}.csv", COLUMNS, meta) as out:
        for case in cases:
            print(f"{case.name}: [{case.M}, {case.K}] @ [{case.K}, {case.N}]", flush=True)
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
              f"{'below goal (' + ', '.join(misses) + ')' if misses else 'meets goal'}")
    print(f"\nwrote {out.path}")
    return str(out.path)


if __name__ == "__main__":
    main()
