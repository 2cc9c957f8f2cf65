"""The (m, S, W) monoid as Triton device functions, shared by every ELSA kernel.

States live in the base-2 domain: ``m`` is the running maximum of ``log2(e) * score``, ``S`` the sum of
``exp2(score2 - m)`` and ``W`` the equally weighted value sum. ``m + log2(S)`` is the base-2 log-sum-exp
(multiply by ``ln 2`` for the natural one). The identity is ``(-inf, 0, 0)``.

``merge_states`` is the monoid product ``a (+) b``; ``fold_tile`` is the same product with its right operand
a score tile ``[BLOCK_M, BLOCK_N]`` and its value tile ``[BLOCK_N, Dv]`` (the tile's own state is never
materialised: its weights are taken directly relative to the merged maximum). Both take their shift from
``safe_shift``, which maps a ``-inf`` maximum (nothing visible yet) to 0 so that ``exp2(-inf - shift)`` is 0
and never NaN. Every difference fed to ``exp2`` is ``x - max(...)`` of already rounded values, hence
``<= 0`` exactly: the exponentials cannot overflow whatever the magnitude of the logits.

Non-finite inputs follow the rule of ``reference.py``: a hidden key (logit ``-inf``) contributes nothing to a
row whatever its key and value rows hold, a visible key's non-finite value reaches its own column. A
``fold_tile`` product ``P V`` breaks the first half where a hidden key's value is NaN or infinite
(``0 * NaN``), so every kernel runs a fast pass with ``fold_tile`` and checks its result
(``count_nonfinite``): only a program whose state holds a NaN or an infinity redoes its keys in an exact
pass (``fold_keys`` with ``EXACT``), which records the visible keys' non-finite value entries apart
(``fold_nonfinite``, added to ``W`` at the end by ``nonfinite_values``) and folds the finite part of the
values (``finite_part``): a hidden key's weight is an exact 0 and meets only finite numbers.
``merge_states`` carries non-finite entries of ``W`` unscaled.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .dots import f16_pair, matmul, matmul_f16x3, pow2, split_f16
from .host import cdiv, next_pow2

__all__ = [
    "ACCUMULATION", "safe_shift", "merge_states", "fold_tile", "kahan_add", "finalize_state", "clamp_bias",
    "add_bias", "finite_part", "count_nonfinite", "fold_nonfinite", "nonfinite_values",
    "identity_state", "settle_sums", "fold_keys", "merge_outputs_", "merge_row_states", "SEGMENT_KEYS",
    "store_lse", "tile_weights", "weighted_parts", "fold_parts",
]

# How each float32 precision's running sums over the key tiles accumulate (``fold_tile``'s ``ACCUMULATE``, a
# host-side choice of every launcher): "kahan" (compensated), "fma" (one rounding per tile), "plain" (the
# default). "ieee", the strictest path, is compensated: its error stays flat in the key count
# (docs/kernel_notes.md, "Exact FP32").
ACCUMULATION = {"ieee": "kahan"}

# Keys per segment of the dense forward's key loop (``_fwd_kernel``'s ``SEGMENT``) for the float32 precisions
# that accumulate plainly, used where a program's keys are longer than two segments: each segment's tiles fold
# into a fresh state, which is then merged into the running one (``merge_row_states``). That two-level sum
# keeps the rounding of the running sums to about sqrt(tiles per segment) + sqrt(segments) roundings instead
# of sqrt(tiles). H100, 1 x 2 x 262,144 x 64, fp16x3: relerr 1.52e-6 -> 4.0e-7 for 2.8% more time
# (docs/kernel_notes.md, "Long key ranges").
SEGMENT_KEYS = {"fp16x3": 8192, "tf32x3": 8192}

# |bias| is clamped to this before the base-2 conversion so that log2(e) * bias stays finite in fp32
# (finfo(float32).min * log2(e) would overflow to -inf and turn a finite bias row into a masked row).
_BIAS_CLAMP = tl.constexpr(2.0e38)
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(1.4426950408889634)
# fold_nonfinite's code: +1 per visible +inf (or NaN) value entry, +_NEG per visible -inf (or NaN) one.
_NEG = tl.constexpr(512.0)


@triton.jit
def safe_shift(m):
    """The shift used for a row whose maximum is ``m``: ``m``, or 0 where ``m == -inf``."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def clamp_bias(b):
    """A float32 bias clamped to ``[-2e38, 2e38]`` so that ``log2(e) * b`` stays finite; ``-inf`` (a hidden
    key), ``+inf`` (its row is NaN, as ``softmax`` makes it) and NaN (which must reach the output, as in
    the reference) are kept."""
    a = tl.abs(b)
    return tl.where((a > _BIAS_CLAMP) & (a < float("inf")), tl.where(b > 0, _BIAS_CLAMP, -_BIAS_CLAMP), b)


@triton.jit
def add_bias(scores, b):
    """``scores + log2(e) * b`` for a clamped bias ``b``, and ``-inf`` wherever ``b`` is ``-inf``: a key the
    bias hides is hidden whatever its product with the query is (a NaN from a non-finite key row included).
    The exact passes use it; the fast passes add the bias plainly (a NaN reaches the state and sends the
    program to its exact pass)."""
    return tl.where(b == float("-inf"), float("-inf"), scores + b * _LOG2E)


@triton.jit
def finite_part(x):
    """``x`` with its NaN and infinite entries replaced by 0."""
    return tl.where(tl.abs(x) < float("inf"), x, 0.0)


@triton.jit
def count_nonfinite(x):
    """How many entries of the block ``x`` (any rank) are NaN or infinite: an int32 scalar."""
    return tl.sum(tl.where(tl.abs(x) < float("inf"), 0, 1))


@triton.jit
def identity_state(BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr):
    """The identity ``(-inf, 0, 0)`` for ``BLOCK_M`` rows as a kernel's running state ``(m, S, S_c, W, W_c)``
    (``S_c`` / ``W_c``: the Kahan compensations, 0)."""
    return (tl.full([BLOCK_M], float("-inf"), dtype=tl.float32), tl.zeros([BLOCK_M], dtype=tl.float32),
            tl.zeros([BLOCK_M], dtype=tl.float32), tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32),
            tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32))


@triton.jit
def settle_sums(s, s_c, w, w_c, ACCUMULATE: tl.constexpr):
    """``(S, W)`` of a running state once its last tile is folded: the Kahan compensations taken off under
    ``ACCUMULATE == "kahan"``, as they are otherwise."""
    if ACCUMULATE == "kahan":
        s = s - s_c
        w = w - w_c
    return s, w


@triton.jit
def finalize_state(m, s, w):
    """``(out, lse)`` of final row states (``m``, ``s`` ``[BLOCK_M]``, ``w`` ``[BLOCK_M, BLOCK_DV]``, base 2):
    ``out = W / S`` and the natural-log ``lse = ln 2 * (m + log2 S)``; a row with no visible key (``S == 0``
    exactly) gives ``out = 0`` and ``lse = -inf``. A NaN anywhere in a row's state (a NaN logit or value of a
    visible key) stays NaN in its output, as in the reference: it never becomes a plausible 0."""
    hidden = s == 0.0
    denom = tl.where(hidden, 1.0, s)
    out = tl.where(hidden[:, None], 0.0, w / denom[:, None])
    lse = tl.where(hidden, float("-inf"), (m + tl.math.log2(denom)) * _LN2)
    return out, lse


@triton.jit
def store_lse(ptrs, m, s, lse, mask):
    """Store a row's natural-log ``lse`` (``finalize_state``'s) at ``ptrs``; into a float64 tensor it is
    formed again from the state ``(m, S)`` in float64, so that it carries the state's own accuracy instead of
    a float32 rounding of a number near ``ln N`` (``~5e-7`` absolute at 2^17 keys, which becomes a relative
    error of every later merge's weights: context parallelism's ring merges partial results by their lse).
    ``log2 S = e + log2(f)`` with ``S = f 2^e``, ``f`` in ``[1, 2)``: the float32 logarithm of ``f`` is within
    ``6e-8`` (absolute), and the sum is formed in float64. Rows whose ``S`` is not a normal float (no visible
    key, non-finite states) keep ``lse``."""
    if ptrs.dtype.element_ty == tl.float64:
        bits = s.to(tl.int32, bitcast=True)
        e = ((bits >> 23) & 0xFF) - 127
        f = ((bits & 0x7FFFFF) | 0x3F800000).to(tl.float32, bitcast=True)
        fine = (s >= 1.1754943508222875e-38) & (s < float("inf"))
        exact = (m.to(tl.float64) + e.to(tl.float64) + tl.math.log2(f).to(tl.float64)) * 0.6931471805599453
        tl.store(ptrs, tl.where(fine, exact, lse.to(tl.float64)), mask=mask)
    else:
        tl.store(ptrs, lse, mask=mask)


@triton.jit
def merge_states(ma, sa, wa, mb, sb, wb):
    """``(ma, sa, wa) (+) (mb, sb, wb)``; exact for the identity on either side.

    Shapes: ``m`` and ``S`` broadcast against ``W`` (e.g. ``[BM, 1, n]`` against ``[BM, Dv, n]``); the
    level-two kernel applies it pairwise, level by level, as a log-depth merge tree. Non-finite entries of
    ``W`` (visible non-finite values) are carried unscaled, as in ``reference.merge_states``: a factor that
    underflows to 0 must not turn an infinity into NaN.
    """
    m = tl.maximum(ma, mb)
    shift = safe_shift(m)
    ca = tl.math.exp2(ma - shift)
    cb = tl.math.exp2(mb - shift)
    w = tl.where(tl.abs(wa) < float("inf"), ca * wa, wa) + tl.where(tl.abs(wb) < float("inf"), cb * wb, wb)
    return m, ca * sa + cb * sb, w


@triton.jit
def merge_row_states(ma, sa, wa, mb, sb, wb):
    """``merge_states`` of two running states of a kernel's rows: ``m``, ``S`` ``[BLOCK_M]``, ``W``
    ``[BLOCK_M, BLOCK_DV]``."""
    m, s, w = merge_states(ma[:, None], sa[:, None], wa, mb[:, None], sb[:, None], wb)
    return tl.max(m, 1), tl.sum(s, 1), w


@triton.jit
def kahan_add(total, comp, x):
    """``total + x`` with Kahan's compensation: returns ``(t, c)`` where ``t - c`` carries the sum to about
    one rounding, however many terms were added (``c`` starts at 0 and holds the running rounding error)."""
    y = x - comp
    t = total + y
    return t, (t - total) - y


@triton.jit
def tile_weights(m, scores, scale=1.0):
    """``(m_new, alpha, p)`` of folding a score tile ``[BLOCK_M, BLOCK_N]`` (base 2) into running maxima
    ``m``: the new maxima, the factor ``exp2(m - m_new)`` of the running sums and the tile's weights
    ``exp2(scores - m_new)`` (0 for ``-inf`` scores, never NaN: ``safe_shift``).

    ``scale`` (positive): the base-2 logits are ``scores * scale``, the scale applied late: the row maxima
    are the unscaled maxima times it (the same numbers: rounding is monotonic) and each weight's exponent
    is one fused multiply-add, ``scores * scale - m_new``, instead of a multiply over the tile and then a
    subtraction. That exponent may exceed 0 by the rounding of ``m_new`` (a weight of at most ``1 + 2^-23``
    at the row maximum)."""
    m_new = tl.maximum(m, tl.max(scores, 1) * scale)
    shift = safe_shift(m_new)
    return m_new, tl.math.exp2(m - shift), tl.math.exp2(scores * scale - shift[:, None])


@triton.jit
def weighted_parts(p, v_hi, v_lo, v_scale, w):
    """``p @ v`` (fresh, shaped like ``w``) for weights ``p`` in ``[0, 1]`` and values given as float16
    parts with ``v = (v_hi + v_lo) * v_scale`` (``v_scale``: a power of two, a scalar or ``[1, BLOCK_DV]``):
    three float16 tensor-core products. The weights are split scaled by 2^14 (exact; the largest becomes
    2^14) so that their float16 parts keep 22 bits down to small weights."""
    p_hi, p_lo = f16_pair(p * 16384.0)
    return matmul_f16x3(p_hi, p_lo, v_hi, v_lo, tl.zeros_like(w)) * (1.0 / 16384.0) * v_scale


@triton.jit
def fold_parts(m, s, w, scores, v_hi, v_lo, v_scale):
    """``fold_tile`` at ``"fp16x3"`` (plain sums) for values split beforehand: ``v = (v_hi + v_lo) *
    v_scale`` (see ``weighted_parts``). Returns ``(m, S, W)``."""
    m_new, alpha, p = tile_weights(m, scores)
    s = s * alpha + tl.sum(p, 1)
    w = w * alpha[:, None] + weighted_parts(p, v_hi, v_lo, v_scale, w)
    return m_new, s, w


@triton.jit
def fold_tile(m, s, s_c, w, w_c, scores, v, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr, scale=1.0):
    """Fold one score tile into the running state: ``(m, S, W) (+) state(scores * scale, v)`` (``scale``:
    see ``tile_weights``).

    Args:
        m, s: ``[BLOCK_M]`` float32 running max (base 2) and normaliser.
        s_c, w_c: under ``ACCUMULATE == "kahan"`` the compensations of ``s`` and ``w`` (start at 0; the state
            is ``(m, s - s_c, w - w_c)``); returned unchanged otherwise.
        w: ``[BLOCK_M, BLOCK_DV]`` float32 running weighted value sum.
        scores: ``[BLOCK_M, BLOCK_N]`` float32 base-2 logits, ``-inf`` for invisible keys.
        v: ``[BLOCK_N, BLOCK_DV]`` values (rows of invisible keys already zeroed, never NaN).
        ACCUMULATE: how the tile is added to the running sums. ``"plain"``: ``s * alpha + sum(p)``, and the
            tile's products accumulate onto ``w * alpha`` (tensor-core precisions) or are formed apart and
            added (``"ieee"``, ``"fp16x3"``). ``"fma"``: the tile's products formed apart, each sum updated by
            one fused multiply-add (one rounding per tile and element; a plain add of a separately formed
            FMA-dot product may be folded back into the dot by the compiler, which then adds every product
            straight into the running sum). ``"kahan"``: compensated sums, exact to about one rounding over
            any number of tiles (the error of plain float32 running sums grows with the tile count, and W's
            terms cancel: random values give a relative error ~ sqrt(tiles) times one rounding).
    """
    m_new, alpha, p = tile_weights(m, scores, scale)
    if PRECISION == "fp16x3":
        v_hi, v_lo, cv = split_f16(v)
        pv = weighted_parts(p, v_hi, v_lo, pow2(-cv), w)
    elif ACCUMULATE != "plain" or PRECISION == "ieee":
        pv = matmul(p, v, tl.zeros_like(w), PRECISION)
    else:
        pv = tl.zeros_like(w)  # unused: the products accumulate onto w below
    if ACCUMULATE == "kahan":
        s, s_c = kahan_add(s * alpha, s_c * alpha, tl.sum(p, 1))
        w, w_c = kahan_add(w * alpha[:, None], w_c * alpha[:, None], pv)
    elif ACCUMULATE == "fma":
        s = tl.fma(s, alpha, tl.sum(p, 1))
        w = tl.fma(w, alpha[:, None], pv)
    else:
        s = s * alpha + tl.sum(p, 1)
        if PRECISION == "fp16x3" or PRECISION == "ieee":
            w = w * alpha[:, None] + pv
        else:
            w = matmul(p.to(v.dtype), v, w * alpha[:, None], PRECISION)
    return m_new, s, s_c, w, w_c


@triton.jit
def fold_nonfinite(code, visible, v):
    """Record in ``code [BLOCK_M, BLOCK_DV]`` which infinities the visible keys' values hold, per row and
    value column: ``visible [BLOCK_M, BLOCK_N]`` marks the visible (row, key) pairs, ``v [BLOCK_N, BLOCK_DV]``
    the values. ``code`` starts at 0 and stays in ``{0, 1, 512, 513}``: 1 once a ``+inf`` was seen, 512 once a
    ``-inf`` was, both for a NaN (which ``nonfinite_values`` turns into NaN, as two infinities of opposite
    signs). The counts come from one product of 0/1 matrices on the float16 tensor cores (exact: every
    operand is an integer below 2^11, every sum below 2^24), so a hidden key's value never meets a weight."""
    tl.static_assert(visible.shape[1] <= 256)  # a count stays below _NEG
    nan = v != v
    ind = tl.where((v == float("inf")) | nan, 1.0, 0.0) + tl.where((v == float("-inf")) | nan, _NEG, 0.0)
    code = tl.dot(tl.where(visible, 1.0, 0.0).to(tl.float16), ind.to(tl.float16), code)
    neg = code >= _NEG
    pos = code - tl.where(neg, _NEG, 0.0) >= 1.0
    return tl.where(pos, 1.0, 0.0) + tl.where(neg, _NEG, 0.0)


@triton.jit
def fold_keys(m, s, s_c, w, w_c, code, scores, v, PRECISION: tl.constexpr, ACCUMULATE: tl.constexpr,
              EXACT: tl.constexpr, scale=1.0):
    """One key tile into a running state: ``fold_tile``, and under ``EXACT`` (a kernel's exact pass) the rule
    that a hidden key (score ``-inf``) adds nothing whatever its value holds: the visible keys' non-finite
    value entries go to ``code`` (``fold_nonfinite``) and the finite part of ``v`` is folded. Without
    ``EXACT``, ``code`` comes back untouched: a kernel's fast pass carries a zero code through its loop (the
    compiler drops it) and hands it, still zero, to the exact pass. ``scale``: see ``tile_weights``."""
    if EXACT:
        code = fold_nonfinite(code, scores != float("-inf"), v)
        v = finite_part(v)
    m, s, s_c, w, w_c = fold_tile(m, s, s_c, w, w_c, scores, v, PRECISION, ACCUMULATE, scale)
    return m, s, s_c, w, w_c, code


@triton.jit
def nonfinite_values(code):
    """The IEEE sum of the non-finite value entries ``fold_nonfinite`` recorded: 0, ``+inf``, ``-inf`` or
    NaN per entry (added to the finite ``W``)."""
    return tl.where(code == _NEG + 1.0, float("nan"),
                    tl.where(code == 1.0, float("inf"), tl.where(code == _NEG, float("-inf"), 0.0)))


# --------------------------------------------------------------------------------------------------------
# Merging finished partial results in place (context parallelism's ring: one result per visiting key shard).


@triton.jit
def _merge_outputs_kernel(
    O, L, OB, LB,
    R, H, N, Dv,
    so_b, so_h, so_n, so_d, sl_b, sl_h, sl_n, sob_b, sob_h, sob_n, sob_d, slb_b, slb_h, slb_n,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """``(O, L) <- (O, L) (+) (OB, LB)`` for ``BLOCK_R`` of the ``R = B * H * N`` rows: two attention results
    ``(out [B, H, N, Dv], natural-log lse [B, H, N])`` of the same queries over disjoint key sets, merged
    into the result over both (``reference.merge_outputs``). The product is ``merge_states``' in the
    natural-log, normalised form: ``lse = log(e^la + e^lb)`` and ``out = e^(la - lse) oa + e^(lb - lse) ob``
    (shifted by the larger lse, so no exponential overflows), non-finite output entries carried unscaled (a
    factor that underflows to 0 must not turn an infinity into NaN), 0 and ``-inf`` for a row that sees no
    key on either side, NaN for a row with a NaN lse."""
    offs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ok = offs < R
    r = tl.where(ok, offs, 0).to(tl.int64)
    n = r % N
    h = (r // N) % H
    b = r // N // H
    d = tl.arange(0, BLOCK_D)
    mask = ok[:, None] & (d[None, :] < Dv)
    l_ptrs = L + b * sl_b + h * sl_h + n * sl_n
    # The lse are read in their own dtype: float64 ones (``store_lse``) keep the shifts exact; only the
    # differences (<= 0) go to the float32 exponentials.
    la = tl.load(l_ptrs, mask=ok, other=float("-inf"))
    lb = tl.load(LB + b * slb_b + h * slb_h + n * slb_n, mask=ok, other=float("-inf")).to(la.dtype)
    o_ptrs = O + (b * so_b + h * so_h + n * so_n)[:, None] + d[None, :].to(tl.int64) * so_d
    oa = tl.load(o_ptrs, mask=mask, other=0.0).to(tl.float32)
    ob = tl.load(OB + (b * sob_b + h * sob_h + n * sob_n)[:, None] + d[None, :].to(tl.int64) * sob_d,
                 mask=mask, other=0.0).to(tl.float32)
    shift = safe_shift(tl.maximum(la, lb))  # a NaN lse makes its factor, hence its row, NaN
    ca = tl.exp((la - shift).to(tl.float32))
    cb = tl.exp((lb - shift).to(tl.float32))
    s = ca + cb
    hidden = s == 0.0
    denom = tl.where(hidden, 1.0, s)
    fa = (ca / denom)[:, None]
    fb = (cb / denom)[:, None]
    out = tl.where(tl.abs(oa) < float("inf"), fa * oa, oa) + tl.where(tl.abs(ob) < float("inf"), fb * ob, ob)
    out = tl.where(hidden[:, None], 0.0, out)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=mask)
    tl.store(l_ptrs, tl.where(hidden, float("-inf"), shift + tl.log(denom).to(la.dtype)), mask=ok)


def merge_outputs_(out, lse, out_b, lse_b) -> None:
    """Merge the attention result ``(out_b, lse_b)`` of the same queries over other keys into ``(out, lse)``,
    in place (``_merge_outputs_kernel``; ``reference.merge_outputs`` is the same product, out of place):
    ``out [B, H, N, Dv]`` and natural-log ``lse [B, H, N]``, any strides, the pair ``(out, lse)`` written
    once per element and nothing allocated. CUDA tensors, or the CPU under ``TRITON_INTERPRET=1``. A trusted
    launcher: its caller (context parallelism's ring) passes two results of the same queries, whose shapes
    agree and whose lse are float32 or float64 (the arithmetic on the lse is in ``lse``'s dtype; the
    forward's float64 lse, ``store_lse``, keep each merge's weights to float32 accuracy)."""
    B, H, N, Dv = out.shape
    R = B * H * N
    if R == 0:
        return
    block_d = next_pow2(max(Dv, 1))
    block_r = max(1, min(64, 4096 // block_d))
    _merge_outputs_kernel[(cdiv(R, block_r),)](
        out, lse, out_b, lse_b, R, H, N, Dv, *out.stride(), *lse.stride(), *out_b.stride(), *lse_b.stride(),
        BLOCK_R=block_r, BLOCK_D=block_d, num_warps=4)
