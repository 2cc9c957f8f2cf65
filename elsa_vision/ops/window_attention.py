"""``window_attention``: Swin-v2 window attention (W-ELSA) as a torch custom op with autograd.

Forward: one Triton launch over all windows (:func:`elsa_vision.kernels.window.window_fwd`: q/k normalisation,
per-head logit scale, shared ``[H, N, N]`` bias and ``[nW, N, N]`` shift mask read by stride).

Backward: the normalised, scaled ``q``/``k`` are recomputed and the attention gradients come from the ELSA
backward (``elsa_vision::attention_bwd``) in the folded window layout ``[B, nW*H, N, D]`` with the bias plus
mask as one ``[1, nW*H, N, N]`` ``attn_bias`` (the per-window bias is never expanded over the batch); the
bias gradient is reduced from the saved log-sum-exp (``attention_bias_grad``) and summed over the windows;
the normalisation and the clamped ``exp`` of ``logit_scale`` are differentiated by autograd. So gradients
reach ``q``, ``k``, ``v``, ``logit_scale`` and the bias (hence ``cpb_mlp``); the mask gets none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..kernels.reference import attention_bias_grad
from .attention import PRECISIONS

__all__ = ["window_attention", "LOGIT_SCALE_MAX"]

LOGIT_SCALE_MAX = 4.605170185988092  # log(100), timm's clamp


@torch.library.custom_op(
    "elsa_vision::window_attention_fwd", mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, Tensor logit_scale, Tensor bias, Tensor? mask, str precision) "
           "-> (Tensor, Tensor)",
)
def _window_fwd(q, k, v, logit_scale, bias, mask, precision):
    from ..kernels.window import window_fwd

    return window_fwd(q, k, v, logit_scale, bias, mask, precision)


@_window_fwd.register_fake
def _window_fwd_fake(q, k, v, logit_scale, bias, mask, precision):
    Bw, H, N, _ = q.shape
    out = q.new_empty(Bw, N, H, v.shape[-1]).transpose(1, 2)  # the kernel's layout (window_fwd)
    return out, q.new_empty(Bw, H, N, dtype=torch.float32)


def _normalized(q: Tensor, k: Tensor, logit_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's logits operands: ``normalize(q) * exp(min(logit_scale, log 100))`` and ``normalize(k)``."""
    scale = torch.clamp(logit_scale.float(), max=LOGIT_SCALE_MAX).exp().view(1, -1, 1, 1)
    qn = F.normalize(q.float(), dim=-1) * scale
    return qn.to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, logit_scale, bias, mask, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, logit_scale, bias, mask, out, lse)
    ctx.precision = precision
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, logit_scale, bias, mask, out, lse = ctx.saved_tensors
    Bw, H, N, D = q.shape
    nW = 1 if mask is None else mask.shape[0]
    B = Bw // nW
    full = bias.unsqueeze(0) if mask is None else bias.unsqueeze(0) + mask.to(bias.dtype).unsqueeze(1)
    full = full.to(q.dtype).reshape(1, nW * H, N, N)

    def fold(t: Tensor) -> Tensor:  # [B*nW, H, N, X] -> [B, nW*H, N, X]: windows of one image become heads
        return t.reshape(B, nW * H, *t.shape[2:])

    need_q, need_k, need_v, need_ls, need_bias = ctx.needs_input_grad[:5]
    with torch.enable_grad():
        qd, kd, lsd = (t.detach().requires_grad_(True) for t in (q, k, logit_scale))
        qn, kn = _normalized(qd, kd, lsd)
    args = (fold(qn.detach()), fold(kn.detach()), fold(v), fold(out), fold(lse))
    dqn, dkn, dv, _ = torch.ops.elsa_vision.attention_bwd(
        fold(dout.contiguous()), *args[:4], args[4], full, None, False, 1.0, ctx.precision, False)
    dq = dk = dls = dbias = None
    if need_q or need_k or need_ls:
        dq, dk, dls = torch.autograd.grad(
            (qn, kn), (qd, kd, lsd), (dqn.reshape(qn.shape), dkn.reshape(kn.shape)), allow_unused=True)
    if need_bias:
        dfull = attention_bias_grad(fold(dout), *args, full, scale=1.0)
        dbias = dfull.reshape(nW, H, N, N).sum(0).to(bias.dtype)
    return (dq if need_q else None, dk if need_k else None, dv.reshape(v.shape) if need_v else None,
            dls if need_ls else None, dbias, None, None)


_window_fwd.register_autograd(_backward, setup_context=_setup_context)


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logit_scale: Tensor,
    bias: Tensor,
    mask: Tensor | None = None,
    *,
    precision: str = "auto",
) -> Tensor:
    """Swin-v2 scaled-cosine window attention, fused (Triton; CUDA, or CPU under ``TRITON_INTERPRET=1``).

    ``softmax(cos(q, k) * exp(min(logit_scale, log 100)) + bias + mask[b % nW]) @ v`` per window ``b``.

    Args:
        q, k: ``[B*nW, H, N, D]``; v: ``[B*nW, H, N, Dv]`` (any strides); float16, bfloat16 or float32.
        logit_scale: ``[H]`` (or timm's ``[H, 1, 1]``) raw per-head parameter.
        bias: ``[H, N, N]`` relative-position bias shared by all windows.
        mask: ``[nW, N, N]`` shift mask (0 / -100), window ``b`` uses ``mask[b % nW]``; None for no shift.
        precision: float32 dot precision, one of ``("auto", "ieee", "tf32x3", "tf32")``.

    Returns:
        ``[B*nW, H, N, Dv]`` in q's dtype, stored as ``[B*nW, N, H, Dv]`` (``.transpose(1, 2)`` of it is
        contiguous). Differentiable in q, k, v, logit_scale and bias.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"window_attention: unknown `precision` {precision!r}; expected one of {PRECISIONS}")
    if not isinstance(logit_scale, Tensor):
        raise TypeError(f"window_attention: `logit_scale` must be a tensor, got {type(logit_scale).__name__}")
    if q.dim() == 4 and logit_scale.numel() == q.shape[1]:
        logit_scale = logit_scale.reshape(-1)
    out, _ = torch.ops.elsa_vision.window_attention_fwd(q, k, v, logit_scale, bias, mask, precision)
    return out
