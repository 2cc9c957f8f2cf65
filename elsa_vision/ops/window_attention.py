"""``window_attention``: Swin-v2 window attention (W-ELSA) as a torch custom op with autograd.

Forward: one Triton launch over all windows (:func:`elsa_vision.kernels.window.window_fwd`: q/k normalisation,
per-head logit scale, shared ``[H, N, N]`` bias and ``[nW, N, N]`` shift mask read by stride).

Backward: the normalised, scaled ``q``/``k`` are recomputed; the gradients of ``q``, ``k``, ``v`` come from
the ELSA backward (``elsa_vision::attention_bwd``) in the folded window layout ``[B, nW*H, N, D]`` with bias
plus mask as one ``[1, nW*H, N, N]`` ``attn_bias`` (per window, never expanded over the batch), then through
the normalisation by autograd. The bias gradient ``dS = P (dP - rowsum(P dP))`` is recomputed densely per
window in chunks of images (windows hold at most a few hundred tokens) and summed over the images; the
``logit_scale`` gradient comes from the same ``dS`` as ``sum dS (L - rowmax L)`` (``L`` the scaled cosine
logits), which avoids the cancellation of the ``dq . q`` route. Gradients reach ``q``, ``k``, ``v``,
``logit_scale`` and the bias (hence ``cpb_mlp``); the mask gets none.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

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
    """The kernel's logit operands: ``normalize(q) * exp(min(logit_scale, log 100))``, ``normalize(k)``."""
    scale = torch.clamp(logit_scale.float(), max=LOGIT_SCALE_MAX).exp().view(1, -1, 1, 1)
    qn = F.normalize(q.float(), dim=-1) * scale
    return qn.to(q.dtype), F.normalize(k.float(), dim=-1).to(k.dtype)


def _bias_and_scale_grads(dout: Tensor, qn: Tensor, kn: Tensor, v: Tensor, full: Tensor, nW: int,
                          max_elements: int = 1 << 24) -> tuple[Tensor, Tensor]:
    """``dS = P * (dP - rowsum(P * dP))`` of every window, recomputed densely from ``qn``, ``kn`` in chunks of
    whole images (at most ``max_elements`` scores at a time); returns ``(dfull [nW, H, N, N], dscale [H])`` in
    float32: the bias gradient summed over the images and ``sum dS * L`` with ``L = qn . kn``, the
    logit-scale gradient before the clamp. Each row's logits are shifted by their maximum before that sum
    (``sum_j dS_ij = 0``): the products then carry no common offset of up to 100 that would cancel.
    """
    Bw, H, N, _ = qn.shape
    B = Bw // nW
    full5 = full.float().reshape(1, nW, H, N, N)
    chunk = max(1, max_elements // max(1, nW * H * N * N))
    dfull = torch.zeros(nW, H, N, N, dtype=torch.float32, device=qn.device)
    dscale = torch.zeros(H, dtype=torch.float32, device=qn.device)
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
    return dfull, dscale


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
    full = full.to(q.dtype)  # [nW, H, N, N]: per window, never per image

    def fold(t: Tensor) -> Tensor:  # [B*nW, H, N, X] -> [B, nW*H, N, X]: windows of one image become heads
        return t.reshape(B, nW * H, *t.shape[2:])

    need_q, need_k, need_v, need_ls, need_bias = ctx.needs_input_grad[:5]
    with torch.enable_grad():
        qd, kd, lsd = (t.detach().requires_grad_(True) for t in (q, k, logit_scale))
        qn, kn = _normalized(qd, kd, lsd)
    dout = dout.contiguous()
    dq = dk = dv = dls = dbias = None
    if need_q or need_k or need_v:
        dqn, dkn, dv, _ = torch.ops.elsa_vision.attention_bwd(
            fold(dout), fold(qn.detach()), fold(kn.detach()), fold(v), fold(out), fold(lse),
            full.reshape(1, nW * H, N, N), None, False, 1.0, ctx.precision, False)
        if need_q or need_k:
            dq, dk = torch.autograd.grad((qn, kn), (qd, kd), (dqn.reshape(qn.shape), dkn.reshape(kn.shape)))
    if need_bias or need_ls:
        dfull, dscale = _bias_and_scale_grads(dout, qn.detach(), kn.detach(), v, full, nW)
        if need_bias:
            dbias = dfull.sum(0).to(bias.dtype)
        if need_ls:
            # L = exp(min(logit_scale, log 100)) cos: dL / dlogit_scale = L where the clamp is inactive.
            dls = (dscale * (logit_scale.float() <= LOGIT_SCALE_MAX)).to(logit_scale.dtype)
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
