"""FP32-accurate matrix products in Triton: ``C = A @ B^T (+ bias)`` for float32 operands on tensor cores.

The GEMM family sibling of the attention kernels, at the same float32 precisions (``kernels.precision``):

* ``"fp16x3"`` (what ``"auto"`` picks on sm90): each operand is first split (``split_rows``, one memory-bound
  pass) into two float16 parts scaled by a power of two per row, ``x * 2**c == hi + lo`` to 22 bits (the
  Hopper loop splits a row-contiguous ``A`` of a product at most ``A_F32_MAX_N`` wide, or of at most
  ``A_F32_MAX_M`` rows, in its own registers instead, one scale per row and K-step); the product loop then
  runs on half-precision tensor cores alone: three products per K-tile (``dots.matmul_f16x3``) into a fresh
  float32 accumulator that is added to the running sum in IEEE float32. The tensor core's own accumulation is
  not IEEE-rounded and its error grows with K (measured: 1e-5 at K = 8192 when every K-tile accumulates
  through it); one fresh accumulator per K-tile keeps the result below PyTorch's FP32 GEMM error at any K. The
  row scales are undone exactly in the epilogue. On sm90, products with ``K % 8 == 0`` run this loop
  warp-specialised (``kernels.gemm_sm90``), the others here;
* ``"tf32x3"`` (``"auto"`` on other sm80+ GPUs): Triton's three-product TF32 split of float32 tiles;
* ``"ieee"``: plain FP32 FMA (no tensor cores); ``"tf32"``: one TF32 pass (~1e-3).

Both operands are given as rows over the reduction dim, ``A [M, K]`` and ``B [N, K]`` (``B`` is the weight
of a linear layer as stored), any strides: ``x @ w.T``, ``dy @ w`` and ``dy.T @ x`` are all this product with
transposed views. The epilogue adds a bias and applies an exact (erf) GELU where asked. When the output tiles
alone do not fill the GPU, K is cut into slices whose partial products go to a float32 workspace and are
summed in a fixed order (``_sum_slices_kernel``, which adds the bias): reruns are bitwise equal.

Range (``"fp16x3"``): a row's largest magnitude is scaled into ``[2^14, 2^15)``; the other elements of the row
keep 22 significant bits down to ``2^-25`` of it, and an absolute ``2^-39`` of it below that. A K-tile's
partial product of scaled rows is at most ``2^30 * BLOCK_K`` and is added unscaled by the row scales, so
operands up to about ``1e30`` in magnitude are exact (where the Hopper loop splits ``A`` itself, each K-step's
row scales are undone at once and the running sum holds ``|A| * 2^15`` per term: ``|A|`` up to about ``1e30``
at K = 3072, ``3e29`` at K = 8192). A non-finite element makes its output row (of ``A``)
or column (of ``B``) non-finite and leaves the others untouched.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dots import f16_pair, gemm_epilogue, matmul_f16x3, pow2, scale_exponent, store_split
from .host import canonical_device, cdiv, device_info, next_pow2, version_state
from .launch import Launch, Program, ProgramCache, install_config
from .precision import resolve_precision

try:  # Gluon (Triton 3.5 and later): the warp-specialised Hopper loop
    from . import gemm_sm90
except ImportError:  # pragma: no cover - an older Triton: the generic loop everywhere
    gemm_sm90 = None

__all__ = ["GemmPlan", "SplitOperand", "gemm", "gemm_plan", "split_rows", "ACTIVATIONS"]

ACTIVATIONS = (None, "gelu")


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _gemm_kernel(
    A, A_EXP, B, B_EXP, Bias, C, C_EXP,
    M, N, K, k_per_slice, a_lo, b_lo, c_lo,
    stride_am, stride_ak, stride_ae, stride_bn, stride_bk, stride_bias, stride_cs, stride_cm, stride_cn,
    stride_ce,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    PRECISION: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr,
    A_GROUP: tl.constexpr, SPLIT_OUT: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of ``C = A @ B^T`` over K-slice ``program_id(1)`` (``stride_cs``
    apart).

    ``"fp16x3"``: ``A`` and ``B`` hold the float16 parts of the operands (high parts, the low parts ``a_lo``
    / ``b_lo`` elements further) and ``A_EXP`` / ``B_EXP`` the int32 exponents of their scales: one per row
    (``split_rows``; ``A_GROUP == 0``), or for ``A`` one per row and ``A_GROUP`` columns (``A_EXP [M, K /
    A_GROUP]``, ``stride_ae`` apart: a ``SplitOperand`` that a product wrote), undone per K-step; otherwise
    ``A`` and ``B`` are float32 and the exponent pointers unused. ``SPLIT_OUT``: the tile is stored as a
    ``SplitOperand`` (float16 parts in ``C``, the low ones ``c_lo`` further, one exponent per row in
    ``C_EXP``, column ``pid_n`` of ``stride_ce``). Grouped program order: ``GROUP_M`` row-tiles share each
    column-tile while it sits in L2.
    """
    pid = tl.program_id(0)
    pid_s = tl.program_id(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    # Rows past the edge read row 0 again (no masks in the loop); they are not stored.
    rows = tl.where(offs_m < M, offs_m, 0).to(tl.int64)
    cols = tl.where(offs_n < N, offs_n, 0).to(tl.int64)
    k_start = pid_s * k_per_slice
    k_end = tl.minimum(K, k_start + k_per_slice)
    a_off = rows[:, None] * stride_am + (k_start + offs_k)[None, :].to(tl.int64) * stride_ak
    b_off = (k_start + offs_k)[:, None].to(tl.int64) * stride_bk + cols[None, :] * stride_bn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            a = tl.load(A + a_off)
            b = tl.load(B + b_off)
        else:
            a = tl.load(A + a_off, mask=(k0 + offs_k)[None, :] < k_end, other=0.0)
            b = tl.load(B + b_off, mask=(k0 + offs_k)[:, None] < k_end, other=0.0)
        if PRECISION == "fp16x3":
            if EVEN_K:
                a2 = tl.load(A + a_lo + a_off)
                b2 = tl.load(B + b_lo + b_off)
            else:
                a2 = tl.load(A + a_lo + a_off, mask=(k0 + offs_k)[None, :] < k_end, other=0.0)
                b2 = tl.load(B + b_lo + b_off, mask=(k0 + offs_k)[:, None] < k_end, other=0.0)
            fresh = matmul_f16x3(a, a2, b, b2, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
            if A_GROUP > 0:  # BLOCK_K divides A_GROUP: one exponent per row over this K-step
                acc += fresh * pow2(-tl.load(A_EXP + rows * stride_ae + k0 // A_GROUP))[:, None]
            else:
                acc += fresh
        elif PRECISION == "ieee":
            # a plain add would be folded back into the FMA dot (every product added to the running sum)
            acc = tl.fma(tl.dot(a, b, tl.zeros_like(acc), input_precision="ieee"), 1.0, acc)
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        a_off += BLOCK_K * stride_ak
        b_off += BLOCK_K * stride_bk

    acc = gemm_epilogue(acc, A_EXP, B_EXP, Bias, rows, cols, stride_bias,
                        PRECISION == "fp16x3" and A_GROUP == 0, PRECISION == "fp16x3", HAS_BIAS, ACTIVATION)
    if SPLIT_OUT:
        store_split(C, C_EXP, acc, offs_m, offs_n, M, N, c_lo, stride_ce, pid_n)
    else:
        c_ptrs = C + pid_s.to(tl.int64) * stride_cs + offs_m[:, None].to(tl.int64) * stride_cm \
            + offs_n[None, :].to(tl.int64) * stride_cn
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@triton.jit
def _sum_slices_kernel(
    P, Bias, C, C_EXP,
    M, N, stride_ps, stride_pm, stride_bias, stride_cm, stride_cn, c_lo, stride_ce,
    SLICES: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, SPLIT_OUT: tl.constexpr,
):
    """``C = act(sum_s P[s] + bias)``, the slices added in order (``P`` float32 ``[SLICES, M, N]``, rows
    contiguous); ``SPLIT_OUT``: stored as ``_gemm_kernel`` stores it (``BLOCK_N`` columns per exponent)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    ptrs = P + offs_m[:, None].to(tl.int64) * stride_pm + offs_n[None, :]
    acc = tl.load(ptrs, mask=mask, other=0.0)
    for s in tl.static_range(1, SLICES):
        acc += tl.load(ptrs + s * stride_ps, mask=mask, other=0.0)
    cols = tl.where(offs_n < N, offs_n, 0)  # columns past the edge read column 0's bias; not stored
    acc = gemm_epilogue(acc, C_EXP, C_EXP, Bias, offs_m, cols, stride_bias, False, False, HAS_BIAS,
                        ACTIVATION)
    if SPLIT_OUT:
        store_split(C, C_EXP, acc, offs_m, offs_n, M, N, c_lo, stride_ce, tl.program_id(1))
    else:
        tl.store(C + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :].to(tl.int64) * stride_cn,
                 acc.to(C.dtype.element_ty), mask=mask)


@triton.jit
def _split_rows_kernel(
    X, PARTS, EXP,
    R, L, lo, stride_xr, stride_xl,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, ONE_PASS: tl.constexpr,
):
    """Split rows ``r`` of float32 ``X [R, L]`` (one scale over each whole row): float16 ``PARTS [2, R, L]``
    (the low parts ``lo`` elements after the high ones) and int32 exponents ``EXP [R]``:
    ``X[r] * 2**EXP[r] == PARTS[0, r] + PARTS[1, r]`` to 22 bits.
    ``ONE_PASS``: a row fits one ``BLOCK_L`` tile (read once); otherwise the rows are read twice (their
    largest magnitude, then the split)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    r_ok = offs_r < R
    x_ptrs = X + offs_r[:, None].to(tl.int64) * stride_xr + offs_l[None, :].to(tl.int64) * stride_xl
    out = offs_r[:, None].to(tl.int64) * L + offs_l[None, :]
    if ONE_PASS:
        mask = r_ok[:, None] & (offs_l[None, :] < L)
        x = tl.load(x_ptrs, mask=mask, other=0.0)
        amax = tl.max(tl.abs(x), 1)
    else:
        amax = tl.zeros([BLOCK_R], dtype=tl.float32)
        for l0 in range(0, L, BLOCK_L):
            x = tl.load(x_ptrs + l0 * stride_xl, mask=r_ok[:, None] & ((l0 + offs_l)[None, :] < L), other=0.0)
            amax = tl.maximum(amax, tl.max(tl.abs(x), 1))
    c = scale_exponent(amax)
    tl.store(EXP + offs_r, c, mask=r_ok)
    scale = pow2(c)[:, None]
    if ONE_PASS:
        hi, low = f16_pair(x * scale)
        tl.store(PARTS + out, hi, mask=mask)
        tl.store(PARTS + lo + out, low, mask=mask)
    else:
        for l0 in range(0, L, BLOCK_L):
            mask = r_ok[:, None] & ((l0 + offs_l)[None, :] < L)
            x = tl.load(x_ptrs + l0 * stride_xl, mask=mask, other=0.0)
            hi, low = f16_pair(x * scale)
            tl.store(PARTS + out + l0, hi, mask=mask)
            tl.store(PARTS + lo + out + l0, low, mask=mask)


@triton.jit
def _column_amax_kernel(
    X, PARTIAL,
    R, L, rows_per_chunk, stride_xl,
    BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr,
):
    """Largest magnitudes of the columns ``r`` of ``X [L, R]`` (columns contiguous) over chunk
    ``program_id(1)`` of its rows: ``PARTIAL [chunks, R]`` float32 (read by ``_split_columns_kernel``)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_l = tl.arange(0, BLOCK_L)
    l_start = tl.program_id(1) * rows_per_chunk
    l_end = tl.minimum(L, l_start + rows_per_chunk)
    r_ok = offs_r < R
    amax = tl.zeros([BLOCK_R], dtype=tl.float32)
    for l0 in range(l_start, l_end, BLOCK_L):
        rows = l0 + offs_l
        x = tl.load(X + rows[:, None].to(tl.int64) * stride_xl + offs_r[None, :],
                    mask=(rows[:, None] < l_end) & r_ok[None, :], other=0.0)
        amax = tl.maximum(amax, tl.max(tl.abs(x), 0))
    tl.store(PARTIAL + tl.program_id(1) * R + offs_r, amax, mask=r_ok)


@triton.jit
def _split_columns_kernel(
    X, PARTIAL, PARTS, EXP,
    R, L, lo, stride_xl,
    CHUNKS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_L: tl.constexpr, TRANSPOSE: tl.constexpr,
):
    """Split the columns ``r`` of ``X [L, R]`` (columns contiguous; one scale per column, from the ``CHUNKS``
    partial maxima) into float16 parts (the low parts ``lo`` elements after the high ones) and int32
    ``EXP [R]``. ``TRANSPOSE``: ``PARTS [2, R, L]``, each column's parts contiguous, a transpose on the way,
    read and written along the contiguous dims (the generic product loop's operands must be K-contiguous:
    Triton's loads of transposed float16 operands measured 2-3x slower there); otherwise ``PARTS [2, L, R]``,
    stored as ``X`` is (the Hopper loop reads them N-major: ``gemm_sm90``'s ``TRANS_B``)."""
    offs_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    offs_l = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
    r_ok = offs_r < R
    chunks = tl.arange(0, CHUNKS)
    c = scale_exponent(tl.max(tl.load(PARTIAL + chunks[:, None] * R + offs_r[None, :], mask=r_ok[None, :],
                                      other=0.0), 0))
    if tl.program_id(1) == 0:
        tl.store(EXP + offs_r, c, mask=r_ok)
    mask = (offs_l[:, None] < L) & r_ok[None, :]
    rows = offs_l[:, None].to(tl.int64)
    x = tl.load(X + rows * stride_xl + offs_r[None, :], mask=mask, other=0.0)
    hi, low = f16_pair(x * pow2(c)[None, :])
    if TRANSPOSE:
        out = offs_r[None, :].to(tl.int64) * L + rows
    else:
        out = rows * R + offs_r[None, :]
    tl.store(PARTS + out, hi, mask=mask)
    tl.store(PARTS + lo + out, low, mask=mask)


# --------------------------------------------------------------------------------------------- planner


@dataclasses.dataclass(frozen=True)
class GemmPlan:
    """How one product runs: the product loop's tiles, warps and stages, its K slices (1: the epilogue writes
    ``C``), the resolved precision, and whether the loop is the warp-specialised Hopper kernel
    (``kernels.gemm_sm90``: ``"fp16x3"`` on sm90 with ``K % 8 == 0``, the TMA row alignment)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    group_m: int
    slices: int
    precision: str
    warp_specialized: bool = False


# The Hopper loop reads a float32 ``a`` (rows contiguous, 16-byte aligned) through TMA and splits it in its
# consumers' registers, one scale per row and K-step (``A_F32``: no split pass), for products at most this
# wide. H100, against the split pass (docs/kernel_notes.md, "FP32-accurate GEMM"): 1.22-1.28x at Swin-v2's
# first stage (N = 288, 384; K = 96), 1.07-1.08x at N = 576-768, 0.98-1.00x at N = 768-1152 with K >= 384,
# 0.81-0.91x at N >= 2304, where the products are compute-bound and the split lengthens each consumer's step.
A_F32_MAX_N = 768
# ... and for products of at most this many rows whatever their width (two row tiles: a single image's
# tokens). There the split pass is a launch and two allocations of its own for a product of a few µs, and
# the host's time decides an eager call. H100, ViT-B/16 float32 at batch 1 (197 rows; 2026-11-28, CUDA-graph
# ms of the whole forward): 1.274 in registers at every width against 1.278 with the split pass above 768.
A_F32_MAX_M = 256
# The same for a transposed ``a`` (columns contiguous: ``TRANS_A``), whose alternative is a column-maxima pass
# and a transposing split. H100, whole weight gradients (2026-11-27): 1024 wide 1.19x faster in registers
# (ViT-L qkv 3072x1024, K = 6304: 0.314 -> 0.257 ms), 768 wide equal, 3072-4096 wide 0.78-0.84x (those
# with at most this many rows are computed transposed instead: ``swap``).
A_T_MAX_N = 1024

# (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) by resolved precision (H100 measurements: docs/kernel_notes.md,
# "FP32-accurate GEMM"); the interpreter takes small tiles.
_CONFIGS = {
    "fp16x3": (128, 128, 64, 8, 3),
    "tf32x3": (128, 128, 32, 8, 3),
    "tf32": (128, 128, 32, 8, 3),
    "ieee": (64, 64, 32, 4, 3),
}
_TUNED: dict = {}


def set_config(precision: str, config: tuple | None) -> None:
    """Install (or with None remove) the (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) of a resolved precision
    (the benchmarks' sweeps use it)."""
    install_config(_TUNED, precision, config, _plan, _PROGRAMS)


def gemm_plan(M: int, N: int, K: int, device=None, precision: str = "auto", slices: int | None = None,
              ) -> GemmPlan:
    """The plan of a float32 ``[M, K] @ [N, K]^T`` on ``device`` (None: this machine's GPU, else the CPU)."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return _plan(M, N, K, canonical_device(device), precision, slices)


@functools.lru_cache(maxsize=1024)
def _plan(M, N, K, device, precision, slices) -> GemmPlan:
    sms, cc, _ = device_info(device)
    prec = resolve_precision(precision, torch.float32, device, "gemm")
    bm, bn, bk, warps, stages = _TUNED.get(prec) or _CONFIGS[prec]
    ws = prec == "fp16x3" and cc == (9, 0) and K % 8 == 0 and gemm_sm90 is not None and "fp16x3" not in _TUNED
    if ws:  # H100 measurements: docs/kernel_notes.md, "FP32-accurate GEMM"
        bm, bn, bk, warps, stages = 128, 128, 64, gemm_sm90.NUM_WARPS, 3
    if cc == (0, 0):  # the CPU interpreter: small tiles, no pipelining
        bm, bn, bk, warps, stages = 32, 32, 16, 4, 1
    tiles = max(1, cdiv(M, bm) * cdiv(N, bn))
    k_tiles = max(1, cdiv(K, bk))
    if slices is None and ws:
        slices = _balanced_slices(tiles, k_tiles, M * N, sms)
    if slices is None:
        # Fewer output tiles than half the SMs: cut K so that tiles x slices fills the machine (partial
        # products summed after), as long as each slice keeps at least 4 K-tiles.
        slices = 1
        if 2 * tiles <= sms and cc != (0, 0):
            slices = max(1, min(cdiv(sms, tiles), k_tiles // 4, 16))
    slices = max(1, min(int(slices), k_tiles))
    slices = cdiv(k_tiles, cdiv(k_tiles, slices))  # no empty slice
    return GemmPlan(bm, bn, bk, warps, stages, 8, slices, prec, ws)


def _balanced_slices(tiles: int, k_tiles: int, outputs: int, sms: int) -> int:
    """K slices for the persistent Hopper loop: the fewest K-steps on the busiest SM (work items over SMs,
    rounded up, times K-steps per item; 144 tiles on 132 SMs would take two full rounds for 1.09 rounds of
    work), counting the partial sums' float32 round trip (``8 * slices`` bytes per output) in K-steps of
    1.46 us at 2.5 TB/s (H100: a 128x128x64 step at ~190 TFLOP/s). Each slice keeps at least 4 K-tiles.
    Slices must save a tenth: the ViT-B qkv weight gradient (108 tiles, 197 K-steps), predicted 5% faster
    in 6 slices, measured 5% slower."""
    whole = cdiv(tiles, sms) * k_tiles
    best, best_cost = 1, 0.9 * whole
    for s in range(2, 17):
        if k_tiles // s < 4:
            break
        cost = cdiv(tiles * s, sms) * cdiv(k_tiles, s) + 8 * s * outputs / 2.5e12 / 1.46e-6
        if cost < best_cost:
            best, best_cost = s, cost
    return best


def _split_config(R: int, L: int, interpreted: bool) -> tuple[int, int, bool, int]:
    """(BLOCK_R, BLOCK_L, one pass, warps) of the row split of ``[R, L]`` (rows contiguous): whole rows in
    one tile where they fit 8192 elements (read once), else two passes over 1024-wide pieces."""
    if interpreted:
        return 4, 16, False, 4
    width = next_pow2(L)
    if width <= 4096:
        return max(1, 8192 // width), width, True, 8 if width >= 2048 else 4
    return 8, 1024, False, 8


# --------------------------------------------------------------------------------------------- launchers


class _Split:
    """The launches that split the rows of one ``[R, L]`` float32 operand layout (``split_rows``):

    * rows contiguous: one kernel (``_split_rows_kernel``), parts stored ``[2, R, L]``;
    * columns contiguous (a transposed view, such as a weight gradient's ``dy.T``): the column maxima in
      chunks of rows (``_column_amax_kernel``), then the split (``_split_columns_kernel``), transposed on the
      way, or with ``transpose=False`` stored as the operand is, ``[2, L, R]`` (the Hopper loop's
      ``TRANS_B``);
    * other strides: copied to rows-contiguous first.
    """

    def __init__(self, shape, strides, device, interpreted: bool, transpose: bool = True):
        R, L = shape
        self.R, self.L, self.device = R, L, device
        self.copy = not (strides[1] == 1 or L == 1 or strides[0] == 1)
        self.columns = not self.copy and strides[1] != 1 and L > 1
        self.transpose = transpose or not self.columns
        if not self.columns:
            br, bl, one, warps = _split_config(R, L, interpreted)
            rs, cs = (L, 1) if self.copy else strides
            self.launch = Launch(_split_rows_kernel, (cdiv(R, br),), (R, L, R * L, rs, cs),
                                 dict(BLOCK_R=br, BLOCK_L=bl, ONE_PASS=one), warps)
            return
        sms = device_info(device)[0]
        br, bl = (16, 16) if interpreted else (64, 64)
        chunks = 1  # enough row chunks for about four programs per SM, at least two tiles of rows each
        while chunks < 32 and cdiv(R, br) * chunks < 4 * sms and L >= 4 * chunks * bl:
            chunks *= 2
        self.chunks = chunks
        self.amax = Launch(_column_amax_kernel, (cdiv(R, br), chunks), (R, L, cdiv(L, chunks), strides[1]),
                           dict(BLOCK_R=br, BLOCK_L=bl), 4)
        bl2 = 16 if interpreted else 256
        self.split = Launch(_split_columns_kernel, (cdiv(R, br), cdiv(L, bl2)), (R, L, R * L, strides[1]),
                            dict(CHUNKS=chunks, BLOCK_R=br, BLOCK_L=bl2, TRANSPOSE=transpose),
                            8 if bl2 >= 256 else 4)

    def __call__(self, x: Tensor) -> tuple[Tensor, Tensor]:
        R, L, dev = self.R, self.L, self.device
        exp = torch.empty((R,), dtype=torch.int32, device=dev)
        parts = torch.empty((2, R, L) if self.transpose else (2, L, R), dtype=torch.float16, device=dev)
        if not self.columns:
            self.launch(x.contiguous() if self.copy else x, parts, exp)
            return parts, exp
        partial = torch.empty((self.chunks, R), dtype=torch.float32, device=dev)
        self.amax(x, partial)
        self.split(x, partial, parts, exp)
        return parts, exp


class _Splits:
    """The split parts of ``b`` operands kept from one product to the next (``gemm(..., reuse_b=True)``):
    the weights of inference products, split once instead of at every call.

    An entry belongs to one tensor (by ``id``, with a weak reference: it goes when the tensor goes) and
    holds the parts of its values at one version of its storage (``Tensor._version``, which every in-place
    change through the tensor or a view of it advances), address, shape, strides and split layout; a call
    that finds any of them changed splits again and replaces the entry. Writes that bypass the version
    counter (through ``tensor.data``) are not seen: a caller reusing splits promises none happen. Views
    are not kept (a new view object per call would only churn), nor inference tensors (a model built under
    ``torch.inference_mode``: no version counter), and nothing is kept or reused while a CUDA graph is
    being captured (the graph then splits at every replay, as it reads the weight then). A kept
    entry costs the weight's own size in GPU memory (two float16 parts and an int32 scale per row)."""

    def __init__(self):
        self._entries: dict = {}

    def __call__(self, b: Tensor, split: _Split) -> tuple[Tensor, Tensor]:
        version = version_state(b)
        if version is None:  # an inference tensor, or a graph (which splits at every replay)
            return split(b)
        key = id(b)
        entry = self._entries.get(key)
        state = (version, b.shape, b.stride(), split.transpose)
        if entry is not None and entry[0]() is b and entry[1] == state:
            return entry[2]
        parts = split(b)
        if b._base is None:
            ref = entry[0] if entry is not None and entry[0]() is b else weakref.ref(
                b, lambda _, key=key, entries=self._entries: entries.pop(key, None))
            self._entries[key] = (ref, state, parts)
        return parts

    def drop(self, b: Tensor) -> None:
        """Forget ``b``'s parts (a training product, whose weights change every step)."""
        if self._entries:
            entry = self._entries.get(id(b))
            if entry is not None and entry[0]() is b:
                del self._entries[id(b)]

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


_SPLITS = _Splits()


def split_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """``(parts, exp)`` of float32 ``x [R, L]`` (any strides): one power-of-two scale per row, float16
    ``parts [2, R, L]`` (contiguous) with ``x[r] * 2**exp[r] == parts[0, r] + parts[1, r]`` to 22 bits, int32
    ``exp [R]``."""
    R, L = x.shape
    if R == 0 or L == 0:
        return (torch.empty((2, R, L), dtype=torch.float16, device=x.device),
                torch.empty((R,), dtype=torch.int32, device=x.device))
    return _Split(x.shape, x.stride(), x.device, not x.is_cuda)(x)


class SplitOperand(NamedTuple):
    """A float32 ``[R, L]`` matrix held as the float16 parts a product's epilogue wrote
    (``gemm(..., split_output=True)``), which the next product reads as its ``a`` with no split pass:
    ``x[r, l] * 2**exp[r, l // group] == parts[0, r, l] + parts[1, r, l]`` to 22 bits, float16
    ``parts [2, R, L]`` (contiguous) and int32 ``exp [R, cdiv(L, group)]``: one scale per row and ``group``
    columns (finer than ``split_rows``' one per row, so no less accurate)."""

    parts: Tensor
    exp: Tensor
    group: int

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]

    def dense(self) -> Tensor:
        """The float32 matrix ``[R, L]`` (each element to 22 bits)."""
        L = self.parts.shape[2]
        exp = self.exp.repeat_interleave(self.group, 1)[:, :L]
        return torch.ldexp(self.parts[0].float() + self.parts[1].float(), -exp.float())


def _transposed(x: Tensor) -> bool:
    """``x [R, L]`` is a transposed view: columns contiguous, rows not (what ``_Split`` splits by columns)."""
    return x.dim() == 2 and x.stride(0) == 1 and x.stride(1) != 1 and x.shape[0] > 1 and x.shape[1] > 1


def _f32_transposed_tma(x: Tensor) -> bool:
    """TMA can load float32 ``x [R, L]`` (columns contiguous) as its storage ``[L, R]``: 16-byte aligned
    base and columns (``gemm_sm90.f32_t_descriptor``)."""
    return _transposed(x) and x.stride(1) >= x.shape[0] and x.stride(1) % 4 == 0 and x.data_ptr() % 16 == 0


class _GemmProgram(Program):
    """The launches of one product signature, planned once (``launch``): the two splits (``"fp16x3"``), the
    product loop and, with K slices, their sum; the output float32 or, with ``split_output``, float16 parts
    (``SplitOperand``). ``a_group``: ``a`` is a ``SplitOperand``'s parts (``a_group`` columns per exponent),
    read as they are where the loop runs ``"fp16x3"`` on K-tiles that divide the groups, else made dense
    first (``dense_a``).

    On the Hopper loop, transposed operands (a weight gradient's ``dy.T @ x``, an input gradient's ``w.T``)
    are read as they are stored: a float32 ``a`` with columns contiguous is split in the consumers' registers
    (``trans_a``, for products at most ``A_T_MAX_N`` wide), a ``b`` with columns contiguous is split into
    parts in its own layout (``trans_b``); no transposed copy of either. A product wider than that whose
    ``a`` and ``b`` are both transposed (the weight gradient of a layer with more inputs than outputs, fc2) is
    computed as ``C^T = b @ a^T`` (``swap``) and stored transposed."""

    ws = False
    a_f32 = trans_a = trans_b = swap = False
    descs = None

    def __init__(self, a, b, bias, precision, activation, slices, a_group, split_output):
        M, K = a.shape[-2:]
        N = b.shape[0]
        dev = a.device
        self.device, self.device_index = dev, (dev.index if a.is_cuda else None)
        self.sizes = (M, N, K)
        p = gemm_plan(M, N, K, dev, precision, slices)
        self.swap = (p.warp_specialized and a.dim() == 2 and not (a_group or activation or split_output)
                     and bias is None and M <= A_T_MAX_N < N and M % 8 == 0 and _transposed(a)
                     and _f32_transposed_tma(b))
        if self.swap:  # C^T = b @ a^T (the same plan: tiles, slices and K are symmetric)
            a, b, M, N = b, a, N, M
        self.split = p.precision == "fp16x3"
        self.dense_a = a_group if a_group and not (self.split and a_group % p.block_k == 0) else 0
        a_group = 0 if self.dense_a else a_group
        self.plan, self.activation, self.a_group = p, activation, a_group
        self.empty = M == 0 or N == 0
        self.zero = K == 0
        self.bias_cast = bias is not None and bias.dtype != torch.float32
        self.split_output = split_output and self.split and not (self.empty or self.zero)
        if self.empty or self.zero:
            return
        has_bias = bias is not None
        stride_ae = 0
        a_shape, a_strides = ((M, K), (K, 1)) if a.dim() == 3 else (a.shape, a.stride())  # parts: dense rows
        ws = p.warp_specialized and not a_group and a.dim() == 2
        self.a_f32 = (ws and (N <= A_F32_MAX_N or M <= A_F32_MAX_M) and a.stride(1) == 1 and a.stride(0) >= K
                      and a.stride(0) % 4 == 0 and a.data_ptr() % 16 == 0)
        self.trans_a = (ws and N <= A_T_MAX_N and not self.a_f32 and _transposed(a)
                        and _f32_transposed_tma(a))
        self.a_f32 = self.a_f32 or self.trans_a
        self.trans_b = p.warp_specialized and _transposed(b) and N % 8 == 0
        if self.split:
            interpreted = not a.is_cuda
            self.split_a = None if a_group or self.a_f32 else _Split(a_shape, a_strides, dev, interpreted)
            self.split_b = _Split(b.shape, b.stride(), dev, interpreted, transpose=not self.trans_b)
            sa, sb, lo = (K, 1), (K, 1), (M * K, N * K)
            stride_ae = cdiv(K, a_group) if a_group else 0
        else:
            sa, sb, lo = a_strides, b.stride(), (0, 0)
        per = cdiv(cdiv(K, p.block_k), p.slices) * p.block_k
        even_k = K % p.block_k == 0 and per % p.block_k == 0
        sbias = bias.stride(0) if has_bias else 0
        scm, scn = (1, M) if self.swap else (N, 1)  # C's strides in the loop's orientation
        one = p.slices == 1
        groups = cdiv(N, p.block_n)  # output exponents per row (split_output)
        self.ws = p.warp_specialized  # the parts go in as TMA descriptors (run)
        if self.ws:
            work = cdiv(M, p.block_m) * cdiv(N, p.block_n) * p.slices
            self.main = Launch(
                gemm_sm90.gemm_ws_kernel, (min(work, device_info(dev)[0]),),
                (M, N, K, per, work, stride_ae, sbias, M * N, scm if one else N, scn if one else 1, groups,
                 M * N),
                dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
                     STAGES=p.num_stages, HAS_BIAS=has_bias and one, ACTIVATION=activation if one else None,
                     A_GROUP=a_group, SPLIT_OUT=self.split_output and one, A_F32=self.a_f32,
                     TRANS_A=self.trans_a, TRANS_B=self.trans_b),
                p.num_warps)
        else:
            self.main = Launch(
                _gemm_kernel, (cdiv(M, p.block_m) * cdiv(N, p.block_n), p.slices),
                (M, N, K, per, *lo, M * N, sa[0], sa[1], stride_ae, sb[0], sb[1], sbias, M * N, N, 1, groups),
                dict(BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_K=p.block_k, GROUP_M=p.group_m,
                     PRECISION=p.precision, HAS_BIAS=has_bias and one, ACTIVATION=activation if one else None,
                     EVEN_K=even_k, A_GROUP=a_group, SPLIT_OUT=self.split_output and one),
                p.num_warps, p.num_stages)
        self.sum = None
        if not one:
            bm2, bn2 = 32, p.block_n
            self.sum = Launch(_sum_slices_kernel, (cdiv(M, bm2), cdiv(N, bn2)),
                              (M, N, M * N, N, sbias, scm, scn, M * N, groups),
                              dict(SLICES=p.slices, BLOCK_M=bm2, BLOCK_N=bn2, HAS_BIAS=has_bias,
                                   ACTIVATION=activation, SPLIT_OUT=self.split_output), 4)

    def run(self, a, b, bias, a_exp=None, reuse_b=False):
        M, N, K = self.sizes
        if self.swap:
            a, b = b, a
        dev = self.device
        if self.split_output:
            parts = torch.empty((2, M, N), dtype=torch.float16, device=dev)
            out_exp = torch.empty((M, cdiv(N, self.plan.block_n)), dtype=torch.int32, device=dev)
            out = parts
        else:
            out = out_exp = torch.empty((M, N), dtype=torch.float32, device=dev)
        if self.empty:
            return out
        if self.zero:  # an empty sum: the bias (and its activation) alone
            out.zero_()
            if bias is not None:
                out += bias.to(torch.float32)
            return torch.nn.functional.gelu(out) if self.activation == "gelu" else out
        if bias is None:
            bias = out_exp
        elif self.bias_cast:
            bias = bias.to(torch.float32)
        if self.dense_a:
            a = SplitOperand(a, a_exp, self.dense_a).dense()
        if self.split:
            if self.split_a is not None:
                a, a_exp = self.split_a(a)
            elif self.a_f32:
                a_exp = out_exp  # unread: the loop scales A per K-step itself
            b, b_exp = _SPLITS(b, self.split_b) if reuse_b else self.split_b(b)
        else:
            a_exp = b_exp = out_exp
        if self.ws:  # descriptors built (and checked) once, then pointed at each call's parts
            if self.descs is None:
                p = self.plan
                if self.trans_a:
                    da = gemm_sm90.f32_t_descriptor(a, p.block_k, p.block_m)
                elif self.a_f32:
                    da = gemm_sm90.f32_descriptor(a, p.block_m, p.block_k)
                else:
                    da = gemm_sm90.parts_descriptor(a, p.block_m, p.block_k)
                if self.trans_b:
                    db = gemm_sm90.parts_t_descriptor(b, p.block_k, p.block_n)
                else:
                    db = gemm_sm90.parts_descriptor(b, p.block_n, p.block_k)
                self.descs = (da, db)
            da, db = self.descs
            da.base, db.base = a, b
            a, b = da, db
        if self.sum is None:
            self.main(a, a_exp, b, b_exp, bias, out, out_exp)
        else:
            work = torch.empty((self.plan.slices, M, N), dtype=torch.float32, device=dev)
            self.main(a, a_exp, b, b_exp, bias, work, work)
            self.sum(work, bias, out, out_exp)
        if self.ws:  # the cached descriptors must not keep this call's operands alive
            da.base = db.base = None
        return SplitOperand(out, out_exp, self.plan.block_n) if self.split_output else out


_PROGRAMS = ProgramCache()


def gemm(a: Tensor | SplitOperand, b: Tensor, bias: Tensor | None = None, *, precision: str = "auto",
         activation: str | None = None, slices: int | None = None, split_output: bool = False,
         reuse_b: bool = False) -> Tensor | SplitOperand:
    """``act(a @ b.T + bias)`` in float32 for float32 ``a [M, K]``, ``b [N, K]`` (any strides: ``b`` is a
    linear layer's weight as stored; pass ``w.t()`` for ``x @ w``) and ``bias [N]``.

    A trusted launcher (``elsa_vision.ops.linear`` checks the inputs). ``precision``: a float32 precision of
    ``kernels.precision``; ``activation``: None or ``"gelu"`` (exact, erf); ``slices``: K slices (None: the
    planner decides). Returns a new contiguous ``[M, N]`` float32 tensor, or with ``split_output`` where the
    product runs ``"fp16x3"`` (and has work to do) a :class:`SplitOperand` of it: the output written as the
    float16 parts the next product reads without a split pass (a layer whose output feeds one product only,
    an MLP's hidden activation). ``a`` may be such a ``SplitOperand`` (read as parts where this product runs
    ``"fp16x3"`` with K-tiles that divide its groups, else made dense first). ``reuse_b``: ``b`` is a weight
    that will not change between calls except through in-place operations (an inference product): its
    ``"fp16x3"`` split is kept and reused while its storage's version is unchanged (:class:`_Splits`);
    without it, a kept split of ``b`` is dropped.
    """
    if not reuse_b:
        _SPLITS.drop(b)
    if isinstance(a, SplitOperand):
        program = _PROGRAMS(_GemmProgram, (a.parts, b, bias),
                            (precision, activation, slices, a.group, split_output))
        return program(a.parts, b, bias, a.exp, reuse_b)
    program = _PROGRAMS(_GemmProgram, (a, b, bias), (precision, activation, slices, 0, split_output))
    return program(a, b, bias, None, reuse_b)
