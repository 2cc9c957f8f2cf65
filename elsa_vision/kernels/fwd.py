"""ELSA forward in Triton: the two-level scan over the (m, S, W) monoid.

Level one (``_fwd_kernel``): each program owns one query tile of ``BLOCK_M`` rows of one (batch, head) and
one *partition* of the keys; it folds the partition's key tiles of ``BLOCK_N`` keys into per-row states with
``monoid.fold_tile`` (a FlashAttention-style online softmax is exactly this fold). Level two
(``_merge_kernel``): the partition states of a row are combined by a pairwise log-depth tree of
``monoid.merge_states`` and normalised to ``W / S``.

At ``"fp16x3"`` (FP32-accurate from float16 tensor cores) a pre-pass (``_split_kv_kernel``) splits the keys
and values into float16 parts once, so that the key loop of every query tile only loads parts and issues
tensor-core products (the varlen layout and the exact pass split in the loop).

When the query tiles alone fill the GPU the planner picks one partition and the level-one kernel finalises
in its epilogue (the fused path: no workspace round trip). Otherwise the keys are cut into partitions so
that ``query tiles x partitions`` fills the machine; the workspace holds ``partitions x B x H x Nq`` states.

Everything about a launch (partitions, tiles, warps, stages) comes from ``plan``; nothing reads the
environment. Tiles come from fixed tables of measured winners (``_default_config``); ``set_config`` installs
another config under a ``tuning_key`` (dtype, head dims, causal, bias, arch, precision), which ``plan`` then
uses (the benchmarks' autotuner, ``benchmarks/autotune.py``, does so).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dots import (
    f16_pair,
    matmul,
    matmul_f16x3,
    pow2,
    scale_exponent,
    score_unscale,
    split_f16,
    split_rows,
    store_split,
)
from .host import FLOAT_DTYPES, LOG2E, canonical_device, cdiv, device_info, next_pow2, tile_size
from .launch import AttentionProgram, Launch, ProgramCache, install_config
from .monoid import (
    ACCUMULATION,
    SEGMENT_KEYS,
    add_bias,
    clamp_bias,
    count_nonfinite,
    finalize_state,
    finite_part,
    fold_keys,
    fold_parts,
    identity_state,
    merge_row_states,
    merge_states,
    nonfinite_values,
    settle_sums,
    store_lse,
)
from .precision import resolve_precision
from .reference import merge_depth

try:  # Gluon (Triton 3.5 and later): the warp-specialised Hopper forward
    from . import fwd_sm90
except ImportError:  # pragma: no cover - an older Triton: the generic kernel everywhere
    fwd_sm90 = None

__all__ = ["FwdPlan", "plan", "elsa_fwd", "elsa_fwd_varlen", "set_config", "tuning_key"]

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _load_tile(
    q, q_lo, q_c, cols, row64, offs_n, offs_d, offs_dv, k_ptr, v_ptr, keep,
    stride_kn, stride_kd, stride_vn, stride_vd, seqlen_k, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, HAS_KPM: tl.constexpr,
    EXACT: tl.constexpr, SCALED: tl.constexpr = True,
):
    """``(scores, v)`` of the key tile at ``cols`` (``_attend``): the base-2 logits before bias and masks
    and the value tile (hidden keys' rows zeroed), from the keys and values as given. Without ``SCALED``
    (not ``"fp16x3"``) the scores are ``q k^T`` itself: the caller applies ``qk_scale`` when it folds."""
    kt_ptrs = k_ptr + row64 * stride_kn + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
    v_ptrs = v_ptr + row64 * stride_vn + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    if MASKED:
        kt = tl.load(kt_ptrs, mask=(offs_d[:, None] < D) & (cols[None, :] < seqlen_k), other=0.0)
        v = tl.load(v_ptrs, mask=(cols[:, None] < seqlen_k) & (offs_dv[None, :] < DV), other=0.0)
    else:
        if D == BLOCK_D:
            kt = tl.load(kt_ptrs)
        else:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
        if DV == BLOCK_DV:
            v = tl.load(v_ptrs)
        else:
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
    if HAS_KPM:
        v = tl.where(keep[:, None], v, 0.0)
        if PRECISION == "fp16x3":
            kt = tl.where(keep[None, :], kt, 0.0)  # a hidden key must not set the tile's scale
    if PRECISION == "fp16x3":
        if EXACT:
            k_bad = tl.max(tl.where(tl.abs(kt) < float("inf"), 0, 1), 0) != 0  # [BLOCK_N]
            kt = finite_part(kt)
        kt_hi, kt_lo, k_c = split_f16(kt)
        qk = matmul_f16x3(q, q_lo, kt_hi, kt_lo, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
        scores = qk * score_unscale(q_c + k_c)  # q carries qk_scale (see the caller)
        if EXACT:
            scores = tl.where(k_bad[None, :], float("nan"), scores)
    else:
        scores = matmul(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PRECISION)
        if SCALED:
            scores = scores * qk_scale
    return scores, v


@triton.jit
def _load_parts(
    q, q_lo, q_c, cols, offs_d, offs_dv, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo, tile, seqlen_k,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
):
    """``(scores, v_hi, v_lo, v_scale)`` of key tile number ``tile`` (keys ``cols``) from
    ``_split_kv_kernel``'s parts (``_attend``'s ``PRESPLIT``): the base-2 logits before bias and masks, and
    the value tile's float16 parts with the power of two of each column (``v = (v_hi + v_lo) * v_scale``)."""
    kt_ptrs = kp_ptr + cols.to(tl.int64)[None, :] * D + offs_d[:, None]
    v_ptrs = vp_ptr + cols.to(tl.int64)[:, None] * DV + offs_dv[None, :]
    d_ok = offs_d[:, None] < D
    dv_ok = offs_dv < DV
    if MASKED:
        col_ok = cols < seqlen_k
        kt_hi = tl.load(kt_ptrs, mask=d_ok & col_ok[None, :], other=0.0)
        kt_lo = tl.load(kt_ptrs + kp_lo, mask=d_ok & col_ok[None, :], other=0.0)
        k_c = tl.load(ke_ptr + cols, mask=col_ok, other=0)
        v_hi = tl.load(v_ptrs, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
        v_lo = tl.load(v_ptrs + vp_lo, mask=col_ok[:, None] & dv_ok[None, :], other=0.0)
    else:
        kt_hi = tl.load(kt_ptrs, mask=d_ok, other=0.0)
        kt_lo = tl.load(kt_ptrs + kp_lo, mask=d_ok, other=0.0)
        k_c = tl.load(ke_ptr + cols)
        v_hi = tl.load(v_ptrs, mask=dv_ok[None, :], other=0.0)
        v_lo = tl.load(v_ptrs + vp_lo, mask=dv_ok[None, :], other=0.0)
    v_c = tl.load(ve_ptr + tile * DV + offs_dv, mask=dv_ok, other=0)
    qk = matmul_f16x3(q, q_lo, kt_hi, kt_lo, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32))
    scores = qk * score_unscale(q_c + k_c)[None, :]  # q carries qk_scale; each key row its own power of two
    return scores, v_hi, v_lo, pow2(-v_c)[None, :]


@triton.jit
def _split_kv_kernel(
    K, V, Kpm, KP, VP, KE, VE,
    stride_kb, stride_kh, stride_kn, stride_kd, stride_vb, stride_vh, stride_vn, stride_vd,
    stride_kpb, stride_kpn, H, Nk, key_tiles, kp_lo, vp_lo,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    HAS_KPM: tl.constexpr,
):
    """The ``"fp16x3"`` forward's keys and values as float16 parts, split once instead of in every query
    tile's loop. Grid ``(key_tiles * B * H,)``, one tile of ``BLOCK_N`` keys of one (batch, head) each.

    Keys: ``KP [2, BH, Nk, D]`` (high parts, then low) with one power of two per key row, its exponent in
    ``KE [BH, Nk]`` (``dots.store_split``): the logits' columns are scaled apart, so a key row's magnitude
    or a non-finite entry touches its own logits only. Values: ``VP [2, BH, Nk, DV]`` with one power of two
    per key tile and value column (the product's reduction runs over the keys, so the scale must be
    shared along them), exponents ``VE [BH, key_tiles, DV]``. ``kp_lo``/``vp_lo``: the elements of one
    part (``BH * Nk * D`` / ``BH * Nk * DV``). A column of a tile that holds a NaN or an
    infinity is stored as NaN: the fast pass's state turns NaN and its program redoes the keys exactly.
    Keys hidden by ``key_padding_mask`` are split as zeros (keys and values), as the loop's own split does:
    what they hold never reaches a scale or the state.
    """
    off_b, off_h, bh, tile, rows, in_rows, row_ok = split_rows(tl.program_id(0), key_tiles, H, Nk, Kpm,
                                                               stride_kpb, stride_kpn, BLOCK_N, HAS_KPM)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    rows64 = rows.to(tl.int64)
    k = tl.load(K + off_b * stride_kb + off_h * stride_kh
                + rows64[:, None] * stride_kn + offs_d[None, :] * stride_kd,
                mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    head_rows = bh.to(tl.int64) * Nk
    store_split(KP + head_rows * D, KE + head_rows, k, rows, offs_d, Nk, D, kp_lo, 1, 0)
    v_ok = in_rows[:, None] & (offs_dv[None, :] < DV)
    v = tl.load(V + off_b * stride_vb + off_h * stride_vh
                + rows64[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                mask=row_ok[:, None] & v_ok, other=0.0)
    bad = tl.max(tl.where(tl.abs(v) < float("inf"), 0, 1), 0) != 0  # [BLOCK_DV]: a NaN or an infinity
    c = scale_exponent(tl.max(tl.abs(v), 0))
    hi, lo = f16_pair(tl.where(bad[None, :], float("nan"), v * pow2(c)[None, :]))
    out = (head_rows + rows64)[:, None] * DV + offs_dv[None, :]
    tl.store(VP + out, hi, mask=v_ok)
    tl.store(VP + vp_lo + out, lo, mask=v_ok)
    tl.store(VE + (bh.to(tl.int64) * key_tiles + tile) * DV + offs_dv, c, mask=offs_dv < DV)


@triton.jit
def _attend(
    m_i, s_i, s_c, acc, acc_c, code, q, q_lo, q_c, offs_m, offs_n, offs_d, offs_dv,
    k_ptr, v_ptr, bias_ptr, kpm_ptr, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
    lo, hi, seqlen_k, causal_shift, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, ACCUMULATE: tl.constexpr, EXACT: tl.constexpr,
    PRESPLIT: tl.constexpr, DEFER_SCALE: tl.constexpr,
):
    """Fold the key tiles ``[lo, hi)`` into the state (``s_c``/``acc_c``: the Kahan compensations under
    ``ACCUMULATE == "kahan"``, see ``monoid.fold_tile``). ``MASKED`` adds the bounds and causal masks.

    ``q`` is the query tile; under ``"fp16x3"`` its ``split_f16`` high part, with ``q_lo`` the low part and
    ``q_c`` their scale exponent (split once by the caller;
    ``q_lo``/``q_c`` unused otherwise). ``k_ptr``/``v_ptr`` point at key/value row 0 of this
    (batch, head); ``bias_ptr`` at the tile's ``[BLOCK_M, 1]`` bias rows (column 0); ``kpm_ptr`` at this
    batch's mask entry 0.

    ``EXACT`` (with ``MASKED``): the exact pass of a program whose fast pass met a NaN or an infinity. A
    ``-inf`` bias hides its key whatever the product (``monoid.add_bias``), the values fold with
    ``monoid.fold_keys`` (their visible non-finite entries go to ``code``), and under ``"fp16x3"`` a
    key row holding a NaN or an infinity gets NaN logits instead of setting the tile's split scale. Without
    ``EXACT``, ``code`` is returned untouched; under ``"fp16x3"`` the masks are then added (``-inf``), not
    selected, so that a hidden key's NaN logit (a non-finite key row, which also spoils the tile's scale)
    reaches the state and the check that sends the program to its exact pass.

    ``PRESPLIT`` (``"fp16x3"``, not ``EXACT``): the keys and values come as ``_split_kv_kernel``'s float16
    parts (``kp_ptr``/``vp_ptr`` at this head's row 0, the low parts ``kp_lo``/``vp_lo`` elements after the
    high ones; ``ke_ptr`` one exponent per key row, ``ve_ptr`` one per key tile and value column): no split
    in the loop. A non-finite key row gives its own keys NaN logits; a non-finite value entry makes its
    tile's column NaN, which sends the program to its exact pass (which reads ``k_ptr``/``v_ptr``).

    ``DEFER_SCALE`` (half-precision inputs without a bias, fast pass): the tile's scores stay ``q k^T``
    and ``qk_scale`` joins the weights' exponent in one fused multiply-add (``monoid.tile_weights``): one
    multiply fewer per score.
    """
    USE_PARTS: tl.constexpr = PRESPLIT and not EXACT
    LATE: tl.constexpr = DEFER_SCALE and PRECISION == "none" and not HAS_BIAS and not EXACT
    for start_n in tl.range(lo, hi, BLOCK_N, num_stages=1 if EXACT else None):  # the exact pass: no buffers
        cols = start_n + offs_n
        row64 = tl.cast(start_n, tl.int64)
        keep = cols >= 0
        if HAS_KPM:
            keep = tl.load(kpm_ptr + cols * stride_kpn, mask=cols < seqlen_k, other=0) != 0
        if USE_PARTS:
            scores, v_hi, v_lo, v_scale = _load_parts(
                q, q_lo, q_c, cols, offs_d, offs_dv, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo,
                start_n // BLOCK_N, seqlen_k, D, DV, BLOCK_M, BLOCK_N, MASKED)
        else:
            scores, v = _load_tile(
                q, q_lo, q_c, cols, row64, offs_n, offs_d, offs_dv, k_ptr, v_ptr, keep, stride_kn, stride_kd,
                stride_vn, stride_vd, seqlen_k, qk_scale, D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV,
                PRECISION, MASKED, HAS_KPM, EXACT, not LATE)
        if HAS_BIAS:
            if MASKED:
                b = tl.load(bias_ptr + cols[None, :] * stride_bn,
                            mask=(offs_m[:, None] >= 0) & (cols[None, :] < seqlen_k), other=0.0)
            else:
                b = tl.load(bias_ptr + cols[None, :] * stride_bn)
            b = b.to(tl.float32)
            b = clamp_bias(b)
            if EXACT:
                scores = add_bias(scores, b)
            else:
                scores = scores + b * _LOG2E
        if MASKED:
            valid = cols[None, :] < seqlen_k
            if CAUSAL:
                valid = valid & (cols[None, :] <= offs_m[:, None] + causal_shift)
            if PRECISION == "fp16x3" and not EXACT:
                scores = scores + tl.where(valid, 0.0, float("-inf"))
            else:
                scores = tl.where(valid, scores, float("-inf"))
        if HAS_KPM:
            scores = tl.where(keep[None, :], scores, float("-inf"))
        if USE_PARTS:
            m_i, s_i, acc = fold_parts(m_i, s_i, acc, scores, v_hi, v_lo, v_scale)
        elif LATE:
            m_i, s_i, s_c, acc, acc_c, code = fold_keys(m_i, s_i, s_c, acc, acc_c, code, scores, v, PRECISION,
                                                        ACCUMULATE, EXACT, qk_scale)
        else:
            m_i, s_i, s_c, acc, acc_c, code = fold_keys(m_i, s_i, s_c, acc, acc_c, code, scores, v, PRECISION,
                                                        ACCUMULATE, EXACT)
    return m_i, s_i, s_c, acc, acc_c, code


@triton.jit
def _fwd_kernel(
    Q, K, V, Bias, Kpm, Out, Lse, WsM, WsS, WsW, CuQ, CuK, KP, VP, KE, VE, Redo,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_kpb, stride_kpn,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_lb, stride_lh, stride_lm,
    H, Nq, Nk, BH, m_tiles, tiles_per_split, qk_scale, parts_k, parts_v,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, IS_VARLEN: tl.constexpr, SPLIT: tl.constexpr,
    ACCUMULATE: tl.constexpr, SEGMENT: tl.constexpr, STORE_LSE: tl.constexpr, PRESPLIT: tl.constexpr,
    DEFER_SCALE: tl.constexpr = False, REDO: tl.constexpr = False,
):
    """Level one. Grid ``(m_tiles * B * H, partitions)`` with ``m_tiles = cdiv(Nq, BLOCK_M)`` (query tiles of
    one head adjacent, so that they share its keys in L2; one flat axis: no 65535 limit on ``B * H``).

    ``SPLIT`` = False: one partition, the epilogue writes ``out`` and ``lse``. ``SPLIT`` = True: writes the
    states of partition ``program_id(2)`` to the workspace ``WsM/WsS [P, BH, Nq]``, ``WsW [P, BH, Nq,
    BLOCK_DV]`` (the identity where the partition holds no visible key).

    ``SEGMENT`` > 0 (a multiple of ``BLOCK_N``; ``monoid.SEGMENT_KEYS``): the unmasked key tiles fold in
    segments of ``SEGMENT`` keys, each into a fresh state merged into the running one (a two-level sum).

    ``PRESPLIT`` (``"fp16x3"``, not varlen): ``KP``/``VP``/``KE``/``VE`` hold the keys and values as
    ``_split_kv_kernel`` split them (same ``BLOCK_N``; ``parts_k``/``parts_v`` elements per part); the fast
    pass reads those, the exact pass ``K``/``V``.

    ``REDO``: only the programs whose ``Redo`` flag (one int32 per program) is set run; the others return at
    once. ``fwd_sm90``'s kernel sets the flags of the query tiles whose state it could not finish exactly
    (non-finite inputs), and this launch computes them again, exact pass included.
    """
    pid = tl.program_id(0)
    if REDO:
        if tl.load(Redo + pid) == 0:
            return
    pid_m = pid % m_tiles
    pid_bh = pid // m_tiles
    pid_s = tl.program_id(1)
    off_b = pid_bh // H
    off_h = pid_bh % H
    start_m = pid_m * BLOCK_M

    if IS_VARLEN:
        q_start = tl.load(CuQ + off_b)
        seqlen_q = tl.load(CuQ + off_b + 1) - q_start
        k_start = tl.load(CuK + off_b)
        seqlen_k = tl.load(CuK + off_b + 1) - k_start
        q_off = q_start.to(tl.int64) * stride_qm + off_h.to(tl.int64) * stride_qh
        k_off = k_start.to(tl.int64) * stride_kn + off_h.to(tl.int64) * stride_kh
        v_off = k_start.to(tl.int64) * stride_vn + off_h.to(tl.int64) * stride_vh
        o_off = q_start.to(tl.int64) * stride_om + off_h.to(tl.int64) * stride_oh
        l_off = q_start.to(tl.int64) * stride_lm + off_h.to(tl.int64) * stride_lh
    else:
        seqlen_q = Nq
        seqlen_k = Nk
        q_off = off_b.to(tl.int64) * stride_qb + off_h.to(tl.int64) * stride_qh
        k_off = off_b.to(tl.int64) * stride_kb + off_h.to(tl.int64) * stride_kh
        v_off = off_b.to(tl.int64) * stride_vb + off_h.to(tl.int64) * stride_vh
        o_off = off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
        l_off = off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh

    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < seqlen_q
    rows64 = offs_m.to(tl.int64)

    q_ptrs = Q + q_off + rows64[:, None] * stride_qm + offs_d[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    q_lo = q
    q_c = 0
    q_bad = offs_m < 0
    if PRECISION == "fp16x3":
        # qk_scale (not a power of two) goes into the query tile before its split, so that the scores are
        # the products times a power of two (one float32 rounding per query element, as the scaling of
        # the products on the other paths). A query row holding a NaN or an infinity is split as zeros (it
        # must not set the tile's scale) and made NaN at the end.
        q_bad = tl.max(tl.where(tl.abs(q) < float("inf"), 0, 1), 1) != 0
        q, q_lo, q_c = split_f16(finite_part(q) * qk_scale)

    # Key range of this program: the partition, cut at the causal diagonal of the tile's last row.
    causal_shift = seqlen_k - seqlen_q
    lo = 0
    hi = seqlen_k
    if SPLIT:
        lo = pid_s * tiles_per_split * BLOCK_N
        hi = tl.minimum(hi, lo + tiles_per_split * BLOCK_N)
    if CAUSAL:
        hi = tl.minimum(hi, start_m + BLOCK_M + causal_shift)
        safe = tl.minimum(tl.maximum(start_m + causal_shift + 1, 0), seqlen_k)
    else:
        safe = seqlen_k
    if IS_VARLEN:
        hi = tl.where(start_m < seqlen_q, hi, lo)
    # Tiles in [lo, mid) are visible to every row of the tile and in bounds: no masks there.
    mid = tl.maximum(lo, tl.minimum(hi, (safe // BLOCK_N) * BLOCK_N))

    bias_ptr = Bias
    kpm_ptr = Kpm
    if HAS_BIAS:
        bias_ptr = (Bias + off_b.to(tl.int64) * stride_bb + off_h.to(tl.int64) * stride_bh
                    + tl.minimum(offs_m, seqlen_q - 1).to(tl.int64)[:, None] * stride_bm)
    if HAS_KPM:
        kpm_ptr = Kpm + off_b.to(tl.int64) * stride_kpb

    kp_ptr, vp_ptr, ke_ptr, ve_ptr = KP, VP, KE, VE
    kp_lo = parts_k
    vp_lo = parts_v
    if PRESPLIT:
        head_rows = pid_bh.to(tl.int64) * Nk
        kp_ptr = KP + head_rows * D
        vp_ptr = VP + head_rows * DV
        ke_ptr = KE + head_rows
        ve_ptr = VE + pid_bh.to(tl.int64) * tl.cdiv(Nk, BLOCK_N) * DV

    m_i, s_i, s_c, acc, acc_c = identity_state(BLOCK_M, BLOCK_DV)
    code = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fold_keys: only an exact pass writes it
    if SEGMENT > 0:
        for seg in range(lo, mid, SEGMENT):
            m_b, s_b, s_cb, acc_b, acc_cb = identity_state(BLOCK_M, BLOCK_DV)
            m_b, s_b, s_cb, acc_b, acc_cb, code = _attend(
                m_b, s_b, s_cb, acc_b, acc_cb, code, q, q_lo, q_c, offs_m, offs_n, offs_d, offs_dv,
                K + k_off, V + v_off, bias_ptr, kpm_ptr, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
                seg, tl.minimum(seg + SEGMENT, mid), seqlen_k, causal_shift, qk_scale,
                D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, False, CAUSAL, HAS_BIAS, HAS_KPM,
                ACCUMULATE, False, PRESPLIT, DEFER_SCALE,
            )
            m_i, s_i, acc = merge_row_states(m_i, s_i, acc, m_b, s_b, acc_b)
    else:
        m_i, s_i, s_c, acc, acc_c, code = _attend(
            m_i, s_i, s_c, acc, acc_c, code, q, q_lo, q_c, offs_m, offs_n, offs_d, offs_dv, K + k_off,
            V + v_off, bias_ptr, kpm_ptr, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
            lo, mid, seqlen_k, causal_shift, qk_scale,
            D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, False, CAUSAL, HAS_BIAS, HAS_KPM,
            ACCUMULATE, False, PRESPLIT, DEFER_SCALE,
        )
    m_i, s_i, s_c, acc, acc_c, code = _attend(
        m_i, s_i, s_c, acc, acc_c, code, q, q_lo, q_c, offs_m, offs_n, offs_d, offs_dv, K + k_off, V + v_off,
        bias_ptr, kpm_ptr, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo,
        stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
        mid, hi, seqlen_k, causal_shift, qk_scale,
        D, DV, BLOCK_M, BLOCK_N, BLOCK_D, BLOCK_DV, PRECISION, True, CAUSAL, HAS_BIAS, HAS_KPM, ACCUMULATE,
        False, PRESPLIT, DEFER_SCALE,
    )
    s_i, acc = settle_sums(s_i, s_c, acc, acc_c, ACCUMULATE)
    if count_nonfinite(acc) + count_nonfinite(s_i) != 0:
        # A NaN or an infinity reached the state: from a visible key (kept), or a hidden key's value through
        # its zero weight (0 * NaN), which the exact pass leaves out. Redo all of the program's keys with it,
        # on key tiles half as wide (its registers stay below the fast pass's).
        EXACT_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 32 else BLOCK_N
        m_i, s_i, s_c, acc, acc_c = identity_state(BLOCK_M, BLOCK_DV)
        m_i, s_i, s_c, acc, acc_c, code = _attend(
            m_i, s_i, s_c, acc, acc_c, code, q, q_lo, q_c, offs_m,
            tl.arange(0, EXACT_N), offs_d, offs_dv, K + k_off, V + v_off,
            bias_ptr, kpm_ptr, kp_ptr, vp_ptr, ke_ptr, ve_ptr, kp_lo, vp_lo,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
            lo, hi, seqlen_k, causal_shift, qk_scale,
            D, DV, BLOCK_M, EXACT_N, BLOCK_D, BLOCK_DV, PRECISION, True, CAUSAL, HAS_BIAS, HAS_KPM,
            ACCUMULATE, True, PRESPLIT, DEFER_SCALE,
        )
        s_i, acc = settle_sums(s_i, s_c, acc, acc_c, ACCUMULATE)
        acc = acc + nonfinite_values(code)
    if PRECISION == "fp16x3":
        # its logits are NaN wherever it sees a key (the split saw zeros)
        nan_row = q_bad & (s_i != 0.0)
        s_i = tl.where(nan_row, float("nan"), s_i)
        acc = tl.where(nan_row[:, None], float("nan"), acc)

    if SPLIT:
        ws_rows = (pid_s.to(tl.int64) * BH + pid_bh) * Nq + rows64
        tl.store(WsM + ws_rows, m_i, mask=row_ok)
        tl.store(WsS + ws_rows, s_i, mask=row_ok)
        tl.store(WsW + ws_rows[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=row_ok[:, None])
    else:
        out, lse = finalize_state(m_i, s_i, acc)
        o_ptrs = Out + o_off + rows64[:, None] * stride_om + offs_dv[None, :] * stride_od
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
        if STORE_LSE:
            store_lse(Lse + l_off + rows64 * stride_lm, m_i, s_i, lse, row_ok)


@triton.jit
def _merge_kernel(
    WsM, WsS, WsW, Out, Lse,
    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
    H, Nq, BH, m_tiles, num_splits,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, SPLITS: tl.constexpr,
    LEVELS: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Level two. Grid ``(cdiv(Nq, BLOCK_M) * B * H,)``: merge the ``num_splits`` partition states of each row
    with a pairwise tree of ``LEVELS = log2(SPLITS)`` levels of ``merge_states`` and normalise.

    The partition axis is last (``[BLOCK_M, 1 | BLOCK_DV, SPLITS]``); each level splits it into its even
    and odd members and merges them, halving it. Padding partitions (``>= num_splits``) are identities.
    """
    pid = tl.program_id(0)
    pid_m = pid % m_tiles
    pid_bh = pid // m_tiles
    off_b = pid_bh // H
    off_h = pid_bh % H
    offs_p = tl.arange(0, SPLITS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Nq
    rows = (offs_p[None, None, :].to(tl.int64) * BH + pid_bh) * Nq + offs_m[:, None, None]  # [BM, 1, S]
    ok = (offs_p[None, None, :] < num_splits) & row_ok[:, None, None]
    m = tl.load(WsM + rows, mask=ok, other=float("-inf"))
    s = tl.load(WsS + rows, mask=ok, other=0.0)
    w = tl.load(WsW + rows * BLOCK_DV + offs_dv[None, :, None], mask=ok, other=0.0)  # [BM, BDV, S]
    for lvl in tl.static_range(LEVELS):
        m_a, m_b = tl.split(tl.reshape(m, [BLOCK_M, 1, SPLITS >> (lvl + 1), 2]))
        s_a, s_b = tl.split(tl.reshape(s, [BLOCK_M, 1, SPLITS >> (lvl + 1), 2]))
        w_a, w_b = tl.split(tl.reshape(w, [BLOCK_M, BLOCK_DV, SPLITS >> (lvl + 1), 2]))
        m, s, w = merge_states(m_a, s_a, w_a, m_b, s_b, w_b)
    m_row = tl.reshape(m, [BLOCK_M])
    s_row = tl.reshape(s, [BLOCK_M])
    acc = tl.reshape(w, [BLOCK_M, BLOCK_DV])
    out, lse = finalize_state(m_row, s_row, acc)
    rows64 = offs_m.to(tl.int64)
    o_ptrs = (Out + off_b.to(tl.int64) * stride_ob + off_h.to(tl.int64) * stride_oh
              + rows64[:, None] * stride_om + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if STORE_LSE:
        store_lse(Lse + off_b.to(tl.int64) * stride_lb + off_h.to(tl.int64) * stride_lh + rows64 * stride_lm,
                  m_row, s_row, lse, row_ok)


# --------------------------------------------------------------------------------------------- planner

@dataclasses.dataclass(frozen=True)
class FwdPlan:
    """How one forward call runs.

    ``partitions``: key partitions per query tile (1 = fused path); ``block_m``/``block_n``: query/key tile
    sizes; ``num_warps``/``num_stages``: Triton launch options of level one; ``merge_depth``: L(n, B) =
    ceil(log2(ceil(Nk / block_n))), the depth of the full two-level merge over the key tiles;
    ``tree_depth``: ceil(log2(partitions)), the level-two tree; ``workspace_bytes``: level-one workspace.
    """

    partitions: int
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    merge_depth: int
    tree_depth: int
    block_d: int
    block_dv: int
    precision: str
    workspace_bytes: int
    presplit: bool = False


# The ``"fp16x3"`` forward splits the keys and values into float16 parts once (``_split_kv_kernel``) when a
# head has at least this many keys and more queries than one query tile holds, instead of every query tile
# splitting every key tile in its loop (docs/kernel_notes.md, "Keys and values split once"). A head of at
# most ``PRESPLIT_MAX_ONE_TILE`` queries (one tile of the split loop's smallest BLOCK_M) reads each key tile
# once: the pre-pass would only add a launch and its parts' round trip through memory.
PRESPLIT_MIN_KEYS = 0
PRESPLIT_MAX_ONE_TILE = 64

# Half-precision inputs without a bias: ``qk_scale`` joins the softmax's exponent in one fused multiply-add
# instead of scaling every score first (``_attend``'s ``DEFER_SCALE``; docs/kernel_notes.md, "Scale folded
# into the exponent").
DEFER_SCALE = True

# Half-precision forwards without a mask, bias or causality run ``fwd_sm90``'s warp-specialised kernel on
# sm90 when the query tiles fill the GPU (one key partition) and the keys number at least
# ``HOPPER_MIN_KEYS[head dim]`` (docs/kernel_notes.md, "The Hopper forward", "Shorter sequences"); False:
# the generic kernel everywhere.
HOPPER = True
HOPPER_MIN_KEYS = {64: 2048, 128: 1024}
# The FP32-accurate (``fp16x3``) Hopper kernel's minimum per head dim: at head dim 128 it is 1.08-1.33x the
# generic kernel from ViT's 197 tokens up, at parity on a grid of 32 programs (docs/kernel_notes.md, "The
# FP32-accurate Hopper forward").
HOPPER_SPLIT_MIN_KEYS = {64: 2048, 128: 192}

# Configs installed by ``set_config``: (dtype, BLOCK_D, BLOCK_DV, causal, bias, arch, precision) -> tiles.
_TUNED: dict[tuple, tuple[int, int, int, int]] = {}


def _smem_bytes(bm: int, bn: int, bd: int, bdv: int, stages: int, elem: int) -> int:
    return elem * (bm * bd + max(1, stages - 1) * bn * (bd + bdv) + bm * bn)


def _fp16x3_safe(bn: int, bdv: int) -> bool:
    """Whether ``"fp16x3"`` may use these tiles: value tiles of 64 columns and more, or key tiles of at most
    32 (Triton 3.6 miscompiles the others on sm90: docs/kernel_notes.md, "Compiler and hardware
    behaviour")."""
    return bdv >= 64 or bn <= 32


def _default_config(dtype, precision, bd, bdv, nq, cc, smem, nk=None, presplit=False,
                    has_bias=False) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) without tuning (``presplit``: the ``"fp16x3"`` loop over
    keys and values split beforehand; ``has_bias``: a bias tile is loaded with every key tile)."""
    if cc == (0, 0):  # interpreter: big tiles mean few (slow) interpreted steps
        bm = min(64, tile_size(nq))
        return bm, 32 if max(bd, bdv) > 128 else 64, 4, 1
    big = max(bd, bdv)
    # Measured winners (python -m benchmarks.attention --tune; docs/kernel_notes.md, "Tiles").
    if dtype == torch.float32:
        if precision == "ieee":
            cfg = (64, 64, 4, 1) if big <= 64 else (32, 32, 4, 2)
        elif precision == "fp16x3" and presplit:  # head dims <= 128 (tuning_key)
            if big <= 64:
                # a bias tile of 128 keys per stage exceeds the shared memory (Triton 3.6: 283,648 bytes)
                cfg = (64, 64, 4, 3) if nq <= 1024 else (128, 64 if has_bias else 128, 8, 3)
            else:
                cfg = (128, 64, 8, 2)
        elif precision == "fp16x3":
            cfg = (128, 64, 4, 3) if big <= 64 else (128, 64, 8, 3)
        elif big <= 64:
            cfg = (128, 64, 8, 3)
        elif big <= 128:
            cfg = (128, 32, 4, 3)
        else:
            cfg = (64, 32, 8, 1)
    else:
        if 256 < nq <= 1024 and big <= 128:
            cfg = (64, 64, 4, 3)  # 257-1024 query rows (ViT-B at 448 px): more programs
        elif 128 < nq <= 256 and big <= 64:
            cfg = (64, 32, 4, 3)  # 129-256 query rows (ViT at 224 px, 197 tokens)
        elif big <= 64:
            cfg = (128, 64, 4, 4)
        elif big <= 128:
            cfg = (128, 128, 8, 3)
        else:
            cfg = (64, 64, 8, 2)
    bm, bn, w, st = cfg
    # Short sequences (windows of 49 or 64 tokens): tiles no taller or wider than the sequence (a 128-row
    # tile over 49 rows does 2.6x the work). Key tiles stay >= 32 (see _fp16x3_safe).
    bm = min(bm, tile_size(nq))
    if nk is not None:
        bn = min(bn, tile_size(nk, 32))
    if precision == "fp16x3" and bdv < 64:
        bn = min(bn, 32)  # see _fp16x3_safe
    elem = 4 if dtype == torch.float32 else 2
    while st > 1 and _smem_bytes(bm, bn, bd, bdv, st, elem) > smem:
        st -= 1
    while bm > 16 and _smem_bytes(bm, bn, bd, bdv, st, elem) > smem:
        bm //= 2
    return bm, bn, w, st


def presplits(precision: str, nk: int, nq: int) -> bool:
    """Whether the forward at ``precision`` of ``nq`` queries over ``nk`` keys per head splits its keys and
    values beforehand (``_split_kv_kernel``; ``PRESPLIT_MIN_KEYS``, ``PRESPLIT_MAX_ONE_TILE``)."""
    return precision == "fp16x3" and nk >= PRESPLIT_MIN_KEYS and nq > PRESPLIT_MAX_ONE_TILE


def plan(*args, **kwargs) -> FwdPlan:
    """Choose partitions, tiles, warps and stages for one forward call (cached; see ``_plan``)."""
    kwargs = dict(kwargs)
    if kwargs.get("device") is not None:
        kwargs["device"] = canonical_device(kwargs["device"])
    return _plan_cached(*args, **kwargs)


def _plan(
    B: int,
    H: int,
    Nq: int,
    Nk: int,
    D: int,
    Dv: int,
    dtype: torch.dtype,
    causal: bool = False,
    device=None,
    sm_count: int | None = None,
    precision: str = "auto",
    has_bias: bool = False,
    varlen: bool = False,
) -> FwdPlan:
    """Choose partitions, tiles, warps and stages for one forward call (``varlen``: the packed layout,
    whose ``"fp16x3"`` loop splits its keys and values itself, with that loop's tiles).

    The fused path (``partitions == 1``) is taken unless the query tiles (``cdiv(Nq, BLOCK_M) * B * H``
    programs) fill less than half of the ``sm_count`` multiprocessors; then the keys are cut into partitions
    (at most 16, at least one key tile each) until the grid holds about two programs per multiprocessor.
    The plan's ``workspace_bytes`` is the level-one workspace that costs
    (``partitions * B * H * Nq * (BLOCK_DV + 2) * 4`` bytes; 0 on the fused path).
    """
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"plan: `dtype` must be one of {FLOAT_DTYPES}, got {dtype}")
    for name, val in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk), ("D", D), ("Dv", Dv)):
        if int(val) < (1 if name in ("D", "Dv") else 0):
            raise ValueError(f"plan: `{name}` must be >= {1 if name in ('D', 'Dv') else 0}, got {val}")
    sms, cc, smem = device_info(device)
    if sm_count is not None:
        sms = int(sm_count)
    key = tuning_key(dtype, D, Dv, causal, has_bias, device, precision)
    bd, bdv, prec = key[1], key[2], key[-1]
    presplit = presplits(prec, Nk, Nq) and not varlen
    tiles = _TUNED.get(key) or _default_config(dtype, prec, bd, bdv, Nq, cc, smem, Nk, presplit, has_bias)
    bm, bn, warps, stages = tiles
    bh = max(1, B * H)
    # Short sequences: halve the query tile before splitting the keys (less padding, more programs).
    while bm > 64 and cdiv(max(Nq, 1), bm) * bh < sms and cc != (0, 0):
        bm //= 2
    programs = cdiv(max(Nq, 1), bm) * bh
    key_tiles = max(1, cdiv(Nk, bn))
    parts = 1
    if 2 * programs <= sms:
        # Less than half a wave of query tiles: the workspace (which costs more memory than the output)
        # pays for itself; with more programs the fused path is as fast and needs no workspace.
        parts = min(16, key_tiles, cdiv(2 * sms, programs))
    parts, tree_depth, workspace = _partitioning(key_tiles, parts, bh * max(Nq, 1), bdv)
    return FwdPlan(
        partitions=parts,
        block_m=bm,
        block_n=bn,
        num_warps=warps,
        num_stages=stages,
        merge_depth=merge_depth(max(Nk, 1), bn),
        tree_depth=tree_depth,
        block_d=bd,
        block_dv=bdv,
        precision=prec,
        workspace_bytes=workspace,
        presplit=presplit,
    )


_plan_cached = functools.lru_cache(maxsize=4096)(_plan)
plan.__doc__ = _plan.__doc__


def set_config(key: tuple, config: tuple[int, int, int, int] | None) -> None:
    """Install (or with None remove) a tuned (BLOCK_M, BLOCK_N, warps, stages) for a tuning key."""
    install_config(_TUNED, key, config, _plan_cached, _PROGRAMS, _VARLEN_PROGRAMS)


def segment_keys(precision: str, block_n: int, nk: int) -> int:
    """``_fwd_kernel``'s ``SEGMENT`` for ``nk`` keys: the keys of one segment of its two-level sum
    (``monoid.SEGMENT_KEYS``, rounded down to whole key tiles) where ``nk`` holds more than two of them, else
    0, a plain running sum (whose rounding is still below the segments' there; the nested loop costs
    3-5% at 4K-16K keys on an H100)."""
    keys = SEGMENT_KEYS.get(precision, 0) // block_n * block_n
    return keys if keys > 0 and nk > 2 * keys else 0


def tuning_key(dtype, D: int, Dv: int, causal: bool, has_bias: bool, device, precision: str) -> tuple:
    """The key of a tuned config: (dtype, BLOCK_D, BLOCK_DV, causal, bias, arch, precision), with the
    precision the dense forward runs (``resolve_precision`` given the padded head dim; bfloat16 under the
    interpreter is ``"upcast"``)."""
    _, cc, _ = device_info(device)
    bd, bdv = tile_size(D), tile_size(Dv)
    prec = resolve_precision(precision, dtype, device, "fwd", max(bd, bdv))
    if cc == (0, 0) and dtype == torch.bfloat16:
        prec = "upcast"  # the interpreter has no bfloat16 dot
    return (dtype, bd, bdv, bool(causal), bool(has_bias), cc, prec)


def _partitioning(key_tiles: int, parts: int, rows: int, bdv: int) -> tuple[int, int, int]:
    """``(partitions, tree_depth, workspace_bytes)`` of at most ``parts`` key partitions over ``key_tiles``
    key tiles, equalised (every partition the same number of tiles, none empty); ``rows``: ``B * H * Nq``."""
    parts = max(1, min(int(parts), key_tiles))
    if parts == 1:
        return 1, 0, 0
    parts = cdiv(key_tiles, cdiv(key_tiles, parts))
    return parts, math.ceil(math.log2(parts)), 4 * rows * (bdv + 2) * parts


def _force_plan(p: FwdPlan, Nk: int, partitions: int, rows: int) -> FwdPlan:
    """``p`` with ``partitions`` key partitions (equalised as the planner does); ``rows``: ``B * H * Nq``."""
    parts, depth, workspace = _partitioning(max(1, cdiv(Nk, p.block_n)), partitions, rows, p.block_dv)
    return dataclasses.replace(p, partitions=parts, tree_depth=depth, workspace_bytes=workspace)


# --------------------------------------------------------------------------------------------- launchers
#
# ``elsa_fwd`` and ``elsa_fwd_varlen`` are the trusted launchers below the public ``elsa_attention`` /
# ``elsa_attention_varlen`` (which validate every input): they check nothing. Each call looks its signature up
# in ``_PROGRAMS`` (``launch.signature``: shapes, strides, dtypes, alignment, options); a ``_FwdProgram``,
# built once per signature, allocates the outputs and launches the kernels directly (``launch.Launch``).


def empty_output(B: int, H: int, Nq: int, Dv: int, like: Tensor) -> Tensor:
    """The ``[B, H, Nq, Dv]`` output, stored as ``[B, Nq, H, Dv]`` (as SDPA's flash / efficient kernels do):
    the ``out.transpose(1, 2).reshape(B, Nq, H * Dv)`` that every attention layer follows with is a view."""
    return torch.empty((B, Nq, H, Dv), device=like.device, dtype=like.dtype).transpose(1, 2)


def bias4(attn_bias: Tensor) -> Tensor:
    """``attn_bias`` with leading dims of size 1 up to rank 4 (a view)."""
    return attn_bias.reshape((1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape))


class _KVSplit:
    """``_split_kv_kernel`` over the keys and values of one signature (``k_strides``, ``v_strides``,
    ``kpm_strides``; ``bh`` heads of ``Nk`` keys) in tiles of ``block_n`` keys: ``split(k, v, kpm)`` allocates
    and returns the parts and exponents it writes, ``(KP, VP, KE, VE)``."""

    def __init__(self, k_strides, v_strides, kpm_strides, H, Nk, bh, D, Dv, block_n, block_d, block_dv,
                 has_kpm, device):
        key_tiles = cdiv(Nk, block_n)
        self.sizes = ((2, bh, Nk, D), (2, bh, Nk, Dv), (bh, Nk), (bh, key_tiles, Dv))
        self.device = device
        scalars = (*k_strides, *v_strides, *kpm_strides, H, Nk, key_tiles, bh * Nk * D, bh * Nk * Dv)
        self.launch = Launch(_split_kv_kernel, (key_tiles * bh,), scalars,
                             dict(D=D, DV=Dv, BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_DV=block_dv,
                                  HAS_KPM=has_kpm), 4)

    def __call__(self, k, v, kpm):
        sk, sv, ek, ev = self.sizes
        parts = (torch.empty(sk, dtype=torch.float16, device=self.device),
                 torch.empty(sv, dtype=torch.float16, device=self.device),
                 torch.empty(ek, dtype=torch.int32, device=self.device),
                 torch.empty(ev, dtype=torch.int32, device=self.device))
        self.launch(k, v, kpm, *parts)
        return parts


class _FwdProgram(AttentionProgram):
    """Every launch of one forward signature: the plan, the grids and all non-tensor arguments, fixed.

    ``varlen``: ``(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)`` for the packed layout
    (``q [total_q, H, D]``; outputs ``[total_q, H, Dv]`` and ``lse [H, total_q]``). ``hopper``: run
    ``fwd_sm90``'s kernel where it applies (``HOPPER``, read when the program is built).
    """

    def __init__(self, q, k, v, bias, kpm, causal, scale, precision, partitions=None, varlen=None,
                 partial=False, hopper=False):
        self.device = q.device
        if partial:  # context parallelism's partial results: float32 out, float64 lse (monoid.store_lse)
            self.out_dtype, self.lse_dtype = torch.float32, torch.float64
        self.dtype = q.dtype
        self.device_index = q.device.index if q.is_cuda else None
        self.bias_cast = bias is not None and bias.dtype == torch.float64
        if varlen is None:
            B, H, Nq, D = q.shape
            Nk, Dv = k.shape[2], v.shape[3]
            grid_m = Nq
            self.out_size, self.out_stride = (B, H, Nq, Dv), (Nq * H * Dv, Dv, H * Dv, 1)
            self.lse_size = (B, H, Nq)
            lse_strides = (H * Nq, Nq, 1)
            strides = (q.stride(), k.stride(), v.stride(), (Nq * H * Dv, Dv, H * Dv, 1))
            self.empty = B * H * Nq == 0
            self.zero = False
        else:
            total_q, H, D = q.shape
            Dv = v.shape[2]
            cu_q, _, max_q, max_k = varlen
            B, Nq, Nk = cu_q.shape[0] - 1, max_q, max(max_k, 1)
            grid_m = max_q
            self.out_size, self.out_stride = (total_q, H, Dv), (H * Dv, Dv, 1)
            self.lse_size = (H, total_q)
            lse_strides = (0, total_q, 1)
            strides = ((0, q.stride(1), q.stride(0), q.stride(2)), (0, k.stride(1), k.stride(0), k.stride(2)),
                       (0, v.stride(1), v.stride(0), v.stride(2)), (0, Dv, H * Dv, 1))
            self.empty = False
            self.zero = total_q == 0 or max_q == 0
            partitions = 1  # the level-two merge has no varlen layout
        if self.empty or self.zero:
            return
        has_bias, has_kpm = bias is not None, kpm is not None
        p = _plan_cached(B, H, Nq, Nk, D, Dv, q.dtype, causal, device=canonical_device(q.device),
                         precision=precision, has_bias=has_bias, varlen=varlen is not None)
        if partitions is not None:
            p = _force_plan(p, Nk, partitions, B * H * max(Nq, 1))
        self.plan = p
        bh = B * H
        sb = tuple(bias4(bias).expand(B, H, Nq, Nk).stride()) if has_bias else (0, 0, 0, 0)
        skp = (kpm.stride(0) if kpm.shape[0] > 1 else 0, kpm.stride(1)) if has_kpm else (0, 0)
        m_tiles = cdiv(grid_m, p.block_m)
        tps = cdiv(max(1, cdiv(Nk, p.block_n)), p.partitions)
        presplit = p.presplit
        parts_k, parts_v = (bh * Nk * D, bh * Nk * Dv) if presplit else (0, 0)
        qk_scale = float(scale) * LOG2E

        def launch_scalars(query_tiles, tiles_per_split):  # _fwd_kernel's scalar arguments
            return (*strides[0], *strides[1], *strides[2], *sb, *skp, *strides[3], *lse_strides,
                    H, Nq, Nk, bh, query_tiles, tiles_per_split, qk_scale, parts_k, parts_v)

        scalars = launch_scalars(m_tiles, tps)
        main = dict(D=D, DV=Dv, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_D=p.block_d, BLOCK_DV=p.block_dv,
                    PRECISION=p.precision, CAUSAL=bool(causal), HAS_BIAS=has_bias, HAS_KPM=has_kpm,
                    IS_VARLEN=varlen is not None, SPLIT=p.partitions > 1,
                    ACCUMULATE=ACCUMULATION.get(p.precision, "plain"),
                    SEGMENT=segment_keys(p.precision, p.block_n, Nk), PRESPLIT=presplit,
                    DEFER_SCALE=DEFER_SCALE, REDO=False)
        self.hopper = None
        masked = has_bias or has_kpm or causal
        if (hopper and fwd_sm90 is not None and varlen is None and not masked
                and partitions is None and p.partitions == 1):
            # FP32-accurate over keys a plain running sum keeps accurate; or half precision
            split = (p.precision == "fp16x3" and main["SEGMENT"] == 0
                     and Nk >= HOPPER_SPLIT_MIN_KEYS.get(D, 0) and fwd_sm90.supported_split(q, k, v, False))
            if split or (Nk >= HOPPER_MIN_KEYS.get(D, 0) and fwd_sm90.supported(q, k, v, False)):
                self.hopper = _HopperForward(B, H, Nq, Nk, D, qk_scale, launch_scalars, main, strides,
                                             lse_strides, canonical_device(q.device), split)
        self.split = None
        if main["PRESPLIT"] and self.hopper is None:
            self.split = _KVSplit(strides[1], strides[2], skp, H, Nk, bh, D, Dv, p.block_n, p.block_d,
                                  p.block_dv, has_kpm, self.device)
        # [with lse, without]: inference calls need no log-sum-exp (one allocation and store fewer)
        self.main = [Launch(_fwd_kernel, (m_tiles * bh, p.partitions), scalars, dict(main, STORE_LSE=store),
                            p.num_warps, p.num_stages) for store in (True, False)]
        self.merge = None
        if p.partitions > 1:
            splits = max(2, next_pow2(p.partitions))
            bm2 = max(2, min(64, 4096 // (splits * p.block_dv)))
            m2 = cdiv(Nq, bm2)
            self.ws_sizes = ((p.partitions, bh, Nq), (p.partitions, bh, Nq, p.block_dv))
            merge = dict(DV=Dv, BLOCK_M=bm2, BLOCK_DV=p.block_dv, SPLITS=splits,
                         LEVELS=splits.bit_length() - 1)
            self.merge = [Launch(_merge_kernel, (m2 * bh,), (*strides[3], *lse_strides, H, Nq, bh, m2,
                                                             p.partitions), dict(merge, STORE_LSE=store), 4)
                          for store in (True, False)]

    def run(self, q, k, v, bias=None, kpm=None, cu_q=None, cu_k=None, need_lse=True):
        """``(out, lse)``; ``lse`` is None unless ``need_lse``."""
        out, lse, done = self.outputs(need_lse)
        if done:
            return out, lse
        if bias is None:
            bias = out
        elif self.bias_cast:
            bias = bias.to(torch.float32)  # copies only the given (un-broadcast) tensor
        kpm = out if kpm is None else kpm.view(torch.uint8)
        if cu_q is None:
            cu_q = cu_k = out
        which = 0 if need_lse else 1
        lse_arg = lse if need_lse else out  # not written without need_lse
        if self.hopper is not None:
            self.hopper(q, k, v, out, lse_arg, which)
            return out, lse
        parts = (out, out, out, out) if self.split is None else self.split(k, v, kpm)
        if self.merge is None:
            self.main[which](q, k, v, bias, kpm, out, lse_arg, out, out, out, cu_q, cu_k, *parts, out)
        else:
            ws_m = torch.empty(self.ws_sizes[0], dtype=torch.float32, device=self.device)
            ws_s = torch.empty(self.ws_sizes[0], dtype=torch.float32, device=self.device)
            ws_w = torch.empty(self.ws_sizes[1], dtype=torch.float32, device=self.device)
            self.main[which](q, k, v, bias, kpm, out, lse_arg, ws_m, ws_s, ws_w, cu_q, cu_k, *parts, out)
            self.merge[which](ws_m, ws_s, ws_w, out, lse_arg)
        return out, lse


class _HopperForward:
    """The launches of one forward signature on ``fwd_sm90``'s kernels: the kernel, then the generic kernel
    over the 64-row query tiles it flagged (``REDO``: non-finite states; the other programs return at once).
    ``split``: float32 inputs at ``"fp16x3"``, on ``attention_fwd_f16x3_kernel`` after ``_split_kv_kernel``
    split the keys and values into float16 parts in its key tiles; else half-precision inputs on
    ``attention_fwd_kernel``. ``launch_scalars(query_tiles, tiles_per_split)`` / ``main``: the generic
    launch's scalar arguments and constexprs, whose query tiles become 64 rows; ``strides``: those of q, k, v
    and the output (``empty_output``'s layout); ``lse_strides``: the lse's."""

    def __init__(self, B, H, Nq, Nk, D, qk_scale, launch_scalars, main, strides, lse_strides, device,
                 split=False):
        rows = fwd_sm90.ROWS.value
        bh = B * H
        out_strides = strides[3]
        self.flags = bh * cdiv(Nq, rows)
        self.split = None
        if split:
            bn, stages = fwd_sm90.SPLIT_CONFIGS[D]
            m_tiles = cdiv(Nq, 2 * rows)
            self.split = _KVSplit(strides[1], strides[2], (0, 0), H, Nk, bh, D, D, bn, D, D, False, device)
            self.main = [Launch(fwd_sm90.attention_fwd_f16x3_kernel, (m_tiles * bh,),
                                (H, Nq, Nk, m_tiles, *strides[0][:3], *out_strides[:3], *lse_strides[:2],
                                 qk_scale),
                                dict(D=D, BLOCK_N=bn, STAGES=stages, STORE_LSE=store), fwd_sm90.NUM_WARPS)
                         for store in (True, False)]
        else:
            bn, stages, consumers = fwd_sm90.config(D, Nq, bh, device_info(device)[0])
            m_tiles = cdiv(Nq, rows * consumers)
            self.main = [Launch(fwd_sm90.attention_fwd_kernel, (m_tiles * bh,),
                                (H, Nq, Nk, m_tiles, *out_strides[:3], *lse_strides[:2], qk_scale),
                                dict(D=D, BLOCK_N=bn, STAGES=stages, CONSUMERS=consumers, STORE_LSE=store),
                                fwd_sm90.NUM_WARPS)
                         for store in (True, False)]
        self.block_n = bn
        # the generic kernel over 64-row query tiles and one partition of all its 64-key tiles
        redo = dict(main, BLOCK_M=rows, BLOCK_N=64, SPLIT=False, SEGMENT=0, PRESPLIT=False, REDO=True)
        redo_scalars = launch_scalars(cdiv(Nq, rows), cdiv(Nk, 64))
        self.redo = [Launch(_fwd_kernel, (cdiv(Nq, rows) * bh, 1), redo_scalars, dict(redo, STORE_LSE=store),
                            4, 2) for store in (True, False)]
        self.descs = None

    def __call__(self, q, k, v, out, lse, which):
        """Write ``out`` (and ``lse`` when ``which`` is 0); returns the flags of the redone query tiles."""
        flags = torch.empty((self.flags,), dtype=torch.int32, device=q.device)  # every flag written
        if self.split is not None:
            kp, vp, ke, ve = self.split(k, v, k)
            if self.descs is None:  # built once, then pointed at each call's parts
                self.descs = (fwd_sm90.descriptor(kp, self.block_n), fwd_sm90.descriptor(vp, self.block_n))
            dk, dv = self.descs
            dk.base, dv.base = kp, vp
            try:
                self.main[which](dk, dv, q, ke, ve, out, lse, flags)
            finally:  # the cached descriptors must not keep this call's tensors alive
                dk.base = dv.base = None
        else:
            if self.descs is None:  # built (and checked) once, then pointed at each call's tensors
                self.descs = (fwd_sm90.descriptor(q, fwd_sm90.ROWS.value),
                              fwd_sm90.descriptor(k, self.block_n), fwd_sm90.descriptor(v, self.block_n))
            dq, dk, dv = self.descs
            dq.base, dk.base, dv.base = q, k, v
            try:
                self.main[which](dq, dk, dv, out, lse, flags)
            finally:
                dq.base = dk.base = dv.base = None
        self.redo[which](q, k, v, out, out, out, lse, out, out, out, out, out, out, out, out, out, flags)
        return flags


_PROGRAMS = ProgramCache()
_VARLEN_PROGRAMS = ProgramCache()


def elsa_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
    partitions: int | None = None,
    need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """ELSA forward: ``softmax(q k^T * scale + bias) v`` with masks, as the two-level monoid scan.

    A trusted launcher: the inputs are not checked (``elsa_attention`` checks them).

    Args:
        q: ``[B, H, Nq, D]``; k: ``[B, H, Nk, D]``; v: ``[B, H, Nk, Dv]``; float16/bfloat16/float32 CUDA
            tensors (CPU under ``TRITON_INTERPRET=1``), any strides (views of a fused qkv projection are read
            in place); head dims up to 256.
        attn_bias: float tensor broadcastable to ``[B, H, Nq, Nk]`` (read through stride-0 dims).
        key_padding_mask: bool ``[B, Nk]`` (or ``[1, Nk]``), True = the key takes part.
        causal: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq`` (bottom-right aligned).
        scale: logit scale, default ``D ** -0.5``.
        precision: float32 only: ``"auto"``, ``"ieee"``, ``"tf32x3"``, ``"fp16x3"``,
            ``"tf32"`` (see ``kernels.precision``).
        partitions: force this many key partitions (None: the plan's choice). The split path is otherwise
            taken only for grids under half a wave; the tests pin its merge tree (2 to 16 partitions) at
            small shapes with it, as ``elsa_decode``'s ``programs`` does for decode.
        need_lse: False: the log-sum-exp is neither stored nor returned (inference).

    Returns:
        ``out [B, H, Nq, Dv]`` in q's dtype (rows with no visible key: 0; stored as ``[B, Nq, H, Dv]``, see
        ``empty_output``) and ``lse [B, H, Nq]`` float32, the natural-log log-sum-exp of each row's logits
        (``-inf`` where no key is visible; None without ``need_lse``). Non-finite inputs follow
        ``reference.py``'s rule: a key hidden from a row (causality, the padding mask, a ``-inf`` bias)
        contributes nothing to it whatever its key and value rows hold; a visible key's NaN logit (or a
        ``+inf`` bias) makes the row NaN, its NaN or infinite value entries reach their own columns only.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    program = fwd_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, partitions)
    return program(q, k, v, attn_bias, key_padding_mask, need_lse=need_lse)


def fwd_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, partitions=None,
                partial=False) -> _FwdProgram:
    """The cached launch program of this forward signature (``scale`` resolved): ``program(q, k, v, bias,
    kpm, need_lse=...) -> (out, lse)`` for any tensors of the same signature. ``partial``: the outputs of a
    partial result that will be merged with others (context parallelism): ``out`` in float32 whatever q's
    dtype (one rounding, at the end of the merges) and ``lse`` in float64, formed from the row's state
    (``monoid.store_lse``), so that the merges' weights keep float32 accuracy."""
    return _PROGRAMS(_FwdProgram, (q, k, v, attn_bias, key_padding_mask),
                     (causal, scale, precision, partitions, None, partial, HOPPER))


def elsa_fwd_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
) -> tuple[Tensor, Tensor]:
    """Packed variable-length ELSA forward (FlashAttention's convention); a trusted launcher.

    Args:
        q: ``[total_q, H, D]``; k: ``[total_k, H, D]``; v: ``[total_k, H, Dv]`` (any strides).
        cu_seqlens_q / cu_seqlens_k: contiguous int32 ``[batch + 1]`` cumulative lengths (``cu[0] = 0``);
            sequence ``i`` owns rows ``cu[i]:cu[i+1]``.
        max_seqlen_q / max_seqlen_k: the longest sequence lengths (set the grid; never read from the device).
        causal: bottom-right aligned within each sequence.

    Returns:
        ``out [total_q, H, Dv]`` in q's dtype and ``lse [H, total_q]`` float32 (natural log, ``-inf`` for
        rows with no visible key).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    program = _VARLEN_PROGRAMS(_varlen_program, (q, k, v, cu_seqlens_q, cu_seqlens_k),
                               (max_seqlen_q, max_seqlen_k, causal, scale, precision))
    return program(q, k, v, cu_q=cu_seqlens_q, cu_k=cu_seqlens_k)


def _varlen_program(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, precision) -> _FwdProgram:
    return _FwdProgram(q, k, v, None, None, causal, scale, precision, varlen=(cu_q, cu_k, max_q, max_k))

