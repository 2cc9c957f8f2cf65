"""The Hopper backward passes (``kernels/bwd_sm90.py``, Gluon: dQ and dK/dV, routed by ``bwd.HOPPER``):
compiled for sm90 on any machine (their structure in the PTX), their routing rules and the generic kernels'
``REDO`` launches after them (under the interpreter too), and on an H100 against float64 and the generic
backward, odd lengths and strided views included, and their non-finite flags."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from elsa_vision.kernels import bwd as bwd_module
from elsa_vision.kernels import fwd as fwd_module
from elsa_vision.kernels.bwd import bwd_program, elsa_bwd
from elsa_vision.kernels.fwd import elsa_fwd
from tests.helpers import DEVICE, compile_for_sm90, fused_qkv_views, randn
from tests.kernels.test_bwd import LOWP_FACTOR, _lowp_grads, _problem, _reference, _relerr

bwd_sm90 = None
if fwd_module.fwd_sm90 is not None:  # Gluon: the same Triton builds as the forward's
    from elsa_vision.kernels import bwd_sm90

pytestmark = pytest.mark.skipif(bwd_sm90 is None, reason="this Triton has no Gluon")

_COMPILE = r"""
import json
import re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from elsa_vision.kernels import bwd_sm90 as B, fwd_sm90 as F
from tests.helpers import spill_stores


def build(fn, descs, consts, **sig_extra):
    # (ptx, facts) of fn compiled for sm90 with these descriptors and constexprs
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({name: mangle_type(d) for name, d in descs.items()})
    sig.update(Lse="*fp32", Delta="*fp32", Redo="*i32", qk_scale="fp32", sm_scale="fp32", **sig_extra)
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": B.NUM_WARPS})
    ptx = k.asm["ptx"]
    return ptx, dict(D=consts["D"], bs=consts["BLOCK_S"], shared=k.metadata.shared, spills=spill_stores(k),
                     wgmma=ptx.count("wgmma.mma_async"), setmaxnreg="setmaxnreg" in ptx)


report = []
# the two passes: the defaults, and the shorter streamed tiles the tuning times too
for dq in (False, True):
    for D, bs, stages in sorted({(D, *c) for D, c in B.CONFIGS.items()} | {(64, 64, 2), (128, 32, 2)}):
        t = torch.empty((2, 3, 512, D), dtype=torch.bfloat16)
        ptx, facts = build(B.bwd_kernel, dict(r1_desc=F.descriptor(t, 64), r2_desc=F.descriptor(t, 64),
                                              s1_desc=F.descriptor(t, bs), s2_desc=F.descriptor(t, bs)),
                           dict(D=D, BLOCK_S=bs, STAGES=stages, DQ=dq), Out1="*bf16", Out2="*bf16")
        report.append(dict(facts, kernel="passes", dq=dq,
                           partial_waits=len(re.findall(r"wgmma.wait_group.sync.aligned [1-9]", ptx)),
                           tma=ptx.count("cp.async.bulk.tensor"), local=".local" in ptx))
# the five-product kernel: the defaults (64 streamed rows: one dQ slice a tile, the consumers taking turns)
# and 128 rows (two slices, one per consumer)
for D, bs, stages in sorted({(D, *c) for D, c in B.FUSED_CONFIGS.items()} | {(64, 128, 2), (128, 64, 2)}):
    t = torch.empty((2, 3, 512, D), dtype=torch.bfloat16)
    acc = torch.empty((2, 3, 512, D), dtype=torch.float32)
    ptx, facts = build(B.bwd_fused_kernel, dict(k_desc=F.descriptor(t, 64), v_desc=F.descriptor(t, 64),
                                                q_desc=F.descriptor(t, bs), do_desc=F.descriptor(t, bs),
                                                dq_desc=F.descriptor(acc, 64)),
                       dict(D=D, BLOCK_S=bs, STAGES=stages), DK="*bf16", DV="*bf16")
    report.append(dict(facts, kernel="fused",
                       reduce=ptx.count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add"),
                       named=sorted(set(re.findall(r"bar.sync\s+(\d+), 128;", ptx)))))
# the FP32-accurate five-product kernel: float16 parts (high, low) of float32 operands
for D, (bs, stages) in sorted(B.FUSED_SPLIT_CONFIGS.items()):
    parts = torch.empty((2, 6, 512, D), dtype=torch.float16)
    acc = torch.empty((2, 3, 512, D), dtype=torch.float32)
    ptx, facts = build(B.bwd_fused_f16x3_kernel, dict(k_desc=F.descriptor(parts, 64),
                                                      v_desc=F.descriptor(parts, 64),
                                                      q_desc=F.descriptor(parts, bs),
                                                      do_desc=F.descriptor(parts, bs),
                                                      dq_desc=F.descriptor(acc, 64)),
                       dict(D=D, BLOCK_S=bs, STAGES=stages), DK="*fp32", DV="*fp32", KE="*i32", VE="*i32",
                       QE="*i32", DOE="*i32")
    report.append(dict(facts, kernel="split", tma=ptx.count("cp.async.bulk.tensor"),
                       reduce=ptx.count("cp.reduce.async.bulk.tensor.4d.global.shared::cta.add"),
                       f16=len(re.findall(r"wgmma.mma_async.sync.aligned.m64n\d+k16.f32.f16.f16", ptx))))
print(json.dumps(report))
"""


def _compiled(kernel: str) -> list:
    """The compile report's entries of ``kernel`` (``"passes"`` or ``"fused"``), compiled once per process."""
    return [var for var in _compile_report() if var["kernel"] == kernel]


@functools.cache
def _compile_report() -> tuple:
    return tuple(compile_for_sm90(_COMPILE))


def test_compiles_for_sm90_warp_specialised():
    # Built for sm90 on any machine, both passes, default and shorter streamed tiles: partitions with their
    # own register budgets, TMA loads (the resident pair once per consumer, the streamed pair per stage,
    # 256-byte rows at head dim 128 in two boxes), and per consumer the products of a streamed tile as wgmma
    # in K-steps of 16: the two score-sized ones (K = D), then dV and dK (dK/dV) or dQ (dQ) with K = BLOCK_S,
    # none left in flight (no partial wait). Shared memory within the H100's; no spills in the dQ pass (the
    # dK/dV pass's are in the kernel notes).
    variants = _compiled("passes")
    assert len(variants) == 2 * (len(bwd_sm90.CONFIGS) + 2)
    for var in variants:
        D, bs = var["D"], var["bs"]
        assert var["setmaxnreg"] and 0 < var["shared"] <= 232448, var
        assert var["wgmma"] == 2 * (2 * D // 16 + (1 if var["dq"] else 2) * bs // 16), var
        assert var["partial_waits"] == 0, var
        assert var["tma"] == (2 + 2 * 2) * (D * 2 // 128), var
        assert not (var["dq"] and var["local"]), var
        assert not var["dq"] or var["spills"] in (None, 0), var


def test_five_product_kernel_compiles_for_sm90():
    # Built for sm90 on any machine: per consumer and streamed tile the four products of the dK/dV pass
    # (K-steps of 16), then the dQ slices it owns -- each over both consumers' 64 keys, so 2 * 64 / 16
    # K-steps -- as wgmma, and one TMA reduce-add per slice; both consumers' partitions synchronise their own
    # 128 threads (named barriers) around the shared dS^T and dQ tiles; shared memory within the H100's
    variants = _compiled("fused")
    assert {(v["D"], v["bs"]) for v in variants} >= {(64, 64), (64, 128), (128, 64)}
    for var in variants:
        D, bs = var["D"], var["bs"]
        slices = bs // 64
        assert var["setmaxnreg"] and 0 < var["shared"] <= 232448, var
        assert var["wgmma"] == 2 * (2 * D // 16 + 2 * bs // 16 + slices * 2 * 64 // 16), var
        assert var["reduce"] == 2 * slices, var
        assert len(var["named"]) >= 2, var


def test_fp32_five_product_kernel_compiles_for_sm90():
    # Built for sm90 on any machine: per consumer and streamed tile the five products, each as three float16
    # wgmma (hi lo, lo hi, hi hi) in K-steps of 16 -- S^T and dP^T over the head dim, dV and dK over the
    # streamed queries, the consumer's own part of dQ over its 64 keys --, one TMA reduce-add per consumer,
    # both parts of K, V (once) and Q, dO (per stage) by TMA; shared memory within the H100's
    variants = _compiled("split")
    assert {v["D"] for v in variants} == set(bwd_sm90.FUSED_SPLIT_CONFIGS)
    for var in variants:
        D, bs = var["D"], var["bs"]
        assert var["setmaxnreg"] and 0 < var["shared"] <= 232448, var
        assert var["wgmma"] == var["f16"] == 2 * 3 * (2 * D // 16 + 2 * bs // 16 + 64 // 16), var
        assert var["reduce"] == 2, var
        assert var["tma"] == 2 * 2 * 2 + 2 * 2, var


def _inputs(B, H, Nq, Nk, D, dtype, seed):
    q, k, v, do, _, _ = _problem(B, H, Nq, Nk, D, D, seed=seed)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    return q, k, v, do, out, lse, delta


def test_routing_rules(monkeypatch):
    # With bwd.HOPPER on, only half-precision dense calls without masks, bias or causality, with equal head
    # dims, default tiles and at least HOPPER_MIN_KEYS[head dim] keys take the Hopper passes (both, or the one
    # asked for); everything else the generic kernels (supported() forced: this machine may have no sm90 GPU)
    monkeypatch.setattr(bwd_sm90, "supported", lambda q, k, v, do: q.dtype != torch.float32)
    monkeypatch.setattr(bwd_sm90, "supported_split", lambda q, k, v, do: False)  # float32: its own test
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    keys = bwd_module.HOPPER_MIN_KEYS[64]
    q, k, v, do, _, _ = _problem(1, 2, 70, keys, 64, 64, seed=1)
    q, k, v, do = (t.half() for t in (q, k, v, do))
    lse = torch.zeros(1, 2, 70, device=DEVICE)

    def hopper(q=q, k=k, v=v, do=do, **kw):
        program = bwd_program(do, q, k, v, do, lse, **kw)
        routed = (program.hopper_dq is not None, program.hopper_dkdv is not None)
        assert routed[0] == routed[1] or not (program.compute_dq and program.compute_dkdv)
        fused = program.hopper_fused is not None
        assert not (fused and any(routed))
        assert fused == (program.acc_size is not None)
        return "fused" if fused else any(routed)

    # both gradients at head dim 64: the five-product backward, whose dQ sum the Delta pass zeroes
    assert hopper() == "fused"
    assert bwd_program(do, q, k, v, do, lse).pre.options["ZERO_ACC"]
    assert hopper(given_delta=True) == "fused"
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", False)
    assert hopper() is True
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert hopper() is True  # bitwise reruns asked for: the two passes
    finally:
        torch.use_deterministic_algorithms(was)
    program = bwd_program(do, q, k, v, do, lse, compute_dkdv=False)
    assert program.hopper_dq is not None and program.hopper_dkdv is None and program.pre is not None
    assert not program.write_delta  # the Hopper dQ pass reads Delta from the pass before it
    assert not hopper(causal=True)
    assert not hopper(attn_bias=torch.zeros(1, 1, 70, keys, dtype=torch.half, device=DEVICE))
    assert not hopper(key_padding_mask=torch.ones(1, keys, dtype=torch.bool, device=DEVICE))
    assert not hopper(compute_dq=False, compute_dkdv=False)
    assert not hopper(config=bwd_module.bwd_config(torch.half, 64, 64, q.device))
    assert not hopper(k=k[:, :, 1:], v=v[:, :, 1:])  # fewer keys than the minimum
    assert not hopper(q=q.float(), k=k.float(), v=v.float(), do=do.float())
    # head dim 128 from fewer keys (the Hopper passes win there from ViT lengths on)
    short = bwd_module.HOPPER_MIN_KEYS[128]
    assert short < keys
    q2, k2, v2, do2 = (t.half() for t in _problem(1, 2, 70, short, 128, 128, seed=2)[:4])
    assert hopper(q=q2, k=k2, v=v2, do=do2) == "fused"
    monkeypatch.delitem(bwd_sm90.FUSED_CONFIGS, 128)
    bwd_module._PROGRAMS.clear()  # planned programs keep their routing
    assert hopper(q=q2, k=k2, v=v2, do=do2) is True  # no five-product config: the two passes
    assert not hopper(q=q2, k=k2[:, :, 1:], v=v2[:, :, 1:], do=do2)
    assert not hopper(k=k[:, :, :short], v=v[:, :, :short])  # head dim 64 keeps its own minimum
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    assert not hopper()


def test_float32_routing_rules(monkeypatch):
    # float32 calls at the fp16x3 precision wanting all three gradients, dense, with a head dim of
    # FUSED_SPLIT_CONFIGS and a grid of 128-key programs filling the multiprocessors HOPPER_SPLIT_MIN_WAVES
    # times take the FP32-accurate five-product kernel on operands split in its tiles (K, V in the consumers'
    # 64 keys, Q, dO in its streamed rows); every other float32 call the generic kernels (supported_split()
    # forced: this machine may have no sm90 GPU; the CPU counts as 4 multiprocessors)
    monkeypatch.setattr(bwd_sm90, "supported_split", lambda q, k, v, do: q.dtype == torch.float32)
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", True)
    sms = bwd_module.device_info(DEVICE)[0]
    keys = 128 * sms // 2 - 1  # two heads of as many 128-key programs as there are multiprocessors
    q, k, v, do = (t.float() for t in _problem(1, 2, 70, keys, 64, 64, seed=3)[:4])
    lse = torch.zeros(1, 2, 70, device=DEVICE)

    def split(q=q, k=k, v=v, do=do, precision="fp16x3", **kw):
        program = bwd_program(do, q, k, v, do, lse, precision=precision, **kw)
        assert program.hopper_dq is None and program.hopper_dkdv is None  # no float32 Hopper passes
        if program.hopper_fused is None:
            assert program.acc_size is None
            return False
        assert program.hopper_fused.split and program.dq is None and program.dkdv is None
        return True

    assert split()
    program = bwd_program(do, q, k, v, do, lse, precision="fp16x3")
    assert program.pre.options["ZERO_ACC"] and program.acc_size == tuple(q.shape)
    bs = bwd_sm90.FUSED_SPLIT_CONFIGS[64][0]
    assert program.split_kv[0].options["BLOCK"] == 64 and program.split_kv[1][2] == (2, math.ceil(keys / 64))
    assert program.split_qdo[0].options["BLOCK"] == bs and program.split_qdo[1][2] == (2, math.ceil(70 / bs))
    assert split(given_delta=True)
    assert not split(precision="tf32x3") and not split(precision="ieee")
    assert not split(causal=True)
    assert not split(attn_bias=torch.zeros(1, 1, 70, keys, device=DEVICE))
    assert not split(key_padding_mask=torch.ones(1, keys, dtype=torch.bool, device=DEVICE))
    assert not split(compute_dkdv=False) and not split(compute_dq=False)
    assert not split(config=bwd_module.bwd_config(torch.float32, 64, 64, q.device, "fp16x3"))
    assert not split(k=k[:, :, :-128], v=v[:, :, :-128])  # one 128-key program per head fewer than SMs
    q2, k2, v2, do2 = (t.float() for t in _problem(1, 2, 70, keys, 128, 128, seed=4)[:4])
    assert not split(q=q2, k=k2, v=v2, do=do2)  # no config at head dim 128
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert not split()  # bitwise reruns asked for: the generic kernels
    finally:
        torch.use_deterministic_algorithms(was)
    monkeypatch.setattr(bwd_module, "PRESPLIT", False)
    bwd_module._PROGRAMS.clear()  # planned programs keep their routing
    assert not split()
    monkeypatch.setattr(bwd_module, "PRESPLIT", True)
    bwd_module._PROGRAMS.clear()
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", False)
    assert not split()
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", True)
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    assert not split()


def _plan_as_on_sm90(monkeypatch, fused):
    """Backward programs planned as on sm90 from any length (supported() forced: this machine may have no
    sm90 GPU), with (``fused``) or without the five-product backward."""
    monkeypatch.setattr(bwd_sm90, "supported", lambda *a: True)
    monkeypatch.setattr(bwd_sm90, "supported_split", lambda *a: True)
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", fused)
    monkeypatch.setattr(bwd_module, "HOPPER_MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(bwd_module, "HOPPER_SPLIT_MIN_WAVES", 0)


@pytest.mark.parametrize("fused,dtype", [(False, torch.float16), (True, torch.float16),
                                         (True, torch.float32)])
def test_redo_launches_finish_exactly_the_flagged_tiles(fused, dtype, monkeypatch):
    # The generic kernels in REDO mode (the second launch of each Hopper pass, or the five-product
    # backward's last two; float32: the FP32-accurate five-product kernel's, at fp16x3): the 64-row tiles
    # whose flag is set (queries for dQ, keys for dK/dV) get the generic gradients, every other row keeps
    # what the Hopper pass wrote. Built as on sm90 and run by the interpreter on CPU machines.
    _plan_as_on_sm90(monkeypatch, fused)
    B, H, N, D = 1, 2, 150, 64
    q, k, v, do, out, lse, delta = _inputs(B, H, N, N, D, dtype, seed=31)
    program = bwd_program(do, q, k, v, out, lse, given_delta=True, precision="fp16x3")
    if fused:
        assert program.hopper_fused.split == (dtype == torch.float32)
        redo_dq, redo_dkdv = program.hopper_fused.redo_dq, program.hopper_fused.redo_dkdv
    else:
        redo_dq, redo_dkdv = program.hopper_dq.redo, program.hopper_dkdv.redo
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    # the same Delta: the same bits (float32: the redo splits the operands in its loop, the full backward
    # once beforehand: bitwise under the interpreter, within a float32 rounding compiled)
    refs = elsa_bwd(do, q, k, v, out, lse, delta=delta, precision="fp16x3")[:3]
    flags = torch.tensor([[1, 0, 1], [0, 1, 0]], dtype=torch.int32, device=DEVICE)  # [B * H, cdiv(150, 64)]
    grads = [torch.full((B, H, N, D), 7.0, dtype=dtype, device=DEVICE) for _ in range(3)]
    dq, dk, dv = grads
    redo_dq(q, k, v, do, out, lse, delta, delta, delta, dq, delta, delta, delta, delta, flags)
    redo_dkdv(q, k, v, do, lse, delta, delta, delta, dk, dv, delta, delta, delta, delta, flags)
    for g, ref in zip(grads, refs):
        for h in range(H):
            for blk in range(3):
                rows = slice(64 * blk, min(N, 64 * blk + 64))
                if flags[h, blk] and (dtype != torch.float32 or DEVICE == "cpu"):
                    assert torch.equal(g[0, h, rows], ref[0, h, rows])
                elif flags[h, blk]:
                    assert _relerr(g[0, h, rows], ref[0, h, rows].double()) <= 5e-7
                else:
                    assert bool((g[0, h, rows] == 7.0).all())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_delta_pass_zeroes_the_dq_sum_and_the_conversion_flags_nonfinite_rows(dtype, monkeypatch):
    # The five-product backward's launches around its kernel, as planned on sm90 (the interpreter on CPU
    # machines): the Delta pass writes rowsum(O * dO) and zeroes the float32 dQ sum (a
    # NaN-filled buffer comes out zero); the conversion writes scale * sum in the gradient's dtype and flags
    # exactly the 64-row tiles holding a NaN or an infinity (Nq = 150: a partial last tile)
    _plan_as_on_sm90(monkeypatch, fused=True)
    B, H, N, D = 1, 2, 150, 64
    q, k, v, do, out, lse, delta = _inputs(B, H, N, N, D, dtype, seed=37)
    program = bwd_program(do, q, k, v, out, lse)
    fused = program.hopper_fused
    assert fused is not None and program.pre is not None and program.acc_size == (B, H, N, D)
    acc = torch.full(program.acc_size, math.nan, dtype=torch.float32, device=DEVICE)
    got = torch.full((B, H, N), math.nan, dtype=torch.float32, device=DEVICE)
    program.pre(out, do, got, acc)
    assert torch.equal(acc, torch.zeros_like(acc))
    assert torch.allclose(got, delta, rtol=1e-5, atol=1e-5)
    acc = randn(B, H, N, D, seed=38)
    acc[0, 0, 130, 3] = math.inf  # tile 2 of head 0
    acc[0, 1, 10, 0] = math.nan  # tile 0 of head 1
    dq = torch.empty(B, H, N, D, dtype=dtype, device=DEVICE)
    flags = torch.full((B * H, 3), -1, dtype=torch.int32, device=DEVICE)
    fused.convert(acc, dq, flags)
    scale = D ** -0.5
    # bit for bit, but bfloat16 under the interpreter within one rounding step (its conversion rounds
    # differently from torch's)
    step = 2.0 ** -7 if dtype == torch.bfloat16 and DEVICE == "cpu" else 0.0
    torch.testing.assert_close(dq, (acc * scale).to(dtype), rtol=step, atol=0, equal_nan=True)
    assert flags.tolist() == [[0, 0, 1], [1, 0, 0]]


# ------------------------------------------------------------------------------------------------- GPU


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm90 GPU")


def _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused=False):
    """``(dq, dk, dv, dq_flags, dkdv_flags)`` of the Hopper passes (and their redo launches), or with
    ``fused`` of the five-product backward (its dQ sum, conversion and redo launches), as the backward runs
    them on the given ``Delta``."""
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", fused)
    program = bwd_program(do, q, k, v, out, lse, given_delta=True)
    if fused:
        assert program.hopper_fused is not None and program.hopper_dq is None and program.hopper_dkdv is None
    else:
        assert program.hopper_dq is not None and program.hopper_dkdv is not None
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    fq, fk = program.run_hopper(do, q, k, v, out, lse, delta, dq, dk, dv)
    return dq, dk, dv, fq, fk


# Summed over key programs by TMA reduce-add in float32 (in no fixed order), the five-product backward's dQ
# may differ from another run's, or the two passes', in the last bit of a few float32 sums, so by a rounding
# step of the half-precision result in a few entries: within this of each other.
FUSED_DQ_RERUN = 1e-3


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("Nq,Nk,D", [(1025, 1025, 64), (2053, 3137, 64), (197, 197, 128), (785, 785, 128),
                                     (1000, 1777, 128), (4096, 4096, 128)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_gradients_against_float64(Nq, Nk, D, dtype, fused, monkeypatch):
    # within LOWP_FACTOR of the same math in the inputs' precision, as the generic half-precision backward;
    # finite inputs flag nothing; the routed backward gives the passes' gradients (dK, dV bit for bit; the
    # five-product dQ within FUSED_DQ_RERUN: summed in no fixed order)
    B, H = 2, 3
    q, k, v, do, out, lse, delta = _inputs(B, H, Nq, Nk, D, dtype, seed=Nq + Nk + D)
    refs, _, _ = _reference(q, k, v, do)
    lowp = _lowp_grads(q, k, v, do)
    dq, dk, dv, fq, fk = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused)
    assert fq.shape == (B * H, math.ceil(Nq / 64)) and fk.shape == (B * H, math.ceil(Nk / 64))
    assert int(fq.sum()) == 0 and int(fk.sum()) == 0
    for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, lowp):
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"
    grads = elsa_bwd(do, q, k, v, out, lse, delta=delta)  # routed (HOPPER still on), the same Delta
    assert torch.equal(grads[1], dk) and torch.equal(grads[2], dv)
    assert torch.equal(grads[0], dq) if not fused else _relerr(grads[0], dq.double()) <= FUSED_DQ_RERUN
    grads = elsa_bwd(do, q, k, v, out, lse)  # routed, Delta formed by the backward's own pass
    assert all(_relerr(a, b.double()) <= 1e-2 for a, b in zip(grads[:3], (dq, dk, dv)))
    if fused:  # against the two passes
        two = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused=False)
        assert torch.equal(two[1], dk) and torch.equal(two[2], dv)
        assert _relerr(dq, two[0].double()) <= FUSED_DQ_RERUN


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_strided_views_and_the_generic_backward(D, fused, monkeypatch):
    # ViT's views of a fused projection read in place give the contiguous inputs' gradients bitwise (the
    # five-product dQ within FUSED_DQ_RERUN), and the generic backward's within half-precision rounding
    B, N, H = 2, 1501, 3
    q, k, v = fused_qkv_views(B, N, H, D, seed=D, dtype=torch.bfloat16)
    do = randn(B, H, N, D, seed=D + 1, dtype=torch.bfloat16)
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    ours = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused)[:3]
    contiguous = _hopper(q.contiguous(), k.contiguous(), v.contiguous(), do, out, lse, delta, monkeypatch,
                         fused)[:3]
    _assert_same(ours, contiguous, fused)
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    generic = elsa_bwd(do, q, k, v, out, lse, delta=delta)[:3]
    assert all(_relerr(a.float(), b.double()) <= 1e-2 for a, b in zip(ours, generic))


def _assert_same(ours, theirs, fused):
    """dQ, dK, dV of two runs: bit for bit, but the five-product dQ within ``FUSED_DQ_RERUN``."""
    assert torch.equal(ours[1], theirs[1]) and torch.equal(ours[2], theirs[2])
    if fused:
        assert _relerr(ours[0], theirs[0].double()) <= FUSED_DQ_RERUN
    else:
        assert torch.equal(ours[0], theirs[0])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_nonfinite_values_flag_their_rows_and_the_redo_keeps_the_reference_rule(fused, monkeypatch):
    # an infinite value in one head makes that head's output, so its Delta and its dQ and dK, non-finite:
    # each of its 64-row blocks is flagged and redone by the generic kernels, whose gradients they then are
    # (the same finite entries); the other head flags nothing and stays finite
    B, H, N, D = 1, 2, 1100, 64
    q, k, v, do, _, _ = _problem(B, H, N, N, D, D, seed=7)
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    v[0, 1, 300, 5] = math.inf
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    dq, dk, dv, fq, fk = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused)
    for flags in (fq, fk):
        assert int(flags[0].sum()) == 0 and bool((flags[1] == 1).all())
    monkeypatch.setattr(bwd_module, "HOPPER", False)
    generic = elsa_bwd(do, q, k, v, out, lse, delta=delta)[:3]
    for ours, theirs in zip((dq, dk, dv), generic):
        assert torch.equal(ours[0, 1].isfinite(), theirs[0, 1].isfinite())
        assert torch.isfinite(ours[0, 0]).all()


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_nan_poisoned_storage_past_the_rows_and_reruns(D, fused, monkeypatch):
    # rows past N of a view's storage hold NaN: TMA reads the view's own rows only (zeros past N), so the
    # gradients equal the clean contiguous run's bit for bit; reruns are bitwise equal too (the five-product
    # dQ within FUSED_DQ_RERUN, and finite)
    B, H, N = 1, 2, 1100
    q, k, v, do, out, lse, delta = _inputs(B, H, N, N, D, torch.bfloat16, seed=D + 3)
    poisoned = []
    for t in (q, k, v, do):
        big = torch.full((B, H, N + 77, D), math.nan, dtype=t.dtype, device=t.device)
        big[:, :, :N] = t
        poisoned.append(big[:, :, :N])
    clean = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused)
    dirty = _hopper(*poisoned, out, lse, delta, monkeypatch, fused)
    assert int(dirty[3].sum()) == 0 and int(dirty[4].sum()) == 0 and bool(dirty[0].isfinite().all())
    _assert_same(clean, dirty, fused)
    for _ in range(3):
        again = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused)
        _assert_same(again, clean, fused)


@pytest.mark.gpu
@needs_sm90
def test_gpu_deterministic_algorithms_take_the_two_passes(monkeypatch):
    # under torch.use_deterministic_algorithms(True) a head-dim-64 backward takes the two passes (one owner
    # per gradient element): reruns bitwise equal; without it, the five-product backward
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", True)
    q, k, v, do, out, lse, _ = _inputs(1, 2, 1300, 1100, 64, torch.bfloat16, seed=45)
    assert bwd_program(do, q, k, v, out, lse).hopper_fused is not None
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        program = bwd_program(do, q, k, v, out, lse)
        assert program.hopper_fused is None and program.hopper_dq is not None
        first = elsa_bwd(do, q, k, v, out, lse)[:3]
        for _ in range(3):
            assert all(torch.equal(a, b) for a, b in zip(elsa_bwd(do, q, k, v, out, lse)[:3], first))
    finally:
        torch.use_deterministic_algorithms(was)


@pytest.mark.gpu
@needs_sm90
def test_gpu_one_sided_calls_as_ring_attention_makes_them(monkeypatch):
    # context parallelism's pieces: Delta given (out not read), one pass per call, lse a strided view of a
    # wider buffer; each Hopper pass alone gives the two-pass full call's gradients bit for bit
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", False)
    B, H, Nq, Nk, D = 1, 2, 1300, 1100, 64
    q, k, v, do, out, lse, delta = _inputs(B, H, Nq, Nk, D, torch.bfloat16, seed=41)
    wide = torch.full((B, H, Nq + 9), math.nan, dtype=torch.float32, device=q.device)
    wide[..., :Nq] = lse
    lse_view = wide[..., :Nq]
    full = elsa_bwd(do, q, k, v, out, lse, delta=delta)[:3]
    dq_only = elsa_bwd(do, q, k, v, None, lse_view, delta=delta, compute_dkdv=False)
    dkdv_only = elsa_bwd(do, q, k, v, None, lse_view, delta=delta, compute_dq=False)
    program = bwd_program(do, q, k, v, None, lse_view, given_delta=True, compute_dkdv=False)
    assert program.hopper_dq is not None
    assert dq_only[1] is None and dkdv_only[0] is None
    assert torch.equal(dq_only[0], full[0])
    assert torch.equal(dkdv_only[1], full[1]) and torch.equal(dkdv_only[2], full[2])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("fused", [False, True])
def test_gpu_huge_logits_stay_finite_and_accurate(fused, monkeypatch):
    # q and k scaled by 6: logits with a spread of about 36 and maxima near 150 (rows close to one-hot) give
    # finite gradients within LOWP_FACTOR of the same math in bfloat16, and nothing flagged
    B, H, N, D = 1, 2, 1536, 64
    q, k, v, do, _, _ = _problem(B, H, N, N, D, D, seed=43)
    q, k = q * 6, k * 6
    q, k, v, do = (t.to(torch.bfloat16) for t in (q, k, v, do))
    out, lse = elsa_fwd(q, k, v)
    delta = (out.float() * do.float()).sum(-1).contiguous()
    refs, _, _ = _reference(q, k, v, do)
    lowp = _lowp_grads(q, k, v, do)
    dq, dk, dv, fq, fk = _hopper(q, k, v, do, out, lse, delta, monkeypatch, fused)
    assert int(fq.sum()) == 0 and int(fk.sum()) == 0
    for name, g, r, lp in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, lowp):
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"


# ---- the FP32-accurate five-product kernel (float32 inputs at fp16x3) ------------------------------------

# The generic fp16x3 backward measures 5e-7 to 8e-7 against float64 at these sizes (H100); the bound of
# test_bwd's float32 default past 1,024 keys.
FP32_FUSED = 2e-6
# dQ summed over key programs in float32 in no fixed order: reruns differ by float32 roundings of the sum.
FP32_DQ_RERUN = 1e-6


def _split_backward(q, k, v, do, out, lse, delta, monkeypatch, split=True):
    """``(dq, dk, dv, dq_flags, dkdv_flags)`` of the FP32-accurate five-product backward (``split``; its
    split pass, dQ sum, conversion and redo launches), or of the generic fp16x3 kernels, on the given
    ``Delta``."""
    monkeypatch.setattr(bwd_module, "HOPPER", split)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", split)
    monkeypatch.setattr(bwd_module, "HOPPER_SPLIT_MIN_WAVES", 0)  # any grid (its rule: the routing test)
    program = bwd_program(do, q, k, v, out, lse, given_delta=True, precision="fp16x3")
    if not split:
        assert program.hopper_fused is None
        return (*elsa_bwd(do, q, k, v, out, lse, delta=delta, precision="fp16x3")[:3], None, None)
    assert program.hopper_fused is not None and program.hopper_fused.split
    dq, dk, dv = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q, k, v))
    fq, fk = program.run_hopper(do, q, k, v, out, lse, delta, dq, dk, dv)
    return dq, dk, dv, fq, fk


def _fp32_inputs(B, H, Nq, Nk, seed, scale=1.0):
    q, k, v, do, _, _ = _problem(B, H, Nq, Nk, 64, 64, seed=seed)
    q, k, v, do = (t.float() for t in (q * scale, k * scale, v, do))
    out, lse = elsa_fwd(q, k, v, precision="fp16x3")
    delta = (out * do).sum(-1).contiguous()
    return q, k, v, do, out, lse, delta


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,H,Nq,Nk", [(2, 3, 1025, 1025), (1, 2, 2053, 3137), (2, 2, 1000, 1777),
                                       (1, 4, 4096, 4096), (16, 12, 197, 197), (8, 12, 785, 785)])
def test_gpu_fp32_five_product_against_float64(B, H, Nq, Nk, monkeypatch):
    # FP32-accurate (within FP32_FUSED of float64, as the generic fp16x3 kernels, and within 2x their error),
    # finite inputs flag nothing; the routed backward (its own Delta pass) gives the same gradients
    q, k, v, do, out, lse, delta = _fp32_inputs(B, H, Nq, Nk, seed=Nq + Nk)
    refs, _, _ = _reference(q, k, v, do)
    dq, dk, dv, fq, fk = _split_backward(q, k, v, do, out, lse, delta, monkeypatch)
    assert int(fq.sum()) == 0 and int(fk.sum()) == 0
    generic = _split_backward(q, k, v, do, out, lse, delta, monkeypatch, split=False)
    for name, g, r, gen in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, generic):
        err, err_gen = _relerr(g, r), _relerr(gen, r)
        assert err <= FP32_FUSED, f"{name}: {err:.3e} > {FP32_FUSED}"
        assert err <= 2 * err_gen, f"{name}: {err:.3e} > 2 x the generic kernels' {err_gen:.3e}"
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", True)
    grads = elsa_bwd(do, q, k, v, out, lse, delta=delta, precision="fp16x3")[:3]  # routed, the same Delta
    assert torch.equal(grads[1], dk) and torch.equal(grads[2], dv)
    assert _relerr(grads[0], dq.double()) <= FP32_DQ_RERUN
    grads = elsa_bwd(do, q, k, v, out, lse, precision="fp16x3")[:3]  # Delta from the backward's own pass
    assert all(_relerr(a, b.double()) <= FP32_DQ_RERUN for a, b in zip(grads, (dq, dk, dv)))


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp32_five_product_views_poisoned_storage_and_reruns(monkeypatch):
    # ViT's views of a fused projection, and views whose storage holds NaN past their rows, give the
    # contiguous inputs' gradients (the split pass reads each view's own rows); reruns: dK, dV bit for bit,
    # dQ within FP32_DQ_RERUN
    B, N, H = 2, 1501, 3
    q, k, v = fused_qkv_views(B, N, H, 64, seed=5)
    do = randn(B, H, N, 64, seed=6)
    out, lse = elsa_fwd(q, k, v, precision="fp16x3")
    delta = (out * do).sum(-1).contiguous()
    clean = _split_backward(q.contiguous(), k.contiguous(), v.contiguous(), do, out, lse, delta, monkeypatch)
    views = _split_backward(q, k, v, do, out, lse, delta, monkeypatch)
    poisoned = []
    for t in (q, k, v, do):
        big = torch.full((B, H, N + 77, 64), math.nan, device=t.device)
        big[:, :, :N] = t
        poisoned.append(big[:, :, :N])
    dirty = _split_backward(*poisoned, out, lse, delta, monkeypatch)
    for run in (views, dirty, _split_backward(q, k, v, do, out, lse, delta, monkeypatch)):
        assert int(run[3].sum()) == 0 and int(run[4].sum()) == 0
        assert torch.equal(run[1], clean[1]) and torch.equal(run[2], clean[2])
        assert _relerr(run[0], clean[0].double()) <= FP32_DQ_RERUN


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp32_five_product_nonfinite_values_and_huge_logits(monkeypatch):
    # an infinite value in one head: that head's 64-row blocks are flagged and redone by the generic
    # kernels (the same finite entries as theirs), the other head flags nothing and stays finite; q, k
    # scaled by 6 (logits near 150, rows close to one-hot): finite, FP32-accurate, nothing flagged
    B, H, N = 1, 2, 1100
    q, k, v, do, _, _, _ = _fp32_inputs(B, H, N, N, seed=7)
    v[0, 1, 300, 5] = math.inf
    out, lse = elsa_fwd(q, k, v, precision="fp16x3")
    delta = (out * do).sum(-1).contiguous()
    dq, dk, dv, fq, fk = _split_backward(q, k, v, do, out, lse, delta, monkeypatch)
    for flags in (fq, fk):
        assert int(flags[0].sum()) == 0 and bool((flags[1] == 1).all())
    generic = _split_backward(q, k, v, do, out, lse, delta, monkeypatch, split=False)[:3]
    for ours, theirs in zip((dq, dk, dv), generic):
        assert torch.equal(ours[0, 1].isfinite(), theirs[0, 1].isfinite())
        assert torch.isfinite(ours[0, 0]).all()
    q, k, v, do, out, lse, delta = _fp32_inputs(B, H, 1536, 1536, seed=43, scale=6.0)
    refs, _, _ = _reference(q, k, v, do)
    dq, dk, dv, fq, fk = _split_backward(q, k, v, do, out, lse, delta, monkeypatch)
    assert int(fq.sum()) == 0 and int(fk.sum()) == 0
    generic = _split_backward(q, k, v, do, out, lse, delta, monkeypatch, split=False)[:3]
    for name, g, r, gen in zip(("dq", "dk", "dv"), (dq, dk, dv), refs, generic):
        err, err_gen = _relerr(g, r), _relerr(gen, r)
        assert err <= 2 * max(err_gen, FP32_FUSED / 4), f"{name}: {err:.3e} against the generic {err_gen:.3e}"


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp32_deterministic_algorithms_take_the_generic_kernels(monkeypatch):
    # under torch.use_deterministic_algorithms(True) the float32 backward keeps one owner per gradient
    # element (the generic fp16x3 kernels): reruns bitwise equal
    monkeypatch.setattr(bwd_module, "HOPPER", True)
    monkeypatch.setattr(bwd_module, "HOPPER_FUSED", True)
    monkeypatch.setattr(bwd_module, "HOPPER_SPLIT_MIN_WAVES", 0)
    q, k, v, do, out, lse, _ = _fp32_inputs(1, 2, 1300, 1100, seed=45)
    assert bwd_program(do, q, k, v, out, lse).hopper_fused is not None
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert bwd_program(do, q, k, v, out, lse).hopper_fused is None
        first = elsa_bwd(do, q, k, v, out, lse)[:3]
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(elsa_bwd(do, q, k, v, out, lse)[:3], first))
    finally:
        torch.use_deterministic_algorithms(was)
