"""``window_attention``: Swin-v2 window attention (W-ELSA) as a torch operator with autograd.

Forward: one Triton launch over all windows (:func:`elsa_vision.kernels.window.window_fwd`: q/k normalisation,
per-head logit scale, shared ``[H, N, N]`` bias and ``[nW, N, N]`` shift mask read by stride).

Backward: every window's softmax is formed densely from its recomputed logits (no saved log-sum-exp: Swin-v2
logits reach ``100 cos + 16``, and a probability recomputed from a float32 log-sum-exp of that size carries
its rounding, ~4e-6 relative, into every gradient; ``docs/kernel_notes.md``, "W-ELSA backward"). From ``P``
and ``dS = P (dP - rowsum(P dP))`` come ``dV = P^T dO``, ``dq = dS k``, ``dk = dS^T q`` (then through the
normalisation), the bias gradient (``dS`` summed over the windows) and the ``logit_scale`` gradient
``sum dS (L - rowmax L)`` (``L`` the scaled cosine logits; this avoids the cancellation of the ``dq . q``
route). Windows of up to 64 tokens (window 8, the common Swin-v2 case) run one fused Triton launch
(:func:`elsa_vision.kernels.window.window_bwd`, float32 arithmetic, dots at the forward's ``precision``:
FP32-accurate three-pass TF32 for ``"auto"`` on sm80+); larger windows run the same math in PyTorch, in
chunks of whole images that bound the memory, with IEEE float32 matmuls unless ``precision="tf32"``.
Gradients reach ``q``, ``k``, ``v``, ``logit_scale`` and the bias (hence ``cpb_mlp``); the mask gets none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ._library import define_op
from .attention import PRECISIONS, _cuda_matmul_precision

__all__ = ["window_attention", "LOGIT_SCALE_MAX"]

LOGIT_SCALE_MAX = 4.605170185988092  # log(100), timm's clamp


def _window_fwd(q, k, v, logit_scale, bias, mask, precision):
    from ..kernels.window import window_fwd

    return window_fwd(q, k, v, logit_scale, bias, mask, precision)


def _window_fwd_fake(q, k, v, logit_scale, bias, mask, precision):
    Bw, H, N, _ = q.shape
    out = q.new_empty(Bw, N, H, v.shape[-1]).transpose(1, 2)  # the kernel's layout (window_fwd)
    return out, q.new_empty(Bw, H, N, dtype=torch.float32)


def _normalized(q: Tensor, k: Tensor, logit_scale: Tensor) -> tuple[Tensor, Tensor]:
    """The kernel's logit operands: ``normalize(q) * exp(min(logit_scale, log 100))``, ``normalize(k)``."""
    scale = torch.clamp(logit_scale.float(), max=LOGIT_SCALE_MAX).exp().view(1, -1, 1, 1)
    qn = F.normalize(q.float(), dim=-1) * scale
    return qn.to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype)


def _dense_window_grads(dout: Tensor, qn: Tensor, kn: Tensor, v: Tensor, full: Tensor, nW: int,
                        need_qkv: bool = True, max_elements: int = 1 << 24):
    """Gradients of every window from its dense softmax, in chunks of whole images (at most
    ``max_elements`` scores at a time), all in float32.

    Returns ``(dqn, dkn, dv, dfull, dscale)``: the gradients of the logit operands ``qn``, ``kn`` and of
    ``v`` (``[B*nW, H, N, D|Dv]``; None unless ``need_qkv``), the bias gradient ``dfull [nW, H, N, N]``
    summed over the images, and ``dscale [H] = sum dS * L`` with ``L = qn . kn``, the logit-scale gradient
    before the clamp. Each row's logits are shifted by their maximum before that sum (``sum_j dS_ij = 0``):
    the products then carry no common offset of up to 100 that would cancel.
    """
    Bw, H, N, _ = qn.shape
    B = Bw // nW
    full5 = full.float().reshape(1, nW, H, N, N)
    chunk = max(1, max_elements // max(1, nW * H * N * N))
    dfull = torch.zeros(nW, H, N, N, dtype=torch.float32, device=qn.device)
    dscale = torch.zeros(H, dtype=torch.float32, device=qn.device)
    dqn = dkn = dv = None
    if need_qkv:
        dqn = torch.empty(qn.shape, dtype=torch.float32, device=qn.device)
        dkn = torch.empty(kn.shape, dtype=torch.float32, device=qn.device)
        dv = torch.empty(v.shape, dtype=torch.float32, device=qn.device)
    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        rows = slice(b0 * nW, b1 * nW)
        qc, kc, vc, dc = (t[rows].float() for t in (qn, kn, v, dout))
        logits = (qc @ kc.transpose(-2, -1)).view(b1 - b0, nW, H, N, N)
        p = (logits + full5).softmax(-1)
        dp = (dc @ vc.transpose(-2, -1)).view(b1 - b0, nW, H, N, N)
        ds = p * (dp - (p * dp).sum(-1, keepdim=True))
        dfull += ds.sum(0)
        dscale += (ds * (logits - logits.amax(-1, keepdim=True))).sum((0, 1, 3, 4))
        if need_qkv:
            p4, ds4 = p.view(-1, H, N, N), ds.view(-1, H, N, N)
            dv[rows] = p4.transpose(-2, -1) @ dc
            dqn[rows] = ds4 @ kc
            dkn[rows] = ds4.transpose(-2, -1) @ qc
    return dqn, dkn, dv, dfull, dscale


def _setup_context(ctx, inputs, output):
    q, k, v, logit_scale, bias, mask, precision = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, logit_scale, bias, mask, out, lse)
    ctx.precision = precision
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout, _dlse):
    q, k, v, logit_scale, bias, mask, out, lse = ctx.saved_tensors
    need_q, need_k, need_v, need_ls, need_bias = ctx.needs_input_grad[:5]
    need_qkv = need_q or need_k or need_v
    from ..kernels.window import BWD_MAX_TOKENS, window_bwd  # loaded already: the forward ran the kernel

    if q.shape[2] <= BWD_MAX_TOKENS:
        dq, dk, dv, dfull, dscale = window_bwd(dout, q, k, v, logit_scale, bias, mask, ctx.precision,
                                               need_qkv=need_qkv)
    else:
        dq, dk, dv, dfull, dscale = _dense_backward(dout, q, k, v, logit_scale, bias, mask, ctx.precision,
                                                    need_q or need_k, need_qkv)
    dls = dbias = None
    if need_bias:
        dbias = dfull.to(bias.dtype)
    if need_ls:
        # L = exp(min(logit_scale, log 100)) cos: dL / dlogit_scale = L where the clamp is inactive.
        dls = (dscale * (logit_scale.float() <= LOGIT_SCALE_MAX)).to(logit_scale.dtype)
    return (dq if need_q else None, dk if need_k else None, dv.to(v.dtype) if need_v else None,
            dls, dbias, None, None)


def _dense_backward(dout, q, k, v, logit_scale, bias, mask, precision, need_qk, need_qkv):
    """Windows larger than the fused kernel's tile: dense float32 softmax per chunk of images (PyTorch)."""
    nW = 1 if mask is None else mask.shape[0]
    full = bias.unsqueeze(0) if mask is None else bias.unsqueeze(0) + mask.to(bias.dtype).unsqueeze(1)
    full = full.to(q.dtype)  # [nW, H, N, N]: per window, never per image
    with torch.enable_grad():
        qd, kd, lsd = (t.detach().requires_grad_(True) for t in (q, k, logit_scale))
        qn, kn = _normalized(qd, kd, lsd)
    with _cuda_matmul_precision(precision == "tf32"):
        dqn, dkn, dv, dfull, dscale = _dense_window_grads(
            dout, qn.detach(), kn.detach(), v, full, nW, need_qkv=need_qkv)
    dq = dk = None
    if need_qk:
        dq, dk = torch.autograd.grad((qn, kn), (qd, kd), (dqn.to(qn.dtype), dkn.to(kn.dtype)))
    return dq, dk, dv, dfull.sum(0), dscale


_WINDOW_FWD = define_op(
    "window_attention_fwd",
    "(Tensor q, Tensor k, Tensor v, Tensor logit_scale, Tensor bias, Tensor? mask, str precision) "
    "-> (Tensor, Tensor)",
    _window_fwd, _window_fwd_fake, _backward, _setup_context,
)


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
        precision: float32 dot precision, one of ``PRECISIONS`` (``ops.attention``).

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
    out, _ = _WINDOW_FWD(q, k, v, logit_scale, bias, mask, precision)
    return out
