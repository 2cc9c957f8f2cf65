"""ElsaSwinV2: timm's ``SwinTransformerV2`` with ELSA window attention.

Swin Transformer V2 ("Scaling Up Capacity and Resolution", https://arxiv.org/abs/2111.09883) as timm
implements it: patch embedding, res-post-norm blocks with (shifted) windows, PatchMerging, classifier head are
timm's own modules. Only each block's ``WindowAttention`` changes class (same parameters and buffers), so the
state_dict is exactly timm's and timm checkpoints load unchanged through timm's ``checkpoint_filter_fn``.

Inside a window the attention is

    softmax(cos(q, k) * exp(min(logit_scale, log 100)) + 16 sigmoid(cpb_mlp(coords))[index] + shift_mask) @ v

computed by the W-ELSA op (:func:`elsa_vision.ops.window_attention.window_attention`, one Triton launch over
all windows, the bias and shift mask read by stride) when the backend resolves to ``"triton"`` (CUDA), and by
:func:`elsa_vision.elsa_attention` with the bias as ``attn_bias`` otherwise (CPU, float64, attention dropout).
"""

from __future__ import annotations

from timm.models import build_model_with_cfg, generate_default_cfgs, register_model
from timm.models import swin_transformer_v2 as _timm_swinv2
from timm.models.swin_transformer_v2 import SwinTransformerV2, checkpoint_filter_fn

from ..layers.elsa_module import ElsaModel, check_attention_options, check_linear_options
from ..layers.window_attention import ElsaSwinV2WindowAttention
from ._builder import FromTimm

__all__ = ["ElsaSwinV2", "ElsaSwinV2Attention"]

ElsaSwinV2Attention = ElsaSwinV2WindowAttention  # the name this module has always exported


class ElsaSwinV2(ElsaModel, FromTimm, SwinTransformerV2):
    """A timm ``SwinTransformerV2`` whose window attentions are :class:`ElsaSwinV2Attention`.

    Everything else is timm's: ``img_size`` / ``strict_img_size=False`` (any input size: feature maps padded
    to the window multiple, shift masks built per call, as timm), per-stage ``window_size``,
    ``pretrained_window_sizes`` (the ``relative_coords_table`` of a window fine-tuned from a smaller one is
    normalised by the pretraining window, so ``cpb_mlp`` weights transfer to any window), windows clipped to
    the stage resolution (shift 0 there), ``set_input_size``, ``forward_intermediates`` and
    ``features_only`` through ``timm.create_model``.

    Args:
        attn_backend: ``"auto"`` (W-ELSA Triton op on CUDA, torch otherwise), ``"torch"``, ``"triton"``.
        attn_precision: float32 precision, one of ``ops.attention.PRECISIONS`` (``"fp16x3"`` runs as
            ``"tf32x3"`` in the window kernel).
        **kwargs: ``timm.models.swin_transformer_v2.SwinTransformerV2`` arguments.

    Shapes: ``forward(x: [B, in_chans, H, W]) -> [B, num_classes]``; ``forward_features -> [B, H/32, W/32,
    num_features]`` (NHWC, timm's layout).

    ``ElsaSwinV2.from_timm`` converts a timm ``SwinTransformerV2`` (an instance, or a name such as
    ``"swinv2_tiny_window8_256"``); a local checkpoint given with a name goes through timm's swinv2
    ``checkpoint_filter_fn`` (original Microsoft layout, non-persistent buffers dropped, patch embedding
    resampled). A checkpoint of another window size loads as well: the ``cpb_mlp`` weights are window
    independent (pass ``pretrained_window_sizes`` as timm does).
    """

    _timm_class = SwinTransformerV2
    _timm_filter_fn = staticmethod(checkpoint_filter_fn)

    def __init__(self, *args, attn_backend: str = "auto", attn_precision: str = "auto",
                 linear_backend: str = "auto", **kwargs):
        check_attention_options("ElsaSwinV2", attn_backend, attn_precision)
        check_linear_options("ElsaSwinV2", linear_backend)
        super().__init__(*args, **kwargs)
        self._elsa_convert(attn_backend, attn_precision)
        self._elsa_linears(linear_backend, attn_precision)

    def _elsa_convert(self, backend: str, precision: str) -> None:
        n = 0
        for m in self.modules():
            if isinstance(m, _timm_swinv2.WindowAttention):
                ElsaSwinV2Attention.convert(m, backend=backend, precision=precision)
                n += 1
        if n == 0:
            raise TypeError("ElsaSwinV2: the model has no Swin v2 WindowAttention to convert")


def _cfg(**kwargs):
    return {
        "url": "", "num_classes": 1000, "input_size": (3, 256, 256), "pool_size": (8, 8),
        "crop_pct": 0.9, "interpolation": "bicubic", "fixed_input_size": True,
        "mean": (0.485, 0.456, 0.406), "std": (0.229, 0.224, 0.225),
        "first_conv": "patch_embed.proj", "classifier": "head.fc", "license": "mit", **kwargs,
    }


# Weights are local files: timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=path))
# (timm's checkpoint files for the same names without the ``elsa_`` prefix load unchanged).
default_cfgs = generate_default_cfgs({
    "elsa_swinv2_tiny_window8_256": _cfg(),
    "elsa_swinv2_tiny_window16_256": _cfg(),
    "elsa_swinv2_small_window8_256": _cfg(),
    "elsa_swinv2_small_window16_256": _cfg(),
    "elsa_swinv2_base_window8_256": _cfg(),
    "elsa_swinv2_base_window16_256": _cfg(),
    "elsa_swinv2_base_window12to24_192to384": _cfg(
        input_size=(3, 384, 384), pool_size=(12, 12), crop_pct=1.0),
})


def _create_elsa_swinv2(variant: str, pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    default_out_indices = tuple(range(len(kwargs.get("depths", (1, 1, 1, 1)))))
    out_indices = kwargs.pop("out_indices", default_out_indices)
    return build_model_with_cfg(
        ElsaSwinV2, variant, pretrained, pretrained_filter_fn=checkpoint_filter_fn,
        feature_cfg=dict(flatten_sequential=True, out_indices=out_indices), **kwargs,
    )


_TINY = dict(embed_dim=96, depths=(2, 2, 6, 2), num_heads=(3, 6, 12, 24))
_SMALL = dict(embed_dim=96, depths=(2, 2, 18, 2), num_heads=(3, 6, 12, 24))
_BASE = dict(embed_dim=128, depths=(2, 2, 18, 2), num_heads=(4, 8, 16, 32))


@register_model
def elsa_swinv2_tiny_window8_256(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=8, **_TINY)
    return _create_elsa_swinv2("elsa_swinv2_tiny_window8_256", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_swinv2_tiny_window16_256(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=16, **_TINY)
    return _create_elsa_swinv2("elsa_swinv2_tiny_window16_256", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_swinv2_small_window8_256(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=8, **_SMALL)
    return _create_elsa_swinv2("elsa_swinv2_small_window8_256", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_swinv2_small_window16_256(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=16, **_SMALL)
    return _create_elsa_swinv2(
        "elsa_swinv2_small_window16_256", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_swinv2_base_window8_256(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=8, **_BASE)
    return _create_elsa_swinv2("elsa_swinv2_base_window8_256", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_swinv2_base_window16_256(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=16, **_BASE)
    return _create_elsa_swinv2("elsa_swinv2_base_window16_256", pretrained=pretrained, **dict(args, **kwargs))


@register_model
def elsa_swinv2_base_window12to24_192to384(pretrained: bool = False, **kwargs) -> ElsaSwinV2:
    args = dict(window_size=24, pretrained_window_sizes=(12, 12, 12, 6), **_BASE)
    return _create_elsa_swinv2(
        "elsa_swinv2_base_window12to24_192to384", pretrained=pretrained, **dict(args, **kwargs))
