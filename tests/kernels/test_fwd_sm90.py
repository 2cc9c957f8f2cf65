"""The warp-specialised Hopper forward (``elsa_vision.kernels.fwd_sm90``), routed from ``fwd.elsa_fwd``.

CPU: the kernel compiled for sm90 without a GPU (its schedule read off the PTX), and the redo launch that
finishes the query tiles it flags (the generic kernel in ``REDO`` mode) under the interpreter. GPU: the
outputs against float64 (FlashAttention's half-precision criterion, as ``test_fwd``), against the generic
kernel, on strided views, run to run, with non-finite inputs (``scan64``'s rule), and the routing rules.
"""

from __future__ import annotations

import math

import pytest
import torch

from elsa_vision.kernels import elsa_fwd
from elsa_vision.kernels import fwd as fwd_module
from elsa_vision.kernels.fwd import fwd_program
from tests.helpers import (
    DEVICE,
    FP32_ACCURATE,
    assert_lse,
    assert_nonfinite_like,
    compile_for_sm90,
    fused_qkv_views,
    qkv,
    relerr,
    scan64,
)
from tests.kernels.test_fwd import assert_low_precision

fwd_sm90 = fwd_module.fwd_sm90
pytestmark = pytest.mark.skipif(fwd_sm90 is None, reason="this Triton has no Gluon")

_COMPILE = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from elsa_vision.kernels import fwd, fwd_sm90 as F

fn = F.attention_fwd_kernel
report = []
# (D, BLOCK_N, stages, consumers, partial: float32 Out and float64 Lse, as context parallelism's pieces)
variants = [(64, 128, 3, 2, False), (128, 128, 3, 2, False), (64, 128, 3, 3, False), (64, 64, 2, 3, False),
            (128, 128, 3, 2, True)]
for D, bn, stages, consumers, partial in variants:
    t = torch.empty((2, 3, 512, D), dtype=torch.bfloat16)
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(q_desc=mangle_type(F.descriptor(t, 64)), k_desc=mangle_type(F.descriptor(t, bn)),
               v_desc=mangle_type(F.descriptor(t, bn)), Out="*fp32" if partial else "*bf16",
               Lse="*fp64" if partial else "*fp32", Redo="*i32", qk_scale="fp32")
    consts = dict(D=D, BLOCK_N=bn, STAGES=stages, CONSUMERS=consumers, STORE_LSE=True)
    sig.update({name: "constexpr" for name in consts})
    k = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": F.NUM_WARPS})
    ptx = k.asm["ptx"]
    tokens = []
    for line in ptx.splitlines():
        line = line.strip()
        if line.startswith("wgmma.mma_async"):
            tokens.append("M" if bn == D else "S" if f"n{bn}k16" in line else "P")
        elif line.startswith("wgmma.wait_group"):
            tokens.append("W" + line.split()[-1].rstrip(";"))
    report.append(dict(D=D, bn=bn, consumers=consumers, shared=k.metadata.shared, local=".local" in ptx,
                       tokens=" ".join(tokens)))
# the generic kernel in REDO mode (the launch that finishes flagged tiles)
consts = dict(D=64, DV=64, BLOCK_M=64, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64, PRECISION="none", CAUSAL=False,
              HAS_BIAS=False, HAS_KPM=False, IS_VARLEN=False, SPLIT=False, ACCUMULATE="plain", STORE_LSE=True,
              SEGMENT=0, PRESPLIT=False, DEFER_SCALE=True, REDO=True)
sig = {n: "i32" for n in fwd._fwd_kernel.arg_names}
sig.update({n: "*bf16" for n in ("Q", "K", "V", "Out")})
sig.update({n: "*fp32" for n in ("Bias", "Lse", "WsM", "WsS", "WsW")})
sig.update({"Kpm": "*u8", "CuQ": "*i32", "CuK": "*i32", "qk_scale": "fp32", "KP": "*fp16", "VP": "*fp16",
            "KE": "*i32", "VE": "*i32", "Redo": "*i32"})
sig.update({n: "constexpr" for n in consts})
k = triton.compile(ASTSource(fn=fwd._fwd_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 2})
report.append(dict(redo_shared=k.metadata.shared))
print(json.dumps(report))
"""


def test_compiles_for_sm90_with_the_softmax_under_the_products():
    # Built for sm90 on any machine: in each consumer's key loop both products of a tile are issued (S_j's
    # and P_{j-1} v_{j-1}'s wgmma instructions back to back) before one wait that leaves the value product
    # running (wait_group 1); no local memory (spills), shared memory within the H100's; the same with the
    # partial-result epilogue (float32 output, float64 lse).
    *variants, redo = compile_for_sm90(_COMPILE)
    assert len(variants) == 5
    for var in variants:
        s, p = ("S", "P") if var["bn"] != var["D"] else ("M", "M")  # told apart by their widths
        loop = " ".join([s] * (var["D"] // 16) + [p] * (var["bn"] // 16) + ["W1"])
        assert var["tokens"].count(loop) == var["consumers"], var
        assert not var["local"] and 0 < var["shared"] <= 232448, var
    assert 0 < redo["redo_shared"] <= 232448


_COMPILE_SPLIT = r"""
import json, re
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from elsa_vision.kernels import fwd_sm90 as F
from tests.helpers import spill_stores

fn = F.attention_fwd_f16x3_kernel
report = []
for (D, (bn, stages)), partial in [(c, p) for c in sorted(F.SPLIT_CONFIGS.items()) for p in (False, True)]:
    parts = torch.empty((2, 6, 512, D), dtype=torch.float16)
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(kp_desc=mangle_type(F.descriptor(parts, bn)), vp_desc=mangle_type(F.descriptor(parts, bn)),
               Q="*fp32", KE="*i32", VE="*i32", Out="*fp32", Lse="*fp64" if partial else "*fp32",
               Redo="*i32", qk_scale="fp32")
    consts = dict(D=D, BLOCK_N=bn, STAGES=stages, STORE_LSE=True)
    sig.update({name: "constexpr" for name in consts})
    k = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": F.NUM_WARPS})
    ptx = k.asm["ptx"]
    report.append(dict(D=D, bn=bn, shared=k.metadata.shared, spills=spill_stores(k), local=".local" in ptx,
                       f16=len(re.findall(r"wgmma.mma_async.sync.aligned.m64n\d+k16.f32.f16.f16", ptx)),
                       wgmma=ptx.count("wgmma.mma_async"), tma=ptx.count("cp.async.bulk.tensor")))
print(json.dumps(report))
"""


def test_fp32_accurate_kernel_compiles_for_sm90():
    # Built for sm90 on any machine, with the float32 and the float64 (partial result) lse: per consumer and
    # key tile three float16 wgmma (K-steps of 16) for S = q k^T (K = D) and three for P V (K = BLOCK_N), and
    # nothing else on the tensor cores; the producer's TMA loads of both parts of keys and values (one per
    # part and 64 columns: the 128-byte swizzle's widest box); no local memory, shared memory within the
    # H100's (at head dim 128 the query parts' 32 KB too). No spill stores at head dim 64; at 128 Triton
    # 3.6's ptxas writes 7 (measured faster all the same: docs/kernel_notes.md), 3.8's none.
    variants = compile_for_sm90(_COMPILE_SPLIT)
    assert len(variants) == 2 * len(fwd_sm90.SPLIT_CONFIGS)
    for var in variants:
        per_consumer = 3 * (var["D"] // 16 + var["bn"] // 16)
        assert var["f16"] == var["wgmma"] == 2 * per_consumer, var
        assert var["tma"] == 4 * (var["D"] // 64), var
        assert not var["local"] and (var["spills"] or 0) <= (0 if var["D"] == 64 else 7), var
        assert 0 < var["shared"] <= 232448, var


@pytest.fixture
def four_sms(monkeypatch):
    """Plans made as for a GPU of 4 multiprocessors (the interpreter's count) on any device, so that the
    small grids of the routing tests keep one key partition on an H100 too; plans and programs of other
    counts are dropped before and after."""
    from elsa_vision.kernels import host

    real = host._device_info
    monkeypatch.setattr(host, "_device_info", lambda device=None: (4, *real(device)[1:]))
    fwd_module._plan_cached.cache_clear()
    fwd_module._PROGRAMS.clear()
    yield
    fwd_module._plan_cached.cache_clear()
    fwd_module._PROGRAMS.clear()


@pytest.mark.parametrize("partial", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_redo_launch_finishes_exactly_the_flagged_tiles(monkeypatch, four_sms, partial, dtype):
    # The generic kernel in REDO mode (the second launch of a Hopper forward): the 64-row query tiles whose
    # flag is set get the full forward (fast pass, then the exact pass their non-finite inputs need), every
    # other row stays as the Hopper kernel left it. Built as on sm90 (supported() / supported_split() forced)
    # and run by the interpreter, float16 against float64, and float32 at "fp16x3" (the launch after the
    # FP32-accurate kernel, splitting in its loop) against the generic "fp16x3" forward, whose float16 split
    # makes an infinite key entry's logits NaN; ``partial``: context parallelism's pieces (float32 out,
    # float64 lse).
    B, H, N, D = 1, 2, 150, 64
    q, k, v = qkv(B, H, N, N, D, seed=31, dtype=dtype)
    v[0, 0, 7, 3] = math.inf  # a non-finite value: visible to every row
    k[0, 1, 11, 0] = math.inf  # logits +-inf: the key hidden from the rows with q[..., 0] < 0, NaN elsewhere
    v[0, 1, 11, :] = math.nan
    precision = "fp16x3" if dtype == torch.float32 else "auto"
    ref, ref_lse = scan64(q, k, v) if dtype != torch.float32 else elsa_fwd(q, k, v, precision=precision)
    fwd_module._PROGRAMS.clear()  # the generic program of this signature
    monkeypatch.setattr(fwd_sm90, "supported", lambda *a: True)
    monkeypatch.setattr(fwd_sm90, "supported_split", lambda *a: True)
    monkeypatch.setattr(fwd_module, "HOPPER_MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(fwd_module, "HOPPER_SPLIT_MIN_KEYS", {64: 0, 128: 0})
    program = fwd_program(q, k, v, None, None, False, D**-0.5, precision, partial=partial)
    assert program.hopper is not None and (program.hopper.split is not None) == (dtype == torch.float32)
    flags = torch.tensor([1, 0, 1, 0, 1, 0], dtype=torch.int32, device=DEVICE)  # [B * H, cdiv(150, 64)]
    out_dtype = torch.float32 if partial else dtype
    lse_dtype = torch.float64 if partial else torch.float32
    out = torch.full((B, N, H, D), 7.0, dtype=out_dtype, device=DEVICE).transpose(1, 2)
    lse = torch.full((B, H, N), 7.0, dtype=lse_dtype, device=DEVICE)
    program.hopper.redo[0](q, k, v, out, out, out, lse, out, out, out, out, out, out, out, out, out, flags)
    for h, blocks in ((0, (0, 2)), (1, (1,))):
        for blk in range(3):
            rows = slice(64 * blk, min(N, 64 * blk + 64))
            if blk in blocks:
                tol = 1e-6 if dtype == torch.float32 else 2e-3
                assert_nonfinite_like(out[0, h, rows], ref[0, h, rows], tol, some_finite=False)
                fin = torch.isfinite(ref_lse[0, h, rows])
                assert torch.equal(torch.isfinite(lse[0, h, rows]), fin)
                if fin.any():  # (none under "fp16x3" in head 1's NaN rows)
                    assert (lse[0, h, rows][fin].double() - ref_lse[0, h, rows][fin]).abs().max() <= 1e-5
            else:
                assert bool((out[0, h, rows] == 7.0).all()) and bool((lse[0, h, rows] == 7.0).all())


@pytest.mark.parametrize("D", [64, 128])
def test_fp32_program_splits_keys_and_values_in_its_tiles(D, monkeypatch, four_sms):
    # The FP32-accurate Hopper program's split pass (run by the interpreter; built as on sm90) on ViT's
    # strided views: float16 parts in the kernel's tiles of SPLIT_CONFIGS keys that give back the keys (one
    # power of two per key row, KE) and values (one per tile and column, VE) to the split's 2^-22
    monkeypatch.setattr(fwd_sm90, "supported_split", lambda *a: True)
    monkeypatch.setattr(fwd_module, "HOPPER_MIN_KEYS", {64: 0, 128: 0})
    monkeypatch.setattr(fwd_module, "HOPPER_SPLIT_MIN_KEYS", {64: 0, 128: 0})
    B, H, N = 1, 2, 150
    q, k, v = fused_qkv_views(B, N, H, D, seed=3)
    program = fwd_program(q, k, v, None, None, False, D**-0.5, "fp16x3")
    kp, vp, ke, ve = program.hopper.split(k, v, k)
    bn = fwd_sm90.SPLIT_CONFIGS[D][0]
    assert kp.shape == vp.shape == (2, B * H, N, D) and ke.shape == (B * H, N)
    assert ve.shape == (B * H, math.ceil(N / bn), D)
    keys = (kp[0].double() + kp[1].double()) * torch.exp2(-ke.double())[..., None]
    values = (vp[0].double() + vp[1].double()) * torch.exp2(-ve.double()).repeat_interleave(bn, 1)[:, :N]
    assert relerr(keys.view(B, H, N, D), k) <= 1e-6 and relerr(values.view(B, H, N, D), v) <= 1e-6


def test_three_consumers_only_for_many_waves():
    # 192-row tiles (three consumer warpgroups) at head dim 64 once their grid holds LARGE_WAVES waves
    sms = 132
    rows = fwd_sm90.ROWS.value * fwd_sm90.LARGE[64][2]
    many = fwd_sm90.LARGE_WAVES * sms * rows
    assert fwd_sm90.config(64, many, 1, sms) == fwd_sm90.LARGE[64]
    assert fwd_sm90.config(64, many - rows, 1, sms) == fwd_sm90.CONFIGS[64]
    assert fwd_sm90.config(128, many * 4, 16, sms) == fwd_sm90.CONFIGS[128]


def test_routing_rules(monkeypatch, four_sms):
    # Only half-precision dense calls without masks, bias or causality whose query tiles fill the GPU and
    # whose keys number at least HOPPER_MIN_KEYS[head dim] take the Hopper kernel (partial results of context
    # parallelism's pieces too); everything else the generic one.
    monkeypatch.setattr(fwd_sm90, "supported", lambda q, k, v, has_mask: q.dtype != torch.float32)
    keys = fwd_module.HOPPER_MIN_KEYS[64]
    wide = fwd_module.HOPPER_MIN_KEYS[128]
    assert wide < keys  # head dim 128 from fewer keys (docs/kernel_notes.md, "Shorter sequences")
    for n, hopper in ((wide, True), (wide - 1, False)):
        q, k, v = qkv(1, 2, 150, n, 128, dtype=torch.float16)
        assert (fwd_program(q, k, v, None, None, False, 0.125, "auto").hopper is not None) == hopper
    q, k, v = qkv(1, 2, 150, keys, 64, dtype=torch.float16)  # 6 query tiles fill 4 CPU "multiprocessors"
    assert fwd_program(q, k, v, None, None, False, 0.125, "auto").hopper is not None
    assert fwd_program(q, k, v, None, None, True, 0.125, "auto").hopper is None  # causal
    kpm = torch.ones(1, keys, dtype=torch.bool, device=DEVICE)
    assert fwd_program(q, k, v, None, kpm, False, 0.125, "auto").hopper is None
    bias = torch.zeros(1, 1, 150, keys, dtype=torch.float16, device=DEVICE)
    assert fwd_program(q, k, v, bias, None, False, 0.125, "auto").hopper is None
    assert fwd_program(q, k, v, None, None, False, 0.125, "auto", partial=True).hopper is not None  # ring
    short = qkv(1, 2, 150, keys - 1, 64, dtype=torch.float16)
    assert fwd_program(*short, None, None, False, 0.125, "auto").hopper is None  # fewer keys than the minimum
    few = qkv(1, 2, 64, keys, 64, dtype=torch.float16)
    assert fwd_program(*few, None, None, False, 0.125, "auto").hopper is None  # key partitions: generic
    monkeypatch.setattr(fwd_sm90, "supported_split", lambda q, k, v, has_mask: q.dtype == torch.float32)
    split_keys = fwd_module.HOPPER_SPLIT_MIN_KEYS
    assert split_keys[64] == keys and split_keys[128] < wide  # FP32 at head dim 128 from ViT's 197 tokens
    f32 = qkv(1, 2, 150, keys, 64)
    assert fwd_program(*f32, None, None, False, 0.125, "fp16x3").hopper.split is not None  # FP32-accurate
    for n, hopper in ((split_keys[128], True), (split_keys[128] - 1, False)):
        wide32 = qkv(1, 2, 150, n, 128)
        assert (fwd_program(*wide32, None, None, False, 0.125, "fp16x3").hopper is not None) == hopper
    assert fwd_program(*f32, None, None, False, 0.125, "fp16x3", partial=True).hopper.split is not None
    for precision in ("ieee", "tf32x3", "tf32"):  # the other float32 precisions: the generic kernel
        assert fwd_program(*f32, None, None, False, 0.125, precision).hopper is None
    assert fwd_program(*f32, None, None, True, 0.125, "fp16x3").hopper is None  # causal
    assert fwd_program(*qkv(1, 2, 150, keys - 1, 64), None, None, False, 0.125, "fp16x3").hopper is None
    plain = 2 * fwd_module.SEGMENT_KEYS["fp16x3"]  # a plain running sum up to here, segments beyond
    for n, hopper in ((plain, True), (plain + 1, False)):
        long = qkv(1, 2, 150, n, 64)
        assert (fwd_program(*long, None, None, False, 0.125, "fp16x3").hopper is not None) == hopper
    monkeypatch.setattr(fwd_module, "HOPPER", False)
    q2, k2, v2 = qkv(1, 2, 150, keys + 1, 64, dtype=torch.float16)
    assert fwd_program(q2, k2, v2, None, None, False, 0.125, "auto").hopper is None


# ------------------------------------------------------------------------------------------------- GPU


def _hopper(q, k, v):
    return fwd_program(q, k, v, None, None, False, q.shape[-1] ** -0.5, "auto").hopper is not None


def _generic(q, k, v, monkeypatch):
    monkeypatch.setattr(fwd_module, "HOPPER", False)
    out = elsa_fwd(q, k, v)
    monkeypatch.setattr(fwd_module, "HOPPER", True)
    return out


def _on_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


needs_sm90 = pytest.mark.skipif(not _on_sm90(), reason="needs an sm90 GPU")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,Nq,Nk", [(2, 3, 2048, 2048), (1, 4, 2561, 2561), (4, 12, 197, 2053),
                                       (1, 4, 4099, 2111)])
def test_gpu_matches_float64_and_the_generic_kernel(B, H, Nq, Nk, D, dtype, monkeypatch):
    _check_against_float64_and_generic(B, H, Nq, Nk, D, dtype, monkeypatch)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,H,Nq,Nk", [(8, 12, 1025, 1025), (4, 16, 1500, 1500), (4, 12, 333, 1031)])
def test_gpu_head_dim_128_from_fewer_keys(B, H, Nq, Nk, dtype, monkeypatch):
    # head dim 128 takes the Hopper kernel from HOPPER_MIN_KEYS[128] keys (a last key tile of one key at
    # 1,025 and 1,031)
    assert Nk >= fwd_module.HOPPER_MIN_KEYS[128]
    _check_against_float64_and_generic(B, H, Nq, Nk, 128, dtype, monkeypatch)


def _check_against_float64_and_generic(B, H, Nq, Nk, D, dtype, monkeypatch):
    q, k, v = qkv(B, H, Nq, Nk, D, seed=Nq + D, dtype=dtype)
    assert _hopper(q, k, v)
    out, lse = elsa_fwd(q, k, v)
    assert out.dtype == dtype and out.shape == (B, H, Nq, D)
    assert_low_precision(out, q, k, v)
    assert_lse(lse, scan64(q, k, v)[1])
    generic, generic_lse = _generic(q, k, v, monkeypatch)
    assert relerr(out, generic) <= (4e-3 if dtype == torch.bfloat16 else 5e-4)
    assert (lse - generic_lse).abs().max().item() <= 1e-4
    assert elsa_fwd(q, k, v, need_lse=False)[1] is None
    assert torch.equal(elsa_fwd(q, k, v, need_lse=False)[0], out)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("B,H,Nq,Nk", [(1, 4, 2053, 4099), (2, 3, 1500, 2048)])
def test_gpu_partial_results_float32_out_float64_lse(B, H, Nq, Nk, D, monkeypatch):
    # context parallelism's pieces (partial=True) on the Hopper kernel: the output in float32, rounded once
    # (closer to float64 than the bf16 output of the same call), the lse in float64 formed from the row's
    # state (below the float32 lse's error, within 3e-7 on average), as the generic kernel forms them
    q, k, v = qkv(B, H, Nq, Nk, D, seed=Nq + D, dtype=torch.bfloat16)
    scale = D ** -0.5
    program = fwd_program(q, k, v, None, None, False, scale, "auto", partial=True)
    assert program.hopper is not None
    out, lse = program(q, k, v, None, None)
    assert out.dtype == torch.float32 and lse.dtype == torch.float64
    ref_out, ref_lse = scan64(q, k, v)
    bf16_out, lse32 = elsa_fwd(q, k, v)
    assert relerr(out, ref_out) <= relerr(bf16_out, ref_out)
    err64, err32 = (lse - ref_lse).abs().mean().item(), (lse32.double() - ref_lse).abs().mean().item()
    assert err64 <= 3e-7 and err64 < err32, (err64, err32)
    monkeypatch.setattr(fwd_module, "HOPPER", False)
    generic = fwd_program(q, k, v, None, None, False, scale, "auto", partial=True)
    assert generic.hopper is None
    g_out, g_lse = generic(q, k, v, None, None)
    assert relerr(out, g_out) <= 4e-3 and (lse - g_lse).abs().max().item() <= 1e-4


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D,config", [(64, (128, 3, 2)), (64, (128, 2, 2)), (64, (64, 3, 2)),
                                      (64, (128, 2, 3)), (64, (128, 3, 3)), (128, (128, 3, 2)),
                                      (128, (64, 3, 2)), (128, (128, 2, 2)), (128, (64, 2, 2)),
                                      (128, (64, 3, 3))])
def test_gpu_finite_inputs_flag_nothing(D, config, monkeypatch):
    # Every tile config finishes finite inputs itself (no 64-row block sent to the generic kernel), and
    # gives FlashAttention's half-precision accuracy, the last key tile partly past the end.
    monkeypatch.setitem(fwd_sm90.CONFIGS, D, config)
    monkeypatch.setattr(fwd_module, "_PROGRAMS", type(fwd_module._PROGRAMS)())
    B, H, N = 1, 8, 4099
    q, k, v = qkv(B, H, N, N, D, seed=D, dtype=torch.bfloat16)
    program = fwd_program(q, k, v, None, None, False, D**-0.5, "auto")
    out = fwd_module.empty_output(B, H, N, D, q)
    lse = torch.empty(B, H, N, device="cuda")
    flags = program.hopper(q, k, v, out, lse, 0)
    assert flags.numel() == B * H * math.ceil(N / 64) and int(flags.abs().sum()) == 0
    assert_low_precision(out, q, k, v)
    assert_lse(lse, scan64(q, k, v)[1])


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_strided_views_reruns_and_consumer_counts(D, monkeypatch):
    B, N, H = 2, 3137, 3
    q, k, v = fused_qkv_views(B, N, H, D, seed=D, dtype=torch.bfloat16)
    assert _hopper(q, k, v)
    out = elsa_fwd(q, k, v)[0]
    assert torch.equal(elsa_fwd(q.contiguous(), k.contiguous(), v.contiguous())[0], out)
    for _ in range(3):
        assert torch.equal(elsa_fwd(q, k, v)[0], out)
    bn, stages, consumers = fwd_sm90.CONFIGS[D]
    # the other count of warpgroups (three of head dim 128 with 128-key tiles fit two stages)
    other = (bn, 2 if D == 128 and bn == 128 else stages, 5 - consumers)
    monkeypatch.setitem(fwd_sm90.CONFIGS, D, other)
    monkeypatch.setattr(fwd_module, "_PROGRAMS", type(fwd_module._PROGRAMS)())
    assert torch.equal(elsa_fwd(q, k, v)[0], out)  # each row's tiles and products are its own: the same bits


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_nonfinite_inputs_follow_the_reference_rule(dtype):
    B, H, N, D = 2, 8, 2053, 64
    q, k, v = qkv(B, H, N, N, D, seed=41, dtype=dtype)
    v[0, 0, 7, 3] = math.inf  # visible to every row: column 3 of head 0 is +inf, underflowed weights too
    q[0, 0, :, 0] = q[0, 0, :, 0].abs()
    k[0, 0, 7, 0] = -60000.0  # ... which it does for most rows
    k[0, 1, 11, 0] = math.inf  # a key hidden (-inf logits) from the rows with q[..., 0] < 0, NaN elsewhere
    v[0, 1, 11, :] = math.nan
    q[0, 1, 100:140, 0] = 0.0  # 0 * inf: NaN logits, NaN rows
    assert _hopper(q, k, v)
    out, lse = elsa_fwd(q, k, v)
    ref = scan64(q, k, v)[0]
    assert_nonfinite_like(out, ref, 2e-2)
    finite = torch.isfinite(ref).all(-1)
    assert torch.isfinite(out[finite]).all()


@pytest.mark.gpu
@needs_sm90
def test_gpu_refused_shapes_take_the_generic_kernel():
    n = fwd_module.HOPPER_MIN_KEYS[64]
    for D in (32, 72, 96):  # head dims without a Hopper config
        assert not _hopper(*qkv(1, 8, n, n, D, dtype=torch.bfloat16))
    q, k, v = qkv(1, 8, n, n, 64, dtype=torch.bfloat16)
    assert _hopper(q, k, v)
    assert not _hopper(q, k[..., 1:, :].contiguous()[:, :, :0], v[:, :, :0])  # no keys
    odd = torch.randn(1, n, 8, 65, device="cuda", dtype=torch.bfloat16)[..., :64].transpose(1, 2)
    assert not _hopper(odd, odd, odd)  # rows 130 bytes apart: no TMA
    f32 = fwd_program(q.float(), k.float(), v.float(), None, None, False, 0.125, "auto")
    assert f32.hopper.split is not None  # float32: the FP32-accurate kernel (below), not this one


# ------------------------------------------------------------------------ FP32-accurate (fp16x3), GPU

def _split_hopper(q, k, v, precision="auto"):
    program = fwd_program(q, k, v, None, None, False, q.shape[-1] ** -0.5, precision)
    return program.hopper is not None and program.hopper.split is not None


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("B,H,Nq,Nk,D", [
    (2, 3, 2048, 2048, 64), (1, 4, 2561, 2561, 64), (4, 12, 197, 2053, 64), (1, 4, 4099, 2111, 64),
    (2, 8, 3137, 3137, 64), (1, 8, 1024, 16384, 64), (2, 3, 2048, 2048, 128), (4, 12, 197, 2053, 128),
    (1, 4, 4099, 2111, 128), (2, 8, 3137, 3137, 128), (8, 12, 785, 785, 128), (64, 12, 197, 197, 128),
    (2, 8, 1024, 16384, 128)])
def test_gpu_fp32_matches_float64_and_the_generic_kernel(B, H, Nq, Nk, D, monkeypatch):
    # float32 at "auto" (fp16x3 on sm90) takes the FP32-accurate Hopper kernel from HOPPER_SPLIT_MIN_KEYS keys
    # up to the plain sum's 16,384: relerr against float64 within the FP32-accurate bound and within a quarter
    # of the generic kernel's (the same arithmetic: at head dim 64 bit for bit where the generic kernel tiles
    # the keys by 128 in one partition too; at 128, tiled by 64 alike, a few last bits apart, 6e-11 to
    # 1.4e-10 in relerr where measured), the lse within assert_lse's bound, the same output without the lse
    q, k, v = qkv(B, H, Nq, Nk, D, seed=Nq + Nk + D)
    assert _split_hopper(q, k, v)
    out, lse = elsa_fwd(q, k, v)
    assert out.dtype == torch.float32 and out.shape == (B, H, Nq, D)
    ref, ref_lse = scan64(q, k, v)
    err = relerr(out, ref)
    assert_lse(lse, ref_lse)
    generic, generic_lse = _generic(q, k, v, monkeypatch)
    assert err <= FP32_ACCURATE and err <= 1.25 * relerr(generic, ref), (err, relerr(generic, ref))
    assert relerr(out, generic) <= 1e-6 and (lse - generic_lse).abs().max().item() <= 1e-5
    generic_plan = fwd_module.plan(B, H, Nq, Nk, D, D, q.dtype, device=q.device)
    if generic_plan.block_n == fwd_sm90.SPLIT_CONFIGS[D][0] and generic_plan.partitions == 1:
        if D == 64:
            assert torch.equal(out, generic) and torch.equal(lse, generic_lse)
        else:
            assert relerr(out, generic) <= 1e-8, relerr(out, generic)
    assert elsa_fwd(q, k, v, need_lse=False)[1] is None
    assert torch.equal(elsa_fwd(q, k, v, need_lse=False)[0], out)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fp32_views_reruns_partial_results_and_no_flags(D):
    # ViT's strided views of a fused qkv projection read in place (the same bits as contiguous copies), the
    # same bits run to run, every flag 0 for finite inputs (no query tile sent to the generic kernel), and
    # context parallelism's partial results: float32 out (the same bits), the lse in float64 from the row's
    # state (below the float32 lse's error against float64)
    B, N, H = 2, 3137, 3
    q, k, v = fused_qkv_views(B, N, H, D, seed=5 + D)
    assert _split_hopper(q, k, v)
    out, lse32 = elsa_fwd(q, k, v)
    assert torch.equal(elsa_fwd(q.contiguous(), k.contiguous(), v.contiguous())[0], out)
    for _ in range(3):
        assert torch.equal(elsa_fwd(q, k, v)[0], out)
    program = fwd_program(q, k, v, None, None, False, D**-0.5, "auto")
    res = fwd_module.empty_output(B, H, N, D, q)
    flags = program.hopper(q, k, v, res, torch.empty(B, H, N, device="cuda"), 0)
    assert flags.numel() == B * H * math.ceil(N / 64) and int(flags.abs().sum()) == 0
    assert torch.equal(res, out)
    partial = fwd_program(q, k, v, None, None, False, D**-0.5, "auto", partial=True)
    assert partial.hopper is not None and partial.hopper.split is not None
    p_out, lse64 = partial(q, k, v, None, None)
    assert p_out.dtype == torch.float32 and lse64.dtype == torch.float64 and torch.equal(p_out, out)
    ref_lse = scan64(q, k, v)[1]
    err64, err32 = (lse64 - ref_lse).abs().mean().item(), (lse32.double() - ref_lse).abs().mean().item()
    assert err64 <= 3e-7 and err64 < err32, (err64, err32)


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fp32_nonfinite_inputs_follow_the_generic_kernel(D, monkeypatch):
    # The kernel flags the 64-row tiles whose state or queries are not finite; the generic kernel redoes
    # them (its exact pass where needed): the generic "fp16x3" forward's NaN and infinities entry by entry
    # (an infinite key entry's logits are NaN under its float16 split; the reference's +-inf), within the
    # FP32-accurate bound elsewhere, and the reference's own where no key is infinite, every row of a
    # flagged tile that the non-finite input does not reach included
    B, H, N = 2, 4, 2053
    q, k, v = qkv(B, H, N, N, D, seed=43 + D)
    v[0, 0, 7, 3] = math.inf  # visible to every row: column 3 of head 0 is +inf
    k[0, 1, 11, 0] = math.inf
    v[0, 1, 11, :] = math.nan
    q[0, 2, 100, 5] = math.nan  # a NaN query row: that row NaN, its tile's other rows exact
    q[1, 3, 2000, 0] = -math.inf  # an infinite query entry: +-inf logits, a NaN row
    assert _split_hopper(q, k, v)
    out, lse = elsa_fwd(q, k, v)
    generic, generic_lse = _generic(q, k, v, monkeypatch)
    assert_nonfinite_like(out, generic, FP32_ACCURATE)
    assert torch.equal(torch.isnan(lse), torch.isnan(generic_lse))
    ref = scan64(q, k, v)[0]
    for b, h in ((0, 0), (0, 2), (1, 3), (1, 0)):
        assert_nonfinite_like(out[b, h], ref[b, h], FP32_ACCURATE)
    others = torch.arange(64, device="cuda") != 36  # the rows of the NaN query's tile
    assert torch.isnan(out[0, 2, 100]).all()
    assert relerr(out[0, 2, 64:128][others], ref[0, 2, 64:128][others]) <= FP32_ACCURATE


@pytest.mark.gpu
@needs_sm90
def test_gpu_fp32_refused_shapes_take_the_generic_kernel():
    n = fwd_module.HOPPER_MIN_KEYS[64]
    for D in (32, 72, 80, 96):  # head dims without an FP32-accurate Hopper config
        assert not _split_hopper(*qkv(1, 8, n, n, D))
    wide = fwd_module.HOPPER_SPLIT_MIN_KEYS[128]
    assert _split_hopper(*qkv(8, 8, wide, wide, 128)) and not _split_hopper(*qkv(8, 8, wide, wide - 1, 128))
    q, k, v = qkv(1, 8, n, n, 64)
    assert _split_hopper(q, k, v)
    assert not _split_hopper(q, k, v, "ieee") and not _split_hopper(q, k, v, "tf32x3")
    long = qkv(1, 1, 64 * 3, 2 * fwd_module.SEGMENT_KEYS["fp16x3"] + 1, 64)
    assert not _split_hopper(*long)  # the generic kernel's segmented sums
    strided = torch.randn(1, 8, n, 128, device="cuda")[..., ::2]  # head dim not contiguous
    assert not _split_hopper(strided, k, v)
