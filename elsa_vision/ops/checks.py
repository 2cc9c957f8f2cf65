"""Input checks of the public ops, in one place: every entry (``elsa_attention``, ``elsa_attention_varlen``,
``window_attention``, ``elsa_linear``, context parallelism, the ELSA layers' options) checks its inputs here
once, with one-line errors naming the entry and the argument; the operators and kernels below trust them.

The options' vocabulary lives here too: ``BACKENDS`` (what ``elsa_attention`` runs on), ``LINEAR_BACKENDS``
(``elsa_linear``), the float32 ``PRECISIONS`` (``kernels.precision``), ``SUPPORTED_DTYPES`` and
``TRITON_MAX_HEAD_DIM``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from ..kernels import triton_runs_on
from ..kernels.precision import PRECISIONS

__all__ = [
    "BACKENDS", "LINEAR_BACKENDS", "PRECISIONS", "SUPPORTED_DTYPES", "TRITON_MAX_HEAD_DIM",
    "check_attention_inputs", "check_linear_inputs", "check_mlp_inputs", "check_qkvpacked_inputs",
    "check_backend", "check_eca_call", "check_options", "check_precision", "check_triton_call",
    "check_triton_device", "check_varlen_inputs", "check_window_inputs", "format_shape",
]

BACKENDS = ("auto", "torch", "triton", "eca")
# What ``elsa_linear`` runs on: the split-precision GEMM where the precision asks for it, or ``F.linear``.
LINEAR_BACKENDS = ("auto", "torch", "triton")

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
# The widest head dim the Triton kernels take; ``backend="auto"`` runs wider heads on the torch backend.
TRITON_MAX_HEAD_DIM = 256


def check_options(who: str, backend: str, precision: str, prefix: str = "",
                  backends: tuple[str, ...] = BACKENDS) -> None:
    """Raise a ``ValueError`` naming ``who`` for a float32 ``precision`` that is not one of ``PRECISIONS``
    or a ``backend`` that is not one of ``backends`` (by default ``elsa_attention``'s; an ELSA layer passes
    the backends its kind accepts). ``prefix``: how the caller's arguments are named, e.g. ``"attn_"``."""
    check_precision(who, precision, prefix)
    check_backend(who, backend, backends, prefix)


def check_precision(who: str, precision: str, prefix: str = "") -> None:
    """The ``precision`` half of :func:`check_options`: one vocabulary for every ELSA op and layer."""
    if precision not in PRECISIONS:
        raise ValueError(f"{who}: unknown {prefix}precision {precision!r}; expected one of {PRECISIONS}")


def check_backend(who: str, backend: str, backends: tuple[str, ...] = BACKENDS, prefix: str = "") -> None:
    """The ``backend`` half of :func:`check_options`."""
    if backend not in backends:
        raise ValueError(f"{who}: unknown {prefix}backend {backend!r}; expected one of {backends}")


def check_triton_device(who: str, q: Tensor, name: str = "q") -> None:
    """Refuse, naming ``who``, tensors the Triton kernels cannot read: they take CUDA tensors, and CPU
    tensors only under Triton's interpreter (``TRITON_INTERPRET=1`` set before Triton is imported). ``name``:
    the argument ``q`` is."""
    # (under torch.compile the check is left to eager calls: Dynamo cannot trace Triton's interpreter switch)
    if not q.is_cuda and not torch.compiler.is_compiling() and not triton_runs_on(q.device):
        raise ValueError(f"{who}: backend='triton' needs CUDA tensors (or TRITON_INTERPRET=1 set before "
                         f"triton is imported), got {name} on {q.device}; use backend='auto' or 'torch'")


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
                         f"{format_shape(q)}, v {format_shape(v)}; use backend='auto' or 'torch'")
    check_triton_device(who, q)


def check_eca_call(who: str, q: Tensor, k: Tensor, causal: bool, dropout_p: float) -> None:
    """What a call routed to ``backend="eca"`` needs (causal self-attention, no dropout)."""
    if not causal:
        raise ValueError(f"{who}: backend='eca' computes causal attention only; pass causal=True")
    if q.shape[2] != k.shape[2]:
        raise ValueError(
            f"{who}: backend='eca' needs Nq == Nk, got q {format_shape(q)}, k {format_shape(k)}")
    if dropout_p > 0.0:
        raise ValueError(f"{who}: backend='eca' has no attention dropout; use backend='torch'")


def format_shape(t: Tensor) -> str:
    """``t``'s shape as error messages write it: ``[2, 3, 197, 64]``."""
    return "[" + ", ".join(str(s) for s in t.shape) + "]"


def check_attention_inputs(q, k, v, attn_bias, key_padding_mask, causal, scale, precision, backend,
                           dropout_p) -> None:
    """The inputs of ``elsa_attention`` (``[B, H, N, D]`` layout), refused in one line naming it."""
    fn = "elsa_attention"
    _check_qkv(fn, q, k, v, 4, "[B, H, N, D]")
    B, H, Nq, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(
            f"{fn}: batch size B must match: q {format_shape(q)}, k {format_shape(k)}, v {format_shape(v)}")
    _check_heads(fn, q, k, v, 2, "length Nk")
    Nk = k.shape[2]
    if attn_bias is not None:
        if not isinstance(attn_bias, Tensor):
            raise TypeError(f"{fn}: `attn_bias` must be a tensor, got {type(attn_bias).__name__}")
        if not attn_bias.is_floating_point():
            raise TypeError(
                f"{fn}: `attn_bias` must be a floating-point tensor (use -inf to hide keys, or "
                f"`key_padding_mask` for a bool mask), got dtype {attn_bias.dtype}"
            )
        _check_device(fn, "attn_bias", attn_bias, q)
        target = (B, H, Nq, Nk)
        ok = attn_bias.dim() <= 4 and all(
            s in (1, t) for s, t in zip(reversed(attn_bias.shape), reversed(target))
        )
        if not ok:
            raise ValueError(
                f"{fn}: `attn_bias` of shape {format_shape(attn_bias)} is not broadcastable to "
                f"[B, H, Nq, Nk] = [{B}, {H}, {Nq}, {Nk}]"
            )
    if key_padding_mask is not None:
        if not isinstance(key_padding_mask, Tensor):
            raise TypeError(
                f"{fn}: `key_padding_mask` must be a bool tensor, got {type(key_padding_mask).__name__}")
        if key_padding_mask.dtype != torch.bool:
            raise TypeError(
                f"{fn}: `key_padding_mask` must have dtype torch.bool (True = key takes part), "
                f"got {key_padding_mask.dtype}"
            )
        kshape = tuple(key_padding_mask.shape)
        if len(kshape) != 2 or kshape[0] not in (1, B) or kshape[1] != Nk:
            raise ValueError(
                f"{fn}: `key_padding_mask` must have shape [B, Nk] = [{B}, {Nk}], "
                f"got {format_shape(key_padding_mask)}"
            )
        _check_device(fn, "key_padding_mask", key_padding_mask, q)
    _check_call_options(fn, causal, scale, precision, backend)
    if not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"{fn}: `dropout_p` must be in [0, 1), got {dropout_p}")


def check_qkvpacked_inputs(qkv, causal, scale, precision, backend) -> None:
    """The input of ``elsa_attention_qkvpacked`` (FlashAttention's packed ``[B, N, 3, H, D]``: q, k, v of
    one fused projection, so one dtype, device and shape by construction), refused in one line naming it."""
    fn = "elsa_attention_qkvpacked"
    if not isinstance(qkv, Tensor):
        raise TypeError(f"{fn}: `qkv` must be a torch.Tensor, got {type(qkv).__name__}")
    shape = qkv.shape
    if len(shape) != 5 or shape[2] != 3:
        raise ValueError(f"{fn}: `qkv` must have shape [B, N, 3, H, D], got {format_shape(qkv)}")
    if qkv.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{fn}: `qkv` has unsupported dtype {qkv.dtype}; expected one of "
                        f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if shape[4] == 0:
        raise ValueError(f"{fn}: head dims must be >= 1, got qkv {format_shape(qkv)}")
    _check_call_options(fn, causal, scale, precision, backend)


def check_varlen_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                        precision, backend) -> None:
    """The inputs of ``elsa_attention_varlen`` (packed ``[total_tokens, H, D]`` layout), refused in one line
    naming it. Offsets on the CPU are read and checked; on CUDA they are trusted (no synchronisation)."""
    fn = "elsa_attention_varlen"
    _check_qkv(fn, q, k, v, 3, "[total_tokens, H, D]")
    _check_heads(fn, q, k, v, 0, "total_k")
    for name, cu, total, mx in (("cu_seqlens_q", cu_seqlens_q, q.shape[0], max_seqlen_q),
                                ("cu_seqlens_k", cu_seqlens_k, k.shape[0], max_seqlen_k)):
        if not isinstance(cu, Tensor) or cu.dtype not in (torch.int32, torch.int64) or cu.dim() != 1:
            raise TypeError(f"{fn}: `{name}` must be a 1-D int32 tensor [batch + 1], got "
                            f"{getattr(cu, 'dtype', type(cu).__name__)}")
        if cu.numel() < 2:
            raise ValueError(f"{fn}: `{name}` must hold batch + 1 >= 2 offsets, got {cu.numel()}")
        _check_device(fn, name, cu, q)
        if isinstance(mx, bool) or not isinstance(mx, int) or mx < 0:
            raise TypeError(f"{fn}: max seqlen for `{name}` must be a non-negative int, got {mx!r}")
        if cu.is_cuda:
            continue  # values stay on the device: reading them would synchronise (FlashAttention's choice)
        lens = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or int(cu[-1]) != total or bool((lens < 0).any()):
            raise ValueError(f"{fn}: `{name}` must rise from 0 to the token count {total}, got "
                             f"{cu.tolist() if cu.numel() <= 16 else format_shape(cu)}")
        if mx < int(lens.max()):
            raise ValueError(
                f"{fn}: max seqlen {mx} for `{name}` is below its longest sequence {int(lens.max())}")
    if cu_seqlens_q.numel() != cu_seqlens_k.numel():
        raise ValueError(f"{fn}: cu_seqlens_q and cu_seqlens_k must have the same length, got "
                         f"{cu_seqlens_q.numel()} and {cu_seqlens_k.numel()}")
    _check_call_options(fn, causal, scale, precision, backend)


def check_window_inputs(q, k, v, logit_scale, bias, mask, precision, scale) -> None:
    """The inputs of ``window_attention`` (``ops.window_attention``), refused in one line naming it."""
    fn = "window_attention"
    if precision not in PRECISIONS:
        raise ValueError(f"{fn}: unknown `precision` {precision!r}; expected one of {PRECISIONS}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() != 4:
            raise ValueError(f"{fn}: `{name}` must be a 4-D tensor [B*nW, H, N, D], got "
                             f"{format_shape(t) if isinstance(t, Tensor) else type(t).__name__}")
    if q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise TypeError(f"{fn}: `q` dtype must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"{fn}: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_triton_device(fn, q)
    Bw, H, N, D = q.shape
    if not (1 <= D <= 256 and 1 <= v.shape[-1] <= 256):
        raise ValueError(f"{fn}: head dims must be in [1, 256], got D={D}, Dv={v.shape[-1]}")
    if k.shape != (Bw, H, N, D) or v.shape[:3] != (Bw, H, N):
        raise ValueError(f"{fn}: k must be {[Bw, H, N, D]} and v [{Bw}, {H}, {N}, Dv], got "
                         f"{format_shape(k)} and {format_shape(v)}")
    if logit_scale is not None:
        if not isinstance(logit_scale, Tensor):
            raise TypeError(f"{fn}: `logit_scale` must be a tensor or None, got {type(logit_scale).__name__}")
        if logit_scale.shape != (H,):
            raise ValueError(
                f"{fn}: `logit_scale` must be [{H}] (or [{H}, 1, 1]), got {format_shape(logit_scale)}")
    elif not _finite_number(scale):
        raise TypeError(f"{fn}: `scale` must be a finite float, got {scale!r}")
    if not isinstance(bias, Tensor) or not bias.is_floating_point() or bias.shape != (H, N, N):
        raise ValueError(f"{fn}: `bias` must be a float tensor [{H}, {N}, {N}], got "
                         f"{format_shape(bias) if isinstance(bias, Tensor) else type(bias).__name__}")
    if mask is not None:
        if not isinstance(mask, Tensor) or mask.dim() != 3 or mask.shape[1:] != (N, N) or mask.shape[0] < 1 \
                or Bw % mask.shape[0]:
            raise ValueError(f"{fn}: `mask` must be [nW, {N}, {N}] with nW dividing {Bw}, got "
                             f"{format_shape(mask) if isinstance(mask, Tensor) else type(mask).__name__}")
    for name, t in (("k", k), ("v", v), ("logit_scale", logit_scale), ("bias", bias), ("mask", mask)):
        if t is not None:
            _check_device(fn, name, t, q)


def check_linear_inputs(x, weight, bias, precision: str, backend: str, who: str = "elsa_linear",
                        prefix: str = "") -> None:
    """The checks of ``elsa_linear``: ``F.linear``'s shapes, one dtype and device, the options, and what
    ``backend="triton"`` needs. Errors name ``who`` and the arguments ``prefix + "weight"`` / ``"bias"``."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{who}: `x` must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{who}: `x` must be a floating-point tensor, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{who}: `x` must have rank >= 1 [..., in_features], got a scalar")
    _check_weight_and_bias(who, x, x.shape[-1], weight, bias, prefix, "x")
    check_options(who, backend, precision, backends=LINEAR_BACKENDS)
    if backend == "triton":
        if x.dtype != torch.float32:
            raise TypeError(f"{who}: backend='triton' takes float32 tensors (half precisions and float64 run "
                            f"on backend='torch'), got {x.dtype}")
        check_triton_device(who, x, "x")


def check_mlp_inputs(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision: str, backend: str) -> None:
    """The checks of ``elsa_mlp``: ``fc1`` as ``elsa_linear`` checks it, ``fc2`` taking ``fc1``'s
    out_features, every tensor of x's dtype and device."""
    who = "elsa_mlp"
    check_linear_inputs(x, fc1_weight, fc1_bias, precision, backend, who, "fc1_")
    _check_weight_and_bias(who, x, fc1_weight.shape[0], fc2_weight, fc2_bias, "fc2_",
                           f"fc1's out_features {fc1_weight.shape[0]} (fc1_weight)")


def _check_weight_and_bias(who, x, in_features, weight, bias, prefix, source) -> None:
    """``weight [out_features, in_features]`` and ``bias [out_features]`` (or None), floating point, of x's
    dtype (autocast aside: it casts the operands) and device; ``source`` names where in_features came
    from."""
    w = f"{prefix}weight"
    if not isinstance(weight, Tensor):
        raise TypeError(f"{who}: `{w}` must be a torch.Tensor, got {type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"{who}: `{w}` must be a floating-point tensor, got {weight.dtype}")
    if weight.dim() != 2:
        raise ValueError(f"{who}: `{w}` must have rank 2 [out_features, in_features], got "
                         f"{format_shape(weight)}")
    if weight.shape[1] != in_features:
        if source == "x":
            raise ValueError(f"{who}: `x` must end with in_features = {weight.shape[1]} ({w} "
                             f"{format_shape(weight)}), got x {format_shape(x)}")
        raise ValueError(f"{who}: `{w}` {format_shape(weight)} must take {source} as in_features")
    autocast = torch.is_autocast_enabled(x.device.type)  # casts F.linear's operands: dtypes may differ
    if x.device != weight.device or (x.dtype != weight.dtype and not autocast):
        raise TypeError(f"{who}: x and {w} must share dtype and device, got x {x.dtype} on {x.device}, "
                        f"{w} {weight.dtype} on {weight.device}")
    if bias is not None:
        b = f"{prefix}bias"
        if not isinstance(bias, Tensor):
            raise TypeError(f"{who}: `{b}` must be a tensor or None, got {type(bias).__name__}")
        if bias.shape != (weight.shape[0],) or bias.device != weight.device or (
                bias.dtype != weight.dtype and not autocast):
            raise ValueError(f"{who}: `{b}` must be [{weight.shape[0]}] of {weight.dtype} on "
                             f"{weight.device}, got {format_shape(bias)} of {bias.dtype} on {bias.device}")


def _check_qkv(fn: str, q, k, v, rank: int, layout: str) -> None:
    """q, k, v are tensors of rank ``rank`` (``layout`` names their axes), of one supported dtype, on one
    device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{fn}: `{name}` must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != rank:
            raise ValueError(f"{fn}: `{name}` must have rank {rank} {layout}, got shape {format_shape(t)}")
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"{fn}: `{name}` has unsupported dtype {t.dtype}; expected one of "
                            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"{fn}: q, k, v must share one dtype, got q={q.dtype}, k={k.dtype}, v={v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"{fn}: q, k, v must be on one device, got q={q.device}, k={k.device}, v={v.device}")


def _check_heads(fn: str, q: Tensor, k: Tensor, v: Tensor, key_axis: int, keys: str) -> None:
    """Heads (axis 1) and head dims (last axis) agree, k and v hold as many keys (``key_axis``, named
    ``keys`` in the error), head dims are >= 1. (Each shape read once, messages formed only when raised:
    this runs at every call.)"""
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[1] != qs[1] or vs[1] != qs[1]:
        raise ValueError(f"{fn}: head count H must match: q {format_shape(q)}, k {format_shape(k)}, "
                         f"v {format_shape(v)}")
    if ks[-1] != qs[-1]:
        raise ValueError(f"{fn}: head dim D of k must equal q's ({qs[-1]}), got k {format_shape(k)}")
    if vs[key_axis] != ks[key_axis]:
        raise ValueError(
            f"{fn}: k and v must have the same {keys}, got k {format_shape(k)}, v {format_shape(v)}")
    if qs[-1] == 0 or vs[-1] == 0:
        raise ValueError(f"{fn}: head dims must be >= 1, got q {format_shape(q)}, v {format_shape(v)}")


def _check_call_options(fn: str, causal, scale, precision: str, backend: str) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"{fn}: `causal` must be a bool, got {type(causal).__name__}")
    if scale is not None and not _finite_number(scale):
        raise TypeError(f"{fn}: `scale` must be a finite float or None, got {scale!r}")
    if precision not in PRECISIONS or backend not in BACKENDS:  # (the one call of the common case: hot path)
        check_options(fn, backend, precision)


def _check_device(fn: str, name: str, t: Tensor, q: Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{fn}: `{name}` is on {t.device}, q on {q.device}")


def _finite_number(x) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x)
