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
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["safe_shift", "merge_states", "fold_tile", "matmul"]


@triton.jit
def safe_shift(m):
    """The shift used for a row whose maximum is ``m``: ``m``, or 0 where ``m == -inf``."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def matmul(a, b, acc, PRECISION: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation.

    ``PRECISION`` is ``"ieee"``, ``"tf32x3"`` or ``"tf32"`` for float32 operands and ``"none"`` for
    float16/bfloat16 operands (tensor cores, fp32 accumulate). ``"upcast"`` multiplies half operands as
    float32 (exact products, fp32 accumulate: the tensor-core result) where no half dot is available (the
    CPU interpreter has none for bfloat16).
    """
    if PRECISION == "none":
        return tl.dot(a, b, acc)
    elif PRECISION == "upcast":
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PRECISION)


@triton.jit
def merge_states(ma, sa, wa, mb, sb, wb):
    """``(ma, sa, wa) (+) (mb, sb, wb)``; exact for the identity on either side.

    Shapes: ``m`` and ``S`` broadcast against ``W`` (e.g. ``[BM, 1, n]`` against ``[BM, Dv, n]``); the
    level-two kernel applies it pairwise, level by level, as a log-depth merge tree.
    """
    m = tl.maximum(ma, mb)
    shift = safe_shift(m)
    ca = tl.math.exp2(ma - shift)
    cb = tl.math.exp2(mb - shift)
    return m, ca * sa + cb * sb, ca * wa + cb * wb


@triton.jit
def fold_tile(m, s, w, scores, v, PRECISION: tl.constexpr):
    """Fold one score tile into the running state: ``(m, S, W) (+) state(scores, v)``.

    Args:
        m, s: ``[BLOCK_M]`` float32 running max (base 2) and normaliser.
        w: ``[BLOCK_M, BLOCK_DV]`` float32 running weighted value sum.
        scores: ``[BLOCK_M, BLOCK_N]`` float32 base-2 logits, ``-inf`` for invisible keys.
        v: ``[BLOCK_N, BLOCK_DV]`` values (rows of invisible keys already zeroed, never NaN).
    """
    m_new = tl.maximum(m, tl.max(scores, 1))
    shift = safe_shift(m_new)
    alpha = tl.math.exp2(m - shift)
    p = tl.math.exp2(scores - shift[:, None])
    s = s * alpha + tl.sum(p, 1)
    if PRECISION == "ieee":
        # FMA dots add each product straight into the accumulator: sum the tile first, then add it, so the
        # running sum takes one rounding per tile instead of one per key.
        w = w * alpha[:, None] + matmul(p, v, tl.zeros_like(w), PRECISION)
    else:
        w = matmul(p.to(v.dtype), v, w * alpha[:, None], PRECISION)
    return m_new, s, w
