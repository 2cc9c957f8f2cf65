"""ElsaHSIViT: a spectral-spatial ViT for hyperspectral patches, on ELSA attention.

After HSIMAE ("HSIMAE: A Unified Masked Autoencoder with Large-scale Pre-training for Hyperspectral Image
Classification", https://arxiv.org/abs/2404.08390): a hyperspectral patch ``(bands, P, P)`` is cut into
spectral-spatial tokens by a ``Conv3d`` over ``[band_group, s, s]`` blocks, giving ``G = ceil(bands /
band_group)`` spectral groups times ``S = (P / s)^2`` spatial positions. Two parallel branches of timm
``Block``s then attend

* spatially: within each spectral group across positions, tokens reshaped to ``(B*G, S, D)``;
* spectrally: within each position across groups, tokens reshaped to ``(B*S, G, D)``;

their outputs are concatenated and projected back to ``D``, and fusion blocks attend over all ``G*S`` tokens
``(B, G*S, D)``. Every attention layer is :class:`elsa_vision.layers.ElsaAttention` (``attn_layer``, timm's
injection point: timm's SDPA ``Attention`` has the same parameter names, so the same network on SDPA is one
argument away).

Token masking (MAE pretraining) is a key mask: masked tokens never act as keys in any branch, so visible
tokens see exactly what they would if the masked ones were dropped; rows with no visible key are 0.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from timm.layers import trunc_normal_
from timm.models import build_model_with_cfg, generate_default_cfgs, register_model, register_notrace_function
from timm.models._features import feature_take_indices
from timm.models.vision_transformer import Block
from torch import Tensor, nn

from ..layers.attention import ElsaAttention
from ..layers.elsa_module import ElsaModel, check_attention_options, check_linear_options

__all__ = ["ElsaHSIViT", "HSIMAEDecoder", "HSI_PRESETS", "GLOBAL_POOLS"]

GLOBAL_POOLS = ("avg", "center", "")


class SpectralSpatialEmbed(nn.Module):
    """``Conv3d`` tokens ``(B, bands, P, P)`` -> ``(B, G, S, D)``; bands zero-padded to ``G * band_group``."""

    def __init__(self, in_chans: int, img_size: int, band_group: int, spatial_patch: int, embed_dim: int):
        super().__init__()
        self.in_chans = in_chans
        self.band_group = band_group
        self.num_groups = math.ceil(in_chans / band_group)
        self.pad_bands = self.num_groups * band_group - in_chans
        self.spatial_patch = spatial_patch
        self.grid = img_size // spatial_patch
        self.num_spatial = self.grid * self.grid
        self.proj = nn.Conv3d(
            1,
            embed_dim,
            kernel_size=(band_group, spatial_patch, spatial_patch),
            stride=(band_group, spatial_patch, spatial_patch),
        )

    def forward(self, x: Tensor) -> Tensor:
        if self.pad_bands:
            x = F.pad(x, (0, 0, 0, 0, 0, self.pad_bands))
        x = self.proj(x.unsqueeze(1))  # (B, D, G, h, w)
        return x.flatten(3).permute(0, 2, 3, 1)  # (B, G, S, D)

    def patchify(self, x: Tensor) -> Tensor:
        """Pixels under each token: ``(B, bands, P, P)`` -> ``(B, G*S, band_group*s*s)`` (MAE targets)."""
        if self.pad_bands:
            x = F.pad(x, (0, 0, 0, 0, 0, self.pad_bands))
        B = x.shape[0]
        g, s, n = self.band_group, self.spatial_patch, self.grid
        x = x.reshape(B, self.num_groups, g, n, s, n, s).permute(0, 1, 3, 5, 2, 4, 6)
        return x.reshape(B, self.num_groups * self.num_spatial, g * s * s)


@register_notrace_function  # an FX leaf, called on the real input (FX skips names with a leading "_")
def check_hsi_patch(x: Tensor, in_chans: int, img_size: int) -> Tensor:
    """``x``, which must be a ``(B, in_chans, img_size, img_size)`` batch of hyperspectral patches (returned,
    so that the check is a node the traced graph depends on)."""
    if x.dim() != 4 or x.shape[1] != in_chans:
        raise ValueError(f"ElsaHSIViT: input must be (B, {in_chans}, P, P), got {tuple(x.shape)}")
    if x.shape[-2:] != (img_size, img_size):
        raise ValueError(
            f"ElsaHSIViT: input patch must be {img_size}x{img_size}, got {x.shape[-2]}x{x.shape[-1]}")
    return x


def _key_mask(visible: Tensor | None) -> Tensor | None:
    """``(B', N)`` bool, True = visible -> SDPA/ELSA bool ``attn_mask`` ``(B', 1, 1, N)``."""
    return None if visible is None else visible[:, None, None, :]


class ElsaHSIViT(ElsaModel, nn.Module):
    """Spectral-spatial ViT for hyperspectral patch classification.

    Args:
        in_chans: number of bands of the input patch (any count; padded to a multiple of ``band_group``).
        num_classes: classes of the head (0: no head, ``forward`` returns pooled features).
        img_size: patch side ``P`` (must be a multiple of ``spatial_patch``).
        band_group: bands per token (Conv3d kernel depth).
        spatial_patch: pixels per token side ``s``.
        embed_dim, num_heads, mlp_ratio, qkv_bias: transformer width.
        branch_depth: blocks in each of the spatial and the spectral branch.
        fusion_depth: blocks over all spectral-spatial tokens.
        global_pool: ``"avg"`` (mean over tokens), ``"center"`` (mean over the centre position's tokens) or
            ``""`` (no pooling: the head sees every token, as timm's ``global_pool=""``).
        drop_rate, drop_path_rate: head dropout and stochastic depth.
        attn_backend, attn_precision: ELSA backend / float32 precision of every attention layer.
        attn_layer: the attention class of every block (timm's ``Block(attn_layer=...)``), by default
            :class:`~elsa_vision.layers.ElsaAttention`; ``timm.layers.Attention`` (same parameter names)
            builds the same network on SDPA. Not part of ``config``: a network rebuilt from ``config`` is
            ELSA.
        attn_impl: deprecated, read from the ``config`` of checkpoints written before ``attn_layer``:
            ``"elsa"`` is the default, ``"sdpa"`` is ``attn_layer=timm.layers.Attention``.

    Shapes: ``forward(x)``: ``x (B, in_chans, P, P)`` -> logits ``(B, num_classes)``;
    ``forward_features(x) -> (B, G*S, D)`` tokens; ``forward_head(tokens, pre_logits=True) -> (B, D)``.
    The model API is timm's (``num_features`` = ``head_hidden_size`` = ``D``, ``get_classifier``,
    ``reset_classifier(num_classes, global_pool=None)``, ``forward_intermediates``); ``features_only`` is
    refused (a hyperspectral patch classifier has no spatial feature maps).
    """

    def __init__(
        self,
        in_chans: int,
        num_classes: int,
        img_size: int = 9,
        band_group: int = 8,
        spatial_patch: int = 3,
        embed_dim: int = 192,
        num_heads: int = 3,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        branch_depth: int = 2,
        fusion_depth: int = 2,
        global_pool: str = "avg",
        drop_rate: float = 0.0,
        drop_path_rate: float = 0.0,
        attn_backend: str = "auto",
        attn_precision: str = "auto",
        linear_backend: str = "auto",
        attn_layer: type[nn.Module] = ElsaAttention,
        attn_impl: str | None = None,
    ):
        super().__init__()
        if attn_impl is not None:
            attn_layer = _legacy_attn_layer(attn_impl, attn_layer)
        for name, val, lo in (
            ("in_chans", in_chans, 1),
            ("num_classes", num_classes, 0),
            ("img_size", img_size, 1),
            ("band_group", band_group, 1),
            ("spatial_patch", spatial_patch, 1),
            ("embed_dim", embed_dim, 1),
            ("num_heads", num_heads, 1),
            ("branch_depth", branch_depth, 0),
            ("fusion_depth", fusion_depth, 0),
        ):
            if isinstance(val, bool) or not isinstance(val, int) or val < lo:
                raise ValueError(f"ElsaHSIViT: {name} must be an int >= {lo}, got {val!r}")
        if img_size % spatial_patch:
            raise ValueError(
                f"ElsaHSIViT: img_size ({img_size}) must be a multiple of spatial_patch ({spatial_patch})"
            )
        if embed_dim % num_heads:
            raise ValueError(
                f"ElsaHSIViT: embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})"
            )
        _check_pool(global_pool)
        check_attention_options("ElsaHSIViT", attn_backend, attn_precision)
        check_linear_options("ElsaHSIViT", linear_backend)
        if branch_depth + fusion_depth == 0:
            raise ValueError("ElsaHSIViT: branch_depth + fusion_depth must be >= 1")
        self.config = dict(
            in_chans=in_chans,
            num_classes=num_classes,
            img_size=img_size,
            band_group=band_group,
            spatial_patch=spatial_patch,
            embed_dim=embed_dim,
            num_heads=num_heads,
            mlp_ratio=float(mlp_ratio),
            qkv_bias=qkv_bias,
            branch_depth=branch_depth,
            fusion_depth=fusion_depth,
            global_pool=global_pool,
            drop_rate=float(drop_rate),
            drop_path_rate=float(drop_path_rate),
            attn_backend=attn_backend,
            attn_precision=attn_precision,
            linear_backend=linear_backend,
        )
        self.num_classes = num_classes
        self.num_features = self.head_hidden_size = self.embed_dim = embed_dim
        self.global_pool = global_pool

        self.patch_embed = SpectralSpatialEmbed(in_chans, img_size, band_group, spatial_patch, embed_dim)
        G, S = self.patch_embed.num_groups, self.patch_embed.num_spatial
        self.num_groups, self.num_spatial = G, S
        self.spatial_pos = nn.Parameter(torch.zeros(1, 1, S, embed_dim))
        self.spectral_pos = nn.Parameter(torch.zeros(1, G, 1, embed_dim))

        n_blocks = branch_depth + fusion_depth
        dpr = [drop_path_rate * i / max(n_blocks - 1, 1) for i in range(n_blocks)]  # stochastic depth decay

        def block(i: int) -> Block:
            return Block(
                embed_dim,
                num_heads,
                mlp_ratio=mlp_ratio,
                qkv_bias=qkv_bias,
                drop_path=dpr[i],
                norm_layer=nn.LayerNorm,
                attn_layer=attn_layer,
            )

        self.spatial_blocks = nn.ModuleList([block(i) for i in range(branch_depth)])
        self.spectral_blocks = nn.ModuleList([block(i) for i in range(branch_depth)])
        self.fuse = nn.Linear(2 * embed_dim, embed_dim) if branch_depth else nn.Identity()
        self.fusion_blocks = nn.ModuleList([block(branch_depth + i) for i in range(fusion_depth)])
        self.norm = nn.LayerNorm(embed_dim)
        self.head_drop = nn.Dropout(drop_rate)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.set_attention(attn_backend, attn_precision)
        self._elsa_linears(linear_backend, attn_precision)
        self.init_weights()

    # -- init ----------------------------------------------------------------------------------------------
    def init_weights(self) -> None:
        trunc_normal_(self.spatial_pos, std=0.02)
        trunc_normal_(self.spectral_pos, std=0.02)
        self.apply(_init_weights)

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        return {"spatial_pos", "spectral_pos"}

    # -- forward -------------------------------------------------------------------------------------------
    def embed(self, x: Tensor) -> Tensor:
        """``(B, bands, P, P)`` -> tokens with position embeddings ``(B, G, S, D)``."""
        x = check_hsi_patch(x, self.patch_embed.in_chans, self.config["img_size"])
        return self.patch_embed(x) + self.spatial_pos + self.spectral_pos

    def forward_tokens(self, t: Tensor, visible: Tensor | None = None) -> Tensor:
        """Encode tokens ``(B, G, S, D)``; ``visible`` ``(B, G, S)`` bool marks unmasked tokens.

        Returns normalised tokens ``(B, G*S, D)``.
        """
        x = self._branches(t, visible)
        mf = _key_mask(None if visible is None else visible.reshape(x.shape[0], -1))
        for blk in self.fusion_blocks:
            x = blk(x, attn_mask=mf)
        return self.norm(x)

    def _branches(self, t: Tensor, visible: Tensor | None = None) -> Tensor:
        """The parallel spatial and spectral branches, fused: ``(B, G, S, D)`` -> ``(B, G*S, D)``."""
        B, G, S, D = t.shape
        if self.spatial_blocks:
            xs = t.reshape(B * G, S, D)
            ms = _key_mask(None if visible is None else visible.reshape(B * G, S))
            for blk in self.spatial_blocks:
                xs = blk(xs, attn_mask=ms)
            xe = t.transpose(1, 2).reshape(B * S, G, D)
            me = _key_mask(None if visible is None else visible.transpose(1, 2).reshape(B * S, G))
            for blk in self.spectral_blocks:
                xe = blk(xe, attn_mask=me)
            xe = xe.reshape(B, S, G, D).transpose(1, 2)
            t = self.fuse(torch.cat([xs.reshape(B, G, S, D), xe], dim=-1))
        return t.reshape(B, G * S, D)

    def forward_features(self, x: Tensor) -> Tensor:
        """``(B, bands, P, P)`` -> tokens ``(B, G*S, D)``."""
        return self.forward_tokens(self.embed(x))

    def forward_intermediates(
        self,
        x: Tensor,
        indices: int | list[int] | None = None,
        norm: bool = False,
        stop_early: bool = False,
        output_fmt: str = "NLC",
        intermediates_only: bool = False,
    ) -> list[Tensor] | tuple[Tensor, list[Tensor]]:
        """Tokens ``(B, G*S, D)`` after each stage: the fused branches (when ``branch_depth > 0``), then every
        fusion block. Arguments as timm's ViT: ``indices`` (None: all, int n: the last n, list: those),
        ``norm`` (the final norm on each), ``stop_early``, ``intermediates_only``; ``output_fmt`` is
        ``"NLC"`` only (the tokens have a spectral axis besides the spatial grid).

        Returns ``(forward_features(x), intermediates)``, or the intermediates alone.
        """
        if output_fmt != "NLC":
            raise ValueError(f"ElsaHSIViT.forward_intermediates: output_fmt must be 'NLC' (tokens "
                             f"(B, G*S, D)), got {output_fmt!r}")
        first = 1 if self.spatial_blocks else 0  # stage 0 is the fused branches when there are branches
        take, max_index = feature_take_indices(first + len(self.fusion_blocks), indices)
        x = self._branches(self.embed(x))
        intermediates = [x] if first and 0 in take else []
        last = max_index + 1 - first if stop_early else len(self.fusion_blocks)
        for i, blk in enumerate(self.fusion_blocks[:last]):
            x = blk(x)
            if first + i in take:
                intermediates.append(x)
        if norm:
            intermediates = [self.norm(t) for t in intermediates]
        if intermediates_only:
            return intermediates
        return self.norm(x), intermediates

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        if self.global_pool == "avg":
            x = x.mean(1)
        elif self.global_pool == "center":
            B = x.shape[0]
            x = x.reshape(B, self.num_groups, self.num_spatial, -1)[:, :, self.num_spatial // 2].mean(1)
        x = self.head_drop(x)
        return x if pre_logits else self.head(x)

    def forward(self, x: Tensor) -> Tensor:
        return self.forward_head(self.forward_features(x))

    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for ``num_classes`` (0: none, ``forward`` returns pooled features); ``global_pool``
        (one of ``GLOBAL_POOLS``) replaces the pooling unless None."""
        if global_pool is not None:
            _check_pool(global_pool)
            self.global_pool = self.config["global_pool"] = global_pool
        self.num_classes = num_classes
        self.config["num_classes"] = num_classes
        self.head = nn.Linear(self.embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        if num_classes > 0:
            _init_weights(self.head)
        self._elsa_linears(self.config["linear_backend"], self.config["attn_precision"])


def _legacy_attn_layer(attn_impl: str, attn_layer: type[nn.Module]) -> type[nn.Module]:
    warnings.warn("ElsaHSIViT: attn_impl is deprecated; the attention class is attn_layer (default "
                  "ElsaAttention, timm.layers.Attention for SDPA)", DeprecationWarning, stacklevel=3)
    if attn_impl not in ("elsa", "sdpa"):
        raise ValueError(f"ElsaHSIViT: attn_impl must be 'elsa' or 'sdpa', got {attn_impl!r}")
    if attn_impl == "elsa":
        return attn_layer
    from timm.layers import Attention

    return Attention


def _check_pool(global_pool: str) -> None:
    if global_pool not in GLOBAL_POOLS:
        raise ValueError(f"ElsaHSIViT: global_pool must be one of {GLOBAL_POOLS}, got {global_pool!r}")


def _init_weights(m: nn.Module) -> None:
    if isinstance(m, nn.Linear):
        trunc_normal_(m.weight, std=0.02)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Conv3d):
        w = m.weight.data
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.LayerNorm):
        nn.init.ones_(m.weight)
        nn.init.zeros_(m.bias)


class HSIMAEDecoder(ElsaModel, nn.Module):
    """MAE decoder: encoded tokens ``(B, T, D)`` and visible mask ``(B, T)`` -> pixels ``(B, T, out_dim)``.

    Masked positions are replaced by a learned mask token before position embeddings are added; ``depth``
    timm ``Block``s with ``ElsaAttention`` attend over all ``T`` tokens; its linear layers are ELSA linear
    layers, as the encoder's.
    """

    def __init__(
        self,
        embed_dim: int,
        num_tokens: int,
        out_dim: int,
        decoder_dim: int = 128,
        depth: int = 2,
        num_heads: int = 4,
        mlp_ratio: float = 4.0,
    ):
        super().__init__()
        if decoder_dim % num_heads:
            raise ValueError(
                f"HSIMAEDecoder: decoder_dim ({decoder_dim}) must be divisible by num_heads ({num_heads})"
            )
        self.decoder_embed = nn.Linear(embed_dim, decoder_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, decoder_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, num_tokens, decoder_dim))
        self.blocks = nn.ModuleList(
            [
                Block(
                    decoder_dim,
                    num_heads,
                    mlp_ratio=mlp_ratio,
                    qkv_bias=True,
                    norm_layer=nn.LayerNorm,
                    attn_layer=ElsaAttention,
                )
                for _ in range(depth)
            ]
        )
        self.norm = nn.LayerNorm(decoder_dim)
        self.pred = nn.Linear(decoder_dim, out_dim)
        self._elsa_linears()
        trunc_normal_(self.mask_token, std=0.02)
        trunc_normal_(self.pos_embed, std=0.02)
        self.apply(_init_weights)

    def forward(self, x: Tensor, visible: Tensor) -> Tensor:
        x = self.decoder_embed(x)
        x = torch.where(visible[..., None], x, self.mask_token.to(x.dtype))
        x = x + self.pos_embed
        for blk in self.blocks:
            x = blk(x)
        return self.pred(self.norm(x))


# Sizes: "base" has ViT-B's width and 12 blocks in all (3 + 3 parallel branch blocks, 6 fusion blocks).
HSI_PRESETS = {
    "tiny": dict(embed_dim=64, num_heads=4, branch_depth=1, fusion_depth=1),
    "small": dict(embed_dim=384, num_heads=6, branch_depth=3, fusion_depth=6),
    "base": dict(embed_dim=768, num_heads=12, branch_depth=3, fusion_depth=6),
}


def _cfg(**kwargs):
    return {
        "url": "",
        "num_classes": 0,
        "input_size": (32, 9, 9),
        "pool_size": None,
        "crop_pct": 1.0,
        "mean": None,
        "std": None,
        "first_conv": "patch_embed.proj",
        "classifier": "head",
        "license": "apache-2.0",
        **kwargs,
    }


default_cfgs = generate_default_cfgs(
    {
        "elsa_hsi_vit_tiny": _cfg(),
        "elsa_hsi_vit_small": _cfg(),
        "elsa_hsi_vit_base": _cfg(),
    }
)


def _create_elsa_hsi_vit(variant: str, pretrained: bool = False, **kwargs) -> ElsaHSIViT:
    if kwargs.get("features_only"):
        raise ValueError(
            f"{variant}: features_only=True is not supported: ElsaHSIViT classifies hyperspectral patches "
            f"and has no spatial feature maps; model.forward_intermediates(x) gives every stage's tokens")
    return build_model_with_cfg(ElsaHSIViT, variant, pretrained, feature_cfg=None, **kwargs)


@register_model
def elsa_hsi_vit_tiny(pretrained: bool = False, **kwargs) -> ElsaHSIViT:
    return _create_elsa_hsi_vit("elsa_hsi_vit_tiny", pretrained, **dict(HSI_PRESETS["tiny"], **kwargs))


@register_model
def elsa_hsi_vit_small(pretrained: bool = False, **kwargs) -> ElsaHSIViT:
    return _create_elsa_hsi_vit("elsa_hsi_vit_small", pretrained, **dict(HSI_PRESETS["small"], **kwargs))


@register_model
def elsa_hsi_vit_base(pretrained: bool = False, **kwargs) -> ElsaHSIViT:
    return _create_elsa_hsi_vit("elsa_hsi_vit_base", pretrained, **dict(HSI_PRESETS["base"], **kwargs))
