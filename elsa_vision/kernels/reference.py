"""The ELSA monoid and a two-level scan in plain PyTorch: the executable specification.

ELSA ("Exact Linear-Scan Attention", arXiv 2604.23798) writes softmax attention for one query row as a
fold over the keys with the associative monoid of states ``(m, S, W)``:

* ``m`` -- the running maximum logit,
* ``S`` -- the sum of ``exp(score - m)`` over the keys seen so far,
* ``W`` -- the value sum weighted by the same ``exp(score - m)``.

The merge ``a (+) b`` rescales both sides to the common maximum ``m = max(a.m, b.m)``::

    S = exp(a.m - m) * a.S + exp(b.m - m) * b.S
    W = exp(a.m - m) * a.W + exp(b.m - m) * b.W

with identity ``e = (-inf, 0, 0)``; the output row is ``W / S`` (0 where ``S == 0``, i.e. where no key is
visible). Because ``(+)`` is associative, any bracketing of any split of a row gives the same result up to
rounding, which is what lets the scan run in parallel: key blocks of ``B`` tokens are folded into states
(level one), then the block states are combined by a log-depth tree (level two).

Non-finite inputs follow one rule, which every backend implements:

* A key is *hidden* from a row when the row's logit for it is ``-inf``: masked by causality, by
  ``key_padding_mask``, by a ``-inf`` bias (which hides the key whatever ``q . k`` is, NaN included) or a
  ``-inf`` product. A hidden key contributes nothing to the row, neither to its output nor to any gradient,
  whatever its key and value rows hold (NaN and infinities included): its weight is an exact 0 that never
  meets them in a product (``0 * NaN`` would be NaN).
* A visible key keeps IEEE semantics. A NaN logit makes the row NaN, and so does a ``+inf`` logit (as
  ``softmax``: ``exp(inf - inf)``). A non-finite entry in column ``c`` of a visible key's value reaches
  column ``c`` of the row's output, and only that column, as in ``softmax(S) @ V``: NaN for a NaN, the
  infinity for infinities of one sign, NaN where both signs meet. The finite values are averaged as usual.

In the monoid the non-finite values sit in ``W`` (``block_state``), and ``merge_states`` carries non-finite
entries of ``W`` unscaled (a rescale by ``exp(-huge) = 0`` would turn an infinity into NaN), so the rule holds
however the keys are split into blocks.

Every other backend of this package (the Triton kernels, the window and decode kernels, context parallel
attention) is tested against the functions in this file. Everything here is differentiable by autograd.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import torch
from torch import Tensor

from .precision import accumulation_dtype

__all__ = [
    "ElsaState",
    "block_state",
    "merge_states",
    "identity_state",
    "finalize",
    "log_sum_exp",
    "merge_depth",
    "attention_scores",
    "scan_attention",
    "softmax_attention",
    "state_from_output",
    "merge_outputs",
    "attention_backward",
    "attention_bias_grad",
    "inputs_finite",
]


def _without_autocast(fn):
    """``fn`` with autocast off on CPU and CUDA: the reference computes in its inputs' dtype, and autocast
    would run its products (``@``) in half precision (and hand its custom functions' backward half-precision
    gradients against float32 operands)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if not (torch.is_autocast_enabled("cpu") or torch.is_autocast_enabled("cuda")):
            return fn(*args, **kwargs)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(*args, **kwargs)

    return wrapper


class ElsaState(NamedTuple):
    """A monoid element for a batch of query rows.

    ``m``: running max logit ``[..., Nq]``; ``s``: sum of ``exp(score - m)`` ``[..., Nq]``;
    ``w``: the same-weighted value sum ``[..., Nq, Dv]``.
    """

    m: Tensor
    s: Tensor
    w: Tensor


def _finite_or_zero(m: Tensor) -> Tensor:
    # Rows whose max is -inf (nothing visible) use 0 as the shift: exp(-inf - 0) = 0, never NaN.
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _finite_part(x: Tensor) -> Tensor:
    """``x`` with its NaN and infinite entries replaced by 0 (gradient 0 there)."""
    return torch.where(torch.isfinite(x), x, torch.zeros_like(x))


def _nonfinite_sum(visible: Tensor, v: Tensor) -> Tensor:
    """``[..., Nq, Dv]``: per row and value column, the IEEE sum of the non-finite entries of the values of
    the keys ``visible [..., Nq, n]`` marks: 0 where there is none, ``+-inf`` where all are infinities of one
    sign, NaN where one is NaN or both signs meet. Two products of 0/1 matrices (whose sums only need to be
    told from 0, so any matmul precision is exact here); a hidden key's entries never enter a product."""
    nan = torch.isnan(v)
    vis = visible.to(v.dtype)
    pos = (vis @ ((v == math.inf) | nan).to(v.dtype)) > 0
    neg = (vis @ ((v == -math.inf) | nan).to(v.dtype)) > 0
    out = torch.where(pos, math.inf, 0.0).to(v.dtype)
    out = torch.where(neg, -math.inf, out)
    return torch.where(pos & neg, math.nan, out)


def inputs_finite(q: Tensor, k: Tensor, v: Tensor, attn_bias: Tensor | None) -> bool:
    """Whether ``q``, ``k``, ``v`` are finite and ``attn_bias`` holds no NaN or ``+inf``: then every logit is
    finite or a mask's ``-inf`` and every value finite, so the plain products (a hidden key's exact 0 weight
    times a finite value) already follow the rule. One host synchronisation; while compiling or capturing a
    CUDA graph the check is skipped and the rule applied in full (False)."""
    if torch.compiler.is_compiling() or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    # One reduction pass per tensor: a NaN or an infinity makes its sum non-finite (so does an overflowing
    # sum of huge finite entries, which only costs the exact path); the bias may hold -inf but not +inf.
    sums = [t.sum().double() for t in (q, k, v) if t.numel()]
    if attn_bias is not None and attn_bias.numel():
        sums.append(torch.clamp(attn_bias.max().double(), min=0.0))
    return not sums or bool(torch.isfinite(torch.stack(sums)).all())


class _Logits(torch.autograd.Function):
    """``q @ k^T`` (IEEE, non-finite entries included) whose gradients take the finite parts of the operands:
    ``dq = dS @ finite(k)``, ``dk = dS^T @ finite(q)``. A hidden pair has ``dS = 0``, and ``0 * NaN`` of a
    hidden key's (or a row's) non-finite entry must not reach the gradient of the other side; a visible
    non-finite entry needs no product to propagate (its logit already makes the row's ``dS`` NaN, or 0 for a
    ``-inf`` logit). The backward is made of differentiable operations (double backward works)."""

    @staticmethod
    def forward(ctx, q, k):
        ctx.save_for_backward(q, k)
        return q @ k.transpose(-2, -1)

    @staticmethod
    def backward(ctx, grad):
        q, k = ctx.saved_tensors
        dq = grad @ _finite_part(k) if ctx.needs_input_grad[0] else None
        dk = grad.transpose(-2, -1) @ _finite_part(q) if ctx.needs_input_grad[1] else None
        return dq, dk


class _WeightedValues(torch.autograd.Function):
    """``p @ finite(v) + _nonfinite_sum(visible, v)``: the values weighted over the visible pairs only.

    The backward leaves the hidden pairs out as well: ``dv = p^T dW`` over the visible pairs (a row whose
    ``dW`` is NaN, because it sees a NaN logit, never reaches the keys hidden from it through a zero weight),
    ``dp = dW finite(v)^T``. Made of differentiable operations (double backward works)."""

    @staticmethod
    def forward(ctx, p, v, visible):
        ctx.save_for_backward(p, v, visible)
        return p @ _finite_part(v) + _nonfinite_sum(visible, v)

    @staticmethod
    def backward(ctx, grad):
        p, v, visible = ctx.saved_tensors
        dp = grad @ _finite_part(v).transpose(-2, -1) if ctx.needs_input_grad[0] else None
        dv = None
        if ctx.needs_input_grad[1]:
            dv = (p.transpose(-2, -1) @ _finite_part(grad)
                  + _nonfinite_sum(visible.transpose(-2, -1), grad)).sum_to_size(v.shape)
        return dp, dv, None


def identity_state(like: ElsaState | Tensor, dv: int | None = None) -> ElsaState:
    """The identity ``(-inf, 0, 0)``.

    ``like`` is either a state (the identity gets its shapes, dtype and device) or a tensor of row shape
    ``[..., Nq]`` together with ``dv``, the value head dim.
    """
    if isinstance(like, ElsaState):
        m, w = like.m, like.w
        return ElsaState(torch.full_like(m, -math.inf), torch.zeros_like(like.s), torch.zeros_like(w))
    if dv is None:
        raise ValueError("identity_state(tensor, dv): dv (the value head dim) is required when `like` is a "
                         "tensor")
    m = torch.full_like(like, -math.inf)
    return ElsaState(m, torch.zeros_like(like), like.new_zeros(*like.shape, dv))


def block_state(scores: Tensor, v: Tensor, keep: Tensor | None = None) -> ElsaState:
    """Fold one key block into a state.

    Args:
        scores: already scaled and biased logits ``[..., Nq, n]``; ``-inf`` marks an invisible key.
        v: values ``[..., n, Dv]`` (broadcastable against ``scores``' leading dims).
        keep: optional multiplier ``[..., Nq, n]`` applied to the weights of ``W`` only (attention dropout:
            ``S`` keeps the undropped normaliser, so ``W / S`` equals ``dropout(softmax) @ v``; a dropped key
            contributes nothing to ``W``, as a hidden one).

    A block with every score ``-inf`` returns the identity exactly. ``W`` is the weighted sum of the finite
    values plus, where visible keys hold non-finite values, their IEEE sum (``_nonfinite_sum``): a key whose
    score is ``-inf`` contributes nothing, whatever its value holds (see the module docstring).
    """
    return _block_state(scores, v, keep, exact=True)


def _block_state(scores: Tensor, v: Tensor, keep: Tensor | None, exact: bool) -> ElsaState:
    """``block_state``; ``exact=False`` is the caller's promise that every value and logit is finite or a
    mask's ``-inf`` (``inputs_finite``): the plain product ``P V`` then already follows the rule."""
    m = scores.amax(dim=-1).detach()  # the output is shift invariant: no gradient flows through m
    p = torch.exp(scores - _finite_or_zero(m).unsqueeze(-1))
    s = p.sum(dim=-1)
    if keep is not None:
        p = p * keep
    if not exact:
        return ElsaState(m, s, p.to(v.dtype) @ v)
    visible = scores != -math.inf  # a NaN score is visible: the row is NaN
    if keep is not None:
        visible = visible & (keep != 0)
    return ElsaState(m, s, _WeightedValues.apply(p.to(v.dtype), v, visible))


def merge_states(a: ElsaState, b: ElsaState) -> ElsaState:
    """``a (+) b`` in the symmetric max form; exact for the identity on either side.

    Non-finite entries of ``W`` (visible non-finite values, see ``block_state``) are carried unscaled: the
    factor of the side with the lower maximum may underflow to 0, and ``0 * inf`` would turn an infinity
    into NaN."""
    return _merge(a, b, exact=True)


def _merge(a: ElsaState, b: ElsaState, exact: bool) -> ElsaState:
    """``merge_states``; ``exact=False`` skips the carry (states whose ``W`` is finite or NaN)."""
    m = torch.maximum(a.m, b.m)
    shift = _finite_or_zero(m)
    ca = torch.exp(a.m - shift)
    cb = torch.exp(b.m - shift)
    # one new [..., Nq, Dv] tensor (the product, then b's term added in place), not three
    w = (ca.unsqueeze(-1) * a.w).addcmul_(cb.unsqueeze(-1), b.w)
    if exact:
        # A factor that underflowed to 0 (its side's maximum far below the other's) made 0 * inf = NaN of an
        # infinity: there the sum is that of the two sides' non-finite entries (a row whose S is NaN is NaN
        # whatever its W holds).
        lost = torch.isnan(w) & ((ca == 0) | (cb == 0)).unsqueeze(-1)
        w = torch.where(lost, (a.w - _finite_part(a.w)) + (b.w - _finite_part(b.w)), w)
    return ElsaState(m, ca * a.s + cb * b.s, w)


def finalize(state: ElsaState) -> Tensor:
    """``W / S`` with 0 where ``S == 0`` (rows with no visible key, never NaN there). Non-finite entries of a
    row's state stay non-finite, as in softmax: a NaN logit of a visible key makes the row NaN, a visible
    non-finite value its own column (see the module docstring)."""
    hidden = state.s == 0
    out = state.w / torch.where(hidden, 1.0, state.s).unsqueeze(-1)  # one new [..., Nq, Dv] tensor
    return out.masked_fill_(hidden.unsqueeze(-1), 0.0)


def log_sum_exp(state: ElsaState) -> Tensor:
    """Per-row ``log(sum_j exp(score_j)) = m + log(S)``; ``-inf`` for rows with no visible key."""
    hidden = state.s == 0
    return torch.where(hidden, torch.full_like(state.s, -math.inf),
                       state.m + torch.log(torch.where(hidden, torch.ones_like(state.s), state.s)))


def merge_depth(n: int, block: int) -> int:
    """L(n, B) = ceil(log2(ceil(n / B))): levels of the merge tree over the key blocks."""
    if n <= 0 or block <= 0:
        raise ValueError(f"merge_depth needs n > 0 and block > 0, got n={n}, block={block}")
    nb = -(-n // block)
    return max(0, math.ceil(math.log2(nb)))


def attention_scores(
    q: Tensor,
    k: Tensor,
    *,
    scale: float,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    q_offset: int = 0,
) -> Tensor:
    """Scaled, biased, masked logits ``[B, H, nq, Nk]`` for queries ``q`` (rows ``q_offset...``).

    ``attn_bias`` must already be sliced to the same query rows; ``causal`` is bottom-right aligned:
    query ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq_total)`` where the caller folds the offset into
    ``q_offset`` (``q_offset = row0 + Nk - Nq``).

    Every masked entry is ``-inf`` whatever ``q . k`` is: a ``-inf`` bias hides its key even where the
    product is NaN (a non-finite key or query row), and the gradients of the product never multiply a hidden
    pair's zero by a non-finite entry (``_Logits``).
    """
    scores = _Logits.apply(q, k) * scale
    if attn_bias is not None:
        bias = attn_bias.to(scores.dtype)
        scores = torch.where(bias == -math.inf, -math.inf, scores + bias)
    if key_padding_mask is not None:
        scores = scores.masked_fill(~key_padding_mask[:, None, None, :], -math.inf)
    if causal:
        nq, nk = scores.shape[-2], scores.shape[-1]
        rows = torch.arange(nq, device=scores.device).unsqueeze(-1) + q_offset
        cols = torch.arange(nk, device=scores.device).unsqueeze(0)
        scores = scores.masked_fill(cols > rows, -math.inf)
    return scores


def _tree_reduce(states: ElsaState, exact: bool = True) -> ElsaState:
    """Blelloch up-sweep over the leading block axis: ceil(log2 nb) levels of pairwise merges (``exact``:
    see ``_merge``)."""
    while states.m.shape[0] > 1:
        if states.m.shape[0] % 2:
            states = ElsaState(*(torch.cat([t, e]) for t, e in zip(states, identity_state(
                ElsaState(*(t[:1] for t in states))))))
        left = ElsaState(*(t[0::2] for t in states))
        right = ElsaState(*(t[1::2] for t in states))
        states = _merge(left, right, exact)
    return ElsaState(*(t[0] for t in states))


def _exclusive_scan(states: ElsaState, exact: bool = True) -> ElsaState:
    """Blelloch exclusive prefix scan over the leading block axis (up-sweep, then down-sweep).

    Returns ``E_j = b_0 (+) ... (+) b_{j-1}`` (``E_0 = e``), the prefix every causal query tile merges with
    its own diagonal block (``exact``: see ``_merge``).
    """
    nb = states.m.shape[0]
    size = 1 << max(0, math.ceil(math.log2(nb)))
    if size > nb:
        pad = identity_state(ElsaState(*(t[:1] for t in states)))
        states = ElsaState(*(torch.cat([t] + [p] * (size - nb)) for t, p in zip(states, pad)))
    tree = [list(t.unbind(0)) for t in states]  # per component, a list of per-block tensors

    def get(i: int) -> ElsaState:
        return ElsaState(tree[0][i], tree[1][i], tree[2][i])

    def put(i: int, st: ElsaState) -> None:
        for c in range(3):
            tree[c][i] = st[c]

    step = 1
    while step < size:  # up-sweep
        for i in range(2 * step - 1, size, 2 * step):
            put(i, _merge(get(i - step), get(i), exact))
        step *= 2
    put(size - 1, identity_state(get(size - 1)))
    step = size // 2
    while step >= 1:  # down-sweep
        for i in range(2 * step - 1, size, 2 * step):
            left = get(i - step)
            put(i - step, get(i))
            put(i, _merge(get(i), left, exact))
        step //= 2
    return ElsaState(*(torch.stack(c[:nb]) for c in tree))


@_without_autocast
def scan_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    block_size: int = 64,
    query_chunk: int | None = None,
    dropout_p: float = 0.0,
    generator: torch.Generator | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Softmax attention as the ELSA two-level scan, in PyTorch.

    Layout as SDPA: ``q [B, H, Nq, D]``, ``k [B, H, Nk, D]``, ``v [B, H, Nk, Dv]``; ``attn_bias``
    broadcastable to ``[B, H, Nq, Nk]``; ``key_padding_mask`` bool ``[B, Nk]`` (True = key takes part).

    Level one folds each block of ``block_size`` keys into a state per query row; level two combines the
    block states with a log-depth tree (non-causal) or, for ``causal``, an exclusive prefix scan over the key
    blocks whose entry at a row's diagonal block is merged with that block. Queries are processed in chunks
    of ``query_chunk`` rows (default: all), bounding the memory at ``O(query_chunk * Nk)``.

    Arithmetic runs in the inputs' dtype (float32 or float64); callers upcast half precision first. A key
    hidden from a row (padding mask, causality, a ``-inf`` bias) contributes nothing to it, whatever its key
    and value rows hold, NaN and infinities included, in the output and in every gradient; a visible key's
    NaN logit makes the row NaN and its non-finite values reach their own columns (the rule of the module
    docstring).
    Returns the output ``[B, H, Nq, Dv]`` (and the per-row log-sum-exp ``[B, H, Nq]`` with ``return_lse``).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    B, H, Nq, D = q.shape
    Nk = k.shape[-2]
    scale = D ** -0.5 if scale is None else scale
    chunk = Nq if query_chunk is None else max(1, int(query_chunk))
    nb = max(1, -(-Nk // block_size))
    pad = nb * block_size - Nk
    # Finite inputs (the usual case) cannot break the rule: the plain product and merges are then exact.
    exact = not inputs_finite(q, k, v, attn_bias)
    if key_padding_mask is not None:
        v = v.masked_fill(~key_padding_mask[:, None, :, None], 0.0)
    # Values padded with zeros: a padded key has score -inf, so it contributes exp(-inf) * 0 = 0.
    v_blocks = torch.nn.functional.pad(v, (0, 0, 0, pad)).unflatten(-2, (nb, block_size)).movedim(-3, 0)
    if attn_bias is not None:
        attn_bias = attn_bias.expand(attn_bias.shape[:-2] + (Nq, Nk)) if attn_bias.dim() >= 2 else attn_bias

    outs, lses = [], []
    for r0 in range(0, Nq, chunk):
        r1 = min(Nq, r0 + chunk)
        bias = None
        if attn_bias is not None:
            bias = attn_bias[..., r0:r1, :] if attn_bias.dim() >= 2 else attn_bias
        scores = attention_scores(
            q[..., r0:r1, :], k, scale=scale, attn_bias=bias, key_padding_mask=key_padding_mask,
            causal=causal, q_offset=r0 + Nk - Nq,
        )
        keep = None
        if dropout_p > 0.0:
            keep = torch.bernoulli(torch.full_like(scores, 1.0 - dropout_p), generator=generator)
            keep = keep / (1.0 - dropout_p)
            keep = torch.nn.functional.pad(keep, (0, pad)).unflatten(-1, (nb, block_size)).movedim(-2, 0)
        scores = torch.nn.functional.pad(scores, (0, pad), value=-math.inf)
        blocks = scores.unflatten(-1, (nb, block_size)).movedim(-2, 0)  # [nb, B, H, rows, block]
        states = _block_state(blocks, v_blocks, keep, exact)
        if causal:
            prefix = _exclusive_scan(states, exact)
            inclusive = _merge(prefix, states, exact)
            # The diagonal block of row i holds its last visible key; later blocks are fully masked.
            last = torch.arange(r0, r1, device=q.device) + (Nk - Nq)
            diag = (last.clamp(min=0) // block_size).clamp(max=nb - 1)
            rows = torch.arange(r1 - r0, device=q.device)
            st = ElsaState(
                inclusive.m[diag, :, :, rows].movedim(0, -1),
                inclusive.s[diag, :, :, rows].movedim(0, -1),
                inclusive.w[diag, :, :, rows, :].movedim(0, -2),
            )
        else:
            st = _tree_reduce(states, exact)
        outs.append(finalize(st))
        if return_lse:
            lses.append(log_sum_exp(st))
    out = torch.cat(outs, dim=-2) if len(outs) > 1 else outs[0]
    if return_lse:
        return out, (torch.cat(lses, dim=-1) if len(lses) > 1 else lses[0])
    return out


def state_from_output(out: Tensor, lse: Tensor) -> ElsaState:
    """The state ``(lse, 1, out)`` (or the identity where ``lse = -inf``) that finalizes to ``out``.

    Partial attention results over disjoint key sets, each given as (output, log-sum-exp), merge exactly
    through :func:`merge_states` once written in this form (split-KV and ring attention do this).
    """
    visible = lse != -math.inf  # NaN stays visible: it propagates
    w = torch.where(visible.unsqueeze(-1), out, 0.0)
    return ElsaState(lse, visible.to(out.dtype), w)


def merge_outputs(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor) -> tuple[Tensor, Tensor]:
    """``(out, lse)`` of attention over two disjoint key sets from each set's ``(out, lse)``: the states
    (:func:`state_from_output`) merged and finalized. ``kernels.monoid.merge_outputs_`` is the same product in
    place."""
    state = merge_states(state_from_output(out_a, lse_a), state_from_output(out_b, lse_b))
    return finalize(state), log_sum_exp(state)


@_without_autocast
def attention_backward(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    *,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    q_offset: int | None = None,
    delta: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """Gradients of attention from the saved per-row log-sum-exp (the backward kernels' specification).

    ``P = exp(S - lse)`` is recomputed from the scores, then ``Delta = rowsum(O * dO)``,
    ``dV = P^T dO``, ``dS = P * (dO V^T - Delta)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.
    A hidden pair (score ``-inf``) has ``P = dS = 0`` exactly, and ``dQ``, ``dK`` multiply ``dS`` by the
    finite parts of ``K``, ``Q`` only: a hidden key's non-finite key or value row (or a non-finite query row
    it is hidden from) never reaches a gradient. A visible non-finite value makes its row's ``Delta`` and so
    its ``dS`` NaN; a visible non-finite key entry does so through the row's NaN ``lse``.
    ``out``/``lse`` may describe attention over a *superset* of the keys ``k`` (ring attention passes the
    global output and log-sum-exp with one key shard): the results are then that shard's contributions.
    Rows with ``lse = -inf`` get zero gradients. Returns ``(dq, dk, dv, dS)``; ``dS`` is the bias gradient
    before reducing over broadcast dims (``None`` when no bias is given).
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    Nq, Nk = q.shape[-2], k.shape[-2]
    offset = Nk - Nq if q_offset is None else q_offset
    scores = attention_scores(q, k, scale=scale, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                              causal=causal, q_offset=offset)
    p, ds = _probs_and_score_grads(scores, do, v, out, lse, delta)
    dv = p.transpose(-2, -1) @ do
    dq = (ds @ _finite_part(k)) * scale
    dk = (ds.transpose(-2, -1) @ _finite_part(q)) * scale
    return dq, dk, dv, (ds if attn_bias is not None else None)


def _probs_and_score_grads(scores, do, v, out, lse, delta):
    """``P = exp(S - lse)`` and ``dS = P * (dO V^T - Delta)``, both exactly 0 for a hidden pair (score
    ``-inf``) and on rows with ``lse = -inf``: a NaN ``dP`` (a hidden key's NaN value) or ``lse`` (a row that
    sees a NaN) never reaches them through a zero weight."""
    hidden = scores == -math.inf
    p = torch.exp(scores - torch.where(lse == -math.inf, torch.zeros_like(lse), lse).unsqueeze(-1))
    p = torch.where(hidden | (lse == -math.inf).unsqueeze(-1), torch.zeros_like(p), p)  # a NaN lse stays NaN
    if delta is None:
        delta = (out * do).sum(-1)
    ds = p * (do @ v.transpose(-2, -1) - delta.unsqueeze(-1))
    return p, torch.where(p == 0, torch.zeros_like(ds), ds)


@_without_autocast
def attention_bias_grad(
    do: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    attn_bias: Tensor,
    *,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    max_elements: int = 1 << 26,
) -> Tensor:
    """``dBias = dS`` reduced over the broadcast dims of ``attn_bias``, in ``attn_bias``'s shape and dtype.

    Recomputed from the saved ``lse`` in chunks of query rows, so at most ``max_elements`` scores exist at
    a time (never the whole ``[B, H, Nq, Nk]`` for long sequences). Arithmetic in float32 (float64 inputs
    stay float64).
    """
    B, H, Nq, _ = q.shape
    Nk = k.shape[-2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    acc = accumulation_dtype(q)
    q, k, v, do, out, lse = (t.to(acc) for t in (q, k, v, do, out, lse))
    shape4 = (1,) * (4 - attn_bias.dim()) + tuple(attn_bias.shape)
    bias4 = attn_bias.reshape(shape4)
    full = (B, H, Nq, Nk)
    reduce_dims = [i for i in range(4) if shape4[i] == 1 and full[i] != 1]
    delta = (out * do).sum(-1)
    chunk = max(1, max_elements // max(1, B * H * Nk))
    pieces = []
    for r0 in range(0, Nq, chunk):
        r1 = min(Nq, r0 + chunk)
        bias = bias4 if shape4[2] == 1 else bias4[..., r0:r1, :]
        scores = attention_scores(q[..., r0:r1, :], k, scale=scale, attn_bias=bias.expand(B, H, r1 - r0, Nk),
                                  key_padding_mask=key_padding_mask, causal=causal, q_offset=r0 + Nk - Nq)
        _, ds = _probs_and_score_grads(scores, do[..., r0:r1, :], v, out[..., r0:r1, :], lse[..., r0:r1],
                                       delta[..., r0:r1])
        pieces.append(ds.sum(dim=reduce_dims, keepdim=True) if reduce_dims else ds)
    if shape4[2] == 1:
        grad = torch.stack(pieces).sum(0)
    else:
        grad = torch.cat(pieces, dim=2)
    return grad.reshape(attn_bias.shape).to(attn_bias.dtype)


@_without_autocast
def softmax_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
) -> Tensor:
    """The textbook ``softmax(S) @ V`` (materialises all scores) with the same conventions: the oracle.

    Rows with no visible key return 0. Used by the tests, in float64, as ground truth.
    """
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    Nq, Nk = q.shape[-2], k.shape[-2]
    scores = attention_scores(q, k, scale=scale, attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                              causal=causal, q_offset=Nk - Nq)
    visible = (scores != -math.inf).any(dim=-1, keepdim=True)  # a NaN logit is visible: the row is NaN
    p = torch.softmax(scores.masked_fill(~visible, 0.0), dim=-1) * visible
    return p.to(v.dtype) @ v
