"""The dense half-precision dK/dV pass for Hopper (sm90), warp-specialised, in Gluon: built, not routed.

The same gradients as ``bwd._bwd_dkdv_kernel`` for float16/bfloat16 inputs without a mask, bias or causality
(``dV = P^T dO``, ``dP^T = V dO^T``, ``dS^T = P^T (dP^T - Delta)``, ``dK = scale * dS^T Q``, with
``P^T = exp(scale * K Q^T - lse)`` recomputed from the forward's natural-log ``lse`` and ``Delta =
rowsum(O * dO)`` from the dQ pass), laid out as the Hopper forward (``fwd_sm90``) is:

* one *producer* warp loads the program's keys and values once (one 64-row tile per consumer) and each query
  tile's ``Q`` and ``dO`` by TMA into a ring of ``STAGES`` stages (4-D descriptors over ``[B, H, N, D]``:
  ``fwd_sm90.descriptor``; reads past ``N`` are zeros);
* ``CONSUMERS`` warpgroups own 64 keys each and fold every query tile into their ``dK`` and ``dV``
  accumulators: ``S^T`` and ``dP^T`` as wgmma from shared memory, ``P^T`` and ``dS^T`` formed in registers
  and fed back as the register operand of ``dV += P^T dO`` and ``dK += dS^T Q``; a stage is released once
  its four products are done.

Query rows past ``Nq`` get ``lse = +inf`` (``P = 0``) and ``Delta = 0``. A consumer whose gradients are not
finite flags its 64 keys in ``Redo`` (1 = redo), and ``bwd._HopperDkdv`` runs the generic kernel's ``REDO``
mode over them, as the forward does.

Not yet run on a GPU: ``bwd.HOPPER`` (off) routes to it; its GPU tests are ``tests/kernels/test_bwd_sm90.py``
(``docs/kernel_notes.md``, "The Hopper backward").
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma

from .fwd_sm90 import ROWS, descriptor
from .host import LOG2E
from .monoid import count_nonfinite

__all__ = ["CONFIGS", "CONSUMERS", "NUM_WARPS", "ROWS", "descriptor", "dkdv_kernel", "supported"]

NUM_WARPS = 4  # the default partition: the first consumer warpgroup
_LOG2E = gl.constexpr(LOG2E)

CONSUMERS = gl.constexpr(2)  # warpgroups of 64 keys per program
# (BLOCK_M, STAGES) per head dim: query rows per step (at head dim 128 each consumer holds two 64 x 128
# float32 accumulators, so its score tiles are 64 x 32) and stages of Q and dO. Not tuned.
CONFIGS = {64: (64, 2), 128: (32, 2)}


def supported(q, k, v, do) -> bool:
    """Whether this pass takes these tensors: an sm90 GPU, float16/bfloat16, head dims 64 or 128 (the same for
    values), the head dim contiguous and every other stride and the base 16-byte aligned (TMA)."""
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


# The partitions share one signature (Gluon's rule for worker partitions); each reads what it needs.


@gluon.jit
def _produce(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
             Lse, Delta, DK, DV, Redo, H, NQ, N, n_tiles, stride_lb, stride_lh, stride_lm,
             stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale,
             D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr):
    pid = gl.program_id(0)
    off_n = (pid % n_tiles) * (ROWS * CONSUMERS)
    off_b = (pid // n_tiles) // H
    off_h = (pid // n_tiles) % H
    mbarrier.expect(kv_bar, CONSUMERS * (k_desc.block_type.nbytes + v_desc.block_type.nbytes))
    for c in gl.static_range(CONSUMERS):  # 64 keys per consumer
        tma.async_copy_global_to_shared(k_desc, [off_b, off_h, off_n + c * ROWS, 0], kv_bar, k_smem.index(c))
        tma.async_copy_global_to_shared(v_desc, [off_b, off_h, off_n + c * ROWS, 0], kv_bar, v_smem.index(c))
    nbytes: gl.constexpr = q_desc.block_type.nbytes + do_desc.block_type.nbytes
    for j in range(gl.cdiv(NQ, BLOCK_M)):
        s = j % STAGES
        mbarrier.wait(empty.index(s), ((j // STAGES) & 1) ^ 1)  # fresh barriers pass phase 1
        bar = ready.index(s)
        mbarrier.expect(bar, nbytes)
        tma.async_copy_global_to_shared(q_desc, [off_b, off_h, j * BLOCK_M, 0], bar, q_smem.index(s))
        tma.async_copy_global_to_shared(do_desc, [off_b, off_h, j * BLOCK_M, 0], bar, do_smem.index(s))


@gluon.jit
def _consume(q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
             Lse, Delta, DK, DV, Redo, H, NQ, N, n_tiles, stride_lb, stride_lh, stride_lm,
             stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale,
             D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr):
    """Keys ``WG * 64`` onwards of the program's key tile: the loop over the query tiles, then dK, dV."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, BLOCK_M, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                     instr_shape=[16, D, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    dtype: gl.constexpr = q_desc.dtype
    pid = gl.program_id(0)
    pid_n = pid % n_tiles
    bh = pid // n_tiles
    off_b = bh // H
    off_h = bh % H

    k = k_smem.index(WG).reshape([ROWS, D])
    v = v_smem.index(WG).reshape([ROWS, D])
    zero = gl.zeros([ROWS, BLOCK_M], gl.float32, s_layout)
    dk = gl.zeros([ROWS, D], gl.float32, o_layout)
    dv = gl.zeros([ROWS, D], gl.float32, o_layout)
    cols = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    lse_base = Lse + off_b.to(gl.int64) * stride_lb + off_h.to(gl.int64) * stride_lh
    delta_base = Delta + bh.to(gl.int64) * NQ
    mbarrier.wait(kv_bar, 0)
    for j in range(gl.cdiv(NQ, BLOCK_M)):
        st = j % STAGES
        rows = j * BLOCK_M + cols
        row_ok = rows < NQ
        lse2 = gl.load(lse_base + rows.to(gl.int64) * stride_lm, mask=row_ok, other=float("inf")) * _LOG2E
        delta = gl.load(delta_base + rows, mask=row_ok, other=0.0)
        mbarrier.wait(ready.index(st), (j // STAGES) & 1)
        q = q_smem.index(st).reshape([BLOCK_M, D])
        do = do_smem.index(st).reshape([BLOCK_M, D])
        s_t = warpgroup_mma(k, q.permute((1, 0)), zero, use_acc=False)  # S^T [64 keys, BLOCK_M queries]
        dp_t = warpgroup_mma(v, do.permute((1, 0)), zero, use_acc=False)  # dP^T
        p_t = gl.exp2(s_t * qk_scale - lse2[None, :])
        ds_t = p_t * (dp_t - delta[None, :])
        dv = warpgroup_mma(gl.convert_layout(p_t.to(dtype), a_layout), do, dv)
        dk = warpgroup_mma(gl.convert_layout(ds_t.to(dtype), a_layout), q, dk)
        mbarrier.arrive(empty.index(st), count=1)

    dk = dk * sm_scale
    keys = pid_n * ROWS * CONSUMERS + WG * ROWS + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    dims = gl.arange(0, D, layout=gl.SliceLayout(0, o_layout))
    key_ok = keys < N
    k_ptrs = (DK + off_b.to(gl.int64) * stride_kb + off_h.to(gl.int64) * stride_kh
              + keys.to(gl.int64)[:, None] * stride_kn + dims[None, :])
    v_ptrs = (DV + off_b.to(gl.int64) * stride_vb + off_h.to(gl.int64) * stride_vh
              + keys.to(gl.int64)[:, None] * stride_vn + dims[None, :])
    gl.store(k_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok[:, None])
    gl.store(v_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok[:, None])
    bad = (count_nonfinite(gl.where(key_ok[:, None], dk, 0.0))
           + count_nonfinite(gl.where(key_ok[:, None], dv, 0.0)))
    block = pid_n * CONSUMERS + WG  # these 64 keys' flag: 1 = the generic kernel's exact pass redoes them
    if block < gl.cdiv(N, ROWS):
        gl.store(Redo + bh * gl.cdiv(N, ROWS) + block, (bad != 0).to(gl.int32))


@gluon.jit
def dkdv_kernel(
    q_desc, do_desc, k_desc, v_desc, Lse, Delta, DK, DV, Redo,
    H, NQ, N, n_tiles, stride_lb, stride_lh, stride_lm,
    stride_kb, stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale,
    D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
):
    """Grid ``(n_tiles * B * H,)``, key tiles of ``64 * CONSUMERS`` keys, one head's tiles adjacent. ``DK``,
    ``DV`` ``[B, H, N, D]`` (head dim contiguous; ``stride_k*`` / ``stride_v*`` their other strides), ``Lse``
    ``[B, H, NQ]`` float32 (natural log), ``Delta`` ``[B * H, NQ]`` float32, ``Redo`` ``[B * H, cdiv(N,
    64)]`` int32 flags; ``qk_scale`` is the base-2 logit scale (``scale * log2(e)``), ``sm_scale`` the
    softmax scale."""
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [STAGES, 1, 1, BLOCK_M, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(do_desc.dtype, [STAGES, 1, 1, BLOCK_M, D], do_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [CONSUMERS, 1, 1, ROWS, D], v_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=CONSUMERS)  # one arrival per consumer warpgroup
    # One tuple literal per partition: a tuple bound to a name would turn its constexprs into tensors.
    gl.warp_specialize([
        (_consume, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
                    Lse, Delta, DK, DV, Redo, H, NQ, N, n_tiles, stride_lb, stride_lh, stride_lm, stride_kb,
                    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_M,
                    STAGES, 0)),
        (_consume, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
                    Lse, Delta, DK, DV, Redo, H, NQ, N, n_tiles, stride_lb, stride_lh, stride_lm, stride_kb,
                    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_M,
                    STAGES, 1)),
        (_produce, (q_desc, do_desc, k_desc, v_desc, q_smem, do_smem, k_smem, v_smem, kv_bar, ready, empty,
                    Lse, Delta, DK, DV, Redo, H, NQ, N, n_tiles, stride_lb, stride_lh, stride_lm, stride_kb,
                    stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, qk_scale, sm_scale, D, BLOCK_M,
                    STAGES)),
    ], [4, 1], [232, 24])  # the second consumer warpgroup and the producer warp: warps, registers
