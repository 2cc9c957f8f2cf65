"""Accuracy against float64: every FP32 precision of ELSA and every FP32 peer, next to the ELSA paper's bound.

For ``[B, H, N, 64]`` random normal q, k, v (and a random normal output gradient) the relative error
``||x - ref64|| / ||ref64||`` of the forward output and of the gradients dq, dk, dv (one norm over the three)
against float64, for

* ELSA (``elsa_attention``, Triton) at ``precision`` = ``ieee``, ``fp16x3``, ``tf32x3``, ``tf32``;
* PyTorch SDPA in float32: ``sdpa_math`` (TF32 off) and ``sdpa_efficient``;

at N = 1K ... 64K (B = 1, H = 8) and at ViT lengths (B = 8, H = 12, N = 197, 785, 3137). The float64
reference is computed in query chunks (``O(chunk x N)`` memory); from 32K keys on the forward is compared on
``--rows`` sampled query rows per head and the gradients are skipped. ``bound`` is Theorem 1 of the paper,
``u (2 ceil(log2 N) + 3)`` with ``u = 2^-24``. Results: CSV and a plot under ``logs/benchmarks/`` (or
``--out``).

    python -m benchmarks.accuracy                # the full sweep (H100: a few minutes)
    python -m benchmarks.accuracy --quick        # 1K and 197 only
"""

from __future__ import annotations

import argparse
import math
import sys

import torch

from benchmarks.common import Results, add_out_dir, columns, device_tag, reference, relerr, run_info, sdpa

U = 2.0 ** -24
PRECISIONS = ("ieee", "fp16x3", "tf32x3", "tf32")
COLUMNS = columns("B", "H", "N", "D", "peer", "fwd_relerr", "grad_relerr", "bound")
SWEEP = [(1, 8, n, 64) for n in (1024, 4096, 16384, 32768, 65536)]  # N = 1K ... 64K
SWEEP += [(8, 12, n, 64) for n in (197, 785, 3137)]  # ViT-B at 224 / 448 / 896 px
QUICK = [(1, 8, 1024, 64), (8, 12, 197, 64)]
GRAD_LIMIT = 16384  # the float64 reference's gradients stop here; beyond, the forward on sampled rows only


def bound(n: int) -> float:
    """Theorem 1 of the ELSA paper: ``u (2 ceil(log2 n) + 3)``, ``u = 2^-24``."""
    return U * (2 * math.ceil(math.log2(n)) + 3)


def peers():
    from elsa_vision import elsa_attention

    def elsa(p):
        return lambda q, k, v: elsa_attention(q, k, v, precision=p)

    out = {f"elsa_{p}": elsa(p) for p in PRECISIONS}
    out["sdpa_math"] = sdpa("sdpa_math")
    out["sdpa_efficient"] = sdpa("sdpa_efficient")
    return out


def measure(B, H, N, D, rows_cap, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, dout = (torch.randn(B, H, N, D, device="cuda", generator=g) for _ in range(4))
    grads = N <= GRAD_LIMIT
    rows = None
    if not grads:
        perm = torch.randperm(N, generator=torch.Generator().manual_seed(seed))
        rows = perm[:rows_cap].sort().values.cuda()
    ref_out, ref_grads = reference(q, k, v, rows=rows, dout=dout if grads else None)
    results = []
    for name, fn in peers().items():
        leaves = [t.clone().requires_grad_(grads) for t in (q, k, v)]
        try:
            out = fn(*leaves)
        except (RuntimeError, torch.cuda.OutOfMemoryError) as err:
            print(f"    {name}: skipped ({str(err).splitlines()[0][:70]})", flush=True)
            torch.cuda.empty_cache()
            continue
        fwd = relerr(out if rows is None else out[..., rows, :], ref_out)
        grad = math.nan
        if grads:
            got = torch.autograd.grad(out, leaves, dout)
            num = sum(((a.double() - b) ** 2).sum() for a, b in zip(got, ref_grads)).sqrt()
            grad = (num / sum((b ** 2).sum() for b in ref_grads).sqrt()).item()
        results.append((name, fwd, grad))
        print(f"    {name:16s} fwd {fwd:.3e}  grad {grad:.3e}  (bound {bound(N):.2e})", flush=True)
        del out, leaves
        torch.cuda.empty_cache()
    return results


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--sizes", default=None, help="comma-separated N of the 1 x 8 x N x 64 sweep only")
    ap.add_argument("--rows", type=int, default=2048, help="sampled query rows per head from 32K keys on")
    add_out_dir(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("accuracy.py runs the Triton kernels: it needs a GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    shapes = QUICK if args.quick else SWEEP
    if args.sizes:
        shapes = [(1, 8, int(n), 64) for n in args.sizes.split(",")]
    meta = run_info("cuda", __file__, argv)
    with Results(args.out / f"accuracy_{device_tag('cuda')}.csv", COLUMNS, meta) as out:
        for B, H, N, D in shapes:
            print(f"{B}x{H}x{N}x{D}", flush=True)
            for name, fwd, grad in measure(B, H, N, D, args.rows):
                out.write(B=B, H=H, N=N, D=D, peer=name, fwd_relerr=f"{fwd:.4g}", grad_relerr=f"{grad:.4g}",
                          bound=f"{bound(N):.4g}")
    _plot(out.rows, out.path.with_suffix(".png"))
    print(f"wrote {out.path}")
    return str(out.path)


def _plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    sweep = [r for r in rows if r["B"] == 1]
    for peer in dict.fromkeys(r["peer"] for r in sweep):
        pts = [(r["N"], float(r["fwd_relerr"])) for r in sweep if r["peer"] == peer]
        ax.plot(*zip(*pts), marker="o", label=peer)
    ns = sorted({r["N"] for r in sweep})
    ax.plot(ns, [bound(n) for n in ns], "k--", label="Theorem 1: u(2 log2 N + 3)")
    ax.set(xscale="log", yscale="log", xlabel="N (keys = queries), B=1, H=8, D=64",
           ylabel="forward ||out - ref64|| / ||ref64||")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
