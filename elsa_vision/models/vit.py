"""ElsaViT: timm's ``VisionTransformer`` with ELSA attention.

The ViT of "An Image is Worth 16x16 Words" (https://arxiv.org/abs/2010.11929) as timm implements it, with
every ``Attention`` built as :class:`elsa_vision.layers.ElsaAttention`. The state_dict is exactly timm's, so
timm checkpoints (and timm's ``checkpoint_filter_fn`` for OpenAI-CLIP / DINOv2 layouts) load unchanged.
"""

from __future__ import annotations

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models.vision_transformer import VisionTransformer, checkpoint_filter_fn

from ..layers.attention import ElsaAttention

__all__ = ["ElsaViT"]


class ElsaViT(VisionTransformer):
    """A timm ``VisionTransformer`` whose attention layers are ``ElsaAttention``.

    Args:
        attn_backend: ``elsa_attention`` backend for every block (``"auto"``, ``"torch"``, ``"triton"``).
        attn_precision: float32 precision (``"auto"``, ``"ieee"``, ``"tf32x3"``, ``"tf32"``).
        **kwargs: ``timm.models.vision_transformer.VisionTransformer`` arguments.
    """

    def __init__(self, *args, attn_backend: str = "auto", attn_precision: str = "auto", **kwargs):
        kwargs.setdefault("attn_layer", ElsaAttention)
        super().__init__(*args, **kwargs)
        self.set_attention(backend=attn_backend, precision=attn_precision)

    def set_attention(self, backend: str | None = None, precision: str | None = None) -> None:
        """Choose the ELSA backend/precision of every attention layer (validated by ``ElsaAttention``)."""
        for m in self.modules():
            if isinstance(m, ElsaAttention):
                if backend is not None:
                    m.backend = backend
                if precision is not None:
                    m.precision = precision


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
    args = dict(patch_size=14, embed_dim=1024, depth=24, num_heads=16, pre_norm=True, norm_layer="layernorm")
    return _create_elsa_vit("elsa_vit_large_patch14_clip_224", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_vit_base_patch14_reg4_dinov2(pretrained: bool = False, **kwargs) -> ElsaViT:
    args = dict(patch_size=14, embed_dim=768, depth=12, num_heads=12, init_values=1e-5, reg_tokens=4,
                no_embed_class=True)
    return _create_elsa_vit("elsa_vit_base_patch14_reg4_dinov2", pretrained=pretrained, **dict(args, **kwargs))
