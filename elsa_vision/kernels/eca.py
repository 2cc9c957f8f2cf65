"""Exact Causal Attention (ECA): Strassen-style triangular products with ~10% fewer multiply-adds.

Rybin, Zhang, Ding, Lin, Luo, "Exact Causal Attention with 10% Fewer Operations" (arXiv 2510.05175) give
bilinear algorithms for the two matrix products of causal attention whose operand or output is triangular:

* Stage I, the masked product ``S = tril(A @ B^T)`` (``A, B`` of shape ``[L, d]``), and
* Stage II, the triangular product ``O = tril(P) @ V`` (``P`` of shape ``[L, L]``, ``V`` of shape ``[L, d]``).

Split the rows into 4 blocks of ``n = L / 4`` and the feature axis into 4 blocks of ``e = d / 4``, so that
``A_rc`` is block ``(r, c)`` of the 4x4 grid (rows ``r n ... r n + n``, features ``c e ... c e + e``). Stage I
needs the six strictly-lower output blocks ``S_ij = sum_c A_ic B_jc^T`` (``i > j``) and the four diagonal
blocks ``tril(sum_c A_ic B_ic^T)``. Done directly that is 24 *full* block products (``n x e x n``) and 16
*half* products (the lower triangle of an ``n x e x n`` product: half the work, recursively the same
problem). The published scheme computes the same ten blocks from 24 full products ``m1 .. m24`` of sums of
blocks plus only 10 half products (the exact identities are the table ``_STAGE1_*`` below, verified as a
tensor identity by the tests), i.e. 29 instead of 32 full-product equivalents.

Stage II is the same bilinear map with two modes exchanged (``<tril(A B^T), P> = <A, tril(P) B>``), so the
dual algorithm computes ``tril(P) @ V`` with the same 24 full products ``(sum of P blocks) @ (sum of V
blocks)`` and 10 products of a lower-triangular matrix with a dense one.

Recursion (``depth``): the 10 half products of one level are themselves ECA problems of size ``n x e``.
``depth`` counts how many times the half products are expanded again; at the deepest level they are computed
as full products and masked. With ``a = 24/64`` (full products per level, as a fraction of ``L^2 d``) and
``b = 10/64`` (half products per level), the multiply-adds of ``eca_masked_matmul`` and ``eca_tril_matmul``
for ``L`` and ``d`` divisible by ``4 ** (depth + 1)`` are exactly::

    L^2 d * ( a * sum_{t=0..depth} b^t  +  b^(depth+1) )

    depth 0: 34/64            = 0.53125  L^2 d
    depth 1: 0.458008...      ~ 0.458    L^2 d   (8.4% below the ideal triangle 0.5 L^2 d)
    depth 2: 0.446564...      ~ 0.447    L^2 d   (10.7% below)
    depth -> inf: 24/54       = 0.4444   L^2 d

against ``0.5 L^2 d`` for an ideal triangular product and ``L^2 d`` for ``matmul`` followed by ``tril``.
Other shapes are zero-padded at each level to multiples of 4 (rows and features) and cropped.

The algorithms trade multiplications for block additions and materialise ``O(L^2)`` intermediates, so they pay
off only where the matmul FLOPs dominate (large ``d``, CPU/edge devices); a fused kernel such as
FlashAttention on a GPU is out of their reach. ``eca_attention`` is the causal attention built on them: it
materialises the ``L x L`` probability matrix (forward and backward), which is its documented cost.
"""

from __future__ import annotations

import math
import re

import torch
from torch import Tensor

from .precision import accumulation_dtype
from .reference import inputs_finite, scan_attention

__all__ = [
    "eca_masked_matmul",
    "eca_tril_matmul",
    "eca_attention",
    "eca_multiply_adds",
]

# ---------------------------------------------------------------------------------------------------------
# The published 4x4 scheme, written with 0-based block indices: "q13" is A_{1,3} (row block 1, feature
# block 3) of the left operand, "k02" is B_{0,2} of the right operand. Full products m1..m24.
# ---------------------------------------------------------------------------------------------------------
_STAGE1_FULL = (
    ("+q13 +q22", "+k02 -k01 -k03 +k13"),
    ("+q32 +q10", "+k00 -k10 -k11 +k12"),
    ("-q21 +q33 +q23", "+k23 -k01"),
    ("+q30 +q20 -q31", "+k20 -k11"),
    ("-q11 +q32 -q12", "+k01 +k22"),
    ("+q11 +q12 -q22", "+k11 +k22"),
    ("+q11 +q12", "+k22"),
    ("-q31 -q21 +q11 -q32 +q12 +q33 +q23", "+k01"),
    ("+q30 +q20 -q31 -q21 +q11 +q12 -q22", "+k11"),
    ("+q22", "+k01 -k02 +k12 +k22 +k03 -k13"),
    ("+q10", "+k10 +k11 -k12"),
    ("+q13", "+k01 -k02 +k03"),
    ("+q32", "-k00 +k10 +k11 +k02 -k12 +k22"),
    ("+q30 +q20 +q32", "-k00 +k10 +k11"),
    ("+q22 +q33 +q23", "+k01 +k03 -k13"),
    ("+q20 -q33", "+k00 -k13"),
    ("+q21 -q23", "+k23"),
    ("+q30 -q31", "+k20"),
    ("-q32 +q12 +q13", "+k02 -k01"),
    ("+q20", "+k10 +k20 -k13"),
    ("+q20 -q13 +q23", "+k13"),
    ("+q30 -q10 +q33", "+k00"),
    ("+q33", "-k00 +k03 +k23"),
    ("+q31", "+k20 +k01 +k21"),
)
# Half products h1..h10: only the lower triangle is needed (they feed diagonal output blocks only).
_STAGE1_HALF = (
    ("+q00", "+k00"),
    ("+q01", "+k01"),
    ("+q02", "+k02"),
    ("+q03", "+k03"),
    ("+q30", "+k30"),
    ("+q31", "+k31"),
    ("+q32", "+k32"),
    ("+q33", "+k33"),
    ("+q10 +q12 -q22", "-k11 +k12"),
    ("+q21", "+k11 +k21 +k23"),
)
# Output blocks S_ij as signed sums of the products (m = full, h = half); diagonal blocks are masked.
_STAGE1_OUT = {
    (0, 0): "+h1 +h2 +h3 +h4",
    (1, 0): "+m2 -m5 -m7 +m11 +m12 +m13 +m19",
    (1, 1): "+m1 +m6 -m7 +m10 +m11 +m12 +h9",
    (2, 0): "+m1 +m3 +m12 +m15 +m16 +m17 +m21 -m23",
    (2, 1): "+m1 -m4 +m6 -m7 -m9 +m10 +m12 +m18 +m20 +m21",
    (2, 2): "+m4 -m6 +m7 +m9 -m17 -m18 +h10",
    (3, 0): "+m2 -m3 -m5 -m7 -m8 +m11 +m13 -m17 +m22 +m23",
    (3, 1): "+m2 +m4 +m11 +m14 +m16 -m18 -m20 +m22",
    (3, 2): "+m3 +m5 +m7 +m8 +m17 +m18 +m24",
    (3, 3): "+h5 +h6 +h7 +h8",
}
_N_FULL, _N_HALF = len(_STAGE1_FULL), len(_STAGE1_HALF)
# Output blocks in a fixed order: index z of (i, j).
_OUT_BLOCKS = tuple(sorted(_STAGE1_OUT))
_DIAG = tuple(z for z, (i, j) in enumerate(_OUT_BLOCKS) if i == j)

_TERM = re.compile(r"([+-])([qkmh])(\d+)")


def _terms(text: str) -> list[tuple[int, str, int]]:
    """``"+q13 -k02"`` -> ``[(+1, "q", 7), (-1, "k", 2)]`` (grid blocks flattened as ``4 * row + col``)."""
    out = []
    for sign, kind, idx in _TERM.findall(text):
        s = 1 if sign == "+" else -1
        if kind in "qk":
            out.append((s, kind, 4 * int(idx[0]) + int(idx[1])))
        else:
            out.append((s, kind, int(idx) - 1))
    return out


def _coefficients() -> tuple[Tensor, Tensor, Tensor]:
    """The scheme as dense integer matrices: ``alpha [34, 16]`` (left operand blocks per product), ``beta
    [34, 16]`` (right operand blocks), ``gamma [34, 10]`` (product -> output block ``_OUT_BLOCKS[z]``).

    Products ``0..23`` are full, ``24..33`` half. ``sum_r alpha[r,x] beta[r,y] gamma[r,z]`` is 1 exactly when
    ``x = (i, c)``, ``y = (j, c)``, ``z = (i, j)``, ``i >= j`` and 0 otherwise (the tests check this).
    """
    n_prod = _N_FULL + _N_HALF
    alpha = torch.zeros(n_prod, 16, dtype=torch.int64)
    beta = torch.zeros(n_prod, 16, dtype=torch.int64)
    gamma = torch.zeros(n_prod, len(_OUT_BLOCKS), dtype=torch.int64)
    for r, (a_text, b_text) in enumerate(_STAGE1_FULL + _STAGE1_HALF):
        for s, _, x in _terms(a_text):
            alpha[r, x] += s
        for s, _, y in _terms(b_text):
            beta[r, y] += s
    for z, block in enumerate(_OUT_BLOCKS):
        for s, kind, idx in _terms(_STAGE1_OUT[block]):
            gamma[idx if kind == "m" else _N_FULL + idx, z] += s
    return alpha, beta, gamma


class _Combo:
    """A sparse +-1 combination ``dst[p] = sum_t sign_t * src[index_t]``: only block additions, so no
    multiply-add is spent (nor counted) here. Sources are a sequence of equally shaped tensors; destination
    ``p`` is the view ``dst(p)``, written in place (each view is taken just before it is written, which keeps
    autograd's view tracking valid)."""

    def __init__(self, coef: Tensor):  # coef [n_dst, n_src] with entries in {-1, 0, 1}
        if not bool(((coef == 0) | (coef == 1) | (coef == -1)).all()):
            raise ValueError("ECA coefficient tables must hold -1, 0 or 1")
        # Positive terms first, so that a destination starts with a copy rather than a negation.
        self.terms = [
            sorted(((int(i), int(coef[p, i])) for i in coef[p].nonzero().flatten()), key=lambda t: -t[1])
            for p in range(coef.shape[0])
        ]
        self.n_dst = coef.shape[0]

    def into(self, srcs, dst) -> None:
        for p in range(self.n_dst):
            terms, view = self.terms[p], dst(p)
            if not terms:
                view.zero_()
                continue
            first, sign = terms[0]
            view.copy_(srcs[first])
            if sign < 0:
                view.neg_()
            for i, sign in terms[1:]:
                view.add_(srcs[i], alpha=sign)

    def __call__(self, srcs) -> Tensor:
        """``srcs`` (a sequence of ``[...]`` tensors) -> ``[n_dst, ...]``."""
        out = srcs[0].new_empty((self.n_dst,) + tuple(srcs[0].shape))
        self.into(srcs, lambda p: out[p])
        return out


_ALPHA, _BETA, _GAMMA = _coefficients()
_LOWER = [z for z in range(len(_OUT_BLOCKS)) if z not in _DIAG]
_HALF_ONLY_DIAG = bool((_GAMMA[_N_FULL:][:, _LOWER] == 0).all())
if not _HALF_ONLY_DIAG:  # a table typo must never reach a computation
    raise RuntimeError("ECA scheme: a half product feeds a strictly-lower output block")

# Stage I: blocks of A -> full / half left factors, blocks of B -> right factors, products -> outputs.
_S1_FULL_A, _S1_FULL_B = _Combo(_ALPHA[:_N_FULL]), _Combo(_BETA[:_N_FULL])
_S1_HALF_A, _S1_HALF_B = _Combo(_ALPHA[_N_FULL:]), _Combo(_BETA[_N_FULL:])
_S1_OUT = _Combo(_GAMMA.T)
# Stage II (the dual): output blocks of P -> left factors, blocks of V -> right factors, products -> O blocks.
_S2_FULL_P, _S2_HALF_P = _Combo(_GAMMA[:_N_FULL]), _Combo(_GAMMA[_N_FULL:])
_S2_FULL_V, _S2_HALF_V = _S1_FULL_B, _S1_HALF_B
_S2_OUT = _Combo(_ALPHA.T)


def _pad_to(x: Tensor, rows: int, cols: int) -> Tensor:
    pr, pc = rows - x.shape[-2], cols - x.shape[-1]
    if pr == 0 and pc == 0:
        return x
    return torch.nn.functional.pad(x, (0, pc, 0, pr))


def _blocks(x: Tensor, n: int, e: int) -> list[Tensor]:
    """The 16 grid blocks of ``x [B, 4n, 4e]`` as strided views, block ``(r, c)`` at ``4 r + c``."""
    g = x.unflatten(-1, (4, e)).unflatten(-3, (4, n))  # [B, 4, n, 4, e]
    return [g[:, r, :, c, :] for r in range(4) for c in range(4)]


def _masked(a: Tensor, b: Tensor, depth: int) -> Tensor:
    """``tril(a @ b^T)`` for ``a, b [B, L, d]`` by ECA Stage I, ``depth`` further levels on half products."""
    bsz, length, d = a.shape
    lp, dp = 4 * math.ceil(length / 4), 4 * math.ceil(d / 4)
    n, e = lp // 4, dp // 4
    qa, kb = _blocks(_pad_to(a, lp, dp), n, e), _blocks(_pad_to(b, lp, dp), n, e)
    full = torch.matmul(_S1_FULL_A(qa), _S1_FULL_B(kb).transpose(-1, -2))  # [24, B, n, n]
    ha, hb = _S1_HALF_A(qa), _S1_HALF_B(kb)  # [10, B, n, e]
    if depth == 0:
        half = torch.matmul(ha, hb.transpose(-1, -2)).tril_()
    else:
        half = _masked(ha.reshape(_N_HALF * bsz, n, e), hb.reshape(_N_HALF * bsz, n, e), depth - 1)
        half = half.reshape(_N_HALF, bsz, n, n)
    out = a.new_empty(bsz, 4, n, 4, n)
    for i in range(4):
        for j in range(i + 1, 4):
            out[:, i, :, j, :].zero_()
    blocks = list(full.unbind(0)) + list(half.unbind(0))
    _S1_OUT.into(blocks, lambda z: out[:, _OUT_BLOCKS[z][0], :, _OUT_BLOCKS[z][1], :])
    for i in range(4):  # the full products also reach above the diagonal of a diagonal block
        out[:, i, :, i, :].tril_()
    return out.reshape(bsz, lp, lp)[:, :length, :length]


def _tril_mm(p: Tensor, v: Tensor, depth: int) -> Tensor:
    """``tril(p) @ v`` for ``p [B, L, L]``, ``v [B, L, d]`` by ECA Stage II (the dual of Stage I)."""
    bsz, length, d = v.shape
    lp, dp = 4 * math.ceil(length / 4), 4 * math.ceil(d / 4)
    n, e = lp // 4, dp // 4
    pg = _pad_to(p, lp, lp).unflatten(-1, (4, n)).unflatten(-3, (4, n))  # [B, 4, n, 4, n]
    pz = [pg[:, i, :, j, :].tril() if i == j else pg[:, i, :, j, :] for i, j in _OUT_BLOCKS]
    vb = _blocks(_pad_to(v, lp, dp), n, e)
    full = torch.matmul(_S2_FULL_P(pz), _S2_FULL_V(vb))  # [24, B, n, e]
    hp, hv = _S2_HALF_P(pz), _S2_HALF_V(vb)  # lower-triangular [10, B, n, n], dense [10, B, n, e]
    if depth == 0:
        half = torch.matmul(hp, hv)
    else:
        half = _tril_mm(hp.reshape(_N_HALF * bsz, n, n), hv.reshape(_N_HALF * bsz, n, e), depth - 1)
        half = half.reshape(_N_HALF, bsz, n, e)
    out = v.new_empty(bsz, 4, n, 4, e)
    _S2_OUT.into(list(full.unbind(0)) + list(half.unbind(0)), lambda x: out[:, x // 4, :, x % 4, :])
    return out.reshape(bsz, lp, dp)[:, :length, :d]


def _check_depth(depth, fn: str) -> int:
    if isinstance(depth, bool) or not isinstance(depth, int) or depth < 0:
        raise ValueError(f"{fn}: `depth` must be an int >= 0, got {depth!r}")
    return depth


def _check_float(name: str, t, fn: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{fn}: `{name}` must have a floating-point dtype, got {t.dtype}")
    if t.dim() < 2:
        raise ValueError(f"{fn}: `{name}` must have shape [..., L, d] (rank >= 2), got {list(t.shape)}")


def _check_pair(fn: str, depth, x_name: str, x, y_name: str, y) -> int:
    """What both products check first: ``depth``, then two floating tensors of rank >= 2 that share one
    dtype and one device. Returns ``depth``."""
    depth = _check_depth(depth, fn)
    _check_float(x_name, x, fn)
    _check_float(y_name, y, fn)
    if x.dtype != y.dtype:
        raise TypeError(f"{fn}: `{x_name}` and `{y_name}` must share one dtype, got {x_name}={x.dtype}, "
                        f"{y_name}={y.dtype}")
    if x.device != y.device:
        raise ValueError(f"{fn}: `{x_name}` and `{y_name}` must be on one device, got {x_name}={x.device}, "
                         f"{y_name}={y.device}")
    return depth


def _leading_batch(fn: str, x_name: str, x: Tensor, y_name: str, y: Tensor) -> torch.Size:
    """The broadcast of the two operands' leading dims (everything before ``[L, d]``)."""
    try:
        return torch.broadcast_shapes(x.shape[:-2], y.shape[:-2])
    except RuntimeError as err:
        raise ValueError(f"{fn}: leading dims of {x_name}={list(x.shape)} and {y_name}={list(y.shape)} "
                         f"do not broadcast") from err


def _batch(x: Tensor, batch: torch.Size) -> Tensor:
    return x.expand(batch + x.shape[-2:]).reshape((-1,) + tuple(x.shape[-2:]))


def eca_masked_matmul(a: Tensor, b: Tensor, depth: int = 1) -> Tensor:
    """``tril(a @ b^T)`` with ECA Stage I.

    Args:
        a: ``[..., L, d]``.
        b: ``[..., L, d]``; leading dims broadcast against ``a``'s; same dtype and device.
        depth: recursion levels on the half products (``>= 0``); multiply-adds ``~0.458 L^2 d`` at 1,
            ``~0.447 L^2 d`` at 2 (see the module docstring for the exact formula).

    Returns:
        ``[..., L, L]``: the lower triangle (diagonal included) of ``a @ b^T``, zeros above. Any ``L >= 1``,
        ``d >= 1`` and floating dtype; differentiable by autograd.
    """
    fn = "eca_masked_matmul"
    depth = _check_pair(fn, depth, "a", a, "b", b)
    if a.shape[-2:] != b.shape[-2:]:
        raise ValueError(f"{fn}: `a` and `b` must both be [..., L, d] with equal L and d, got "
                         f"a={list(a.shape)}, b={list(b.shape)}")
    length, d = a.shape[-2:]
    if length == 0 or d == 0:
        raise ValueError(f"{fn}: L and d must be >= 1, got a={list(a.shape)}")
    batch = _leading_batch(fn, "a", a, "b", b)
    out = _masked(_batch(a, batch), _batch(b, batch), depth)
    return out.reshape(batch + (length, length))


def eca_tril_matmul(p: Tensor, v: Tensor, depth: int = 1) -> Tensor:
    """``tril(p) @ v`` with ECA Stage II (only the lower triangle of ``p``, diagonal included, is read).

    Args:
        p: ``[..., L, L]``.
        v: ``[..., L, d]``; leading dims broadcast against ``p``'s; same dtype and device.
        depth: recursion levels on the half products, as in :func:`eca_masked_matmul` (same multiply-adds).

    Returns:
        ``[..., L, d]``. Any ``L >= 1``, ``d >= 1`` and floating dtype; differentiable by autograd.
    """
    fn = "eca_tril_matmul"
    depth = _check_pair(fn, depth, "p", p, "v", v)
    length, d = v.shape[-2:]
    if p.shape[-2:] != (length, length):
        raise ValueError(f"{fn}: `p` must be [..., L, L] with L = v.shape[-2] = {length}, "
                         f"got p={list(p.shape)}, v={list(v.shape)}")
    if length == 0 or d == 0:
        raise ValueError(f"{fn}: L and d must be >= 1, got v={list(v.shape)}")
    batch = _leading_batch(fn, "p", p, "v", v)
    out = _tril_mm(_batch(p, batch), _batch(v, batch), depth)
    return out.reshape(batch + (length, d))


def _triu_t_mm(p: Tensor, x: Tensor, depth: int) -> Tensor:
    """``tril(p)^T @ x`` (upper-triangular times dense) as a Stage II product on the reversed index order:
    with ``J`` the reversal, ``tril(p)^T = J tril(J p^T J) J``."""
    return eca_tril_matmul(p.transpose(-1, -2).flip(-2, -1), x.flip(-2), depth).flip(-2)


def eca_multiply_adds(length: int, d: int, depth: int = 1) -> int:
    """Multiply-adds of one ``eca_masked_matmul`` / ``eca_tril_matmul`` of size ``L x d`` (padding included):
    ``24 n^2 e`` full products per level plus the 10 half products, recursively; at the deepest level the
    half products are ``n x e x n`` full products."""
    depth = _check_depth(depth, "eca_multiply_adds")
    lp, dp = 4 * math.ceil(length / 4), 4 * math.ceil(d / 4)
    n, e = lp // 4, dp // 4
    half = _N_HALF * (n * n * e if depth == 0 else eca_multiply_adds(n, e, depth - 1))
    return _N_FULL * n * n * e + half


# ---------------------------------------------------------------------------------------------------------
# Causal attention on ECA.
# ---------------------------------------------------------------------------------------------------------
def _causal_softmax(scores: Tensor) -> Tensor:
    """Row softmax of ``scores`` (``-inf`` above the diagonal already); rows with no finite score -> 0."""
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(scores - m)
    s = e.sum(dim=-1, keepdim=True)
    return e / torch.where(s > 0, s, torch.ones_like(s))


class _EcaAttention(torch.autograd.Function):
    """Causal attention ``O = tril(P) V`` with ``P = softmax(tril(Q K^T) * scale + bias)``; every matmul of
    the forward and backward pass is an ECA product. Saves ``P`` (``[..., L, L]``)."""

    @staticmethod
    def forward(ctx, q, k, v, bias, scale, depth):
        length = q.shape[-2]
        upper = torch.ones(length, length, dtype=torch.bool, device=q.device).triu_(1)
        scores = eca_masked_matmul(q, k, depth) * scale
        if bias is not None:
            scores = scores + bias.to(scores.dtype)
        p = _causal_softmax(scores.masked_fill(upper, -math.inf))
        # Rows (queries) and columns (keys) that carry no probability have exactly zero output and gradients;
        # the block sums of ECA would leave rounding residue there, so they are zeroed explicitly.
        live = p != 0
        rows, cols = live.any(dim=-1, keepdim=True), live.any(dim=-2).unsqueeze(-1)
        out = eca_tril_matmul(p, v, depth) * rows
        ctx.save_for_backward(q, k, v, p, out, rows, cols)
        ctx.scale, ctx.depth = scale, depth
        ctx.bias_shape = None if bias is None else bias.shape
        ctx.bias_dtype = None if bias is None else bias.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, p, out, rows, cols = ctx.saved_tensors
        depth, scale = ctx.depth, ctx.scale
        dout = dout.to(out.dtype) * rows
        dv = _triu_t_mm(p, dout, depth) * cols if ctx.needs_input_grad[2] else None
        dp = eca_masked_matmul(dout, v, depth)  # only the lower triangle is needed: P is zero above it
        delta = (dout * out).sum(dim=-1, keepdim=True)  # = rowsum(P * dP)
        ds = p * (dp - delta)  # lower triangular: p vanishes above the diagonal
        dq = eca_tril_matmul(ds, k, depth) * (rows * scale) if ctx.needs_input_grad[0] else None
        dk = _triu_t_mm(ds, q, depth) * (cols * scale) if ctx.needs_input_grad[1] else None
        dbias = None
        if ctx.bias_shape is not None and ctx.needs_input_grad[3]:
            dbias = ds.sum_to_size(ctx.bias_shape).to(ctx.bias_dtype)
        return dq, dk, dv, dbias, None, None


def eca_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    scale: float | None = None,
    depth: int = 1,
) -> Tensor:
    """Causal softmax attention whose four kinds of matmul (``QK^T``, ``PV`` and the backward's ``dO V^T``,
    ``dS K``, ``dS^T Q``, ``P^T dO``) all run as ECA products.

    Args:
        q, k: ``[B, H, L, D]``; v: ``[B, H, L, Dv]`` (self-attention: ``Nq == Nk == L``), one float dtype.
        attn_bias: float tensor broadcastable to ``[B, H, L, L]``, added after scaling; differentiable.
        key_padding_mask: bool ``[B, L]`` (True = the key takes part).
        scale: logit scale, default ``D ** -0.5``.
        depth: ECA recursion depth (see :func:`eca_masked_matmul`).

    Query ``i`` sees key ``j`` iff ``j <= i``; rows with no visible key return 0. Half-precision inputs are
    computed in float32 and cast back. Materialises ``[B, H, L, L]`` scores and probabilities (saved for the
    backward): meant for CPU/edge devices where FLOPs, not memory, are the bottleneck.

    Non-finite inputs follow the rule of ``reference.py`` (a hidden key contributes nothing whatever it
    holds; a visible key's NaN logit makes its row NaN, its non-finite values reach their own columns). ECA's
    block sums would mix a NaN or an infinity into rows and keys that never see it (``inf - inf``), so a call
    whose ``q``, ``k``, ``v`` or bias hold one (other than ``-inf`` in the bias) runs the reference scan
    instead (``reference.inputs_finite``: one host check per call).
    """
    if q.shape[-2] != k.shape[-2]:
        raise ValueError(
            f"eca_attention: causal ECA needs Nq == Nk, got q {list(q.shape)}, k {list(k.shape)}")
    depth = _check_depth(depth, "eca_attention")
    dtype = q.dtype
    compute = accumulation_dtype(q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not inputs_finite(q, k, v, attn_bias):
        out = scan_attention(q.to(compute), k.to(compute), v.to(compute), attn_bias=attn_bias,
                             key_padding_mask=key_padding_mask, causal=True, scale=scale)
        return out.to(dtype)
    bias = attn_bias
    if key_padding_mask is not None:
        hide = torch.zeros(key_padding_mask.shape, dtype=compute, device=q.device)
        hide = hide.masked_fill(~key_padding_mask, -math.inf)[:, None, None, :]
        bias = hide if bias is None else bias.to(compute) + hide
    out = _EcaAttention.apply(q.to(compute), k.to(compute), v.to(compute), bias, scale, depth)
    return out.to(dtype)
