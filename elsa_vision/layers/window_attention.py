"""Swin window attention computed by ELSA: timm's Swin v1 and v2 ``WindowAttention`` with the W-ELSA op.

``ElsaSwinWindowAttention`` and ``ElsaSwinV2WindowAttention`` subclass timm's modules (same parameters and
buffers, so timm checkpoints load unchanged) and replace only ``forward``. Where the Triton kernels run (the
backend resolves to ``"triton"``: CUDA, or the CPU interpreter, no attention dropout) every window of the
batch goes through one launch of :func:`elsa_vision.ops.window_attention.window_attention`: the
``[H, N, N]`` relative-position bias and the ``[nW, N, N]`` shift mask are read by stride, never expanded per
window (timm's fused path materialises ``[B*nW, H, N, N]``). Elsewhere (CPU, float64, attention dropout) the
windows run through :func:`elsa_vision.elsa_attention` with the bias as ``attn_bias``.

* Swin v1: ``softmax(q . k * scale + table[index] + mask) v``.
* Swin v2: ``softmax(cos(q, k) * exp(min(logit_scale, log 100)) + 16 sigmoid(cpb_mlp(coords))[index] + mask)
  v``; with autograd off the position bias is computed once and reused while its inputs are unchanged.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from timm.models import register_notrace_module
from timm.models import swin_transformer as _swin1
from timm.models import swin_transformer_v2 as _swin2
from torch import Tensor, nn

from ..kernels.host import version_state
from ..ops.attention import elsa_attention, resolve_backend
from ..ops.window_attention import window_attention
from .elsa_module import ElsaAttentionModule
from .linear import linear_of

__all__ = ["ElsaSwinWindowAttention", "ElsaSwinV2WindowAttention", "window_attention_fallback"]


def window_attention_fallback(q: Tensor, k: Tensor, v: Tensor, bias: Tensor, mask: Tensor | None,
                              scale: float, precision: str, backend: str, dropout_p: float) -> Tensor:
    """Windows through ``elsa_attention``. ``q, k, v [B*nW, H, N, D]``, ``bias [1, H, N, N]``, ``mask [nW, N,
    N]`` (or None). With a shift mask the windows of one image are folded into the head axis, so the bias
    stays ``[1, nW*H, N, N]`` (no per-image copy). Returns ``[B*nW, N, H*Dv]``."""
    Bw, H, N, _ = q.shape
    if mask is not None:
        nW = mask.shape[0]
        if Bw % nW:
            raise ValueError(f"window attention: {Bw} windows is not a multiple of the mask's {nW} windows")
        q, k, v = (t.reshape(Bw // nW, nW * H, N, t.shape[-1]) for t in (q, k, v))
        bias = (bias.view(1, 1, H, N, N) + mask.to(bias.dtype).view(1, nW, 1, N, N)).reshape(1, nW * H, N, N)
    x = elsa_attention(q, k, v, attn_bias=bias.to(q.dtype), scale=scale, precision=precision, backend=backend,
                       dropout_p=dropout_p)
    # [B', nW*H, N, Dv] -> [Bw, N, H*Dv] in one copy at most, whichever layout the backend returned.
    return x.unflatten(1, (-1, H)).permute(0, 1, 3, 2, 4).reshape(Bw, N, -1)


class _ElsaWindowAttention(ElsaAttentionModule):
    """What the two Swin classes share: the route choice and the output projection. ``convert`` (in place,
    from timm's window attention of the same Swin version) is :meth:`ElsaModule.convert`."""

    def _route(self, q: Tensor) -> tuple[bool, float, str]:
        """``(fused, dropout_p, backend)``: whether the W-ELSA op runs, and the fallback's options."""
        dropout_p = self.attn_drop.p if self.training else 0.0
        backend = "torch" if dropout_p > 0 else self.backend
        return resolve_backend(backend, q, dropout_p) == "triton", dropout_p, backend

    def _out(self, x: Tensor, B_: int, N: int) -> Tensor:
        return self.proj_drop(self.proj(x.transpose(1, 2).reshape(B_, N, -1)))


@register_notrace_module  # FX leaves (timm's registry), as ElsaAttention
class ElsaSwinWindowAttention(_ElsaWindowAttention, _swin1.WindowAttention):
    """timm Swin v1 ``WindowAttention`` computed by ELSA.

    ``forward(x [B*nW, N, C], mask [nW, N, N] (0 / -100 or -inf) | None) -> [B*nW, N, C]``; the relative
    position bias ``table[index]`` and the shift mask are the window op's bias and mask.
    """

    _converts = _swin1.WindowAttention

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B_, N, C = x.shape
        qkv = self.qkv(x).reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        fused, dropout_p, backend = self._route(q)
        if fused:
            out = window_attention(q, k, v, None, self._get_rel_pos_bias()[0], mask,
                                   precision=self.precision, scale=self.scale)
            return self._out(out, B_, N)
        x = window_attention_fallback(q, k, v, self._get_rel_pos_bias(), mask, self.scale,
                                      self.precision, backend, dropout_p)
        return self.proj_drop(self.proj(x))


def _same_key(a: tuple, b: tuple) -> bool:
    """Equal ``(autocast, ((tensor, data_ptr, version), ...))`` keys: the same tensor objects, unchanged."""
    return a[0] == b[0] and len(a[1]) == len(b[1]) and all(
        t is u and p == q and v == w for (t, p, v), (u, q, w) in zip(a[1], b[1]))


def _kept(module: nn.Module, name: str, tensors: tuple, compute) -> Tensor:
    """``compute()``, kept on ``module`` (``__dict__[name]``: no buffer, not in the state dict) and reused
    while autograd is off and ``tensors`` are the same objects, unchanged (their version counters and
    addresses: an in-place update, a replacement, ``.to()`` or ``load_state_dict`` recompute it) under the
    same autocast state. With autograd on, under ``torch.compile`` (the compiler folds it itself), for
    inference tensors (built under ``torch.inference_mode``: no version counters) and while a CUDA graph is
    captured (a graph recomputes it at every replay, reading its inputs as they are then, as the GEMM's
    weight splits) it is computed at every call."""
    if torch.is_grad_enabled() or torch.compiler.is_compiling():
        return compute()
    states = version_state(*tensors)
    if states is None:
        return compute()
    dev = tensors[0].device.type
    autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev)
    key = autocast, tuple((t, *state) for t, state in zip(tensors, states))
    cached = module.__dict__.get(name)
    if cached is not None and _same_key(cached[0], key):
        return cached[1]
    value = compute()
    module.__dict__[name] = (key, value)
    return value


def _finite_coords(table: Tensor) -> Tensor:
    """The normalised ``relative_coords_table`` with the 0/0 of a window side of 1 set to its value, 0.

    timm up to 1.0.29 divides the coordinates by ``window_size - 1`` (timm 1.0.31: by ``max(.., 1)``), so a
    stage whose window is clamped to 1x1 (a small image's last stage) gets a NaN table and NaN outputs."""
    return table.nan_to_num_(0.0)


@register_notrace_module
class ElsaSwinV2WindowAttention(_ElsaWindowAttention, _swin2.WindowAttention):
    """timm Swin v2 ``WindowAttention`` (scaled cosine attention) computed by ELSA.

    ``forward(x [B*nW, N, C], mask [nW, N, N] (0 / -100) | None) -> [B*nW, N, C]``. The W-ELSA op does the
    q/k normalisation, the per-head logit scale, the ``16 sigmoid(cpb)`` bias and the shift mask in one
    launch; the fallback folds the logit scale into q and passes the rest as ``attn_bias`` (``scale=1``).
    """

    _converts = _swin2.WindowAttention

    def _converted(self) -> None:
        _finite_coords(self.relative_coords_table)

    def _make_pair_wise_relative_positions(self, *args, **kwargs) -> tuple[Tensor, Tensor]:
        table, index = super()._make_pair_wise_relative_positions(*args, **kwargs)  # set_window_size
        return _finite_coords(table), index

    def _qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v ``[B_, H, N, Dh]`` from the projection with timm's (q_bias, zero k_bias, v_bias), their
        concatenation kept for inference as the position bias is."""
        B_, N, _ = x.shape
        if self.q_bias is None:
            qkv = self.qkv(x)
        else:
            biases = (self.q_bias, self.k_bias, self.v_bias)
            qkv_bias = _kept(self, "_elsa_qkv_bias", biases, lambda: torch.cat(biases))
            if getattr(self, "qkv_bias_separate", False):
                qkv = self.qkv(x) + qkv_bias
            else:
                qkv = linear_of(self.qkv, x, self.qkv.weight, qkv_bias)
        qkv = qkv.reshape(B_, N, 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        return qkv.unbind(0)

    def position_bias(self) -> Tensor:
        """``16 sigmoid(cpb_mlp(relative_coords_table))[relative_position_index]`` as ``[H, N, N]``.

        With autograd off (inference) the bias is computed once and reused until an input changes: a
        ``cpb_mlp`` parameter or the table/index buffers updated in place (their version counters),
        replaced or moved (``.to()``, ``load_state_dict``), or a different autocast state. Under
        ``torch.compile`` it is always recomputed (the compiler folds it itself), and so it is for a model
        whose weights are inference tensors (built under ``torch.inference_mode``: no version counters).
        """
        tensors = (*self.cpb_mlp.parameters(), self.relative_coords_table, self.relative_position_index)
        return _kept(self, "_elsa_position_bias", tensors, self._position_bias)

    def _position_bias(self) -> Tensor:
        N = self.relative_position_index.shape[0]
        table = self.cpb_mlp(self.relative_coords_table).view(-1, self.num_heads)
        bias = table[self.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1)
        return 16 * torch.sigmoid(bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        B_, N, C = x.shape
        q, k, v = self._qkv(x)
        fused, dropout_p, backend = self._route(q)
        if fused:
            # Bias and mask keep their dtype (float32 under autocast): the kernel reads them as float32.
            out = window_attention(q, k, v, self.logit_scale.view(-1), self.position_bias(), mask,
                                   precision=self.precision)
            return self._out(out, B_, N)
        logit_scale = torch.clamp(self.logit_scale, max=math.log(1.0 / 0.01)).exp()  # [H, 1, 1]
        q = F.normalize(q, dim=-1) * logit_scale
        k = F.normalize(k, dim=-1)
        x = window_attention_fallback(q, k, v, self.position_bias().unsqueeze(0), mask, 1.0,
                                      self.precision, backend, dropout_p)
        return self.proj_drop(self.proj(x))
