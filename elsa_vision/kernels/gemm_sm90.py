"""The ``"fp16x3"`` product loop of ``kernels.gemm`` for Hopper (sm90), warp-specialised, in Gluon.

The same product as ``gemm._gemm_kernel`` at ``"fp16x3"`` (float16 parts of both operands, three tensor-core
products per K-tile into a fresh float32 accumulator added to the running sum in IEEE float32, the row scales
undone in the epilogue, bias / GELU / split output / K slices), laid out the way Hopper runs matrix products
fastest, which Triton 3.6's own pipeliner does not generate for it (``docs/kernel_notes.md``, "FP32-accurate
GEMM"):

* one *producer* warp issues the TMA loads of the four float16 tiles of each K-step (``A`` high and low,
  ``B`` high and low: a descriptor over each operand's ``[2 * rows, K]`` parts, the low rows ``rows`` after
  the high ones) into a ring of ``STAGES`` shared-memory stages, each completing on its ``ready`` mbarrier;
* two *consumer* warpgroups each own 64 rows of the 128-row tile: they wait for a stage, issue the three
  asynchronous wgmma products from shared memory, wait for them, release the stage (``empty`` mbarrier, one
  arrival per consumer) and add the fresh products to their running sum. The two warpgroups synchronise
  only through the mbarriers, so one's additions and epilogue overlap the other's products;
* with ``A_F32`` (a float32 ``A`` with rows contiguous, for products at most ``gemm.A_F32_MAX_N`` wide or
  ``gemm.A_F32_MAX_M`` long) the producer loads ``A`` itself, each K-step in two float32 halves, and each
  consumer splits its rows in registers (one power-of-two scale per row and K-step, undone on the fresh
  product) and issues six wgmma products with ``A`` from registers: no split pass over ``A`` in memory;
* with ``TRANS_A`` (with ``A_F32``: ``A`` a transposed view, its columns contiguous, as a weight gradient's
  ``dy.T``) the producer loads ``[BLOCK_K, BLOCK_M / 2]`` tiles of the storage ``[K, M]`` for each consumer,
  which reads its rows transposed from shared memory into the same registers: no split pass and no
  transposed copy of ``A``;
* with ``TRANS_B`` (``B`` a transposed view, such as the weight gradient's ``x.T`` or the input gradient's
  ``w.T``) ``B``'s parts are stored as ``B`` is, ``[2, K, N]`` with ``N`` contiguous (``gemm._Split``'s
  column split without its transpose), loaded as ``[BLOCK_K, BLOCK_N]`` tiles and read by wgmma ``N``-major;
* the grid is persistent (at most one program per SM, each looping over work items), so the producer loads
  the next tile's first stages while the consumers finish the last one's epilogue.

TMA needs rows of 16-byte multiples (``K % 8 == 0`` for K-contiguous operands, ``M % 4 == 0`` / ``N % 8 == 0``
for transposed ones) and zero-fills reads past ``K``; rows past ``M`` (``N``) read the low parts or zeros and
are never stored. The planner (``gemm._plan``) sends other products to the
generic kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

from .dots import f16_pair, gemm_epilogue, pow2, scale_exponent, store_split

__all__ = ["gemm_ws_kernel", "parts_descriptor", "parts_t_descriptor", "f32_descriptor", "f32_t_descriptor",
           "NUM_WARPS"]

NUM_WARPS = 4  # the kernel's num_warps: its default partition, the first consumer warpgroup


def parts_descriptor(parts, block_rows: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of float16 parts ``[2, R, K]`` (contiguous, ``K % 8 == 0``) seen as ``[2R, K]``,
    in tiles of ``[block_rows, block_k]``."""
    _, R, K = parts.shape
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, block_k], gl.float16)
    return TensorDescriptor(parts, [2 * R, K], [K, 1], [block_rows, block_k], layout)


def f32_descriptor(x, block_rows: int, block_k: int) -> TensorDescriptor:
    """The TMA descriptor of a float32 ``x [R, K]`` (rows contiguous, 16-byte aligned rows and base) in
    tiles of ``[block_rows, block_k // 2]``: the ``A_F32`` loop loads each K-step in two halves."""
    layout = gl.NVMMASharedLayout.get_default_for([block_rows, block_k // 2], gl.float32)
    return TensorDescriptor(x, list(x.shape), [x.stride(0), 1], [block_rows, block_k // 2], layout)


def parts_t_descriptor(parts, block_k: int, block_cols: int) -> TensorDescriptor:
    """The TMA descriptor of float16 parts ``[2, K, R]`` (contiguous, ``R % 8 == 0``: the parts of a
    transposed operand stored as it is) in tiles of ``[1, block_k, block_cols]``; the part is a dimension of
    its own, so reads past ``K`` are zeros, not the low parts."""
    _, K, R = parts.shape
    layout = gl.NVMMASharedLayout.get_default_for([1, block_k, block_cols], gl.float16)
    return TensorDescriptor(parts, [2, K, R], [K * R, R, 1], [1, block_k, block_cols], layout)


def f32_t_descriptor(x, block_k: int, block_rows: int) -> TensorDescriptor:
    """The TMA descriptor of a transposed float32 ``x [R, K]`` (columns contiguous, 16-byte aligned columns
    and base) as its storage ``[K, R]``, in tiles of ``[block_k, block_rows // 2]``: the ``TRANS_A`` loop
    loads one tile per consumer warpgroup."""
    layout = gl.NVMMASharedLayout.get_default_for([block_k, block_rows // 2], gl.float32)
    return TensorDescriptor(x, [x.shape[1], x.shape[0]], [x.stride(1), 1], [block_k, block_rows // 2], layout)


@gluon.jit
def _work_tile(w, M, N, K, k_per_slice, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr,
               GROUP_M: gl.constexpr):
    """``(off_m, off_n, pid_n, pid_s, k_start, n_steps)`` of work item ``w``: the output tiles of K-slice 0
    in grouped order (``GROUP_M`` row-tiles share each column-tile while it sits in L2), then slice 1's..."""
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    tiles = tiles_m * tiles_n
    pid_s = w // tiles
    pid = w % tiles
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_m = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_m
    pid_n = (pid % per_group) // group_m
    k_start = pid_s * k_per_slice
    n_steps = gl.cdiv(gl.minimum(K, k_start + k_per_slice) - k_start, BLOCK_K)
    return pid_m * BLOCK_M, pid_n * BLOCK_N, pid_n, pid_s, k_start, n_steps


@gluon.jit
def _b_tile(b_bufs, i, BLOCK_K: gl.constexpr, BLOCK_N: gl.constexpr, TRANS_B: gl.constexpr):
    """Buffer ``i`` of ``B``'s parts as wgmma's ``[BLOCK_K, BLOCK_N]`` operand: K-major parts transposed in
    place, ``TRANS_B`` parts (``[1, BLOCK_K, BLOCK_N]``, N contiguous) as they are."""
    if TRANS_B:
        return b_bufs.index(i).reshape([BLOCK_K, BLOCK_N])
    else:
        return b_bufs.index(i).permute((1, 0))


@gluon.jit
def _split_a(a0, a1, layout: gl.constexpr):
    """One power-of-two scale per row of the float32 register tiles ``a0``, ``a1`` (the row's largest
    magnitude over both into ``[2^14, 2^15)``: ``dots.scale_exponent``) and their float16 parts
    (``dots.f16_pair``): ``(a0_hi, a0_lo, a1_hi, a1_lo, unscale)``, ``unscale`` the rows' ``2^-c`` in the
    accumulator's row layout."""
    c = scale_exponent(gl.maximum(gl.max(gl.abs(a0), 1), gl.max(gl.abs(a1), 1)))
    scale = pow2(c)[:, None]
    a0_hi, a0_lo = f16_pair(a0 * scale)
    a1_hi, a1_lo = f16_pair(a1 * scale)
    return a0_hi, a0_lo, a1_hi, a1_lo, gl.convert_layout(pow2(-c), gl.SliceLayout(1, layout))


@gluon.jit
def _f32_step(a_bufs, b_bufs, s, acc, layout: gl.constexpr, row0: gl.constexpr, HM: gl.constexpr,
              HK: gl.constexpr, BLOCK_N: gl.constexpr, TRANS_A: gl.constexpr, TRANS_B: gl.constexpr):
    """One K-step of the ``A_F32`` loop for rows ``row0 : row0 + HM`` of stage ``s``: A's float32 rows for
    this K-step in registers as two halves of ``HK`` columns -- from the two K-halves of the tile, or with
    ``TRANS_A`` from this warpgroup's transposed ``[2 HK, HM]`` tile -- scaled by one power of two per row
    and split into float16 parts (``_split_a``); six wgmma products with A from registers, B's parts sliced
    along K. Returns the fresh float32 product with the row scales undone (exact)."""
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=layout, k_width=2)
    if TRANS_A:
        a_t = a_bufs.index(2 * s + row0 // HM)  # [2 HK, HM]: this warpgroup's rows, K along dim 0
        a0 = a_t.slice(0, HK).permute((1, 0)).load(a_layout)
        a1 = a_t.slice(HK, HK).permute((1, 0)).load(a_layout)
    else:
        a0 = a_bufs.index(2 * s).slice(row0, HM).load(a_layout)
        a1 = a_bufs.index(2 * s + 1).slice(row0, HM).load(a_layout)
    a0_hi, a0_lo, a1_hi, a1_lo, unscale = _split_a(a0, a1, layout)
    if TRANS_B:
        b_hi = _b_tile(b_bufs, 2 * s, 2 * HK, BLOCK_N, True)
        b_lo = _b_tile(b_bufs, 2 * s + 1, 2 * HK, BLOCK_N, True)
        b_hi0 = b_hi.slice(0, HK)
        b_hi1 = b_hi.slice(HK, HK)
        b_lo0 = b_lo.slice(0, HK)
        b_lo1 = b_lo.slice(HK, HK)
    else:
        b_hi = b_bufs.index(2 * s)
        b_lo = b_bufs.index(2 * s + 1)
        b_hi0 = b_hi.slice(0, HK, dim=1).permute((1, 0))
        b_hi1 = b_hi.slice(HK, HK, dim=1).permute((1, 0))
        b_lo0 = b_lo.slice(0, HK, dim=1).permute((1, 0))
        b_lo1 = b_lo.slice(HK, HK, dim=1).permute((1, 0))
    fresh = warpgroup_mma(a0_hi, b_lo0, acc, use_acc=False, is_async=True)  # the small terms first
    fresh = warpgroup_mma(a1_hi, b_lo1, fresh, is_async=True)
    fresh = warpgroup_mma(a0_lo, b_hi0, fresh, is_async=True)
    fresh = warpgroup_mma(a1_lo, b_hi1, fresh, is_async=True)
    fresh = warpgroup_mma(a0_hi, b_hi0, fresh, is_async=True)
    fresh = warpgroup_mma(a1_hi, b_hi1, fresh, is_async=True)
    fresh, _, _, _, _ = warpgroup_mma_wait(0, deps=(fresh, a0_hi, a0_lo, a1_hi, a1_lo))  # A kept alive
    return fresh * unscale[:, None]


# The partitions share one signature (Gluon's rule for worker partitions); each reads what it needs.


@gluon.jit
def _produce(a_desc, b_desc, a_bufs, b_bufs, ready, empty, A_EXP, B_EXP, Bias, C, C_EXP,
             M, N, K, k_per_slice, work, stride_ae, stride_bias, stride_cs, stride_cm, stride_cn, stride_ce,
             c_lo, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, A_GROUP: gl.constexpr,
             SPLIT_OUT: gl.constexpr, A_F32: gl.constexpr, TRANS_A: gl.constexpr, TRANS_B: gl.constexpr):
    nbytes: gl.constexpr = 2 * a_desc.block_type.nbytes + 2 * b_desc.block_type.nbytes
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        off_m, off_n, pid_n, pid_s, k_start, n_steps = _work_tile(w, M, N, K, k_per_slice, BLOCK_M, BLOCK_N,
                                                                  BLOCK_K, GROUP_M)
        for i in range(n_steps):
            s = step % STAGES
            mbarrier.wait(empty.index(s), ((step // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
            bar = ready.index(s)
            mbarrier.expect(bar, nbytes)
            k = k_start + i * BLOCK_K
            if TRANS_A:  # the storage [K, M]: one [BLOCK_K, BLOCK_M / 2] tile per consumer
                tma.async_copy_global_to_shared(a_desc, [k, off_m], bar, a_bufs.index(2 * s))
                tma.async_copy_global_to_shared(a_desc, [k, off_m + BLOCK_M // 2], bar,
                                                a_bufs.index(2 * s + 1))
            elif A_F32:  # the float32 tile in two halves of K (a swizzled TMA box row holds 128 bytes)
                tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(2 * s))
                tma.async_copy_global_to_shared(a_desc, [off_m, k + BLOCK_K // 2], bar,
                                                a_bufs.index(2 * s + 1))
            else:
                tma.async_copy_global_to_shared(a_desc, [off_m, k], bar, a_bufs.index(2 * s))
                tma.async_copy_global_to_shared(a_desc, [M + off_m, k], bar, a_bufs.index(2 * s + 1))
            if TRANS_B:  # parts [2, K, N]
                tma.async_copy_global_to_shared(b_desc, [0, k, off_n], bar, b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(b_desc, [1, k, off_n], bar, b_bufs.index(2 * s + 1))
            else:
                tma.async_copy_global_to_shared(b_desc, [off_n, k], bar, b_bufs.index(2 * s))
                tma.async_copy_global_to_shared(b_desc, [N + off_n, k], bar, b_bufs.index(2 * s + 1))
            step += 1


@gluon.jit
def _consume(a_desc, b_desc, a_bufs, b_bufs, ready, empty, A_EXP, B_EXP, Bias, C, C_EXP,
             M, N, K, k_per_slice, work, stride_ae, stride_bias, stride_cs, stride_cm, stride_cn, stride_ce,
             c_lo, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
             STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, A_GROUP: gl.constexpr,
             SPLIT_OUT: gl.constexpr, A_F32: gl.constexpr, TRANS_A: gl.constexpr, TRANS_B: gl.constexpr,
             HALF: gl.constexpr):
    """Rows ``HALF * BLOCK_M / 2`` onwards of each tile: the products, then the epilogue of
    ``gemm._gemm_kernel`` (row and column scales, bias, GELU, float32 or split store)."""
    HM: gl.constexpr = BLOCK_M // 2
    layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_N, 16])
    step = 0
    for w in range(gl.program_id(0), work, gl.num_programs(0)):
        off_m, off_n, pid_n, pid_s, k_start, n_steps = _work_tile(w, M, N, K, k_per_slice, BLOCK_M, BLOCK_N,
                                                                  BLOCK_K, GROUP_M)
        offs_m = off_m + HALF * HM + gl.arange(0, HM, layout=gl.SliceLayout(1, layout))
        offs_n = off_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, layout))
        rows = gl.where(offs_m < M, offs_m, 0).to(gl.int64)
        cols = gl.where(offs_n < N, offs_n, 0).to(gl.int64)
        acc = gl.zeros([HM, BLOCK_N], gl.float32, layout)
        for i in range(n_steps):
            s = step % STAGES
            mbarrier.wait(ready.index(s), (step // STAGES) & 1)
            if A_F32:
                fresh = _f32_step(a_bufs, b_bufs, s, acc, layout, HALF * HM, HM, BLOCK_K // 2, BLOCK_N,
                                  TRANS_A, TRANS_B)
            else:
                a_hi = a_bufs.index(2 * s).slice(HALF * HM, HM)
                a_lo = a_bufs.index(2 * s + 1).slice(HALF * HM, HM)
                b_hi = _b_tile(b_bufs, 2 * s, BLOCK_K, BLOCK_N, TRANS_B)
                b_lo = _b_tile(b_bufs, 2 * s + 1, BLOCK_K, BLOCK_N, TRANS_B)
                fresh = warpgroup_mma(a_hi, b_lo, acc, use_acc=False, is_async=True)  # the small terms first
                fresh = warpgroup_mma(a_lo, b_hi, fresh, is_async=True)
                fresh = warpgroup_mma(a_hi, b_hi, fresh, is_async=True)
                fresh = warpgroup_mma_wait(0, deps=(fresh,))
            mbarrier.arrive(empty.index(s), count=1)
            if A_GROUP > 0:  # BLOCK_K divides A_GROUP: one exponent per row over this K-step
                group = (k_start + i * BLOCK_K) // A_GROUP
                fresh = fresh * pow2(-gl.load(A_EXP + rows * stride_ae + group))[:, None]
            acc += fresh
            step += 1
        unscale_rows: gl.constexpr = A_GROUP == 0 and not A_F32  # A_F32: undone at every K-step
        acc = gemm_epilogue(acc, A_EXP, B_EXP, Bias, rows, cols, stride_bias, unscale_rows, True, HAS_BIAS,
                            ACTIVATION)
        if SPLIT_OUT:
            store_split(C, C_EXP, acc, offs_m, offs_n, M, N, c_lo, stride_ce, pid_n)
        else:
            ptrs = C + pid_s.to(gl.int64) * stride_cs + offs_m[:, None].to(gl.int64) * stride_cm \
                + offs_n[None, :].to(gl.int64) * stride_cn
            gl.store(ptrs, acc, mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


@gluon.jit
def gemm_ws_kernel(
    a_desc, A_EXP, b_desc, B_EXP, Bias, C, C_EXP,
    M, N, K, k_per_slice, work, stride_ae, stride_bias, stride_cs, stride_cm, stride_cn, stride_ce, c_lo,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr, GROUP_M: gl.constexpr,
    STAGES: gl.constexpr, HAS_BIAS: gl.constexpr, ACTIVATION: gl.constexpr, A_GROUP: gl.constexpr,
    SPLIT_OUT: gl.constexpr, A_F32: gl.constexpr, TRANS_A: gl.constexpr, TRANS_B: gl.constexpr,
):
    """``work`` items (output tiles x K slices, ``k_per_slice`` apart) of ``C = A @ B^T`` from the
    descriptors of the float16 parts (``parts_descriptor``; ``parts_t_descriptor`` with ``TRANS_B``), or
    with ``A_F32`` of A itself in float32 (``f32_descriptor``; ``f32_t_descriptor`` with ``TRANS_A``: split
    in the consumers' registers), over a persistent grid. The other arguments are those of
    ``gemm._gemm_kernel`` at ``"fp16x3"``."""
    if TRANS_A:  # one [BLOCK_K, BLOCK_M / 2] tile of A's storage per consumer and stage
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BLOCK_K, BLOCK_M // 2], a_desc.layout)
    else:
        A_K: gl.constexpr = BLOCK_K // 2 if A_F32 else BLOCK_K
        a_bufs = gl.allocate_shared_memory(a_desc.dtype, [2 * STAGES, BLOCK_M, A_K], a_desc.layout)
    if TRANS_B:
        b_bufs = gl.allocate_shared_memory(gl.float16, [2 * STAGES, 1, BLOCK_K, BLOCK_N], b_desc.layout)
    else:
        b_bufs = gl.allocate_shared_memory(gl.float16, [2 * STAGES, BLOCK_N, BLOCK_K], b_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # one arrival per consumer warpgroup
    # One tuple literal per partition: a tuple bound to a name would turn its constexprs into tensors.
    gl.warp_specialize([
        (_consume, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, A_EXP, B_EXP, Bias, C, C_EXP,
                    M, N, K, k_per_slice, work, stride_ae, stride_bias, stride_cs, stride_cm, stride_cn,
                    stride_ce, c_lo, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, HAS_BIAS, ACTIVATION,
                    A_GROUP, SPLIT_OUT, A_F32, TRANS_A, TRANS_B, 0)),
        (_consume, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, A_EXP, B_EXP, Bias, C, C_EXP,
                    M, N, K, k_per_slice, work, stride_ae, stride_bias, stride_cs, stride_cm, stride_cn,
                    stride_ce, c_lo, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, HAS_BIAS, ACTIVATION,
                    A_GROUP, SPLIT_OUT, A_F32, TRANS_A, TRANS_B, 1)),
        (_produce, (a_desc, b_desc, a_bufs, b_bufs, ready, empty, A_EXP, B_EXP, Bias, C, C_EXP,
                    M, N, K, k_per_slice, work, stride_ae, stride_bias, stride_cs, stride_cm, stride_cn,
                    stride_ce, c_lo, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, STAGES, HAS_BIAS, ACTIVATION,
                    A_GROUP, SPLIT_OUT, A_F32, TRANS_A, TRANS_B)),
    ], [4, 1], [232, 24])  # the second consumer warpgroup and the producer warp: warps, registers
