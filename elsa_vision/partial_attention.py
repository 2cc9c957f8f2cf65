"""Partial attention: the building blocks of context parallelism (``elsa_vision.distributed``), whose ring
folds the results of one query shard against every key shard with the monoid.

Each function computes one (query shard, key shard) pair through the Triton kernels or the torch reference,
in ``kernels.precision.accumulation_dtype``; it sits beside ``distributed.py``, above ``ops``, which it
builds on.
"""

from __future__ import annotations

from .kernels.precision import accumulation_dtype
from .kernels.reference import attention_backward, merge_outputs, scan_attention
from .ops.attention import TORCH_QUERY_CHUNK

__all__ = ["partial_attention", "partial_attention_grads", "merge_partial"]


def partial_attention(q, k, v, key_padding_mask, attn_bias, causal, scale, precision, backend):
    """``(out, lse)`` of ``q`` against one key shard, ``out`` in ``accumulation_dtype(q)``, through
    ``backend`` (``"triton"``: the dense forward kernel writing a partial result, ``lse`` in float64 for the
    merges: ``kernels.fwd.fwd_program``'s ``partial``; else the reference scan, ``lse`` in the accumulation
    dtype). Inputs are trusted (checked by the caller's public entry)."""
    acc = accumulation_dtype(q)
    if backend == "triton":
        from .kernels.fwd import fwd_program  # on first use: the package imports without Triton

        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        program = fwd_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, partial=True)
        out, lse = program(q, k, v, attn_bias, key_padding_mask)
        return out.to(acc), lse
    return scan_attention(q.to(acc), k.to(acc), v.to(acc), attn_bias=attn_bias,
                          key_padding_mask=key_padding_mask, causal=causal, scale=scale,
                          query_chunk=TORCH_QUERY_CHUNK, return_lse=True)


def merge_partial(out, lse, out_b, lse_b, backend):
    """``(out, lse)`` of the same queries over the keys of two results, ``(out, lse)`` and ``(out_b,
    lse_b)``. ``"triton"``: merged into ``out`` and ``lse`` in place (``kernels.monoid.merge_outputs_``: no
    temporary), which are returned; else the reference's new tensors (``kernels.reference.merge_outputs``)."""
    if backend == "triton":
        from .kernels.monoid import merge_outputs_

        merge_outputs_(out, lse, out_b, lse_b)
        return out, lse
    return merge_outputs(out, lse, out_b, lse_b)


def partial_attention_grads(do, q, k, v, lse, delta, key_padding_mask, attn_bias, causal, scale, precision,
                            backend, want_dq):
    """One (query shard, key shard) pair's contribution to dQ (``want_dq``) or to (dK, dV), in the dtype of
    ``delta``, from the global ``lse`` and ``Delta = rowsum(O dO)`` of the shard's query rows."""
    acc = delta.dtype
    if backend == "triton":
        from .kernels.bwd import elsa_bwd  # on first use: the package imports without Triton

        dq, dk, dv, _ = elsa_bwd(
            do.to(q.dtype), q, k, v, None, lse.float(), attn_bias=attn_bias,
            key_padding_mask=key_padding_mask, causal=causal, scale=scale, precision=precision,
            delta=delta.float(), compute_dq=want_dq, compute_dkdv=not want_dq)
    else:
        dq, dk, dv, _ = attention_backward(do.to(acc), q.to(acc), k.to(acc), v.to(acc), None, lse,
                                           attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                                           causal=causal, scale=scale, delta=delta)
    return (dq.to(acc),) if want_dq else (dk.to(acc), dv.to(acc))
