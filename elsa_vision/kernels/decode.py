"""Few-query ELSA forward in Triton: stream-K ("lean") decomposition of the key axis.

For a handful of query rows (``Nq <= 16``: a decode step against a KV cache, attention pooling, learned
camera queries) and long key sequences, the regular forward has ``B * H`` query tiles at most: far fewer
programs than multiprocessors unless ``B * H`` is large. Here the key axis of *every* (batch, head) is cut
into equal lean tiles of ``BLOCK_N`` keys, numbered in one flat index space ``bh * tiles_per_head + t``, and
that space is split into ``programs`` equal contiguous ranges (``tiles_per_program`` tiles each), one per
program, whatever ``B * H`` is. A range may end inside one head and continue into the next.

Level one (``_decode_kernel``): a program walks its range; for each run of tiles that belongs to one
(batch, head) it folds the tiles into per-row states ``(m, S, W)`` with ``monoid.fold_tile`` and flushes the
partial state to the workspace when the head changes or the range ends. The partial of program ``p`` for
head ``bh`` goes to slot ``p - first(bh)`` where ``first(bh) = (bh * tiles_per_head) // tiles_per_program``
is the first program touching that head, so every slot is written by exactly one program.

Level two (``_decode_merge_kernel``): one program per (batch, head) merges that head's partials with
``monoid.merge_states`` left to right in slot order (a fixed order: reruns are bitwise equal) and
normalises to ``out = W / S`` and ``lse = ln 2 * (m + log2 S)``; rows with no visible key give 0 and
``-inf``.

Masks as in ``fwd``: bottom-right causal (query ``i`` sees key ``j <= i + Nk - Nq``), bool key padding mask,
a float bias broadcast through stride-0 dims; float16/bfloat16/float32 with the same ``PRECISION`` handling.
``choose_forward`` is the single place that decides between this path and ``fwd.elsa_fwd``.
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
import triton.language as tl
from torch import Tensor

from .dots import matmul
from .fwd import bias4
from .host import FLOAT_DTYPES, LOG2E, cdiv, device_info, tile_size
from .launch import AttentionProgram, Launch, ProgramCache
from .monoid import (
    ACCUMULATION,
    add_bias,
    clamp_bias,
    count_nonfinite,
    finalize_state,
    fold_keys,
    identity_state,
    merge_states,
    nonfinite_values,
    settle_sums,
)
from .precision import resolve_precision

__all__ = ["DecodePlan", "decode_plan", "elsa_decode", "choose_forward", "DECODE_MAX_QUERIES",
           "DECODE_MIN_KEYS"]

_LOG2E = tl.constexpr(LOG2E)
_LN2 = tl.constexpr(0.6931471805599453)

# Routing thresholds of ``choose_forward``: at most this many query rows, at least this many keys.
DECODE_MAX_QUERIES = 16
DECODE_MIN_KEYS = 4096


# --------------------------------------------------------------------------------------------- kernels


@triton.jit
def _decode_run(
    m_i, s_i, s_c, acc, acc_c, code, q, offs_m, offs_n, offs_d, offs_dv, k_base, v_base, bias_base, kpm_base,
    stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
    t0, t1, tile_base, Nk, causal_shift, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_N: tl.constexpr,
    ACCUMULATE: tl.constexpr, EXACT: tl.constexpr,
):
    """Fold the key tiles ``[t0, t1)`` of one (batch, head) run into the state; tile ``tile`` starts at key
    ``(tile - tile_base) * BLOCK_N``. ``EXACT``: the exact pass (``monoid.add_bias``,
    ``monoid.fold_keys``: a hidden key contributes nothing whatever it holds; the visible keys'
    non-finite values go to ``code``); otherwise ``code`` is returned untouched."""
    for tile in range(t0, t1):
        start_n = (tile - tile_base) * BLOCK_N
        cols = start_n + offs_n
        row64 = tl.cast(start_n, tl.int64)
        kt_ptrs = k_base + row64 * stride_kn + offs_n[None, :] * stride_kn + offs_d[:, None] * stride_kd
        v_ptrs = v_base + row64 * stride_vn + offs_n[:, None] * stride_vn + offs_dv[None, :] * stride_vd
        if EVEN_N:
            kt = tl.load(kt_ptrs, mask=offs_d[:, None] < D, other=0.0)
            v = tl.load(v_ptrs, mask=offs_dv[None, :] < DV, other=0.0)
        else:
            kt = tl.load(kt_ptrs, mask=(offs_d[:, None] < D) & (cols[None, :] < Nk), other=0.0)
            v = tl.load(v_ptrs, mask=(cols[:, None] < Nk) & (offs_dv[None, :] < DV), other=0.0)
        qk = matmul(q, kt, tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32), PRECISION)
        scores = qk * qk_scale
        if HAS_BIAS:
            b = tl.load(bias_base + cols[None, :].to(tl.int64) * stride_bn,
                        mask=(offs_m[:, None] >= 0) & (cols[None, :] < Nk), other=0.0).to(tl.float32)
            b = clamp_bias(b)
            if EXACT:
                scores = add_bias(scores, b)
            else:
                scores = scores + b * _LOG2E
        valid = (cols[None, :] < Nk) & (offs_m[:, None] >= 0)
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + causal_shift)
        scores = tl.where(valid, scores, float("-inf"))
        if HAS_KPM:
            keep = tl.load(kpm_base + cols.to(tl.int64) * stride_kpn, mask=cols < Nk, other=0) != 0
            scores = tl.where(keep[None, :], scores, float("-inf"))
            v = tl.where(keep[:, None], v, 0.0)
        m_i, s_i, s_c, acc, acc_c, code = fold_keys(m_i, s_i, s_c, acc, acc_c, code, scores, v, PRECISION,
                                                    ACCUMULATE, EXACT)
    return m_i, s_i, s_c, acc, acc_c, code


@triton.jit
def _decode_kernel(
    Q, K, V, Bias, Kpm, WsM, WsS, WsW,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_bb, stride_bh, stride_bm, stride_bn,
    stride_kpb, stride_kpn,
    H, Nq, Nk, tiles_per_head, total_tiles, tiles_per_program, max_partials, qk_scale,
    D: tl.constexpr, DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, PRECISION: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_BIAS: tl.constexpr, HAS_KPM: tl.constexpr, EVEN_N: tl.constexpr, ACCUMULATE: tl.constexpr,
):
    """Level one. Grid ``(programs,)``; program ``p`` owns the flat tiles
    ``[p * tiles_per_program, min((p + 1) * tiles_per_program, total_tiles))``.

    Writes one partial state per (program, head) run to ``WsM/WsS [BH, max_partials, Nq]`` and
    ``WsW [BH, max_partials, Nq, BLOCK_DV]`` (the identity where the run holds no visible key).
    """
    pid = tl.program_id(0)
    t = pid * tiles_per_program
    end = tl.minimum(t + tiles_per_program, total_tiles)

    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Nq
    rows64 = offs_m.to(tl.int64)
    causal_shift = Nk - Nq

    while t < end:
        bh = t // tiles_per_head
        run_end = tl.minimum(end, (bh + 1) * tiles_per_head)
        off_b = (bh // H).to(tl.int64)
        off_h = (bh % H).to(tl.int64)

        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh + rows64[:, None] * stride_qm \
            + offs_d[None, :] * stride_qd
        q = tl.load(q_ptrs, mask=row_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        k_base = K + off_b * stride_kb + off_h * stride_kh
        v_base = V + off_b * stride_vb + off_h * stride_vh
        bias_base = Bias
        kpm_base = Kpm
        if HAS_BIAS:
            bias_base = (Bias + off_b * stride_bb + off_h * stride_bh
                         + tl.minimum(offs_m, Nq - 1).to(tl.int64)[:, None] * stride_bm)
        if HAS_KPM:
            kpm_base = Kpm + off_b * stride_kpb

        m_i, s_i, s_c, acc, acc_c = identity_state(BLOCK_M, BLOCK_DV)
        code = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)  # fold_keys: only an exact pass writes it
        m_i, s_i, s_c, acc, acc_c, code = _decode_run(
            m_i, s_i, s_c, acc, acc_c, code, q, offs_m, offs_n, offs_d, offs_dv, k_base, v_base, bias_base,
            kpm_base, stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
            t, run_end, bh * tiles_per_head, Nk, causal_shift, qk_scale,
            D, DV, BLOCK_M, BLOCK_N, PRECISION, CAUSAL, HAS_BIAS, HAS_KPM, EVEN_N, ACCUMULATE, False)
        s_i, acc = settle_sums(s_i, s_c, acc, acc_c, ACCUMULATE)
        if count_nonfinite(acc) + count_nonfinite(s_i) != 0:
            # A NaN or an infinity reached the state: redo the run with the exact pass (see monoid), on key
            # tiles half as wide (its registers stay below the fast pass's).
            EXACT_N: tl.constexpr = BLOCK_N // 2 if BLOCK_N >= 32 else BLOCK_N
            m_i, s_i, s_c, acc, acc_c = identity_state(BLOCK_M, BLOCK_DV)
            per: tl.constexpr = BLOCK_N // EXACT_N
            m_i, s_i, s_c, acc, acc_c, code = _decode_run(
                m_i, s_i, s_c, acc, acc_c, code, q, offs_m,
                tl.arange(0, EXACT_N), offs_d, offs_dv, k_base, v_base, bias_base, kpm_base,
                stride_kn, stride_kd, stride_vn, stride_vd, stride_bn, stride_kpn,
                t * per, run_end * per, bh * tiles_per_head * per, Nk, causal_shift, qk_scale,
                D, DV, BLOCK_M, EXACT_N, PRECISION, CAUSAL, HAS_BIAS, HAS_KPM, EVEN_N, ACCUMULATE, True)
            s_i, acc = settle_sums(s_i, s_c, acc, acc_c, ACCUMULATE)
            acc = acc + nonfinite_values(code)

        slot = pid - (bh * tiles_per_head) // tiles_per_program
        ws_rows = (bh.to(tl.int64) * max_partials + slot) * Nq + rows64
        tl.store(WsM + ws_rows, m_i, mask=row_ok)
        tl.store(WsS + ws_rows, s_i, mask=row_ok)
        tl.store(WsW + ws_rows[:, None] * BLOCK_DV + offs_dv[None, :], acc, mask=row_ok[:, None])
        t = run_end


@triton.jit
def _decode_merge_kernel(
    WsM, WsS, WsW, Out, Lse,
    stride_ob, stride_oh, stride_om, stride_od, stride_lb, stride_lh, stride_lm,
    H, Nq, tiles_per_head, tiles_per_program, max_partials,
    DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, STORE_LSE: tl.constexpr,
):
    """Level two. Grid ``(B * H,)``: merge the head's partials ``first(bh) .. last(bh)`` left to right and
    normalise into ``Out [B, H, Nq, DV]`` and ``Lse [B, H, Nq]`` (natural log)."""
    bh = tl.program_id(0)
    first = (bh * tiles_per_head) // tiles_per_program
    last = ((bh + 1) * tiles_per_head - 1) // tiles_per_program
    offs_m = tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    row_ok = offs_m < Nq
    rows64 = offs_m.to(tl.int64)

    m_i = tl.full([BLOCK_M, 1], float("-inf"), dtype=tl.float32)
    s_i = tl.zeros([BLOCK_M, 1], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    for slot in range(0, last - first + 1):
        ws_rows = (bh.to(tl.int64) * max_partials + slot) * Nq + rows64
        m_p = tl.load(WsM + ws_rows, mask=row_ok, other=float("-inf"))
        s_p = tl.load(WsS + ws_rows, mask=row_ok, other=0.0)
        w_p = tl.load(WsW + ws_rows[:, None] * BLOCK_DV + offs_dv[None, :], mask=row_ok[:, None], other=0.0)
        m_i, s_i, acc = merge_states(m_i, s_i, acc, m_p[:, None], s_p[:, None], w_p)

    out, lse = finalize_state(tl.reshape(m_i, [BLOCK_M]), tl.reshape(s_i, [BLOCK_M]), acc)
    off_b = (bh // H).to(tl.int64)
    off_h = (bh % H).to(tl.int64)
    o_ptrs = Out + off_b * stride_ob + off_h * stride_oh + rows64[:, None] * stride_om \
        + offs_dv[None, :] * stride_od
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None] & (offs_dv[None, :] < DV))
    if STORE_LSE:
        tl.store(Lse + off_b * stride_lb + off_h * stride_lh + rows64 * stride_lm, lse, mask=row_ok)


# --------------------------------------------------------------------------------------------- planning


@dataclasses.dataclass(frozen=True)
class DecodePlan:
    """Launch parameters of one few-query call.

    ``block_n``: keys per lean tile; ``tiles_per_head = cdiv(Nk, block_n)``; ``total_tiles = B * H *
    tiles_per_head``; ``programs`` level-one programs of ``tiles_per_program`` consecutive flat tiles each
    (the last may hold fewer, none is empty); ``max_partials``: workspace slots per head (an upper bound on
    the programs that touch one head); ``block_m``: query rows per tile (``>= Nq``, at least 16 for the
    dot); ``workspace_bytes``: the level-one workspace.
    """

    block_m: int
    block_n: int
    block_d: int
    block_dv: int
    tiles_per_head: int
    total_tiles: int
    programs: int
    tiles_per_program: int
    max_partials: int
    num_warps: int
    num_stages: int
    precision: str
    workspace_bytes: int


def _smem_bytes(bm: int, bn: int, bd: int, bdv: int, stages: int, elem: int) -> int:
    return elem * (bm * bd + max(1, stages - 1) * bn * (bd + bdv) + bm * bn)


def _decode_plan(B, H, Nq, Nk, D, dtype, sm_count=None, Dv=None, precision="auto", device=None, block_n=None,
                 programs=None) -> DecodePlan:
    if dtype not in FLOAT_DTYPES:
        raise TypeError(f"decode_plan: `dtype` must be one of {FLOAT_DTYPES}, got {dtype}")
    Dv = D if Dv is None else Dv
    for name, val, lo in (("B", B, 1), ("H", H, 1), ("Nq", Nq, 1), ("Nk", Nk, 1), ("D", D, 1), ("Dv", Dv, 1)):
        if isinstance(val, bool) or not isinstance(val, int) or val < lo:
            raise ValueError(f"decode_plan: `{name}` must be an int >= {lo}, got {val!r}")
    if not (D <= 256 and Dv <= 256):
        raise ValueError(f"decode_plan: head dims must be in [1, 256], got D={D}, Dv={Dv}")
    if Nq > 128:
        raise ValueError(f"decode_plan: the few-query path takes Nq <= 128 query rows, got Nq={Nq}")
    prec = resolve_precision(precision, dtype, device, "decode")
    sms, cc, smem = device_info(device)
    if cc == (0, 0) and dtype == torch.bfloat16:
        prec = "upcast"  # the interpreter has no bfloat16 dot
    if sm_count is not None:
        if isinstance(sm_count, bool) or not isinstance(sm_count, int) or sm_count < 1:
            raise ValueError(f"decode_plan: `sm_count` must be an int >= 1, got {sm_count!r}")
        sms = sm_count
    bm, bd, bdv = tile_size(Nq), tile_size(D), tile_size(Dv)
    elem = 4 if dtype == torch.float32 else 2
    big = max(bd, bdv)
    if cc == (0, 0):
        bn, warps, stages = (32 if big > 128 else 64), 4, 1
    elif dtype == torch.float32:
        bn, warps, stages = (64 if big <= 128 else 32), 4, 3
    else:
        bn, warps, stages = (128 if big <= 128 else 64), 4, 3
    while stages > 1 and _smem_bytes(bm, bn, bd, bdv, stages, elem) > smem:
        stages -= 1
    while bn > 16 and _smem_bytes(bm, bn, bd, bdv, stages, elem) > smem:
        bn //= 2
    if block_n is not None:
        if isinstance(block_n, bool) or not isinstance(block_n, int) or block_n < 16 \
                or block_n & (block_n - 1):
            raise ValueError(f"decode_plan: `block_n` must be a power of two >= 16, got {block_n!r}")
        bn = block_n
    tph = cdiv(Nk, bn)
    total = B * H * tph
    if programs is None:
        # One wave: every multiprocessor gets as many resident programs as its shared memory holds (<= 2).
        per_sm = max(1, min(2, smem // max(1, _smem_bytes(bm, bn, bd, bdv, stages, elem))))
        target = sms * per_sm
    else:
        if isinstance(programs, bool) or not isinstance(programs, int) or programs < 1:
            raise ValueError(f"decode_plan: `programs` must be an int >= 1, got {programs!r}")
        target = programs
    progs = max(1, min(total, target))
    tpp = cdiv(total, progs)
    progs = cdiv(total, tpp)  # equal ranges, none empty
    max_partials = min(progs, (tph - 1) // tpp + 2)
    ws = B * H * max_partials * Nq * (bdv + 2) * 4
    return DecodePlan(block_m=bm, block_n=bn, block_d=bd, block_dv=bdv, tiles_per_head=tph, total_tiles=total,
                      programs=progs, tiles_per_program=tpp, max_partials=max_partials, num_warps=warps,
                      num_stages=stages, precision=prec, workspace_bytes=ws)


_decode_plan_cached = functools.lru_cache(maxsize=1024)(_decode_plan)


def decode_plan(B: int, H: int, Nq: int, Nk: int, D: int, dtype: torch.dtype, sm_count: int | None = None, *,
                Dv: int | None = None, precision: str = "auto", device=None, block_n: int | None = None,
                programs: int | None = None) -> DecodePlan:
    """Lean tile size, program count and tiles per program for one few-query call.

    Defaults: ``block_n`` 64 keys for float32 and 128 for float16/bfloat16 (head dims <= 128; halved above,
    and halved until the pipelined tiles fit in shared memory); ``programs`` = one wave, ``sm_count`` (the
    device's multiprocessors unless given) times the programs one multiprocessor can hold (<= 2).
    ``block_n`` and ``programs`` may be forced (tests and benchmarks of the stream-K split).
    """
    if device is not None:
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
    return _decode_plan_cached(B, H, Nq, Nk, D, dtype, sm_count, Dv, precision, device, block_n, programs)


def choose_forward(B: int, H: int, Nq: int, Nk: int, device=None, sm_count: int | None = None) -> str:
    """``"decode"`` where the stream-K few-query path is expected to win, else ``"fwd"``.

    Decode when ``Nq <= DECODE_MAX_QUERIES``, ``Nk >= DECODE_MIN_KEYS`` and the regular forward's query
    tiles (``B * H * cdiv(Nq, 16)`` at best) fill at most one wave of ``sm_count`` multiprocessors: then
    the regular grid can only be widened by its (at most 16) key partitions, while the lean split spreads
    every key tile of every head evenly over the machine.
    """
    sms = device_info(device)[0] if sm_count is None else int(sm_count)
    if 1 <= Nq <= DECODE_MAX_QUERIES and Nk >= DECODE_MIN_KEYS and B * H * cdiv(Nq, 16) <= sms:
        return "decode"
    return "fwd"


# --------------------------------------------------------------------------------------------- launcher


class _DecodeProgram(AttentionProgram):
    """Both launches of one few-query signature, planned once (see ``launch``)."""

    def __init__(self, q, k, v, bias, kpm, causal, scale, precision, block_n=None, programs=None):
        B, H, Nq, D = q.shape
        Nk, Dv = k.shape[2], v.shape[3]
        self.device, self.dtype = q.device, q.dtype
        self.device_index = q.device.index if q.is_cuda else None
        self.bias_cast = bias is not None and bias.dtype == torch.float64
        self.out_size, self.out_stride = (B, H, Nq, Dv), (Nq * H * Dv, Dv, H * Dv, 1)
        self.lse_size = (B, H, Nq)
        self.empty = B * H * Nq == 0
        self.zero = Nk == 0
        if self.empty or self.zero:
            return
        p = decode_plan(B, H, Nq, Nk, D, q.dtype, Dv=Dv, precision=precision, device=q.device,
                        block_n=block_n, programs=programs)
        self.plan = p
        bh = B * H
        self.ws_sizes = ((bh, p.max_partials, Nq), (bh, p.max_partials, Nq, p.block_dv))
        has_bias, has_kpm = bias is not None, kpm is not None
        sb = tuple(bias4(bias).expand(B, H, Nq, Nk).stride()) if has_bias else (0, 0, 0, 0)
        skp = (kpm.stride(0) if kpm.shape[0] > 1 else 0, kpm.stride(1)) if has_kpm else (0, 0)
        self.main = Launch(
            _decode_kernel, (p.programs,),
            (*q.stride(), *k.stride(), *v.stride(), *sb, *skp,
             H, Nq, Nk, p.tiles_per_head, p.total_tiles, p.tiles_per_program, p.max_partials, scale * LOG2E),
            dict(D=D, DV=Dv, BLOCK_M=p.block_m, BLOCK_N=p.block_n, BLOCK_D=p.block_d, BLOCK_DV=p.block_dv,
                 PRECISION=p.precision, CAUSAL=causal, HAS_BIAS=has_bias, HAS_KPM=has_kpm,
                 EVEN_N=Nk % p.block_n == 0, ACCUMULATE=ACCUMULATION.get(p.precision, "plain")),
            p.num_warps, p.num_stages)
        merge_scalars = (*self.out_stride, H * Nq, Nq, 1, H, Nq, p.tiles_per_head, p.tiles_per_program,
                         p.max_partials)
        self.merge = [Launch(_decode_merge_kernel, (bh,), merge_scalars,
                             dict(DV=Dv, BLOCK_M=p.block_m, BLOCK_DV=p.block_dv, STORE_LSE=store), 4)
                      for store in (True, False)]  # [with lse, without]

    def run(self, q, k, v, bias=None, kpm=None, need_lse=True):
        out, lse, done = self.outputs(need_lse)
        if done:
            return out, lse
        ws_m = torch.empty(self.ws_sizes[0], device=self.device, dtype=torch.float32)
        ws_s = torch.empty(self.ws_sizes[0], device=self.device, dtype=torch.float32)
        ws_w = torch.empty(self.ws_sizes[1], device=self.device, dtype=torch.float32)
        if bias is None:
            bias = ws_m
        elif self.bias_cast:
            bias = bias.to(torch.float32)
        kpm = ws_m if kpm is None else kpm.view(torch.uint8)
        self.main(q, k, v, bias, kpm, ws_m, ws_s, ws_w)
        self.merge[0 if need_lse else 1](ws_m, ws_s, ws_w, out, lse if need_lse else out)
        return out, lse


_PROGRAMS = ProgramCache()


def decode_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, block_n=None,
                   programs=None) -> _DecodeProgram:
    """The cached launch program of this few-query signature (``scale`` resolved)."""
    program = _PROGRAMS(_DecodeProgram, (q, k, v, attn_bias, key_padding_mask),
                        (causal, scale, precision, block_n, programs))
    return program


def elsa_decode(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
    block_n: int | None = None,
    programs: int | None = None,
    need_lse: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Few-query attention ``softmax(q k^T * scale + bias) v`` by the stream-K split; ``elsa_fwd``'s contract.

    A trusted launcher: the inputs are not checked (``elsa_attention`` checks them).

    Args:
        q: ``[B, H, Nq, D]`` with ``Nq <= 128`` (the path is planned for ``Nq <= 16``); k: ``[B, H, Nk, D]``;
            v: ``[B, H, Nk, Dv]``; float16/bfloat16/float32, any strides.
        attn_bias: float tensor broadcastable to ``[B, H, Nq, Nk]`` (read through stride-0 dims).
        key_padding_mask: bool ``[B, Nk]`` (or ``[1, Nk]``), True = the key takes part.
        causal: query ``i`` sees key ``j`` iff ``j <= i + Nk - Nq`` (bottom-right: one decode query sees
            the whole cache).
        scale: logit scale, default ``D ** -0.5``.
        precision: float32 only: ``"auto"``, ``"ieee"``, ``"tf32x3"``, ``"fp16x3"``, ``"tf32"`` (as
            ``elsa_fwd``; ``"fp16x3"`` runs as ``"tf32x3"``).
        block_n, programs: force the lean tile size and the level-one program count (see ``decode_plan``).
        need_lse: False: the log-sum-exp is neither stored nor returned (inference).

    Returns:
        ``out [B, H, Nq, Dv]`` in q's dtype (rows with no visible key: 0) and ``lse [B, H, Nq]`` float32
        (natural log, ``-inf`` where no key is visible). Deterministic: reruns are bitwise equal.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return decode_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, block_n,
                          programs)(q, k, v, attn_bias, key_padding_mask, need_lse)
