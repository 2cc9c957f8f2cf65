"""``window_attention``: Swin window attention (W-ELSA) as a torch operator with autograd.

Swin v2 (scaled cosine attention, ``logit_scale`` given) and Swin v1 (``q . k * scale``,
``logit_scale=None``).
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

As for ``elsa_attention``: the operator has no autograd of its own, one ``torch.autograd.Function`` saves its
inputs and runs the backward, and the public function checks the inputs once (the kernels trust them).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from ._library import define_op, eager_bypass
from .checks import check_window_inputs
from .numerics import cuda_matmul_precision

__all__ = ["window_attention", "LOGIT_SCALE_MAX"]

LOGIT_SCALE_MAX = 4.605170185988092  # log(100), timm's clamp


def _window_fwd(q, k, v, logit_scale, bias, mask, precision, scale):
    from ..kernels.window import window_fwd

    return window_fwd(q, k, v, logit_scale, bias, mask, precision, scale)


def _window_fwd_fake(q, k, v, logit_scale, bias, mask, precision, scale):
    Bw, H, N, _ = q.shape
    return q.new_empty(Bw, N, H, v.shape[-1]).transpose(1, 2)  # the kernel's layout (window_fwd)


def _normalized(q: Tensor, k: Tensor, logit_scale: Tensor | None, qk_scale: float) -> tuple[Tensor, Tensor]:
    """The kernel's logit operands: ``normalize(q) * exp(min(logit_scale, log 100))``, ``normalize(k)``
    (Swin v2), or ``q * qk_scale``, ``k`` without ``logit_scale`` (Swin v1)."""
    if logit_scale is None:
        return (q.float() * qk_scale).to(q.dtype), k
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
    def grads(qc, kc, vc, dc, exact):
        logits = (qc @ kc.transpose(-2, -1)).view(b1 - b0, nW, H, N, N)
        if not exact:
            p = (logits + full5).softmax(-1)
            dp = (dc @ vc.transpose(-2, -1)).view(b1 - b0, nW, H, N, N)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))
            return logits, p, ds, ds * (logits - logits.amax(-1, keepdim=True)), kc, qc
        # The rule of kernels/reference.py: a -inf bias or mask entry hides its key whatever the logit (a
        # hidden pair has P = dS = 0), a row that sees nothing has zero gradients, the products take the
        # finite parts of the operands (a hidden key's or query's NaN or infinity reaches no gradient).
        fin = lambda t: torch.where(torch.isfinite(t), t, 0.0)  # noqa: E731
        s = torch.where(full5 == -math.inf, -math.inf, logits + full5)
        p = torch.where(s == -math.inf, 0.0, s.softmax(-1))
        dp = (dc @ fin(vc).transpose(-2, -1)).view(b1 - b0, nW, H, N, N)
        ds = torch.where(p == 0, 0.0, p * (dp - (p * dp).sum(-1, keepdim=True)))
        lmax = logits.masked_fill(s == -math.inf, -math.inf).amax(-1, keepdim=True)
        return logits, p, ds, torch.where(p == 0, 0.0, ds * (logits - lmax)), fin(kc), fin(qc)

    for b0 in range(0, B, chunk):
        b1 = min(B, b0 + chunk)
        rows = slice(b0 * nW, b1 * nW)
        qc, kc, vc, dc = (t[rows].float() for t in (qn, kn, v, dout))
        # Finite inputs give finite gradients; a NaN or an infinity (or a row that sees no key) sends the
        # chunk through the exact rule. The check is a host synchronisation: skipped (exact) while compiling
        # or capturing a CUDA graph.
        exact = torch.compiler.is_compiling() or (qc.is_cuda and torch.cuda.is_current_stream_capturing())
        logits, p, ds, dsl, kf, qf = grads(qc, kc, vc, dc, exact)
        if not exact and not bool(torch.isfinite(ds.sum()) & torch.isfinite(dsl.sum())):
            logits, p, ds, dsl, kf, qf = grads(qc, kc, vc, dc, True)
        dfull += ds.sum(0)
        dscale += dsl.sum((0, 1, 3, 4))
        if need_qkv:
            p4, ds4 = p.view(-1, H, N, N), ds.view(-1, H, N, N)
            dv[rows] = p4.transpose(-2, -1) @ dc
            dqn[rows] = ds4 @ kf
            dkn[rows] = ds4.transpose(-2, -1) @ qf
    return dqn, dkn, dv, dfull, dscale


def _window_bwd(dout, q, k, v, logit_scale, bias, mask, precision, scale, need_q, need_k, need_v):
    """Both backward routes (fused kernel up to ``BWD_MAX_TOKENS`` tokens, dense PyTorch above) as one
    operator body: ``(dq, dk, dv, dbias [H, N, N], dscale [H])``, float32 bias/scale gradients, empty
    tensors for the gradients not asked for."""
    need_qkv = need_q or need_k or need_v
    from ..kernels.window import BWD_MAX_TOKENS, window_bwd  # loaded already: the forward ran the kernel

    if q.shape[2] <= BWD_MAX_TOKENS:
        dq, dk, dv, dfull, dscale = window_bwd(dout, q, k, v, logit_scale, bias, mask, precision, need_qkv,
                                               scale)
    else:
        dq, dk, dv, dfull, dscale = _dense_backward(dout, q, k, v, logit_scale, bias, mask, precision, scale,
                                                    need_q or need_k, need_qkv)
    none = q.new_empty(0)
    return (dq if need_q else none, dk if need_k else none, dv.to(v.dtype) if need_v else none, dfull,
            dscale)


def _window_bwd_fake(dout, q, k, v, logit_scale, bias, mask, precision, scale, need_q, need_k, need_v):
    H, N = q.shape[1], q.shape[2]
    none = q.new_empty(0)
    return (q.new_empty(q.shape) if need_q else none, k.new_empty(k.shape) if need_k else none,
            v.new_empty(v.shape) if need_v else none, q.new_empty(H, N, N, dtype=torch.float32),
            q.new_empty(H, dtype=torch.float32))


def _backward(ctx, dout):
    q, k, v, logit_scale, bias, mask = ctx.saved_tensors
    need_q, need_k, need_v, need_ls, need_bias = ctx.needs_input_grad[:5]
    args = (dout, q, k, v, logit_scale, bias, mask, ctx.precision, ctx.scale, need_q, need_k, need_v)
    dq, dk, dv, dfull, dscale = eager_bypass(dout, _window_bwd, _WINDOW_BWD)(*args)
    dls = dbias = None
    if need_bias:
        dbias = dfull.to(bias.dtype)
    if need_ls:
        # L = exp(min(logit_scale, log 100)) cos: dL / dlogit_scale = L where the clamp is inactive.
        dls = (dscale * (logit_scale.float() <= LOGIT_SCALE_MAX)).to(logit_scale.dtype)
    return (dq if need_q else None, dk if need_k else None, dv if need_v else None, dls, dbias, None, None,
            None)


def _dense_backward(dout, q, k, v, logit_scale, bias, mask, precision, qk_scale, need_qk, need_qkv):
    """Windows larger than the fused kernel's tile: dense float32 softmax per chunk of images (PyTorch)."""
    nW = 1 if mask is None else mask.shape[0]
    full = bias.unsqueeze(0) if mask is None else bias.unsqueeze(0) + mask.to(bias.dtype).unsqueeze(1)
    full = full.to(q.dtype)  # [nW, H, N, N]: per window, never per image
    with torch.enable_grad():
        qd, kd = (t.detach().requires_grad_(True) for t in (q, k))
        lsd = None if logit_scale is None else logit_scale.detach().requires_grad_(True)
        qn, kn = _normalized(qd, kd, lsd, qk_scale)
    with cuda_matmul_precision(precision == "tf32"):
        dqn, dkn, dv, dfull, dscale = _dense_window_grads(
            dout, qn.detach(), kn.detach(), v, full, nW, need_qkv=need_qkv)
    dq = dk = None
    if need_qk:
        dq, dk = torch.autograd.grad((qn, kn), (qd, kd), (dqn.to(qn.dtype), dkn.to(kn.dtype)))
        # Through the normalisation a non-finite query or key row turns even a zero gradient into NaN: it
        # gets 0 where nothing reached it (hidden from, or seeing, no key), NaN where a NaN did.
        for g, x, gx in ((dq, q, dqn), (dk, k, dkn)):
            bad = ~torch.isfinite(x).all(-1, keepdim=True)
            g.copy_(torch.where(bad, torch.where(gx == 0, 0.0, math.nan).to(g.dtype), g))
    return dq, dk, dv, dfull.sum(0), dscale


_WINDOW_BWD = define_op(
    "window_attention_bwd",
    "(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor? logit_scale, Tensor bias, Tensor? mask, "
    "str precision, float scale, bool need_q, bool need_k, bool need_v) -> (Tensor, Tensor, Tensor, Tensor, "
    "Tensor)",
    _window_bwd, _window_bwd_fake,
)
_WINDOW_FWD = define_op(
    "window_attention_fwd",
    "(Tensor q, Tensor k, Tensor v, Tensor? logit_scale, Tensor bias, Tensor? mask, str precision, "
    "float scale) -> Tensor",
    _window_fwd, _window_fwd_fake,
)


class _WindowAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, logit_scale, bias, mask, precision, scale):
        args = (q, k, v, logit_scale, bias, mask, precision, scale)
        out = eager_bypass(q, _window_fwd, _WINDOW_FWD)(*args)
        ctx.save_for_backward(q, k, v, logit_scale, bias, mask)
        ctx.precision, ctx.scale = precision, scale
        return out

    backward = staticmethod(_backward)


def window_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    logit_scale: Tensor | None,
    bias: Tensor,
    mask: Tensor | None = None,
    *,
    precision: str = "auto",
    scale: float | None = None,
) -> Tensor:
    """Swin window attention, fused (Triton; CUDA, or CPU under ``TRITON_INTERPRET=1``).

    Swin v2: ``softmax(cos(q, k) * exp(min(logit_scale, log 100)) + bias + mask[b % nW]) @ v`` per window
    ``b``; Swin v1 (``logit_scale=None``): ``softmax(q . k * scale + bias + mask[b % nW]) @ v``.

    Args:
        q, k: ``[B*nW, H, N, D]``; v: ``[B*nW, H, N, Dv]`` (any strides); float16, bfloat16 or float32.
        logit_scale: ``[H]`` (or timm's ``[H, 1, 1]``) raw per-head parameter of Swin v2, or None.
        bias: ``[H, N, N]`` relative-position bias shared by all windows.
        mask: ``[nW, N, N]`` shift mask (0 / -100), window ``b`` uses ``mask[b % nW]``; None for no shift.
        precision: float32 dot precision, one of ``PRECISIONS`` (``kernels.precision``).
        scale: the logit scale without ``logit_scale`` (default ``D ** -0.5``); unused with it.

    Returns:
        ``[B*nW, H, N, Dv]`` in q's dtype, stored as ``[B*nW, N, H, Dv]`` (``.transpose(1, 2)`` of it is
        contiguous). Differentiable in q, k, v, logit_scale and bias.
    """
    if isinstance(logit_scale, Tensor) and q.dim() == 4 and logit_scale.numel() == q.shape[1]:
        logit_scale = logit_scale.reshape(-1)
    if scale is None:  # (a head dim of 0 is left to check_window_inputs to refuse)
        scale = q.shape[-1] ** -0.5 if isinstance(q, Tensor) and q.dim() == 4 and q.shape[-1] else 1.0
    check_window_inputs(q, k, v, logit_scale, bias, mask, precision, scale)
    scale = float(scale)
    grads = q.requires_grad or k.requires_grad or v.requires_grad or bias.requires_grad or (
        logit_scale is not None and logit_scale.requires_grad)
    if grads and torch.is_grad_enabled():
        return _WindowAttention.apply(q, k, v, logit_scale, bias, mask, precision, scale)
    return eager_bypass(q, _window_fwd, _WINDOW_FWD)(q, k, v, logit_scale, bias, mask, precision, scale)
