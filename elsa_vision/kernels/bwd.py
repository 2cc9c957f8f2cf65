"""ELSA backward in Triton: gradients of exact softmax attention from the saved per-row log-sum-exp.

The forward (``elsa_fwd``) returns the output ``O [B, H, Nq, Dv]`` and ``lse [B, H, Nq]`` (float32, natural
log, ``-inf`` for a row that sees no key). The backward recomputes the probabilities blockwise,
``P = exp(S - lse)`` with ``S = scale * Q K^T + bias`` (masked entries ``-inf``), so nothing of size
``Nq * Nk`` is stored:

* ``dQ = scale * dS K`` -- one program per query tile, looping over the key tiles (``_bwd_dq_kernel``,
  launched first); it also forms ``Delta = rowsum(O * dO)`` of its rows (``[B, H, Nq]`` float32) for the
  next kernel.
  A separate dQ pass keeps every gradient element owned by exactly one program: no atomics, bitwise
  reproducible (on Hopper, dense half-precision calls, and dense float32 calls at ``fp16x3`` on grids that
  fill the GPU, form dQ in the dK/dV program instead and sum it over key programs in float32,
  ``_HopperFused``, unless ``torch.use_deterministic_algorithms(True)``);
* ``dV = P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - Delta)``, ``dK = scale * dS^T Q`` -- one program per key
  tile, looping over the query tiles (``_bwd_dkdv_kernel``);
* ``dBias = dS`` reduced over the bias's broadcast dims (``_bwd_dbias_kernel``): one program per output tile
  of the *reduced* bias loops, in a fixed order, over the ``(b, h)`` pairs (and query/key tiles) that share
  it, so a ``(1, H, N, N)`` relative-position bias, an ``(nW, 1, N, N)`` window mask on ``B = batch * nW``
  windows (window ``b % nW``, timm's layout) or a ``(B, 1, 1, N)`` padding bias never materialises
  ``[B, H, Nq, Nk]``. When the reduced grid is too small to fill the GPU the member loop is split into a few
  chunks written to a float32 workspace of the reduced shape and summed in a fixed order.

Conventions are the forward's: SDPA layout, bottom-right causal (query ``i`` sees key ``j`` iff
``j <= i + Nk - Nq``), ``key_padding_mask`` True = key takes part, rows with no visible key have zero,
finite gradients, keys hidden by the padding mask are loaded as zeros so NaN stored there never leaks.
A key hidden by causality or a ``-inf`` bias reaches no gradient either, whatever it holds: a program whose
gradients come out non-finite redoes its tiles with the exact rule (``dS = 0`` where ``P = 0``, the products
on the finite parts of the operands; ``_dkdv_loop``, ``docs/kernel_notes.md``).
Precision as the forward: float16/bfloat16 operands with float32 accumulation; float32 with ``"ieee"``
(plain FP32 FMA), ``"tf32x3"`` (FP32-accurate on TF32 tensor cores), ``"fp16x3"`` (FP32-accurate from three
float16 tensor-core products of power-of-two-scaled two-part splits, ``dots.split_f16``; head dims up to
128), ``"tf32"`` (one TF32 pass) and ``"auto"`` (the fastest FP32-accurate choice for the device:
``fp16x3`` on sm90, ``tf32x3`` on other tensor-core GPUs, else ``ieee``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dots import f16_pair, mm_f16x3, split_f16, split_rows
from .host import LOG2E, cdiv, device_info, next_pow2, tile_size
from .launch import Launch, Program, ProgramCache
from .monoid import count_nonfinite, finite_part
from .precision import resolve_precision

try:  # Gluon (Triton 3.5 and later): the warp-specialised Hopper backward passes
    from . import bwd_sm90
except ImportError:  # pragma: no cover - an older Triton: the generic kernels everywhere
    bwd_sm90 = None

__all__ = ["BwdConfig", "bwd_config", "bwd_program", "elsa_bwd"]

# The ``"fp16x3"`` backward splits Q and dO (for the dK/dV kernel's loop) and K and V (for the dQ kernel's)
# into float16 parts once per call (``_split_pair_kernel``), bitwise the splits its loops would form.
PRESPLIT = True

# Half-precision backwards without a mask, bias or causality at head dims 64 / 128 and at least
# ``HOPPER_MIN_KEYS[head dim]`` keys take ``bwd_sm90``'s warp-specialised dQ and dK/dV passes on sm90
# (``_HopperPass``; H100: 1.08-1.23x the generic kernels at 3K-32K tokens; at head dim 64 level with them
# at 197-785 tokens, at head dim 128 1.21-1.31x there: docs/kernel_notes.md, "The Hopper backward").
# False: the generic kernels everywhere (the A/B of the benchmarks' ``elsa_generic`` peer).
HOPPER = True
HOPPER_MIN_KEYS = {64: 1024, 128: 192}
# Where both gradients are wanted, head dims in ``bwd_sm90.FUSED_CONFIGS`` take the five-product backward
# (``_HopperFused``: dQ formed in the dK/dV program and summed over key programs by TMA reduce-add), unless
# ``torch.use_deterministic_algorithms(True)`` asks for bitwise reruns (the two passes above, one owner per
# gradient element). False: the two passes always.
HOPPER_FUSED = True
# Dense float32 calls at the ``"fp16x3"`` precision (``PRESPLIT``) wanting every gradient, with a head dim
# in ``bwd_sm90.FUSED_SPLIT_CONFIGS``, take the FP32-accurate five-product kernel on the split operands
# (``bwd_sm90.bwd_fused_f16x3_kernel``) under the same two switches where its grid (one program per 128 keys
# of a head) fills the multiprocessors at least this many times: H100, 1.32-1.61x the generic kernels from
# 197 to 16K tokens on such grids, slower on a grid of 64 programs (2 x 4 heads x 1,024 tokens), where the
# generic kernels' smaller tiles give more programs (docs/kernel_notes.md, "The FP32-accurate five-product
# backward").
HOPPER_SPLIT_MIN_WAVES = 1



# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _mm(a, b, acc, PREC: tl.constexpr, DOT_UPCAST: tl.constexpr):
    """``acc + a @ b`` with float32 accumulation at ``PREC`` (``"tf32x3"`` is Triton's three-product split,
    which forms the small products in a fresh accumulator and adds the result to ``acc`` in IEEE float32).

    ``DOT_UPCAST`` (CPU interpreter with bfloat16 operands only) multiplies the exactly widened float32
    copies: Triton's interpreter mis-multiplies bfloat16 blocks, and bf16 products are exact in float32, so
    the result equals the tensor-core product up to summation order.
    """
    if DOT_UPCAST:
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    elif PREC == "none":
        acc = tl.dot(a, b, acc)
    elif PREC == "ieee":
        # FMA dots add every product straight into ``acc`` (a running sum over all tiles): form the tile's
        # products in a fresh accumulator and add them with one fused multiply-add (a plain add would be
        # folded back into the dot by the compiler).
        acc = tl.fma(tl.dot(a, b, tl.zeros_like(acc), input_precision="ieee"), 1.0, acc)
    else:
        acc = tl.dot(a, b, acc, input_precision=PREC)
    return acc


@triton.jit
def _bwd_preprocess_kernel(
    O, DO, DELTA, ACC,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_dob, stride_doh, stride_dom, stride_dod,
    H, Nq, Dv,
    BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, ZERO_ACC: tl.constexpr,
):
    """``DELTA[b, h, i] = sum_d O[b, h, i, d] * dO[b, h, i, d]`` in float32; contiguous ``[B, H, Nq]``.
    ``ZERO_ACC``: also zero the same rows of the five-product backward's contiguous float32 dQ sum ``ACC``
    ``[B, H, Nq, Dv]``."""
    pid_m = tl.program_id(1)
    pid_bh = tl.program_id(0)
    b = (pid_bh // H).to(tl.int64)
    h = (pid_bh % H).to(tl.int64)
    m0 = pid_m * BLOCK_M
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_DV)
    mask = ((m0 + offs_m) < Nq)[:, None] & (offs_d < Dv)[None, :]
    o_ptrs = (O + b * stride_ob + h * stride_oh + m0.to(tl.int64) * stride_om
              + offs_m[:, None] * stride_om + offs_d[None, :] * stride_od)
    do_ptrs = (DO + b * stride_dob + h * stride_doh + m0.to(tl.int64) * stride_dom
               + offs_m[:, None] * stride_dom + offs_d[None, :] * stride_dod)
    o = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(do_ptrs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    tl.store(DELTA + pid_bh.to(tl.int64) * Nq + m0 + offs_m, delta, mask=(m0 + offs_m) < Nq)
    if ZERO_ACC:
        acc_ptrs = ACC + (pid_bh.to(tl.int64) * Nq + m0 + offs_m[:, None]) * Dv + offs_d[None, :]
        tl.store(acc_ptrs, tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32), mask=mask)


@triton.jit
def _bwd_dq_convert_kernel(
    ACC, DQ, Redo,
    H, Nq, D, stride_qb, stride_qh, stride_qm, sm_scale,
    BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``DQ = sm_scale * ACC`` (the five-product backward's float32 sum ``dS K``, contiguous ``[B, H, Nq,
    D]``; ``DQ`` ``[B, H, Nq, D]`` with the head dim contiguous and the other strides ``stride_q*``) in DQ's
    dtype, and per 64 query rows of a head (grid ``(B * H, cdiv(Nq, BLOCK_M))``, ``BLOCK_M`` = 64) the flag
    ``Redo[bh, tile]`` (1: a row is not finite; the generic dQ kernel's ``REDO`` launch redoes it)."""
    pid_bh = tl.program_id(0)
    pid_m = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (rows < Nq)[:, None] & (offs_d < D)[None, :]
    offs = (pid_bh.to(tl.int64) * Nq + rows[:, None]) * D + offs_d[None, :]
    dq = tl.load(ACC + offs, mask=mask, other=0.0) * sm_scale
    b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
    out = DQ + b * stride_qb + h * stride_qh + rows.to(tl.int64)[:, None] * stride_qm + offs_d[None, :]
    tl.store(out, dq.to(DQ.dtype.element_ty), mask=mask)
    tl.store(Redo + pid_bh.to(tl.int64) * tl.num_programs(1) + pid_m, (count_nonfinite(dq) != 0).to(tl.int32))


@triton.jit
def _split_tile(X, P, E, b, h, head, rows64, ok, in_rows, slot, stride_b, stride_h, stride_n, stride_c, lo,
                C: tl.constexpr, BLOCK_C: tl.constexpr):
    """Split one tile of ``X``'s rows (``ok``: loaded, others zero; ``in_rows``: stored) with ``split_f16``
    into parts ``P`` (rows ``head + rows64``, ``C`` columns, low parts ``lo`` elements later) and its
    exponent at ``E + slot``."""
    offs = tl.arange(0, BLOCK_C)
    x = tl.load(X + b * stride_b + h * stride_h + rows64[:, None] * stride_n + offs[None, :] * stride_c,
                mask=ok[:, None] & (offs < C)[None, :], other=0.0)
    hi, low, c = split_f16(x)
    out = P + (head + rows64)[:, None] * C + offs[None, :]
    keep = in_rows[:, None] & (offs < C)[None, :]
    tl.store(out, hi, mask=keep)
    tl.store(out + lo, low, mask=keep)
    tl.store(E + slot, c)


@triton.jit
def _split_pair_kernel(
    X, Y, KPM, XP, YP, XE, YE,
    stride_xb, stride_xh, stride_xn, stride_xd, stride_yb, stride_yh, stride_yn, stride_yd,
    stride_kpmb, stride_kpmn, H, N, tiles, parts_x, parts_y,
    DX: tl.constexpr, DY: tl.constexpr, BLOCK: tl.constexpr, BLOCK_DX: tl.constexpr, BLOCK_DY: tl.constexpr,
    HAS_KPM: tl.constexpr,
):
    """Two ``[B, H, N, *]`` operands of the ``"fp16x3"`` backward's loops split once, in the tiles of
    ``BLOCK`` rows the loop reads them in, exactly as the loop would (``split_f16``: one power of two per
    tile): parts ``XP [2, B·H, N, DX]`` (high, then low ``parts_x`` elements later) and exponents
    ``XE [B·H, tiles]``, likewise ``Y``. Grid ``(tiles * B * H,)``. With ``HAS_KPM`` the rows of keys hidden
    by the padding mask are split as zeros, as the loop loads them."""
    b, h, bh, tile, rows, in_rows, ok = split_rows(tl.program_id(0), tiles, H, N, KPM, stride_kpmb,
                                                   stride_kpmn, BLOCK, HAS_KPM)
    rows64 = rows.to(tl.int64)
    head = bh.to(tl.int64) * N
    slot = bh.to(tl.int64) * tiles + tile
    _split_tile(X, XP, XE, b, h, head, rows64, ok, in_rows, slot, stride_xb, stride_xh, stride_xn, stride_xd,
                parts_x, DX, BLOCK_DX)
    _split_tile(Y, YP, YE, b, h, head, rows64, ok, in_rows, slot, stride_yb, stride_yh, stride_yn, stride_yd,
                parts_y, DY, BLOCK_DY)


@triton.jit
def _head_parts(XP, YP, XE, YE, pid_bh, N, DX: tl.constexpr, DY: tl.constexpr, BLOCK: tl.constexpr,
                PRESPLIT: tl.constexpr):
    """Where head ``pid_bh``'s parts and exponents of ``_split_pair_kernel`` start (the pointers unchanged
    without ``PRESPLIT``)."""
    if PRESPLIT:
        row0 = pid_bh.to(tl.int64) * N
        tile0 = pid_bh.to(tl.int64) * tl.cdiv(N, BLOCK)
        return XP + row0 * DX, YP + row0 * DY, XE + tile0, YE + tile0
    return XP, YP, XE, YE


@triton.jit
def _load_parts(parts, lo, exps, rows, offs_c, rows_ok, cols_ok, C: tl.constexpr, MASKED: tl.constexpr,
                MASK_COLS: tl.constexpr):
    """``(hi, lo, c)`` of one tile of ``_split_pair_kernel``'s parts: rows ``rows`` of a head whose parts
    start at ``parts`` (``C`` columns, the low parts ``lo`` elements later), its exponent at ``exps``."""
    ptrs = parts + rows.to(tl.int64)[:, None] * C + offs_c[None, :]
    return (_load_rows(ptrs, rows_ok, cols_ok, MASKED, MASK_COLS),
            _load_rows(ptrs + lo, rows_ok, cols_ok, MASKED, MASK_COLS), tl.load(exps))


@triton.jit
def _split_loaded(x, y, EXACT: tl.constexpr):
    """``split_f16`` of two tiles a loop loaded (``x`` the operand of the scores' product, ``y`` the other);
    the exact pass splits the finite part of ``x``."""
    if EXACT:
        x = finite_part(x)
    x_hi, x_lo, x_c = split_f16(x)
    y_hi, y_lo, y_c = split_f16(y)
    return x_hi, x_lo, x_c, y_hi, y_lo, y_c


@triton.jit
def _load_rows(ptrs, rows_ok, cols_ok, MASK_ROWS: tl.constexpr, MASK_COLS: tl.constexpr):
    """Load a ``[rows, cols]`` tile, masking (and zero-filling) only the dimensions that need it."""
    if MASK_ROWS:
        if MASK_COLS:
            return tl.load(ptrs, mask=rows_ok[:, None] & cols_ok[None, :], other=0.0)
        return tl.load(ptrs, mask=rows_ok[:, None], other=0.0)
    if MASK_COLS:
        return tl.load(ptrs, mask=cols_ok[None, :], other=0.0)
    return tl.load(ptrs)


@triton.jit
def _probs(s, bias_ptrs, lse, lse2, q_idx, k_idx, q_ok, k_ok, diag, sm_scale, qk_scale,
           HAS_BIAS: tl.constexpr, CAUSAL: tl.constexpr, MASKED: tl.constexpr, EXACT: tl.constexpr = False):
    """``P = exp(sm_scale * S + bias - lse)`` of one score tile ``s``, in either orientation.

    The query-side operands (``lse``, ``lse2 = lse * log2(e)``, ``q_idx``, ``q_ok``) and the key-side ones
    (``k_idx``, ``k_ok``) come expanded along the tile's axes: ``[M, 1]`` and ``[1, N]`` for ``S``,
    ``[1, M]`` and ``[N, 1]`` for ``S^T``. ``MASKED`` = False is the caller's promise that every pair of the
    tile is visible and in bounds (no masks at all). The bias is added in the natural-log domain: a bias near
    finfo.min must not overflow when scaled by log2(e). ``EXACT`` (with ``MASKED``): a pair a ``-inf`` bias
    hides has ``P = 0`` too, whatever its score (NaN from a non-finite key or query row) and ``lse`` are.
    """
    if HAS_BIAS:
        if MASKED:
            bias = tl.load(bias_ptrs, mask=q_ok & k_ok, other=0.0).to(tl.float32)
        else:
            bias = tl.load(bias_ptrs).to(tl.float32)
        arg = (s * sm_scale + bias - lse) * 1.4426950408889634
    else:
        arg = s * qk_scale - lse2
    # P <= 1 exactly; the recomputed score may pass lse by its rounding (|s| 2^-24 each), which at logits far
    # past exp's range would give P = inf (and NaN gradients): clamp the exponent at 0, NaN kept (a NaN
    # logit still makes its row NaN, as in softmax)
    p = tl.math.exp2(tl.minimum(arg, 0.0, propagate_nan=tl.PropagateNan.ALL))
    if MASKED:
        valid = q_ok & k_ok
        if CAUSAL:
            valid = valid & (k_idx <= q_idx + diag)
        if EXACT and HAS_BIAS:
            valid = valid & (bias != float("-inf"))
        p = tl.where(valid, p, 0.0)
    return p


@triton.jit
def _dkdv_loop(
    dk, dv, k, v, k_hi, k_lo, k_c, v_hi, v_lo, v_c, key_ok, offs_n, offs_ml, offs_d, offs_dv,
    q_base, do_base, lse_base, delta_base, bias_base, qp_base, dop_base, qe_base, doe_base, parts_q, parts_do,
    stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm,
    lo, hi, Nq, diag, sm_scale, qk_scale,
    D: tl.constexpr, Dv: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr,
    PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EXACT: tl.constexpr = False, PRESPLIT: tl.constexpr = False,
):
    """Accumulate ``dK, dV`` of one key tile over the query tiles ``[lo, hi)``.

    ``MASKED`` = False is the caller's promise that every (key, query) pair of these tiles is visible and in
    bounds (full key and query tiles, no padding mask, past the causal diagonal): no bounds masks, no
    ``tl.where`` on the scores and no ``-inf`` guard on the lse (a row that sees a key has a finite one).

    ``EXACT`` (with ``MASKED``; the caller passes the finite parts of ``v`` and, under ``"fp16x3"``, the
    splits of the finite parts of ``k`` and ``v``): a hidden pair has ``P = dS = 0`` exactly, whatever ``dP``
    or the lse hold (``dS = P (dP - Delta)`` is taken as 0 where ``P`` is), and ``dK`` takes the finite part
    of ``Q``: a hidden key's or query's NaN or infinity reaches no gradient. The logits come from the raw
    ``k`` and ``q`` (IEEE, as the forward's), or under ``"fp16x3"`` from the finite parts: a row whose
    query or visible key is non-finite has a NaN lse, so its ``P`` is NaN either way.

    ``PRESPLIT`` (``"fp16x3"``, not ``EXACT``): ``Q`` and ``dO`` come as ``_split_pair_kernel``'s parts of
    this head (``qp_base``/``dop_base``, exponents ``qe_base``/``doe_base`` per query tile of ``BLOCK_M``),
    bitwise the splits the loop would form.
    """
    USE_PARTS: tl.constexpr = PRESPLIT and not EXACT
    d_in = offs_d < D
    dv_in = offs_dv < Dv
    for m0 in range(lo, hi, BLOCK_M):
        offs_m = m0 + offs_ml
        m_in = offs_m < Nq
        m64 = tl.cast(m0, tl.int64)
        if USE_PARTS:
            tile = m0 // BLOCK_M
            q_hi, q_lo, q_c = _load_parts(qp_base, parts_q, qe_base + tile, offs_m, offs_d, m_in, d_in, D,
                                          MASKED, D != BLOCK_D)
            do_hi, do_lo, do_c = _load_parts(dop_base, parts_do, doe_base + tile, offs_m, offs_dv, m_in,
                                             dv_in, Dv, MASKED, Dv != BLOCK_DV)
        else:
            q = _load_rows(q_base + m64 * stride_qm + offs_ml[:, None] * stride_qm
                           + offs_d[None, :] * stride_qd, m_in, d_in, MASKED, D != BLOCK_D)
            do = _load_rows(do_base + m64 * stride_dom + offs_ml[:, None] * stride_dom
                            + offs_dv[None, :] * stride_dod, m_in, dv_in, MASKED, Dv != BLOCK_DV)
        if MASKED:
            lse = tl.load(lse_base + m64 * stride_lm + offs_ml * stride_lm, mask=m_in, other=0.0)
            delta = tl.load(delta_base + m0 + offs_ml, mask=m_in, other=0.0)
        else:
            lse = tl.load(lse_base + m64 * stride_lm + offs_ml * stride_lm)
            delta = tl.load(delta_base + m0 + offs_ml)
        if MASKED or HAS_BIAS:
            # A row with no visible key has lse = -inf and every score masked: shift by 0 so P = 0, not NaN.
            lse = tl.where(lse == float("-inf"), 0.0, lse)

        # scores^T [BLOCK_N, BLOCK_M]
        if PREC == "fp16x3":
            if not USE_PARTS:
                q_hi, q_lo, q_c, do_hi, do_lo, do_c = _split_loaded(q, do, EXACT)
            qkt = mm_f16x3(k_hi, k_lo, k_c, tl.trans(q_hi), tl.trans(q_lo), q_c, [BLOCK_N, BLOCK_M])
        else:
            qkt = _mm(k, tl.trans(q), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), PREC, DOT_UPCAST)
        pt = _probs(qkt, bias_base + m64 * stride_bm + offs_ml[None, :] * stride_bm,
                    lse[None, :], (lse * 1.4426950408889634)[None, :], offs_m[None, :], offs_n[:, None],
                    m_in[None, :], key_ok[:, None], diag, sm_scale, qk_scale, HAS_BIAS, CAUSAL, MASKED, EXACT)
        if PREC == "fp16x3":
            # P <= 1 is split scaled by 2^14 (exact), as in the forward's fold_tile
            pt_hi, pt_lo = f16_pair(pt * 16384.0)
            dv += mm_f16x3(pt_hi, pt_lo, 0, do_hi, do_lo, do_c, [BLOCK_N, BLOCK_DV]) * (1.0 / 16384.0)
            dpt = mm_f16x3(v_hi, v_lo, v_c, tl.trans(do_hi), tl.trans(do_lo), do_c, [BLOCK_N, BLOCK_M])
            dst = pt * (dpt - delta[None, :])
            if EXACT:
                dst = tl.where(pt == 0.0, 0.0, dst)
            ds_hi, ds_lo, ds_c = split_f16(dst)
            dk += mm_f16x3(ds_hi, ds_lo, ds_c, q_hi, q_lo, q_c, [BLOCK_N, BLOCK_D])
        else:
            dv = _mm(pt.to(do.dtype), do, dv, PREC, DOT_UPCAST)
            dpt = _mm(v, tl.trans(do), tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32), PREC, DOT_UPCAST)
            dst = pt * (dpt - delta[None, :])
            if EXACT:
                dst = tl.where(pt == 0.0, 0.0, dst)
                q = finite_part(q)
            dk = _mm(dst.to(q.dtype), q, dk, PREC, DOT_UPCAST)
    return dk, dv


@triton.jit
def _bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, BIAS, KPM, DK, DV, QP, DOP, QE, DOE, Redo,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_kpmb, stride_kpmn,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, Nq, Nk, BIAS_B, BIAS_H,
    sm_scale, qk_scale, parts_q, parts_do,
    D: tl.constexpr, Dv: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr,
    PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRESPLIT: tl.constexpr, REDO: tl.constexpr,
):
    """One program per (b * H + h, key tile): ``dK, dV [BLOCK_N, D | Dv]`` from a loop over the query tiles.
    ``PRESPLIT``: ``Q`` and ``dO`` split beforehand (``QP``/``DOP``/``QE``/``DOE``, ``_split_pair_kernel``
    in query tiles of ``BLOCK_M``; ``parts_q``/``parts_do`` elements per part) for the fast pass.
    ``REDO`` (after the Hopper pass, ``BLOCK_N`` = 64): only the key tiles whose int32 flag in ``Redo``
    ``[B * H, cdiv(Nk, 64)]`` is set run (their fast pass, then the exact one where it is needed); the
    other programs return at once, leaving the Hopper pass's gradients.

    Works on the transposed scores ``S^T [BLOCK_N, BLOCK_M]`` so that ``dV += P^T dO`` and
    ``dK += dS^T Q`` are plain products. The query tiles run in three
    stretches: those crossing the causal diagonal (masked), the full visible ones (no masks: the bulk of
    the work), and the partial last tile (masked); a partial key tile or a padding mask masks them all.
    """
    pid_n = tl.program_id(1)
    pid_bh = tl.program_id(0)
    if REDO:
        if tl.load(Redo + pid_bh.to(tl.int64) * tl.num_programs(1) + pid_n) == 0:
            return
    b32 = pid_bh // H
    h32 = pid_bh % H
    b = b32.to(tl.int64)
    h = h32.to(tl.int64)
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_ml = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    diag = Nk - Nq  # bottom-right causal: key j visible to query i iff j <= i + diag

    key_ok = offs_n < Nk
    if HAS_KPM:
        kpm = tl.load(KPM + b * stride_kpmb + offs_n.to(tl.int64) * stride_kpmn, mask=key_ok, other=0)
        key_ok = key_ok & (kpm != 0)
    # Hidden keys are loaded as zeros: whatever they hold (NaN included) never reaches a gradient.
    k = tl.load(K + b * stride_kb + h * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, mask=key_ok[:, None] & (offs_d < D)[None, :], other=0.0)
    v = tl.load(V + b * stride_vb + h * stride_vh + offs_n.to(tl.int64)[:, None] * stride_vn
                + offs_dv[None, :] * stride_vd, mask=key_ok[:, None] & (offs_dv < Dv)[None, :], other=0.0)
    k_hi = k
    k_lo = k
    k_c = 0
    v_hi = v
    v_lo = v
    v_c = 0
    if PREC == "fp16x3":
        # K and V are split once per program, Q and dO once per query tile, P and dS where they are formed
        k_hi, k_lo, k_c = split_f16(k)
        v_hi, v_lo, v_c = split_f16(v)

    # Query tiles: [m_start, m_full) cross the diagonal, [m_full, m_mid) are full and visible, the rest
    # (the partial last tile) masked.
    m_start = n0 * 0
    m_full = n0 * 0
    if CAUSAL:
        m_start = tl.maximum(n0 - diag, 0) // BLOCK_M * BLOCK_M
        m_full = (tl.maximum(n0 + BLOCK_N - 1 - diag, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        m_full = tl.minimum(tl.maximum(m_full, m_start), Nq)
    m_mid = m_full
    if not HAS_KPM:
        if n0 + BLOCK_N <= Nk:
            m_mid = tl.maximum(m_full, Nq // BLOCK_M * BLOCK_M)

    q_base = Q + b * stride_qb + h * stride_qh
    do_base = DO + b * stride_dob + h * stride_doh
    lse_base = LSE + b * stride_lb + h * stride_lh
    delta_base = DELTA + pid_bh.to(tl.int64) * Nq
    bias_base = BIAS
    if HAS_BIAS:
        # transposed bias tile [BLOCK_N, BLOCK_M]; the bias's batch index is b % BIAS_B (window tiling)
        bias_base = (BIAS + (b32 % BIAS_B).to(tl.int64) * stride_bb + (h32 % BIAS_H).to(tl.int64) * stride_bh
                     + offs_n.to(tl.int64)[:, None] * stride_bn)

    qp_base, dop_base, qe_base, doe_base = _head_parts(QP, DOP, QE, DOE, pid_bh, Nq, D, Dv, BLOCK_M, PRESPLIT)

    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
    # The three query ranges in turn, unrolled: [m_start, m_full) masked, [m_full, m_mid) unmasked,
    # [m_mid, Nq) masked.
    for stage in tl.static_range(3):
        lo = m_start
        hi = m_full
        if stage == 1:
            lo = m_full
            hi = m_mid
        if stage == 2:
            lo = m_mid
            hi = Nq
        dk, dv = _dkdv_loop(
            dk, dv, k, v, k_hi, k_lo, k_c, v_hi, v_lo, v_c, key_ok, offs_n, offs_ml, offs_d, offs_dv,
            q_base, do_base, lse_base, delta_base, bias_base, qp_base, dop_base, qe_base, doe_base, parts_q,
            parts_do, stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm,
            lo, hi, Nq, diag, sm_scale, qk_scale,
            D, Dv, HAS_BIAS, HAS_KPM, CAUSAL, PREC, DOT_UPCAST, stage != 1,
            BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, False, PRESPLIT)
    if count_nonfinite(dk) + count_nonfinite(dv) != 0:
        # A NaN or an infinity reached the gradients: from a row that sees one (kept), or through a hidden
        # pair's zero (0 * NaN), which the exact pass leaves out. Redo the key tile with it, on query tiles
        # half as tall (its registers stay below the fast pass's).
        EXACT_M: tl.constexpr = BLOCK_M // 2 if BLOCK_M >= 32 else BLOCK_M
        v = finite_part(v)
        if PREC == "fp16x3":
            k_hi, k_lo, k_c = split_f16(finite_part(k))
            v_hi, v_lo, v_c = split_f16(v)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        dk, dv = _dkdv_loop(
            dk, dv, k, v, k_hi, k_lo, k_c, v_hi, v_lo, v_c, key_ok, offs_n, tl.arange(0, EXACT_M), offs_d,
            offs_dv, q_base, do_base, lse_base, delta_base, bias_base, qp_base, dop_base, qe_base, doe_base,
            parts_q, parts_do, stride_qm, stride_qd, stride_dom, stride_dod, stride_lm, stride_bm,
            m_start, Nq, Nq, diag, sm_scale, qk_scale,
            D, Dv, HAS_BIAS, HAS_KPM, CAUSAL, PREC, DOT_UPCAST, True,
            EXACT_M, BLOCK_N, BLOCK_D, BLOCK_DV, True)

    dk = dk * sm_scale
    n_in = offs_n < Nk
    tl.store(DK + b * stride_dkb + h * stride_dkh + offs_n.to(tl.int64)[:, None] * stride_dkn
             + offs_d[None, :] * stride_dkd, dk.to(DK.dtype.element_ty),
             mask=n_in[:, None] & (offs_d < D)[None, :])
    tl.store(DV + b * stride_dvb + h * stride_dvh + offs_n.to(tl.int64)[:, None] * stride_dvn
             + offs_dv[None, :] * stride_dvd, dv.to(DV.dtype.element_ty),
             mask=n_in[:, None] & (offs_dv < Dv)[None, :])


@triton.jit
def _dq_loop(
    dq, q_hi, q_lo, q_c, do_hi, do_lo, do_c, lse, lse2, delta, m_in, offs_m, offs_nl, offs_d, offs_dv,
    k_base, v_base, bias_base, kpm_base, kp_base, vp_base, ke_base, ve_base, parts_k, parts_v,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpmn,
    lo, hi, Nk, diag, sm_scale, qk_scale,
    D: tl.constexpr, Dv: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr,
    PREC: tl.constexpr, DOT_UPCAST: tl.constexpr, MASKED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    EXACT: tl.constexpr = False, PRESPLIT: tl.constexpr = False,
):
    """Accumulate ``dQ`` of one query tile over the key tiles ``[lo, hi)`` (``MASKED`` as in ``_dkdv_loop``;
    ``q_hi``/``do_hi`` are ``q``/``dO`` themselves except under ``"fp16x3"``). ``EXACT`` as in
    ``_dkdv_loop`` (under ``"fp16x3"`` the caller passes the split of the finite part of ``q``): ``dP`` and
    ``dQ`` take the finite parts of ``V`` and ``K``, and ``dS`` is 0 where ``P`` is. ``PRESPLIT`` as in
    ``_dkdv_loop`` for ``K`` and ``V`` (``kp_base``/``vp_base``, exponents per key tile of ``BLOCK_N``; the
    keys hidden by the padding mask split as zeros)."""
    USE_PARTS: tl.constexpr = PRESPLIT and not EXACT
    d_in = offs_d < D
    dv_in = offs_dv < Dv
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + offs_nl
        n64 = tl.cast(n0, tl.int64)
        key_ok = offs_n < Nk
        if MASKED and HAS_KPM:
            kpm = tl.load(kpm_base + offs_n.to(tl.int64) * stride_kpmn, mask=key_ok, other=0)
            key_ok = key_ok & (kpm != 0)
        if USE_PARTS:
            tile = n0 // BLOCK_N
            k_hi, k_lo, k_c = _load_parts(kp_base, parts_k, ke_base + tile, offs_n, offs_d, key_ok, d_in, D,
                                          MASKED, D != BLOCK_D)
            v_hi, v_lo, v_c = _load_parts(vp_base, parts_v, ve_base + tile, offs_n, offs_dv, key_ok, dv_in,
                                          Dv, MASKED, Dv != BLOCK_DV)
        else:
            k = _load_rows(k_base + n64 * stride_kn + offs_nl[:, None] * stride_kn
                           + offs_d[None, :] * stride_kd, key_ok, d_in, MASKED, D != BLOCK_D)
            v = _load_rows(v_base + n64 * stride_vn + offs_nl[:, None] * stride_vn
                           + offs_dv[None, :] * stride_vd, key_ok, dv_in, MASKED, Dv != BLOCK_DV)
            if EXACT:
                v = finite_part(v)
        if PREC == "fp16x3":
            if not USE_PARTS:
                k_hi, k_lo, k_c, v_hi, v_lo, v_c = _split_loaded(k, v, EXACT)
            qk = mm_f16x3(q_hi, q_lo, q_c, tl.trans(k_hi), tl.trans(k_lo), k_c, [BLOCK_M, BLOCK_N])
        else:
            qk = _mm(q_hi, tl.trans(k), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PREC, DOT_UPCAST)
        p = _probs(qk, bias_base + n64 * stride_bn + offs_nl[None, :] * stride_bn,
                   lse[:, None], lse2[:, None], offs_m[:, None], offs_n[None, :], m_in[:, None],
                   key_ok[None, :], diag, sm_scale, qk_scale, HAS_BIAS, CAUSAL, MASKED, EXACT)
        if PREC == "fp16x3":
            dp = mm_f16x3(do_hi, do_lo, do_c, tl.trans(v_hi), tl.trans(v_lo), v_c, [BLOCK_M, BLOCK_N])
            ds = p * (dp - delta[:, None])
            if EXACT:
                ds = tl.where(p == 0.0, 0.0, ds)
            ds_hi, ds_lo, ds_c = split_f16(ds)
            dq += mm_f16x3(ds_hi, ds_lo, ds_c, k_hi, k_lo, k_c, [BLOCK_M, BLOCK_D])
        else:
            dp = _mm(do_hi, tl.trans(v), tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PREC, DOT_UPCAST)
            ds = p * (dp - delta[:, None])
            if EXACT:
                ds = tl.where(p == 0.0, 0.0, ds)
                k = finite_part(k)
            dq = _mm(ds.to(k.dtype), k, dq, PREC, DOT_UPCAST)
    return dq


@triton.jit
def _bwd_dq_kernel(
    Q, K, V, DO, O, LSE, DELTA, BIAS, KPM, DQ, KP, VP, KE, VE, Redo,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_kpmb, stride_kpmn,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, Nq, Nk, BIAS_B, BIAS_H,
    sm_scale, qk_scale, parts_k, parts_v,
    D: tl.constexpr, Dv: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, WRITE_DELTA: tl.constexpr,
    PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    PRESPLIT: tl.constexpr, REDO: tl.constexpr,
):
    """One program per (b * H + h, query tile): ``dQ [BLOCK_M, D]`` from a loop over the key tiles: the full
    key tiles every row of the tile sees without masks, then the diagonal and the partial last tile masked
    (all of them masked for a partial query tile or with a padding mask).

    ``WRITE_DELTA``: the tile's ``Delta = rowsum(O * dO)`` is formed here from ``O`` and written to
    ``DELTA`` for the dK/dV kernel that runs after this one (no separate preprocess launch); otherwise it
    is read from ``DELTA``. ``PRESPLIT``: ``K`` and ``V`` split beforehand (``KP``/``VP``/``KE``/``VE``,
    ``_split_pair_kernel`` in key tiles of ``BLOCK_N``) for the fast pass. ``REDO`` (after the Hopper pass,
    ``BLOCK_M`` = 64): only the query tiles whose int32 flag in ``Redo`` ``[B * H, cdiv(Nq, 64)]`` is set
    run, as in ``_bwd_dkdv_kernel``."""
    pid_m = tl.program_id(1)
    pid_bh = tl.program_id(0)
    if REDO:
        if tl.load(Redo + pid_bh.to(tl.int64) * tl.num_programs(1) + pid_m) == 0:
            return
    b32 = pid_bh // H
    h32 = pid_bh % H
    b = b32.to(tl.int64)
    h = h32.to(tl.int64)
    m0 = pid_m * BLOCK_M
    m064 = m0.to(tl.int64)
    offs_ml = tl.arange(0, BLOCK_M)
    offs_m = m0 + offs_ml
    offs_nl = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_in = offs_m < Nq
    diag = Nk - Nq

    q = tl.load(Q + b * stride_qb + h * stride_qh + m064 * stride_qm + offs_ml[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, mask=m_in[:, None] & (offs_d < D)[None, :], other=0.0)
    do = tl.load(DO + b * stride_dob + h * stride_doh + m064 * stride_dom + offs_ml[:, None] * stride_dom
                 + offs_dv[None, :] * stride_dod, mask=m_in[:, None] & (offs_dv < Dv)[None, :], other=0.0)
    lse = tl.load(LSE + b * stride_lb + h * stride_lh + m064 * stride_lm + offs_ml * stride_lm,
                  mask=m_in, other=0.0)
    lse = tl.where(lse == float("-inf"), 0.0, lse)
    lse2 = lse * 1.4426950408889634
    if WRITE_DELTA:
        o = tl.load(O + b * stride_ob + h * stride_oh + m064 * stride_om + offs_ml[:, None] * stride_om
                    + offs_dv[None, :] * stride_od, mask=m_in[:, None] & (offs_dv < Dv)[None, :], other=0.0)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
        tl.store(DELTA + pid_bh.to(tl.int64) * Nq + offs_m, delta, mask=m_in)
    else:
        delta = tl.load(DELTA + pid_bh.to(tl.int64) * Nq + offs_m, mask=m_in, other=0.0)

    # Key tiles: [0, n_mid) are full and visible to every row of the tile, [n_mid, n_end) masked.
    n_end = Nk
    n_mid = m0 * 0 + Nk // BLOCK_N * BLOCK_N
    if CAUSAL:
        n_end = tl.minimum(tl.maximum(m0 + BLOCK_M + diag, 0), Nk)
        n_mid = tl.minimum(n_mid, tl.maximum(m0 + diag + 1, 0) // BLOCK_N * BLOCK_N)
    if HAS_KPM:
        n_mid = m0 * 0
    if m0 + BLOCK_M > Nq:
        n_mid = m0 * 0

    k_base = K + b * stride_kb + h * stride_kh
    v_base = V + b * stride_vb + h * stride_vh
    bias_base = BIAS
    if HAS_BIAS:
        bias_base = (BIAS + (b32 % BIAS_B).to(tl.int64) * stride_bb + (h32 % BIAS_H).to(tl.int64) * stride_bh
                     + m064 * stride_bm + offs_ml[:, None] * stride_bm)
    kpm_base = KPM + b * stride_kpmb
    kp_base, vp_base, ke_base, ve_base = _head_parts(KP, VP, KE, VE, pid_bh, Nk, D, Dv, BLOCK_N, PRESPLIT)

    q_hi = q
    q_lo = q
    q_c = 0
    do_hi = do
    do_lo = do
    do_c = 0
    if PREC == "fp16x3":
        # Q and dO are split once per program, K, V and dS at every key tile
        q_hi, q_lo, q_c = split_f16(q)
        do_hi, do_lo, do_c = split_f16(do)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # The two key ranges in turn, unrolled: [0, n_mid) unmasked, [n_mid, n_end) masked.
    for stage in tl.static_range(2):
        lo = 0
        hi = n_mid
        if stage == 1:
            lo = n_mid
            hi = n_end
        dq = _dq_loop(
            dq, q_hi, q_lo, q_c, do_hi, do_lo, do_c, lse, lse2, delta, m_in, offs_m, offs_nl, offs_d,
            offs_dv, k_base, v_base, bias_base, kpm_base, kp_base, vp_base, ke_base, ve_base, parts_k,
            parts_v, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpmn,
            lo, hi, Nk, diag, sm_scale, qk_scale,
            D, Dv, HAS_BIAS, HAS_KPM, CAUSAL, PREC, DOT_UPCAST, stage == 1, BLOCK_M, BLOCK_N, BLOCK_D,
            BLOCK_DV, False, PRESPLIT)
    if count_nonfinite(dq) != 0:
        # As in the dK/dV kernel: redo the query tile with the exact pass, on key tiles a quarter as wide
        # (at least 16: the width of a dot).
        EXACT_N: tl.constexpr = max(BLOCK_N // 4, 16)
        if PREC == "fp16x3":
            q_hi, q_lo, q_c = split_f16(finite_part(q))
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        dq = _dq_loop(
            dq, q_hi, q_lo, q_c, do_hi, do_lo, do_c, lse, lse2, delta, m_in, offs_m, tl.arange(0, EXACT_N),
            offs_d, offs_dv, k_base, v_base, bias_base, kpm_base, kp_base, vp_base, ke_base, ve_base, parts_k,
            parts_v, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpmn,
            0, n_end, Nk, diag, sm_scale, qk_scale,
            D, Dv, HAS_BIAS, HAS_KPM, CAUSAL, PREC, DOT_UPCAST, True, BLOCK_M, EXACT_N, BLOCK_D,
            BLOCK_DV, True)

    dq = dq * sm_scale
    tl.store(DQ + b * stride_dqb + h * stride_dqh + m064 * stride_dqm + offs_ml[:, None] * stride_dqm
             + offs_d[None, :] * stride_dqd, dq.to(DQ.dtype.element_ty),
             mask=m_in[:, None] & (offs_d < D)[None, :])


@triton.jit
def _dbias_members(
    Q, K, V, DO, LSE, DELTA, KPM, bias_base,
    stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm, stride_bm, stride_bn, stride_kpmb, stride_kpmn,
    bb, hb, per_h, t_lo, t_hi, m_lo, m_hi, n_lo, n_hi, H, Nq, Nk, BIAS_B, BIAS_H, diag, sm_scale,
    offs_ml, offs_nl, offs_d, offs_dv, d_in, dv_in,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EXACT: tl.constexpr,
):
    """``_bwd_dbias_kernel``'s sum of ``dS`` over the members ``[t_lo, t_hi)`` and the tiles ``[m_lo, m_hi)``
    x ``[n_lo, n_hi)`` of its output tile. ``EXACT``: ``dP`` from the finite part of ``V``, ``P`` 0 where a
    ``-inf`` bias hides the pair and ``dS`` 0 where ``P`` is (see ``_dkdv_loop``)."""
    zero64 = tl.full([], 0, tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for t in range(t_lo, t_hi):
        b = bb + (t // per_h) * BIAS_B + zero64
        h = hb + (t % per_h) * BIAS_H + zero64
        bh = b * H + h
        for m0 in range(m_lo, m_hi, BLOCK_M):
            offs_m = m0 + offs_ml
            m_in = offs_m < Nq
            m064 = m0 + zero64
            q = tl.load(Q + b * stride_qb + h * stride_qh + m064 * stride_qm + offs_ml[:, None] * stride_qm
                        + offs_d[None, :] * stride_qd, mask=m_in[:, None] & d_in[None, :], other=0.0)
            do = tl.load(DO + b * stride_dob + h * stride_doh + m064 * stride_dom
                         + offs_ml[:, None] * stride_dom
                         + offs_dv[None, :] * stride_dod, mask=m_in[:, None] & dv_in[None, :], other=0.0)
            lse = tl.load(LSE + b * stride_lb + h * stride_lh + m064 * stride_lm + offs_ml * stride_lm,
                          mask=m_in, other=0.0)
            lse = tl.where(lse == float("-inf"), 0.0, lse)
            delta = tl.load(DELTA + bh * Nq + offs_m, mask=m_in, other=0.0)
            for n0 in range(n_lo, n_hi, BLOCK_N):
                offs_n = n0 + offs_nl
                n064 = n0 + zero64
                key_ok = offs_n < Nk
                if HAS_KPM:
                    kpm = tl.load(KPM + b * stride_kpmb + n064 * stride_kpmn + offs_nl * stride_kpmn,
                                  mask=key_ok, other=0)
                    key_ok = key_ok & (kpm != 0)
                k = tl.load(K + b * stride_kb + h * stride_kh + n064 * stride_kn
                            + offs_nl[:, None] * stride_kn
                            + offs_d[None, :] * stride_kd, mask=key_ok[:, None] & d_in[None, :], other=0.0)
                v = tl.load(V + b * stride_vb + h * stride_vh + n064 * stride_vn
                            + offs_nl[:, None] * stride_vn
                            + offs_dv[None, :] * stride_vd, mask=key_ok[:, None] & dv_in[None, :], other=0.0)
                qk = _mm(q, tl.trans(k),
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PREC, DOT_UPCAST)
                p = _probs(qk, bias_base + m064 * stride_bm + n064 * stride_bn + offs_ml[:, None] * stride_bm
                           + offs_nl[None, :] * stride_bn, lse[:, None], lse[:, None], offs_m[:, None],
                           offs_n[None, :], m_in[:, None], key_ok[None, :], diag, sm_scale, sm_scale,
                           True, CAUSAL, True, EXACT)
                if EXACT:
                    v = finite_part(v)
                dp = _mm(do, tl.trans(v),
                         tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PREC, DOT_UPCAST)
                ds = p * (dp - delta[:, None])
                if EXACT:
                    ds = tl.where(p == 0.0, 0.0, ds)
                acc += ds
    return acc


@triton.jit
def _bwd_dbias_kernel(
    Q, K, V, DO, LSE, DELTA, BIAS, KPM, DB,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_dob, stride_doh, stride_dom, stride_dod,
    stride_lb, stride_lh, stride_lm,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_kpmb, stride_kpmn,
    stride_dbs, stride_dbb, stride_dbh, stride_dbm, stride_dbn,
    H, Nq, Nk, D, Dv, BIAS_B, BIAS_H, N_MEMBERS, MEMBERS_PER_SPLIT,
    sm_scale,
    HAS_KPM: tl.constexpr, CAUSAL: tl.constexpr, REDUCE_M: tl.constexpr, REDUCE_N: tl.constexpr,
    PREC: tl.constexpr, DOT_UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """``dBias = dS`` summed over the bias's broadcast dims, one program per reduced output tile.

    Grid: (``BIAS_B * BIAS_H * splits``, query tiles or 1 if ``REDUCE_M``, key tiles or 1 if ``REDUCE_N``);
    the batch-like axis is axis 0, whose limit is 2^31 - 1 (axes 1 and 2 stop at 65535).
    The ``N_MEMBERS = (B / BIAS_B) * (H / BIAS_H)`` pairs ``(b, h)`` sharing one bias slice are visited in
    a fixed order (member ``t``: ``b = bb + (t // (H / BIAS_H)) * BIAS_B``, ``h = hb + (t % (H / BIAS_H)) *
    BIAS_H``), split into chunks of ``MEMBERS_PER_SPLIT``; chunk ``s`` writes slice ``s`` of ``DB``
    (float32 ``[splits, BIAS_B, BIAS_H, Mb, Nb]``).
    """
    pid_m = tl.program_id(1)
    pid_n = tl.program_id(2)
    pid_z = tl.program_id(0)
    n_slices = BIAS_B * BIAS_H
    split = pid_z // n_slices
    rest = pid_z % n_slices
    bb = rest // BIAS_H
    hb = rest % BIAS_H
    per_h = H // BIAS_H
    diag = Nk - Nq
    offs_ml = tl.arange(0, BLOCK_M)
    offs_nl = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    d_in = offs_d < D
    dv_in = offs_dv < Dv
    if REDUCE_M:
        m_lo = 0
        m_hi = Nq
    else:
        m_lo = pid_m * BLOCK_M
        m_hi = m_lo + 1
    if REDUCE_N:
        n_lo = 0
        n_hi = Nk
    else:
        n_lo = pid_n * BLOCK_N
        n_hi = n_lo + 1
    bias_base = BIAS + bb.to(tl.int64) * stride_bb + hb.to(tl.int64) * stride_bh
    t_lo = split * MEMBERS_PER_SPLIT
    t_hi = tl.minimum(t_lo + MEMBERS_PER_SPLIT, N_MEMBERS)

    acc = _dbias_members(
        Q, K, V, DO, LSE, DELTA, KPM, bias_base,
        stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
        stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
        stride_lb, stride_lh, stride_lm, stride_bm, stride_bn, stride_kpmb, stride_kpmn,
        bb, hb, per_h, t_lo, t_hi, m_lo, m_hi, n_lo, n_hi, H, Nq, Nk, BIAS_B, BIAS_H, diag, sm_scale,
        offs_ml, offs_nl, offs_d, offs_dv, d_in, dv_in,
        HAS_KPM, CAUSAL, PREC, DOT_UPCAST, BLOCK_M, BLOCK_N, False)
    if count_nonfinite(acc) != 0:
        # A NaN or an infinity reached the sum: from a row that sees one (kept), or through a hidden pair's
        # zero (0 * NaN), which the exact pass leaves out. Redo the sum with it.
        acc = _dbias_members(
            Q, K, V, DO, LSE, DELTA, KPM, bias_base,
            stride_qb, stride_qh, stride_qm, stride_qd, stride_kb, stride_kh, stride_kn, stride_kd,
            stride_vb, stride_vh, stride_vn, stride_vd, stride_dob, stride_doh, stride_dom, stride_dod,
            stride_lb, stride_lh, stride_lm, stride_bm, stride_bn, stride_kpmb, stride_kpmn,
            bb, hb, per_h, t_lo, t_hi, m_lo, m_hi, n_lo, n_hi, H, Nq, Nk, BIAS_B, BIAS_H, diag, sm_scale,
            offs_ml, offs_nl, offs_d, offs_dv, d_in, dv_in,
            HAS_KPM, CAUSAL, PREC, DOT_UPCAST, BLOCK_M, BLOCK_N, True)

    out_base = (DB + split.to(tl.int64) * stride_dbs + bb.to(tl.int64) * stride_dbb
                + hb.to(tl.int64) * stride_dbh)
    offs_m = pid_m * BLOCK_M + offs_ml
    offs_n = pid_n * BLOCK_N + offs_nl
    if REDUCE_M:
        if REDUCE_N:
            total = tl.sum(tl.sum(acc, axis=1), axis=0)
            tl.store(out_base, total)
        else:
            col = tl.sum(acc, axis=0)
            tl.store(out_base + offs_n.to(tl.int64) * stride_dbn, col, mask=offs_n < Nk)
    else:
        if REDUCE_N:
            row = tl.sum(acc, axis=1)
            tl.store(out_base + offs_m.to(tl.int64) * stride_dbm, row, mask=offs_m < Nq)
        else:
            tl.store(out_base + offs_m.to(tl.int64)[:, None] * stride_dbm
                     + offs_n.to(tl.int64)[None, :] * stride_dbn,
                     acc, mask=(offs_m < Nq)[:, None] & (offs_n < Nk)[None, :])


# -------------------------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class BwdConfig:
    """Tile shapes and launch parameters of the three backward kernels.

    ``*_1``: dK/dV kernel (key tile ``block_n1`` rows, loops over query tiles of ``block_m1``);
    ``*_2``: dQ kernel (query tile ``block_m2``, loops over key tiles of ``block_n2``);
    ``*_3``: dBias kernel (output tile ``block_m3 x block_n3``).
    """

    block_m1: int = 32
    block_n1: int = 64
    warps1: int = 4
    stages1: int = 2
    block_m2: int = 64
    block_n2: int = 32
    warps2: int = 4
    stages2: int = 2
    block_m3: int = 64
    block_n3: int = 64
    warps3: int = 4


def _cfg(dkdv: tuple[int, int, int, int], dq: tuple[int, int, int, int],
         dbias: tuple[int, int, int] = (64, 32, 4)) -> BwdConfig:
    """A ``BwdConfig`` from ``(BLOCK_M, BLOCK_N, warps, stages)`` of the dK/dV and dQ kernels and
    ``(BLOCK_M, BLOCK_N, warps)`` of the dBias kernel."""
    return BwdConfig(*dkdv, *dq, *dbias)


def bwd_config(dtype: torch.dtype, d: int, dv: int, device: torch.device, precision: str = "tf32x3",
               n_k: int | None = None, has_bias: bool = False, heads: int | None = None) -> BwdConfig:
    """Default tiles for the backward from the dtype, head dims, key length and device (no environment
    variables).

    Chosen from tile sweeps (``python -m benchmarks.attention_bwd --tiles``; measurements in
    ``docs/kernel_notes.md``, "Backward"): half precision takes dK/dV tiles of 32 queries x 128 keys (4 warps,
    3 stages) and, at head dims <= 64, dQ tiles of 128 queries x 64 keys on 8 warps (64 x 64 on 4 warps up to
    ``n_k = 1024`` keys, and 128 x 64 on 4 warps at 193-256 keys -- ViT's 197 tokens, where both tiles pad to
    256 rows -- when ``heads`` (B x H) give at least one such tile per multiprocessor); wider half-precision
    heads take dK/dV 64 x 128 and dQ 128 x 64 on 8 warps (2.6x the 4-warp 32 x 128 / 128 x 32 split at 1 x 8 x
    4096 x 128 on an H100); float32 runs best with larger tiles on 8 warps (dK/dV 64 x 128, dQ 128 x 64),
    which pays for the three products per tile of ``tf32x3`` and ``fp16x3``.
    ``fp16x3`` (``precision`` is the resolved ``tl.dot`` precision; its operands split once per call) at head
    dim <= 64: past ``n_k = 1024`` keys dK/dV 64 x 128 on 3 stages and dQ 128 x 128 on 2 (128 x 64 on 3
    with a bias, ``has_bias``: a 128 x 128 bias tile is over the shared memory), up to 1024 keys 64 x 64 /
    64 x 64 on 4 warps (more programs for short sequences); at head dim 128 the 32 x 128 / 128 x 32 split
    on 8 warps, 3 stages (2 with a bias). Wider heads shrink the resident tiles to keep operands and
    accumulators in registers. ``precision="ieee"`` uses the smaller float32 tiles (its FMA
    products are slower on the large ones).
    The dBias kernel always runs unpipelined (``num_stages=1``, so the config has no stage count for it): its
    nested member / tile loops are mis-pipelined otherwise (``docs/kernel_notes.md``, "Compiler and hardware
    behaviour").
    """
    wide = max(next_pow2(d), next_pow2(dv))
    if device.type != "cuda":
        # CPU interpreter: few large tiles (the interpreter's cost is per program and per loop step)
        return BwdConfig(block_m1=64, block_n1=64, block_m2=64, block_n2=64, block_m3=64, block_n3=64)
    if dtype in (torch.float16, torch.bfloat16) and wide <= 64:
        keys = n_k if n_k is not None else 1 << 30
        dq = (64, 64, 4, 3) if keys <= 1024 else (128, 64, 8, 3)
        if 192 < keys <= 256 and heads is not None and 2 * heads >= device_info(device)[0]:
            dq = (128, 64, 4, 3)
        cfg = _cfg((32, 128, 4, 3), dq, (64, 64, 4))
    elif dtype in (torch.float16, torch.bfloat16):
        cfg = _cfg((64, 128, 8, 3), (128, 64, 8, 3), (64, 64, 4))
    elif precision == "fp16x3" and wide <= 64:
        short = n_k is not None and n_k <= 1024
        if short:
            cfg = _cfg((64, 64, 4, 2), (64, 64, 4, 2))
        else:  # a bias tile of 128 x 128 takes the dQ kernel over the shared memory
            cfg = _cfg((64, 128, 8, 3), (128, 64, 8, 3) if has_bias else (128, 128, 8, 2))
    elif precision == "fp16x3" and wide <= 128:
        stages = 2 if has_bias else 3
        cfg = _cfg((32, 128, 8, stages), (128, 32, 8, stages))
    elif wide <= 64 and precision != "ieee":
        cfg = _cfg((64, 128, 8, 2), (128, 64, 8, 2))
    else:
        cfg = _cfg((32, 64, 4, 2), (64, 32, 4, 2))
    if wide >= 256:
        cfg = BwdConfig(block_m1=max(16, cfg.block_m1 // 2), block_n1=max(16, cfg.block_n1 // 2),
                        warps1=8, stages1=1, block_m2=max(16, cfg.block_m2 // 2),
                        block_n2=max(16, cfg.block_n2 // 2), warps2=8, stages2=1,
                        block_m3=32, block_n3=32, warps3=4)
    return cfg


# -------------------------------------------------------------------------------------------- launcher


class _BwdProgram(Program):
    """Every launch of one backward signature, planned once (see ``launch``).

    Launch order: the dQ kernel (which also forms and writes ``Delta`` unless it was given), then the dK/dV
    kernel, then the dBias kernel; with ``hopper``, where it applies, ``bwd_sm90``'s passes in their place
    (``_HopperPass``), after the ``Delta`` kernel, or with ``fuse`` too, where both gradients are wanted and
    the head dim has a five-product config, ``_HopperFused`` (its dQ sum zeroed by the ``Delta`` kernel).
    The separate ``Delta`` kernel runs where no generic dQ pass precedes the dK/dV one (``compute_dq=False``,
    or a Hopper dQ) and ``Delta`` is not given. The gradients go to tensors the program allocates, or to the
    caller's ``dq``, ``dk``, ``dv`` (``grads``: their strides are planned here, e.g. views of one packed
    ``dqkv``)."""

    def __init__(self, do, q, k, v, out, lse, attn_bias, key_padding_mask, dq, dk, dv, causal, scale,
                 precision, bias_requires_grad, config, given_delta, compute_dq, compute_dkdv, hopper=False,
                 fuse=False):
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[3]
        device = q.device
        self.device, self.dtype = device, q.dtype
        self.device_index = device.index if q.is_cuda else None
        self.q_size, self.k_size, self.v_size = (B, H, Nq, D), (B, H, Nk, D), (B, H, Nk, Dv)
        # the gradients' strides: the caller's tensors, or the contiguous ones ``run`` allocates
        dq_s, dk_s, dv_s = (_contiguous(size) if t is None else t.stride()
                            for t, size in ((dq, self.q_size), (dk, self.k_size), (dv, self.v_size)))
        self.delta_size = (B, H, Nq)
        self.compute_dq, self.compute_dkdv, self.given_delta = compute_dq, compute_dkdv, given_delta
        self.empty = min(B, H, Nq, Nk) == 0
        if self.empty:
            return
        prec = resolve_precision(precision, q.dtype, device, "bwd", max(D, Dv))
        sm_scale = float(scale)
        qk_scale = sm_scale * LOG2E
        cfg = config or bwd_config(q.dtype, D, Dv, device, prec, Nk, attn_bias is not None, B * H)
        BLOCK_D, BLOCK_DV = tile_size(D), tile_size(Dv)
        dot_upcast = device.type == "cpu" and q.dtype == torch.bfloat16
        has_bias, has_kpm = attn_bias is not None, key_padding_mask is not None
        if has_bias:
            bias4 = attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))
            Bb, Hb, Mb, Nb = bias4.shape
            bias_e = bias4.expand(Bb, Hb, Nq, Nk)
            b_strides = (bias_e.stride(0) if Bb > 1 else 0, bias_e.stride(1) if Hb > 1 else 0,
                         bias_e.stride(2), bias_e.stride(3))
        else:
            Bb, Hb, Mb, Nb = 1, 1, 1, 1
            b_strides = (0, 0, 0, 0)
        kpm_strides = ((key_padding_mask.stride(0) if key_padding_mask.shape[0] > 1 else 0,
                        key_padding_mask.stride(1)) if has_kpm else (0, 0))
        q_s, k_s, v_s, do_s, lse_s = q.stride(), k.stride(), v.stride(), do.stride(), lse.stride()
        o_s = out.stride() if out is not None else (0, 0, 0, 0)
        presplit = prec == "fp16x3" and PRESPLIT
        dense = (bwd_sm90 is not None and config is None and not (has_bias or has_kpm or causal) and D == Dv
                 and dq_s[3] == dk_s[3] == dv_s[3] == 1)  # the Hopper epilogues: head dim contiguous
        # float32 calls wanting every gradient: the FP32-accurate five-product kernel on the split operands
        split_fused = (hopper and fuse and dense and presplit and compute_dq and compute_dkdv
                       and D in bwd_sm90.FUSED_SPLIT_CONFIGS and bwd_sm90.supported_split(q, k, v, do)
                       and cdiv(Nk, bwd_sm90.ROWS.value * bwd_sm90.CONSUMERS.value) * B * H
                       >= HOPPER_SPLIT_MIN_WAVES * device_info(device)[0])
        hopper = split_fused or (hopper and dense and Nk >= HOPPER_MIN_KEYS.get(D, 0)
                                 and bwd_sm90.supported(q, k, v, do))
        fused = split_fused or (hopper and fuse and compute_dq and compute_dkdv
                                and D in bwd_sm90.FUSED_CONFIGS)
        # the tiles the operands are split in: those of the generic loops, or of the five-product kernel
        if split_fused:
            split_n, split_m = bwd_sm90.ROWS.value, bwd_sm90.FUSED_SPLIT_CONFIGS[D][0]
        else:
            split_n, split_m = cfg.block_n2, cfg.block_m1
        self.acc_size = (B, H, Nq, D) if fused else None
        # Delta: formed by the generic dQ kernel, or by a pass of its own before a Hopper or no dQ pass (which
        # zeroes the five-product backward's dQ sum on the way)
        self.write_delta = compute_dq and not given_delta and not hopper
        self.pre = None
        if not given_delta and not self.write_delta:
            self.pre = Launch(_bwd_preprocess_kernel, (B * H, cdiv(Nq, 64)), (*o_s, *do_s, H, Nq, Dv),
                              dict(BLOCK_M=64, BLOCK_DV=BLOCK_DV, ZERO_ACC=fused), 4)
        common = dict(D=D, Dv=Dv, HAS_BIAS=has_bias, HAS_KPM=has_kpm, CAUSAL=causal, PREC=prec,
                      DOT_UPCAST=dot_upcast)
        bh = B * H
        rows = 64  # the Hopper passes' flags: one per 64 own rows
        self.dq = self.split_kv = self.hopper_dq = self.hopper_fused = None
        redo_dq = None
        if compute_dq:
            parts = (bh * Nk * D, bh * Nk * Dv) if presplit else (0, 0)
            scalars = (*q_s, *k_s, *v_s, *do_s, *o_s, *lse_s, *b_strides, *kpm_strides,
                       *dq_s, H, Nq, Nk, Bb, Hb, sm_scale, qk_scale, *parts)
            consts = dict(common, WRITE_DELTA=self.write_delta, BLOCK_M=cfg.block_m2, BLOCK_N=cfg.block_n2,
                          BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV, PRESPLIT=presplit, REDO=False)
            if hopper:  # the Hopper pass, then the generic kernel over the tiles it flagged
                redo_dq = Launch(_bwd_dq_kernel, (bh, cdiv(Nq, rows)), scalars,
                                 dict(consts, BLOCK_M=rows, PRESPLIT=False, REDO=True), 4, cfg.stages2)
                if not fused:
                    self.hopper_dq = _HopperPass(True, B, H, Nq, Nk, D, sm_scale, lse_s, dq_s, dq_s, redo_dq)
            else:
                self.dq = Launch(_bwd_dq_kernel, (bh, cdiv(Nq, cfg.block_m2)), scalars, consts, cfg.warps2,
                                 cfg.stages2)
            if presplit:
                self.split_kv = self._split(k_s, v_s, kpm_strides, H, Nk, D, Dv, split_n, has_kpm, parts)
        self.dkdv = self.split_qdo = self.hopper_dkdv = None
        if compute_dkdv:
            parts = (bh * Nq * D, bh * Nq * Dv) if presplit else (0, 0)
            scalars = (*q_s, *k_s, *v_s, *do_s, *lse_s, *b_strides, *kpm_strides, *dk_s, *dv_s, H, Nq, Nk, Bb,
                       Hb, sm_scale, qk_scale, *parts)
            consts = dict(common, BLOCK_M=cfg.block_m1, BLOCK_N=cfg.block_n1, BLOCK_D=BLOCK_D,
                          BLOCK_DV=BLOCK_DV, PRESPLIT=presplit, REDO=False)
            if hopper:
                redo = Launch(_bwd_dkdv_kernel, (bh, cdiv(Nk, rows)), scalars,
                              dict(consts, BLOCK_N=rows, PRESPLIT=False, REDO=True), 4, cfg.stages1)
                if fused:
                    self.hopper_fused = _HopperFused(B, H, Nq, Nk, D, sm_scale, lse_s, dq_s, dk_s, dv_s,
                                                     redo_dq, redo, split_fused)
                else:
                    self.hopper_dkdv = _HopperPass(False, B, H, Nq, Nk, D, sm_scale, lse_s, dk_s, dv_s, redo)
            else:
                self.dkdv = Launch(_bwd_dkdv_kernel, (bh, cdiv(Nk, cfg.block_n1)), scalars, consts,
                                   cfg.warps1, cfg.stages1)
            if presplit:
                self.split_qdo = self._split(q_s, do_s, (0, 0), H, Nq, D, Dv, split_m, False, parts)
        self.dbias = None
        if has_bias and bias_requires_grad:
            reduce_m, reduce_n = Mb == 1, Nb == 1
            grid_m = 1 if reduce_m else cdiv(Nq, cfg.block_m3)
            grid_n = 1 if reduce_n else cdiv(Nk, cfg.block_n3)
            n_members = (B // Bb) * (H // Hb)
            tiles = grid_m * grid_n * Bb * Hb
            # Split the member loop only when the reduced grid cannot fill the device (fixed-order sum after).
            target = 2 * device_info(device)[0]
            n_split = max(1, min(n_members, target // tiles)) if tiles < target else 1
            per_split = cdiv(n_members, n_split)
            n_split = cdiv(n_members, per_split)
            self.ws_size = (n_split, Bb, Hb, Mb, Nb)
            self.bias_shape, self.bias_dtype = tuple(attn_bias.shape), attn_bias.dtype
            # The dBias kernel recomputes S and dP with tf32x3 under fp16x3 (FP32-accurate either way).
            self.dbias = Launch(
                _bwd_dbias_kernel, (Bb * Hb * n_split, grid_m, grid_n),
                (*q_s, *k_s, *v_s, *do_s, *lse_s, *b_strides, *kpm_strides, *_contiguous(self.ws_size),
                 H, Nq, Nk, D, Dv, Bb, Hb, n_members, per_split, sm_scale),
                dict(HAS_KPM=has_kpm, CAUSAL=causal, REDUCE_M=reduce_m, REDUCE_N=reduce_n,
                     PREC="tf32x3" if prec == "fp16x3" else prec, DOT_UPCAST=dot_upcast, BLOCK_M=cfg.block_m3,
                     BLOCK_N=cfg.block_n3, BLOCK_D=BLOCK_D, BLOCK_DV=BLOCK_DV),
                cfg.warps3, 1)  # unpipelined: see bwd_config

    def _split(self, x_s, y_s, kpm_s, H, N, dx, dy, block, has_kpm, parts):
        """``(launch, sizes)`` of ``_split_pair_kernel`` over two ``[B, H, N, *]`` operands in tiles of
        ``block`` rows: the parts and exponents it writes are allocated per call with ``sizes``."""
        bh = self.q_size[0] * H
        tiles = cdiv(N, block)
        launch = Launch(_split_pair_kernel, (tiles * bh,), (*x_s, *y_s, *kpm_s, H, N, tiles, *parts),
                        dict(DX=dx, DY=dy, BLOCK=block, BLOCK_DX=tile_size(dx), BLOCK_DY=tile_size(dy),
                             HAS_KPM=has_kpm), 4)
        return launch, ((2, bh, N, dx), (2, bh, N, dy), (bh, tiles), (bh, tiles))

    def _parts(self, split, x, y, kpm):
        """The parts and exponents of ``split`` (see ``_split``) for ``x``, ``y``; four dummies without."""
        if split is None:
            return (x,) * 4
        launch, sizes = split
        out = tuple(torch.empty(size, dtype=torch.float16 if i < 2 else torch.int32, device=self.device)
                    for i, size in enumerate(sizes))
        launch(x, y, kpm, *out)
        return out

    def run_hopper(self, do, q, k, v, out, lse, delta, dq, dk, dv, bias=None, kpm=None, acc=None):
        """The Hopper passes this program routes (``hopper_dq``, ``hopper_dkdv``), each followed by its redo
        launch, or the five-product backward (``hopper_fused``, summing dQ in ``acc``: zeroed by the
        ``Delta`` pass, else here; allocated when None), into ``dq`` and ``dk``, ``dv`` from the given
        ``Delta``; ``bias`` and ``kpm`` are the generic kernels' unread placeholders (``delta`` when None).
        Returns the flags ``[B * H, cdiv(own rows, 64)]`` of the redone dQ and dK/dV tiles (None for a pass
        not routed)."""
        if self.hopper_fused is not None and acc is None:
            acc = torch.zeros(self.acc_size, dtype=torch.float32, device=self.device)
        bias = delta if bias is None else bias
        kpm = delta if kpm is None else kpm
        out = delta if out is None else out
        # the generic kernels' tensor arguments before ``Redo`` (the parts they do not read: ``delta``)
        redo_dq = (q, k, v, do, out, lse, delta, bias, kpm, dq, delta, delta, delta, delta)
        redo_dkdv = (q, k, v, do, lse, delta, bias, kpm, dk, dv, delta, delta, delta, delta)
        if self.hopper_fused is not None:
            parts = ()
            if self.hopper_fused.split:  # the float32 operands as float16 parts and exponents
                parts = (*self._parts(self.split_kv, k, v, kpm), *self._parts(self.split_qdo, q, do, kpm))
            return self.hopper_fused(q, k, v, do, lse, delta, acc, dq, dk, dv, redo_dq, redo_dkdv, parts)
        fq = fk = None
        if self.hopper_dq is not None:
            fq = self.hopper_dq((q, do), (k, v), lse, delta, dq, dq, redo_dq)
        if self.hopper_dkdv is not None:
            fk = self.hopper_dkdv((k, v), (q, do), lse, delta, dk, dv, redo_dkdv)
        return fq, fk

    def run(self, do, q, k, v, out, lse, bias, kpm, delta, grads=None):
        dev, dtype = self.device, self.dtype
        if grads is not None:  # the caller's (planned with their strides)
            dq, dk, dv = grads
        else:
            dq = torch.empty(self.q_size, dtype=dtype, device=dev) if self.compute_dq else None
            dk = torch.empty(self.k_size, dtype=dtype, device=dev) if self.compute_dkdv else None
            dv = torch.empty(self.v_size, dtype=dtype, device=dev) if self.compute_dkdv else None
        if self.empty:
            return (None if dq is None else dq.zero_(), None if dk is None else dk.zero_(),
                    None if dv is None else dv.zero_(), None)
        if delta is None:
            delta = torch.empty(self.delta_size, dtype=torch.float32, device=dev)
        elif not delta.is_contiguous():
            delta = delta.contiguous()
        if out is None:
            out = delta  # not read: Delta is given
        if bias is None:
            bias = delta  # not read: HAS_BIAS is False
        kpm = delta if kpm is None else kpm.view(torch.uint8)
        acc = None
        if self.acc_size is not None:  # the five-product backward's dQ sum (zeroed by the Delta pass)
            acc = torch.empty(self.acc_size, dtype=torch.float32, device=dev)
            if self.pre is None:
                acc.zero_()
        if self.pre is not None:
            self.pre(out, do, delta, delta if acc is None else acc)
        if self.hopper_dq is not None or self.hopper_dkdv is not None or self.hopper_fused is not None:
            self.run_hopper(do, q, k, v, out, lse, delta, dq, dk, dv, bias, kpm, acc)
        if self.dq is not None:
            self.dq(q, k, v, do, out, lse, delta, bias, kpm, dq, *self._parts(self.split_kv, k, v, kpm),
                    delta)  # Redo: not read
        if self.dkdv is not None:
            self.dkdv(q, k, v, do, lse, delta, bias, kpm, dk, dv, *self._parts(self.split_qdo, q, do, kpm),
                      delta)  # Redo: not read
        dbias = None
        if self.dbias is not None:
            ws = torch.empty(self.ws_size, dtype=torch.float32, device=dev)
            self.dbias(q, k, v, do, lse, delta, bias, kpm, ws)
            red = ws[0]
            for s in range(1, self.ws_size[0]):  # fixed order: bitwise reproducible
                red = red + ws[s]
            dbias = red.to(self.bias_dtype).reshape(self.bias_shape)
        return dq, dk, dv, dbias


class _HopperPass:
    """One backward pass of one signature on ``bwd_sm90``'s kernel -- dQ (``dq``) or dK/dV -- then the
    generic kernel of that pass over the 64-row tiles it flagged (``redo``: its ``REDO`` launch; non-finite
    gradients; the other programs return at once)."""

    def __init__(self, dq: bool, B, H, Nq, Nk, D, sm_scale, lse_strides, out1_strides, out2_strides,
                 redo: Launch):
        rows = bwd_sm90.ROWS.value
        self.block_s, stages = bwd_sm90.CONFIGS[D]
        n_own, n_stream = (Nq, Nk) if dq else (Nk, Nq)
        own_tiles = cdiv(n_own, rows * bwd_sm90.CONSUMERS.value)
        self.flags = (B * H, cdiv(n_own, rows))
        # the gradients' strides (dQ twice, or dK and dV) but the head dim's (1)
        self.main = Launch(bwd_sm90.bwd_kernel, (own_tiles * B * H,),
                           (H, n_own, n_stream, own_tiles, *lse_strides, *out1_strides[:3], *out2_strides[:3],
                            sm_scale * LOG2E, sm_scale),
                           dict(D=D, BLOCK_S=self.block_s, STAGES=stages, DQ=dq),
                           bwd_sm90.NUM_WARPS)
        self.redo = redo
        self.descs = None

    def __call__(self, resident, streamed, lse, delta, out1, out2, redo_tensors):
        """Write ``out1`` (dQ, or dK) and ``out2`` (dV) from the ``resident`` pair (dQ: Q, dO; dK/dV: K, V)
        and the ``streamed`` one; then the redo launch over ``redo_tensors`` (the generic kernel's tensor
        arguments before ``Redo``). Returns the flags ``[B * H, cdiv(own rows, 64)]`` of the redone tiles."""
        if self.descs is None:  # built (and checked) once, then pointed at each call's tensors
            rows = bwd_sm90.ROWS.value
            self.descs = tuple(bwd_sm90.descriptor(t, rows) for t in resident) + tuple(
                bwd_sm90.descriptor(t, self.block_s) for t in streamed)
        descs = self.descs
        for desc, t in zip(descs, (*resident, *streamed)):
            desc.base = t
        flags = torch.empty(self.flags, dtype=torch.int32, device=lse.device)  # every flag written
        try:
            self.main(*descs, lse, delta, out1, out2, flags)
        finally:  # the cached descriptors must not keep this call's tensors alive
            for desc in descs:
                desc.base = None
        self.redo(*redo_tensors, flags)
        return flags


class _HopperFused:
    """The five-product backward on ``bwd_sm90.bwd_fused_kernel`` (half precision) or, with ``split``,
    ``bwd_fused_f16x3_kernel`` (float32 as ``fp16x3`` parts): dK, dV and the float32 sum ``dS K`` over the
    key programs in one pass, then ``dQ = scale * sum`` in dQ's dtype (``_bwd_dq_convert_kernel``, which
    flags non-finite rows), then each generic kernel's ``REDO`` launch over its flagged 64-row tiles."""

    def __init__(self, B, H, Nq, Nk, D, sm_scale, lse_strides, dq_strides, dk_strides, dv_strides,
                 redo_dq: Launch, redo_dkdv: Launch, split: bool = False):
        rows = bwd_sm90.ROWS.value
        self.split = split
        configs = bwd_sm90.FUSED_SPLIT_CONFIGS if split else bwd_sm90.FUSED_CONFIGS
        kernel = bwd_sm90.bwd_fused_f16x3_kernel if split else bwd_sm90.bwd_fused_kernel
        self.block_s, stages = configs[D]
        own_tiles = cdiv(Nk, rows * bwd_sm90.CONSUMERS.value)
        self.flags_k, self.flags_q = (B * H, cdiv(Nk, rows)), (B * H, cdiv(Nq, rows))
        self.main = Launch(kernel, (own_tiles * B * H,),
                           (H, Nk, Nq, own_tiles, *lse_strides, *dk_strides[:3], *dv_strides[:3],
                            sm_scale * LOG2E, sm_scale),
                           dict(D=D, BLOCK_S=self.block_s, STAGES=stages), bwd_sm90.NUM_WARPS)
        self.convert = Launch(_bwd_dq_convert_kernel, (B * H, cdiv(Nq, rows)),
                              (H, Nq, D, *dq_strides[:3], sm_scale), dict(BLOCK_M=rows, BLOCK_D=tile_size(D)),
                              4)
        self.redo_dq, self.redo_dkdv = redo_dq, redo_dkdv
        self.descs = None

    def __call__(self, q, k, v, do, lse, delta, acc, dq, dk, dv, redo_dq, redo_dkdv, parts=()):
        """Write ``dq``, ``dk``, ``dv`` (``acc``: the zeroed contiguous float32 ``[B, H, Nq, D]`` sum);
        ``redo_*``: the generic kernels' tensor arguments before ``Redo``; ``parts`` (``split``): ``(KP, VP,
        KE, VE, QP, DOP, QE, DOE)`` of ``_split_pair_kernel``, K and V in 64-key tiles, Q and dO in tiles of
        the streamed rows. Returns the flags of the redone dQ and dK/dV tiles."""
        if self.split:
            kp, vp, ke, ve, qp, dop, qe, doe = parts
            loaded, exps = (kp, vp, qp, dop, acc), (ke, ve, qe, doe)
        else:
            loaded, exps = (k, v, q, do, acc), ()
        if self.descs is None:  # built (and checked) once, then pointed at each call's tensors
            rows = bwd_sm90.ROWS.value
            self.descs = tuple(bwd_sm90.descriptor(t, n) for t, n in zip(
                loaded, (rows, rows, self.block_s, self.block_s, rows)))
        descs = self.descs
        for desc, t in zip(descs, loaded):
            desc.base = t
        fk = torch.empty(self.flags_k, dtype=torch.int32, device=lse.device)  # every flag written
        fq = torch.empty(self.flags_q, dtype=torch.int32, device=lse.device)
        try:
            self.main(*descs, *exps, lse, delta, dk, dv, fk)
        finally:  # the cached descriptors must not keep this call's tensors alive
            for desc in descs:
                desc.base = None
        self.convert(acc, dq, fq)
        self.redo_dq(*redo_dq, fq)
        self.redo_dkdv(*redo_dkdv, fk)
        return fq, fk


def _contiguous(size: tuple) -> tuple:
    """Strides of a contiguous tensor of ``size``."""
    strides, acc = [], 1
    for n in reversed(size):
        strides.append(acc)
        acc *= max(1, n)
    return tuple(reversed(strides))


_PROGRAMS = ProgramCache()


def elsa_bwd(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor | None,
    lse: Tensor,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
    bias_requires_grad: bool = False,
    config: BwdConfig | None = None,
    delta: Tensor | None = None,
    compute_dq: bool = True,
    compute_dkdv: bool = True,
    grads: tuple[Tensor | None, Tensor | None, Tensor | None] | None = None,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """Gradients of ``out = softmax(scale * q k^T + bias, masked) @ v`` from the saved ``(out, lse)``.

    A trusted launcher: the inputs are not checked (the public ``elsa_attention`` checks them).

    Args:
        do: output gradient ``[B, H, Nq, Dv]``; any strides.
        q, k, v: ``[B, H, Nq, D]``, ``[B, H, Nk, D]``, ``[B, H, Nk, Dv]``; any strides (fused-qkv views).
        out: forward output ``[B, H, Nq, Dv]`` (may be None when ``delta`` is given); lse: float32
            ``[B, H, Nq]`` natural-log log-sum-exp, ``-inf`` for rows with no visible key.
        attn_bias: float ``[Bb, Hb, Mb, Nb]`` (or fewer leading dims) with ``Hb in (1, H)``,
            ``Mb in (1, Nq)``, ``Nb in (1, Nk)`` and ``Bb`` dividing ``B``: batch ``b`` uses bias slice
            ``b % Bb`` (``Bb = 1`` or ``B`` is ordinary broadcasting, ``Bb = nW`` the window layout
            ``B = batch * nW``).
        key_padding_mask: bool ``[B or 1, Nk]``, True = key takes part.
        causal: bottom-right aligned (query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq``).
        scale: logit scale, default ``D ** -0.5``.
        precision: ``"auto" | "ieee" | "tf32x3" | "fp16x3" | "tf32"`` for float32 inputs (ignored for
            half).
        bias_requires_grad: also return ``dbias`` in ``attn_bias``'s shape and dtype (reduced over its
            size-1 / window-tiled dims; a stride-0 *expanded* dim of full size gets its full gradient, as
            autograd requires for that shape).
        config: tile override (``bwd_config`` picks the default).
        delta: float32 ``[B, H, Nq]`` ``rowsum(out * dO)`` computed by the caller (``out`` is then not
            read): context parallelism sends it along with the query rows.
        compute_dq / compute_dkdv: False skips the dQ kernel / the dK/dV kernel (its gradients are returned
            as None), for callers that need one side only (the two passes of ring attention's backward).
        grads: ``(dq, dk, dv)`` to write the gradients into (FlashAttention's convention; None for a pass
            not computed): tensors of q's dtype and the shapes of q, k, v, any strides with the head dim
            contiguous, not overlapping each other or the inputs -- e.g. the views
            ``dqkv.permute(2, 0, 3, 1, 4).unbind(0)`` of one packed ``[B, N, 3, H, D]`` buffer, so that a
            fused qkv projection gets its gradient without a copy (``elsa_attention_qkvpacked``).

    Returns:
        ``(dq, dk, dv, dbias)``: ``grads``, or contiguous ``[B, H, N, D|Dv]`` tensors in the input dtype
        (None where not computed; zeros for empty inputs); ``dbias`` or None.
    """
    if out is None and delta is None:
        raise ValueError("elsa_bwd: pass `out` (the forward output), or `delta` = rowsum(out * do)")
    program = bwd_program(do, q, k, v, out, lse, attn_bias, key_padding_mask, causal, scale, precision,
                          bias_requires_grad, config, delta is not None, compute_dq, compute_dkdv, grads)
    return program(do, q, k, v, out, lse, attn_bias, key_padding_mask, delta, grads)


def bwd_program(do, q, k, v, out, lse, attn_bias=None, key_padding_mask=None, causal=False, scale=None,
                precision="auto", bias_requires_grad=False, config=None, given_delta=False, compute_dq=True,
                compute_dkdv=True, grads=None) -> _BwdProgram:
    """The cached launch program of this backward signature (``elsa_bwd``'s arguments; ``given_delta``:
    ``delta`` is passed): ``program(do, q, k, v, out, lse, bias, kpm, delta, grads) -> (dq, dk, dv, dbias)``
    for any tensors of the same signature (``grads`` included: None, or tensors of the same strides)."""
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    options = (causal, scale, precision, bool(bias_requires_grad), config, given_delta, compute_dq,
               compute_dkdv, HOPPER, HOPPER_FUSED and not torch.are_deterministic_algorithms_enabled())
    dq, dk, dv = (None, None, None) if grads is None else grads
    return _PROGRAMS(_BwdProgram, (do, q, k, v, out, lse, attn_bias, key_padding_mask, dq, dk, dv), options)
