"""Split-precision dot products as Triton device functions: the float32 arithmetic of every kernel family.

A float32 tile product runs one of the project's precisions (``kernels.precision``): ``matmul`` is one
``tl.dot`` at ``"ieee"`` / ``"tf32x3"`` / ``"tf32"`` (or a half-precision tensor-core dot, ``"none"``);
``"fp16x3"`` splits each float32 tile in registers into two float16 parts scaled by a power of two
(``split_f16``) and forms three half-precision tensor-core products (``matmul_f16x3``). The attention kernels
(the (m, S, W) monoid, ``kernels.monoid``) and the GEMM family (``kernels.gemm``) use them alike.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = [
    "matmul", "split_f16", "matmul_f16x3", "mm_f16x3", "unscale", "pow2", "f16_pair", "scale_exponent",
    "store_split", "gemm_epilogue",
]

_SQRT1_2 = tl.constexpr(0.7071067811865476)


@triton.jit
def pow2(c):
    """``2 ** c`` as float32 for an int32 ``c`` in ``[-126, 127]`` (built from the exponent bits: exact)."""
    return ((c + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def scale_exponent(amax):
    """The int32 ``c`` that scales a float32 largest magnitude ``amax`` (any shape) into ``[2^14, 2^15)``,
    clamped to ``[-112, 126]`` so that ``pow2(c)`` and ``pow2(-c)`` are normal floats (zeros stay zero,
    NaN stays NaN, an infinite ``amax`` gives -112). The one scale rule of every float16 split."""
    e = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.minimum(tl.maximum(14 - e, -112), 126)


@triton.jit
def f16_pair(xs):
    """``(hi, lo)``: float32 ``xs`` rounded to float16 (``hi``, round to nearest even) and the float32-exact
    remainder ``xs - hi`` rounded to float16 (``lo``). ``xs`` must already lie in float16 range."""
    hi = xs.to(tl.float16)
    return hi, (xs - hi.to(tl.float32)).to(tl.float16)


@triton.jit
def split_f16(x):
    """``(hi, lo, c)``: float16 ``hi + lo`` equal to ``x * 2**c`` up to ``2^-22`` of each element (or
    ``2^-39`` of the block's largest magnitude), for a float32 block ``x`` of rank 2.

    ``c`` (int32) scales the block's largest magnitude into ``[2^14, 2^15)``: float16 then holds it with
    room to spare (max 65504), and ``hi`` keeps 11 significant bits of every element down to ``2^-29`` of
    that maximum. ``hi`` is ``x * 2**c`` rounded to float16 (round to nearest even), ``lo`` the
    float32-exact remainder rounded to float16: 11 more bits while it is a normal float16, a ``2^-25``
    absolute step below that. So the pair carries 22 significant bits, the budget of a TF32 ``hi``/``lo``
    split, and the products run on half-precision tensor cores at twice the TF32 rate. ``c`` is clamped to
    ``[-112, 126]`` so that ``pow2(c)`` and ``pow2(-c)`` are normal floats: every float32 maximum from the
    subnormals to ``2^127`` is scaled into float16 range (a block of zeros stays zero; NaN stays NaN). The
    scaling by ``2**c`` is exact, so callers undo it exactly with ``pow2(-c)``.
    """
    c = scale_exponent(tl.max(tl.max(tl.abs(x), 1), 0))
    hi, lo = f16_pair(x * pow2(c))
    return hi, lo, c


@triton.jit
def matmul_f16x3(a_hi, a_lo, b_hi, b_lo, acc):
    """``acc + a @ b`` from the ``split_f16`` parts of ``a`` and ``b`` (both scaled: the caller undoes the
    scales): ``a_hi @ b_lo + a_lo @ b_hi + a_hi @ b_hi`` on half-precision tensor cores with float32
    accumulation, the small terms first. Pass zeros and add a long-running sum outside in float32: the tensor
    core's accumulation is not IEEE-rounded (docs/kernel_notes.md). The ``a_lo @ b_lo`` term left out is
    ``~2^-22`` of ``|a| |b|``: FP32-accurate."""
    acc = tl.dot(a_hi, b_lo, acc)
    acc = tl.dot(a_lo, b_hi, acc)
    return tl.dot(a_hi, b_hi, acc)


@triton.jit
def matmul(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.

    ``PRECISION`` is ``"ieee"``, ``"tf32x3"`` or ``"tf32"`` for float32 operands and ``"none"`` for
    float16/bfloat16 operands (tensor cores, fp32 accumulate); ``"fp16x3"`` callers use ``split_f16`` and
    ``matmul_f16x3``. ``"upcast"``
    multiplies half operands as float32 (exact products, fp32 accumulate: the tensor-core result) where no
    half dot is available (the CPU interpreter has none for bfloat16).
    """
    if PRECISION == "none":
        return tl.dot(a, b, acc)
    elif PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def score_unscale(c):
    """``2**-c`` for the exponent sum ``c`` of a query tile's and a key row's ``split_f16`` scales, clamped to
    float32's normal powers: the factor that undoes the scales of the ``"fp16x3"`` forward's scores. The clamp
    only touches scores below ~1e-27 (their exp2 is 1 either way) or beyond float32's range (products of
    inputs past 2^154)."""
    return pow2(-tl.minimum(tl.maximum(c, -126), 127))


@triton.jit
def unscale(x, c):
    """``x * 2**-c`` for the exponent sum ``c`` in ``[-224, 252]`` of two ``split_f16`` scales, in two exact
    halves (each a normal power of two): a gradient as small as 1e-34 can come from a tile scaled by 2^94
    times one scaled by 2^47. The intermediate lies between ``x`` and the result, so it cannot overflow."""
    c1 = c >> 1
    return x * pow2(-c1) * pow2(c1 - c)


@triton.jit
def mm_f16x3(a_hi, a_lo, a_c, b_hi, b_lo, b_c, shape: tl.constexpr):
    """``a @ b`` in float32 from the ``split_f16`` parts and scale exponents of ``a`` and ``b``: three float16
    tensor-core products into a fresh float32 accumulator of ``shape``, then the scales undone exactly.
    The caller adds the result to its running sum in IEEE float32 (see ``matmul_f16x3``)."""
    return unscale(matmul_f16x3(a_hi, a_lo, b_hi, b_lo, tl.zeros(shape, dtype=tl.float32)), a_c + b_c)


@triton.jit
def store_split(P, E, x, offs_m, offs_n, M, N, lo, stride_e, group):
    """Store float32 tile ``x`` (rows ``offs_m``, columns ``offs_n`` of ``[M, N]``) as float16 parts
    ``P [2, M, N]`` (the low parts ``lo`` elements after the high ones) with one scale per row of the tile:
    its exponent at column ``group`` of ``E`` (rows ``stride_e`` apart). A tile's rows are scaled apart, so a
    non-finite element reaches its own row and column group only."""
    mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    x = tl.where(mask, x, 0.0)
    c = scale_exponent(tl.max(tl.abs(x), 1))
    hi, low = f16_pair(x * pow2(c)[:, None])
    out = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
    tl.store(P + out, hi, mask=mask)
    tl.store(P + lo + out, low, mask=mask)
    tl.store(E + offs_m.to(tl.int64) * stride_e + group, c, mask=offs_m < M)


@triton.jit
def split_rows(pid, tiles, H, N, KPM, stride_kpmb, stride_kpmn, BLOCK: tl.constexpr, HAS_KPM: tl.constexpr):
    """The rows of program ``pid`` of a pass that splits ``[B, H, N, *]`` operands ahead of an attention
    kernel's loop (grid ``tiles * B * H``: one tile of ``BLOCK`` rows of one (batch, head) each):
    ``(b, h, bh, tile, rows, in_rows, ok)``, ``b``/``h`` as int64, ``in_rows`` the rows below ``N``, ``ok``
    those the loop loads (with ``HAS_KPM``, the keys the padding mask ``KPM [B, N]`` keeps: a hidden key is
    split as zeros, as the loop's own split sees it)."""
    tile = pid % tiles
    bh = pid // tiles
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    rows = tile * BLOCK + tl.arange(0, BLOCK)
    in_rows = rows < N
    ok = in_rows
    if HAS_KPM:
        ok = ok & (tl.load(KPM + b * stride_kpmb + rows.to(tl.int64) * stride_kpmn, mask=ok, other=0) != 0)
    return b, h, bh, tile, rows, in_rows, ok


@triton.jit
def gemm_epilogue(acc, A_EXP, B_EXP, Bias, rows, cols, stride_bias, UNSCALE_ROWS: tl.constexpr,
                  UNSCALE_COLS: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr):
    """The epilogue of an FP32-accurate product tile ``acc [rows, cols]``: the parts' power-of-two row scales
    undone (int32 exponents ``A_EXP[rows]`` where ``UNSCALE_ROWS``, ``B_EXP[cols]`` where ``UNSCALE_COLS``;
    exact), the bias added (``Bias[cols]``, any float dtype) and the activation applied (None or ``"gelu"``,
    exact erf)."""
    if UNSCALE_ROWS:
        acc = acc * pow2(-tl.load(A_EXP + rows))[:, None]
    if UNSCALE_COLS:
        acc = acc * pow2(-tl.load(B_EXP + cols))[None, :]
    if HAS_BIAS:
        acc += tl.load(Bias + cols * stride_bias)[None, :].to(tl.float32)
    if ACTIVATION == "gelu":
        acc = 0.5 * acc * (1.0 + tl.math.erf(acc * _SQRT1_2))
    return acc
