"""The public attention functions: ``elsa_attention`` and ``elsa_attention_varlen``.

Layout and conventions follow ``torch.nn.functional.scaled_dot_product_attention`` (``[B, H, N, D]``) and
FlashAttention (bottom-right aligned causal mask; rows that see no key return 0, never NaN).

The Triton path has FlashAttention's three tiers: two torch operators without autograd of their own
(``elsa_vision::attention_fwd`` and ``elsa_vision::attention_bwd``, declared with ``_library.define_op``: a
kernel and a fake kernel each, so ``torch.compile(fullgraph=True)`` sees one opaque node per call), one
``torch.autograd.Function`` that saves ``q, k, v, out, lse`` and calls the backward operator, and the public
function, which checks its inputs once. Everything below it trusts them: the operators' bodies and the
kernels' launchers (``kernels.fwd`` / ``bwd`` / ``decode``) only look their launch programs up by signature
(``kernels.launch``).
"""

from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch import Tensor

from ..kernels import triton_runs_on
from ..kernels.precision import PRECISIONS
from ..kernels.reference import attention_backward, scan_attention
from ._library import define_op

__all__ = [
    "elsa_attention", "elsa_attention_varlen", "PRECISIONS", "BACKENDS", "SUPPORTED_DTYPES",
    "resolve_backend", "check_options", "inference_call",
]

BACKENDS = ("auto", "torch", "triton", "eca")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# Rows per query chunk of the torch backend: bounds its memory at O(chunk * Nk) for long sequences.
_TORCH_QUERY_CHUNK = 1024
# The widest head dim the Triton kernels take; ``backend="auto"`` runs wider heads on the torch backend.
TRITON_MAX_HEAD_DIM = 256


def check_options(who: str, backend: str, precision: str, prefix: str = "") -> None:
    """Raise a ``ValueError`` naming ``who`` for a ``backend`` / float32 ``precision`` that
    ``elsa_attention`` does not know (``prefix``: how the caller's arguments are named, e.g. ``"attn_"``)."""
    if precision not in PRECISIONS:
        raise ValueError(f"{who}: unknown {prefix}precision {precision!r}; expected one of {PRECISIONS}")
    if backend not in BACKENDS:
        raise ValueError(f"{who}: unknown {prefix}backend {backend!r}; expected one of {BACKENDS}")


def check_triton_device(who: str, q: Tensor) -> None:
    """Refuse, naming ``who``, tensors the Triton kernels cannot read: they take CUDA tensors, and CPU
    tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported)."""
    # (under torch.compile the check is left to eager calls: Dynamo cannot trace Triton's interpreter switch)
    if not q.is_cuda and not torch.compiler.is_compiling() and not triton_runs_on(q.device):
        raise ValueError(f"{who}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         f"triton is imported), got q on {q.device}; use backend='auto' or 'torch'")


def check_triton_call(who: str, q: Tensor, v: Tensor, dropout_p: float = 0.0) -> None:
    """What a call routed to ``backend="triton"`` needs (its dtype, head dims, device; no dropout), refused
    in one line naming ``who``. Every entry that launches the kernels checks it once."""
    if dropout_p > 0.0:
        raise ValueError(f"{who}: backend='triton' has no attention dropout; use backend='torch'")
    if q.dtype == torch.float64:
        raise TypeError(f"{who}: backend='triton' takes float16, bfloat16 or float32; float64 runs on "
                        "backend='torch'")
    if max(q.shape[-1], v.shape[-1]) > TRITON_MAX_HEAD_DIM:
        raise ValueError(f"{who}: backend='triton' takes head dims up to {TRITON_MAX_HEAD_DIM}, got q "
                         f"{_shape(q)}, v {_shape(v)}; use backend='auto' or 'torch'")
    check_triton_device(who, q)


def _shape(t: Tensor) -> str:
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def _check_inputs(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, backend, dropout_p):
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"elsa_attention: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"elsa_attention: `{name}` must have rank 4 [B, H, N, D], got shape {_shape(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(
                f"elsa_attention: `{name}` has unsupported dtype {t.dtype}; expected one of "
                f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}"
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(
            f"elsa_attention: q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(
            f"elsa_attention: q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    B, H, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"elsa_attention: batch size B must match: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    if k.shape[1] != H or v.shape[1] != H:
        raise ValueError(
            f"elsa_attention: head count H must match: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    if k.shape[3] != D:
        raise ValueError(f"elsa_attention: head dim D of k must equal q's ({D}), got k {_shape(k)}")
    if v.shape[2] != k.shape[2]:
        raise ValueError(
            f"elsa_attention: k and v must have the same length Nk, got k {_shape(k)}, v {_shape(v)}")
    if D == 0 or v.shape[3] == 0:
        raise ValueError(f"elsa_attention: head dims must be >= 1, got q {_shape(q)}, v {_shape(v)}")
    Nk = k.shape[2]
    if attn_bias is not None:
        if not isinstance(attn_bias, Tensor):
            raise TypeError(f"elsa_attention: `attn_bias` must be a tensor, got {type(attn_bias).__name__}")
        if not attn_bias.is_floating_point():
            raise TypeError(
                f"elsa_attention: `attn_bias` must be a floating-point tensor (use -inf to hide keys, or "
                f"`key_padding_mask` for a bool mask), got dtype {attn_bias.dtype}"
            )
        if attn_bias.device != q.device:
            raise ValueError(f"elsa_attention: `attn_bias` is on {attn_bias.device}, q on {q.device}")
        target = (B, H, Nq, Nk)
        ok = attn_bias.dim() <= 4 and all(
            s in (1, t) for s, t in zip(reversed(attn_bias.shape), reversed(target))
        )
        if not ok:
            raise ValueError(
                f"elsa_attention: `attn_bias` of shape {_shape(attn_bias)} is not broadcastable to "
                f"[B, H, Nq, Nk] = [{B}, {H}, {Nq}, {Nk}]"
            )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(
                "elsa_attention: `key_padding_mask` must be a bool tensor, got "
                f"{type(key_padding_mask).__name__}"
            )
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"elsa_attention: `key_padding_mask` must have dtype torch.bool (True = key takes part), "
                f"got {key_padding_mask.dtype}"
            )
        kshape = tuple(key_padding_mask.shape)
        if len(kshape) != 2 or kshape[0] not in (1, B) or kshape[1] != Nk:
            raise ValueError(
                f"elsa_attention: `key_padding_mask` must have shape [B, Nk] = [{B}, {Nk}], "
                f"got {_shape(key_padding_mask)}"
            )
        if key_padding_mask.device != q.device:
            raise ValueError(
                f"elsa_attention: `key_padding_mask` is on {key_padding_mask.device}, q on {q.device}")
    if not isinstance(causal, bool):
        raise TypeError(f"elsa_attention: `causal` must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TypeError(f"elsa_attention: `scale` must be a finite float or None, got {scale!r}")
    check_options("elsa_attention", backend, precision)
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"elsa_attention: `dropout_p` must be in [0, 1), got {dropout_p}")


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


@contextlib.contextmanager
def _cuda_matmul_precision(tf32: bool):
    """Pin CUDA float32 matmuls to IEEE (or TF32) for the torch backend; restores the setting on exit."""
    flag = torch.backends.cuda.matmul
    old = flag.allow_tf32
    flag.allow_tf32 = tf32
    try:
        yield
    finally:
        flag.allow_tf32 = old


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


def _attention_fwd(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, need_lse=True):
    program = _forward_program(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    return program(q, k, v, attn_bias, key_padding_mask, need_lse=need_lse)


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
    _attention_fwd, _attention_fwd_fake,
)


def direct(t: Tensor) -> bool:
    """Whether an operator call on ``t`` may run the operator's body directly: ``t`` is a plain tensor and
    nothing could intercept the call (no compilation or export tracing, no dispatch or torch-function mode, no
    functorch transform). Eager calls then skip the dispatcher's host time (``docs/kernel_notes.md``, "Host
    path"); everything that traces or transforms sees the operator."""
    return (type(t) is Tensor and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0 and not torch._C._is_torch_function_mode_enabled()
            and not torch._C._are_functorch_transforms_active())


class _ElsaAttention(torch.autograd.Function):
    """The Triton path with autograd: forward operator, saved ``(q, k, v, out, lse)``, backward operator."""

    @staticmethod
    def forward(ctx, q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
        args = (q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
        out, lse = _attention_fwd(*args) if direct(q) else _ATTENTION_FWD(*args)
        ctx.save_for_backward(q, k, v, out, lse, attn_bias, key_padding_mask)
        ctx.causal, ctx.scale, ctx.precision = causal, scale, precision
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, attn_bias, key_padding_mask = ctx.saved_tensors
        bias_grad = attn_bias is not None and ctx.needs_input_grad[3]
        args = (dout, q, k, v, out, lse, attn_bias, key_padding_mask, ctx.causal, ctx.scale, ctx.precision,
                bias_grad)
        dq, dk, dv, dbias = _attention_bwd(*args) if direct(dout) else _ATTENTION_BWD(*args)
        return dq, dk, dv, (dbias if bias_grad else None), None, None, None, None


def _triton_attention(q, k, v, attn_bias, key_padding_mask, causal, scale, precision):
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                    or (attn_bias is not None and attn_bias.requires_grad)):
        return _ElsaAttention.apply(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    if direct(q):  # inference: no log-sum-exp
        return _attention_fwd(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, False)[0]
    return _ATTENTION_FWD(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)[0]


def inference_call(q: Tensor, k: Tensor, v: Tensor, *, causal: bool = False, scale: float | None = None,
                   precision: str = "auto", backend: str = "auto"):
    """``elsa_attention(q, k, v, causal=..., scale=..., precision=..., backend=...)`` checked and planned
    once: returns ``f(q, k, v) -> out`` for later inference calls (no autograd, no bias or mask) on tensors
    with the same shapes, strides, dtype, device and alignment as these, or None where the call is not one
    Triton launch program (another backend). Layers keep ``f`` per input signature, so that a steady-state
    call does no validation, no backend choice and no plan lookup (``ElsaAttention``)."""
    _check_inputs(q, k, v, None, None, causal, scale, precision, backend, 0.0)
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
    compute = torch.float64 if dtype == torch.float64 else torch.float32
    qc, kc, vc = (t.to(compute) for t in (q, k, v))
    ctx = _cuda_matmul_precision(precision == "tf32") if q.is_cuda and dtype == torch.float32 else (
        contextlib.nullcontext())
    with ctx:
        out = scan_attention(
            qc, kc, vc, attn_bias=attn_bias, key_padding_mask=key_padding_mask, causal=causal, scale=scale,
            query_chunk=_TORCH_QUERY_CHUNK, dropout_p=dropout_p,
        )
    return out.to(dtype)


# ---------------------------------------------------------------------------------------------------------
# Partial attention: the building blocks of context parallelism (``elsa_vision.distributed``), whose ring
# folds the results of one query shard against every key shard with the monoid.


def accumulation_dtype(t: Tensor) -> torch.dtype:
    """The dtype partial results are kept and merged in: float64 for float64 inputs, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def partial_attention(q, k, v, key_padding_mask, attn_bias, causal, scale, precision, backend):
    """``(out, lse)`` of ``q`` against one key shard, in ``accumulation_dtype(q)``, through ``backend``
    (``"triton"``: the forward kernels; else the reference scan). Inputs are trusted (checked by the caller's
    public entry)."""
    acc = accumulation_dtype(q)
    if backend == "triton":
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        out, lse = _attention_fwd(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
        return out.to(acc), lse.to(acc)
    return scan_attention(q.to(acc), k.to(acc), v.to(acc), attn_bias=attn_bias,
                          key_padding_mask=key_padding_mask, causal=causal, scale=scale,
                          query_chunk=_TORCH_QUERY_CHUNK, return_lse=True)


def partial_attention_grads(do, q, k, v, lse, delta, key_padding_mask, attn_bias, causal, scale, precision,
                            backend, want_dq):
    """One (query shard, key shard) pair's contribution to dQ (``want_dq``) or to (dK, dV), in the dtype of
    ``delta``, from the global ``lse`` and ``Delta = rowsum(O dO)`` of the shard's query rows."""
    acc = delta.dtype
    if backend == "triton":
        dq, dk, dv, _ = _kernels()[1].elsa_bwd(
            do.to(q.dtype), q, k, v, None, lse.float(), attn_bias=attn_bias,
            key_padding_mask=key_padding_mask, causal=causal, scale=scale, precision=precision,
            delta=delta.float(), compute_dq=want_dq, compute_dkdv=not want_dq)
    else:
        dq, dk, dv, _ = attention_backward(do.to(acc), q.to(acc), k.to(acc), v.to(acc), None, lse,
                                           attn_bias=attn_bias, key_padding_mask=key_padding_mask,
                                           causal=causal, scale=scale, delta=delta)
    return (dq.to(acc),) if want_dq else (dk.to(acc), dv.to(acc))


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
    _check_inputs(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, backend, dropout_p)
    chosen = resolve_backend(backend, q, dropout_p)
    if chosen == "triton":
        check_triton_call("elsa_attention", q, v, dropout_p)
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return _triton_attention(q, k, v, attn_bias, key_padding_mask, causal, scale, precision)
    if chosen == "eca":
        from ..kernels.eca import eca_attention

        if not causal:
            raise ValueError("elsa_attention: backend='eca' computes causal attention only; pass causal=True")
        if q.shape[2] != k.shape[2]:
            raise ValueError(
                f"elsa_attention: backend='eca' needs Nq == Nk, got q {_shape(q)}, k {_shape(k)}")
        if dropout_p > 0.0:
            raise ValueError("elsa_attention: backend='eca' has no attention dropout; use backend='torch'")
        return eca_attention(q, k, v, attn_bias=attn_bias, key_padding_mask=key_padding_mask, scale=scale)
    return _torch_backend(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, dropout_p)


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, precision,
                  backend):
    fn = "elsa_attention_varlen"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise ValueError(f"{fn}: `{name}` must have rank 3 [total_tokens, H, D], got shape {_shape(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: `{name}` has unsupported dtype {t.dtype}; expected one of "
                            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")
    if k.shape[1] != q.shape[1] or v.shape[1] != q.shape[1]:
        raise ValueError(f"{fn}: head count H must match: q {_shape(q)}, k {_shape(k)}, v {_shape(v)}")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"{fn}: head dim D of k must equal q's ({q.shape[2]}), got k {_shape(k)}")
    if v.shape[0] != k.shape[0]:
        raise ValueError(f"{fn}: k and v must have the same total_k, got k {_shape(k)}, v {_shape(v)}")
    if q.shape[2] == 0 or v.shape[2] == 0:
        raise ValueError(f"{fn}: head dims must be >= 1, got q {_shape(q)}, v {_shape(v)}")
    for name, cu, total, mx in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            raise TypeError(f"{fn}: `{name}` must be a 1-D int32 tensor [batch + 1], got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.numel() < 2:
            raise ValueError(f"{fn}: `{name}` must hold batch + 1 >= 2 offsets, got {cu.numel()}")
        if cu.device != q.device:
            raise ValueError(f"{fn}: `{name}` is on {cu.device}, q on {q.device}")
        if isinstance(mx, bool) or not isinstance(mx, int) or mx < 0:
            raise TypeError(f"{fn}: max seqlen for `{name}` must be a non-negative int, got {mx!r}")
        if cu.is_cuda:
            continue  # values stay on the device: reading them would synchronise (FlashAttention's choice)
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lens < 0).any()):
            raise ValueError(f"{fn}: `{name}` must rise from 0 to the token count {total}, got "
                             f"{cu.tolist() if cu.numel() <= 16 else _shape(cu)}")
        if mx < int(lens.max()):
            raise ValueError(
                f"{fn}: max seqlen {mx} for `{name}` is below its longest sequence {int(lens.max())}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: `causal` must be a bool, got {type(causal).__name__}")
    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise TypeError(f"{fn}: `scale` must be a finite float or None, got {scale!r}")
    check_options(fn, backend, precision)


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
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale, precision,
                  backend)
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
