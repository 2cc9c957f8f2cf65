"""The public FP32-accurate linear map: ``elsa_linear(x, weight, bias)``, ``torch.nn.functional.linear``'s
contract computed on tensor cores at the project's float32 precisions.

PyTorch runs a float32 ``nn.Linear`` on the GPU's FP32 SIMT cores (``allow_tf32`` off) or as one TF32 pass
(~1e-3). ``elsa_linear`` computes float32 products with the split-precision GEMM (``kernels.gemm``): on sm90
``"fp16x3"`` (three half-precision tensor-core products per tile, relative error below PyTorch FP32's), on
other tensor-core GPUs ``"tf32x3"``. Everything else is ``torch.nn.functional.linear`` exactly as it is:
float16 / bfloat16 / float64 inputs, autocast regions, CPU tensors, ``precision="ieee"`` (IEEE FP32, TF32 off)
and ``"tf32"`` (one TF32 pass).

Three tiers, as the attention op: two torch operators (``elsa_vision::linear_fwd`` / ``linear_bwd``, each a
kernel and a fake kernel: one opaque node under ``torch.compile``), one ``autograd.Function`` (saves ``x`` and
``weight``; the backward forms ``dX = dY W``, ``dW = dY^T X`` with the same kernels and ``db = sum dY``), and
the public function, which checks its inputs once. Where nothing needs a gradient (inference) the forward
operator keeps each weight's float16 parts from one call to the next (``kernels.gemm``, ``reuse_b``): a
weight is split once while it is unchanged (its version counter; a CUDA graph splits at every replay), for
the weight's own size in GPU memory; a call with autograd drops them.

``elsa_mlp`` is timm's ``Mlp`` with exact GELU (``fc2(gelu(fc1(x)))``) as one operator where nothing needs
its gradient: the first product's epilogue adds the bias, applies the GELU and writes the hidden activation
as the float16 parts the second product reads (``kernels.gemm.SplitOperand``), so the hidden activation is
neither written in float32, nor read again by a GELU, nor split by a pass of its own. With gradients it is
``elsa_linear``, ``F.gelu``, ``elsa_linear``.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.precision import resolve_precision
from ._library import define_op, eager_bypass
from .checks import LINEAR_BACKENDS, check_linear_inputs, check_mlp_inputs
from .numerics import cuda_matmul_precision

__all__ = ["elsa_linear", "elsa_mlp", "LINEAR_BACKENDS", "linear_route", "linear_on_route", "mlp_on_route"]


@functools.cache
def _gemm():
    from ..kernels import gemm

    return gemm


def linear_route(x: Tensor, precision: str, backend: str) -> str:
    """Where ``elsa_linear`` computes a call on ``x``: ``"triton"`` (the split-precision GEMM) for float32
    tensors the kernels can read when ``precision`` resolves to a tensor-core FP32 path outside autocast,
    else ``"torch"`` (``F.linear``). ``backend="triton"`` asks for the GEMM whatever the precision (the
    kernel then runs ``"ieee"`` / ``"tf32"`` itself)."""
    if backend == "torch" or x.dtype != torch.float32:
        return "torch"
    if torch.is_autocast_enabled(x.device.type):
        return "torch"  # autocast casts F.linear's operands to its dtype, as for nn.Linear
    if backend == "triton":
        return "triton"
    if not x.is_cuda:
        return "torch"
    return _cuda_route(x.device, precision)


@functools.lru_cache(maxsize=64)
def _cuda_route(device: torch.device, precision: str) -> str:
    """The route of a float32 call on CUDA ``device``: the GEMM where ``precision`` resolves to a tensor-core
    FP32-accurate path there (``fp16x3`` on sm90, ``tf32x3`` on other sm80+ GPUs), else ``F.linear``."""
    resolved = resolve_precision(precision, torch.float32, device, "gemm")
    return "triton" if resolved in ("fp16x3", "tf32x3") else "torch"


# ---------------------------------------------------------------------------------------------------------
# The Triton path: two operators without autograd of their own, one autograd.Function around them.


def _linear_fwd(x, weight, bias, precision, inference):
    return _gemm().gemm(x, weight, bias, precision=precision, reuse_b=inference)


def _linear_fwd_fake(x, weight, bias, precision, inference):
    return x.new_empty(x.shape[0], weight.shape[0])


def _linear_bwd(dy, x, weight, precision, need_x, need_w, need_b):
    gemm = _gemm().gemm
    dx = gemm(dy, weight.t(), precision=precision) if need_x else dy.new_empty(0)
    dw = gemm(dy.t(), x.t(), precision=precision) if need_w else dy.new_empty(0)
    db = dy.sum(0) if need_b else dy.new_empty(0)
    return dx, dw, db


def _linear_bwd_fake(dy, x, weight, precision, need_x, need_w, need_b):
    return (x.new_empty(x.shape) if need_x else dy.new_empty(0),
            weight.new_empty(weight.shape) if need_w else dy.new_empty(0),
            dy.new_empty(weight.shape[0]) if need_b else dy.new_empty(0))


def _mlp_fwd(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision):
    gemm = _gemm().gemm
    hidden = gemm(x, fc1_weight, fc1_bias, precision=precision, activation="gelu", split_output=True,
                  reuse_b=True)
    return gemm(hidden, fc2_weight, fc2_bias, precision=precision, reuse_b=True)


def _mlp_fwd_fake(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision):
    return x.new_empty(x.shape[0], fc2_weight.shape[0])


_MLP_FWD = define_op(
    "mlp_fwd",
    "(Tensor x, Tensor fc1_weight, Tensor? fc1_bias, Tensor fc2_weight, Tensor? fc2_bias, str precision) "
    "-> Tensor",
    _mlp_fwd, _mlp_fwd_fake,
)
_LINEAR_FWD = define_op(
    "linear_fwd", "(Tensor x, Tensor weight, Tensor? bias, str precision, bool inference) -> Tensor",
    _linear_fwd, _linear_fwd_fake,
)
_LINEAR_BWD = define_op(
    "linear_bwd",
    "(Tensor dy, Tensor x, Tensor weight, str precision, bool need_x, bool need_w, bool need_b) "
    "-> (Tensor, Tensor, Tensor)",
    _linear_bwd, _linear_bwd_fake,
)


class _ElsaLinear(torch.autograd.Function):
    """The Triton path with autograd on 2-D ``x``: forward operator, saved ``(x, weight)``, backward
    operator."""

    @staticmethod
    def forward(ctx, x, weight, bias, precision):
        args = (x, weight, bias, precision, False)
        ctx.save_for_backward(x, weight)
        ctx.precision, ctx.has_bias = precision, bias is not None
        return eager_bypass(x, _linear_fwd, _LINEAR_FWD)(*args)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        args = (dy, x, weight, ctx.precision, need_x, need_w, need_b and ctx.has_bias)
        dx, dw, db = eager_bypass(dy, _linear_bwd, _LINEAR_BWD)(*args)
        return (dx if need_x else None), (dw if need_w else None), (db if args[-1] else None), None


def _needs_grad(*tensors) -> bool:
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def _triton_linear(x2, weight, bias, precision):
    if _needs_grad(x2, weight, bias):
        return _ElsaLinear.apply(x2, weight, bias, precision)
    return eager_bypass(x2, _linear_fwd, _LINEAR_FWD)(x2, weight, bias, precision, True)


def elsa_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *, precision: str = "auto",
                backend: str = "auto") -> Tensor:
    """``x @ weight.T + bias`` (``torch.nn.functional.linear``), FP32-accurate on tensor cores for float32.

    Args:
        x: ``[..., in_features]``, any strides.
        weight: ``[out_features, in_features]``; bias: ``[out_features]`` or None. Same dtype and device as x.
        precision: for float32 on CUDA: ``"auto"`` (FP32-accurate: ``"fp16x3"`` on sm90, ``"tf32x3"`` on
            other tensor-core GPUs; relative error against float64 at or below PyTorch FP32's), ``"fp16x3"``,
            ``"tf32x3"``, ``"ieee"`` (PyTorch's FP32 GEMM, TF32 off: the plain PyTorch result), ``"tf32"``
            (PyTorch's TF32 GEMM, ~1e-3). See ``kernels.precision``.
        backend: ``"auto"`` (the split-precision GEMM where ``precision`` asks for it on CUDA float32
            outside autocast; ``F.linear`` otherwise), ``"torch"`` (always ``F.linear``), ``"triton"`` (the
            GEMM at any float32 precision; CUDA, or the CPU under ``TRITON_INTERPRET=1``).

    Returns:
        ``[..., out_features]`` in x's dtype; gradients flow to x, weight and bias on every path.
    """
    check_linear_inputs(x, weight, bias, precision, backend)
    return linear_on_route(x, weight, bias, precision, linear_route(x, precision, backend))


def linear_on_route(x, weight, bias, precision: str, route: str) -> Tensor:
    """``elsa_linear`` on its ``route`` (``linear_route``) for inputs that ``check_linear_inputs`` passed, or,
    on the ``"torch"`` route, that ``F.linear`` checks itself (a layer's forward, whose options were checked
    when they were set)."""
    if route == "torch":
        if x.dtype == torch.float32 and x.is_cuda and precision in ("ieee", "tf32"):
            with cuda_matmul_precision(precision == "tf32"):
                return F.linear(x, weight, bias)
        return F.linear(x, weight, bias)
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), x.shape[-1])
    out = _triton_linear(x2, weight, bias, precision)
    return out.view(*lead, weight.shape[0])


def elsa_mlp(x: Tensor, fc1_weight: Tensor, fc1_bias: Tensor | None, fc2_weight: Tensor,
             fc2_bias: Tensor | None, *, precision: str = "auto", backend: str = "auto") -> Tensor:
    """``fc2(gelu(fc1(x)))`` with exact (erf) GELU -- timm's ``Mlp`` without dropout or norm -- each product
    as :func:`elsa_linear` computes it, with the same ``precision`` / ``backend`` (see there).

    Where the products run on the split-precision GEMM and nothing needs a gradient (inference), the two
    products are one operator that keeps the hidden activation as float16 parts (module docstring): it is
    rounded once to 22 bits with one scale per row and 128 columns, where the unfused products round it to
    float32 and then to 22 bits with one scale per row. Otherwise, and on every other route, it is the two
    ``elsa_linear`` calls around ``F.gelu``.

    Args:
        x: ``[..., in_features]``; fc1_weight ``[hidden, in_features]``, fc1_bias ``[hidden]`` or None;
            fc2_weight ``[out_features, hidden]``, fc2_bias ``[out_features]`` or None; one dtype and device.

    Returns:
        ``[..., out_features]`` in x's dtype.
    """
    check_mlp_inputs(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision, backend)
    route = linear_route(x, precision, backend)  # the hidden activation's too: x's dtype and device
    return mlp_on_route(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision, route)


def mlp_on_route(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision: str, route: str) -> Tensor:
    """``elsa_mlp`` on its ``route`` for inputs that ``check_mlp_inputs`` passed (on the ``"torch"`` route:
    that ``F.linear`` checks itself, as :func:`linear_on_route`)."""
    if route == "torch" or _needs_grad(x, fc1_weight, fc1_bias, fc2_weight, fc2_bias):
        hidden = F.gelu(linear_on_route(x, fc1_weight, fc1_bias, precision, route))
        return linear_on_route(hidden, fc2_weight, fc2_bias, precision, route)
    lead = x.shape[:-1]
    x2 = x.reshape(lead.numel(), x.shape[-1])
    out = eager_bypass(x2, _mlp_fwd, _MLP_FWD)(x2, fc1_weight, fc1_bias, fc2_weight, fc2_bias, precision)
    return out.view(*lead, fc2_weight.shape[0])
