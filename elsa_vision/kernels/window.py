"""W-ELSA forward in Triton: Swin-v2 window attention over all windows of a batch in one launch.

For every window ``b`` (of ``B*nW``), head ``h`` and query row ``i`` of the ``N`` window tokens::

    out[b, h, i] = softmax_j( cos(q_bi, k_bj) * exp(min(logit_scale[h], log 100))
                              + bias[h, i, j] + mask[b % nW, i, j] ) @ v[b, h]

as Swin Transformer V2 (timm ``swin_transformer_v2.WindowAttention``): q and k are L2-normalised in the
kernel, ``bias [H, N, N]`` (``16 sigmoid(cpb_mlp(coords))[index]``) is shared by every window and read by
stride (never expanded per window), the shifted-window mask ``[nW, N, N]`` (0 / -100) is read at window
index ``b % nW`` (timm's layout ``B*nW`` with the window index fastest).

Each program owns one query tile of ``BLOCK_M`` rows of one head of one window; it folds the key tiles of
``BLOCK_N`` keys into per-row ``(m, S, W)`` states with ``monoid.fold_tile`` and finalises ``W / S`` (a window
of at most 576 tokens is one partition: no split, no workspace). Windows of any token count ``N`` (49, 64,
144, 256, 576, non-square) are covered by masked tiles.

Non-finite inputs follow the rule of ``reference.py``: a ``-inf`` in the bias or mask hides its key from the
row whatever the key holds (Swin's ``-100`` hides nothing); a window whose result comes out non-finite is
redone with the exact rule (``_window_keys``, ``_window_grads``).
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dots import matmul
from .host import LOG2E, cdiv, device_info, tile_size
from .launch import Launch, Program, ProgramCache
from .monoid import (
    ACCUMULATION,
    count_nonfinite,
    finalize_state,
    finite_part,
    fold_keys,
    identity_state,
    nonfinite_values,
    settle_sums,
)
from .precision import resolve_precision

__all__ = ["window_fwd", "window_plan", "window_bwd", "window_bwd_plan",
           "BWD_MAX_TOKENS", "LOGIT_SCALE_MAX"]

LOGIT_SCALE_MAX = math.log(1.0 / 0.01)  # timm's clamp of the per-head logit scale: exp(.) <= 100
_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)
_NORM_EPS = tl.constexpr(1e-12)  # F.normalize's eps: x / max(|x|, eps)


@triton.jit
def _window_keys(
    m_i, s_i, s_c, acc, acc_c, code, qn, q_scale, row_in, offs_n, offs_d, offs_dv, k_base, v_base, bias_rows,
    mask_rows, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_mn, N,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    HAS_MASK: tl.constexpr, COSINE: tl.constexpr, ACCUMULATE: tl.constexpr, EXACT: tl.constexpr,
):
    """Fold the key tiles of one window into the state of one query tile (``qn``: its logit operand).
    ``EXACT``: the exact pass (a ``-inf`` in the bias or mask hides its key whatever the product, and
    ``monoid.fold_keys``: the visible keys' non-finite values go to ``code``); otherwise ``code`` is
    returned untouched. Swin's ``-100`` shift mask hides nothing: its keys keep a tiny weight."""
    for start_n in range(0, N, BLOCK_N):
        cols = start_n + offs_n
        col_ok = cols < N
        cols64 = cols.to(tl.int64)
        kt = tl.load(k_base + cols64[None, :] * stride_kn + offs_d[:, None] * stride_kd,
                     mask=(offs_d[:, None] < D) & col_ok[None, :], other=0.0)
        if COSINE:
            kt = kt.to(tl.float32)
            k_norm = tl.maximum(tl.sqrt(tl.sum(kt * kt, 0)), _NORM_EPS)
            kn = (kt / k_norm[None, :]).to(k_base.dtype.element_ty)
        else:
            kn = kt
        v = tl.load(v_base + cols64[:, None] * stride_vn + offs_dv[None, :] * stride_vd,
                    mask=col_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        scores = matmul(qn, kn, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PRECISION)
        if not COSINE:
            scores = scores * q_scale
        tile_ok = row_in[:, None] & col_ok[None, :]
        add = tl.load(bias_rows + cols64[None, :] * stride_bn, mask=tile_ok, other=0.0).to(tl.float32)
        if HAS_MASK:
            add += tl.load(mask_rows + cols64[None, :] * stride_mn, mask=tile_ok,
                           other=0.0).to(tl.float32)
        if EXACT:
            scores = tl.where(add == float("-inf"), float("-inf"), scores + add * _LOG2E)
        else:
            scores = scores + add * _LOG2E
        scores = tl.where(col_ok[None, :], scores, float("-inf"))
        m_i, s_i, s_c, acc, acc_c, code = fold_keys(m_i, s_i, s_c, acc, acc_c, code, scores, v, PRECISION,
                                                    ACCUMULATE, EXACT)
    return m_i, s_i, s_c, acc, acc_c, code


@triton.jit
def _window_fwd_kernel(
    Q, K, V, LogitScale, Bias, Mask, Out,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ls,
    stride_bh, stride_bm, stride_bn,
    stride_mw, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    N, nW, m_tiles, logit_max, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr,
    HAS_MASK: tl.constexpr, COSINE: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Grid ``(Bw, m_tiles * H)``: axis 0 = the window (the long axis: no 65535 limit; consecutive programs
    are consecutive windows of one head and query tile, so they read the same bias rows from L2), axis 1 =
    (head, query tile).

    ``COSINE`` (Swin v2): the logits are ``cos(q, k) * exp(min(logit_scale, logit_max))``; otherwise (Swin v1)
    ``q . k * qk_scale`` (``LogitScale`` unread).

    Writes ``Out [Bw, H, N, DV]`` (input dtype); the backward recomputes the softmax, no log-sum-exp is kept.
    """
    pid = tl.program_id(1)
    pid_m = pid % m_tiles
    off_h = pid // m_tiles

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_in = offs_m < N
    rows64 = tl.minimum(offs_m, N - 1).to(tl.int64)
    h64 = off_h.to(tl.int64)

    if COSINE:
        # Per-head scale of the normalised logits, base 2: exp(min(logit_scale, log 100)) * log2(e).
        ls = tl.load(LogitScale + h64 * stride_ls).to(tl.float32)
        q_scale = tl.exp(tl.minimum(ls, logit_max)) * _LOG2E
    else:
        q_scale = qk_scale * _LOG2E  # applied to the float32 products
    bias_rows = Bias + h64 * stride_bh + rows64[:, None] * stride_bm

    b64 = tl.program_id(0).to(tl.int64)
    q_ptrs = (Q + b64 * stride_qb + h64 * stride_qh + rows64[:, None] * stride_qm
              + offs_d[None, :] * stride_qd)
    if COSINE:
        q = tl.load(q_ptrs, mask=row_in[:, None] & (offs_d[None, :] < D), other=0.0).to(tl.float32)
        q_norm = tl.maximum(tl.sqrt(tl.sum(q * q, 1)), _NORM_EPS)
        qn = (q * (q_scale / q_norm)[:, None]).to(Q.dtype.element_ty)
    else:
        qn = tl.load(q_ptrs, mask=row_in[:, None] & (offs_d[None, :] < D), other=0.0)

    k_base = K + b64 * stride_kb + h64 * stride_kh
    v_base = V + b64 * stride_vb + h64 * stride_vh
    mask_rows = Mask
    if HAS_MASK:
        mask_rows = Mask + (b64 % nW) * stride_mw + rows64[:, None] * stride_mm

    m_i, s_i, s_c, acc, acc_c = identity_state(BLOCK_M, BLOCK_DV)
    code = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fold_keys: only an exact pass writes it
    m_i, s_i, s_c, acc, acc_c, code = _window_keys(
        m_i, s_i, s_c, acc, acc_c, code, qn, q_scale, row_in, offs_n, offs_d, offs_dv, k_base, v_base,
        bias_rows, mask_rows, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_mn, N,
        D, DV, BLOCK_M, BLOCK_N, PRECISION, HAS_MASK, COSINE, ACCUMULATE, False)
    s_i, acc = settle_sums(s_i, s_c, acc, acc_c, ACCUMULATE)
    if count_nonfinite(acc) + count_nonfinite(s_i) != 0:
        # A NaN or an infinity reached the state: redo the window with the exact pass (see monoid), on
        # key tiles half as wide (its registers stay below the fast pass's).
        EXACT_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 32 else BLOCK_N
        m_i, s_i, s_c, acc, acc_c = identity_state(BLOCK_M, BLOCK_DV)
        m_i, s_i, s_c, acc, acc_c, code = _window_keys(
            m_i, s_i, s_c, acc, acc_c, code, qn, q_scale,
            row_in, tl.arange(0, EXACT_N), offs_d, offs_dv, k_base, v_base, bias_rows, mask_rows,
            stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_mn, N,
            D, DV, BLOCK_M, EXACT_N, PRECISION, HAS_MASK, COSINE, ACCUMULATE, True)
        s_i, acc = settle_sums(s_i, s_c, acc, acc_c, ACCUMULATE)
        acc = acc + nonfinite_values(code)

    out, _ = finalize_state(m_i, s_i, acc)
    o_ptrs = (Out + b64 * stride_ob + h64 * stride_oh + rows64[:, None] * stride_om
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_in[:, None] & (offs_dv[None, :] < DV))


@triton.jit
def _window_grads(q, k, v, do, bias, mask, tok, row_ok, scale, PRECISION: tl.constexpr,
                  HAS_MASK: tl.constexpr, COSINE: tl.constexpr, NEED_QKV: tl.constexpr, BLOCK: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, EXACT: tl.constexpr):
    """One window's ``(dS, rowsum dS (L - rowmax L), dv, dq, dk)`` (the last three 0 without ``NEED_QKV``)
    from float32 tiles ``q, k [BLOCK, BLOCK_D]``, ``v, do [BLOCK, BLOCK_DV]``, the bias and (``HAS_MASK``)
    the shift mask ``[BLOCK, BLOCK]``; ``tok`` marks the window's tokens, ``row_ok`` the rows to write.

    ``EXACT``: the rule of ``reference.py``. A pair whose bias or mask is ``-inf`` has ``P = 0`` whatever its
    logit (NaN included), a row that sees no key has zero gradients, ``dS`` is 0 where ``P`` is, and the
    products take the finite parts of ``v``, of the normalised keys and of the scaled queries: a hidden key's
    or query's NaN or infinity reaches no gradient (a key or query row holding one gets 0 where nothing
    reaches it, NaN where a NaN does)."""
    if COSINE:
        # F.normalize: x / max(|x|, eps)
        q_raw = tl.sqrt(tl.sum(q * q, 1))
        k_raw = tl.sqrt(tl.sum(k * k, 1))
        q_norm = tl.maximum(q_raw, _NORM_EPS)
        k_norm = tl.maximum(k_raw, _NORM_EPS)
        qhat = q / q_norm[:, None]
        khat = k / k_norm[:, None]
    else:
        qhat = q
        khat = k
    qn = qhat * scale

    logits = matmul(qn, tl.trans(khat), tl.zeros([BLOCK, BLOCK], dtype=tl.float32), PRECISION)
    s = logits + bias
    if HAS_MASK:
        s += mask
    if EXACT:
        hidden = bias == float("-inf")
        if HAS_MASK:
            hidden = hidden | (mask == float("-inf"))
        # rows past the window (or the batch) have zero queries, whose products with a NaN key are NaN
        s = tl.where(hidden | ~(row_ok[:, None] & tok[None, :]), float("-inf"), s)
        s_max = tl.max(s, 1)
        shift = tl.where(s_max == float("-inf"), 0.0, s_max)
        e = tl.where(s == float("-inf"), 0.0, tl.exp(s - shift[:, None]))
        den = tl.sum(e, 1)
        p = e / tl.where(den == 0.0, 1.0, den)[:, None]
        v = finite_part(v)
    else:
        s = tl.where(tok[None, :], s, float("-inf"))
        p = tl.exp(s - tl.max(s, 1)[:, None])
        p = p / tl.sum(p, 1)[:, None]
    dp = matmul(do, tl.trans(v), tl.zeros([BLOCK, BLOCK], dtype=tl.float32), PRECISION)
    ds = p * (dp - tl.sum(p * dp, 1)[:, None])
    if EXACT:
        ds = tl.where(p == 0.0, 0.0, ds)
    ds = tl.where(row_ok[:, None], ds, 0.0)
    dsc = tl.zeros([BLOCK], dtype=tl.float32)
    if COSINE:
        # sum_j dS_ij = 0: shifting each row's logits by their maximum removes a common offset of up to 100
        if EXACT:
            lmax = tl.max(tl.where(s != float("-inf"), logits, float("-inf")), 1)
            dsc = tl.sum(tl.where(p == 0.0, 0.0, ds * (logits - lmax[:, None])), 1)
        else:
            lmax = tl.max(tl.where(tok[None, :], logits, float("-inf")), 1)
            dsc = tl.sum(ds * tl.where(tok[None, :], logits - lmax[:, None], 0.0), 1)

    dv = 0.0
    dq = 0.0
    dk = 0.0
    if NEED_QKV:
        if EXACT:
            q_ok = tl.max(tl.where(tl.abs(q) < float("inf"), 0, 1), 1) == 0
            k_ok = tl.max(tl.where(tl.abs(k) < float("inf"), 0, 1), 1) == 0
            qhat = finite_part(qhat)
            khat = finite_part(khat)
            qn = finite_part(qn)
        dv = matmul(tl.trans(p), do, tl.zeros([BLOCK, BLOCK_DV], dtype=tl.float32), PRECISION)
        dqh = matmul(ds, khat, tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32), PRECISION) * scale
        dkh = matmul(tl.trans(ds), qn, tl.zeros([BLOCK, BLOCK_D], dtype=tl.float32), PRECISION)
        if COSINE:
            # through the normalisation: (dy - y (y . dy)) / |x|, or dy / eps where the norm is clamped
            q_dot = tl.where(q_raw > _NORM_EPS, tl.sum(qhat * dqh, 1), 0.0)
            k_dot = tl.where(k_raw > _NORM_EPS, tl.sum(khat * dkh, 1), 0.0)
            dq = (dqh - qhat * q_dot[:, None]) / q_norm[:, None]
            dk = (dkh - khat * k_dot[:, None]) / k_norm[:, None]
            if EXACT:
                # a non-finite row's norm is NaN: 0 where nothing reached it, NaN where a NaN did
                dq = tl.where(q_ok[:, None], dq, tl.where(dqh == 0.0, 0.0, float("nan")))
                dk = tl.where(k_ok[:, None], dk, tl.where(dkh == 0.0, 0.0, float("nan")))
        else:
            dq = dqh
            dk = dkh
    return ds, dsc, dv, dq, dk


@triton.jit
def _window_bwd_kernel(
    Q, K, V, DO, LogitScale, Bias, Mask, GradQ, GradK, GradV, DBias, DScale,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_ob, stride_oh, stride_om, stride_od,
    stride_ls,
    stride_bh, stride_bm, stride_bn,
    stride_mw, stride_mm, stride_mn,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    Bw, H, N, nW, logit_max, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
    WINDOWS: tl.constexpr, PRECISION: tl.constexpr, HAS_MASK: tl.constexpr, NEED_QKV: tl.constexpr,
    COSINE: tl.constexpr,
):
    """Grid ``(cdiv(Bw, WINDOWS), H)``: one program owns one head of ``WINDOWS`` consecutive windows, each
    window whole in one ``BLOCK x BLOCK`` tile (``N <= BLOCK``).

    Per window: the logits ``L = normalize(q) * scale . normalize(k)`` and the dense softmax ``P`` of
    ``L + bias + mask`` (row maximum and sum formed here, no saved log-sum-exp), ``dP = dO V^T``,
    ``dS = P (dP - rowsum(P dP))``; then ``dV = P^T dO`` and ``dq``, ``dk`` through the normalisation.
    Writes ``GradQ``, ``GradK``, ``GradV`` (when ``NEED_QKV``), and per program the bias gradient summed
    over its windows ``DBias [G, H, N, N]`` and ``DScale [G, H] = sum dS (L - rowmax L)`` (float32).
    Without ``COSINE`` (Swin v1) the logits are ``L = q . k * qk_scale`` and ``DScale`` is 0.
    """
    pid_w = tl.program_id(0)
    off_h = tl.program_id(1)
    h64 = off_h.to(tl.int64)
    offs = tl.arange(0, BLOCK)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    tok = offs < N
    tok64 = tl.minimum(offs, N - 1).to(tl.int64)
    tile_ok = tok[:, None] & tok[None, :]
    d_ok = offs_d[None, :] < D
    dv_ok = offs_dv[None, :] < DV

    if COSINE:
        scale = tl.exp(tl.minimum(tl.load(LogitScale + h64 * stride_ls).to(tl.float32), logit_max))
    else:
        scale = qk_scale
    bias = tl.load(Bias + h64 * stride_bh + tok64[:, None] * stride_bm + tok64[None, :] * stride_bn,
                   mask=tile_ok, other=0.0).to(tl.float32)
    dbias = tl.zeros([BLOCK, BLOCK], dtype=tl.float32)
    dscale = tl.zeros([BLOCK], dtype=tl.float32)

    for w in range(WINDOWS):
        b = pid_w * WINDOWS + w
        b64 = tl.minimum(b, Bw - 1).to(tl.int64)
        row_ok = tok & (b < Bw)
        q = tl.load(Q + b64 * stride_qb + h64 * stride_qh + tok64[:, None] * stride_qm
                    + offs_d[None, :] * stride_qd, mask=row_ok[:, None] & d_ok, other=0.0).to(tl.float32)
        k = tl.load(K + b64 * stride_kb + h64 * stride_kh + tok64[:, None] * stride_kn
                    + offs_d[None, :] * stride_kd, mask=row_ok[:, None] & d_ok, other=0.0).to(tl.float32)
        v = tl.load(V + b64 * stride_vb + h64 * stride_vh + tok64[:, None] * stride_vn
                    + offs_dv[None, :] * stride_vd, mask=row_ok[:, None] & dv_ok, other=0.0).to(tl.float32)
        do = tl.load(DO + b64 * stride_ob + h64 * stride_oh + tok64[:, None] * stride_om
                     + offs_dv[None, :] * stride_od, mask=row_ok[:, None] & dv_ok, other=0.0).to(tl.float32)
        mask = bias
        if HAS_MASK:
            mask_ptrs = (Mask + (b64 % nW) * stride_mw + tok64[:, None] * stride_mm
                         + tok64[None, :] * stride_mn)
            mask = tl.load(mask_ptrs, mask=tile_ok, other=0.0).to(tl.float32)
        ds, dsc, dv, dq, dk = _window_grads(q, k, v, do, bias, mask, tok, row_ok, scale, PRECISION, HAS_MASK,
                                            COSINE, NEED_QKV, BLOCK, BLOCK_D, BLOCK_DV, False)
        bad = count_nonfinite(ds)
        if NEED_QKV:
            bad += count_nonfinite(dv) + count_nonfinite(dq) + count_nonfinite(dk)
        if bad != 0:
            # A NaN or an infinity reached the gradients: from a row that sees one (kept), or through a hidden
            # pair's zero weight (0 * NaN), which the exact rule leaves out (see _window_grads).
            ds, dsc, dv, dq, dk = _window_grads(q, k, v, do, bias, mask, tok, row_ok, scale, PRECISION,
                                                HAS_MASK, COSINE, NEED_QKV, BLOCK, BLOCK_D, BLOCK_DV, True)
        dbias += ds
        dscale += dsc

        if NEED_QKV:
            qk_ok = row_ok[:, None] & d_ok
            tl.store(GradQ + b64 * stride_dqb + h64 * stride_dqh + tok64[:, None] * stride_dqm
                     + offs_d[None, :] * stride_dqd, dq.to(GradQ.dtype.element_ty), mask=qk_ok)
            tl.store(GradK + b64 * stride_dkb + h64 * stride_dkh + tok64[:, None] * stride_dkn
                     + offs_d[None, :] * stride_dkd, dk.to(GradK.dtype.element_ty), mask=qk_ok)
            tl.store(GradV + b64 * stride_dvb + h64 * stride_dvh + tok64[:, None] * stride_dvn
                     + offs_dv[None, :] * stride_dvd, dv.to(GradV.dtype.element_ty),
                     mask=row_ok[:, None] & dv_ok)

    ws = (pid_w * H + off_h).to(tl.int64)
    tl.store(DBias + ws * N * N + tok64[:, None] * N + tok64[None, :], dbias, mask=tile_ok)
    tl.store(DScale + ws, tl.sum(dscale, 0))


def _windows_per_program(Bw: int, programs_per_window: int, device) -> int:
    """The largest power of two <= 8 windows per program that still leaves >= 4 programs per SM."""
    sms, _, _ = device_info(device)
    windows = 1
    while windows < 8 and programs_per_window * cdiv(Bw, 2 * windows) >= 4 * sms:
        windows *= 2
    return windows


@functools.lru_cache(maxsize=1024)
def window_plan(N: int) -> dict:
    """Launch options of :func:`window_fwd`: tiles, warps, pipeline stages (one program per window, head and
    query tile).

    ``BLOCK_M`` covers a 49/64-token window in one tile (larger windows take 64-row tiles), keys go in tiles
    of 32. Measured on H100 (``docs/kernel_notes.md``, "Window attention (W-ELSA)"): one window per program,
    four warps and no software pipelining (``num_stages=1``) ran 1.6-2.2x faster on the Swin-v2-T/W8 stages
    than several windows per program with two stages, whose buffers held the registers and shared memory a
    second resident program needs; 32-key tiles are within 2% of the best at 49-576 tokens in float32 and
    bfloat16, where 64-key tiles lose 2.5x on Swin v1's 49-token bfloat16 windows.
    """
    return dict(BLOCK_M=64 if N > 32 else 32, BLOCK_N=32, num_warps=4, num_stages=1)


class _WindowFwdProgram(Program):
    """The launch of one window-forward signature, planned once (see ``launch``)."""

    def __init__(self, q, k, v, logit_scale, bias, mask, precision, scale):
        Bw, H, N, D = q.shape
        Dv = v.shape[-1]
        self.device, self.dtype = q.device, q.dtype
        self.device_index = q.device.index if q.is_cuda else None
        self.out_size, self.out_stride = (Bw, H, N, Dv), (N * H * Dv, Dv, H * Dv, 1)
        self.empty = Bw == 0 or N == 0
        if self.empty:
            return
        prec = resolve_precision(precision, q.dtype, q.device, "window")
        if q.device.type == "cpu" and q.dtype != torch.float32:
            prec = "upcast"  # the interpreter has no half dot
        cfg = window_plan(N)
        m_tiles = cdiv(N, cfg["BLOCK_M"])
        has_mask = mask is not None
        cosine = logit_scale is not None
        self.launch = Launch(
            _window_fwd_kernel, (Bw, m_tiles * H),
            (*q.stride(), *k.stride(), *v.stride(), logit_scale.stride(0) if cosine else 0, *bias.stride(),
             *(mask.stride() if has_mask else (0, 0, 0)), *self.out_stride,
             N, mask.shape[0] if has_mask else 1, m_tiles, LOGIT_SCALE_MAX, float(scale)),
            dict(D=D, DV=Dv, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_D=tile_size(D),
                 BLOCK_DV=tile_size(Dv), PRECISION=prec, HAS_MASK=has_mask,
                 COSINE=cosine, ACCUMULATE=ACCUMULATION.get(prec, "plain")),
            cfg["num_warps"], cfg["num_stages"])

    def run(self, q, k, v, logit_scale, bias, mask):
        out = torch.empty_strided(self.out_size, self.out_stride, dtype=self.dtype, device=self.device)
        if not self.empty:
            self.launch(q, k, v, bias if logit_scale is None else logit_scale, bias,
                        bias if mask is None else mask, out)
        return out


_FWD_PROGRAMS = ProgramCache()


def window_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logit_scale: Tensor | None,
    bias: Tensor,
    mask: Tensor | None = None,
    precision: str = "auto",
    scale: float = 1.0,
) -> Tensor:
    """Window attention forward (Swin v2 cosine attention, or Swin v1 with ``logit_scale=None``).

    A trusted launcher: the inputs are not checked (``ops.window_attention`` checks them).

    Args:
        q, k: ``[B*nW, H, N, D]``; v: ``[B*nW, H, N, Dv]``; any strides (views of a fused qkv); float16,
            bfloat16 or float32.
        logit_scale: ``[H]``, Swin v2's raw parameter: q and k are L2-normalised per row and
            ``exp(min(logit_scale, log 100))`` multiplies the cosines. None: plain ``q . k * scale`` logits.
        bias: ``[H, N, N]`` additive bias shared by all windows (any strides, e.g. a permuted view).
        mask: ``[nW, N, N]`` additive shift mask, window ``b`` uses ``mask[b % nW]``; or None.
        precision: float32 dot precision ``"auto" | "ieee" | "tf32x3" | "fp16x3" | "tf32"`` (ignored for
            half inputs; ``"fp16x3"`` runs as ``"tf32x3"``).
        scale: the logit scale without ``logit_scale`` (Swin v1: ``head_dim ** -0.5``).

    Returns:
        ``out [B*nW, H, N, Dv]`` in q's dtype (the backward recomputes each window's softmax: no
        log-sum-exp is kept). It is stored as ``[B*nW, N, H, Dv]`` (a transposed view), so that
        ``out.transpose(1, 2).reshape(B*nW, N, H*Dv)``, the input of the output projection, is free.
    """
    program = _FWD_PROGRAMS(_WindowFwdProgram, (q, k, v, logit_scale, bias, mask), (precision, float(scale)))
    return program(q, k, v, logit_scale, bias, mask)


_BWD_PROGRAMS = ProgramCache()
BWD_MAX_TOKENS = 64  # windows the fused backward holds whole in one tile (Swin-v2 W8: 64 tokens)


@functools.lru_cache(maxsize=1024)
def window_bwd_plan(Bw: int, H: int, N: int, D: int, Dv: int, device) -> dict:
    """Launch options of :func:`window_bwd`: the window tile, windows per program, warps.

    ``WINDOWS`` is the largest power of two <= 8 that still leaves at least four programs per SM; each
    program writes one ``[N, N]`` partial bias gradient, so fewer programs also means a smaller workspace.
    Four warps: measured against eight on Swin-v2-T/W8's four stages (``docs/kernel_notes.md``, "Window
    attention (W-ELSA)").
    """
    return dict(BLOCK=tile_size(N), WINDOWS=_windows_per_program(Bw, H, device), num_warps=4, num_stages=1)


class _WindowBwdProgram(Program):
    """The launch of one window-backward signature, planned once (see ``launch``)."""

    def __init__(self, dout, q, k, v, logit_scale, bias, mask, precision, need_qkv, scale):
        Bw, H, N, D = q.shape
        Dv = v.shape[-1]
        dev = q.device
        self.device, self.device_index = dev, dev.index if q.is_cuda else None
        self.need_qkv = need_qkv
        self.sizes = (Bw, H, N, D), (Bw, H, N, D), (Bw, H, N, Dv)
        self.dtypes = q.dtype, k.dtype, v.dtype
        self.HN = (H, N)
        self.empty = Bw == 0 or N == 0
        if self.empty:
            return
        prec = resolve_precision(precision, torch.float32, dev, "window")
        cfg = window_bwd_plan(Bw, H, N, D, Dv, dev)
        self.groups = groups = cdiv(Bw, cfg["WINDOWS"])
        has_mask = mask is not None
        cosine = logit_scale is not None
        no_grad = (0, 0, 0, 0)
        grads = [(H * N * D, N * D, D, 1)] * 2 + [(H * N * Dv, N * Dv, Dv, 1)]  # contiguous dq, dk, dv
        self.launch = Launch(
            _window_bwd_kernel, (groups, H),
            (*q.stride(), *k.stride(), *v.stride(), *dout.stride(), logit_scale.stride(0) if cosine else 0,
             *bias.stride(), *(mask.stride() if has_mask else (0, 0, 0)),
             *(grads[0] if need_qkv else no_grad), *(grads[1] if need_qkv else no_grad),
             *(grads[2] if need_qkv else no_grad),
             Bw, H, N, mask.shape[0] if has_mask else 1, LOGIT_SCALE_MAX, float(scale)),
            dict(D=D, DV=Dv, BLOCK_D=tile_size(D), BLOCK_DV=tile_size(Dv), PRECISION=prec, HAS_MASK=has_mask,
                 NEED_QKV=need_qkv, COSINE=cosine, BLOCK=cfg["BLOCK"], WINDOWS=cfg["WINDOWS"]),
            cfg["num_warps"], cfg["num_stages"])

    def run(self, dout, q, k, v, logit_scale, bias, mask):
        dev = self.device
        H, N = self.HN
        dq = dk = dv = None
        if self.need_qkv:
            dq, dk, dv = (torch.empty(size, dtype=dt, device=dev)
                          for size, dt in zip(self.sizes, self.dtypes))
        if self.empty:
            zeros = torch.zeros((H, N, N), dtype=torch.float32, device=dev)
            return dq, dk, dv, zeros, torch.zeros(H, dtype=torch.float32, device=dev)
        dbias = torch.empty((self.groups, H, N, N), dtype=torch.float32, device=dev)
        dscale = torch.empty((self.groups, H), dtype=torch.float32, device=dev)
        self.launch(q, k, v, dout, bias if logit_scale is None else logit_scale, bias,
                    bias if mask is None else mask, q if dq is None else dq, k if dk is None else dk,
                    v if dv is None else dv, dbias, dscale)
        if self.groups > 1:
            dbias, dscale = dbias.sum(0), dscale.sum(0)
        else:
            dbias, dscale = dbias[0], dscale[0]
        return dq, dk, dv, dbias, dscale


def window_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logit_scale: Tensor | None,
    bias: Tensor,
    mask: Tensor | None = None,
    precision: str = "auto",
    need_qkv: bool = True,
    scale: float = 1.0,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor, Tensor]:
    """Gradients of :func:`window_fwd` for windows of at most ``BWD_MAX_TOKENS`` tokens, in one launch.

    A trusted launcher: the inputs are not checked (``ops.window_attention`` checks them).

    Each window's softmax is formed densely from its recomputed logits (row maximum and sum in float32,
    no saved log-sum-exp: Swin-v2 logits reach ``100 cos + 16``, where a float32 log-sum-exp carries a
    rounding of ~4e-6 into every probability). All arithmetic is float32 whatever the input dtype; the dots
    run at ``precision`` resolved as for float32 (``"auto"``: FP32-accurate three-pass TF32 on sm80+).

    Args:
        dout: ``[B*nW, H, N, Dv]`` gradient of the output (any strides); the rest as :func:`window_fwd`.
        need_qkv: compute ``dq``, ``dk``, ``dv`` (else only the bias and logit-scale gradients).

    Returns:
        ``(dq, dk, dv, dbias, dscale)``: ``dq``, ``dk``, ``dv`` in the inputs' dtype (None unless
        ``need_qkv``); ``dbias [H, N, N]`` float32, summed over all windows; ``dscale [H]`` float32,
        ``sum dS * L`` with ``L`` the scaled cosine logits: the gradient of ``exp(logit_scale)`` times that
        scale, i.e. of ``logit_scale`` before its clamp (0 without ``logit_scale``).
    """
    if q.shape[2] > BWD_MAX_TOKENS:
        raise ValueError(f"window_bwd: windows of at most {BWD_MAX_TOKENS} tokens, got N={q.shape[2]}")
    program = _BWD_PROGRAMS(_WindowBwdProgram, (dout, q, k, v, logit_scale, bias, mask),
                            (precision, need_qkv, float(scale)))
    return program(dout, q, k, v, logit_scale, bias, mask)
