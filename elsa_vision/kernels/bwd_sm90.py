"""The dense half-precision backward passes for Hopper (sm90), warp-specialised, in Gluon.

The same gradients as ``bwd._bwd_dkdv_kernel`` and ``bwd._bwd_dq_kernel`` for float16/bfloat16 inputs
without a mask, bias or causality, from the forward's natural-log ``lse`` and ``Delta = rowsum(O * dO)``,
laid out as the Hopper forward (``fwd_sm90``) is. One kernel serves both passes (``DQ``): a program owns 64
rows per consumer warpgroup of one side and streams the tiles of the other side.

* one *producer* warp loads the program's *resident* pair once (one 64-row tile per consumer: keys and
  values for dK/dV, queries and output gradients for dQ) and each *streamed* tile's pair (``Q``, ``dO``;
  ``K``, ``V``) by TMA into a ring of ``STAGES`` stages (4-D descriptors over ``[B, H, N, D]``:
  ``fwd_sm90.descriptor``; reads past ``N`` are zeros);
* ``CONSUMERS`` warpgroups own 64 rows each. Per streamed tile: ``X = A1 B1^T`` and ``Y = A2 B2^T`` as
  wgmma from shared memory (dK/dV: ``S^T = K Q^T``, ``dP^T = V dO^T``; dQ: ``S = Q K^T``, ``dP = dO V^T``),
  then ``P = exp(scale * S - lse)`` and ``dS = P (dP - Delta)`` in registers, fed back as the register
  operand of ``dV += P^T dO`` and ``dK += dS^T Q`` (dK/dV) or ``dQ += dS K`` (dQ); a stage is released once
  its products are done. dK and dQ are scaled by ``scale`` at the end.

Query rows past ``Nq`` get ``lse = +inf`` (``P = 0``) and ``Delta = 0``; keys past ``Nk`` are zero rows of
``K`` and ``V``, which add nothing to ``dQ``. A consumer whose gradients are not finite flags its 64 rows in
``Redo`` (1 = redo), and ``bwd._HopperPass`` runs the generic kernel's ``REDO`` mode over them, as the
forward does.

``bwd_fused_kernel`` is the five-product backward, for calls that want all three gradients: the dK/dV
pass's program, whose consumers also write their ``dS^T`` (half precision) into a shared tile of both
consumers' keys; once both have written it (mbarriers), ``dQ_j = dS K`` over the program's 128 keys is
formed in 64-query slices, each by one consumer (the consumers take turns), staged in shared memory and
added to a float32 ``[B, H, Nq, D]`` buffer by TMA reduce-add. Its sum over key programs is in no fixed
order (reruns may differ in the last bits); ``bwd._HopperFused`` converts it to dQ and flags non-finite
rows for the generic kernel's redo.

``bwd_fused_f16x3_kernel`` is the same five-product backward for float32 inputs at ``fp16x3``: it reads
the float16 parts (high, low) of Q, dO, K and V that ``bwd._split_pair_kernel`` writes, forms each product
as three float16 wgmma into a fresh float32 accumulator whose power-of-two scales it then undoes (the
generic kernels' ``fp16x3`` arithmetic), and each consumer adds its own keys' part of ``dQ_j`` (its ``dS``
tile has its own scale) by TMA reduce-add.

``bwd._BwdProgram`` routes to them on sm90 (``bwd.HOPPER``, ``bwd.HOPPER_MIN_KEYS``, ``bwd.HOPPER_FUSED``,
``bwd.HOPPER_SPLIT_MIN_WAVES``); measurements and what limits them: ``docs/kernel_notes.md``, "The Hopper
backward" and "The FP32-accurate five-product backward"; tests:
``tests/kernels/test_bwd_sm90.py``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)

from .dots import f16_pair, split_f16, unscale
from .fwd_sm90 import ROWS, descriptor, mm3, stage_ring, stream_pairs, stream_part_pairs
from .host import LOG2E
from .monoid import count_nonfinite

__all__ = ["CONFIGS", "CONSUMERS", "FUSED_CONFIGS", "FUSED_SPLIT_CONFIGS", "NUM_WARPS", "ROWS",
           "bwd_fused_f16x3_kernel", "bwd_fused_kernel", "bwd_kernel", "descriptor", "supported",
           "supported_split"]

NUM_WARPS = 4  # the default partition: the first consumer warpgroup
_LOG2E = gl.constexpr(LOG2E)

CONSUMERS = gl.constexpr(2)  # warpgroups of 64 own rows per program
# (BLOCK_S, STAGES) per head dim: streamed rows per step and stages of the streamed pair. H100, bf16, the
# whole backward at 3K-32K tokens (``benchmarks.attention_bwd --tune-hopper``): head dim 64, 128 rows 1-10 %
# faster than 64 but at 16K (2 % slower), 32 rows 20-25 % slower, 3 stages within 3 %; head dim 128, 64 rows
# 9-16 % faster than 32. A loop issuing a tile's score products under the previous tile's gradient products
# (as the forward does) lost at every shape and was removed (docs/kernel_notes.md, "The Hopper backward").
CONFIGS = {64: (128, 2), 128: (64, 2)}
# (BLOCK_S, STAGES) of the five-product backward (``bwd_fused_kernel``) per head dim it serves. H100, bf16,
# 1K-32K tokens: at head dim 64, 64 streamed rows 1-3 % faster than 128 (two or three stages).
FUSED_CONFIGS = {64: (64, 2), 128: (64, 2)}
# (BLOCK_S, STAGES) of ``bwd_fused_f16x3_kernel`` per head dim it serves: 64 streamed queries (one dQ partial
# per consumer and tile), three stages of the four streamed parts (229,840 bytes of shared memory). H100,
# 197-16K tokens: three stages 1-9 % faster than two but at 4K-8K tokens (1-3 % slower).
FUSED_SPLIT_CONFIGS = {64: (64, 3)}


def supported(q, k, v, do) -> bool:
    """Whether these passes take these tensors: an sm90 GPU, float16/bfloat16, head dims 64 or 128 (the same
    for values), the head dim contiguous and every other stride and the base 16-byte aligned (TMA)."""
    if not q.is_cuda or q.dtype not in (torch.float16, torch.bfloat16):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    D = q.shape[-1]
    if D not in CONFIGS or any(t.shape[-1] != D for t in (k, v, do)) or k.shape[2] == 0 or q.shape[2] == 0:
        return False
    for t in (q, k, v, do):
        if t.dtype != q.dtype or t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def supported_split(q, k, v, do) -> bool:
    """Whether ``bwd_fused_f16x3_kernel`` can take these float32 tensors: an sm90 GPU, equal head dims, at
    least one query and key (``bwd`` routes the head dims of ``FUSED_SPLIT_CONFIGS``). Their strides are
    free: the kernel reads the contiguous float16 parts the split pass writes."""
    if not q.is_cuda or any(t.dtype != torch.float32 for t in (q, k, v, do)):
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    return all(t.shape[-1] == q.shape[-1] for t in (k, v, do)) and k.shape[2] > 0 and q.shape[2] > 0


# The partitions share one signature (Gluon's rule for worker partitions); each reads what it needs.


@gluon.jit
def _produce(r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready, empty,
             Lse, Delta, Out1, Out2, Redo, H, N_OWN, N_STREAM, own_tiles, stride_lb, stride_lh, stride_lm,
             stride_1b, stride_1h, stride_1n, stride_2b, stride_2h, stride_2n, qk_scale, sm_scale,
             D: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr, DQ: gl.constexpr):
    _load_pairs(r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready, empty,
                H, N_STREAM, own_tiles, BLOCK_S, STAGES)


@gluon.jit
def _load_pairs(r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready, empty,
                H, N_STREAM, own_tiles, BLOCK_S: gl.constexpr, STAGES: gl.constexpr):
    """A producer's work: the program's resident pair once (64 own rows per consumer), then the streamed
    pair's tiles into the ring of stages."""
    pid = gl.program_id(0)
    off_r = (pid % own_tiles) * (ROWS * CONSUMERS)
    off_b = (pid // own_tiles) // H
    off_h = (pid // own_tiles) % H
    mbarrier.expect(r_bar, CONSUMERS * (r1_desc.block_type.nbytes + r2_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):  # 64 own rows per consumer
        tma.async_copy_global_to_shared(r1_desc, [off_b, off_h, off_r + c * ROWS, 0], r_bar, r1_smem.index(c))
        tma.async_copy_global_to_shared(r2_desc, [off_b, off_h, off_r + c * ROWS, 0], r_bar, r2_smem.index(c))
    stream_pairs(s1_desc, s2_desc, s1_smem, s2_smem, ready, empty, off_b, off_h, N_STREAM, BLOCK_S, STAGES)


@gluon.jit
def _row_vectors(Lse, Delta, lse_base, delta_base, rows, n, stride_lm):
    """``(lse * log2(e), Delta)`` of query ``rows`` (any layout): ``+inf`` and 0 past ``n`` queries."""
    ok = rows < n
    lse2 = gl.load(lse_base + rows.to(gl.int64) * stride_lm, mask=ok, other=float("inf")) * _LOG2E
    return lse2, gl.load(delta_base + rows, mask=ok, other=0.0)


@gluon.jit
def _tile_grads(x, y, lse2, delta, qk_scale, DQ: gl.constexpr):
    """``(P, dS)`` of one tile from its score products ``x`` (``S`` or ``S^T``) and ``y`` (``dP`` or
    ``dP^T``): ``P = exp2(S * qk_scale - lse * log2 e)``, ``dS = P (dP - Delta)``, with the query rows'
    ``lse2`` and ``Delta`` along the rows (dQ) or the columns (dK/dV)."""
    if DQ:
        p = gl.exp2(x * qk_scale - lse2[:, None])
        ds = p * (y - delta[:, None])
    else:
        p = gl.exp2(x * qk_scale - lse2[None, :])
        ds = p * (y - delta[None, :])
    return p, ds


@gluon.jit
def _consume(r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready, empty,
             Lse, Delta, Out1, Out2, Redo, H, N_OWN, N_STREAM, own_tiles, stride_lb, stride_lh, stride_lm,
             stride_1b, stride_1h, stride_1n, stride_2b, stride_2h, stride_2n, qk_scale, sm_scale,
             D: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr, DQ: gl.constexpr,
             WG: gl.constexpr):
    """Own rows ``WG * 64`` onwards of the program's tile: the loop over the streamed tiles, then the
    gradients (dK/dV: ``Out1`` = dK, ``Out2`` = dV; dQ: ``Out1`` = dQ)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_S, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = s1_desc.dtype
    pid = gl.program_id(0)
    pid_r = pid % own_tiles
    bh = pid // own_tiles
    off_b = bh // H
    off_h = bh % H
    first = pid_r * ROWS * CONSUMERS + WG * ROWS  # this warpgroup's first own row

    a1 = r1_smem.index(WG).reshape([ROWS, D])
    a2 = r2_smem.index(WG).reshape([ROWS, D])
    zero = gl.zeros([ROWS, BLOCK_S], gl.float32, s_layout)
    acc1 = gl.zeros([ROWS, D], gl.float32, o_layout)
    acc2 = gl.zeros([ROWS, D], gl.float32, o_layout)
    lse_base = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
    delta_base = Delta + bh.to(gl.int64) * (N_OWN if DQ else N_STREAM)
    cols = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, s_layout))
    if DQ:  # the own rows are queries: their lse and Delta, once
        own = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, s_layout))
        lse2, delta = _row_vectors(Lse, Delta, lse_base, delta_base, own, N_OWN, stride_lm)
    mbarrier.wait(r_bar, 0)
    n_tiles = gl.cdiv(N_STREAM, BLOCK_S)
    # each streamed tile's four (three) products in turn
    for j in range(n_tiles):
        st = j % STAGES
        if not DQ:  # the streamed rows are queries
            lse2, delta = _row_vectors(Lse, Delta, lse_base, delta_base, j * BLOCK_S + cols, N_STREAM,
                                       stride_lm)
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        b1 = s1_smem.index(st).reshape([BLOCK_S, D])
        b2 = s2_smem.index(st).reshape([BLOCK_S, D])
        x = warpgroup_mma(a1, b1.permute((1, 0)), zero, use_acc=False)  # S^T (dK/dV) or S (dQ)
        y = warpgroup_mma(a2, b2.permute((1, 0)), zero, use_acc=False)  # dP^T or dP
        p, ds = _tile_grads(x, y, lse2, delta, qk_scale, DQ)
        if not DQ:
            acc2 = warpgroup_mma(gl.convert_layout(p.to(dtype), a_layout), b2, acc2)  # dV += P^T dO
        # dK += dS^T Q, or dQ += dS K
        acc1 = warpgroup_mma(gl.convert_layout(ds.to(dtype), a_layout), b1, acc1)
        mbarrier.arrive(empty.index(st), count=1)

    acc1 = acc1 * sm_scale
    rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    row_ok = rows < N_OWN
    _store_rows(acc1, Out1, off_b, off_h, rows, dims, row_ok, stride_1b, stride_1h, stride_1n)
    bad = count_nonfinite(gl.where(row_ok[:, None], acc1, 0.0))
    if not DQ:
        _store_rows(acc2, Out2, off_b, off_h, rows, dims, row_ok, stride_2b, stride_2h, stride_2n)
        bad += count_nonfinite(gl.where(row_ok[:, None], acc2, 0.0))
    _store_flag(Redo, bh, pid_r * CONSUMERS + WG, N_OWN, bad)


@gluon.jit
def _store_rows(acc, Out, off_b, off_h, rows, dims, row_ok, stride_b, stride_h, stride_n):
    """``acc`` (a consumer's 64 rows) into rows ``rows`` of ``Out``'s head ``(off_b, off_h)``, those with
    ``row_ok``, in ``Out``'s dtype."""
    ptrs = (Out + off_b.to(gl.int64) * stride_b + off_h.to(gl.int64) * stride_h
            + rows.to(gl.int64)[:, None] * stride_n + dims[None, :])
    gl.store(ptrs, acc.to(Out.dtype.element_ty), mask=row_ok[:, None])


@gluon.jit
def _store_flag(Redo, bh, block, n_own, bad):
    """The flag of 64-row ``block`` of head ``bh`` (of ``cdiv(n_own, 64)``): 1 (the generic kernel's exact
    pass redoes the rows) where ``bad`` non-finite values were written."""
    if block < gl.cdiv(n_own, ROWS):
        gl.store(Redo + bh * gl.cdiv(n_own, ROWS) + block, (bad != 0).to(gl.int32))


@gluon.jit
def bwd_kernel(
    r1_desc, r2_desc, s1_desc, s2_desc, Lse, Delta, Out1, Out2, Redo,
    H, N_OWN, N_STREAM, own_tiles, stride_lb, stride_lh, stride_lm,
    stride_1b, stride_1h, stride_1n, stride_2b, stride_2h, stride_2n, qk_scale, sm_scale,
    D: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr, DQ: gl.constexpr,
):
    """Grid ``(own_tiles * B * H,)``, tiles of ``64 * CONSUMERS`` own rows, one head's tiles adjacent.

    dK/dV (``DQ`` False): resident ``r1``, ``r2`` = K, V (``N_OWN`` keys), streamed ``s1``, ``s2`` = Q, dO
    (``N_STREAM`` queries), ``Out1`` = dK, ``Out2`` = dV. dQ: resident Q, dO, streamed K, V, ``Out1`` = dQ
    (``Out2`` unused). ``Out*`` ``[B, H, N_OWN, D]`` with the head dim contiguous (``stride_1*`` /
    ``stride_2*`` their other strides), ``Lse`` ``[B, H, Nq]`` float32 (natural log), ``Delta`` ``[B * H,
    Nq]`` float32, ``Redo`` ``[B * H, cdiv(N_OWN, 64)]`` int32 flags; ``qk_scale`` is the base-2 logit scale
    (``scale * log2(e)``), ``sm_scale`` the softmax scale."""
    r1_smem = gl.allocate_shared_memory(r1_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], r1_desc.layout)
    r2_smem = gl.allocate_shared_memory(r2_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], r2_desc.layout)
    s1_smem = gl.allocate_shared_memory(s1_desc.dtype, [STAGES, 1, 1, BLOCK_S, D], s1_desc.layout)
    s2_smem = gl.allocate_shared_memory(s2_desc.dtype, [STAGES, 1, 1, BLOCK_S, D], s2_desc.layout)
    r_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(r_bar, count=1)
    ready, empty = stage_ring(STAGES, CONSUMERS)
    # One tuple literal per partition: a tuple bound to a name would turn its constexprs into tensors.
    gl.warp_specialize([
        (_consume, (r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready,
                    empty, Lse, Delta, Out1, Out2, Redo, H, N_OWN, N_STREAM, own_tiles, stride_lb, stride_lh,
                    stride_lm, stride_1b, stride_1h, stride_1n, stride_2b, stride_2h, stride_2n, qk_scale,
                    sm_scale, D, BLOCK_S, STAGES, DQ, 0)),
        (_consume, (r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready,
                    empty, Lse, Delta, Out1, Out2, Redo, H, N_OWN, N_STREAM, own_tiles, stride_lb, stride_lh,
                    stride_lm, stride_1b, stride_1h, stride_1n, stride_2b, stride_2h, stride_2n, qk_scale,
                    sm_scale, D, BLOCK_S, STAGES, DQ, 1)),
        (_produce, (r1_desc, r2_desc, s1_desc, s2_desc, r1_smem, r2_smem, s1_smem, s2_smem, r_bar, ready,
                    empty, Lse, Delta, Out1, Out2, Redo, H, N_OWN, N_STREAM, own_tiles, stride_lb, stride_lh,
                    stride_lm, stride_1b, stride_1h, stride_1n, stride_2b, stride_2h, stride_2n, qk_scale,
                    sm_scale, D, BLOCK_S, STAGES, DQ)),
    ], [4, 1], [232, 24])  # the second consumer warpgroup and the producer warp: warps, registers


# ---- the five-product backward: dQ formed in the dK/dV program, reduced across key programs ------------

# a barrier of the calling partition's threads (renamed from ``thread_barrier`` after Triton 3.6)
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier

if hasattr(tma, "async_atomic_add"):  # Triton 3.7 and later
    _reduce_add = tma.async_atomic_add
else:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _reduce_add(tensor_desc, coord, src, _semantic=None):
        """TMA reduce-add of the shared-memory tile ``src`` into ``tensor_desc`` at ``coord``."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)


@gluon.jit
def _key_consumer(Lse, Delta, H, NK, NQ, own_tiles, stride_lb, stride_lh, BLOCK_S: gl.constexpr,
                  WG: gl.constexpr, layout: gl.constexpr):
    """What consumer ``WG`` of a five-product program needs of it: ``(pid_r, bh, off_b, off_h, first,
    lse_base, delta_base, cols, key_ok)`` -- the program's key tile and head, the consumer's first key, where
    the head's lse and ``Delta`` rows start, a streamed tile's column offsets and which of the consumer's 64
    keys lie below ``NK`` (along the rows and columns of ``layout``, the ``S^T`` tile's)."""
    pid = gl.program_id(0)
    pid_r = pid % own_tiles
    bh = pid // own_tiles
    off_b = bh // H
    off_h = bh % H
    first = pid_r * ROWS * CONSUMERS + WG * ROWS
    lse_base = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
    delta_base = Delta + bh.to(gl.int64) * NQ
    cols = gl.arange(0, BLOCK_S, layout=gl.SliceLayout(0, layout))
    key_ok = (first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))) < NK
    return pid_r, bh, off_b, off_h, first, lse_base, delta_base, cols, key_ok


@gluon.jit
def _add_dq(dq, dq_desc, stage, off_b, off_h, row, D: gl.constexpr):
    """Add ``dq`` (a consumer's 64 rows of ``dS K``, float32) to the dQ sum of ``dq_desc`` at query ``row`` of
    head ``(off_b, off_h)``: staged in the consumer's shared-memory tile ``stage`` once the previous
    reduction from it has read it, then one TMA reduce-add."""
    tma.store_wait(0)
    _barrier()
    stage.reshape([ROWS, D]).store(dq)
    fence_async_shared()
    _barrier()
    _reduce_add(dq_desc, [off_b, off_h, row, 0], stage)


@gluon.jit
def _store_key_grads(dk, dv, DK, DV, Redo, bh, off_b, off_h, first, pid_r, NK, stride_kb, stride_kh,
                     stride_kn, stride_vb, stride_vh, stride_vn, D: gl.constexpr, layout: gl.constexpr,
                     WG: gl.constexpr):
    """A five-product consumer's epilogue: its 64 keys' ``dk`` (scaled) and ``dv`` (``layout``) into rows
    ``first`` onwards of ``DK`` and ``DV`` (those below ``NK``), and the flag of its 64 keys (consumer ``WG``
    of key tile ``pid_r``)."""
    rows = first + gl.arange(0, ROWS, layout=gl.SliceLayout(1, layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, layout))
    row_ok = rows < NK
    _store_rows(dk, DK, off_b, off_h, rows, dims, row_ok, stride_kb, stride_kh, stride_kn)
    _store_rows(dv, DV, off_b, off_h, rows, dims, row_ok, stride_vb, stride_vh, stride_vn)
    bad = count_nonfinite(gl.where(row_ok[:, None], dk, 0.0))
    bad += count_nonfinite(gl.where(row_ok[:, None], dv, 0.0))
    _store_flag(Redo, bh, pid_r * CONSUMERS + WG, NK, bad)


@gluon.jit
def _produce_fused(k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                   dq_smem, r_bar, ready, empty, ds_full, ds_empty, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                   own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn, stride_vb,
                   stride_vh, stride_vn, qk_scale, sm_scale, D: gl.constexpr, BLOCK_S: gl.constexpr,
                   STAGES: gl.constexpr, WG: gl.constexpr):
    _load_pairs(k_desc, v_desc, q_desc, do_desc, k_smem, v_smem, q_smem, do_smem, r_bar, ready, empty, H, NQ,
                own_tiles, BLOCK_S, STAGES)


@gluon.jit
def _consume_fused(k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                   dq_smem, r_bar, ready, empty, ds_full, ds_empty, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                   own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn, stride_vb,
                   stride_vh, stride_vn, qk_scale, sm_scale, D: gl.constexpr, BLOCK_S: gl.constexpr,
                   STAGES: gl.constexpr, WG: gl.constexpr):
    """Keys ``WG * 64`` onwards of the program's tile: per streamed query tile the dK/dV pass's four
    products (``dV`` and ``dK`` asynchronous, with ``dS^T``, bf16/fp16, this consumer's 64 key rows, written
    under them into the shared ``dS^T`` tile of both consumers' keys); then the 64-query slices of
    ``dQ_j = dS K`` (``K`` = both consumers' resident keys) this consumer owns -- slice ``h`` of tile ``j``
    is consumer ``(h + j) % 2``'s, formed once the other consumer's rows are written -- go through shared
    memory into ``dQacc`` by TMA reduce-add (float32, unscaled)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_S, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    SLICES: gl.constexpr = BLOCK_S // ROWS  # 64-query slices of dQ per streamed tile
    dtype: gl.constexpr = q_desc.dtype
    # keys past NK (zero rows of K and V) get dS = 0: their P need not be finite
    pid_r, bh, off_b, off_h, first, lse_base, delta_base, cols, key_ok = _key_consumer(
        Lse, Delta, H, NK, NQ, own_tiles, stride_lb, stride_lh, BLOCK_S, WG, s_layout)

    a1 = k_smem.index(WG).reshape([ROWS, D])
    a2 = v_smem.index(WG).reshape([ROWS, D])
    zero = gl.zeros([ROWS, BLOCK_S], gl.float32, s_layout)
    zero_o = gl.zeros([ROWS, D], gl.float32, o_layout)
    acc1 = gl.zeros([ROWS, D], gl.float32, o_layout)
    acc2 = gl.zeros([ROWS, D], gl.float32, o_layout)
    mbarrier.wait(r_bar, 0)
    n_tiles = gl.cdiv(NQ, BLOCK_S)
    for j in range(n_tiles):
        st = j % STAGES
        lse2, delta = _row_vectors(Lse, Delta, lse_base, delta_base, j * BLOCK_S + cols, NQ, stride_lm)
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        b1 = q_smem.index(st).reshape([BLOCK_S, D])
        b2 = do_smem.index(st).reshape([BLOCK_S, D])
        x = warpgroup_mma(a1, b1.permute((1, 0)), zero, use_acc=False)  # S^T
        y = warpgroup_mma(a2, b2.permute((1, 0)), zero, use_acc=False)  # dP^T
        p, ds = _tile_grads(x, y, lse2, delta, qk_scale, False)
        ds = gl.where(key_ok[:, None], ds, 0.0)
        pa = gl.convert_layout(p.to(dtype), a_layout)
        dsb = ds.to(dtype)
        dsa = gl.convert_layout(dsb, a_layout)
        tok2 = warpgroup_mma(pa, b2, acc2, is_async=True)  # dV += P^T dO
        tok1 = warpgroup_mma(dsa, b1, acc1, is_async=True)  # dK += dS^T Q
        # under them, dS^T of this consumer's keys into the shared tile (two buffers: tile j's, j - 1's)
        buf = j % 2
        mbarrier.wait(ds_empty.index(buf), ((j // 2) & 1) ^ 1)  # fresh barriers pass phase 1
        tile = ds_smem.index(buf)
        tile.slice(WG * ROWS, ROWS, dim=0).store(dsb)
        fence_async_shared()
        _barrier()
        mbarrier.arrive(ds_full.index(buf), count=1)
        acc2, acc1, _, _ = warpgroup_mma_wait(0, deps=(tok2, tok1, pa, dsa))
        mbarrier.arrive(empty.index(st), count=1)
        for h in gl.static_range(SLICES):
            if (h + j) % CONSUMERS == WG:  # dQ rows j * BLOCK_S + h * 64 onwards: dS[h] K over both halves
                mbarrier.wait(ds_full.index(buf), (j // 2) & 1)  # the other consumer's keys written
                dq = zero_o
                for c in gl.static_range(CONSUMERS):
                    a = tile.slice(c * ROWS, ROWS, dim=0).slice(h * ROWS, ROWS, dim=1).permute((1, 0))
                    dq = warpgroup_mma(a, k_smem.index(c).reshape([ROWS, D]), dq, use_acc=c > 0)
                _add_dq(dq, dq_desc, dq_smem.index(WG), off_b, off_h, j * BLOCK_S + h * ROWS, D)
        mbarrier.arrive(ds_empty.index(buf), count=1)
    tma.store_wait(0)

    _store_key_grads(acc1 * sm_scale, acc2, DK, DV, Redo, bh, off_b, off_h, first, pid_r, NK, stride_kb,
                     stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, D, o_layout, WG)


@gluon.jit
def bwd_fused_kernel(
    k_desc, v_desc, q_desc, do_desc, dq_desc, Lse, Delta, DK, DV, Redo,
    H, NK, NQ, own_tiles, stride_lb, stride_lh, stride_lm,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale,
    D: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr,
):
    """The whole backward in one pass: grid ``(own_tiles * B * H,)`` over tiles of ``64 * CONSUMERS`` keys,
    one head's tiles adjacent. Resident K, V; streamed Q, dO (``NQ`` queries); ``DK``, ``DV`` ``[B, H, NK,
    D]`` (head dim contiguous; ``stride_k*`` / ``stride_v*`` their other strides); ``dq_desc`` over a float32
    ``[B, H, NQ, D]`` accumulator, zeroed before the launch, that receives ``dS K`` (``dQ / scale``) summed
    over the key programs; ``Redo`` ``[B * H, cdiv(NK, 64)]`` the dK/dV flags; ``Lse``, ``Delta`` and the
    scales as ``bwd_kernel``."""
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, 1, BLOCK_S, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, 1, BLOCK_S, D], do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS * CONSUMERS, BLOCK_S], q_desc.dtype)
    ds_smem = gl.allocate_shared_memory(q_desc.dtype, [2, ROWS * CONSUMERS, BLOCK_S], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 1, 1, ROWS, D], dq_desc.layout)
    r_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(r_bar, count=1)
    ready, empty = stage_ring(STAGES, CONSUMERS)
    # a dS buffer is full once both consumers wrote their keys' rows, empty once both read it
    ds_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(2):
        mbarrier.init(ds_full.index(b), count=CONSUMERS)
        mbarrier.init(ds_empty.index(b), count=CONSUMERS)
    gl.warp_specialize([
        (_consume_fused, (k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem,
                          ds_smem, dq_smem, r_bar, ready, empty, ds_full, ds_empty, Lse, Delta, DK, DV, Redo,
                          H, NK, NQ, own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh,
                          stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_S, STAGES,
                          0)),
        (_consume_fused, (k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem,
                          ds_smem, dq_smem, r_bar, ready, empty, ds_full, ds_empty, Lse, Delta, DK, DV, Redo,
                          H, NK, NQ, own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh,
                          stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_S, STAGES,
                          1)),
        (_produce_fused, (k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem,
                          ds_smem, dq_smem, r_bar, ready, empty, ds_full, ds_empty, Lse, Delta, DK, DV, Redo,
                          H, NK, NQ, own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh,
                          stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_S, STAGES,
                          0)),
    ], [4, 1], [232, 24])


# ---- the FP32-accurate five-product backward: float32 inputs as float16 parts (``fp16x3``) ---------------

_P_SCALE = gl.constexpr(14)  # P <= 1 is split scaled by 2^14, as in the generic fp16x3 kernels


@gluon.jit
def _produce_f16x3(k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                   dq_smem, r_bar, ready, empty, KE, VE, QE, DOE, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                   own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn, stride_vb,
                   stride_vh, stride_vn, qk_scale, sm_scale, D: gl.constexpr, BLOCK_S: gl.constexpr,
                   STAGES: gl.constexpr, WG: gl.constexpr):
    """The producer: both parts (high, low) of the program's keys and values once, 64 rows per consumer,
    then both parts of each streamed query tile's ``Q`` and ``dO`` into the ring of stages. The parts are
    ``[2, B * H, N, D]`` tensors, so a tile's coordinates are ``(part, head, row, 0)``."""
    pid = gl.program_id(0)
    bh = pid // own_tiles
    off_r = (pid % own_tiles) * (ROWS * CONSUMERS)
    mbarrier.expect(r_bar, 2 * CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):
        for part in gl.static_range(2):
            tma.async_copy_global_to_shared(k_desc, [part, bh, off_r + c * ROWS, 0], r_bar,
                                            k_smem.index(2 * c + part))
            tma.async_copy_global_to_shared(v_desc, [part, bh, off_r + c * ROWS, 0], r_bar,
                                            v_smem.index(2 * c + part))
    stream_part_pairs(q_desc, do_desc, q_smem, do_smem, ready, empty, bh, NQ, BLOCK_S, STAGES)


@triton.jit
def _clamp_exponent(arg):
    """``min(arg, 0)``, NaN kept (``bwd._probs``'s clamp: ``P <= 1`` although the recomputed score may pass
    the lse by a rounding; a NaN logit still makes its row NaN)."""
    return tl.minimum(arg, 0.0, propagate_nan=tl.PropagateNan.ALL)


@gluon.jit
def _consume_f16x3(k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                   dq_smem, r_bar, ready, empty, KE, VE, QE, DOE, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                   own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn, stride_vb,
                   stride_vh, stride_vn, qk_scale, sm_scale, D: gl.constexpr, BLOCK_S: gl.constexpr,
                   STAGES: gl.constexpr, WG: gl.constexpr):
    """Keys ``WG * 64`` onwards of the program's tile, FP32-accurate: per streamed query tile the five
    products of ``_consume_fused`` from float16 parts, three tensor-core products each (``fwd_sm90.mm3``) into
    a fresh float32 accumulator whose parts' power-of-two scales are then undone exactly (``dots.unscale``)
    and which is added to the running sums in IEEE float32 -- ``bwd._dkdv_loop``'s ``fp16x3`` arithmetic.
    ``dS^T`` is split in registers (one power of two for the consumer's 64 x ``BLOCK_S`` tile) into shared
    memory, read there by ``dK += dS^T Q`` and, transposed, by this consumer's own part of ``dQ_j = dS K``
    over its 64 keys, which goes through shared memory into ``dQacc`` by TMA reduce-add (float32,
    unscaled): each consumer adds its own keys' part, so no consumer waits for the other's ``dS``."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_S, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    # keys past NK (zero rows of K and V) get P = dS = 0
    pid_r, bh, off_b, off_h, first, lse_base, delta_base, cols, key_ok = _key_consumer(
        Lse, Delta, H, NK, NQ, own_tiles, stride_lb, stride_lh, BLOCK_S, WG, s_layout)
    # its keys' parts' exponents (a second consumer past the last key has none: its rows are not stored)
    key_tile = pid_r * CONSUMERS + WG
    has_keys = key_tile < gl.cdiv(NK, ROWS)
    k_c = gl.load(KE + bh.to(gl.int64) * gl.cdiv(NK, ROWS) + key_tile, mask=has_keys, other=0)
    v_c = gl.load(VE + bh.to(gl.int64) * gl.cdiv(NK, ROWS) + key_tile, mask=has_keys, other=0)
    q_tiles = gl.cdiv(NQ, BLOCK_S)

    k_hi = k_smem.index(2 * WG).reshape([ROWS, D])
    k_lo = k_smem.index(2 * WG + 1).reshape([ROWS, D])
    v_hi = v_smem.index(2 * WG).reshape([ROWS, D])
    v_lo = v_smem.index(2 * WG + 1).reshape([ROWS, D])
    ds_hi = ds_smem.index(2 * WG)
    ds_lo = ds_smem.index(2 * WG + 1)
    zero = gl.zeros([ROWS, BLOCK_S], gl.float32, s_layout)
    zero_o = gl.zeros([ROWS, D], gl.float32, o_layout)
    dk = gl.zeros([ROWS, D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, D], gl.float32, o_layout)
    mbarrier.wait(r_bar, 0)
    for j in range(q_tiles):
        st = j % STAGES
        lse2, delta = _row_vectors(Lse, Delta, lse_base, delta_base, j * BLOCK_S + cols, NQ, stride_lm)
        q_c = gl.load(QE + bh.to(gl.int64) * q_tiles + j)
        do_c = gl.load(DOE + bh.to(gl.int64) * q_tiles + j)
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        q_hi = q_smem.index(2 * st).reshape([BLOCK_S, D])
        q_lo = q_smem.index(2 * st + 1).reshape([BLOCK_S, D])
        do_hi = do_smem.index(2 * st).reshape([BLOCK_S, D])
        do_lo = do_smem.index(2 * st + 1).reshape([BLOCK_S, D])
        x = mm3(k_hi, k_lo, q_hi.permute((1, 0)), q_lo.permute((1, 0)), zero)  # S^T, scaled
        y = mm3(v_hi, v_lo, do_hi.permute((1, 0)), do_lo.permute((1, 0)), zero)  # dP^T, scaled
        x, y = warpgroup_mma_wait(0, deps=(x, y))
        # P^T <= 1 (the exponent clamped at 0 against the recomputed score passing lse by a rounding)
        arg = unscale(x, k_c + q_c) * qk_scale - lse2[None, :]
        p = gl.exp2(_clamp_exponent(arg))
        p = gl.where(key_ok[:, None], p, 0.0)
        ds = p * (unscale(y, v_c + do_c) - delta[None, :])
        p_hi, p_lo = f16_pair(p * 16384.0)
        pa_hi = gl.convert_layout(p_hi, a_layout)
        pa_lo = gl.convert_layout(p_lo, a_layout)
        s_hi, s_lo, ds_c = split_f16(ds)
        _barrier()  # every warp's reads of the previous tile's dS^T are done
        ds_hi.store(s_hi)
        ds_lo.store(s_lo)
        fence_async_shared()
        _barrier()
        fv = mm3(pa_hi, pa_lo, do_hi, do_lo, zero_o)  # P^T dO, scaled
        fk = mm3(ds_hi, ds_lo, q_hi, q_lo, zero_o)  # dS^T Q, scaled
        fv, fk, _, _ = warpgroup_mma_wait(0, deps=(fv, fk, pa_hi, pa_lo))
        mbarrier.arrive(empty.index(st), count=1)
        dv += unscale(fv, do_c + _P_SCALE)
        dk += unscale(fk, ds_c + q_c)
        # this consumer's keys' part of dQ_j = dS K
        fq = mm3(ds_hi.permute((1, 0)), ds_lo.permute((1, 0)), k_hi, k_lo, zero_o)
        fq = warpgroup_mma_wait(0, deps=(fq,))
        _add_dq(unscale(fq, ds_c + k_c), dq_desc, dq_smem.index(WG), off_b, off_h, j * BLOCK_S, D)
    tma.store_wait(0)

    _store_key_grads(dk * sm_scale, dv, DK, DV, Redo, bh, off_b, off_h, first, pid_r, NK, stride_kb,
                     stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, D, o_layout, WG)


@gluon.jit
def bwd_fused_f16x3_kernel(
    k_desc, v_desc, q_desc, do_desc, dq_desc, KE, VE, QE, DOE, Lse, Delta, DK, DV, Redo,
    H, NK, NQ, own_tiles, stride_lb, stride_lh, stride_lm,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale,
    D: gl.constexpr, BLOCK_S: gl.constexpr, STAGES: gl.constexpr,
):
    """The FP32-accurate (``fp16x3``) backward of float32 inputs in one pass, as ``bwd_fused_kernel``: grid
    ``(own_tiles * B * H,)`` over tiles of ``64 * CONSUMERS`` keys, one head's tiles adjacent. The
    descriptors are over ``bwd._split_pair_kernel``'s float16 parts ``[2, B * H, N, D]`` (high, low): K and
    V split in 64-key tiles (exponents ``KE``, ``VE`` ``[B * H, cdiv(NK, 64)]``), Q and dO in tiles of
    ``BLOCK_S`` queries (``QE``, ``DOE`` ``[B * H, cdiv(NQ, BLOCK_S)]``); ``dq_desc`` over the zeroed float32
    ``[B, H, NQ, D]`` sum of ``dS K``; ``DK``, ``DV`` float32 ``[B, H, NK, D]`` (strides as
    ``bwd_fused_kernel``'s), ``Redo``, ``Lse``, ``Delta`` and the scales as there."""
    f16: gl.constexpr = gl.float16
    k_smem = gl.allocate_shared_memory(f16, [2 * CONSUMERS, 1, 1, ROWS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(f16, [2 * CONSUMERS, 1, 1, ROWS, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(f16, [2 * STAGES, 1, 1, BLOCK_S, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(f16, [2 * STAGES, 1, 1, BLOCK_S, D], do_desc.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([ROWS, BLOCK_S], f16)
    ds_smem = gl.allocate_shared_memory(f16, [2 * CONSUMERS, ROWS, BLOCK_S], ds_layout)
    dq_smem = gl.allocate_shared_memory(gl.float32, [CONSUMERS, 1, 1, BLOCK_S, D], dq_desc.layout)
    r_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(r_bar, count=1)
    ready, empty = stage_ring(STAGES, CONSUMERS)
    gl.warp_specialize([
        (_consume_f16x3, (k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                          dq_smem, r_bar, ready, empty, KE, VE, QE, DOE, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                          own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_S, STAGES, 0)),
        (_consume_f16x3, (k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                          dq_smem, r_bar, ready, empty, KE, VE, QE, DOE, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                          own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_S, STAGES, 1)),
        (_produce_f16x3, (k_desc, v_desc, q_desc, do_desc, dq_desc, k_smem, v_smem, q_smem, do_smem, ds_smem,
                          dq_smem, r_bar, ready, empty, KE, VE, QE, DOE, Lse, Delta, DK, DV, Redo, H, NK, NQ,
                          own_tiles, stride_lb, stride_lh, stride_lm, stride_kb, stride_kh, stride_kn,
                          stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_S, STAGES, 0)),
    ], [4, 1], [232, 24])
