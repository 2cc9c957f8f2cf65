"""ElsaViT: timm's ``VisionTransformer`` with ELSA attention.

The ViT of "An Image is Worth 16x16 Words" (https://arxiv.org/abs/2010.11929) as timm implements it, with
every ``Attention`` built as :class:`elsa_vision.layers.ElsaAttention`. The state_dict is exactly timm's, so
timm checkpoints (and timm's ``checkpoint_filter_fn`` for OpenAI-CLIP / DINOv2 layouts) load unchanged.
"""

from __future__ import annotations

import inspect
from functools import partial

import torch
from timm.layers import Attention, AttentionPoolLatent, LayerNorm
from timm.models import (
    adapt_input_conv,
    build_model_with_cfg,
    generate_default_cfgs,
    register_model,
    register_model_deprecations,
)
from timm.models._manipulate import checkpoint_seq
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn
from torch import Tensor

from ..distributed import LAYOUTS, ContextParallel
from ..layers.attention import ElsaAttention
from ..layers.attention_pool import ElsaAttentionPoolLatent
from ..layers.elsa_module import ElsaModel, check_attention_options, check_linear_options
from ._builder import FromTimm

__all__ = ["ElsaViT", "elsa_checkpoint_filter_fn"]

# VisionTransformer arguments that ElsaViT fixes itself.
_OWN_KWARGS = ("attn_layer",)
# timm >= 1.0.23 injects the attention class (`attn_layer`); older versions build timm's Attention, which
# ElsaViT then converts block by block with the same weights.
_TIMM_HAS_ATTN_LAYER = "attn_layer" in inspect.signature(VisionTransformer.__init__).parameters


def elsa_checkpoint_filter_fn(state_dict: dict[str, Tensor], model: VisionTransformer) -> dict[str, Tensor]:
    """timm's ``checkpoint_filter_fn``, then ``adapt_input_conv`` of the patch embedding for ``in_chans``.

    Handles timm, OpenAI-CLIP (``visual.*``) and DINOv2 (``mask_token``) layouts and resamples ``pos_embed``
    to the model's grid; a 3-channel patch embedding is adapted to any ``in_chans`` (timm's rule: mean for 1
    channel, cycled and rescaled for more).
    """
    out = checkpoint_filter_fn(state_dict, model)
    key = "patch_embed.proj.weight"
    w = out.get(key)
    in_chans = model.patch_embed.proj.weight.shape[1]
    if w is not None and w.dim() == 4 and w.shape[1] != in_chans:
        out[key] = adapt_input_conv(in_chans, w)
    return out


class ElsaViT(ElsaModel, FromTimm, VisionTransformer):
    """A timm ``VisionTransformer`` whose attention layers are ``ElsaAttention``.

    Everything else is timm's own code: patch embedding (``in_chans``, ``dynamic_img_size`` /
    ``dynamic_img_pad`` with position-embedding interpolation for other and non-square sizes), class and
    register tokens, ``no_embed_class``, layer scale (``init_values``), ``qk_norm``, CLIP's ``pre_norm`` and
    QuickGELU (``act_layer="quick_gelu"``), ``global_pool`` in ``"token" | "avg" | "max" | "avgmax" | "map" |
    ""`` (the MAP head's latent attention runs through ELSA as well) and ``set_grad_checkpointing``.

    Args:
        attn_backend: ``elsa_attention`` backend for every block (``"auto"``, ``"torch"``, ``"triton"``).
        attn_precision: float32 precision of the attention and of every linear layer, one of
            ``kernels.precision.PRECISIONS`` (``"auto"``: FP32-accurate on tensor cores).
        linear_backend: ``elsa_linear`` backend of every linear layer and of the patch embedding
            (:class:`elsa_vision.layers.ElsaLinear`): ``"auto"`` (the split-precision GEMM for float32 on
            CUDA), ``"torch"`` (PyTorch's own GEMM), ``"triton"``.
        context_parallel_group: a ``torch.distributed`` process group over which every image's tokens are
            split (context parallelism, see :meth:`set_context_parallel`); ``None`` runs on one process.
        context_parallel_layout: ``"contiguous"`` or ``"zigzag"`` shards (see
            :func:`elsa_vision.distributed.shard_ranges`).
        **kwargs: ``timm.models.vision_transformer.VisionTransformer`` arguments.

    Shapes: ``forward(x: [B, in_chans, H, W]) -> [B, num_classes]`` (``[B, embed_dim]`` with
    ``num_classes=0``); ``forward_features -> [B, num_prefix_tokens + (H/p)(W/p), embed_dim]`` (with context
    parallelism: this rank's shard of those tokens, see :meth:`set_context_parallel`).

    ``ElsaViT.from_timm`` converts a timm ``VisionTransformer`` (an instance, or a name such as
    ``"vit_base_patch16_224"``); a local checkpoint given with a name goes through
    :func:`elsa_checkpoint_filter_fn`: timm's ``checkpoint_filter_fn`` (OpenAI-CLIP and DINOv2 layouts,
    position-embedding resampling), then the patch embedding adapted to ``in_chans``.
    """

    _timm_class = VisionTransformer
    _timm_filter_fn = staticmethod(elsa_checkpoint_filter_fn)

    context_parallel: ContextParallel | None = None

    def __init__(
        self,
        *args,
        attn_backend: str = "auto",
        attn_precision: str = "auto",
        linear_backend: str = "auto",
        context_parallel_group=None,
        context_parallel_layout: str = "contiguous",
        **kwargs,
    ):
        check_attention_options("ElsaViT", attn_backend, attn_precision)
        check_linear_options("ElsaViT", linear_backend)
        for k in _OWN_KWARGS:
            if k in kwargs and kwargs[k] is not ElsaAttention:
                raise ValueError(f"ElsaViT: `{k}` is fixed to ElsaAttention, got {kwargs[k]!r}")
        if kwargs.get("global_pool") == "prr":
            raise ValueError(
                "ElsaViT: global_pool='prr' is not supported; expected token, avg, max, avgmax, map or ''")
        kwargs.pop("attn_layer", None)
        if _TIMM_HAS_ATTN_LAYER:
            kwargs["attn_layer"] = ElsaAttention
        super().__init__(*args, **kwargs)
        self._elsa_convert(attn_backend, attn_precision)
        self._elsa_linears(linear_backend, attn_precision)
        self.set_context_parallel(context_parallel_group, layout=context_parallel_layout)

    # ------------------------------------------------------------------------------- context parallelism
    def set_context_parallel(self, group, layout: str = "contiguous") -> None:
        """Split every image's tokens over the ranks of ``group`` (``None``: back to one process).

        After the patch and position embedding (computed whole on every rank, cheap next to attention) the
        token sequence -- class/register tokens first, then the patches -- is sharded with ``layout``; the
        prefix tokens therefore belong to rank 0's shard, like any other token, and are not replicated.
        Norms and MLPs run on the local shard, every block's attention is
        :func:`elsa_vision.distributed.context_parallel_attention` over the group, and the pooling joins the
        shards: ``"token"`` and ``"avg"`` pooling through an all-reduce of per-rank partial results, the other
        pools (``max``, ``avgmax``, ``map``, ``""``) after an all-gather of the tokens. Every rank then
        returns the logits of the single-process model.

        ``forward_features`` returns this rank's shard ``[B, n_local, C]`` (global order given by
        ``self.context_parallel.global_index()``); :meth:`gather_tokens` reassembles ``[B, N, C]``.

        Gradients: every rank computes the same loss, so the gradient reaching a rank is ``world`` times the
        share of one loss for parameters used on the shard and once the full gradient for the replicated head;
        the parameter gradients averaged over the group (what DDP over the ranks does) equal single-process
        gradients. Every rank of the group must receive the same images. Dropout, drop-path and patch dropout
        draw from each rank's own generator: keep them off (or the ranks' seeds equal) for exact parity.
        """
        if layout not in LAYOUTS:
            raise ValueError(
                f"ElsaViT: unknown context_parallel_layout {layout!r}; expected one of {LAYOUTS}")
        cp = None if group is None else ContextParallel(group, layout)
        self.context_parallel = cp
        for i, blk in enumerate(self.blocks):
            attn = getattr(blk, "attn", None)
            if not isinstance(attn, ElsaAttention):
                raise TypeError(f"ElsaViT: blocks.{i}.attn is a {type(attn).__name__}, not ElsaAttention")
            attn.context_parallel = cp

    def gather_tokens(self, x_local: Tensor) -> Tensor:
        """``[B, N, C]`` from every rank's ``[B, n_local, C]`` of the last forward (differentiable)."""
        if self.context_parallel is None:
            return x_local
        return self.context_parallel.gather(x_local, dim=1)

    def forward_features(self, x: Tensor, attn_mask: Tensor | None = None, is_causal: bool = False) -> Tensor:
        cp = self.context_parallel
        if cp is None:
            return super().forward_features(x, attn_mask=attn_mask, is_causal=is_causal)
        x = self.patch_embed(x)
        x = self._pos_embed(x)
        x = self.patch_drop(x)
        cp.seq_len = x.shape[1]
        x = cp.shard(x, dim=1)
        x = self.norm_pre(x)
        if attn_mask is not None:
            if attn_mask.dim() != 4 or attn_mask.shape[-2] != cp.seq_len:
                raise ValueError(f"ElsaViT: with context parallelism attn_mask must be [B|1, H|1, N, N] with "
                                 f"N={cp.seq_len}, got {list(attn_mask.shape)}")
            attn_mask = cp.shard(attn_mask, dim=-2)
        if attn_mask is not None or is_causal:
            for blk in self.blocks:
                x = blk(x, attn_mask=attn_mask, is_causal=is_causal)
        elif self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.norm(x)

    def pool(self, x: Tensor, pool_type: str | None = None) -> Tensor:
        cp = self.context_parallel
        if cp is None:
            return super().pool(x, pool_type)
        pool_type = self.global_pool if pool_type is None else pool_type
        if self.attn_pool is None and pool_type in ("token", "avg"):
            # Each rank reduces the tokens it holds (token 0 lives in rank 0's shard in both layouts); the
            # partial results are summed over the group. Ranks holding none of the pooled tokens still take
            # part in the graph (an empty sum), so every rank runs the same collectives in backward.
            start = 0 if self.pool_include_prefix else self.num_prefix_tokens
            index = cp.global_index(device=x.device)
            keep = index == 0 if pool_type == "token" else index >= start
            total = cp.all_reduce(x[:, keep].sum(dim=1))
            return total if pool_type == "token" else total / (cp.seq_len - start)
        return super().pool(cp.gather(x, dim=1), pool_type)

    def forward_intermediates(self, *args, **kwargs):
        if self.context_parallel is not None:
            raise RuntimeError("ElsaViT.forward_intermediates is not available with context parallelism; "
                               "call set_context_parallel(None) first")
        return super().forward_intermediates(*args, **kwargs)

    def _elsa_convert(self, backend: str, precision: str) -> None:
        """Make every attention of the model ELSA (weights kept) and set backend/precision."""
        for i, blk in enumerate(self.blocks):
            attn = getattr(blk, "attn", None)
            if isinstance(attn, ElsaAttention):
                continue
            if type(attn) is not Attention:
                raise TypeError(
                    f"ElsaViT: blocks.{i}.attn is a {type(attn).__name__}; only timm Attention converts "
                    f"to ElsaAttention (use elsa_vision.patch_attention for other models)"
                )
            blk.attn = ElsaAttention.from_timm(attn, backend=backend, precision=precision)
        if isinstance(self.attn_pool, AttentionPoolLatent):
            ElsaAttentionPoolLatent.convert(self.attn_pool, backend=backend, precision=precision)
        elif self.attn_pool is not None:
            raise TypeError(f"ElsaViT: attn_pool {type(self.attn_pool).__name__} has no ELSA version")
        self.set_attention(backend=backend, precision=precision)


def _cfg(**kwargs):
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 224, 224), "pool_size": None,
        "crop_pct": 0.9, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5),
        "first_conv": "patch_embed.proj", "classifier": "head", "license": "apache-2.0", **kwargs,
    }


_IMAGENET_MEAN, _IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
_CLIP_MEAN, _CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)

# Weights are local files: timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path)).
default_cfgs = generate_default_cfgs({
    "elsa_vit_tiny_patch16_224": _cfg(),
    "elsa_vit_small_patch16_224": _cfg(),
    "elsa_vit_base_patch16_224": _cfg(),
    "elsa_vit_large_patch16_224": _cfg(),
    "elsa_vit_base_patch16_384": _cfg(input_size=(3, 384, 384), crop_pct=1.0),
    "elsa_vit_large_patch14_clip_224": _cfg(mean=_CLIP_MEAN, std=_CLIP_STD, crop_pct=1.0),
    "elsa_vit_base_patch14_reg4_dinov2": _cfg(
        input_size=(3, 518, 518), mean=_IMAGENET_MEAN, std=_IMAGENET_STD, num_classes=0, crop_pct=1.0),
})


def _create_elsa_vit(variant: str, pretrained: bool = False, **kwargs) -> ElsaViT:
    out_indices = kwargs.pop("out_indices", 3)
    return build_model_with_cfg(
        ElsaViT, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(out_indices=out_indices, feature_cls="getter"), **kwargs,
    )


@register_model
def elsa_vit_tiny_patch16_224(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=16, embed_dim=192, depth=12, num_heads=3)
    return _create_elsa_vit("elsa_vit_tiny_patch16_224", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_small_patch16_224(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    return _create_elsa_vit("elsa_vit_small_patch16_224", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_base_patch16_224(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_elsa_vit("elsa_vit_base_patch16_224", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_large_patch16_224(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16)
    return _create_elsa_vit("elsa_vit_large_patch16_224", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_base_patch16_384(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=16, embed_dim=768, depth=12, num_heads=12)
    return _create_elsa_vit("elsa_vit_base_patch16_384", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_large_patch14_clip_224(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=14, embed_dim=1024, depth=24, num_heads=16, pre_norm=True,
                norm_layer=partial(LayerNorm, eps=1e-5))
    return _create_elsa_vit("elsa_vit_large_patch14_clip_224", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_base_patch14_reg4_dinov2(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=14, embed_dim=768, depth=12, num_heads=12, init_values=1e-5, reg_tokens=4,
                no_embed_class=True)
    return _create_elsa_vit(
        "elsa_vit_base_patch14_reg4_dinov2", pretrained=pretrained, **dict(args, **kwargs))


# Short names (the high-resolution inference CLI's, the docs') of registered models: timm maps them to the
# registered name (with a deprecation warning), elsa_vision.inference.highres.MODEL_ALIASES lists them.
register_model_deprecations(__name__, {
    "elsa_vit_t_patch16": "elsa_vit_tiny_patch16_224",
    "elsa_vit_s_patch16": "elsa_vit_small_patch16_224",
    "elsa_vit_b_patch16": "elsa_vit_base_patch16_224",
    "elsa_vit_l_patch16": "elsa_vit_large_patch16_224",
    "elsa_vit_b_patch16_384": "elsa_vit_base_patch16_384",
    "elsa_vit_l_patch14_clip": "elsa_vit_large_patch14_clip_224",
    "elsa_vit_b_patch14_dinov2": "elsa_vit_base_patch14_reg4_dinov2",
})
