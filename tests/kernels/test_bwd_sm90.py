"""The Hopper dK/dV pass (``kernels/bwd_sm90.py``, Gluon): compiled for sm90 on any machine (its structure in
the PTX), and on an H100 against float64 and the generic backward, odd lengths and strided views included,
and its non-finite flags."""

from __future__ import annotations

import math

import pytest
import torch

from elsa_vision.kernels import fwd as fwd_module
from tests.helpers import compile_for_sm90
from tests.kernels.test_bwd import LOWP_FACTOR, _lowp_grads, _problem, _reference, _relerr

bwd_sm90 = None
if fwd_module.fwd_sm90 is not None:  # Gluon: the same Triton builds as the forward's
    from elsa_vision.kernels import bwd_sm90

pytestmark = pytest.mark.skipif(bwd_sm90 is None, reason="this Triton has no Gluon")

_COMPILE = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from elsa_vision.kernels import bwd_sm90 as B, fwd_sm90 as F

fn = B.dkdv_kernel
report = []
for D, (bm, stages) in sorted(B.CONFIGS.items()):
    t = torch.empty((2, 3, 512, D), dtype=torch.bfloat16)
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(q_desc=mangle_type(F.descriptor(t, bm)), do_desc=mangle_type(F.descriptor(t, bm)),
               k_desc=mangle_type(F.descriptor(t, 64)), v_desc=mangle_type(F.descriptor(t, 64)),
               Lse="*fp32", Delta="*fp32", DK="*bf16", DV="*bf16", Redo="*i32", qk_scale="fp32",
               sm_scale="fp32")
    consts = dict(D=D, BLOCK_M=bm, STAGES=stages)
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": B.NUM_WARPS})
    ptx = k.asm["ptx"]
    report.append(dict(D=D, bm=bm, shared=k.metadata.shared, wgmma=ptx.count("wgmma.mma_async"),
                       tma=ptx.count("cp.async.bulk.tensor"), setmaxnreg="setmaxnreg" in ptx))
print(json.dumps(report))
"""


def test_compiles_for_sm90_warp_specialised():
    # Built for sm90 on any machine: partitions with their own register budgets, TMA loads (keys and values
    # once per consumer, Q and dO per stage, 256-byte rows at head dim 128 in two boxes), and per consumer
    # the four products of a query tile as wgmma: S^T and dP^T (K = D), dV and dK (K = BLOCK_M), in K-steps
    # of 16; shared memory within the H100's.
    for var in compile_for_sm90(_COMPILE):
        D, bm = var["D"], var["bm"]
        assert var["setmaxnreg"] and 0 < var["shared"] <= 232448, var
        assert var["wgmma"] == 2 * (2 * D // 16 + 2 * bm // 16), var
        assert var["tma"] == (2 + 2 * 2) * (D * 2 // 128), var


# ------------------------------------------------------------------------------------------------- GPU


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm90 GPU")


def _dkdv(q, k, v, do, scale=None):
    """The Hopper pass on the forward's lse and ``Delta = rowsum(O * dO)``, as the backward would run it."""
    from elsa_vision.kernels.fwd import elsa_fwd

    scale = q.shape[-1] ** -0.5 if scale is None else scale
    out, lse = elsa_fwd(q, k, v, scale=scale)
    B, H, Nq, _ = q.shape
    delta = (out.float() * do.float()).sum(-1).reshape(B * H, Nq).contiguous()
    return bwd_sm90.dkdv(q, k, v, do, lse, delta, scale)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("Nq,Nk,D", [(197, 197, 64), (785, 785, 64), (2053, 3137, 64), (1000, 777, 128),
                                     (4096, 4096, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gradients_against_float64(Nq, Nk, D, dtype):
    # within LOWP_FACTOR of the same math in the inputs' precision, as the generic half-precision backward
    B, H = 2, 3
    q, k, v, do, _, _ = _problem(B, H, Nq, Nk, D, D, seed=Nq + Nk + D)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    assert bwd_sm90.supported(q, k, v, do)
    refs, _, _ = _reference(q, k, v, do)
    lowp = _lowp_grads(q, k, v, do)
    dk, dv, flags = _dkdv(q, k, v, do)
    assert dk.dtype == dtype and dv.shape == v.shape and int(flags.sum()) == 0
    assert flags.shape == (B * H, math.ceil(Nk / 64))
    for name, g, r, lp in (("dk", dk, refs[1], lowp[1]), ("dv", dv, refs[2], lowp[2])):
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_strided_views_and_the_generic_backward(D):
    # ViT's views of a fused projection read in place give the contiguous inputs' gradients bitwise, and
    # the generic backward's within half-precision rounding
    from elsa_vision.kernels.bwd import elsa_bwd
    from elsa_vision.kernels.fwd import elsa_fwd

    B, N, H = 2, 1501, 3
    qkv_proj = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv_proj.permute(2, 0, 3, 1, 4).unbind(0)
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    dk, dv, _ = _dkdv(q, k, v, do)
    dk_c, dv_c, _ = _dkdv(q.contiguous(), k.contiguous(), v.contiguous(), do)
    assert torch.equal(dk, dk_c) and torch.equal(dv, dv_c)
    out, lse = elsa_fwd(q, k, v)
    _, gk, gv = elsa_bwd(do, q, k, v, out, lse)[:3]
    for ours, theirs in ((dk, gk), (dv, gv)):
        assert _relerr(ours.float(), theirs.double()) <= 1e-2


@pytest.mark.gpu
@needs_sm90
def test_gpu_nonfinite_values_flag_their_keys():
    # an infinite value in one head makes that head's output, so its Delta and every dK of it, non-finite:
    # each of its 64-key blocks is flagged, none of the other head's, whose gradients stay finite
    B, H, N, D = 1, 2, 1000, 64
    q, k, v, do, _, _ = _problem(B, H, N, N, D, D, seed=7)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    v[0, 1, 300, 5] = math.inf
    dk, dv, flags = _dkdv(q, k, v, do)
    assert int(flags[0].sum()) == 0 and bool((flags[1] == 1).all())
    assert torch.isfinite(dv[0, 0]).all() and torch.isfinite(dk[0, 0]).all()
