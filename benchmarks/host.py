"""Host time per call: what one attention call costs the CPU that enqueues it, next to every peer, in one run.

At a tiny shape the GPU work is negligible, so the time to enqueue ``--calls`` calls back to back (one
``torch.cuda.synchronize`` after the loop, not inside it) divided by the call count is the host cost of one
call -- what decides an eager model's speed at ViT sizes in half precision. Cases:

* ``fwd`` / ``fwd_bwd``: ``[1, 1, 64, 64]`` attention, forward (no autograd) and forward + backward (inputs
  requiring grad, ``out.backward(dout)``): SDPA's efficient, cuDNN and flash backends (where they take the
  dtype) against ``elsa_attention``.
* ``fwd_long`` / ``fwd_bwd_long``: the same at ``[1, 1, 2048, 64]``, where the warp-specialised Hopper
  backward takes the call on sm90 (``bwd.HOPPER_MIN_KEYS``; the forward's grid is too small for the Hopper
  forward, which needs one key partition) and the GPU's work is still a few µs: ``elsa`` against
  ``elsa_generic`` (the generic kernels, ``benchmarks.common.generic_kernels``) and SDPA's cuDNN backend.
* ``window``: one window-attention module call on ``[8, 49, 96]`` (Swin-T stage 1, 3 heads, window 7;
  ``[8, 64, 96]`` for Swin v2, window 8): timm's ``WindowAttention`` (v1 and v2) against the same module
  converted to ELSA (the W-ELSA op).
* ``vit_block``: one timm ViT-B ``Block`` on ``[1, 16, 768]``: timm (SDPA) against the block with
  ``ElsaAttention``.
* ``linear`` / ``mlp``: one ViT-B qkv projection (768 -> 2304) and one timm ViT-B ``Mlp`` on ``[16, 768]``,
  no autograd: ``F.linear`` / timm's ``Mlp`` against ``elsa_linear`` / the ``ElsaMlp`` made from it (float32:
  the split-precision GEMM, whose weights are split once for inference; bfloat16: ``F.linear`` behind
  ``elsa_linear``'s checks).

Every row also gives the GPU kernels one call launches (``torch.profiler``). ``--breakdown`` adds the host
time of each stage of ELSA's forward path at the same shape, timed alone in the same way: input validation,
backend choice, program lookup (signature + cache), output allocation, the direct Triton launch (and, for
comparison, the same launch through Triton's ``JITFunction.run``), the operator dispatch and the autograd
Function (each as the difference to the stage below it).

    python -m benchmarks.host                  # every case, fp32 and bf16, CSV under logs/benchmarks/
    python -m benchmarks.host --breakdown      # plus the per-stage costs
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import math
import sys

import torch

from benchmarks.common import (
    Results,
    add_out_dir,
    columns,
    device_tag,
    generic_kernels,
    host_us,
    launches,
    run_info,
    sdpa,
)

COLUMNS = columns("label", "case", "dtype", "peer", "host_us", "launches")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
SHAPE = (1, 1, 64, 64)  # the attention cases: GPU work negligible, the host's cost per call is what is left
LONG = (1, 1, 2048, 64)  # long enough for the Hopper backward, GPU work still a few µs
SDPA_PEERS = ("sdpa_efficient", "sdpa_cudnn", "sdpa_flash")  # flash is skipped for float32 (no kernel)
CASES = ("fwd", "fwd_bwd", "fwd_long", "fwd_bwd_long", "window_v1", "window_v2", "vit_block", "linear", "mlp")
TOKENS = 16  # the linear cases' rows


def attention_peers(dtype, long: bool = False) -> dict:
    """The attention peers as ``fn(q, k, v)``: SDPA's backends and ``elsa``; at the ``LONG`` shape cuDNN,
    ``elsa`` and ``elsa_generic`` (whose calls, backward included, run inside ``generic_kernels``)."""
    from elsa_vision import elsa_attention

    names = ("sdpa_cudnn",) if long else SDPA_PEERS
    peers = {name: sdpa(name) for name in names if not (name == "sdpa_flash" and dtype == torch.float32)}
    peers["elsa"] = lambda q, k, v: elsa_attention(q, k, v)
    if long:
        peers["elsa_generic"] = peers["elsa"]
    return peers


def modules() -> dict:
    """The module cases: (module, input shape, window mask shape or None). timm's Swin-T stage-1 window
    attention (v1: window 7, 3 heads, 96 channels; v2: window 8) and one ViT-B block."""
    import timm
    from timm.models import swin_transformer as swin1
    from timm.models import swin_transformer_v2 as swin2

    return {
        "window_v1": (swin1.WindowAttention(96, num_heads=3, window_size=(7, 7)), (8, 49, 96), (4, 49, 49)),
        "window_v2": (swin2.WindowAttention(96, window_size=(8, 8), num_heads=3), (8, 64, 96), (4, 64, 64)),
        "vit_block": (timm.create_model("vit_base_patch16_224", depth=1).blocks[0], (1, 16, 768), None),
    }


def attention_rows(dtype, calls, long: bool = False):
    q, k, v = (torch.randn(*(LONG if long else SHAPE), device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    fwds, fwd_bwds = {}, {}
    for name, fn in attention_peers(dtype, long).items():
        try:
            fn(q, k, v)
        except RuntimeError as err:  # a backend that does not take this dtype / shape on this device
            print(f"  {name}: skipped ({str(err).splitlines()[0][:80]})")
            continue
        kernels = generic_kernels if name == "elsa_generic" else contextlib.nullcontext

        def fwd(fn=fn, kernels=kernels):
            with torch.no_grad(), kernels():
                fn(q, k, v)

        def fwd_bwd(fn=fn, kernels=kernels):
            with kernels():
                fn(qg, kg, vg).backward(dout)

        fwds[name], fwd_bwds[name] = fwd, fwd_bwd
    rows = []
    suffix = "_long" if long else ""
    for case, fns in (("fwd" + suffix, fwds), ("fwd_bwd" + suffix, fwd_bwds)):
        for name, us in host_us(fns, calls).items():
            rows.append((case, name, us, launches(fns[name])))
    return rows


def module_rows(dtype, calls):
    from elsa_vision import patch_attention

    rows = []
    for case, (mod, shape, mask) in modules().items():
        x = torch.randn(shape, device="cuda", dtype=dtype)
        base = mod.to("cuda", dtype).eval()
        patched = copy.deepcopy(base)
        patch_attention(patched)
        args = (x,) if mask is None else (x, torch.zeros(mask, device="cuda", dtype=dtype))
        fns = {}
        for name, m in (("timm", base), ("elsa", patched)):
            def call(m=m, args=args):
                with torch.no_grad():
                    m(*args)

            fns[name] = call
        for name, us in host_us(fns, calls).items():
            rows.append((case, name, us, launches(fns[name])))
    return rows


def linear_rows(dtype, calls):
    """``linear`` and ``mlp``: torch's layer against ELSA's, no autograd, at ``[TOKENS, 768]``."""
    import torch.nn.functional as F
    from timm.layers import Mlp

    from elsa_vision import patch_model
    from elsa_vision.ops.linear import elsa_linear

    torch.manual_seed(0)
    x = torch.randn(TOKENS, 768, device="cuda", dtype=dtype)
    w = torch.randn(2304, 768, device="cuda", dtype=dtype) / 768 ** 0.5
    b = torch.randn(2304, device="cuda", dtype=dtype)
    mlp = Mlp(768, 3072).to("cuda", dtype).eval()
    elsa_mlp = copy.deepcopy(mlp)
    patch_model(elsa_mlp)  # an ElsaMlp over two ElsaLinear layers
    cases = {
        "linear": {"torch": lambda: F.linear(x, w, b), "elsa": lambda: elsa_linear(x, w, b)},
        "mlp": {"timm": lambda: mlp(x), "elsa": lambda: elsa_mlp(x)},
    }
    rows = []
    with torch.no_grad():
        for case, fns in cases.items():
            for name, us in host_us(fns, calls).items():
                rows.append((case, name, us, launches(fns[name])))
    return rows


def breakdown_rows(dtype, calls):
    """Host µs of each stage of ELSA's forward and backward paths at ``[1, 1, 64, 64]`` (new code only)."""
    from elsa_vision import elsa_attention
    from elsa_vision.kernels import bwd as kbwd
    from elsa_vision.kernels import fwd as kfwd
    from elsa_vision.ops import attention as ops
    from elsa_vision.ops._library import eager_bypass
    from elsa_vision.ops.checks import check_attention_inputs

    q, k, v = (torch.randn(*SHAPE, device="cuda", dtype=dtype) for _ in range(3))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    dout = torch.randn_like(q)
    scale = SHAPE[-1] ** -0.5
    out, lse = kfwd.elsa_fwd(q, k, v, None, None, False, scale, "auto")
    program = kfwd.fwd_program(q, k, v, None, None, False, scale, "auto")
    p = program.plan
    main = program.main[0]

    parts = (out,) * 4
    if program.split is not None:  # fp16x3: the keys and values split beforehand, a launch of its own
        parts = program.split(k, v, out)  # allocated once here; the timed launches below write them again

    # the forward program's tensor arguments (``_FwdProgram.run``): no bias, key padding mask, workspace or
    # varlen offsets (``out`` in their places, unread), ``out`` as the unread ``Redo`` too
    args = (q, k, v, out, out, out, lse, out, out, out, out, out, *parts, out)

    def direct_launch():
        if program.split is not None:
            program.split.launch(k, v, out, *parts)
        main(*args)

    def jit_launch():
        if program.split is not None:
            split = program.split.launch
            kfwd._split_kv_kernel[split.grid](k, v, out, *parts, *split.scalars, **split.options)
        kfwd._fwd_kernel[main.grid](*args, *main.scalars, **main.options)

    def nograd(fn):
        def call():
            with torch.no_grad():
                fn()
        return call

    bwd_args = (dout, q, k, v, out, lse, None, None, False, scale, "auto", False)
    stages = {
        "validation": nograd(lambda: check_attention_inputs(q, k, v, None, None, False, None, "auto", "auto",
                                                            0.0)),
        "backend_choice": nograd(lambda: ops.resolve_backend("auto", q)),
        "eager_bypass_check": nograd(lambda: eager_bypass(q, ops.attention_fwd, ops._ATTENTION_FWD)),
        "program_lookup": nograd(lambda: kfwd.fwd_program(q, k, v, None, None, False, scale, "auto")),
        "allocation_out_lse": nograd(lambda: (torch.empty_strided(program.out_size, program.out_stride,
                                                                  dtype=dtype, device=q.device),
                                              torch.empty(program.lse_size, dtype=torch.float32,
                                                          device=q.device))),
        "triton_launch_direct": nograd(direct_launch),
        "triton_launch_jit": nograd(jit_launch),
        "fwd_op_body": nograd(lambda: ops.attention_fwd(q, k, v, None, None, False, scale, "auto")),
        "fwd_op_dispatch": nograd(lambda: ops._ATTENTION_FWD(q, k, v, None, None, False, scale, "auto")),
        "fwd_autograd_function": lambda: ops._ElsaAttention.apply(qg, k, v, None, None, False, scale, "auto"),
        "fwd_elsa_attention_inference": nograd(lambda: elsa_attention(q, k, v)),
        "bwd_kernels": nograd(lambda: kbwd.elsa_bwd(dout, q, k, v, out, lse, None, None, False, scale)),
        "bwd_op_body": nograd(lambda: ops._attention_bwd(*bwd_args)),
        "bwd_op_dispatch": nograd(lambda: ops._ATTENTION_BWD(*bwd_args)),
        "fwd_bwd_backward": lambda: elsa_attention(qg, kg, vg).backward(dout),
        "fwd_bwd_autograd_grad": lambda: torch.autograd.grad(elsa_attention(qg, kg, vg), (qg, kg, vg), dout),
    }
    print(f"  plan: partitions {p.partitions}, tiles {p.block_m}x{p.block_n}, precision {p.precision}")
    measured = host_us(stages, calls)
    return [("breakdown", name, us, math.nan) for name, us in measured.items()]


PROFILES = ("fwd_bwd", "fwd_bwd_long", "vit_block")


def profile_elsa(dtype, calls, case: str = "fwd_bwd"):
    """cProfile of ``calls`` ELSA calls of one case: attention forward + backward at ``SHAPE`` (``fwd_bwd``)
    or ``LONG`` (``fwd_bwd_long``, where the Hopper kernels take them), or the patched ViT-B block's forward
    (``vit_block``): where the host time goes, function by function."""
    import cProfile
    import pstats

    from elsa_vision import elsa_attention, patch_attention

    if case == "vit_block":
        block, shape, _ = modules()["vit_block"]
        block = block.to("cuda", dtype).eval()
        patch_attention(block)
        x = torch.randn(shape, device="cuda", dtype=dtype)

        def step():
            with torch.no_grad():
                block(x)
    else:
        shape = LONG if case == "fwd_bwd_long" else SHAPE
        q, k, v = (torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        dout = torch.randn(*shape, device="cuda", dtype=dtype)

        def step():
            elsa_attention(q, k, v).backward(dout)

    for _ in range(20):
        step()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        step()
    prof.disable()
    torch.cuda.synchronize()
    print(f"{case}, {dtype}, {calls} calls:")
    pstats.Stats(prof).sort_stats("tottime").print_stats(25)


def main(argv=None) -> str:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--breakdown", action="store_true", help="per-stage host costs of ELSA's forward")
    ap.add_argument("--label", default="", help="a tag for this tree (e.g. 'before' / 'after' in one run)")
    ap.add_argument("--profile", nargs="?", const="fwd_bwd", choices=PROFILES, default=None,
                    help="cProfile of ELSA's calls of one case (default fwd_bwd) and exit")
    add_out_dir(ap)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        ap.error("host.py measures CUDA launches: it needs a GPU")
    if args.profile is not None:
        for dname in args.dtypes.split(","):
            profile_elsa(DTYPES[dname], args.calls, args.profile)
        return ""
    import elsa_vision

    label = args.label or elsa_vision.__file__
    meta = dict(run_info("cuda", __file__, argv), label=label)
    tag = device_tag("cuda") + (f"_{args.label}" if args.label else "")
    with Results(args.out / f"host_{tag}.csv", COLUMNS, meta) as out:
        for dname in args.dtypes.split(","):
            dtype = DTYPES[dname]
            print(f"{dname}:", flush=True)
            got = (attention_rows(dtype, args.calls) + attention_rows(dtype, args.calls, long=True)
                   + module_rows(dtype, args.calls) + linear_rows(dtype, args.calls))
            if args.breakdown:
                got += breakdown_rows(dtype, args.calls)
            for case, peer, us, n in got:
                print(f"  {case:10s} {peer:24s} {us:9.1f} us  {n:5.1f} launches", flush=True)
                out.write(case=case, dtype=dname, peer=peer, host_us=f"{us:.2f}", launches=n)
    print("\nratios (elsa host µs / peer host µs)")
    for dname in args.dtypes.split(","):
        for case in CASES:
            sel = {r["peer"]: float(r["host_us"]) for r in out.rows
                   if r["case"] == case and r["dtype"] == dname}
            if "elsa" not in sel:
                continue
            parts = [f"{p} {sel['elsa'] / us:.2f}x" for p, us in sel.items() if p != "elsa"]
            print(f"  {dname} {case:10s} elsa {sel['elsa']:7.1f} us: " + ", ".join(parts))
    print(f"wrote {out.path}")
    return str(out.path)


if __name__ == "__main__":
    main()
