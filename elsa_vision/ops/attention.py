"""The public attention functions: ``elsa_attention``, ``elsa_attention_qkvpacked`` and
``elsa_attention_varlen``.

Layout and conventions follow ``torch.nn.functional.scaled_dot_product_attention`` (``[B, H, N, D]``) and
FlashAttention (bottom-right aligned causal mask; rows that see no key return 0, never NaN).

The Triton path has FlashAttention's three tiers: two torch operators without autograd of their own
(``elsa_vision::attention_fwd`` and ``elsa_vision::attention_bwd``, declared with ``_library.define_op``: a
kernel and a fake kernel each, so ``torch.compile(fullgraph=True)`` sees one opaque node per call), one
``torch.autograd.Function`` that saves ``q, k, v, out, lse`` and calls the backward operator, and the public
function, which checks its inputs once (``ops.checks``). Everything below it trusts them: the operators'
bodies and the kernels' launchers (``kernels.fwd`` / ``bwd`` / ``decode``) only look their launch programs up
by signature (``kernels.launch``). The packed entry (``elsa_attention_qkvpacked``, FlashAttention's
``[B, N, 3, H, D]``) has a backward operator of its own, ``elsa_vision::attention_bwd_qkvpacked``, which
writes the three gradients into one packed buffer: the gradient of the fused projection, with no
``stack`` of three gradients and no copy out of a permuted layout behind it.
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

from ..kernels.precision import PRECISIONS, accumulation_dtype
from ..kernels.reference import scan_attention
from ._library import define_op, eager_bypass
from .checks import (
    BACKENDS,
    SUPPORTED_DTYPES,
    TRITON_MAX_HEAD_DIM,
    check_attention_inputs,
    check_eca_call,
    check_options,
    check_qkvpacked_inputs,
    check_triton_call,
    check_varlen_inputs,
)
from .numerics import cuda_matmul_precision

__all__ = [
    "elsa_attention", "elsa_attention_qkvpacked", "elsa_attention_varlen", "PRECISIONS", "BACKENDS",
    "SUPPORTED_DTYPES",
    "resolve_backend", "check_options", "inference_call",
]

# Rows per query chunk of the torch backend: bounds its memory at O(chunk * Nk) for long sequences.
TORCH_QUERY_CHUNK = 1024


def resolve_backend(backend: str, q: Tensor, dropout_p: float = 0.0) -> str:
    """The backend ``"auto"`` stands for: ``"triton"`` where a kernel covers the call (CUDA, float16 /
    bfloat16 / float32, head dims up to ``TRITON_MAX_HEAD_DIM``, no attention dropout), else ``"torch"``."""
    if backend != "auto":
        return backend
    if q.is_cuda and q.dtype != torch.float64 and dropout_p == 0.0 and q.shape[-1] <= TRITON_MAX_HEAD_DIM \
            and _triton_available():
        return "triton"
    return "torch"


def _triton_available() -> bool:
    from ..kernels import triton_available

    return triton_available()


# ---------------------------------------------------------------------------------------------------------
# The Triton path: two operators without autograd of their own, one autograd.Function around them.


@functools.cache
def _kernels():
    """The Triton kernel modules ``(fwd, bwd, decode)``, imported on first use (the package imports without
    Triton)."""
    from ..kernels import bwd, decode, fwd

    return fwd, bwd, decode


def _forward_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
    """The launch program of the forward: the stream-K few-query path where ``choose_forward`` picks it, the
    dense two-level scan otherwise."""
    fwd, _, decode = _kernels()
    B, H, Nq, _ = q.shape
    Nk = k.shape[2]
    if Nq <= decode.DECODE_MAX_QUERIES and Nk >= decode.DECODE_MIN_KEYS \
            and decode.choose_forward(B, H, Nq, Nk, device=q.device) == "decode":
        return decode.decode_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    return fwd.fwd_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)


def attention_fwd(q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
    """The body of ``elsa_vision::attention_fwd``: ``(out, lse)`` of trusted inputs through the Triton
    forward's launch program. (Context parallelism's partial results use the dense forward's program built
    for merging instead: ``kernels.fwd.fwd_program(..., partial=True)``.)"""
    program = _forward_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    return program(q, k, v, attn_bias, key_padding_mask)


def _attention_out(q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
    """``attention_fwd`` without the log-sum-exp (``(out, None)``): what an eager inference call runs in
    place of the forward operator."""
    program = _forward_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    return program(q, k, v, attn_bias, key_padding_mask, need_lse=False)


def _attention_fwd_fake(q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
    B, H, Nq, _ = q.shape
    out = q.new_empty(B, Nq, H, v.shape[-1]).transpose(1, 2)  # the kernels' layout (fwd.empty_output)
    return out, q.new_empty(B, H, Nq, dtype=torch.float32)


def _attention_bwd(dout, q, k, v, out, lse, attn_bias, key_padding_mask, causal, scale, precision, bias_grad):
    dq, dk, dv, dbias = _kernels()[1].elsa_bwd(
        dout, q, k, v, out, lse, attn_bias, key_padding_mask, causal, scale, precision, bias_grad)
    return dq, dk, dv, (dbias if dbias is not None else q.new_empty(0))


def _attention_bwd_fake(dout, q, k, v, out, lse, attn_bias, key_padding_mask, causal, scale, precision,
                        bias_grad):
    dbias = attn_bias.new_empty(attn_bias.shape) if bias_grad else q.new_empty(0)
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), dbias


def unpack_qkv(qkv: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(q, k, v)``, each ``[B, H, N, D]``: views of a packed ``[B, N, 3, H, D]`` tensor."""
    return qkv.permute(2, 0, 3, 1, 4).unbind(0)


def _attention_bwd_qkvpacked(dout, qkv, out, lse, causal, scale, precision):
    q, k, v = unpack_qkv(qkv)
    dqkv = torch.empty(qkv.shape, dtype=qkv.dtype, device=qkv.device)
    _kernels()[1].elsa_bwd(dout, q, k, v, out, lse, None, None, causal, scale, precision,
                           grads=unpack_qkv(dqkv))
    return dqkv


def _attention_bwd_qkvpacked_fake(dout, qkv, out, lse, causal, scale, precision):
    return qkv.new_empty(qkv.shape)


_ATTENTION_BWD_QKVPACKED = define_op(
    "attention_bwd_qkvpacked",
    "(Tensor dout, Tensor qkv, Tensor out, Tensor lse, bool causal, float scale, str precision) -> Tensor",
    _attention_bwd_qkvpacked, _attention_bwd_qkvpacked_fake,
)
_ATTENTION_BWD = define_op(
    "attention_bwd",
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, Tensor? attn_bias, "
    "Tensor? key_padding_mask, bool causal, float scale, str precision, bool bias_grad) "
    "-> (Tensor, Tensor, Tensor, Tensor)",
    _attention_bwd, _attention_bwd_fake,
)
_ATTENTION_FWD = define_op(
    "attention_fwd",
    "(Tensor q, Tensor k, Tensor v, Tensor? attn_bias, Tensor? key_padding_mask, bool causal, float scale, "
    "str precision) -> (Tensor, Tensor)",
    attention_fwd, _attention_fwd_fake,
)


class _ElsaAttention(torch.autograd.Function):
    """The Triton path with autograd: forward operator, saved ``(q, k, v, out, lse)``, backward operator."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
        args = (q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
        out, lse = eager_bypass(q, attention_fwd, _ATTENTION_FWD)(*args)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias, key_padding_mask)
        ctx.causal, ctx.scale, ctx.precision = causal, scale, precision
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, attn_bias, key_padding_mask = ctx.saved_tensors
        bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
        args = (dout, q, k, v, out, lse, attn_bias, key_padding_mask, ctx.causal, ctx.scale, ctx.precision,
                bias_grad)
        dq, dk, dv, dbias = eager_bypass(dout, _attention_bwd, _ATTENTION_BWD)(*args)
        return dq, dk, dv, (dbias if bias_grad else None), None, None, None, None


class _ElsaAttentionQKVPacked(torch.autograd.Function):
    """The Triton path of a packed ``qkv`` with autograd: the forward operator on its views, saved ``(qkv,
    out, lse)``, the packed backward operator (one ``dqkv``)."""

    @staticmethod
    def forward(ctx, qkv, causal, scale, precision):
        q, k, v = unpack_qkv(qkv)
        args = (q, k, v, None, None, causal, scale, precision)
        out, lse = eager_bypass(qkv, attention_fwd, _ATTENTION_FWD)(*args)
        ctx.save_for_backward(qkv, out, lse)
        ctx.causal, ctx.scale, ctx.precision = causal, scale, precision
        return out

    @staticmethod
    def backward(ctx, dout):
        qkv, out, lse = ctx.saved_tensors
        dqkv = eager_bypass(dout, _attention_bwd_qkvpacked, _ATTENTION_BWD_QKVPACKED)(
            dout, qkv, out, lse, ctx.causal, ctx.scale, ctx.precision)
        return dqkv, None, None, None


def _triton_attention(q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (attn_bias is not None and attn_bias.requires_grad)):
        return _ElsaAttention.apply(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    # inference: eager calls store no log-sum-exp
    return eager_bypass(q, _attention_out, _ATTENTION_FWD)(
        q, k, v, attn_bias, key_padding_mask, causal, scale, precision)[0]


def inference_call(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                   precision: str = "auto", backend: str = "auto"):
    """``elsa_attention(q, k, v, causal=..., scale=..., precision=..., backend=...)`` checked and planned
    once: returns ``f(q, k, v) -> out`` for later inference calls (no autograd, no bias or mask) on tensors
    with the same shapes, strides, dtype, device and alignment as these, or None where the call is not one
    Triton launch program (another backend). Layers keep ``f`` per input signature, so that a steady-state
    call does no validation, no backend choice and no plan lookup (``ElsaAttention``)."""
    check_attention_inputs(q, k, v, None, None, causal, scale, precision, backend, 0.0)
    if resolve_backend(backend, q) != "triton":
        return None
    check_triton_call("elsa_attention", q, v)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    program = _forward_program(q, k, v, None, None, causal, scale, precision)

    def call(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        return program(q, k, v, need_lse=False)[0]

    return call


def _torch_backend(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, dropout_p):
    dtype = q.dtype
    B, H, Nq, _ = q.shape
    if B * H * Nq == 0 or k.shape[2] == 0:
        # Nothing to compute, or rows that see no key (0): the empty products give exactly that, with a graph
        return (q @ k.transpose(-2, -1)) @ v
    compute = accumulation_dtype(q)
    qc, kc, vc = (t.to(compute) for t in (q, k, v))
    ctx = cuda_matmul_precision(precision == "tf32") if q.is_cuda and dtype == torch.float32 else (
        contextlib.nullcontext())
    with ctx:
        out = scan_attention(
            qc, kc, vc, attn_bias=attn_bias, key_padding_mask=key_padding_mask, causal=causal, scale=scale,
            query_chunk=TORCH_QUERY_CHUNK, dropout_p=dropout_p,
        )
    return out.to(dtype)


def elsa_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    attn_bias: Tensor | None = None,
    key_padding_mask: Tensor | None = None,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
    backend: str = "auto",
    dropout_p: float = 0.0,
) -> Tensor:
    """Exact softmax attention computed as the ELSA scan.

    Args:
        q: queries ``[B, H, Nq, D]``.
        k: keys ``[B, H, Nk, D]`` (``Nk`` may differ from ``Nq``: cross-attention).
        v: values ``[B, H, Nk, Dv]`` (``Dv`` may differ from ``D``). Any strides.
        attn_bias: float tensor broadcastable to ``[B, H, Nq, Nk]``, added after scaling; ``-inf`` hides a
            key; differentiable.
        key_padding_mask: bool ``[B, Nk]``; True = the key takes part (SDPA's convention).
        causal: query ``i`` sees key ``j`` iff ``j <= i + (Nk - Nq)`` (bottom-right aligned, as
            FlashAttention; equal to SDPA's ``is_causal`` when ``Nq == Nk``).
        scale: logit scale, default ``D ** -0.5``.
        precision: for float32 inputs: ``"auto"`` (FP32-accurate, relative error <= 1e-6 vs float64),
            ``"ieee"`` (plain FP32 arithmetic, no tensor cores), ``"tf32x3"`` (FP32-accurate on tensor
            cores), ``"fp16x3"`` (FP32-accurate
            from three float16 tensor-core products per dot: each fp32 tile scaled by a power of two and
            split into two float16 parts; forward and backward, head dims up to 128, wider ones run it
            as ``"tf32x3"``; what ``"auto"`` picks on sm90), ``"tf32"`` (one TF32 pass, ~1e-3). Ignored
            for float16/bfloat16 (float32 accumulation always) and float64. See ``kernels.precision``.
        backend: ``"auto"`` (Triton on CUDA where a kernel covers the call: float16/bfloat16/float32, head
            dims up to 256, no attention dropout; torch otherwise), ``"torch"`` (the reference scan; any
            device, full autograd), ``"triton"``, ``"eca"`` (causal self-attention on the Exact Causal
            Attention products: fewer multiply-adds, needs ``causal=True`` and ``Nq == Nk``, materialises
            ``[B, H, N, N]``; for CPU/edge devices where FLOPs matter; never chosen by ``"auto"``).
        dropout_p: attention dropout probability (torch backend; 0 in eval).

    Returns:
        ``[B, H, Nq, Dv]`` in the dtype of ``q`` (empty when ``B``, ``H`` or ``Nq`` is 0). Rows with no
        visible key are 0, never NaN. A key hidden from a row (causality, the padding mask, a ``-inf`` bias)
        contributes nothing to it, in the output and the gradients, whatever its key and value rows hold
        (NaN and infinities included); as in softmax, a NaN logit (or a ``+inf`` bias) among a row's
        visible keys makes the row NaN, and a NaN or an infinity in column ``c`` of a visible key's value
        makes column ``c`` of the row non-finite (``kernels/reference.py``). The Triton backend stores it
        as ``[B, Nq, H, Dv]`` (as SDPA's flash and efficient backends do), so that
        ``out.transpose(1, 2).reshape(B, Nq, H * Dv)`` is a view, not a copy.
    """
    check_attention_inputs(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, backend, dropout_p)
    return _attention_on("elsa_attention", resolve_backend(backend, q, dropout_p), q, k, v, attn_bias,
                         key_padding_mask, causal, scale, precision, dropout_p)


def _attention_on(who, chosen, q, k, v, attn_bias, key_padding_mask, causal, scale, precision, dropout_p):
    """The attention of checked inputs on the backend ``chosen`` (``resolve_backend``), what that backend
    cannot take refused naming ``who``: the public entries' one dispatch."""
    if chosen == "triton":
        check_triton_call(who, q, v, dropout_p)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return _triton_attention(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    if chosen == "eca":
        from ..kernels.eca import eca_attention

        check_eca_call(who, q, k, causal, dropout_p)
        return eca_attention(q, k, v, attn_bias=attn_bias, key_padding_mask=key_padding_mask, scale=scale)
    return _torch_backend(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, dropout_p)


def elsa_attention_qkvpacked(
    qkv: Tensor,
    *,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
    backend: str = "auto",
) -> Tensor:
    """Self-attention of a packed ``qkv`` (FlashAttention's ``flash_attn_qkvpacked_func`` convention).

    Args:
        qkv: ``[B, N, 3, H, D]``: queries, keys and values of one fused projection (``qkv(x).view(B, N, 3,
            H, D)`` of a ``Linear(dim, 3 * H * D)``, as timm's ViT builds them); any strides.
        causal, scale, precision, backend: as in :func:`elsa_attention` (no bias, mask or dropout).

    Returns:
        ``[B, N, H, D]`` in ``qkv``'s dtype (``.reshape(B, N, H * D)`` is a view): the same values as
        ``elsa_attention(q, k, v).transpose(1, 2)`` on ``q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)``.
        With autograd on the Triton backend the backward writes ``qkv``'s gradient as one contiguous
        ``[B, N, 3, H, D]`` tensor, where the unpacked call's gradient passes through ``unbind``'s
        ``stack`` and a copy out of the permuted layout (two more kernels and buffers of ``qkv``'s size
        per call).
    """
    check_qkvpacked_inputs(qkv, causal, scale, precision, backend)
    who = "elsa_attention_qkvpacked"
    chosen = resolve_backend(backend, qkv)
    if chosen == "triton" and torch.is_grad_enabled() and qkv.requires_grad:  # the packed backward
        check_triton_call(who, qkv, qkv)
        scale = qkv.shape[-1] ** -0.5 if scale is None else float(scale)
        return _ElsaAttentionQKVPacked.apply(qkv, causal, scale, precision).transpose(1, 2)
    q, k, v = unpack_qkv(qkv)
    return _attention_on(who, chosen, q, k, v, None, None, causal, scale, precision, 0.0).transpose(1, 2)


def elsa_attention_varlen(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    causal: bool = False,
    scale: float | None = None,
    precision: str = "auto",
    backend: str = "auto",
) -> Tensor:
    """Attention over packed sequences of different lengths (FlashAttention's varlen convention).

    Args:
        q: ``[total_q, H, D]``; k: ``[total_k, H, D]``; v: ``[total_k, H, Dv]``: the tokens of all sequences
            concatenated, no padding (e.g. images of different sizes, NaViT-style).
        cu_seqlens_q / cu_seqlens_k: int32 ``[batch + 1]`` cumulative lengths; sequence ``i`` owns query
            rows ``cu_seqlens_q[i]:cu_seqlens_q[i+1]`` and keys ``cu_seqlens_k[i]:cu_seqlens_k[i+1]``. On CUDA
            their values are trusted (checking them would synchronise with the device); on the CPU they are
            checked.
        max_seqlen_q / max_seqlen_k: the longest lengths (host integers: no call reads the offsets back).
        causal, scale, precision, backend: as in ``elsa_attention`` (causal is bottom-right aligned within
            each sequence).

    Returns:
        ``[total_q, H, Dv]`` in q's dtype; a sequence attends only to its own keys. Inference on the Triton
        backend runs one packed launch; with autograd (and on the torch backend) the sequences are laid out
        padded to ``[batch, H, max_seqlen, D]`` on the device, keys past a sequence's end hidden, and run
        through the differentiable ``elsa_attention``: no host synchronisation on either path.
    """
    check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                        precision, backend)
    chosen = resolve_backend(backend, q)
    if chosen == "triton":
        check_triton_call("elsa_attention_varlen", q, v)
    if chosen == "triton" and not (torch.is_grad_enabled()
                                   and (q.requires_grad or k.requires_grad or v.requires_grad)):
        from ..kernels.fwd import elsa_fwd_varlen

        cu_q, cu_k = (cu if cu.is_contiguous() else cu.contiguous() for cu in (cu_seqlens_q, cu_seqlens_k))
        out, _ = elsa_fwd_varlen(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal=causal, scale=scale,
                                 precision=precision)
        return out
    return _varlen_padded(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                          precision, "torch" if chosen == "torch" else "triton")


def _varlen_padded(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, precision, backend):
    """Packed sequences through ``elsa_attention`` on a padded ``[batch, H, max_len, D]`` layout, built and
    read back with device-side index arithmetic (no ``.tolist()``)."""
    batch = cu_q.numel() - 1
    total_q, H, D = q.shape
    dev = q.device
    if total_q == 0 or max_q == 0:
        return q.new_zeros(total_q, H, v.shape[2])

    def layout(cu, total):
        cu = cu.long()
        tok = torch.arange(total, device=dev)
        seq = torch.searchsorted(cu[1:], tok, right=True)  # the sequence each token belongs to
        return seq, tok - cu[seq], cu[1:] - cu[:-1]

    seq_q, pos_q, len_q = layout(cu_q, total_q)
    seq_k, pos_k, len_k = layout(cu_k, k.shape[0])
    Mk = max(max_k, 1)

    def padded(t, seq, pos, m):
        return t.new_zeros(batch, m, H, t.shape[2]).index_put((seq, pos), t).transpose(1, 2)

    qp, kp, vp = padded(q, seq_q, pos_q, max_q), padded(k, seq_k, pos_k, Mk), padded(v, seq_k, pos_k, Mk)
    kpm = torch.arange(Mk, device=dev)[None, :] < len_k[:, None]
    bias, causal_flag = None, False
    if causal:
        if cu_q is cu_k and max_q == max_k:
            causal_flag = True  # equal lengths: bottom-right on the padded grid is each sequence's diagonal
        else:  # bottom-right per sequence: query i sees key j iff j <= i + len_k - len_q
            rows = torch.arange(max_q, device=dev)[None, :, None] + (len_k - len_q)[:, None, None]
            keep = torch.arange(Mk, device=dev)[None, None, :] <= rows
            bias = torch.zeros(keep.shape, dtype=q.dtype, device=dev).masked_fill_(~keep, -math.inf)[:, None]
    out = elsa_attention(qp, kp, vp, attn_bias=bias, key_padding_mask=kpm, causal=causal_flag, scale=scale,
                         precision=precision, backend=backend)
    return out.transpose(1, 2)[seq_q, pos_q]
