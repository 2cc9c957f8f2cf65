"""``ElsaAttention``: a drop-in for timm's ``Attention`` whose attention is ``elsa_attention``.

Parameter names (``qkv``, ``q_norm``, ``k_norm``, ``norm``, ``gate``, ``proj``) and constructor arguments are
timm's, so a timm ``VisionTransformer`` state_dict loads unchanged. The backend and precision are fixed when
the module is built (timm's convention), not chosen per call. Two options timm's ``Attention`` does not have:
``rope`` (a rotary embedding of q and k by per-token positions, VGGT's RoPE2D) and ``query_chunk`` (queries
attend ``query_chunk`` rows at a time, for high-resolution inference).
"""

from __future__ import annotations

import copy
import math

import torch
from timm.models import register_notrace_module
from torch import Tensor, nn

from ..ops._library import eager_bypass
from ..ops.attention import elsa_attention, elsa_attention_qkvpacked, inference_call
from .elsa_module import ElsaAttentionModule, refuse_torchscript

__all__ = ["ElsaAttention", "mask_to_bias", "refuse_torchscript"]


def mask_to_bias(attn_mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """SDPA's ``attn_mask`` (bool: True = attend, or additive float) as an additive float bias."""
    if attn_mask is None or attn_mask.is_floating_point():
        return attn_mask
    if attn_mask.dtype != torch.bool:
        raise TypeError(f"attn_mask must be bool or floating point, got {attn_mask.dtype}")
    bias = torch.zeros(attn_mask.shape, dtype=dtype, device=attn_mask.device)
    return bias.masked_fill_(~attn_mask, -math.inf)


@register_notrace_module  # an FX leaf (timm's registry): its forward branches on the mask and the backend
class ElsaAttention(ElsaAttentionModule, nn.Module):
    """Multi-head self-attention with a fused ``qkv`` projection, computed by ELSA.

    Args are those of ``timm.layers.Attention``; in addition (keyword only):
        backend, precision: passed to :func:`elsa_vision.elsa_attention`.
        rope: a module ``rope(t [B, H, N, D], pos) -> [B, H, N, D]`` (e.g.
            :class:`elsa_vision.layers.RotaryPositionEmbedding2D`) applied to q and k after the q/k norms
            whenever ``forward`` is given ``pos``. It holds no weights of this layer.
        query_chunk: None, or attend ``query_chunk`` query rows at a time: q-side work (attention, ``norm``,
            gate, ``proj``) runs per chunk against the keys and values of the whole sequence, the same
            result as one call (each query row is independent) with the attention workspace of one chunk.
            Not with ``is_causal`` or context parallelism. An attribute, so it can be changed on a built
            model.

    ``forward(x [B, N, C], attn_mask=None, is_causal=False, pos=None) -> [B, N, dim_out]``: ``attn_mask`` is
    SDPA's (bool, True = attend, or additive float; broadcastable to ``[B, H, N, N]``), ``pos`` the
    positions ``rope`` reads (RoPE2D: ``[B, N, 2]`` int64).

    Context parallelism: with ``context_parallel`` set to an :class:`elsa_vision.distributed.ContextParallel`
    (``ElsaViT.set_context_parallel`` does this for every block), ``x`` is this rank's shard
    ``[B, n_local, C]`` of a sequence of ``context_parallel.seq_len`` tokens, attention runs as
    :func:`elsa_vision.distributed.context_parallel_attention` over the group, and ``attn_mask`` holds this
    rank's query rows of the full mask (``[B|1, H|1, n_local, seq_len]``). Attention dropout is not available
    in that mode.
    """

    __prepare_scriptable__ = refuse_torchscript

    def __init__(
        self,
        dim: int,
        num_heads: int = 8,
        attn_head_dim: int | None = None,
        dim_out: int | None = None,
        qkv_bias: bool = False,
        qk_norm: bool = False,
        scale_norm: bool = False,
        proj_bias: bool = True,
        gated: bool = False,
        attn_drop: float = 0.0,
        proj_drop: float = 0.0,
        norm_layer: type[nn.Module] | None = None,
        device=None,
        dtype=None,
        *,
        backend: str = "auto",
        precision: str = "auto",
        rope: nn.Module | None = None,
        query_chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.check_options(backend, precision)
        dd = {"device": device, "dtype": dtype}
        dim_out = dim_out or dim
        head_dim = attn_head_dim
        if head_dim is None:
            if dim % num_heads:
                raise ValueError(f"ElsaAttention: dim ({dim}) must be divisible by num_heads ({num_heads})")
            head_dim = dim // num_heads
        if (qk_norm or scale_norm) and norm_layer is None:
            raise ValueError("ElsaAttention: norm_layer must be given when qk_norm or scale_norm is True")
        self.num_heads = num_heads
        self.head_dim = head_dim
        self.attn_dim = num_heads * head_dim
        self.scale = head_dim**-0.5
        self.backend = backend
        self.precision = precision
        self.query_chunk = query_chunk

        self.qkv = nn.Linear(dim, self.attn_dim * 3, bias=qkv_bias, **dd)
        self.q_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.k_norm = norm_layer(head_dim, **dd) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(attn_drop)
        self.norm = norm_layer(self.attn_dim, **dd) if scale_norm else nn.Identity()
        self.gate = nn.Linear(dim, self.attn_dim, bias=qkv_bias, **dd) if gated else None
        self.proj = nn.Linear(self.attn_dim, dim_out, bias=proj_bias, **dd)
        self.proj_drop = nn.Dropout(proj_drop)
        self.rope = rope
        self.context_parallel = None  # an elsa_vision.distributed.ContextParallel, or None

    @property
    def query_chunk(self) -> int | None:
        """Query rows attended at a time (None: all); checked when set."""
        return self._query_chunk

    @query_chunk.setter
    def query_chunk(self, value: int | None) -> None:
        self._query_chunk = _check_chunk(value)

    def forward(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False,
                pos: Tensor | None = None) -> Tensor:
        B, N, _ = x.shape
        # q, k, v stay strided views of the fused projection: the kernels read them without copies.
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim)
        if self._packed(attn_mask, pos, N):  # training: qkv's gradient written in place, in one piece
            o = elsa_attention_qkvpacked(qkv, causal=bool(is_causal), scale=self.scale,
                                         precision=self.precision, backend=self.backend)
            return self._project(o, x)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        if q.dtype != v.dtype:  # CUDA autocast runs layer_norm in float32: q, k back to the projection's
            q, k = q.to(v.dtype), k.to(v.dtype)  # dtype, as SDPA's autocast does
        rotated = self.rope is not None and pos is not None
        if rotated:
            q, k = self.rope.rotate(q, k, pos)
        chunk = self._query_chunk
        if chunk is None or N <= chunk:
            o = self._attend(x, q, k, v, attn_mask, bool(is_causal), rotated)
            return self._project(o.transpose(1, 2), x)
        if is_causal or self.context_parallel is not None:
            raise ValueError("ElsaAttention: query_chunk is not available with is_causal=True or context "
                             "parallelism; set query_chunk=None")
        attn_mask = mask_to_bias(attn_mask, q.dtype)  # once, not per chunk
        per_row = attn_mask is not None and attn_mask.dim() >= 2 and attn_mask.shape[-2] != 1
        out = None
        for s in range(0, N, chunk):
            e = min(N, s + chunk)
            rows = attn_mask[..., s:e, :] if per_row else attn_mask
            o = self._attend(x, q[:, :, s:e], k, v, rows, False, None)
            y = self._project(o.transpose(1, 2), x[:, s:e])
            if out is None:
                out = y.new_empty(B, N, y.shape[-1])
            out[:, s:e] = y
        return out

    def _packed(self, attn_mask: Tensor | None, pos: Tensor | None, N: int) -> bool:
        """Whether this call attends the packed projection itself (``elsa_attention_qkvpacked``): with
        autograd on, where q and k are the projection's (no q/k norm, no RoPE) and nothing else the packed
        entry lacks is asked for (a mask, context parallelism, attention dropout, query chunks). Inference
        keeps its planned call (``_planned``)."""
        return (torch.is_grad_enabled() and attn_mask is None and self.context_parallel is None
                and type(self.q_norm) is nn.Identity and type(self.k_norm) is nn.Identity
                and (pos is None or self.rope is None) and not (self.training and self.attn_drop.p > 0)
                and (self._query_chunk is None or N <= self._query_chunk))

    def _attend(self, x: Tensor, q: Tensor, k: Tensor, v: Tensor, attn_mask: Tensor | None, causal: bool,
                rotated: bool | None) -> Tensor:
        """``[B, H, Nq, Dv]``. ``rotated``: whether RoPE made q, k (part of the planned call's signature);
        None: q is not the whole of the projection (a query chunk), so the call is not planned."""
        dropout_p = self.attn_drop.p if self.training else 0.0
        cp = self.context_parallel
        inference = attn_mask is None and cp is None and dropout_p == 0.0 and not torch.is_grad_enabled()
        if inference and rotated is not None:  # plain eager: the planned call; traced: the operator
            return eager_bypass(x, _planned, _unplanned)(self, x, q, k, v, causal, rotated)
        if cp is not None:
            if dropout_p > 0:
                raise ValueError(
                    f"ElsaAttention: attention dropout (attn_drop={dropout_p}) is not available with context "
                    f"parallelism; set attn_drop_rate=0 or call .eval()")
            return cp.attention(q, k, v, attn_bias=mask_to_bias(attn_mask, q.dtype), causal=causal,
                                scale=self.scale, precision=self.precision, backend=self.backend)
        return elsa_attention(
            q, k, v, attn_bias=mask_to_bias(attn_mask, q.dtype), causal=causal, scale=self.scale,
            precision=self.precision, backend="torch" if dropout_p > 0 else self.backend, dropout_p=dropout_p,
        )

    def _project(self, o: Tensor, x: Tensor) -> Tensor:
        """Attention output ``o [B, n, H, Dv]`` of the tokens ``x [B, n, C]`` -> ``[B, n, dim_out]``."""
        B, n = o.shape[:2]
        o = self.norm(o.reshape(B, n, self.attn_dim))
        if self.gate is not None:
            o = o * self.gate(x).sigmoid()
        return self.proj_drop(self.proj(o))

    def __getstate__(self):
        state = super().__getstate__()
        state.pop("_elsa_calls", None)  # planned launch programs: rebuilt on first use after a copy
        return state

    @classmethod
    def from_module(cls, module: nn.Module, *, backend: str = "auto",
                    precision: str = "auto") -> ElsaAttention:
        """What takes the place of a timm ``Attention`` in a patched model: a weight-preserving copy
        (:meth:`from_timm`; this layer is built from its own constructor, not converted in place)."""
        return cls.from_timm(module, backend=backend, precision=precision)

    @classmethod
    def from_timm(cls, attn: nn.Module, *, backend: str = "auto", precision: str = "auto") -> ElsaAttention:
        """A weight-preserving copy of a timm ``Attention`` (fused ``qkv``) as ``ElsaAttention``.

        The result has the same parameters (shared storage is not kept: tensors are copied), device, dtype and
        train/eval mode; ``attn`` itself is left unchanged.
        """
        qkv = getattr(attn, "qkv", None)
        if not isinstance(qkv, nn.Linear) or not isinstance(getattr(attn, "proj", None), nn.Linear):
            raise TypeError(
                f"ElsaAttention.from_timm: expected a timm Attention with `qkv` and `proj` nn.Linear layers, "
                f"got {type(attn).__name__}"
            )
        num_heads, head_dim = int(attn.num_heads), int(attn.head_dim)
        if qkv.out_features != 3 * num_heads * head_dim:
            raise ValueError(
                f"ElsaAttention.from_timm: qkv.out_features must be 3 * num_heads * head_dim = "
                f"{3 * num_heads * head_dim}, got {qkv.out_features}"
            )
        q_norm, norm = getattr(attn, "q_norm", nn.Identity()), getattr(attn, "norm", nn.Identity())
        gate = getattr(attn, "gate", None)
        new = cls(
            qkv.in_features, num_heads=num_heads, attn_head_dim=head_dim, dim_out=attn.proj.out_features,
            qkv_bias=qkv.bias is not None, proj_bias=attn.proj.bias is not None, gated=gate is not None,
            attn_drop=attn.attn_drop.p, proj_drop=attn.proj_drop.p, device=qkv.weight.device,
            dtype=qkv.weight.dtype,
            backend=backend, precision=precision,
        )
        # Norm layers are taken over as copies of the source modules (any norm type, any eps).
        new.q_norm = copy.deepcopy(q_norm)
        new.k_norm = copy.deepcopy(getattr(attn, "k_norm", nn.Identity()))
        new.norm = copy.deepcopy(norm)
        new.scale = float(getattr(attn, "scale", new.scale))
        missing, unexpected = new.load_state_dict(attn.state_dict(), strict=False)
        if missing or unexpected:
            raise ValueError(
                f"ElsaAttention.from_timm: {type(attn).__name__} does not map onto ElsaAttention "
                f"(missing {missing}, unexpected {unexpected})"
            )
        return new.train(attn.training)

    def extra_repr(self) -> str:
        chunk = f", query_chunk={self.query_chunk}" if self.query_chunk is not None else ""
        return (f"heads={self.num_heads}, head_dim={self.head_dim}, backend={self.backend}, "
                f"precision={self.precision}{chunk}")


def _planned(layer: ElsaAttention, x: Tensor, q: Tensor, k: Tensor, v: Tensor, causal: bool,
             rotated: bool) -> Tensor:
    """Inference without a mask: the attention call checked and planned once per input signature
    (``ops.attention.inference_call``; q, k, v are views of the projection of ``x``, or RoPE's outputs of
    them, so ``x``'s shape and device and q's dtype fix theirs), later calls go straight to the launch
    program. Plain eager calls only (``eager_bypass``): a launch program is no operator."""
    # q's dtype, not x's: under autocast the projection (so q, k, v) is in the autocast dtype
    key = (x.shape, q.dtype, x.device, causal, rotated, layer.backend, layer.precision, layer.scale)
    calls = layer.__dict__.setdefault("_elsa_calls", {})
    call = calls.get(key, False)
    if call is False:
        call = calls[key] = inference_call(q, k, v, causal=causal, scale=layer.scale,
                                           precision=layer.precision, backend=layer.backend)
    if call is None:  # not one Triton launch (the torch backend ...)
        return _unplanned(layer, x, q, k, v, causal, rotated)
    return call(q, k, v)


def _unplanned(layer: ElsaAttention, x: Tensor, q: Tensor, k: Tensor, v: Tensor, causal: bool,
               rotated: bool) -> Tensor:
    """The same inference call through ``elsa_attention`` (its operator where something traces)."""
    return elsa_attention(q, k, v, causal=causal, scale=layer.scale, precision=layer.precision,
                          backend=layer.backend)


def _check_chunk(query_chunk: int | None) -> int | None:
    if query_chunk is not None and (isinstance(query_chunk, bool) or not isinstance(query_chunk, int)
                                    or query_chunk < 1):
        raise ValueError(f"ElsaAttention: query_chunk must be None or an int >= 1, got {query_chunk!r}")
    return query_chunk
