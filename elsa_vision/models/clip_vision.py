"""ElsaCLIPVision: the open_clip / OpenAI-CLIP image tower with ELSA attention.

CLIP ("Learning Transferable Visual Models From Natural Language Supervision", https://arxiv.org/abs/2103.00020)
encodes images with a pre-norm ViT; CoCa (https://arxiv.org/abs/2205.01917) adds an attentional pooler with
learned queries. This module keeps open_clip's ``VisionTransformer`` state_dict layout exactly:

    conv1.weight (D, 3, P, P)             no bias
    class_embedding (D,)                  positional_embedding (1 + N, D)
    ln_pre.*                              transformer.resblocks.i.{ln_1, attn.in_proj_weight (3D, D),
                                          attn.in_proj_bias (3D,), attn.out_proj, ln_2, mlp.c_fc, mlp.c_proj}
                                          (+ ls_1.gamma, ls_2.gamma with layer scale)
    attn_pool.{query, attn.*, ln_q, ln_k} (attentional pooler)   attn_pool_contrastive.* (parallel/cascade)
    ln_post.*                             proj (D or E, E)

so open_clip and OpenAI checkpoints load unchanged, while every attention (self-attention in the blocks and
cross-attention of the pooler's learned queries) runs through :func:`elsa_vision.elsa_attention` with q, k, v
as strided views of the fused ``in_proj`` output in SDPA layout ``[B, H, N, Dh]``.

Inputs larger (or smaller) than ``image_size`` are accepted: the patch-grid positional embedding is resampled
bicubically (antialiased), as open_clip's ``resize_pos_embed`` does when loading a checkpoint at another
resolution. :meth:`ElsaCLIPVision.set_image_size` makes such a resize permanent.

The registered towers (``elsa_clip_b16``, ``elsa_clip_l14``, ``elsa_clip_l14_336``) are timm models that
behave as timm's own CLIP ViTs (``vit_base_patch16_clip_224`` ...): the projection ``proj`` is the head, so
``num_classes`` is its width (the CLIP embedding width by default), ``num_classes=0`` or
``reset_classifier(0)`` gives the pooled ``width``-wide features, ``features_only=True`` and
``forward_intermediates`` give every block's patch tokens, and the model traces with torch.fx.
"""

from __future__ import annotations

import math
import os
from collections import OrderedDict
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from timm.data import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD
from timm.layers import LayerScale, QuickGELU
from timm.models import (
    adapt_input_conv,
    build_model_with_cfg,
    generate_default_cfgs,
    register_model,
    register_notrace_function,
    register_notrace_module,
)
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from ..layers.elsa_module import ElsaModel, check_attention_options, check_linear_options
from ..layers.multihead_attention import ElsaMultiheadAttention

__all__ = [
    "ElsaCLIPVision",
    "ElsaMultiheadAttention",
    "CLIP_VISION_ARCHITECTURES",
    "clip_checkpoint_filter_fn",
    "create_elsa_clip_vision",
    "from_open_clip",
    "load_clip_state_dict",
    "resample_positional_embedding",
    "vision_state_dict",
]


def _pair(x) -> tuple[int, int]:
    if isinstance(x, (tuple, list)):
        if len(x) != 2:
            raise ValueError(f"expected an int or a pair (H, W), got {x!r}")
        return int(x[0]), int(x[1])
    return int(x), int(x)


# ----------------------------------------------------------------------------------------------- layers


class LayerNorm(nn.LayerNorm):
    """LayerNorm returning the input dtype; ``fp32=True`` normalises in float32 (LayerNormFp32)."""

    def __init__(self, normalized_shape, eps: float = 1e-5, fp32: bool = False, **kwargs) -> None:
        super().__init__(normalized_shape, eps=eps, **kwargs)
        self.fp32 = fp32

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        if self.fp32:
            x = x.float()
        return F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps).to(dtype)


@register_notrace_module  # an FX leaf: how many tokens it keeps depends on the input's length
class PatchDropout(nn.Module):
    """Drops random patch tokens while training (https://arxiv.org/abs/2212.00794); keeps token 0."""

    def __init__(self, prob: float) -> None:
        super().__init__()
        if not 0.0 <= prob < 1.0:
            raise ValueError(f"PatchDropout: prob must be in [0, 1), got {prob}")
        self.prob = prob

    def forward(self, x: Tensor) -> Tensor:
        if not self.training or self.prob == 0.0:
            return x
        cls_tok, x = x[:, :1], x[:, 1:]
        B, N = x.shape[:2]
        keep = max(1, int(N * (1.0 - self.prob)))
        idx = torch.randn(B, N, device=x.device).topk(keep, dim=-1).indices
        x = x[torch.arange(B, device=x.device)[:, None], idx]
        return torch.cat((cls_tok, x), dim=1)


class ResidualAttentionBlock(nn.Module):
    """Pre-norm block ``x + ls_1(attn(ln_1(x)))``, ``x + ls_2(mlp(ln_2(x)))`` with open_clip's names."""

    def __init__(
        self,
        width: int,
        heads: int,
        mlp_ratio: float,
        ls_init_value: float | None,
        act_layer: type[nn.Module],
        norm_layer,
        backend: str,
        precision: str,
    ) -> None:
        super().__init__()
        self.ln_1 = norm_layer(width)
        self.attn = ElsaMultiheadAttention(width, heads, batch_first=True, backend=backend,
                                           precision=precision)
        self.ls_1 = LayerScale(width, ls_init_value) if ls_init_value is not None else nn.Identity()
        self.ln_2 = norm_layer(width)
        hidden = int(width * mlp_ratio)
        self.mlp = nn.Sequential(
            OrderedDict(
                [
                    ("c_fc", nn.Linear(width, hidden)),
                    ("gelu", act_layer()),
                    ("c_proj", nn.Linear(hidden, width)),
                ]
            )
        )
        self.ls_2 = LayerScale(width, ls_init_value) if ls_init_value is not None else nn.Identity()

    def forward(self, x: Tensor) -> Tensor:
        y = self.ln_1(x)
        x = x + self.ls_1(self.attn(y, y, y, need_weights=False)[0])
        return x + self.ls_2(self.mlp(self.ln_2(x)))


class Transformer(nn.Module):
    """``resblocks``: a stack of :class:`ResidualAttentionBlock` over ``[B, N, width]``."""

    def __init__(
        self,
        width: int,
        layers: int,
        heads: int,
        mlp_ratio: float,
        ls_init_value: float | None,
        act_layer,
        norm_layer,
        backend: str,
        precision: str,
    ) -> None:
        super().__init__()
        self.width, self.layers = width, layers
        self.grad_checkpointing = False
        self.resblocks = nn.ModuleList(
            [
                ResidualAttentionBlock(
                    width, heads, mlp_ratio, ls_init_value, act_layer, norm_layer, backend, precision
                )
                for _ in range(layers)
            ]
        )

    def forward(self, x: Tensor) -> Tensor:
        for blk in self.resblocks:
            if self.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return x


class AttentionalPooler(nn.Module):
    """CoCa's pooler: ``n_queries`` learned queries cross-attend (through ELSA) to the LayerNormed tokens.

    ``[B, N, context_dim] -> [B, n_queries, d_model]``.
    """

    def __init__(
        self,
        d_model: int,
        context_dim: int,
        n_head: int,
        n_queries: int,
        norm_layer,
        backend: str,
        precision: str,
    ) -> None:
        super().__init__()
        self.query = nn.Parameter(torch.randn(n_queries, d_model))
        self.attn = ElsaMultiheadAttention(
            d_model, n_head, kdim=context_dim, vdim=context_dim, batch_first=True, backend=backend,
            precision=precision,
        )
        self.ln_q = norm_layer(d_model)
        self.ln_k = norm_layer(context_dim)

    def forward(self, x: Tensor) -> Tensor:
        x = self.ln_k(x)
        q = self.ln_q(self.query).unsqueeze(0).expand(x.shape[0], -1, -1)
        return self.attn(q, x, x, need_weights=False)[0]


def _sincos_2d(width: int, grid: tuple[int, int]) -> Tensor:
    """Fixed 2-D sin-cos embedding ``(1 + gh*gw, width)`` with a zero class row (MAE's layout)."""
    if width % 4:
        raise ValueError(f"sin_cos_2d positional embedding needs width divisible by 4, got {width}")
    gh, gw = grid
    omega = 1.0 / 10000 ** (torch.arange(width // 4, dtype=torch.float64) / (width / 4.0))
    ys, xs = torch.meshgrid(
        torch.arange(gh, dtype=torch.float64), torch.arange(gw, dtype=torch.float64), indexing="ij"
    )
    parts = []
    for coord in (
        xs.reshape(-1),
        ys.reshape(-1),
    ):  # first half encodes the column (w), second half the row (h)
        out = coord[:, None] * omega[None]
        parts += [out.sin(), out.cos()]
    emb = torch.cat(parts, dim=1)
    return torch.cat([torch.zeros(1, width, dtype=torch.float64), emb], 0).float()


def resample_positional_embedding(
    pos: Tensor, old_grid: tuple[int, int], new_grid: tuple[int, int], num_prefix_tokens: int = 1
) -> Tensor:
    """Resample the patch rows of ``pos (prefix + gh*gw, D)`` to ``new_grid`` (bicubic, antialiased).

    The prefix (class) rows are kept; this is open_clip's ``resize_pos_embed`` for any (also non-square) grid.
    """
    old_grid, new_grid = _pair(old_grid), _pair(new_grid)
    if pos.shape[0] != num_prefix_tokens + old_grid[0] * old_grid[1]:
        raise ValueError(
            f"positional embedding has {pos.shape[0]} rows, expected {num_prefix_tokens} + "
            f"{old_grid[0]}*{old_grid[1]} for grid {old_grid}"
        )
    if old_grid == new_grid:
        return pos
    prefix, grid = pos[:num_prefix_tokens], pos[num_prefix_tokens:]
    grid = grid.reshape(1, old_grid[0], old_grid[1], -1).permute(0, 3, 1, 2)
    grid = F.interpolate(grid.float(), size=new_grid, mode="bicubic", antialias=True, align_corners=False)
    grid = grid.to(pos.dtype).permute(0, 2, 3, 1).reshape(new_grid[0] * new_grid[1], -1)
    return torch.cat([prefix, grid], 0)


@register_notrace_function  # an FX leaf, called on the real input (FX skips names with a leading "_")
def check_clip_images(x: Tensor, in_chans: int, patch_size: tuple[int, int]) -> Tensor:
    """``x``, which must be images ``[B, in_chans, H, W]`` with ``H, W`` multiples of ``patch_size``
    (returned, so that the check is a node the traced graph depends on)."""
    if x.dim() != 4 or x.shape[1] != in_chans:
        raise ValueError(f"ElsaCLIPVision: expected images [B, {in_chans}, H, W], got {list(x.shape)}")
    H, W = x.shape[-2:]
    if H % patch_size[0] or W % patch_size[1]:
        raise ValueError(
            f"ElsaCLIPVision: input size ({H}, {W}) must be a multiple of patch_size {tuple(patch_size)}"
        )
    return x


@register_notrace_function  # an FX leaf: the grid is read from the patch map's shape
def clip_positional_embedding(pos: Tensor, grid_size: tuple[int, int], patches: Tensor) -> Tensor:
    """``pos (1 + gh*gw, D)`` of the stored ``grid_size``, resampled to the grid of ``patches [B, D, h, w]``
    when it differs (:func:`resample_positional_embedding`)."""
    grid = (patches.shape[-2], patches.shape[-1])
    if grid == tuple(grid_size):
        return pos
    return resample_positional_embedding(pos, grid_size, grid)


# timm's global_pool names -> open_clip's pool_type
_TIMM_POOL = {"token": "tok", "avg": "avg", "": "none"}


def _pool_type(who: str, global_pool: str) -> str:
    if global_pool not in _TIMM_POOL:
        raise ValueError(f"{who}: global_pool must be one of {sorted(_TIMM_POOL)}, got {global_pool!r}")
    return _TIMM_POOL[global_pool]


# ------------------------------------------------------------------------------------------------ model


class ElsaCLIPVision(ElsaModel, nn.Module):
    """open_clip's ``VisionTransformer`` (same arguments, same state_dict) with ELSA attention.

    Args:
        image_size, patch_size: int or (H, W). width, layers, heads, mlp_ratio: trunk shape.
        ls_init_value: layer-scale init (None: no ``ls_1``/``ls_2``).
        attentional_pool: False; True (CoCa: ``attn_pool`` then ``ln_post`` then ``pool_type``); or
            ``"parallel"`` / ``"cascade"`` (``attn_pool`` + ``attn_pool_contrastive`` with one query).
        attn_pooler_queries, attn_pooler_heads: pooler shape.
        output_dim: embedding width E (``proj`` is ``(D, E)``, or ``(E, E)`` with an attentional pooler; the
            pooler's width is E).
        patch_dropout: training-time patch drop fraction. no_ln_pre: drop ``ln_pre``.
        pos_embed_type: ``"learnable"`` or ``"sin_cos_2d"`` (fixed).
        pool_type: ``"tok"``, ``"avg"``, ``"none"``.
        final_ln_after_pool: apply ``ln_post`` after pooling (no attentional pool).
        act_layer: ``"gelu"``, ``"quick_gelu"`` or an ``nn.Module`` class. norm_eps: LayerNorm eps.
        norm_fp32: LayerNorm in float32 for half inputs (open_clip's ``LayerNormFp32``).
        output_tokens: ``forward`` returns ``(pooled, tokens)``.
        num_classes: timm's name for the width of the head, which is the projection ``proj``: None (default)
            is ``output_dim`` (the CLIP embedding); another width builds a new projection
            ``(pool width, num_classes)``; 0 builds none (``forward`` returns the pooled features,
            ``head_hidden_size`` wide).
        in_chans: input channels of ``conv1`` (3 for every CLIP checkpoint; a checkpoint's RGB ``conv1`` is
            adapted to another count by :func:`clip_checkpoint_filter_fn`, timm's ``adapt_input_conv``).
        global_pool: timm's name for ``pool_type``: ``"token"`` (``"tok"``), ``"avg"``, ``""`` (``"none"``);
            overrides ``pool_type`` when given.
        attn_backend, attn_precision: ``elsa_attention`` backend of every attention / float32 precision of
            the attention and linear layers.
        linear_backend: ``elsa_linear`` backend of the linear layers and ``conv1`` (``"auto"``: FP32-accurate
            split GEMMs for float32 on CUDA; ``"torch"``: PyTorch's own GEMMs).

    Shapes: ``forward(x [B, in_chans, H, W]) -> [B, num_classes]`` (``[B, 1, E]`` for
    ``"parallel"``/``"cascade"``), tokens ``[B, gh*gw, D]`` (``[B, n_queries - 1, E]`` with CoCa pooling).
    ``H, W`` must be multiples of the patch size; other than ``image_size`` they use a resampled positional
    embedding.

    timm's model API: ``num_classes``, ``num_features`` (``width``: the tokens of ``forward_features``),
    ``head_hidden_size`` (the pooled features, ``width`` or E with an attentional pooler),
    ``forward_features`` (tokens after the last block and, when ``ln_post`` normalises tokens -- no
    attentional pooler, no ``final_ln_after_pool`` -- after ``ln_post``, timm's ``norm``),
    ``forward_head(x, pre_logits=False)``, ``get_classifier`` / ``reset_classifier``,
    ``forward_intermediates``, ``prune_intermediate_layers``, ``feature_info`` (one entry per block) and
    ``set_grad_checkpointing``.
    """

    def __init__(
        self,
        image_size=224,
        patch_size=16,
        width: int = 768,
        layers: int = 12,
        heads: int = 12,
        mlp_ratio: float = 4.0,
        ls_init_value: float | None = None,
        attentional_pool: bool | str = False,
        attn_pooler_queries: int = 256,
        attn_pooler_heads: int = 8,
        output_dim: int = 512,
        patch_dropout: float = 0.0,
        no_ln_pre: bool = False,
        pos_embed_type: str = "learnable",
        pool_type: str = "tok",
        final_ln_after_pool: bool = False,
        act_layer: str | type[nn.Module] = "gelu",
        norm_eps: float = 1e-5,
        norm_fp32: bool = False,
        output_tokens: bool = False,
        *,
        num_classes: int | None = None,
        in_chans: int = 3,
        global_pool: str | None = None,
        attn_backend: str = "auto",
        attn_precision: str = "auto",
        linear_backend: str = "auto",
    ) -> None:
        super().__init__()
        check_attention_options("ElsaCLIPVision", attn_backend, attn_precision)
        check_linear_options("ElsaCLIPVision", linear_backend)
        if global_pool is not None:
            pool_type = _pool_type("ElsaCLIPVision", global_pool)
        num_classes = output_dim if num_classes is None else num_classes
        if num_classes < 0:
            raise ValueError(f"ElsaCLIPVision: num_classes must be >= 0 or None, got {num_classes}")
        if in_chans < 1:
            raise ValueError(f"ElsaCLIPVision: in_chans must be >= 1, got {in_chans}")
        if pool_type not in ("tok", "avg", "none"):
            raise ValueError(f"ElsaCLIPVision: pool_type must be 'tok', 'avg' or 'none', got {pool_type!r}")
        if pos_embed_type not in ("learnable", "sin_cos_2d"):
            raise ValueError(
                f"ElsaCLIPVision: pos_embed_type must be 'learnable' or 'sin_cos_2d', got {pos_embed_type!r}"
            )
        if attentional_pool not in (False, True, "parallel", "cascade"):
            raise ValueError(
                f"ElsaCLIPVision: attentional_pool must be False, True, 'parallel' or 'cascade', "
                f"got {attentional_pool!r}"
            )
        if isinstance(act_layer, str):
            acts = {"gelu": nn.GELU, "quick_gelu": QuickGELU}
            if act_layer not in acts:
                raise ValueError(
                    f"ElsaCLIPVision: act_layer must be one of {sorted(acts)} or a module class, "
                    f"got {act_layer!r}"
                )
            act_layer = acts[act_layer]
        if width % heads:
            raise ValueError(f"ElsaCLIPVision: width ({width}) must be divisible by heads ({heads})")
        self.image_size = _pair(image_size)
        self.patch_size = _pair(patch_size)
        if self.image_size[0] % self.patch_size[0] or self.image_size[1] % self.patch_size[1]:
            raise ValueError(
                f"ElsaCLIPVision: image_size {self.image_size} must be a multiple of patch_size "
                f"{self.patch_size}"
            )
        self.grid_size = (self.image_size[0] // self.patch_size[0], self.image_size[1] // self.patch_size[1])
        self.width, self.output_dim = width, output_dim
        self.output_tokens = output_tokens
        self.final_ln_after_pool = final_ln_after_pool
        self.pos_embed_type = pos_embed_type

        def norm_layer(d):
            return LayerNorm(d, eps=norm_eps, fp32=norm_fp32)

        self.in_chans = in_chans
        self.conv1 = nn.Conv2d(in_chans, width, kernel_size=self.patch_size, stride=self.patch_size,
                               bias=False)
        scale = width**-0.5
        self.class_embedding = nn.Parameter(scale * torch.randn(width))
        n_pos = self.grid_size[0] * self.grid_size[1] + 1
        if pos_embed_type == "learnable":
            self.positional_embedding = nn.Parameter(scale * torch.randn(n_pos, width))
        else:
            self.positional_embedding = nn.Parameter(_sincos_2d(width, self.grid_size), requires_grad=False)
        self.patch_dropout = PatchDropout(patch_dropout) if patch_dropout > 0 else nn.Identity()
        self.ln_pre = nn.Identity() if no_ln_pre else norm_layer(width)
        self.transformer = Transformer(
            width,
            layers,
            heads,
            mlp_ratio,
            ls_init_value,
            act_layer,
            norm_layer,
            attn_backend,
            attn_precision,
        )
        self.attn_pool_type = attentional_pool if isinstance(attentional_pool, str) else ""
        if attentional_pool:
            self.attn_pool = AttentionalPooler(
                output_dim,
                width,
                attn_pooler_heads,
                attn_pooler_queries,
                norm_layer,
                attn_backend,
                attn_precision,
            )
            if isinstance(attentional_pool, str):
                self.attn_pool_contrastive = AttentionalPooler(
                    output_dim, width, attn_pooler_heads, 1, norm_layer, attn_backend, attn_precision
                )
                self.pool_type = "none"
            else:
                self.attn_pool_contrastive = None
                self.pool_type = pool_type
            pool_dim = output_dim
        else:
            self.attn_pool = None
            self.attn_pool_contrastive = None
            self.pool_type = pool_type
            pool_dim = width
        self.ln_post = norm_layer(pool_dim)
        # ln_post normalises the tokens (timm's `norm`) unless it follows a pooler or the pooling
        self._token_norm = self.attn_pool is None and not final_ln_after_pool
        self.num_classes = num_classes
        self.num_features = self.embed_dim = width
        self.head_hidden_size = pool_dim
        self.num_prefix_tokens = 1
        self.proj = nn.Parameter(scale * torch.randn(pool_dim, num_classes)) if num_classes else None
        reduction = self.patch_size[0] if self.patch_size[0] == self.patch_size[1] else self.patch_size
        self.feature_info = [dict(module=f"transformer.resblocks.{i}", num_chs=width, reduction=reduction)
                             for i in range(layers)]
        self._elsa_linears(linear_backend, attn_precision)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        self.transformer.grad_checkpointing = enable

    def lock(self, unlocked_groups: int = 0, freeze_bn_stats: bool = False) -> None:
        """Freeze the tower except its last ``unlocked_groups`` groups (LiT; open_clip's grouping).

        Groups, first to last: the embedding (``conv1``, ``class_embedding``, ``positional_embedding``,
        ``ln_pre``), each block but the last, the last block with ``ln_post``, and ``proj``.
        """
        if unlocked_groups < 0:
            raise ValueError(f"lock: unlocked_groups must be >= 0, got {unlocked_groups}")
        for p in self.parameters():
            p.requires_grad = False
        if unlocked_groups == 0:
            return
        blocks = list(self.transformer.resblocks)
        groups = [
            [self.conv1, self.class_embedding, self.positional_embedding, self.ln_pre],
            *[[b] for b in blocks[:-1]],
            [blocks[-1], self.ln_post],
            [self.proj],
        ]
        for group in groups[-unlocked_groups:]:
            for item in group:
                if item is None:  # no projection (num_classes=0)
                    continue
                params = [item] if isinstance(item, nn.Parameter) else list(item.parameters())
                for p in params:
                    p.requires_grad = True

    def no_weight_decay(self) -> set[str]:
        return {"positional_embedding", "class_embedding"}

    def set_image_size(self, image_size) -> None:
        """Resample ``positional_embedding`` to a new default input size (in place)."""
        image_size = _pair(image_size)
        if image_size[0] % self.patch_size[0] or image_size[1] % self.patch_size[1]:
            raise ValueError(
                f"set_image_size: image_size {image_size} must be a multiple of patch_size {self.patch_size}"
            )
        grid = (image_size[0] // self.patch_size[0], image_size[1] // self.patch_size[1])
        with torch.no_grad():
            new = resample_positional_embedding(self.positional_embedding.data, self.grid_size, grid)
        self.positional_embedding = nn.Parameter(new, requires_grad=self.positional_embedding.requires_grad)
        self.image_size, self.grid_size = image_size, grid

    # -- timm's classifier API -------------------------------------------------------------------------
    def get_classifier(self) -> nn.Parameter | None:
        """The head: the projection ``proj`` ``(head_hidden_size, num_classes)``; None with
        ``num_classes=0``."""
        return self.proj

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new projection of width ``num_classes`` (0: none, ``forward`` returns the pooled features);
        ``global_pool`` (timm's names ``"token"``, ``"avg"``, ``""``) changes the pooling of a tower without
        an attentional pooler."""
        if num_classes < 0:
            raise ValueError(f"reset_classifier: num_classes must be >= 0, got {num_classes}")
        if global_pool is not None:
            pool_type = _pool_type("reset_classifier", global_pool)
            if self.attn_pool is not None:
                raise ValueError("reset_classifier: the pooling of a tower with an attentional pooler is "
                                 "fixed; pass global_pool=None")
            self.pool_type = pool_type
        self.num_classes = num_classes
        w = self.conv1.weight
        self.proj = (nn.Parameter(self.width**-0.5 * torch.randn(self.head_hidden_size, num_classes,
                                                                  device=w.device, dtype=w.dtype))
                     if num_classes else None)

    # -- forward ---------------------------------------------------------------------------------------
    def _embeds(self, x: Tensor) -> Tensor:
        x = self.conv1(check_clip_images(x, self.in_chans, self.patch_size))
        pos = clip_positional_embedding(self.positional_embedding, self.grid_size, x)
        x = x.flatten(2).transpose(1, 2)
        cls_tok = self.class_embedding.to(x.dtype).view(1, 1, -1).expand(x.shape[0], -1, -1)
        x = torch.cat([cls_tok, x], dim=1) + pos.to(x.dtype)
        x = self.patch_dropout(x)
        return self.ln_pre(x)

    def forward_features(self, x: Tensor) -> Tensor:
        """Tokens ``[B, 1 + gh*gw, width]`` after the last block, normalised by ``ln_post`` when it
        normalises tokens (no attentional pooler, no ``final_ln_after_pool``: timm's ``norm``)."""
        x = self.transformer(self._embeds(x))
        return self.ln_post(x) if self._token_norm else x

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        return_prefix_tokens: bool = False,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NCHW",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """timm's ``forward_intermediates``: the patch tokens after the blocks ``indices`` selects (the last
        ``n`` for an int, all for None), as ``[B, width, gh, gw]`` (``"NCHW"``) or ``[B, gh*gw, width]``
        (``"NLC"``); ``norm`` applies ``ln_post`` (towers whose ``ln_post`` normalises tokens);
        ``return_prefix_tokens`` pairs each with its class token. Returns ``(forward_features(x),
        intermediates)``, or the intermediates alone with ``intermediates_only``."""
        if output_fmt not in ("NCHW", "NLC"):
            raise ValueError(f"forward_intermediates: output_fmt must be 'NCHW' or 'NLC', got {output_fmt!r}")
        if norm and not self._token_norm:
            raise ValueError("forward_intermediates: norm=True needs a tower whose ln_post normalises tokens "
                             "(no attentional pooler, no final_ln_after_pool)")
        blocks = self.transformer.resblocks
        take_indices, max_index = feature_take_indices(len(blocks), indices)
        B, _, H, W = x.shape
        x = self._embeds(x)
        if stop_early:
            blocks = blocks[: max_index + 1]
        intermediates = []
        for i, blk in enumerate(blocks):
            if self.transformer.grad_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
            if i in take_indices:
                intermediates.append(self.ln_post(x) if norm else x)
        prefix = [y[:, :1] for y in intermediates]
        intermediates = [y[:, 1:] for y in intermediates]
        if output_fmt == "NCHW":
            gh, gw = H // self.patch_size[0], W // self.patch_size[1]
            intermediates = [y.reshape(B, gh, gw, -1).permute(0, 3, 1, 2).contiguous() for y in intermediates]
        if return_prefix_tokens:
            intermediates = list(zip(intermediates, prefix))
        if intermediates_only:
            return intermediates
        return (self.ln_post(x) if self._token_norm else x), intermediates

    def prune_intermediate_layers(
        self, indices: int | list[int] = 1, prune_norm: bool = False, prune_head: bool = True
    ) -> list[int]:
        """timm's ``prune_intermediate_layers``: drop the blocks after the last of ``indices``; ``prune_norm``
        drops ``ln_post``; ``prune_head`` drops the poolers and the projection (pooling off). Returns the
        kept indices."""
        take_indices, max_index = feature_take_indices(len(self.transformer.resblocks), indices)
        self.transformer.resblocks = self.transformer.resblocks[: max_index + 1]
        self.transformer.layers = len(self.transformer.resblocks)
        self.feature_info = self.feature_info[: max_index + 1]
        if prune_head:
            if self.attn_pool is not None:
                self.attn_pool = self.attn_pool_contrastive = None
                self.attn_pool_type = ""
                self.ln_post = nn.Identity()  # it normalised the pooler's output
            self.final_ln_after_pool = False
            self._token_norm = True
            self.head_hidden_size = self.width
            self.reset_classifier(0, "")
        if prune_norm:
            self.ln_post = nn.Identity()
        return take_indices

    def _global_pool(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.pool_type == "avg":
            return x[:, 1:].mean(dim=1), x[:, 1:]
        if self.pool_type == "tok":
            return x[:, 0], x[:, 1:]
        return x, x

    def _pool(self, x: Tensor) -> tuple[Tensor, Tensor]:
        if self.attn_pool is not None:
            if self.attn_pool_contrastive is not None:
                x = self.ln_post(x)
                tokens = self.attn_pool(x)
                pooled = self.attn_pool_contrastive(x if self.attn_pool_type == "parallel" else tokens)
                return pooled, tokens
            x = self.ln_post(self.attn_pool(x))
            return self._global_pool(x)
        if self.final_ln_after_pool:
            pooled, tokens = self._global_pool(x)
            return self.ln_post(pooled), tokens
        return self._global_pool(x)  # forward_features applied ln_post

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor | tuple[Tensor, Tensor]:
        """Pool the tokens of :meth:`forward_features` and project them (``pre_logits``: not projected);
        ``(pooled, tokens)`` with ``output_tokens``."""
        pooled, tokens = self._pool(x)
        if not pre_logits and self.proj is not None:
            pooled = pooled @ self.proj
        return (pooled, tokens) if self.output_tokens else pooled

    def forward(self, x: Tensor) -> Tensor | tuple[Tensor, Tensor]:
        return self.forward_head(self.forward_features(x))


# ------------------------------------------------------------------------------------- configs, builders

def vision_state_dict(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The image-tower entries of a full CLIP state_dict (``visual.*`` prefix stripped, ``module.`` removed).

    A state_dict that already is an image tower (has ``conv1.weight``) is returned as is.
    """
    sd = {k[7:] if k.startswith("module.") else k: v for k, v in state_dict.items()}
    if "conv1.weight" in sd:
        return dict(sd)
    vis = {k[len("visual.") :]: v for k, v in sd.items() if k.startswith("visual.")}
    if not vis:
        raise ValueError(
            "state_dict has neither 'visual.*' keys (a CLIP checkpoint) nor 'conv1.weight' (an image "
            f"tower); first keys: {list(sd)[:5]}"
        )
    return vis


def load_clip_state_dict(path: str | os.PathLike, *, arg: str = "pretrained") -> dict[str, Tensor]:
    """Read a CLIP checkpoint file into a flat float state_dict (all towers), without executing anything.

    Accepts ``.safetensors``, plain ``torch.save`` state dicts (read with ``weights_only=True``; a nested
    ``"state_dict"`` entry and a ``module.`` prefix are unwrapped) and OpenAI's TorchScript archives (their
    tensors are read by :func:`elsa_vision.files.read_torchscript_state_dict`; the archive's code is never
    run; the non-tensor entries ``input_resolution``, ``context_length`` and ``vocab_size`` are dropped).
    Every file is read by :func:`elsa_vision.files.read_weights`; ``arg`` (the caller's name for the file)
    starts its errors.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not a checkpoint of weights (or a TorchScript archive that is refused).
    """
    from ..files import read_weights

    sd = read_weights(path, arg=arg, torchscript=True)
    for key in ("input_resolution", "context_length", "vocab_size"):  # OpenAI's archives keep them as tensors
        sd.pop(key, None)
    return sd


def _infer_config(vis: Mapping[str, Tensor]) -> dict[str, Any]:
    """Architecture of an image tower from its weights (OpenAI layout: head width 64)."""
    try:
        width, _, ph, pw = vis["conv1.weight"].shape
        n_pos = vis["positional_embedding"].shape[0]
        proj = vis["proj"]
    except KeyError as e:
        raise ValueError(
            f"image-tower state_dict lacks {e.args[0]!r}; not an open_clip/OpenAI ViT tower"
        ) from e
    layers = len({k.split(".")[2] for k in vis if k.startswith("transformer.resblocks.")})
    gh = math.isqrt(n_pos - 1)
    if gh * gh != n_pos - 1:
        raise ValueError(f"positional_embedding has {n_pos} rows, not 1 + a square grid; pass a config name")
    cfg = dict(
        image_size=gh * ph,
        patch_size=ph,
        width=width,
        layers=layers,
        heads=width // 64,
        output_dim=proj.shape[1],
        mlp_ratio=vis["transformer.resblocks.0.mlp.c_fc.weight"].shape[0] / width,
        no_ln_pre="ln_pre.weight" not in vis,
    )
    if "transformer.resblocks.0.ls_1.gamma" in vis:
        cfg["ls_init_value"] = 1e-5
    if "attn_pool.query" in vis:
        cfg["attentional_pool"] = "parallel" if "attn_pool_contrastive.query" in vis else True
        cfg["attn_pooler_queries"] = vis["attn_pool.query"].shape[0]
    return cfg


def _load_tower(model: ElsaCLIPVision, vis: Mapping[str, Tensor], source: str) -> None:
    vis = _adapt_tower(vis, model)
    _check_tower(model, vis, source)
    model.load_state_dict(vis, strict=True)


def _check_tower(
    model: ElsaCLIPVision, vis: Mapping[str, Tensor], source: str, resampled: bool = False
) -> None:
    """Every tensor of ``model`` (which may live on the meta device) in ``vis`` with the same shape, and no
    other; ``resampled``: a positional embedding of another grid is accepted (resampled when loading)."""
    missing, unexpected = [], []
    own = model.state_dict()
    for k in own:
        if k not in vis:
            missing.append(k)
        elif vis[k].shape != own[k].shape:
            if resampled and k == "positional_embedding" and vis[k].shape[1:] == own[k].shape[1:]:
                continue
            raise ValueError(
                f"checkpoint {source}: {k!r} has shape {list(vis[k].shape)}, the model expects "
                f"{list(own[k].shape)}"
            )
    unexpected = [k for k in vis if k not in own]
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {source} does not match the image tower: missing {missing[:6]}"
            f"{'...' if len(missing) > 6 else ''}, unexpected {unexpected[:6]}"
            f"{'...' if len(unexpected) > 6 else ''}"
        )


def create_elsa_clip_vision(
    name: str, pretrained: str | os.PathLike | None = None, **kwargs
) -> ElsaCLIPVision:
    """``timm.create_model(name, **kwargs)`` of a registered tower (:data:`CLIP_VISION_ARCHITECTURES`),
    optionally loading a local file.

    ``pretrained``: a CLIP checkpoint (full model or image tower, open_clip or OpenAI format); a positional
    embedding for another grid is resampled. ``kwargs`` override the architecture (e.g. ``image_size=448``,
    ``act_layer="quick_gelu"`` for OpenAI weights, ``attn_backend``).
    """
    import timm

    if name not in CLIP_VISION_ARCHITECTURES:
        raise ValueError(
            f"create_elsa_clip_vision: unknown name {name!r}; expected one of "
            f"{sorted(CLIP_VISION_ARCHITECTURES)}"
        )
    model = timm.create_model(name, **kwargs)
    if pretrained is not None:
        _load_tower(model, vision_state_dict(load_clip_state_dict(pretrained)), repr(os.fspath(pretrained)))
    return model


def _config_from_visual(visual: nn.Module) -> dict[str, Any]:
    """ElsaCLIPVision arguments reproducing an open_clip ``VisionTransformer`` instance."""
    from open_clip.transformer import LayerNormFp32, VisionTransformer
    from open_clip.transformer import QuickGELU as OcQuickGELU

    if not isinstance(visual, VisionTransformer):
        raise TypeError(
            f"from_open_clip: the image tower must be open_clip's VisionTransformer, got "
            f"{type(visual).__name__} (timm / ResNet towers are not converted)"
        )
    blocks = visual.transformer.resblocks
    blk = blocks[0]
    if not isinstance(
        blk.attn, (nn.MultiheadAttention, ElsaMultiheadAttention)
    ):  # stock or elsa_clip-patched
        raise ValueError(
            "from_open_clip: custom attention blocks (qk_norm / scaled_cosine_attn / scale_heads / "
            "scale_attn / scale_fc) are not supported; expected default ResidualAttentionBlocks"
        )
    if visual.proj is None:
        raise ValueError("from_open_clip: the tower's `proj` was pruned (None); expected a projection matrix")
    act = blk.mlp.gelu
    if isinstance(act, OcQuickGELU):
        act_layer = "quick_gelu"
    elif isinstance(act, nn.GELU) and act.approximate == "none":
        act_layer = "gelu"
    else:
        raise ValueError(
            f"from_open_clip: unsupported activation {type(act).__name__}; expected GELU or QuickGELU"
        )
    width = visual.conv1.out_channels
    ls = blk.ls_1
    cfg = dict(
        image_size=visual.image_size,
        patch_size=visual.patch_size,
        width=width,
        layers=len(blocks),
        heads=blk.attn.num_heads,
        mlp_ratio=blk.mlp.c_fc.out_features / width,
        ls_init_value=float(ls.gamma.detach().flatten()[0]) if hasattr(ls, "gamma") else None,
        output_dim=visual.proj.shape[1],
        no_ln_pre=isinstance(visual.ln_pre, nn.Identity),
        patch_dropout=getattr(visual.patch_dropout, "prob", 0.0),
        pos_embed_type="learnable" if visual.positional_embedding.requires_grad else "sin_cos_2d",
        pool_type=visual.pool_type,
        final_ln_after_pool=visual.final_ln_after_pool,
        act_layer=act_layer,
        norm_eps=blk.ln_1.eps,
        norm_fp32=isinstance(blk.ln_1, LayerNormFp32),
        output_tokens=visual.output_tokens,
    )
    if visual.attn_pool is not None:
        cfg.update(
            attentional_pool=visual.attn_pool_type or True,
            attn_pooler_queries=visual.attn_pool.query.shape[0],
            attn_pooler_heads=visual.attn_pool.attn.num_heads,
        )
        if not visual.attn_pool_type:
            cfg["pool_type"] = visual.pool_type
    return cfg


def _config_from_name(name: str) -> dict[str, Any]:
    """ElsaCLIPVision arguments for an open_clip config name (``open_clip.list_models()``)."""
    import open_clip

    mc = open_clip.get_model_config(name)
    if mc is None:
        raise ValueError(f"from_open_clip: unknown open_clip config {name!r}; see open_clip.list_models()")
    vc = dict(mc["vision_cfg"])
    if vc.get("timm_model_name") or isinstance(vc.get("layers"), (list, tuple)):
        raise ValueError(f"from_open_clip: {name!r} has a timm/ResNet image tower; only ViT towers convert")
    custom = [
        k
        for k in (
            "qk_norm",
            "scaled_cosine_attn",
            "scale_heads",
            "scale_attn_inner",
            "scale_attn",
            "scale_fc",
        )
        if vc.get(k)
    ]
    if custom or vc.get("block_type") == "custom":
        raise ValueError(f"from_open_clip: {name!r} uses custom attention blocks ({custom}); not supported")
    if vc.get("act_kwargs"):
        raise ValueError(f"from_open_clip: {name!r} sets act_kwargs {vc['act_kwargs']}; not supported")
    width = vc.get("width", 768)
    norm_kwargs = vc.get("norm_kwargs") or {}
    return dict(
        image_size=vc.get("image_size", 224),
        patch_size=vc.get("patch_size", 16),
        width=width,
        layers=vc.get("layers", 12),
        heads=width // vc.get("head_width", 64),
        mlp_ratio=vc.get("mlp_ratio", 4.0),
        ls_init_value=vc.get("ls_init_value"),
        attentional_pool=vc.get("attentional_pool", False),
        attn_pooler_queries=vc.get("attn_pooler_queries", 256),
        attn_pooler_heads=vc.get("attn_pooler_heads", 8),
        output_dim=mc["embed_dim"],
        patch_dropout=vc.get("patch_dropout", 0.0),
        no_ln_pre=vc.get("no_ln_pre", False),
        pos_embed_type=vc.get("pos_embed_type", "learnable"),
        pool_type=vc.get("pool_type", "tok"),
        final_ln_after_pool=vc.get("final_ln_after_pool", False),
        act_layer="quick_gelu" if mc.get("quick_gelu", False) else "gelu",
        norm_eps=norm_kwargs.get("eps", 1e-5),
        output_tokens=vc.get("output_tokens", False),
    )


def from_open_clip(
    model_or_name: nn.Module | str | os.PathLike,
    pretrained: str | os.PathLike | None = None,
    *,
    image_size=None,
    attn_backend: str = "auto",
    attn_precision: str = "auto",
    **kwargs,
) -> ElsaCLIPVision:
    """An :class:`ElsaCLIPVision` equal to an open_clip image tower.

    Args:
        model_or_name: one of
            * an open_clip ``CLIP`` / ``CustomTextCLIP`` / ``CoCa`` (its ``.visual``) or a
              ``VisionTransformer``: configuration and weights are copied as float32 on the tower's device
              (the source is untouched);
            * an open_clip config name (``"ViT-B-16"``, ``"coca_ViT-B-32"``, ``"ViT-L-14-336-quickgelu"``):
              the tower is built from the config, with weights from ``pretrained``;
            * the path of an OpenAI-format checkpoint (``visual.*`` keys; TorchScript or state_dict): the
              architecture is read from the weights, QuickGELU unless ``act_layer`` says otherwise.
        pretrained: a local checkpoint file for a config name (open_clip or OpenAI format, ``.pt``, ``.bin``,
            ``.safetensors``). Nothing is downloaded: tags such as ``"openai"`` are rejected.
        image_size: default input size; the positional embedding is resampled to it (bicubic).
        attn_backend, attn_precision: ELSA settings.
        kwargs: ElsaCLIPVision overrides (e.g. ``output_tokens``).
    """
    if isinstance(model_or_name, nn.Module):
        if pretrained is not None:
            raise ValueError(
                "from_open_clip: `pretrained` applies to a config name; got a model instance (load "
                "its weights first)"
            )
        visual = getattr(model_or_name, "visual", model_or_name)
        cfg = {**_config_from_visual(visual), **kwargs}
        model = ElsaCLIPVision(**cfg, attn_backend=attn_backend, attn_precision=attn_precision)
        model.load_state_dict(
            {
                k: v.detach().clone().float() if v.is_floating_point() else v
                for k, v in visual.state_dict().items()
            },
            strict=True,
        )
        model.to(visual.conv1.weight.device)
    elif isinstance(model_or_name, (str, os.PathLike)):
        name = os.fspath(model_or_name)
        if os.path.isfile(name):
            if pretrained is not None:
                raise ValueError(
                    f"from_open_clip: got a checkpoint path {name!r} and pretrained={pretrained!r}; "
                    "pass a config name with pretrained=<file>, or the OpenAI checkpoint alone"
                )
            vis = vision_state_dict(load_clip_state_dict(name, arg="model_or_name"))
            cfg = {**_infer_config(vis), "act_layer": "quick_gelu", **kwargs}
            # the architecture read from the file is built on the meta device first: a file cannot ask for
            # a tower larger than the tensors it holds (a wide conv1 and one c_fc row: a 50 GB tower)
            with torch.device("meta"):
                shapes = ElsaCLIPVision(**cfg, attn_backend=attn_backend, attn_precision=attn_precision)
            _check_tower(shapes, vis, repr(name), resampled=True)
            model = ElsaCLIPVision(**cfg, attn_backend=attn_backend, attn_precision=attn_precision)
            _load_tower(model, vis, repr(name))
        else:
            cfg = {**_config_from_name(name), **kwargs}
            model = ElsaCLIPVision(**cfg, attn_backend=attn_backend, attn_precision=attn_precision)
            if pretrained is not None:
                path = os.fspath(pretrained)
                if not os.path.isfile(path):
                    raise ValueError(
                        f"from_open_clip: pretrained must be a local checkpoint file, got {path!r} "
                        "(weights are never downloaded)"
                    )
                _load_tower(model, vision_state_dict(load_clip_state_dict(path)), repr(path))
    else:
        raise TypeError(
            f"from_open_clip: model_or_name must be an open_clip model, a config name or a checkpoint "
            f"path, got {type(model_or_name).__name__}"
        )
    if image_size is not None:
        model.set_image_size(image_size)
    return model


# ------------------------------------------------------------------------------------------------ registry

# The image towers of the released CLIP ViTs (open_clip configs ViT-B-16, ViT-L-14, ViT-L-14-336).
_model_cfgs: dict[str, dict[str, Any]] = {
    "elsa_clip_b16": dict(image_size=224, patch_size=16, width=768, layers=12, heads=12, output_dim=512),
    "elsa_clip_l14": dict(image_size=224, patch_size=14, width=1024, layers=24, heads=16, output_dim=768),
    "elsa_clip_l14_336": dict(image_size=336, patch_size=14, width=1024, layers=24, heads=16, output_dim=768),
}
# Read-only view of the registered towers' architectures: name -> ElsaCLIPVision arguments.
CLIP_VISION_ARCHITECTURES = MappingProxyType({k: MappingProxyType(v) for k, v in _model_cfgs.items()})


def clip_checkpoint_filter_fn(state_dict: Mapping[str, Tensor], model: ElsaCLIPVision) -> dict[str, Tensor]:
    """The image tower of a CLIP state_dict (:func:`vision_state_dict`) fitted to ``model``
    (:func:`_adapt_tower`: float32, positional embedding resampled, ``conv1`` adapted to ``in_chans``, the
    projection kept only when the model's head is the checkpoint's), timm's filter-function convention:
    ``timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path))``."""
    return _adapt_tower(vision_state_dict(state_dict), model)


def _adapt_tower(vis: Mapping[str, Tensor], model: ElsaCLIPVision) -> dict[str, Tensor]:
    """An image tower's state_dict fitted to ``model``, as float32: the positional embedding resampled to the
    model's grid when the checkpoint's is another square grid; an RGB ``conv1`` adapted to the model's
    ``in_chans`` (timm's ``adapt_input_conv``); and where the model's head is not the CLIP embedding
    (``num_classes`` other than ``output_dim``, as timm re-initialises a head of another width) the
    checkpoint's ``proj`` left out: the model keeps its own new projection, or none with ``num_classes=0``."""
    vis = dict(vis)
    if model.num_classes != model.output_dim and "proj" in vis:
        del vis["proj"]
        if model.proj is not None:
            vis["proj"] = model.proj.detach().clone()
    conv = vis.get("conv1.weight")
    if conv is not None and conv.dim() == 4 and conv.shape[1] != model.in_chans:
        vis["conv1.weight"] = adapt_input_conv(model.in_chans, conv)
    pos = vis.get("positional_embedding")
    if (
        pos is not None
        and pos.shape != model.positional_embedding.shape
        and pos.shape[1:] == model.positional_embedding.shape[1:]
    ):
        gh = math.isqrt(pos.shape[0] - 1)
        if gh * gh == pos.shape[0] - 1:
            vis["positional_embedding"] = resample_positional_embedding(pos, (gh, gh), model.grid_size)
    return {k: v.float() if v.is_floating_point() else v for k, v in vis.items()}


def _cfg(open_clip_name: str, patch: int, **kwargs):
    return {
        # The head is the projection `proj`, a parameter of open_clip's layout and not a module, so no
        # `classifier` module is named; num_classes None leaves its width to the architecture (output_dim,
        # the CLIP embedding), and clip_checkpoint_filter_fn handles a head of another width.
        "url": "", "num_classes": None, "classifier": None,
        # any multiple of the patch runs (the positional embedding is resampled); the smallest size timm's
        # tests and tools should pick is 8 x 8 patches, not an arbitrary side that is no multiple of the patch
        "input_size": (3, 224, 224), "min_input_size": (3, 8 * patch, 8 * patch), "fixed_input_size": False,
        "pool_size": None, "crop_pct": 1.0, "interpolation": "bicubic", "mean": OPENAI_CLIP_MEAN,
        "std": OPENAI_CLIP_STD, "first_conv": "conv1", "license": "mit",
        "description": f"the image tower of open_clip's {open_clip_name}",
        **kwargs,
    }


# Weights are local files: create_elsa_clip_vision(name, pretrained=path), or timm's
# timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path)).
default_cfgs = generate_default_cfgs({
    "elsa_clip_b16": _cfg("ViT-B-16", 16),
    "elsa_clip_l14": _cfg("ViT-L-14", 14),
    "elsa_clip_l14_336": _cfg("ViT-L-14-336", 14, input_size=(3, 336, 336)),
})


def _create_elsa_clip_vision(variant: str, pretrained: bool = False, **kwargs) -> ElsaCLIPVision:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        ElsaCLIPVision, variant, pretrained, pretrained_filter_fn=clip_checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **{**_model_cfgs[variant], **kwargs},
    )


@register_model
def elsa_clip_b16(pretrained: bool = False, **kwargs) -> ElsaCLIPVision:
    return _create_elsa_clip_vision("elsa_clip_b16", pretrained, **kwargs)


@register_model
def elsa_clip_l14(pretrained: bool = False, **kwargs) -> ElsaCLIPVision:
    return _create_elsa_clip_vision("elsa_clip_l14", pretrained, **kwargs)


@register_model
def elsa_clip_l14_336(pretrained: bool = False, **kwargs) -> ElsaCLIPVision:
    return _create_elsa_clip_vision("elsa_clip_l14_336", pretrained, **kwargs)
