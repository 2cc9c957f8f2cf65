"""The FP32-accurate GEMM (``kernels.gemm``) against float64: odd sizes, every float32 precision, K slices,
bias and GELU epilogues, transposed views, tiny / huge / subnormal magnitudes and non-finite elements. CPU
runs go through Triton's interpreter at small sizes; the ``gpu`` tests take the ViT shapes and K up to 8192
and hold the kernel to PyTorch FP32's own error on the same inputs. On an H100 the products with
``K % 8 == 0`` run the warp-specialised Hopper loop (``kernels.gemm_sm90``), the others the generic one: the
checks below take K of both kinds."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from elsa_vision.kernels.gemm import SplitOperand, gemm, gemm_plan, gemm_sm90, split_rows  # noqa: E402
from tests.helpers import DEVICE, FP32_ACCURATE, TF32_BOUND, compile_for_sm90, randn, relerr  # noqa: E402

# (M, N, K), none a multiple of a tile; the last three have K % 8 == 0 (the Hopper loop's TMA rows)
SIZES = [(37, 29, 45), (1, 70, 130), (65, 33, 257), (2, 3, 1), (37, 29, 48), (1, 70, 136), (65, 33, 264)]
KS = (45, 48)  # the reduction width of the smaller checks: generic loop / Hopper loop on sm90


def _ref(a, b, bias=None, gelu=False):
    out = a.double() @ b.double().t()
    if bias is not None:
        out = out + bias.double()
    return torch.nn.functional.gelu(out) if gelu else out


@pytest.mark.parametrize("M,N,K", SIZES)
@pytest.mark.parametrize("precision", ["fp16x3", "tf32x3", "ieee"])
def test_fp32_accurate_against_float64(M, N, K, precision):
    a, b, bias = randn(M, K, seed=1), randn(N, K, seed=2), randn(N, seed=3)
    for slices in (1, 2, 3):
        out = gemm(a, b, bias, precision=precision, slices=slices)
        assert out.shape == (M, N) and out.dtype == torch.float32 and out.is_contiguous()
        assert relerr(out, _ref(a, b, bias)) <= FP32_ACCURATE, (slices, relerr(out, _ref(a, b, bias)))


def test_tf32_is_one_pass():
    a, b = randn(64, 96, seed=1), randn(48, 96, seed=2)
    err = relerr(gemm(a, b, precision="tf32"), _ref(a, b))
    assert err <= TF32_BOUND
    if DEVICE == "cuda":
        assert err > 10 * FP32_ACCURATE  # really one TF32 pass on tensor cores


@pytest.mark.parametrize("K", KS)
def test_gelu_epilogue_and_no_bias(K):
    a, b, bias = randn(37, K, seed=1), randn(29, K, seed=2), randn(29, seed=3)
    for slices in (1, 2):
        assert relerr(gemm(a, b, bias, precision="fp16x3", activation="gelu", slices=slices),
                      _ref(a, b, bias, gelu=True)) <= FP32_ACCURATE
    assert relerr(gemm(a, b, precision="fp16x3"), _ref(a, b)) <= FP32_ACCURATE


def test_transposed_and_strided_views():
    # the three products of a linear layer: x @ w.T, dy @ w, dy.T @ x
    x, w, dy = randn(53, 40, seed=1), randn(24, 40, seed=2), randn(53, 24, seed=3)
    for a, b in ((x, w), (dy, w.t()), (dy.t(), x.t()), (x[::2, 1:], w[:, 1:]), (x.t().contiguous().t(), w)):
        assert relerr(gemm(a, b, precision="fp16x3"), _ref(a, b)) <= FP32_ACCURATE


def test_empty_and_zero_k():
    a, b, bias = randn(0, 8, seed=1), randn(5, 8, seed=2), randn(5, seed=3)
    assert gemm(a, b, bias, precision="fp16x3").shape == (0, 5)
    out = gemm(randn(3, 0, seed=1), randn(5, 0, seed=2), bias, precision="fp16x3", activation="gelu")
    torch.testing.assert_close(out, torch.nn.functional.gelu(bias).expand(3, 5), rtol=0, atol=0)


@pytest.mark.parametrize("scale_a,scale_b", [(1e-30, 1.0), (1.0, 1e-30), (1e25, 1e-20), (1e28, 1.0),
                                             (1e-38, 1e3)])
@pytest.mark.parametrize("K", KS)
def test_tiny_and_huge_magnitudes(scale_a, scale_b, K):
    a, b = randn(37, K, seed=1, scale=scale_a), randn(29, K, seed=2, scale=scale_b)
    ref = _ref(a, b)
    assert torch.isfinite(ref).all()
    assert relerr(gemm(a, b, precision="fp16x3"), ref) <= FP32_ACCURATE


@pytest.mark.parametrize("K", KS)
def test_rows_of_very_different_magnitude_keep_their_own_precision(K):
    # one scale per row: a row of 1e-20 next to a row of 1e20 (and a weight row of 1e15) stays exact
    a, b = randn(9, K, seed=1), randn(7, K, seed=2)
    a[3] *= 1e-20
    a[5] *= 1e20
    b[2] *= 1e15
    out = gemm(a, b, precision="fp16x3")
    # each element within 2^-20 of sum_k |a_ik| |b_jk| (the dot product's own scale), whatever the others
    bound = a.double().abs() @ b.double().abs().t()
    assert ((out.double() - _ref(a, b)).abs() <= 2.0 ** -20 * bound).all()


def test_subnormal_operand():
    a = randn(16, 40, seed=1, scale=1e-39)  # float32 subnormals
    b = randn(12, 40, seed=2, scale=1e3)
    assert (a.abs() < torch.finfo(torch.float32).tiny).float().mean() > 0.9
    ref = _ref(a, b)
    torch_err = relerr((a.double().float() @ b.t()).double(), ref) if DEVICE == "cpu" else None
    err = relerr(gemm(a, b, precision="fp16x3"), ref)
    assert err <= 1e-5, (err, torch_err)  # the outputs are ~1e-35: float32 itself keeps ~1e-7 relative


@pytest.mark.parametrize("value", [math.inf, -math.inf, math.nan])
@pytest.mark.parametrize("K", KS)
def test_non_finite_elements_stay_in_their_row_and_column(value, K):
    a, b, bias = randn(37, K, seed=1), randn(29, K, seed=2), randn(29, seed=3)
    a[4, 7] = value
    b[11, 30] = value
    out = gemm(a, b, bias, precision="fp16x3")
    assert not torch.isfinite(out[4]).any() and not torch.isfinite(out[:, 11]).any()
    keep_r = torch.arange(37, device=out.device) != 4
    keep_c = torch.arange(29, device=out.device) != 11
    clean = out[keep_r][:, keep_c]
    assert torch.isfinite(clean).all()
    a2, b2 = a.clone(), b.clone()
    a2[4, 7] = 0.0
    b2[11, 30] = 0.0
    assert relerr(clean, _ref(a2, b2, bias)[keep_r][:, keep_c]) <= FP32_ACCURATE


@pytest.mark.parametrize("layout", ["rows", "columns", "strided"])
def test_split_rows_reconstructs_each_row(layout):
    x = randn(13, 70, seed=4) * torch.logspace(-20, 20, 13, device=DEVICE)[:, None]
    wide = torch.zeros(13, 140, device=DEVICE)
    wide[:, ::2] = x
    view = {"rows": x, "columns": x.t().contiguous().t(), "strided": wide[:, ::2]}[layout]
    parts, exp = split_rows(view)
    assert parts.shape == (2, 13, 70) and parts.dtype == torch.float16 and exp.dtype == torch.int32
    back = (parts[0].double() + parts[1].double()) * torch.pow(2.0, -exp.double())[:, None]
    assert ((back - x.double()).abs() <= 2.0 ** -22 * x.double().abs() + 1e-45).all()
    # the largest magnitude of every row scaled into [2^14, 2^15)
    top = (x.double().abs().amax(1) * torch.pow(2.0, exp.double()))
    assert ((top >= 2.0 ** 14) & (top < 2.0 ** 15)).all()


def test_split_of_a_transposed_view_can_keep_its_layout():
    # the Hopper loop's TRANS_B parts: each column of x.T's storage (a row of the view) scaled and split as in
    # split_rows, the parts stored [2, L, R] as the storage is; the transposing split gives the same values
    from elsa_vision.kernels.gemm import _Split

    x = randn(13, 70, seed=4) * torch.logspace(-20, 20, 13, device=DEVICE)[:, None]
    view = x.t().contiguous().t()  # [13, 70], columns contiguous
    kept = _Split(view.shape, view.stride(), view.device, not view.is_cuda, transpose=False)
    parts, exp = kept(view)
    assert parts.shape == (2, 70, 13) and not kept.transpose
    moved, exp2 = _Split(view.shape, view.stride(), view.device, not view.is_cuda)(view)
    assert torch.equal(exp, exp2) and torch.equal(parts.transpose(1, 2), moved)
    assert torch.equal(exp, split_rows(x)[1])


def _groups_hold(split: SplitOperand, x):
    """Each row and ``group`` columns of ``split`` hold ``x`` to 22 bits (elements below ``2^-18`` of the
    group's largest magnitude: to half a float16 subnormal step of the scaled value), the largest magnitude
    scaled into ``[2^14, 2^15)`` (GELU gives groups of zeros too: any scale)."""
    R, L = x.shape
    exp = split.exp.double().repeat_interleave(split.group, 1)[:, :L]
    back = (split.parts[0].double() + split.parts[1].double()) * torch.pow(2.0, -exp)
    top = torch.zeros(R, split.exp.shape[1], dtype=torch.float64, device=x.device)
    for g in range(split.exp.shape[1]):
        cols = slice(g * split.group, (g + 1) * split.group)
        top[:, g] = x[:, cols].double().abs().amax(1)
    scaled = top * torch.pow(2.0, split.exp.double())
    bound = 2.0 ** -22 * x.double().abs() + 2.0 ** -25 * torch.pow(2.0, -exp)
    return (((back - x.double()).abs() <= bound).all()
            and ((scaled >= 2.0 ** 14) & (scaled < 2.0 ** 15) | (top == 0)).all())  # a group of zeros


@pytest.mark.parametrize("M,H,N,K", [(37, 70, 29, 45), (65, 33, 40, 130), (1, 97, 3, 5), (37, 72, 29, 48)])
def test_split_output_feeds_the_next_product(M, H, N, K):
    # an MLP's two products: act(x @ w1.T + b1) written as float16 parts, read by the second without a split
    x, w1, b1 = randn(M, K, seed=1), randn(H, K, seed=2), randn(H, seed=3)
    w2, b2 = randn(N, H, seed=4), randn(N, seed=5)
    hidden_ref = _ref(x, w1, b1, gelu=True)
    ref = _ref(hidden_ref.float(), w2, b2)
    for slices in (1, 2, 3):
        hidden = gemm(x, w1, b1, precision="fp16x3", activation="gelu", split_output=True, slices=slices)
        assert isinstance(hidden, SplitOperand) and hidden.shape == (M, H)
        assert hidden.parts.dtype == torch.float16 and hidden.exp.shape == (M, -(-H // hidden.group))
        dense = gemm(x, w1, b1, precision="fp16x3", activation="gelu", slices=slices)
        assert _groups_hold(hidden, dense)  # the float32 output, to 22 bits per row and group
        assert relerr(hidden.dense(), hidden_ref) <= FP32_ACCURATE
        for slices2 in (1, 2):
            out = gemm(hidden, w2, b2, precision="fp16x3", slices=slices2)
            assert out.shape == (M, N) and relerr(out, ref) <= FP32_ACCURATE, (slices, slices2)


def test_split_operand_read_dense_where_its_groups_do_not_fit():
    x, w1, w2 = randn(37, 45, seed=1), randn(70, 45, seed=2), randn(29, 70, seed=3)
    hidden = gemm(x, w1, precision="fp16x3", split_output=True)
    ref = _ref(_ref(x, w1).float(), w2)
    for precision in ("tf32x3", "ieee"):  # no parts for these precisions: the dense matrix
        assert relerr(gemm(hidden, w2, precision=precision), ref) <= FP32_ACCURATE
    assert isinstance(gemm(x, w1, precision="ieee", split_output=True), torch.Tensor)
    odd = SplitOperand(hidden.parts, hidden.exp[:, :1].repeat(1, 70 // 7 + 1), 7)  # 7 is no K-tile multiple
    torch.testing.assert_close(gemm(odd, w2, precision="fp16x3"), gemm(odd.dense(), w2, precision="fp16x3"),
                               rtol=0, atol=0)
    empty = gemm(randn(0, 45, seed=1), w1, precision="fp16x3", split_output=True)
    assert empty.shape == (0, 70)


@pytest.mark.parametrize("value", [math.inf, math.nan])
@pytest.mark.parametrize("K,H", [(45, 70), (48, 72)])
def test_split_output_keeps_non_finite_values_in_their_rows(value, K, H):
    x, w1, w2 = randn(37, K, seed=1), randn(H, K, seed=2), randn(29, H, seed=3)
    x[5, 3] = value
    hidden = gemm(x, w1, precision="fp16x3", activation="gelu", split_output=True)
    out = gemm(hidden, w2, precision="fp16x3")
    assert not torch.isfinite(out[5]).any()
    keep = torch.arange(37, device=out.device) != 5
    x2 = x.clone()
    x2[5, 3] = 0.0
    assert torch.isfinite(out[keep]).all()
    assert relerr(out[keep], _ref(_ref(x2, w1, gelu=True).float(), w2)[keep]) <= FP32_ACCURATE


@pytest.mark.parametrize("K", KS)
def test_reruns_are_bitwise_equal(K):
    a, b, bias = randn(65, K, seed=1), randn(33, K, seed=2), randn(33, seed=3)
    first = gemm(a, b, bias, precision="fp16x3", slices=3)
    for _ in range(3):
        assert torch.equal(gemm(a, b, bias, precision="fp16x3", slices=3), first)


def test_plan_cuts_k_only_when_tiles_do_not_fill_the_gpu(monkeypatch):
    from elsa_vision.kernels import gemm as g
    from elsa_vision.kernels import host

    monkeypatch.setattr(host, "_device_info", lambda device=None: (132, (9, 0), 232448))
    g._plan.cache_clear()
    try:
        big = gemm_plan(12608, 2304, 768, "cpu")
        assert big.precision == "fp16x3" and big.slices == 1 and (big.block_m, big.block_n) == (128, 128)
        small = gemm_plan(768, 768, 12608, "cpu")  # 36 tiles: dW of a 768-wide projection
        assert small.slices > 1 and 36 * small.slices <= 2 * 132
        assert gemm_plan(64, 1000, 768, "cpu").slices > 1  # a classifier head on a small batch
        assert gemm_plan(0, 5, 8, "cpu").slices == 1 and gemm_plan(5, 5, 0, "cpu").slices == 1
        assert gemm_plan(12608, 2304, 768, "cpu", precision="tf32x3").precision == "tf32x3"
    finally:
        g._plan.cache_clear()


@pytest.mark.skipif(gemm_sm90 is None, reason="this Triton has no Gluon")
def test_plan_takes_the_hopper_loop_where_tma_can_load_the_parts(monkeypatch):
    from elsa_vision.kernels import gemm as g
    from elsa_vision.kernels import host

    for cc, K, precision, expected in [((9, 0), 768, "auto", True), ((9, 0), 8192, "fp16x3", True),
                                       ((9, 0), 775, "auto", False),  # rows of 1550 bytes: no TMA
                                       ((9, 0), 768, "tf32x3", False), ((8, 0), 768, "fp16x3", False)]:
        monkeypatch.setattr(host, "_device_info", lambda device=None, cc=cc: (132, cc, 232448))
        g._plan.cache_clear()
        try:
            plan = gemm_plan(12608, 2304, K, "cpu", precision=precision)
        finally:
            g._plan.cache_clear()
        assert plan.warp_specialized is expected, (cc, K, precision)
        if expected:
            assert (plan.block_m, plan.block_n, plan.block_k, plan.num_stages) == (128, 128, 64, 3)


@pytest.mark.skipif(gemm_sm90 is None, reason="this Triton has no Gluon")
def test_hopper_loop_splits_a_in_registers_for_narrow_products(monkeypatch):
    """A float32 ``a`` with rows contiguous and 16-byte aligned, or with columns contiguous and 16-byte
    aligned columns (``trans_a``), goes to the Hopper loop whole (no split pass) for products at most
    ``A_F32_MAX_N`` wide or at most ``A_F32_MAX_M`` rows long; longer and wider products, misaligned or
    overlapping ``a`` and the generic loop take the split pass."""
    from elsa_vision.kernels import gemm as g
    from elsa_vision.kernels import host

    def program(a, b):
        return g._GemmProgram(a, b, None, "auto", None, None, 0, False)

    monkeypatch.setattr(host, "_device_info", lambda device=None: (132, (9, 0), 232448))
    g._plan.cache_clear()
    try:
        x = torch.empty(g.A_F32_MAX_M + 8, 96)
        narrow, wide = torch.empty(g.A_F32_MAX_N, 96), torch.empty(g.A_F32_MAX_N + 8, 96)
        p = program(x, narrow)
        assert p.ws and p.a_f32 and p.split_a is None
        assert not program(x, wide).a_f32
        assert program(x[:g.A_F32_MAX_M], wide).a_f32  # few rows: in registers at any width
        p = program(x.t().contiguous().t(), narrow)  # columns contiguous: read transposed from shared memory
        assert p.a_f32 and p.trans_a and p.split_a is None
        assert program(x.t().contiguous().t(), torch.empty(g.A_T_MAX_N, 96)).trans_a  # its own limit
        assert not program(x.t().contiguous().t(), torch.empty(g.A_T_MAX_N + 8, 96)).a_f32
        assert not program(torch.empty(256 * 96 + 1)[1:].view(256, 96), narrow).a_f32  # 4-byte aligned
        assert not program(torch.empty(96, 257)[:, :256].t(), narrow).a_f32  # columns 1028 bytes apart
        assert not program(torch.empty(1, 96).expand(256, 96), narrow).a_f32  # rows overlap: no TMA
        assert not program(torch.empty(256, 100), torch.empty(64, 100)).a_f32  # K % 8: the generic loop
    finally:
        g._plan.cache_clear()


@pytest.mark.skipif(gemm_sm90 is None, reason="this Triton has no Gluon")
def test_hopper_loop_reads_transposed_operands_as_stored(monkeypatch):
    """The products of a linear layer's backward on the Hopper loop: the weight gradient ``dy.T @ x`` splits
    ``dy.T`` in registers (``trans_a``) and ``x.T`` into parts in its own layout (``trans_b``), with no
    transposed copy; a weight gradient wider than ``A_T_MAX_N`` with at most that many rows is computed
    transposed (``swap``); the input gradient ``dy @ w`` splits ``w.T`` in its own layout. Misaligned or
    odd-width transposed operands keep the transposing split."""
    from elsa_vision.kernels import gemm as g
    from elsa_vision.kernels import host

    def program(a, b, bias=None):
        return g._GemmProgram(a, b, bias, "auto", None, None, 0, False)

    monkeypatch.setattr(host, "_device_info", lambda device=None: (132, (9, 0), 232448))
    g._plan.cache_clear()
    try:
        T = 1024
        x, dy, w = torch.empty(T, 768), torch.empty(T, 2304), torch.empty(2304, 768)  # qkv-like: 768 -> 2304
        p = program(dy.t(), x.t())  # its weight gradient, 2304 x 768
        assert (p.trans_a, p.trans_b, p.swap, p.split_a) == (True, True, False, None)
        assert not p.split_b.transpose
        h, dh = torch.empty(T, 3072), torch.empty(T, 768)  # fc2-like: 3072 -> 768
        p = program(dh.t(), h.t())  # its weight gradient, 768 x 3072
        assert (p.swap, p.trans_a, p.trans_b) == (True, True, True)
        assert p.sizes == (768, 3072, T)  # the caller's orientation, for the output
        assert not program(dh.t(), h.t(), torch.empty(3072)).swap  # a bias belongs to C's columns
        p = program(dy, w.t())  # the input gradient dy @ w
        assert p.trans_b and not p.split_b.transpose and p.a_f32 and not p.trans_a
        assert not program(x, w).trans_b  # the forward: w's rows are K-contiguous already
        xl, dyl = torch.empty(T, 1024), torch.empty(T, 3072)  # ViT-L's qkv: 1024 -> 3072
        assert program(dyl.t(), xl.t()).trans_a  # 1024 wide: A_T_MAX_N, wider than A_F32_MAX_N
        odd = torch.empty(T, 770)
        p = program(x.t(), odd.t())  # 770 % 8: parts rows of 1540 bytes, no TMA for B
        assert p.trans_a and not (p.swap or p.trans_b) and p.split_b.transpose
        misaligned = torch.empty(T * 2304 + 1)[1:].view(T, 2304)
        p = program(misaligned.t(), x.t())
        assert not p.trans_a and p.split_a.transpose and p.trans_b
    finally:
        g._plan.cache_clear()


_HOPPER_COMPILE = """
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource
from triton.runtime.jit import mangle_type
from elsa_vision.kernels import gemm_sm90

fn = gemm_sm90.gemm_ws_kernel
desc = mangle_type(gemm_sm90.parts_descriptor(torch.empty((2, 256, 128), dtype=torch.float16), 128, 64))
desc_t = mangle_type(gemm_sm90.parts_t_descriptor(torch.empty((2, 256, 128), dtype=torch.float16), 64, 128))
f32 = mangle_type(gemm_sm90.f32_descriptor(torch.empty((256, 128), dtype=torch.float32), 128, 64))
f32_t = mangle_type(gemm_sm90.f32_t_descriptor(torch.empty((256, 128), dtype=torch.float32).t(), 64, 128))
report = []
plain = dict(TRANS_A=False, TRANS_B=False)
for flags in [dict(HAS_BIAS=True, ACTIVATION=None, A_GROUP=0, SPLIT_OUT=False, A_F32=False, **plain),
              dict(HAS_BIAS=True, ACTIVATION="gelu", A_GROUP=128, SPLIT_OUT=True, A_F32=False, **plain),
              dict(HAS_BIAS=False, ACTIVATION="gelu", A_GROUP=0, SPLIT_OUT=True, A_F32=True, **plain),
              dict(HAS_BIAS=False, ACTIVATION=None, A_GROUP=0, SPLIT_OUT=False, A_F32=True, TRANS_A=True,
                   TRANS_B=True),
              dict(HAS_BIAS=False, ACTIVATION=None, A_GROUP=0, SPLIT_OUT=False, A_F32=False, TRANS_A=False,
                   TRANS_B=True)]:
    a = (f32_t if flags["TRANS_A"] else f32) if flags["A_F32"] else desc
    sig = {name: "i32" for name in fn.arg_names}
    sig.update(a_desc=a, A_EXP="*i32", b_desc=desc_t if flags["TRANS_B"] else desc, B_EXP="*i32",
               Bias="*fp32", C="*fp16" if flags["SPLIT_OUT"] else "*fp32", C_EXP="*i32")
    consts = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, STAGES=3, **flags)
    sig.update({name: "constexpr" for name in consts})
    kernel = triton.compile(GluonASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": gemm_sm90.NUM_WARPS})
    ptx = kernel.asm["ptx"]
    report.append(dict(wgmma=ptx.count("wgmma.mma_async"), setmaxnreg="setmaxnreg" in ptx,
                       tma=ptx.count("cp.async.bulk.tensor"), shared=kernel.metadata.shared))
print(json.dumps(report))
"""


@pytest.mark.skipif(gemm_sm90 is None, reason="this Triton has no Gluon")
def test_hopper_loop_compiles_for_sm90_warp_specialised():
    # Built for sm90 on any machine (no GPU needed): partitions with their own register budgets (setmaxnreg),
    # TMA loads, the three products of both consumer warpgroups as wgmma (3 x 4 K-steps of 16 each; with A
    # split in registers, six products of two K-steps each), the stages within the H100's shared memory,
    # for the float16 parts of A, for A in float32, and for transposed operands (A's storage tiles and B's
    # N-major parts, 256-byte rows: two 128-byte TMA boxes per tile). The GPU tests run it.
    variants = compile_for_sm90(_HOPPER_COMPILE)
    assert len(variants) == 5
    for variant in variants:
        assert variant["setmaxnreg"] and variant["tma"], variant
        assert variant["wgmma"] == 2 * 3 * 4 and variant["shared"] <= 232448, variant
    assert [v["tma"] for v in variants] == [4, 4, 4, 8, 6]


# ------------------------------------------------------------------------------------------------- GPU


def _torch_fp32(a, b):
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        return a @ b.t()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(12608, 2304, 768), (12608, 768, 3072), (3137, 771, 775),
                                   (197, 4096, 8192), (2304, 768, 12608), (64, 1000, 768)])
@pytest.mark.parametrize("precision", ["auto", "tf32x3"])
def test_gpu_at_most_torch_fp32_error(M, N, K, precision):
    a, b = randn(M, K, seed=5), randn(N, K, seed=6)
    ref = _ref(a, b)
    ours = relerr(gemm(a, b, precision=precision), ref)
    theirs = relerr(_torch_fp32(a, b), ref)
    assert ours <= max(theirs, 2e-7) and ours <= FP32_ACCURATE, (ours, theirs)


@pytest.mark.gpu
def test_gpu_split_and_strided_inputs_match_contiguous():
    x, w = randn(3137, 768, seed=7), randn(2304, 768, seed=8)
    dense = gemm(x, w, precision="auto")
    xt = x.t().contiguous().t()
    assert torch.equal(gemm(xt, w, precision="auto"), dense)  # split copies make the product layout-blind
    dy = randn(3137, 2304, seed=9)
    assert relerr(gemm(dy.t(), x.t(), precision="auto"), _ref(dy.t(), x.t())) <= FP32_ACCURATE


@pytest.mark.gpu
@pytest.mark.parametrize("M,N,K", [(12611, 768, 768), (12611, 3072, 768), (12611, 768, 3072)])
def test_gpu_programs_keep_no_operand_alive(M, N, K):
    # A cached program (its TMA descriptors on sm90) must not hold a call's operands or their float16 parts
    # once the call returns: with the result dropped, the allocated memory is back where it was (such held
    # operands are the likely cause of 3.4 GB more peak in the FP32 VGGT aggregator at 100 frames). M = 12611
    # keeps the signature unique in the test process, so the first call builds the program.
    a, b = randn(M, K, seed=10), randn(N, K, seed=11)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    for _ in range(2):  # the call that builds the program, and a call through it
        out = gemm(a, b, precision="auto")
        del out
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == before


@pytest.mark.gpu
@pytest.mark.parametrize("T,fin,fout", [(12608, 768, 2304), (12608, 3072, 768), (6304, 4096, 1024),
                                        (3136, 768, 771), (1000, 96, 384), (1000, 384, 96)])
def test_gpu_linear_backward_products_at_most_torch_fp32_error(T, fin, fout):
    # dW = dy.T @ x and dX = dy @ w of a linear layer fin -> fout, transposed operands as autograd passes
    # them: on an H100 the Hopper loop reads them as stored (dy.T split in registers, x.T and w.T split in
    # their own layout; fc2-like weight gradients computed transposed), 771 outputs keep the transposing
    # split for dy.T; every K-slice count lands on the same error
    x, w, dy = randn(T, fin, seed=12), randn(fout, fin, seed=13), randn(T, fout, seed=14)
    for a, b in ((dy.t(), x.t()), (dy, w.t())):
        ref = _ref(a, b)
        ours, theirs = relerr(gemm(a, b, precision="auto"), ref), relerr(_torch_fp32(a, b), ref)
        assert ours <= max(theirs, 2e-7) and ours <= FP32_ACCURATE, (a.shape, b.shape, ours, theirs)
    ref = _ref(dy.t(), x.t())
    for slices in (2, 5):
        out = gemm(dy.t(), x.t(), precision="auto", slices=slices)
        assert out.shape == (fout, fin) and out.is_contiguous()
        assert relerr(out, ref) <= FP32_ACCURATE, slices


@pytest.mark.gpu
@pytest.mark.parametrize("fin,fout", [(768, 2304), (3072, 768)])
def test_gpu_weight_gradient_keeps_non_finite_values_in_their_row_and_column(fin, fout):
    # an infinity in dy makes one row of dW non-finite, a NaN in x one column; the rest stays exact (the
    # in-register scale is per row and K-step, the parts' per column)
    T = 2048
    x, dy = randn(T, fin, seed=15), randn(T, fout, seed=16)
    dy[100, 7], x[900, 3] = float("inf"), float("nan")
    out = gemm(dy.t(), x.t(), precision="auto")
    assert not torch.isfinite(out[7]).any() and torch.isnan(out[:, 3]).all()
    keep_r = torch.arange(fout, device=DEVICE) != 7
    keep_c = torch.arange(fin, device=DEVICE) != 3
    clean = out[keep_r][:, keep_c]
    assert torch.isfinite(clean).all()
    dy[100, 7], x[900, 3] = 0.0, 0.0
    assert relerr(clean, _ref(dy.t(), x.t())[keep_r][:, keep_c]) <= FP32_ACCURATE


@pytest.mark.gpu
@pytest.mark.parametrize("fin,fout", [(768, 2304), (3072, 768)])
def test_gpu_weight_gradient_magnitudes(fin, fout):
    # the transposed operands read as stored keep the split's magnitude rules: tiny and huge scales of the
    # whole product, and rows (dy's columns) and columns (x's) of very different magnitude, each within 2^-20
    # of its own dot product's scale (sum_t |dy_ti| |x_tj|)
    T = 1024
    for scale_dy, scale_x in ((1e-30, 1.0), (1e25, 1e-20), (1e-38, 1e3)):
        x, dy = randn(T, fin, seed=17, scale=scale_x), randn(T, fout, seed=18, scale=scale_dy)
        ref = _ref(dy.t(), x.t())
        assert torch.isfinite(ref).all()
        assert relerr(gemm(dy.t(), x.t(), precision="auto"), ref) <= FP32_ACCURATE, (scale_dy, scale_x)
    x, dy = randn(T, fin, seed=19), randn(T, fout, seed=20)
    dy[:, 3] *= 1e-20
    dy[:, 5] *= 1e20
    x[:, 2] *= 1e15
    out = gemm(dy.t(), x.t(), precision="auto")
    bound = dy.double().abs().t() @ x.double().abs()
    assert ((out.double() - _ref(dy.t(), x.t())).abs() <= 2.0 ** -20 * bound).all()
