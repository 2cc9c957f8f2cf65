"""The dense half-precision forward for Hopper (sm90), warp-specialised, in Gluon.

The same fold as ``fwd._fwd_kernel`` for float16/bfloat16 inputs without a mask, bias or causality (the
(m, S, W) monoid over key tiles, ``monoid.tile_weights`` with the scale in the exponent), laid out the way
Hopper overlaps the softmax with the tensor cores, which Triton 3.6 does not generate from the generic
kernel (``docs/kernel_notes.md``, "The Hopper forward"):

* one *producer* warp loads the program's query tile once and each key tile's keys and values by TMA into
  a ring of ``STAGES`` shared-memory stages (4-D descriptors over ``[B, H, N, D]``, so ViT's strided views of
  a fused qkv projection are read in place; reads past ``N`` are zero-filled);
* ``CONSUMERS`` warpgroups own 64 query rows each. For key tile ``j`` a consumer issues ``S_j = q k_j^T``
  and ``W += P_{j-1} v_{j-1}`` asynchronously, waits for ``S_j`` alone (``wgmma.wait_group 1``) and forms
  tile ``j``'s weights while the value product is still on the tensor cores, then waits for it, releases
  the stage of tile ``j-1`` and rescales ``W``. In the machine code ptxas moves the wait for the value
  product above the exponentials; the other consumers' products run under them. Two schedules that keep
  a consumer's own product under its softmax measured slower and were removed (the weights through shared
  memory; FlashAttention-3's ping-pong of two warpgroups): ``docs/kernel_notes.md``, "The Hopper forward".

Only the last key tile is masked (``N % BLOCK_N`` keys past the end read as zeros and get ``-inf`` logits).

``attention_fwd_f16x3_kernel`` runs the FP32-accurate (``"fp16x3"``) forward of float32 inputs on the same
structure: the producer streams both float16 parts of each key and value tile as ``fwd._split_kv_kernel``
split them once, each consumer splits its ``q * qk_scale`` once and forms ``S`` and ``P V`` as three float16
wgmma each into fresh float32 accumulators (``dots.matmul_f16x3``'s arithmetic, scales undone exactly), and
folds them in IEEE float32 as ``monoid.fold_parts`` does: its output is the generic kernel's on the same
key tiles, bit for bit. Plain running sums, so for at most ``2 * monoid.SEGMENT_KEYS["fp16x3"]`` keys.

Non-finite inputs: a visible key's NaN logit or ``+inf`` makes its row NaN and ``-inf`` logits hide their
keys, as in the reference, but a value row holding an infinity or a NaN multiplies a weight that is exactly 0
(a hidden key, or one whose weight underflowed) into NaN, where the reference gives the key's own columns
(or nothing). A program whose state is not finite at the end therefore records its query tile in
``Redo`` (one int32 flag per 64 query rows of a head, 1 = redo), and ``fwd`` runs the generic kernel over
those rows only (its fast pass, then its exact pass).
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .dots import f16_pair, pow2, score_unscale, split_f16
from .monoid import count_nonfinite, finalize_state, finite_part, store_lse, tile_weights

__all__ = ["CONFIGS", "LARGE", "LARGE_WAVES", "ROWS", "SPLIT_CONFIGS", "supported", "supported_split",
           "config", "descriptor", "stage_ring", "stream_pairs", "stream_part_pairs", "mm3",
           "attention_fwd_kernel", "attention_fwd_f16x3_kernel", "NUM_WARPS"]

NUM_WARPS = 4  # the default partition: the first consumer warpgroup
ROWS = gl.constexpr(64)  # query rows per consumer warpgroup (one wgmma M)

# (BLOCK_N, STAGES, CONSUMERS) per head dim, the measured winners (docs/kernel_notes.md,
# "The Hopper forward"); LARGE: the config of grids of at least LARGE_WAVES waves of LARGE's query tiles
# (three consumer warpgroups: more products in flight per SM, but 192-row tiles leave a larger last wave on
# smaller grids).
CONFIGS = {64: (128, 3, 2), 128: (128, 3, 2)}
LARGE = {64: (128, 3, 3)}
LARGE_WAVES = 8

# (BLOCK_N, STAGES) of the FP32-accurate kernel per head dim, two consumer warpgroups (docs/kernel_notes.md,
# "The FP32-accurate Hopper forward": at head dim 64 128-key tiles beat 64, two stages of both parts beat
# three; at head dim 128 the query parts wait in shared memory beside two stages of 64-key tiles).
SPLIT_CONFIGS = {64: (128, 2), 128: (64, 2)}


def _dense_sm90(q, k, v, has_mask: bool, dtypes: tuple, head_dims) -> bool:
    """An sm90 GPU, no mask, bias or causality (``has_mask``), q, k and v of one dtype among ``dtypes``, one
    head dim among ``head_dims`` (the same for values), at least one query and one key."""
    if has_mask or not q.is_cuda or q.dtype not in dtypes or k.dtype != q.dtype or v.dtype != q.dtype:
        return False
    if torch.cuda.get_device_capability(q.device) != (9, 0):
        return False
    D = q.shape[-1]
    return D in head_dims and k.shape[-1] == D and v.shape[-1] == D and k.shape[2] > 0 and q.shape[2] > 0


def supported(q, k, v, has_mask: bool) -> bool:
    """Whether this kernel runs the forward of these tensors: an sm90 GPU, float16/bfloat16, no mask, bias
    or causality (``has_mask``), head dims 64 or 128 (the same for values), at least one key, the head dim
    contiguous and every other stride and the base 16-byte aligned (TMA)."""
    if not _dense_sm90(q, k, v, has_mask, (torch.float16, torch.bfloat16), CONFIGS):
        return False
    for t in (q, k, v):
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def supported_split(q, k, v, has_mask: bool) -> bool:
    """Whether ``attention_fwd_f16x3_kernel`` runs the FP32-accurate forward of these tensors: an sm90 GPU,
    float32, no mask, bias or causality, head dims in ``SPLIT_CONFIGS`` (the same for values), at least one
    query and key, the query's head dim contiguous (its rows are read by plain loads, any other strides; the
    keys and values by the split pass, any strides)."""
    return _dense_sm90(q, k, v, has_mask, (torch.float32,), SPLIT_CONFIGS) and q.stride(-1) == 1


def config(D: int, Nq: int, heads: int, sms: int) -> tuple[int, int, int]:
    """``(BLOCK_N, STAGES, CONSUMERS)`` for head dim ``D``, ``Nq`` query rows of
    ``heads`` (batch x heads) heads on ``sms`` multiprocessors."""
    large = LARGE.get(D)
    if large is not None and -(-Nq // (ROWS.value * large[2])) * heads >= LARGE_WAVES * sms:
        return large
    return CONFIGS[D]


def descriptor(t, block_rows: int) -> TensorDescriptor:
    """The TMA descriptor of ``t [B, H, N, D]`` (any strides with ``D`` contiguous) in tiles of
    ``[1, 1, block_rows, D]``."""
    D = t.shape[-1]
    dtype = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[t.dtype]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, block_rows, D], dtype)
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, block_rows, D], layout)


# The partitions share one signature (Gluon's rule for worker partitions); each reads what it needs.


@gluon.jit
def _produce(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out, Lse, Redo,
             H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, qk_scale,
             D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CONSUMERS: gl.constexpr, STORE_LSE: gl.constexpr):
    pid = gl.program_id(0)
    off_m = (pid % m_tiles) * BLOCK_M
    off_b = (pid // m_tiles) // H
    off_h = (pid // m_tiles) % H
    mbarrier.expect(q_bar, CONSUMERS * q_desc.block_type.nbytes)
    for c in gl.static_range(CONSUMERS):  # 64 rows per consumer
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, off_m + c * ROWS, 0], q_bar, q_smem.index(c))
    stream_pairs(k_desc, v_desc, k_smem, v_smem, ready, empty, off_b, off_h, N, BLOCK_N, STAGES)


@gluon.jit
def stage_ring(STAGES: gl.constexpr, CONSUMERS: gl.constexpr):
    """``(ready, empty)``: the mbarriers of a ring of ``STAGES`` shared-memory stages, ``ready`` completed by
    the producer's loads (one arrival with the bytes expected), ``empty`` by every consumer warpgroup
    releasing the stage (``CONSUMERS`` arrivals)."""
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)
    return ready, empty


@gluon.jit
def stream_pairs(desc1, desc2, smem1, smem2, ready, empty, off_b, off_h, N, BLOCK: gl.constexpr,
                 STAGES: gl.constexpr):
    """A producer's loop: tiles ``j`` of ``BLOCK`` rows of two ``[B, H, N, D]`` tensors (head ``off_b``,
    ``off_h``) by TMA into a ring of ``STAGES`` shared-memory stages, stage ``j % STAGES`` once its
    consumers have released it (``empty``), completing on its ``ready`` barrier. The Hopper forward streams
    keys and values with it, the backward passes (``bwd_sm90``) their streamed pair."""
    nbytes: gl.constexpr = desc1.block_type.nbytes + desc2.block_type.nbytes
    for j in range(gl.cdiv(N, BLOCK)):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(desc1, [off_b, off_h, j * BLOCK, 0], bar, smem1.index(s))
        tma.async_copy_global_to_shared(desc2, [off_b, off_h, j * BLOCK, 0], bar, smem2.index(s))


@gluon.jit
def stream_part_pairs(desc1, desc2, smem1, smem2, ready, empty, bh, N, BLOCK: gl.constexpr,
                      STAGES: gl.constexpr):
    """``stream_pairs`` for two operands split into float16 parts (``[2, B * H, N, D]`` tensors, high parts
    then low, so a tile's coordinates are ``(part, head, row, 0)``; ``bh`` the head): both parts of each
    tile, four TMA loads into slots ``2 * s`` and ``2 * s + 1`` of stage ``s``. The FP32-accurate forward
    streams keys and values with it, the FP32-accurate backward queries and output gradients."""
    nbytes: gl.constexpr = 2 * (desc1.block_type.nbytes + desc2.block_type.nbytes)
    for j in range(gl.cdiv(N, BLOCK)):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        for part in gl.static_range(2):
            tma.async_copy_global_to_shared(desc1, [part, bh, j * BLOCK, 0], bar, smem1.index(2 * s + part))
            tma.async_copy_global_to_shared(desc2, [part, bh, j * BLOCK, 0], bar, smem2.index(2 * s + part))


@gluon.jit
def _masked(scores, j, N, BLOCK_N: gl.constexpr, layout: gl.constexpr):
    """``scores`` of key tile ``j`` with ``-inf`` past key ``N`` (only the last tile has such keys)."""
    if (j + 1) * BLOCK_N > N:
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        scores = gl.where((cols < N)[None, :], scores, float("-inf"))
    return scores


@gluon.jit
def _consume(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out, Lse, Redo,
             H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, qk_scale,
             D: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
             CONSUMERS: gl.constexpr, STORE_LSE: gl.constexpr, WG: gl.constexpr):
    """Rows ``WG * 64`` onwards of the program's query tile: the key loop, then ``W / S`` and the lse."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, D, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    pid_m = pid % m_tiles
    off_b = (pid // m_tiles) // H
    off_h = (pid // m_tiles) % H
    n_tiles = gl.cdiv(N, BLOCK_N)

    q = q_smem.index(WG).reshape([ROWS, D])
    zero = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    m = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    acc = gl.zeros([ROWS, D], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)

    # Tile 0: its scores and weights; its value product is issued with tile 1's scores.
    mbarrier.wait(ready.index(0), 0)
    scores = warpgroup_mma(q, k_smem.index(0).reshape([BLOCK_N, D]).permute((1, 0)), zero, use_acc=False)
    scores = _masked(scores, 0, N, BLOCK_N, s_layout)
    m, alpha, p = tile_weights(m, scores, qk_scale)
    s = gl.sum(p, 1)
    p_op = gl.convert_layout(p.to(dtype), p_layout)
    for j in range(1, n_tiles):
        st = j % STAGES
        prev = (j - 1) % STAGES
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        k_t = k_smem.index(st).reshape([BLOCK_N, D]).permute((1, 0))
        v_prev = v_smem.index(prev).reshape([BLOCK_N, D])
        # S_j is formed in the registers of S_{j-1} (dead once its weights are formed)
        s_tok = warpgroup_mma(q, k_t, scores, use_acc=False, is_async=True)
        o_tok = warpgroup_mma(p_op, v_prev, acc, is_async=True)
        scores = warpgroup_mma_wait(1, deps=(s_tok,))  # S_j done; P_{j-1} v_{j-1} still running
        scores = _masked(scores, j, N, BLOCK_N, s_layout)
        m, alpha, p = tile_weights(m, scores, qk_scale)
        s = s * alpha + gl.sum(p, 1)
        acc, _ = warpgroup_mma_wait(0, deps=(o_tok, p_op))
        mbarrier.arrive(empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
        p_op = gl.convert_layout(p.to(dtype), p_layout)
    last = (n_tiles - 1) % STAGES
    acc = warpgroup_mma(p_op, v_smem.index(last).reshape([BLOCK_N, D]), acc)
    mbarrier.arrive(empty.index(last), count=1)

    m = gl.convert_layout(m, gl.SliceLayout(1, o_layout))
    s = gl.convert_layout(s, gl.SliceLayout(1, o_layout))
    out, lse = finalize_state(m, s, acc)
    rows = pid_m * BLOCK_M + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    row_ok = rows < NQ
    o_ptrs = (Out + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
              + rows.to(gl.int64)[:, None] * stride_om + cols[None, :])
    gl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=row_ok[:, None])
    if STORE_LSE:  # a float64 Lse (partial results) is formed again from the row's state
        lse_ptrs = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows
        store_lse(lse_ptrs, m, s, lse, row_ok)
    bad = count_nonfinite(gl.where(row_ok[:, None], acc, 0.0)) + count_nonfinite(gl.where(row_ok, s, 0.0))
    block = pid_m * CONSUMERS + WG  # these 64 rows' flag: 1 = the generic kernel redoes them (docstring)
    if block < gl.cdiv(NQ, ROWS):
        gl.store(Redo + (pid // m_tiles) * gl.cdiv(NQ, ROWS) + block, (bad != 0).to(gl.int32))


@gluon.jit
def attention_fwd_kernel(
    q_desc, k_desc, v_desc, Out, Lse, Redo,
    H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, qk_scale,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CONSUMERS: gl.constexpr,
    STORE_LSE: gl.constexpr,
):
    """Grid ``(m_tiles * B * H,)``, query tiles of ``64 * CONSUMERS`` rows, one head's tiles adjacent.
    ``Out [B, H, NQ, D]`` (its head dim contiguous; the inputs' dtype, or float32 for a partial result),
    ``Lse [B, H, NQ]`` float32, or float64 for a partial result (``STORE_LSE``; ``monoid.store_lse``),
    ``Redo`` ``[B * H, cdiv(NQ, 64)]`` int32 flags, set to 1 for the 64 query rows whose state is not finite;
    ``qk_scale`` is the base-2 logit scale (``scale * log2(e)``)."""
    BLOCK_M: gl.constexpr = ROWS * CONSUMERS
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [STAGES, 1, 1, BLOCK_N, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [STAGES, 1, 1, BLOCK_N, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    ready, empty = stage_ring(STAGES, CONSUMERS)
    # One tuple literal per partition: a tuple bound to a name would turn its constexprs into tensors.
    if CONSUMERS == 2:
        gl.warp_specialize([
            (_consume, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE, 0)),
            (_consume, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE, 1)),
            (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                        qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE)),
        ], [4, 1], [232, 24])  # the second consumer warpgroup and the producer warp: warps, registers
    else:
        gl.warp_specialize([
            (_consume, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE, 0)),
            (_consume, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE, 1)),
            (_consume, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb,
                        stride_lh, qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE, 2)),
            (_produce, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_bar, ready, empty, Out,
                        Lse, Redo, H, NQ, N, m_tiles, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
                        qk_scale, D, BLOCK_M, BLOCK_N, STAGES, CONSUMERS, STORE_LSE)),
        ], [4, 4, 1], [160, 160, 24])


# --------------------------------------------------------------------------- FP32-accurate (fp16x3) forward


@gluon.jit
def mm3(a_hi, a_lo, b_hi, b_lo, acc):
    """``a_hi b_lo + a_lo b_hi + a_hi b_hi`` into the fresh accumulator ``acc`` (its contents are not read),
    issued asynchronously (the caller waits): ``dots.matmul_f16x3``'s three float16 products, the small
    terms first."""
    acc = warpgroup_mma(a_hi, b_lo, acc, use_acc=False, is_async=True)
    acc = warpgroup_mma(a_lo, b_hi, acc, is_async=True)
    return warpgroup_mma(a_hi, b_hi, acc, is_async=True)


_P_SCALE = gl.constexpr(16384.0)  # the weights P <= 1 are split scaled by 2^14, as monoid.weighted_parts
_barrier = gl.barrier if hasattr(gl, "barrier") else gl.thread_barrier  # (thread_barrier in older Triton)


@gluon.jit
def _produce_f16x3(kp_desc, vp_desc, k_smem, v_smem, q_smem, ready, empty, Q, KE, VE, Out, Lse, Redo, H, NQ,
                   N, m_tiles, stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om, stride_lb,
                   stride_lh, qk_scale, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   STORE_LSE: gl.constexpr):
    """The producer warp: both float16 parts of each key and value tile into the ring of stages."""
    stream_part_pairs(kp_desc, vp_desc, k_smem, v_smem, ready, empty, gl.program_id(0) // m_tiles, N, BLOCK_N,
                      STAGES)


@gluon.jit
def _consume_f16x3(kp_desc, vp_desc, k_smem, v_smem, q_smem, ready, empty, Q, KE, VE, Out, Lse, Redo, H, NQ,
                   N, m_tiles, stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om, stride_lb,
                   stride_lh, qk_scale, D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
                   STORE_LSE: gl.constexpr, WG: gl.constexpr):
    """Rows ``WG * 64`` onwards of the program's 128-row query tile: ``q * qk_scale`` split once (one power of
    two for the 64 rows; a row holding a NaN or an infinity is split as zeros and sets the 64 rows' flag),
    then per key tile ``S`` and ``P V`` as three float16 products each, folded as ``monoid.fold_parts``. The
    query parts stay in registers at head dim 64; at 128, where ``W``, a fresh ``P V`` (64 x 128 float32
    each) and the weights' parts fill them, they wait in ``q_smem`` (the products read them from there)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, D, 16])
    qa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=s_layout, k_width=2)
    pa_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    pid = gl.program_id(0)
    pid_m = pid % m_tiles
    bh = pid // m_tiles
    off_b = bh // H
    off_h = bh % H
    n_tiles = gl.cdiv(N, BLOCK_N)
    rows = pid_m * 2 * ROWS + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    row_ok = rows < NQ
    q = gl.load(Q + off_b.to(gl.int64) * stride_qb + off_h.to(gl.int64) * stride_qh
                + rows.to(gl.int64)[:, None] * stride_qm + dims[None, :], mask=row_ok[:, None], other=0.0)
    q_bad = gl.sum(gl.where(gl.abs(q) < float("inf"), 0, 1), 1)  # NaN or infinite entries per row
    q_hi, q_lo, q_c = split_f16(finite_part(q) * qk_scale)  # the scores carry the base-2 logit scale
    if D > 64:
        qa_hi = q_smem.index(2 * WG)
        qa_lo = q_smem.index(2 * WG + 1)
        qa_hi.store(q_hi)
        qa_lo.store(q_lo)
        fence_async_shared()  # the stores, before the tensor cores read them
        _barrier()
    else:
        qa_hi = gl.convert_layout(q_hi, qa_layout)
        qa_lo = gl.convert_layout(q_lo, qa_layout)
    zero_s = gl.zeros([ROWS, BLOCK_N], gl.float32, s_layout)
    zero_o = gl.zeros([ROWS, D], gl.float32, o_layout)
    m = gl.full([ROWS], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    s = gl.zeros([ROWS], gl.float32, gl.SliceLayout(1, s_layout))
    w = gl.zeros([ROWS, D], gl.float32, o_layout)
    ke_base = KE + bh.to(gl.int64) * N
    ve_base = VE + bh.to(gl.int64) * n_tiles * D
    for j in range(n_tiles):
        st = j % STAGES
        cols = j * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        col_ok = cols < N
        k_c = gl.load(ke_base + cols, mask=col_ok, other=0)
        v_c = gl.load(ve_base + j * D + dims)
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        k_hi = k_smem.index(2 * st).reshape([BLOCK_N, D]).permute((1, 0))
        k_lo = k_smem.index(2 * st + 1).reshape([BLOCK_N, D]).permute((1, 0))
        sc = warpgroup_mma_wait(0, deps=(mm3(qa_hi, qa_lo, k_hi, k_lo, zero_s),))
        scores = sc * score_unscale(q_c + k_c)[None, :] + gl.where(col_ok, 0.0, float("-inf"))[None, :]
        m, alpha, p = tile_weights(m, scores)
        s = s * alpha + gl.sum(p, 1)
        p_hi, p_lo = f16_pair(p * _P_SCALE)
        pa_hi = gl.convert_layout(p_hi, pa_layout)
        pa_lo = gl.convert_layout(p_lo, pa_layout)
        v_hi = v_smem.index(2 * st).reshape([BLOCK_N, D])
        v_lo = v_smem.index(2 * st + 1).reshape([BLOCK_N, D])
        pv, _, _ = warpgroup_mma_wait(0, deps=(mm3(pa_hi, pa_lo, v_hi, v_lo, zero_o), pa_hi, pa_lo))
        mbarrier.arrive(empty.index(st), count=1)
        alpha_o = gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))
        w = w * alpha_o[:, None] + pv * (1.0 / _P_SCALE) * pow2(-v_c)[None, :]
    m = gl.convert_layout(m, gl.SliceLayout(1, o_layout))
    s = gl.convert_layout(s, gl.SliceLayout(1, o_layout))
    out, lse = finalize_state(m, s, w)
    gl.store(Out + off_b.to(gl.int64) * stride_ob + off_h.to(gl.int64) * stride_oh
             + rows.to(gl.int64)[:, None] * stride_om + dims[None, :], out.to(Out.dtype.element_ty),
             mask=row_ok[:, None])
    if STORE_LSE:  # a float64 Lse (partial results) is formed again from the row's state
        lse_ptrs = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh + rows
        store_lse(lse_ptrs, m, s, lse, row_ok)
    bad = (count_nonfinite(gl.where(row_ok[:, None], w, 0.0)) + count_nonfinite(gl.where(row_ok, s, 0.0))
           + gl.sum(gl.where(row_ok, q_bad, 0), 0))
    block = pid_m * 2 + WG  # these 64 rows' flag: 1 = the generic kernel redoes them
    if block < gl.cdiv(NQ, ROWS):
        gl.store(Redo + bh * gl.cdiv(NQ, ROWS) + block, (bad != 0).to(gl.int32))


@gluon.jit
def attention_fwd_f16x3_kernel(
    kp_desc, vp_desc, Q, KE, VE, Out, Lse, Redo, H, NQ, N, m_tiles,
    stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om, stride_lb, stride_lh, qk_scale,
    D: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, STORE_LSE: gl.constexpr,
):
    """Grid ``(m_tiles * B * H,)`` over query tiles of 128 rows (two consumer warpgroups), one head's tiles
    adjacent. ``Q [B, H, NQ, D]`` float32 (head dim contiguous); ``kp_desc`` / ``vp_desc``: descriptors
    (``descriptor(parts, BLOCK_N)``) over ``fwd._split_kv_kernel``'s parts ``[2, B * H, N, D]`` split in
    tiles of ``BLOCK_N`` keys, with ``KE [B * H, N]`` and ``VE [B * H, cdiv(N, BLOCK_N), D]`` their
    exponents; ``Out [B, H, NQ, D]`` float32 (head dim contiguous); ``Lse [B, H, NQ]`` float32, or float64
    for a partial result (``STORE_LSE``; ``monoid.store_lse``); ``Redo`` ``[B * H, cdiv(NQ, 64)]`` int32
    flags, 1 for the 64 query rows whose state is not finite or whose queries are not; ``qk_scale`` is the
    base-2 logit scale."""
    k_smem = gl.allocate_shared_memory(gl.float16, [2 * STAGES, 1, 1, BLOCK_N, D], kp_desc.layout)
    v_smem = gl.allocate_shared_memory(gl.float16, [2 * STAGES, 1, 1, BLOCK_N, D], vp_desc.layout)
    if D > 64:  # both consumers' query parts (_consume_f16x3)
        q_smem = gl.allocate_shared_memory(gl.float16, [4, ROWS, D],
                                           gl.NVMMASharedLayout.get_default_for([ROWS, D], gl.float16))
    else:  # unused
        q_smem = k_smem
    ready, empty = stage_ring(STAGES, 2)
    gl.warp_specialize([
        (_consume_f16x3, (kp_desc, vp_desc, k_smem, v_smem, q_smem, ready, empty, Q, KE, VE, Out, Lse, Redo,
                          H, NQ, N, m_tiles, stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
                          stride_lb, stride_lh, qk_scale, D, BLOCK_N, STAGES, STORE_LSE, 0)),
        (_consume_f16x3, (kp_desc, vp_desc, k_smem, v_smem, q_smem, ready, empty, Q, KE, VE, Out, Lse, Redo,
                          H, NQ, N, m_tiles, stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
                          stride_lb, stride_lh, qk_scale, D, BLOCK_N, STAGES, STORE_LSE, 1)),
        (_produce_f16x3, (kp_desc, vp_desc, k_smem, v_smem, q_smem, ready, empty, Q, KE, VE, Out, Lse, Redo,
                          H, NQ, N, m_tiles, stride_qb, stride_qh, stride_qm, stride_ob, stride_oh, stride_om,
                          stride_lb, stride_lh, qk_scale, D, BLOCK_N, STAGES, STORE_LSE)),
    ], [4, 1], [232, 24])  # the second consumer warpgroup and the producer warp: warps, registers
