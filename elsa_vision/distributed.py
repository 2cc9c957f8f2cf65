"""Context-parallel ELSA: one sequence sharded over the ranks of a ``torch.distributed`` process group.

Each rank holds the queries, keys and values of its own tokens. Key/value shards travel around a ring
(``batch_isend_irecv`` to the next rank while the current shard is being folded in), and every rank folds
each visiting shard into its queries' (m, S, W) states with the ELSA monoid. Because the merge is
associative and commutative, the order in which shards arrive does not change the result beyond rounding:
this is the multi-device level of the scan. The backward pass makes two turns of the ring: in the first the
key/value shards travel again and every rank accumulates the dQ of its queries; in the second the query side
(q, dO and the per-row lse and Delta = rowsum(O dO)) travels and every rank accumulates the dK/dV of its own
keys in place. No gradient buffer is sent, so the ring holds one incoming shard at a time: the same
products as one dK/dV + dQ backward (the kernels' two passes), the same bytes per hop as sending the
accumulators along, less memory.

Layouts (``layout=``):
    ``"contiguous"`` -- rank r holds one contiguous slice; slices differ in length by at most one token.
    ``"zigzag"`` -- the sequence is cut into 2W chunks and rank r holds chunks r and 2W-1-r, which balances
    causal work (every rank gets one early and one late chunk).

Works with NCCL (GPU) and gloo (CPU). Self-attention only (queries and keys are the same tokens).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .kernels.precision import accumulation_dtype
from .ops.attention import resolve_backend
from .ops.checks import check_options, check_triton_call
from .partial_attention import merge_partial, partial_attention, partial_attention_grads

__all__ = [
    "ContextParallel",
    "all_reduce_sum",
    "shard_ranges",
    "shard_sequence",
    "gather_sequence",
    "context_parallel_attention",
]

LAYOUTS = ("contiguous", "zigzag")
# The backward's dK/dV blocks of a key block longer than this are formed and added a piece of this many keys
# at a time: the blocks of a whole shard would be two more shard-sized tensors at the backward's peak.
KEY_PIECE = 16384
# Each ring step's transfer goes in pieces of rows (``_visits``), at most RING_PIECES of them and none shorter
# than RING_PIECE_ROWS: a rank holds three pieces of the travelling tensors at a time (the one computed on,
# the one arriving, its own next one), where whole shards are one (two ranks) or two (more) full sets.
# Shards that make fewer than four pieces travel whole: on two ranks three pieces of a third would hold no
# less, their memory is small, and each piece costs a launch per block and a merge (or dQ addition).
RING_PIECES = 8
RING_PIECE_ROWS = 16384


def _even_cuts(n: int, parts: int) -> list[tuple[int, int]]:
    base, extra = divmod(n, parts)
    cuts, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        cuts.append((start, end))
        start = end
    return cuts


def shard_ranges(n: int, world_size: int, rank: int, layout: str = "contiguous") -> list[tuple[int, int]]:
    """Global ``[start, end)`` token ranges held by ``rank`` (one for contiguous, two for zigzag)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the group of size {world_size}")
    if layout == "contiguous":
        return [_even_cuts(n, world_size)[rank]]
    cuts = _even_cuts(n, 2 * world_size)
    return [cuts[rank], cuts[2 * world_size - 1 - rank]]


def _group_info(group) -> tuple[int, int]:
    return dist.get_world_size(group), dist.get_rank(group)


def shard_sequence(x: Tensor, group=None, *, dim: int = -2, layout: str = "contiguous") -> Tensor:
    """This rank's tokens of a full sequence tensor (every rank passes the same ``x``)."""
    world, rank = _group_info(group)
    ranges = shard_ranges(x.shape[dim], world, rank, layout)
    return torch.cat([x.narrow(dim, a, b - a) for a, b in ranges], dim=dim)


def _pad_rows(x: Tensor, rows: int, dim: int = -2, value: float = 0.0) -> Tensor:
    """``x`` padded with ``value`` to ``rows`` entries along ``dim``, contiguous: the buffers a ring sends."""
    pad = rows - x.shape[dim]
    if pad == 0:
        return x.contiguous()
    widths = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, pad]
    return torch.nn.functional.pad(x, widths, value=value).contiguous()


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_local, n, group, dim, layout):
        ctx.cfg = (group, dim, layout)
        world, _ = _group_info(group)
        lengths = [sum(b - a for a, b in shard_ranges(n, world, r, layout)) for r in range(world)]
        longest = max(lengths)
        padded = _pad_rows(x_local, longest, dim=dim)
        bufs = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(bufs, padded, group=group)
        out_parts = []
        for r, buf in enumerate(bufs):
            offset = 0
            for a, b in shard_ranges(n, world, r, layout):
                out_parts.append((a, buf.narrow(dim, offset, b - a)))
                offset += b - a
        out_parts.sort(key=lambda t: t[0])
        return torch.cat([p for _, p in out_parts], dim=dim)

    @staticmethod
    def backward(ctx, grad):
        group, dim, layout = ctx.cfg
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=group)
        return shard_sequence(grad, group, dim=dim, layout=layout), None, None, None, None


def gather_sequence(x_local: Tensor, n: int, group=None, *, dim: int = -2,
                    layout: str = "contiguous") -> Tensor:
    """Reassemble the full sequence (length ``n``) from every rank's shard (an all-gather).

    Differentiable: the backward sums the incoming gradients over the ranks (an all-reduce) and returns this
    rank's rows, the adjoint of "every rank computes the same function of the gathered sequence". When every
    rank then holds the same loss, the gradients reaching the shards are ``world`` times those of one loss,
    so averaging parameter gradients over the group (what DDP does) gives the single-process gradient.
    """
    return _GatherSequence.apply(x_local, n, group, dim % x_local.dim(), layout)


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def all_reduce_sum(x: Tensor, group=None) -> Tensor:
    """Sum of ``x`` over the ranks of ``group``; differentiable (the backward sums gradients likewise)."""
    return _AllReduceSum.apply(x, group)


class ContextParallel:
    """One sequence sharded over ``group`` with ``layout``: the helpers a model needs in one object.

    ``seq_len`` is the global length of the sequence currently being processed; the model that owns the
    object sets it (``cp.seq_len = n``) after embedding and before the attention layers run. The object holds
    a handle to the process group, so a deep copy of a model shares it (process groups are per process).

    Args:
        group: a ``torch.distributed`` process group (``dist.group.WORLD`` for all ranks).
        layout: ``"contiguous"`` or ``"zigzag"`` (see :func:`shard_ranges`).
    """

    def __init__(self, group: Any, layout: str = "contiguous", seq_len: int | None = None) -> None:
        if layout not in LAYOUTS:
            raise ValueError(f"ContextParallel: unknown layout {layout!r}; expected one of {LAYOUTS}")
        if group is None:
            raise ValueError(
                "ContextParallel: group must be a process group (dist.group.WORLD for all ranks), got None")
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("ContextParallel needs an initialised torch.distributed process group")
        self.group = group
        self.layout = layout
        self.seq_len = seq_len
        self.world, self.rank = _group_info(group)
        if self.rank < 0:
            raise ValueError("ContextParallel: this process is not a member of `group`")

    def __deepcopy__(self, memo):
        return ContextParallel(self.group, self.layout, self.seq_len)

    def __repr__(self) -> str:
        return f"ContextParallel(world={self.world}, rank={self.rank}, layout={self.layout!r})"

    def _n(self, n: int | None) -> int:
        n = self.seq_len if n is None else n
        if n is None:
            raise ValueError("ContextParallel: seq_len is not set (the owner sets it before attention runs)")
        return int(n)

    def ranges(self, n: int | None = None) -> list[tuple[int, int]]:
        """Global ``[start, end)`` ranges of this rank's tokens."""
        return shard_ranges(self._n(n), self.world, self.rank, self.layout)

    def local_len(self, n: int | None = None) -> int:
        return sum(b - a for a, b in self.ranges(n))

    def global_index(self, n: int | None = None, device=None) -> Tensor:
        """Global positions of this rank's tokens, ``[n_local]`` int64, in local order."""
        return torch.cat([torch.arange(a, b, device=device) for a, b in self.ranges(n)])

    def shard(self, x: Tensor, dim: int = 1) -> Tensor:
        """This rank's tokens of a full sequence ``x`` (length ``seq_len`` along ``dim``)."""
        n = self._n(None)
        if x.shape[dim] != n:
            raise ValueError(
                f"ContextParallel.shard: dim {dim} of x must be seq_len={n}, got {list(x.shape)}")
        return shard_sequence(x, self.group, dim=dim, layout=self.layout)

    def gather(self, x_local: Tensor, dim: int = 1) -> Tensor:
        """The full sequence from every rank's shard (differentiable, see :func:`gather_sequence`)."""
        return gather_sequence(x_local, self._n(None), self.group, dim=dim, layout=self.layout)

    def all_reduce(self, x: Tensor) -> Tensor:
        return all_reduce_sum(x, self.group)

    def attention(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        """:func:`context_parallel_attention` over this group, layout and ``seq_len``."""
        return context_parallel_attention(
            q, k, v, seq_len=self._n(None), group=self.group, layout=self.layout, **kwargs)


class _Ring:
    """Send to the next rank, receive from the previous one, overlapped with compute."""

    def __init__(self, group):
        self.group = group
        world, rank = _group_info(group)
        self.world, self.rank = world, rank
        nxt, prv = (rank + 1) % world, (rank - 1) % world
        self.next = dist.get_global_rank(group, nxt) if group is not None else nxt
        self.prev = dist.get_global_rank(group, prv) if group is not None else prv

    def start(self, tensors: list[Tensor]) -> tuple[list, list[Tensor]]:
        recv = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, t, self.prev, self.group) for t in recv]
        return dist.batch_isend_irecv(ops), recv

    @staticmethod
    def wait(reqs) -> None:
        for r in reqs:
            r.wait()


def _pairs(q_ranges, k_ranges, causal):
    """(q slice, k slice, causal flag) blocks to compute; fully masked causal blocks are skipped.

    Chunk boundaries come from one global partition, so a causal pair is either fully visible, fully
    masked, or the same chunk on both sides (a square diagonal block: ordinary causal attention).
    """
    q_off = 0
    for qa, qb in q_ranges:
        k_off = 0
        for ka, kb in k_ranges:
            qs, ks = slice(q_off, q_off + qb - qa), slice(k_off, k_off + kb - ka)
            if qb > qa and kb > ka:
                if not causal or kb - 1 <= qa:
                    yield qs, ks, False
                elif (ka, kb) == (qa, qb):
                    yield qs, ks, True
                # else: every key of the chunk lies after every query: nothing to compute
            k_off += kb - ka
        q_off += qb - qa


def _bias_block(bias, qs, n_rows, k_ranges, ks):
    """The bias entries of one (query block, key block) pair: rows ``qs`` of ``bias`` (or, for a bias whose
    rows are broadcast, ``n_rows`` copies of its row), columns: the global key indices of ``ks`` within a
    shard made of ``k_ranges``."""
    if bias is None:
        return None
    blk = bias[..., qs, :] if n_rows is None else bias[..., :1, :].expand(*bias.shape[:2], n_rows,
                                                                           bias.shape[-1])
    if bias.shape[-1] > 1:
        cols = torch.cat([torch.arange(a, b, device=bias.device) for a, b in k_ranges])[ks]
        blk = blk.index_select(-1, cols)
    return blk


def _bias_rows_travel(bias: Tensor, group) -> bool:
    """Whether the rows of ``bias`` differ between ranks (then they travel with the query side): a bias given
    with one row for all queries stays home. Decided by all ranks together, so that every rank sends the same
    list of buffers; a rank holding a single query row counts as having rows."""
    has_rows = bias.shape[-2] == 1 or bias.stride(-2) != 0
    flag = torch.tensor([1 if has_rows else 0], device=bias.device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def _held_pairs(q_ranges, k_ranges, causal, held: slice, keys_held: bool):
    """``_pairs`` with one side -- the keys (``keys_held``) or the queries -- clipped to the rows ``held`` of
    a visiting piece: yields ``(qs, ks, loc, causal flag)``, ``loc`` the clipped side's rows within the
    piece; blocks outside the piece are skipped."""
    for qs, ks, blk_causal in _pairs(q_ranges, k_ranges, causal):
        side = ks if keys_held else qs
        a, b = max(side.start, held.start), min(side.stop, held.stop)
        if b <= a:
            continue
        loc = slice(a - held.start, b - held.start)
        yield (qs, slice(a, b), loc, blk_causal) if keys_held else (slice(a, b), ks, loc, blk_causal)


def _row_pieces(rows: int) -> list[tuple[int, int]]:
    """The ``[start, end)`` pieces a shard of ``rows`` rows travels in: up to ``RING_PIECES`` of at least
    ``RING_PIECE_ROWS`` rows, or the whole shard where that makes fewer than four."""
    pieces = min(RING_PIECES, rows // max(1, RING_PIECE_ROWS))
    return [c for c in _even_cuts(rows, pieces if pieces >= 4 else 1) if c[1] > c[0]]


def _own_pieces(own: list, dims: list[int], rows: int, causal: bool):
    """This rank's own tensors in the pieces of :func:`_row_pieces` (views): ``(slice, pieces)`` each. The
    backward computes on its own rows in these pieces too: a call's ``fp16x3`` operand parts
    (``kernels.bwd``) are then a piece's, not two more shard-sized tensors at the backward's peak. Causal:
    the whole shard, one piece (the own blocks include the causal diagonal ones, whose mask is aligned to
    the whole block)."""
    for a, b in [(0, rows)] if causal else _row_pieces(rows):
        yield slice(a, b), [None if t is None else t.narrow(d, a, b - a) for t, d in zip(own, dims)]


def _visits(ring: _Ring, own: list[Tensor], dims: list[int], rows: int):
    """Every other rank's travelling tensors, a piece of rows at a time: yields ``(src, cut, bufs)``, the
    owner's rank, the ``slice`` of its ``rows`` padded rows that ``bufs`` hold, and those pieces (``own``:
    this rank's tensors, each ``rows`` long along its entry of ``dims``).

    Each piece goes once around the ring before the next one starts (up to ``RING_PIECES`` pieces of at
    least ``RING_PIECE_ROWS`` rows, or the whole shard where that makes fewer than four): a rank
    forwards the piece it is handed to the next rank while the caller computes on it, and the next transfer
    is under way meanwhile, so besides its own tensors a rank holds about three pieces of the travelling
    ones (the one computed on, the one arriving, its own next piece), not one or two whole shards. The
    caller works on its own rows first; the first piece's transfer is the only one not overlapped."""
    world, rank = ring.world, ring.rank
    order = [(a, b, step) for a, b in _row_pieces(rows) for step in range(1, world)]
    if not order:
        return

    def own_piece(a: int, b: int) -> list[Tensor]:
        return [t.narrow(d, a, b - a).contiguous() for t, d in zip(own, dims)]

    pending = ring.start(own_piece(*order[0][:2]))
    for i, (a, b, step) in enumerate(order):
        reqs, bufs = pending
        _Ring.wait(reqs)
        if i + 1 < len(order):
            na, nb, nstep = order[i + 1]
            pending = ring.start(bufs if nstep > 1 else own_piece(na, nb))
        yield (rank - step) % world, slice(a, b), bufs


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, kpm, bias, group, n, causal, scale, precision, backend, layout):
        ring = _Ring(group)
        world, rank = ring.world, ring.rank
        ranges = [shard_ranges(n, world, r, layout) for r in range(world)]
        lengths = [sum(b - a for a, b in rr) for rr in ranges]
        longest = max(lengths)
        # Every rank sends equally shaped buffers; padded keys are hidden by the travelling mask.
        valid = torch.ones(k.shape[0], k.shape[-2], dtype=torch.bool, device=k.device)
        if kpm is not None:
            valid = valid & kpm
        # Without a padding mask and with equal shards every key is valid: the mask stays home.
        masked = kpm is not None or min(lengths) != longest
        kb, vb = _pad_rows(k, longest), _pad_rows(v, longest)
        mb = _pad_rows(valid, longest, dim=-1, value=False) if masked else None
        # One running (out, lse) per local query chunk: the first result, into which every later one is
        # merged (in place on the Triton path: one output-sized tensor per block, the block's own).
        state = [None] * len(ranges[rank])

        def attend(src, keys, kb, vb, mb):
            """Merge in this rank's queries against rows ``keys`` of ``src``'s keys (held from
            ``keys.start``)."""
            for qs, ks, loc, blk_causal in _held_pairs(ranges[rank], ranges[src], causal, keys, True):
                out_b, lse_b = partial_attention(q[..., qs, :], kb[..., loc, :], vb[..., loc, :],
                                                 mb[:, loc] if masked else None,
                                                 _bias_block(bias, qs, None, ranges[src], ks),
                                                 blk_causal, scale, precision, backend)
                idx = _chunk_index(ranges[rank], qs)
                state[idx] = ((out_b, lse_b) if state[idx] is None else
                              merge_partial(*state[idx], out_b, lse_b, backend))
                del out_b, lse_b

        attend(rank, slice(0, longest), kb, vb, mb)
        for src, cut, bufs in _visits(ring, [kb, vb, mb] if masked else [kb, vb], [-2, -2, -1], longest):
            attend(src, cut, *(bufs if masked else (*bufs, None)))
        outs, lses = [], []
        for i, (a, b) in enumerate(ranges[rank]):
            st, state[i] = state[i], None
            if st is None:  # nothing visible for this chunk (cannot happen for self-attention; kept exact)
                shape = q.shape[:-2] + (b - a,)
                outs.append(q.new_zeros(shape + (v.shape[-1],), dtype=accumulation_dtype(q)))
                lses.append(torch.full(shape, float("-inf"), dtype=accumulation_dtype(q), device=q.device))
                continue
            outs.append(st[0])
            lses.append(st[1].to(accumulation_dtype(q)))  # the Triton path's float64 lse: merges only
        if len(outs) == 1:
            out, lse = outs[0], lses[0]
        else:
            out, lse = torch.cat(outs, dim=-2), torch.cat(lses, dim=-1)
        ctx.save_for_backward(q, k, v, out, lse, valid, bias)
        ctx.cfg = (group, n, causal, scale, precision, backend, layout, masked, kpm is not None)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, valid, bias = ctx.saved_tensors
        group, n, causal, scale, precision, backend, layout, masked, has_kpm = ctx.cfg
        ring = _Ring(group)
        world, rank = ring.world, ring.rank
        ranges = [shard_ranges(n, world, r, layout) for r in range(world)]
        longest = max(sum(b - a for a, b in rr) for rr in ranges)
        # dO stays in the inputs' dtype (in bf16 it travels at half the size of a float32 copy; the kernels
        # read it so either way); Delta = rowsum(O dO) is formed in the accumulation dtype.
        do = dout.to(q.dtype)
        delta = (out * do.to(out.dtype)).sum(-1)

        # Turn 1, dQ: the key/value shards travel as in the forward; each rank adds its queries' dQ blocks.
        dq = torch.zeros(q.shape, dtype=out.dtype, device=q.device)
        kb, vb = _pad_rows(k, longest), _pad_rows(v, longest)
        mb = _pad_rows(valid, longest, dim=-1, value=False) if masked else None

        def add_dq(src, keys, kb, vb, mb):
            for qs, ks, loc, blk_causal in _held_pairs(ranges[rank], ranges[src], causal, keys, True):
                (gq,) = partial_attention_grads(
                    do[..., qs, :], q[..., qs, :], kb[..., loc, :], vb[..., loc, :], lse[..., qs],
                    delta[..., qs], mb[:, loc] if masked else None,
                    _bias_block(bias, qs, None, ranges[src], ks), blk_causal, scale, precision, backend,
                    want_dq=True)
                dq[..., qs, :] += gq
                del gq

        for cut, bufs in _own_pieces([kb, vb, mb], [-2, -2, -1], longest, causal):
            add_dq(rank, cut, *bufs)
        for src, cut, bufs in _visits(ring, [kb, vb, mb] if masked else [kb, vb], [-2, -2, -1], longest):
            add_dq(src, cut, *(bufs if masked else (*bufs, None)))
        del kb, vb, mb
        dq = dq.to(q.dtype)  # complete: in the inputs' dtype during turn 2 (half the memory in bf16)

        # Turn 2, dK/dV: the query side travels (q, dO, lse, Delta, and the bias rows where they differ
        # between ranks); each rank adds the dK/dV blocks of its own keys in place.
        travel_bias = bias is not None and _bias_rows_travel(bias, group)
        side = [_pad_rows(q, longest), _pad_rows(do, longest), _pad_rows(lse, longest, dim=-1),
                _pad_rows(delta, longest, dim=-1)] + ([_pad_rows(bias, longest)] if travel_bias else [])
        dims = [-2, -2, -1, -1, -2][:len(side)]
        kpm = valid if has_kpm else None
        dk = torch.zeros(k.shape, dtype=out.dtype, device=k.device)
        dv = torch.zeros(v.shape, dtype=out.dtype, device=v.device)

        def add_dkdv(src, queries, qb, dob, lseb, deltab, biasb=None):
            """Add the dK/dV blocks of rows ``queries`` of ``src``'s queries (held from
            ``queries.start``)."""
            for qs, block, loc, blk_causal in _held_pairs(ranges[src], ranges[rank], causal, queries, False):
                # dK/dV of a key depend on that key alone: a visible block is cut into pieces of keys (a
                # causal diagonal block is not: its mask is aligned to the whole block)
                for ks in [block] if blk_causal else _pieces(block, KEY_PIECE):
                    bias_blk = (_bias_block(biasb, loc, None, ranges[rank], ks) if travel_bias else
                                _bias_block(bias, None, qs.stop - qs.start, ranges[rank], ks))
                    gk, gv = partial_attention_grads(
                        dob[..., loc, :], qb[..., loc, :], k[..., ks, :], v[..., ks, :], lseb[..., loc],
                        deltab[..., loc], None if kpm is None else kpm[:, ks], bias_blk, blk_causal, scale,
                        precision, backend, want_dq=False)
                    dk[..., ks, :] += gk
                    dv[..., ks, :] += gv
                    del gk, gv

        for cut, bufs in _own_pieces(side, dims, longest, causal):
            add_dkdv(rank, cut, *bufs)
        for src, cut, bufs in _visits(ring, side, dims, longest):
            add_dkdv(src, cut, *bufs)
        return (dq, dk.to(k.dtype), dv.to(v.dtype),
                None, None, None, None, None, None, None, None, None)


def _pieces(block: slice, size: int) -> list[slice]:
    """``block`` cut into consecutive slices of at most ``size`` (at least 1) positions."""
    size = max(1, int(size))
    return [slice(a, min(a + size, block.stop)) for a in range(block.start, block.stop, size)]


def _chunk_index(q_ranges, qs: slice) -> int:
    off = 0
    for i, (a, b) in enumerate(q_ranges):
        if qs.start == off:
            return i
        off += b - a
    raise AssertionError("query slice does not start a chunk")


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    seq_len: int,
    group=None,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    attn_bias: Tensor | None = None,
    scale: float | None = None,
    precision: str = "auto",
    backend: str = "auto",
    layout: str = "contiguous",
) -> Tensor:
    """Self-attention over a sequence of ``seq_len`` tokens sharded over ``group``.

    Args:
        q, k, v: this rank's tokens, ``[B, H, n_local, D]`` (``v``: ``Dv``), as :func:`shard_sequence`
            lays them out.
        seq_len: the global number of tokens.
        key_padding_mask: this rank's part of a bool ``[B, seq_len]`` mask (True = key takes part).
        attn_bias: this rank's query rows of a bias ``[B|1, H|1, n_local, seq_len]`` (all key columns, global
            order); forward only (no gradient).
        causal, scale, precision, backend: as :func:`elsa_vision.elsa_attention`.
        layout: ``"contiguous"`` or ``"zigzag"`` (load-balanced causal).

    Returns ``[B, H, n_local, Dv]``, equal to the matching rows of single-device attention; differentiable in
    q, k, v.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("context_parallel_attention needs an initialised torch.distributed process group")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    check_options("context_parallel_attention", backend, precision)
    world, rank = _group_info(group)
    n_local = sum(b - a for a, b in shard_ranges(seq_len, world, rank, layout))
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4 or t.shape[-2] != n_local:
            raise ValueError(
                f"context_parallel_attention: `{name}` must be [B, H, {n_local}, D] on rank {rank} "
                f"(seq_len={seq_len}, world={world}, layout={layout}), got {list(t.shape)}")
    if key_padding_mask is not None and (key_padding_mask.dtype != torch.bool
                                         or tuple(key_padding_mask.shape) != (q.shape[0], n_local)):
        raise ValueError(f"context_parallel_attention: `key_padding_mask` must be bool [B, {n_local}], "
                         f"got {key_padding_mask.dtype} {list(key_padding_mask.shape)}")
    if attn_bias is not None:
        if attn_bias.requires_grad:
            raise ValueError("context_parallel_attention: `attn_bias` gradients are not supported")
        if (attn_bias.dim() != 4 or attn_bias.shape[-2] not in (1, n_local)
                or attn_bias.shape[-1] not in (1, seq_len)):
            raise ValueError(f"context_parallel_attention: `attn_bias` must be "
                             f"[B|1, H|1, {n_local}, {seq_len}], got {list(attn_bias.shape)}")
        attn_bias = attn_bias.expand(*attn_bias.shape[:2], n_local, attn_bias.shape[-1])
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    chosen = resolve_backend(backend, q)
    if chosen == "triton":
        check_triton_call("context_parallel_attention", q, v)
    return _RingAttention.apply(q, k, v, key_padding_mask, attn_bias, group, seq_len, causal, scale,
                                precision, chosen, layout)
