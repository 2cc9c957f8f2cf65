"""The Hopper dK/dV pass (``kernels/bwd_sm90.py``, Gluon, routed by ``bwd.HOPPER``): compiled for sm90 on any
machine (its structure in the PTX), its routing rules and the generic kernel's ``REDO`` launch after it (under
the interpreter too), and on an H100 against float64 and the generic backward, odd lengths and strided
views included, and its non-finite flags."""

from __future__ import annotations

import math

import pytest
import torch

from elsa_vision.kernels import bwd as bwd_module
from elsa_vision.kernels import fwd as fwd_module
from elsa_vision.kernels.bwd import bwd_program, elsa_bwd
from elsa_vision.kernels.fwd import elsa_fwd
from tests.helpers import DEVICE, compile_for_sm90
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


def _inputs(B, H, Nq, Nk, D, dtype, seed):
    q, k, v, do, _, _ = _problem(B, H, Nq, Nk, D, D, seed=seed)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    return q, k, v, do, out, lse, delta


def test_routing_rules(monkeypatch):
    # With bwd.HOPPER on, only half-precision dense calls without masks, bias or causality, with equal head
    # dims, default tiles and at least HOPPER_MIN_KEYS keys take the Hopper pass; everything else the
    # generic dK/dV kernel (supported() forced: this machine may have no sm90 GPU)
    monkeypatch.setattr(bwd_sm90, "supported", lambda q, k, v, do: q.dtype != torch.float32)
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    keys = bwd_module.HOPPER_MIN_KEYS
    q, k, v, do, _, _ = _problem(1, 2, 70, keys, 64, 64, seed=1)
    q, k, v, do = (t.half() for t in (q, k, v, do))
    lse = torch.zeros(1, 2, 70, device=DEVICE)

    def hopper(q=q, k=k, v=v, do=do, **kw):
        return bwd_program(do, q, k, v, do, lse, **kw).hopper is not None

    assert hopper()
    assert not hopper(causal=True)
    assert not hopper(attn_bias=torch.zeros(1, 1, 70, keys, dtype=torch.half, device=DEVICE))
    assert not hopper(key_padding_mask=torch.ones(1, keys, dtype=torch.bool, device=DEVICE))
    assert not hopper(compute_dkdv=False)
    assert not hopper(config=bwd_module.bwd_config(torch.half, 64, 64, q.device))
    assert not hopper(k=k[:, :, 1:], v=v[:, :, 1:])  # fewer keys than the minimum
    assert not hopper(q=q.float(), k=k.float(), v=v.float(), do=do.float())
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    assert not hopper()


def test_redo_launch_finishes_exactly_the_flagged_key_tiles(monkeypatch):
    # The generic dK/dV kernel in REDO mode (the second launch of the Hopper pass): the 64-key tiles whose
    # flag is set get the generic gradients, every other key keeps what the Hopper pass wrote. Built as on
    # sm90 (supported() forced) and run by the interpreter on CPU machines, float16.
    monkeypatch.setattr(bwd_sm90, "supported", lambda *a: True)
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_MIN_KEYS", 0)
    B, H, N, D = 1, 2, 150, 64
    q, k, v, do, out, lse, delta = _inputs(B, H, N, N, D, torch.float16, seed=31)
    program = bwd_program(do, q, k, v, out, lse)
    assert program.hopper is not None
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    _, ref_k, ref_v, _ = elsa_bwd(do, q, k, v, out, lse, delta=delta)  # the same Delta: the same bits
    flags = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.int32, device=DEVICE)  # [B * H, cdiv(150, 64)]
    dk = torch.full((B, H, N, D), 7.0, dtype=torch.float16, device=DEVICE)
    dv = torch.full_like(dk, 7.0)
    program.hopper.redo(q, k, v, do, lse, delta, delta, delta, dk, dv, delta, delta, delta, delta, flags)
    for h in range(H):
        for blk in range(3):
            keys = slice(64 * blk, min(N, 64 * blk + 64))
            if flags[h, blk]:
                assert torch.equal(dk[0, h, keys], ref_k[0, h, keys]) and torch.equal(dv[0, h, keys],
                                                                                        ref_v[0, h, keys])
            else:
                assert bool((dk[0, h, keys] == 7.0).all()) and bool((dv[0, h, keys] == 7.0).all())


# ------------------------------------------------------------------------------------------------- GPU


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm90 GPU")


def _hopper_dkdv(q, k, v, do, out, lse, delta, monkeypatch):
    """``(dk, dv, flags)`` of the Hopper pass (and the redo launch after it), as the backward runs it."""
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    program = bwd_program(do, q, k, v, out, lse)
    assert program.hopper is not None
    dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (k, v))
    flags = program.hopper(q, k, v, do, lse, delta, delta, delta, dk, dv)
    return dk, dv, flags


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("Nq,Nk,D", [(1025, 1025, 64), (2053, 3137, 64), (1000, 1777, 128),
                                     (4096, 4096, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_gradients_against_float64(Nq, Nk, D, dtype, monkeypatch):
    # within LOWP_FACTOR of the same math in the inputs' precision, as the generic half-precision backward;
    # finite inputs flag nothing
    B, H = 2, 3
    q, k, v, do, out, lse, delta = _inputs(B, H, Nq, Nk, D, dtype, seed=Nq + Nk + D)
    refs, _, _ = _reference(q, k, v, do)
    lowp = _lowp_grads(q, k, v, do)
    dk, dv, flags = _hopper_dkdv(q, k, v, do, out, lse, delta, monkeypatch)
    assert flags.shape == (B * H, math.ceil(Nk / 64)) and int(flags.sum()) == 0
    for name, g, r, lp in (("dk", dk, refs[1], lowp[1]), ("dv", dv, refs[2], lowp[2])):
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"
    # the whole backward with the pass routed (the same Delta given): dQ unchanged, dK and dV the pass's
    grads = elsa_bwd(do, q, k, v, out, lse, delta=delta)
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    generic = elsa_bwd(do, q, k, v, out, lse, delta=delta)
    assert torch.equal(grads[0], generic[0]) and torch.equal(grads[1], dk) and torch.equal(grads[2], dv)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_strided_views_and_the_generic_backward(D, monkeypatch):
    # ViT's views of a fused projection read in place give the contiguous inputs' gradients bitwise, and
    # the generic backward's within half-precision rounding
    B, N, H = 2, 1501, 3
    qkv_proj = torch.randn(B, N, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k, v = qkv_proj.permute(2, 0, 3, 1, 4).unbind(0)
    do = torch.randn(B, H, N, D, device="cuda", dtype=torch.bfloat16)
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    dk, dv, _ = _hopper_dkdv(q, k, v, do, out, lse, delta, monkeypatch)
    contiguous = (q.contiguous(), k.contiguous(), v.contiguous())
    dk_c, dv_c, _ = _hopper_dkdv(*contiguous, do, out, lse, delta, monkeypatch)
    assert torch.equal(dk, dk_c) and torch.equal(dv, dv_c)
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    _, gk, gv, _ = elsa_bwd(do, q, k, v, out, lse)
    for ours, theirs in ((dk, gk), (dv, gv)):
        assert _relerr(ours.float(), theirs.double()) <= 1e-2


@pytest.mark.gpu
@needs_sm90
def test_gpu_nonfinite_values_flag_their_keys_and_the_redo_keeps_the_reference_rule(monkeypatch):
    # an infinite value in one head makes that head's output, so its Delta and every dK of it, non-finite:
    # each of its 64-key blocks is flagged and redone by the generic kernel, whose gradients they are then;
    # the other head flags nothing
    B, H, N, D = 1, 2, 1100, 64
    q, k, v, do, _, _ = _problem(B, H, N, N, D, D, seed=7)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    v[0, 1, 300, 5] = math.inf
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    dk, dv, flags = _hopper_dkdv(q, k, v, do, out, lse, delta, monkeypatch)
    assert int(flags[0].sum()) == 0 and bool((flags[1] == 1).all())
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    _, gk, gv, _ = elsa_bwd(do, q, k, v, out, lse)
    assert torch.equal(dk[0, 1].isfinite(), gk[0, 1].isfinite()) and torch.equal(dv[0, 1].isfinite(),
                                                                                  gv[0, 1].isfinite())
    assert torch.isfinite(dk[0, 0]).all() and torch.isfinite(dv[0, 0]).all()
