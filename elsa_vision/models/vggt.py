"""ElsaVGGT: the VGGT multi-frame encoder and its camera and depth heads, with ELSA attention.

VGGT: Visual Geometry Grounded Transformer, Wang et al., CVPR 2025 (https://arxiv.org/abs/2503.11651).
FastVGGT token merging: Shen et al. 2025 (https://arxiv.org/abs/2509.02560).

Input ``images [B, S, 3, H, W]`` in [0, 1] (normalised inside). The aggregator embeds every frame with a
DINOv2-style ViT (or a single conv), prepends a camera token and register tokens (index 0 of each learned
pair for the reference frame 0, index 1 for all others), then alternates *frame* attention over
``(B·S, P, C)`` and *global* attention over ``(B, S·P, C)`` -- the long-sequence case (100 frames of 1041
tokens = 104K tokens) that ELSA's exact scan serves. Every attention is
:class:`elsa_vision.layers.ElsaAttention` (exact softmax attention, no approximation) with q and k
LayerNorm-ed per head and, in the aggregator, 2D RoPE (frequency 100, the layer's ``rope`` option); residual
branches carry timm's ``LayerScale``.

Heads: the camera head refines a pose encoding ``[B, S, 9]`` (translation 3, quaternion xyzw 4, FoV h/w 2;
camera-from-world, principal point at the centre) over 4 iterations with an adaLN-modulated trunk; the
DPT depth head returns depth (``exp``) and confidence (``1 + exp``); the optional point head is the same DPT
head with ``inv_log`` activation for world points. Parameter names equal facebookresearch/vggt's
(``aggregator.*``, ``camera_head.*``, ``depth_head.*``, ``point_head.*``), so a VGGT state_dict loads with
``strict=True`` (:meth:`ElsaVGGT.from_vggt_checkpoint`; the tracking head's keys are dropped and reported).

The configurations (:data:`VGGT_CONFIGS`: ``"elsa_vggt"``, VGGT-1B, and ``"elsa_vggt_small"``) are built by
:meth:`ElsaVGGT.from_config` and loaded by :meth:`ElsaVGGT.from_vggt_checkpoint`. They are not registered in
timm's model registry: ElsaVGGT takes sequences ``[B, S, 3, H, W]`` and returns cameras and depth maps, not
the ``[B, num_classes]`` of an image model that timm's tools and tests (``features_only``, ``num_classes``,
``reset_classifier``) expect of every registered name.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from types import MappingProxyType

import torch
import torch.nn.functional as F
from timm.layers import LayerScale, Mlp
from torch import Tensor, nn

from ..layers.attention import ElsaAttention
from ..layers.elsa_module import ElsaModel, check_attention_options, check_linear_options
from ..layers.rope import RotaryPositionEmbedding2D

__all__ = [
    "ElsaVGGT",
    "Aggregator",
    "CameraHead",
    "DPTHead",
    "VGGT_CONFIGS",
    "find_vggt_config",
    "vggt_config_mismatch",
    "RotaryPositionEmbedding2D",
    "load_vggt_state_dict",
    "vggt_checkpoint_filter_fn",
]

_logger = logging.getLogger(__name__)

_RESNET_MEAN = (0.485, 0.456, 0.406)
_RESNET_STD = (0.229, 0.224, 0.225)


# --------------------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------------------


class PositionGetter(nn.Module):
    """Integer patch coordinates ``(row, col)`` of an ``h × w`` grid, row-major: ``[B, h·w, 2]`` (int64)."""

    def forward(self, batch: int, h: int, w: int, device: torch.device) -> Tensor:
        rows = torch.arange(h, device=device).repeat_interleave(w)
        cols = torch.arange(w, device=device).repeat(h)
        return torch.stack([rows, cols], dim=-1)[None].expand(batch, h * w, 2)


class TokenMerge:
    """FastVGGT-style token merging for one global block (approximate: not exact attention).

    Destination tokens: all tokens of frame 0, the camera/register tokens of every frame, and every
    ``stride``-th patch token of the other frames (``stride = round(1 / (1 − ratio))``). Every other token
    (source) is averaged into its most cosine-similar destination of the same sequence; attention runs on the
    destinations only and each source takes its destination's output (unmerge).

    Args:
        x: block input after ``norm1``, ``[B, S·P, C]``; pos: ``[B, S·P, 2]``.
    """

    def __init__(self, num_frames: int, tokens_per_frame: int, patch_start_idx: int, ratio: float) -> None:
        if not 0.0 < ratio < 1.0:
            raise ValueError(f"TokenMerge: `ratio` must be in (0, 1), got {ratio}")
        S, P = num_frames, tokens_per_frame
        stride = max(1, round(1.0 / (1.0 - ratio)))
        idx = torch.arange(S * P).reshape(S, P)
        keep = torch.zeros(S, P, dtype=torch.bool)
        keep[0] = True
        keep[:, :patch_start_idx] = True
        keep[1:, patch_start_idx::stride] = True
        self.dst = idx[keep]
        self.src = idx[~keep]

    def merge(self, x: Tensor, pos: Tensor | None, chunk: int = 4096) -> tuple[Tensor, Tensor | None, Tensor]:
        """Returns the merged destination tokens ``[B, Nd, C]``, their positions and the source->dst map."""
        dst_idx, src_idx = self.dst.to(x.device), self.src.to(x.device)
        xd, xs = x[:, dst_idx], x[:, src_idx]
        dn = F.normalize(xd.float(), dim=-1)
        assign = torch.cat(
            [
                torch.bmm(F.normalize(xs[:, i : i + chunk].float(), dim=-1), dn.transpose(1, 2)).argmax(-1)
                for i in range(0, xs.shape[1], chunk)
            ],
            dim=1,
        )  # [B, Ns] indices into the destinations
        summed = xd.scatter_add(1, assign[..., None].expand_as(xs), xs)
        count = torch.ones(xd.shape[:2], dtype=x.dtype, device=x.device).scatter_add(
            1, assign, torch.ones_like(assign, dtype=x.dtype)
        )
        merged = summed / count[..., None]
        return merged, (pos[:, dst_idx] if pos is not None else None), assign

    def unmerge(self, y_dst: Tensor, assign: Tensor, n: int) -> Tensor:
        B, _, C = y_dst.shape
        out = y_dst.new_empty(B, n, C)
        out[:, self.dst.to(y_dst.device)] = y_dst
        out[:, self.src.to(y_dst.device)] = torch.gather(
            y_dst, 1, assign[..., None].expand(B, assign.shape[1], C)
        )
        return out


class Block(nn.Module):
    """Pre-norm transformer block ``x + ls1(attn(norm1(x))); x + ls2(mlp(norm2(x)))`` (VGGT's / DINOv2's
    names): :class:`~elsa_vision.layers.ElsaAttention` with per-head q/k LayerNorm and the ``rope`` option,
    timm's ``LayerScale`` and ``Mlp``. ``forward(x, pos=None, merge=None)``: ``pos`` for RoPE, ``merge`` a
    :class:`TokenMerge` (global blocks).

    ``token_chunk`` (None: off): without autograd, the MLP half runs over ``token_chunk`` tokens at a time,
    so its ``[tokens, mlp_ratio * dim]`` hidden activation is never whole; every token's result is the same
    (the MLP is token-wise)."""

    token_chunk: int | None = None

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        init_values: float | None = None,
        qk_norm: bool = False,
        rope: RotaryPositionEmbedding2D | None = None,
        norm_eps: float = 1e-5,
        backend: str = "auto",
        precision: str = "auto",
    ) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps=norm_eps)
        self.attn = ElsaAttention(dim, num_heads, qkv_bias=qkv_bias, qk_norm=qk_norm, proj_bias=proj_bias,
                                  norm_layer=nn.LayerNorm, backend=backend, precision=precision, rope=rope)
        self.ls1 = LayerScale(dim, init_values) if init_values else nn.Identity()
        self.norm2 = nn.LayerNorm(dim, eps=norm_eps)
        self.mlp = Mlp(dim, int(dim * mlp_ratio), bias=ffn_bias)
        self.ls2 = LayerScale(dim, init_values) if init_values else nn.Identity()

    def forward(self, x: Tensor, pos: Tensor | None = None, merge: TokenMerge | None = None) -> Tensor:
        h = self.norm1(x)
        if merge is None:
            h = self.attn(h, pos=pos)
        else:
            hm, pm, assign = merge.merge(h, pos)
            h = merge.unmerge(self.attn(hm, pos=pm), assign, x.shape[1])
        x = x + self.ls1(h)
        chunk = self.token_chunk
        if chunk is None or torch.is_grad_enabled() or x.shape[1] <= chunk:
            return x + self.ls2(self.mlp(self.norm2(x)))
        out = torch.empty_like(x)
        for s in range(0, x.shape[1], chunk):
            xs = x[:, s : s + chunk]
            out[:, s : s + chunk] = xs + self.ls2(self.mlp(self.norm2(xs)))
        return out


class PatchEmbed(nn.Module):
    """Conv patch embedding ``[N, 3, H, W] -> [N, (H/p)(W/p), D]`` (key ``proj``)."""

    def __init__(self, patch_size: int, in_chans: int, embed_dim: int) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=patch_size, stride=patch_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.proj(x).flatten(2).transpose(1, 2)


class DinoVisionTransformer(nn.Module):
    """DINOv2 ViT with register tokens (the aggregator's ``patch_embed``), DINOv2 key names.

    ``forward(x [N, 3, H, W]) -> dict(x_norm_patchtokens [N, (H/p)(W/p), D], x_norm_clstoken,
    x_norm_regtokens)``.
    ``pos_embed`` is resampled bicubically (antialiased) when the patch grid differs from ``img_size/patch``.
    """

    def __init__(
        self,
        img_size: int,
        patch_size: int,
        embed_dim: int,
        depth: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        num_register_tokens: int = 4,
        init_values: float = 1.0,
        backend: str = "auto",
        precision: str = "auto",
    ) -> None:
        super().__init__()
        self.patch_size = patch_size
        self.num_register_tokens = num_register_tokens
        grid = img_size // patch_size
        self.patch_embed = PatchEmbed(patch_size, 3, embed_dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.zeros(1, grid * grid + 1, embed_dim))
        self.register_tokens = nn.Parameter(torch.zeros(1, num_register_tokens, embed_dim))
        self.blocks = nn.ModuleList(
            Block(
                embed_dim,
                num_heads,
                mlp_ratio,
                init_values=init_values,
                norm_eps=1e-6,
                backend=backend,
                precision=precision,
            )
            for _ in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.mask_token = nn.Parameter(torch.zeros(1, embed_dim))
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        nn.init.normal_(self.cls_token, std=1e-6)
        nn.init.normal_(self.register_tokens, std=1e-6)

    def interpolate_pos_encoding(self, h0: int, w0: int, dtype: torch.dtype) -> Tensor:
        pe = self.pos_embed.float()
        n = pe.shape[1] - 1
        if h0 * w0 == n and h0 == w0:
            return pe.to(dtype)
        m = int(math.isqrt(n))
        patch = pe[:, 1:].reshape(1, m, m, -1).permute(0, 3, 1, 2)
        patch = F.interpolate(patch, size=(h0, w0), mode="bicubic", antialias=True)
        patch = patch.permute(0, 2, 3, 1).reshape(1, h0 * w0, -1)
        return torch.cat([pe[:, :1], patch], dim=1).to(dtype)

    def forward(self, x: Tensor) -> dict[str, Tensor]:
        n, _, h, w = x.shape
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(n, -1, -1), x], dim=1)
        x = x + self.interpolate_pos_encoding(h // self.patch_size, w // self.patch_size, x.dtype)
        x = torch.cat([x[:, :1], self.register_tokens.expand(n, -1, -1), x[:, 1:]], dim=1)
        for blk in self.blocks:
            x = blk(x)
        x = self.norm(x)
        r = self.num_register_tokens
        return {
            "x_norm_clstoken": x[:, 0],
            "x_norm_regtokens": x[:, 1 : r + 1],
            "x_norm_patchtokens": x[:, r + 1 :],
        }


# --------------------------------------------------------------------------------------------------------
# Aggregator
# --------------------------------------------------------------------------------------------------------


def _slice_expand_and_flatten(token: Tensor, B: int, S: int) -> Tensor:
    """``token [1, 2, X, C]`` -> ``[B·S, X, C]``: index 0 for frame 0, index 1 for frames 1..S−1."""
    first = token[:, :1].expand(B, 1, *token.shape[2:])
    rest = token[:, 1:].expand(B, S - 1, *token.shape[2:])
    return torch.cat([first, rest], dim=1).reshape(B * S, *token.shape[2:])


class Aggregator(nn.Module):
    """Alternating frame/global attention over per-frame tokens.

    Args:
        img_size, patch_size: training resolution (square) and patch size; any ``H, W`` divisible by
            ``patch_size`` runs.
        embed_dim, depth, num_heads, mlp_ratio: transformer size; ``depth`` frame and ``depth`` global blocks.
        num_register_tokens: register tokens per frame.
        patch_embed: ``"dinov2"`` (DINOv2 ViT with registers; VGGT's ``dinov2_vitl14_reg``) or ``"conv"``.
        patch_embed_depth: blocks of the DINOv2 patch embed (24 for VGGT-1B).
        qk_norm, rope_freq, init_values: per-head q/k LayerNorm, RoPE base frequency (<= 0: off), LayerScale.
        keep_layers: indices of the intermediate outputs to return (others are ``None`` in the list, saving
            memory); ``None`` keeps all.
        merge_ratio: FastVGGT token merging in the global blocks (0 = off = exact attention).
        attn_backend, attn_precision: ``elsa_attention`` backend and float32 precision.

    ``forward(images [B, S, 3, H, W] in [0, 1]) -> (list of depth x [B, S, P, 2C] or None, patch_start_idx)``;
    entry ``i`` is ``cat(frame_block_i output, global_block_i output)``; ``P = 1 + R + (H/p)(W/p)``.

    ``frames_chunk`` (None: off): without autograd, the per-frame parts (the patch embedding and the frame
    blocks) run over ``frames_chunk`` frames of the ``B * S`` at a time, so that their activations are never
    those of every frame at once; the results are the same (each frame is computed alone either way).
    """

    frames_chunk: int | None = None

    def __init__(
        self,
        img_size: int = 518,
        patch_size: int = 14,
        embed_dim: int = 1024,
        depth: int = 24,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        num_register_tokens: int = 4,
        qkv_bias: bool = True,
        proj_bias: bool = True,
        ffn_bias: bool = True,
        patch_embed: str = "dinov2",
        patch_embed_depth: int = 24,
        qk_norm: bool = True,
        rope_freq: float = 100.0,
        init_values: float = 0.01,
        keep_layers: Sequence[int] | None = None,
        merge_ratio: float = 0.0,
        attn_backend: str = "auto",
        attn_precision: str = "auto",
    ) -> None:
        super().__init__()
        if patch_embed == "dinov2":
            self.patch_embed = DinoVisionTransformer(
                img_size,
                patch_size,
                embed_dim,
                patch_embed_depth,
                num_heads,
                mlp_ratio,
                num_register_tokens,
                init_values=1.0,
                backend=attn_backend,
                precision=attn_precision,
            )
            self.patch_embed.mask_token.requires_grad_(False)
        elif patch_embed == "conv":
            self.patch_embed = PatchEmbed(patch_size, 3, embed_dim)
        else:
            raise ValueError(f"Aggregator: `patch_embed` must be 'dinov2' or 'conv', got {patch_embed!r}")
        if not 0.0 <= merge_ratio < 1.0:
            raise ValueError(f"Aggregator: `merge_ratio` must be in [0, 1), got {merge_ratio}")
        self.rope = RotaryPositionEmbedding2D(frequency=rope_freq) if rope_freq > 0 else None
        self.position_getter = PositionGetter() if self.rope is not None else None
        kw = dict(
            mlp_ratio=mlp_ratio,
            qkv_bias=qkv_bias,
            proj_bias=proj_bias,
            ffn_bias=ffn_bias,
            init_values=init_values,
            qk_norm=qk_norm,
            rope=self.rope,
            backend=attn_backend,
            precision=attn_precision,
        )
        self.frame_blocks = nn.ModuleList(Block(embed_dim, num_heads, **kw) for _ in range(depth))
        self.global_blocks = nn.ModuleList(Block(embed_dim, num_heads, **kw) for _ in range(depth))
        self.depth = depth
        self.patch_size = patch_size
        self.camera_token = nn.Parameter(torch.zeros(1, 2, 1, embed_dim))
        self.register_token = nn.Parameter(torch.zeros(1, 2, num_register_tokens, embed_dim))
        self.patch_start_idx = 1 + num_register_tokens
        self.keep_layers = None if keep_layers is None else sorted({int(i) % depth for i in keep_layers})
        self.merge_ratio = float(merge_ratio)
        nn.init.normal_(self.camera_token, std=1e-6)
        nn.init.normal_(self.register_token, std=1e-6)
        self.register_buffer("_resnet_mean", torch.tensor(_RESNET_MEAN).view(1, 1, 3, 1, 1), persistent=False)
        self.register_buffer("_resnet_std", torch.tensor(_RESNET_STD).view(1, 1, 3, 1, 1), persistent=False)

    def forward(self, images: Tensor) -> tuple[list[Tensor | None], int]:
        if images.dim() != 5 or images.shape[2] != 3:
            raise ValueError(f"Aggregator: `images` must be [B, S, 3, H, W], got {list(images.shape)}")
        B, S, _, H, W = images.shape
        if H % self.patch_size or W % self.patch_size:
            raise ValueError(f"Aggregator: H, W ({H}, {W}) must be multiples of patch_size {self.patch_size}")
        x = ((images - self._resnet_mean.to(images.dtype)) / self._resnet_std.to(images.dtype)).reshape(
            B * S, 3, H, W
        )
        patch = self._per_frame(self._embed, x)
        tokens = torch.cat(
            [
                _slice_expand_and_flatten(self.camera_token, B, S),
                _slice_expand_and_flatten(self.register_token, B, S),
                patch,
            ],
            dim=1,
        )
        _, P, C = tokens.shape
        pos = None
        if self.rope is not None:
            pos = self.position_getter(B * S, H // self.patch_size, W // self.patch_size, images.device) + 1
            pos = torch.cat(
                [pos.new_zeros(B * S, self.patch_start_idx, 2), pos], dim=1
            )  # special tokens at 0
        merge = (
            TokenMerge(S, P, self.patch_start_idx, self.merge_ratio)
            if self.merge_ratio > 0 and S > 1
            else None
        )
        keep = set(range(self.depth)) if self.keep_layers is None else set(self.keep_layers)
        outputs: list[Tensor | None] = []
        for i in range(self.depth):
            tokens = self._per_frame(self.frame_blocks[i], tokens.reshape(B * S, P, C), pos)
            frame_out = tokens.reshape(B, S, P, C)
            gpos = pos.reshape(B, S * P, 2) if pos is not None else None
            tokens = self.global_blocks[i](tokens.reshape(B, S * P, C), gpos, merge)
            outputs.append(torch.cat([frame_out, tokens.reshape(B, S, P, C)], dim=-1) if i in keep else None)
        return outputs, self.patch_start_idx

    def _embed(self, x: Tensor) -> Tensor:
        patch = self.patch_embed(x)
        return patch["x_norm_patchtokens"] if isinstance(patch, dict) else patch

    def _per_frame(self, fn, x: Tensor, pos: Tensor | None = None) -> Tensor:
        """``fn(x[, pos])`` of frames ``x [frames, ...]`` (``pos [frames, P, 2]``), ``frames_chunk`` frames
        at a time without autograd."""
        chunk = self.frames_chunk
        call = (lambda a, p: fn(a)) if pos is None else fn
        if chunk is None or torch.is_grad_enabled() or x.shape[0] <= chunk:
            return call(x, pos)
        out = None
        for s in range(0, x.shape[0], chunk):
            y = call(x[s : s + chunk], None if pos is None else pos[s : s + chunk])
            if out is None:
                out = y.new_empty((x.shape[0], *y.shape[1:]))
            out[s : s + y.shape[0]] = y
        return out


# --------------------------------------------------------------------------------------------------------
# Heads
# --------------------------------------------------------------------------------------------------------


def activate_pose(
    pose: Tensor, trans_act: str = "linear", quat_act: str = "linear", fl_act: str = "relu"
) -> Tensor:
    """Activations of the pose encoding parts: translation, quaternion, FoV."""

    def act(x: Tensor, kind: str) -> Tensor:
        if kind == "linear":
            return x
        if kind == "relu":
            return F.relu(x)
        if kind == "exp":
            return torch.exp(x)
        raise ValueError(f"unknown pose activation {kind!r}")

    return torch.cat(
        [act(pose[..., :3], trans_act), act(pose[..., 3:7], quat_act), act(pose[..., 7:], fl_act)], -1
    )


class CameraHead(nn.Module):
    """Iterative camera refinement from the camera token of the last aggregator layer.

    Each iteration embeds the current (detached) pose encoding, modulates the normalised camera tokens
    adaLN-style (shift, scale, gate), runs a transformer trunk over the ``S`` frames of a sequence and adds a
    predicted delta. ``forward(tokens_list, num_iterations=4) -> list of [B, S, 9]`` (one per iteration).
    """

    def __init__(
        self,
        dim_in: int = 2048,
        trunk_depth: int = 4,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        init_values: float = 0.01,
        trans_act: str = "linear",
        quat_act: str = "linear",
        fl_act: str = "relu",
        attn_backend: str = "auto",
        attn_precision: str = "auto",
    ) -> None:
        super().__init__()
        self.target_dim = 9
        self.acts = dict(trans_act=trans_act, quat_act=quat_act, fl_act=fl_act)
        self.trunk = nn.Sequential(
            *[
                Block(
                    dim_in,
                    num_heads,
                    mlp_ratio,
                    init_values=init_values,
                    backend=attn_backend,
                    precision=attn_precision,
                )
                for _ in range(trunk_depth)
            ]
        )
        self.token_norm = nn.LayerNorm(dim_in)
        self.trunk_norm = nn.LayerNorm(dim_in)
        self.empty_pose_tokens = nn.Parameter(torch.zeros(1, 1, self.target_dim))
        self.embed_pose = nn.Linear(self.target_dim, dim_in)
        self.poseLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(dim_in, 3 * dim_in, bias=True))
        self.adaln_norm = nn.LayerNorm(dim_in, elementwise_affine=False, eps=1e-6)
        self.pose_branch = Mlp(dim_in, dim_in // 2, self.target_dim)

    def forward(self, tokens_list: list[Tensor | None], num_iterations: int = 4) -> list[Tensor]:
        tokens = self.token_norm(tokens_list[-1][:, :, 0])  # [B, S, C]
        B, S, _ = tokens.shape
        pred = None
        out = []
        for _ in range(num_iterations):
            cond = self.embed_pose(self.empty_pose_tokens.expand(B, S, -1) if pred is None else pred.detach())
            shift, scale, gate = self.poseLN_modulation(cond).chunk(3, dim=-1)
            h = gate * (self.adaln_norm(tokens) * (1 + scale) + shift) + tokens
            delta = self.pose_branch(self.trunk_norm(self.trunk(h)))
            pred = delta if pred is None else pred + delta
            out.append(activate_pose(pred, **self.acts))
        return out


def _uv_grid(width: int, height: int, aspect_ratio: float, dtype, device) -> Tensor:
    """Normalised pixel-centre coordinates ``[H, W, 2]`` in the unit-diagonal box of the aspect ratio."""
    diag = math.sqrt(aspect_ratio**2 + 1.0)
    sx, sy = aspect_ratio / diag, 1.0 / diag
    xs = torch.linspace(
        -sx * (width - 1) / width, sx * (width - 1) / width, width, dtype=dtype, device=device
    )
    ys = torch.linspace(
        -sy * (height - 1) / height, sy * (height - 1) / height, height, dtype=dtype, device=device
    )
    yy, xx = torch.meshgrid(ys, xs, indexing="ij")
    return torch.stack([xx, yy], dim=-1)


def _sincos(dim: int, pos: Tensor, omega_0: float = 100.0) -> Tensor:
    omega = 1.0 / omega_0 ** (torch.arange(dim // 2, dtype=torch.float64, device=pos.device) / (dim / 2.0))
    ang = pos.reshape(-1).double()[:, None] * omega[None]
    return torch.cat([ang.sin(), ang.cos()], dim=1).float()


def _grid_pos_embed(grid: Tensor, dim: int) -> Tensor:
    h, w, _ = grid.shape
    flat = grid.reshape(-1, 2)
    return torch.cat([_sincos(dim // 2, flat[:, 0]), _sincos(dim // 2, flat[:, 1])], dim=-1).reshape(
        h, w, dim
    )


class ResidualConvUnit(nn.Module):
    def __init__(self, features: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(features, features, 3, padding=1, bias=True)
        self.conv2 = nn.Conv2d(features, features, 3, padding=1, bias=True)

    def forward(self, x: Tensor) -> Tensor:
        return self.conv2(F.relu(self.conv1(F.relu(x)))) + x


class FeatureFusionBlock(nn.Module):
    def __init__(self, features: int, has_residual: bool = True) -> None:
        super().__init__()
        self.out_conv = nn.Conv2d(features, features, 1, bias=True)
        self.has_residual = has_residual
        if has_residual:
            self.resConfUnit1 = ResidualConvUnit(features)
        self.resConfUnit2 = ResidualConvUnit(features)

    def forward(self, x: Tensor, skip: Tensor | None = None, size: Sequence[int] | None = None) -> Tensor:
        if self.has_residual and skip is not None:
            x = x + self.resConfUnit1(skip)
        x = self.resConfUnit2(x)
        if size is None:
            x = F.interpolate(x, scale_factor=2, mode="bilinear", align_corners=True)
        else:
            x = F.interpolate(x, size=tuple(size), mode="bilinear", align_corners=True)
        return self.out_conv(x)


class DPTHead(nn.Module):
    """DPT dense head (https://arxiv.org/abs/2103.13413) over four aggregator layers.

    ``forward(tokens_list, images [B, S, 3, H, W], patch_start_idx) -> (pred [B, S, H, W, output_dim−1],
    conf [B, S, H, W])``; ``activation``: ``"exp"`` (depth), ``"inv_log"`` (points), ``"linear"``;
    confidence ``1 + exp`` (``"expp1"``). Frames are processed in chunks of ``frames_chunk_size``.
    """

    def __init__(
        self,
        dim_in: int,
        patch_size: int = 14,
        output_dim: int = 2,
        activation: str = "exp",
        conf_activation: str = "expp1",
        features: int = 256,
        out_channels: Sequence[int] = (256, 512, 1024, 1024),
        intermediate_layer_idx: Sequence[int] = (4, 11, 17, 23),
        pos_embed: bool = True,
        frames_chunk_size: int = 8,
    ) -> None:
        super().__init__()
        if len(out_channels) != 4 or len(intermediate_layer_idx) != 4:
            raise ValueError("DPTHead: `out_channels` and `intermediate_layer_idx` must have 4 entries each")
        self.patch_size = patch_size
        self.activation = activation
        self.conf_activation = conf_activation
        self.pos_embed = pos_embed
        self.intermediate_layer_idx = list(intermediate_layer_idx)
        self.frames_chunk_size = frames_chunk_size
        oc = list(out_channels)
        self.norm = nn.LayerNorm(dim_in)
        self.projects = nn.ModuleList(nn.Conv2d(dim_in, c, 1) for c in oc)
        self.resize_layers = nn.ModuleList(
            [
                nn.ConvTranspose2d(oc[0], oc[0], kernel_size=4, stride=4),
                nn.ConvTranspose2d(oc[1], oc[1], kernel_size=2, stride=2),
                nn.Identity(),
                nn.Conv2d(oc[3], oc[3], kernel_size=3, stride=2, padding=1),
            ]
        )
        self.scratch = nn.Module()
        for i, c in enumerate(oc, start=1):
            setattr(self.scratch, f"layer{i}_rn", nn.Conv2d(c, features, 3, padding=1, bias=False))
        self.scratch.refinenet1 = FeatureFusionBlock(features)
        self.scratch.refinenet2 = FeatureFusionBlock(features)
        self.scratch.refinenet3 = FeatureFusionBlock(features)
        self.scratch.refinenet4 = FeatureFusionBlock(features, has_residual=False)
        self.scratch.output_conv1 = nn.Conv2d(features, features // 2, 3, padding=1)
        self.scratch.output_conv2 = nn.Sequential(
            nn.Conv2d(features // 2, 32, 3, padding=1), nn.ReLU(inplace=True), nn.Conv2d(32, output_dim, 1)
        )

    def _add_pos(self, x: Tensor, W: int, H: int, ratio: float = 0.1) -> Tensor:
        grid = _uv_grid(x.shape[-1], x.shape[-2], W / H, torch.float32, x.device)
        pe = _grid_pos_embed(grid, x.shape[1]).to(x.dtype) * ratio
        return x + pe.permute(2, 0, 1)[None]

    def _activate(self, out: Tensor) -> tuple[Tensor, Tensor]:
        fmap = out.permute(0, 2, 3, 1)
        x, c = fmap[..., :-1], fmap[..., -1]
        if self.activation == "exp":
            x = torch.exp(x)
        elif self.activation == "inv_log":
            x = torch.sign(x) * torch.expm1(x.abs())
        elif self.activation != "linear":
            raise ValueError(f"DPTHead: unknown activation {self.activation!r}")
        if self.conf_activation == "expp1":
            c = 1 + c.exp()
        elif self.conf_activation != "linear":
            raise ValueError(f"DPTHead: unknown conf_activation {self.conf_activation!r}")
        return x, c

    def _forward_frames(
        self, tokens_list, images: Tensor, psi: int, s0: int, s1: int
    ) -> tuple[Tensor, Tensor]:
        B, _, _, H, W = images.shape
        S = s1 - s0
        ph, pw = H // self.patch_size, W // self.patch_size
        feats = []
        for j, li in enumerate(self.intermediate_layer_idx):
            t = tokens_list[li]
            if t is None:
                raise ValueError(f"DPTHead: aggregator layer {li} was not kept (Aggregator.keep_layers)")
            x = self.norm(t[:, s0:s1, psi:].reshape(B * S, ph * pw, t.shape[-1]))
            x = x.permute(0, 2, 1).reshape(B * S, -1, ph, pw)
            x = self.projects[j](x)
            if self.pos_embed:
                x = self._add_pos(x, W, H)
            feats.append(self.resize_layers[j](x))
        sc = self.scratch
        l1, l2, l3, l4 = (
            sc.layer1_rn(feats[0]),
            sc.layer2_rn(feats[1]),
            sc.layer3_rn(feats[2]),
            sc.layer4_rn(feats[3]),
        )
        out = sc.refinenet4(l4, size=l3.shape[2:])
        out = sc.refinenet3(out, l3, size=l2.shape[2:])
        out = sc.refinenet2(out, l2, size=l1.shape[2:])
        out = sc.refinenet1(out, l1)
        out = sc.output_conv1(out)
        out = F.interpolate(
            out, size=(ph * self.patch_size, pw * self.patch_size), mode="bilinear", align_corners=True
        )
        if self.pos_embed:
            out = self._add_pos(out, W, H)
        pred, conf = self._activate(sc.output_conv2(out))
        return pred.reshape(B, S, *pred.shape[1:]), conf.reshape(B, S, *conf.shape[1:])

    def forward(
        self, tokens_list: list[Tensor | None], images: Tensor, patch_start_idx: int
    ) -> tuple[Tensor, Tensor]:
        S = images.shape[1]
        step = S if not self.frames_chunk_size or self.frames_chunk_size >= S else self.frames_chunk_size
        parts = [
            self._forward_frames(tokens_list, images, patch_start_idx, s, min(s + step, S))
            for s in range(0, S, step)
        ]
        if len(parts) == 1:
            return parts[0]
        return torch.cat([p[0] for p in parts], 1), torch.cat([p[1] for p in parts], 1)


# --------------------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------------------


class ElsaVGGT(ElsaModel, nn.Module):
    """VGGT with ELSA attention: aggregator + camera head + DPT depth head (+ optional DPT point head).

    Args:
        img_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, num_register_tokens, patch_embed,
            patch_embed_depth, qk_norm, rope_freq, init_values, merge_ratio: see :class:`Aggregator`.
        camera_trunk_depth, camera_num_heads: camera head trunk.
        dpt_features, dpt_out_channels, intermediate_layer_idx: DPT heads.
        enable_point: also build ``point_head`` (VGGT's world-point DPT head).
        attn_backend, attn_precision: ``elsa_attention`` backend of every attention / float32 precision of
            the attention and linear layers.
        linear_backend: ``elsa_linear`` backend of every linear layer, the patch embedding and the heads'
            1x1 convolutions (``"auto"``: FP32-accurate split GEMMs for float32 on CUDA; ``"torch"``:
            PyTorch's own).

    ``forward(images [B, S, 3, H, W] or [S, 3, H, W], in [0, 1])`` returns a dict: ``pose_enc [B, S, 9]``,
    ``pose_enc_list`` (per refinement iteration), ``depth [B, S, H, W, 1]``, ``depth_conf [B, S, H, W]``
    (+ ``world_points [B, S, H, W, 3]``, ``world_points_conf`` with the point head).
    """

    def __init__(
        self,
        img_size: int = 518,
        patch_size: int = 14,
        embed_dim: int = 1024,
        depth: int = 24,
        num_heads: int = 16,
        mlp_ratio: float = 4.0,
        num_register_tokens: int = 4,
        patch_embed: str = "dinov2",
        patch_embed_depth: int = 24,
        qk_norm: bool = True,
        rope_freq: float = 100.0,
        init_values: float = 0.01,
        camera_trunk_depth: int = 4,
        camera_num_heads: int = 16,
        dpt_features: int = 256,
        dpt_out_channels: Sequence[int] = (256, 512, 1024, 1024),
        intermediate_layer_idx: Sequence[int] = (4, 11, 17, 23),
        enable_point: bool = False,
        merge_ratio: float = 0.0,
        attn_backend: str = "auto",
        attn_precision: str = "auto",
        linear_backend: str = "auto",
    ) -> None:
        super().__init__()
        check_attention_options("ElsaVGGT", attn_backend, attn_precision)
        check_linear_options("ElsaVGGT", linear_backend)
        for i in intermediate_layer_idx:
            if not 0 <= int(i) < depth:
                raise ValueError(
                    f"ElsaVGGT: intermediate_layer_idx {list(intermediate_layer_idx)} must be in "
                    f"[0, depth={depth})"
                )
        self.config = dict(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            num_register_tokens=num_register_tokens,
            patch_embed=patch_embed,
            patch_embed_depth=patch_embed_depth,
            qk_norm=qk_norm,
            rope_freq=rope_freq,
            init_values=init_values,
            camera_trunk_depth=camera_trunk_depth,
            camera_num_heads=camera_num_heads,
            dpt_features=dpt_features,
            dpt_out_channels=list(dpt_out_channels),
            intermediate_layer_idx=list(intermediate_layer_idx),
            enable_point=enable_point,
            merge_ratio=merge_ratio,
        )
        self.img_size = img_size
        self.patch_size = patch_size
        self.aggregator = Aggregator(
            img_size=img_size,
            patch_size=patch_size,
            embed_dim=embed_dim,
            depth=depth,
            num_heads=num_heads,
            mlp_ratio=mlp_ratio,
            num_register_tokens=num_register_tokens,
            patch_embed=patch_embed,
            patch_embed_depth=patch_embed_depth,
            qk_norm=qk_norm,
            rope_freq=rope_freq,
            init_values=init_values,
            keep_layers=list(intermediate_layer_idx) + [depth - 1],
            merge_ratio=merge_ratio,
            attn_backend=attn_backend,
            attn_precision=attn_precision,
        )
        self.camera_head = CameraHead(
            dim_in=2 * embed_dim,
            trunk_depth=camera_trunk_depth,
            num_heads=camera_num_heads,
            mlp_ratio=mlp_ratio,
            init_values=init_values,
            attn_backend=attn_backend,
            attn_precision=attn_precision,
        )
        dpt = dict(
            dim_in=2 * embed_dim,
            patch_size=patch_size,
            features=dpt_features,
            out_channels=dpt_out_channels,
            intermediate_layer_idx=intermediate_layer_idx,
        )
        self.point_head = DPTHead(output_dim=4, activation="inv_log", **dpt) if enable_point else None
        self.depth_head = DPTHead(output_dim=2, activation="exp", **dpt)
        self._elsa_linears(linear_backend, attn_precision)

    def set_chunks(self, frames: int | None = None, tokens: int | None = None) -> None:
        """Bound what inference (no autograd) holds at once, with the same results: the aggregator's patch
        embedding and frame blocks run over ``frames`` frames at a time (``Aggregator.frames_chunk``), every
        block's MLP over ``tokens`` tokens at a time (``Block.token_chunk``); None: all at once. The depth and
        point heads always run ``DPTHead.frames_chunk_size`` frames at a time."""
        for name, value in (("frames", frames), ("tokens", tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"ElsaVGGT.set_chunks: `{name}` must be None or an int >= 1, got {value!r}")
        self.aggregator.frames_chunk = frames
        for m in self.modules():
            if isinstance(m, Block):
                m.token_chunk = tokens

    def forward(self, images: Tensor, num_iterations: int = 4) -> dict[str, Tensor | list[Tensor]]:
        if images.dim() == 4:
            images = images[None]
        tokens, psi = self.aggregator(images)
        pose_list = self.camera_head(tokens, num_iterations=num_iterations)
        out: dict[str, Tensor | list[Tensor]] = {"pose_enc": pose_list[-1], "pose_enc_list": pose_list}
        out["depth"], out["depth_conf"] = self.depth_head(tokens, images, psi)
        if self.point_head is not None:
            out["world_points"], out["world_points_conf"] = self.point_head(tokens, images, psi)
        return out

    @classmethod
    def from_config(cls, name: str, **overrides) -> ElsaVGGT:
        """The model of a named configuration (``"elsa_vggt"``, ``"elsa_vggt_small"``: :data:`VGGT_CONFIGS`)
        with ``overrides`` of its arguments (``enable_point=True``, ``merge_ratio=0.9``, ``attn_backend``,
        ``img_size`` ...); random weights (:meth:`from_vggt_checkpoint` loads a file)."""
        if name not in VGGT_CONFIGS:
            raise ValueError(f"unknown ElsaVGGT config {name!r}; expected one of {sorted(VGGT_CONFIGS)}")
        return cls(**{**VGGT_CONFIGS[name], **overrides})

    @classmethod
    def from_vggt_checkpoint(cls, path: str | Path, config: str | None = None, **overrides) -> ElsaVGGT:
        """Load a facebookresearch/vggt checkpoint (``model.safetensors`` or ``model.pt``) or an ElsaVGGT
        state_dict with strict keys.

        ``config``: a :data:`VGGT_CONFIGS` name; None reads it from the weights (:func:`find_vggt_config`;
        VGGT-1B's release is ``"elsa_vggt"``). The point head is built when the checkpoint has
        ``point_head.*`` keys. VGGT's tracking head (``track_head.*``) has no counterpart here: its keys are
        dropped and listed in the log and in ``model.dropped_checkpoint_keys``.
        """
        sd = load_vggt_state_dict(path)
        overrides.setdefault("enable_point", any(k.startswith("point_head.") for k in sd))
        if config is None:
            config = find_vggt_config(sd, str(path), **overrides)
        model = cls.from_config(config, **overrides)
        model.load_state_dict(_filter_fn(sd, model), strict=True)
        return model


def load_vggt_state_dict(path: str | Path, *, arg: str = "checkpoint") -> dict[str, Tensor]:
    """Read a state_dict from ``.safetensors`` or a torch file with :func:`elsa_vision.files.read_weights`
    (``weights_only=True``; ``model`` / ``state_dict`` and a ``module.`` prefix unwrapped); of a
    ``MultiViewReconstructionModule`` checkpoint, the network (``submodule="net"``).

    ``arg``: the caller's name for the file (``"--weights"``); errors start with it and name the file.

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not a checkpoint of weights; an ``UnsafeCheckpointError`` (a Lightning
            ``.ckpt`` of an older run, with Python objects pickled in) says how to export the network.
    """
    from ..files import UnsafeCheckpointError, read_weights

    try:
        return read_weights(path, arg=arg, submodule="net")
    except UnsafeCheckpointError as exc:
        raise UnsafeCheckpointError(
            f"{exc} (as a Lightning .ckpt of an older multiview run does: its hyper-parameters hold the "
            "optimizer factory); if you trust the file, export its network with "
            "MultiViewReconstructionModule.load_from_checkpoint(path, weights_only=False, "
            "net=ElsaVGGT.from_config(name)).export_net('net.safetensors')"
        ) from None


def vggt_config_mismatch(state_dict: dict[str, Tensor], config: str, **overrides) -> str | None:
    """None when ``state_dict`` loads into ``ElsaVGGT.from_config(config, **overrides)`` (as
    :meth:`ElsaVGGT.from_vggt_checkpoint` loads it: heads absent here dropped, the DINOv2 ``pos_embed``
    resampled), else the first difference in a few words. The model is built on the meta device."""
    overrides.setdefault("enable_point", any(k.startswith("point_head.") for k in state_dict))
    with torch.device("meta"):
        own = ElsaVGGT.from_config(config, **overrides).state_dict()
    heads = {k.split(".")[0] for k in own}
    keys = {k for k in state_dict if k.split(".")[0] in heads}
    for what, diff in (("missing", sorted(own.keys() - keys)), ("unexpected", sorted(keys - own.keys()))):
        if diff:
            return f"{len(diff)} {what} keys, e.g. {diff[0]}"
    for k in sorted(keys):
        if tuple(state_dict[k].shape) != tuple(own[k].shape) and not k.endswith("patch_embed.pos_embed"):
            return f"{k} is {list(state_dict[k].shape)}, the config's is {list(own[k].shape)}"
    return None


def find_vggt_config(state_dict: dict[str, Tensor], source: str = "state_dict", **overrides) -> str:
    """The :data:`VGGT_CONFIGS` name whose architecture ``state_dict`` has (with ``overrides`` applied).

    Raises:
        ValueError: in one line naming every config and why it does not fit.
    """
    why = {name: vggt_config_mismatch(state_dict, name, **overrides) for name in VGGT_CONFIGS}
    fits = [name for name, reason in why.items() if reason is None]
    if len(fits) != 1:
        reasons = "; ".join(f"{name}: {reason or 'fits'}" for name, reason in why.items())
        raise ValueError(f"{source} fits {'no' if not fits else 'more than one'} ElsaVGGT config ({reasons})")
    return fits[0]


def vggt_checkpoint_filter_fn(
    state_dict: dict[str, Tensor], model: ElsaVGGT
) -> tuple[dict[str, Tensor], list[str]]:
    """Keep the keys ``model`` has (heads absent here -- ``track_head``, and ``point_head`` when disabled --
    are dropped and returned); resample DINOv2 ``pos_embed`` to the model's grid when it differs."""
    own = model.state_dict()
    heads = {k.split(".")[0] for k in own}
    out, dropped = {}, []
    for k, v in state_dict.items():
        if k.split(".")[0] not in heads:
            dropped.append(k)
            continue
        if k.endswith("patch_embed.pos_embed") and k in own and v.shape != own[k].shape:
            n_new = own[k].shape[1] - 1
            g_new = int(math.isqrt(n_new))
            g_old = int(math.isqrt(v.shape[1] - 1))
            grid = v[:, 1:].float().reshape(1, g_old, g_old, -1).permute(0, 3, 1, 2)
            grid = F.interpolate(grid, size=(g_new, g_new), mode="bicubic", antialias=True)
            v = torch.cat([v[:, :1].float(), grid.permute(0, 2, 3, 1).reshape(1, n_new, -1)], 1).to(v.dtype)
        out[k] = v
    return out, dropped


# --------------------------------------------------------------------------------------------------------
# Configurations
# --------------------------------------------------------------------------------------------------------

# The 1B configuration of the VGGT release and a tiny one that trains on a CPU.
_model_cfgs: dict[str, dict] = {
    "elsa_vggt": dict(
        img_size=518,
        patch_size=14,
        embed_dim=1024,
        depth=24,
        num_heads=16,
        num_register_tokens=4,
        patch_embed="dinov2",
        patch_embed_depth=24,
        camera_trunk_depth=4,
        camera_num_heads=16,
        dpt_features=256,
        dpt_out_channels=(256, 512, 1024, 1024),
        intermediate_layer_idx=(4, 11, 17, 23),
    ),
    "elsa_vggt_small": dict(
        img_size=56,
        patch_size=14,
        embed_dim=48,
        depth=4,
        num_heads=4,
        num_register_tokens=4,
        patch_embed="conv",
        patch_embed_depth=0,
        camera_trunk_depth=1,
        camera_num_heads=4,
        dpt_features=32,
        dpt_out_channels=(16, 32, 64, 64),
        intermediate_layer_idx=(0, 1, 2, 3),
    ),
}
# Read-only view of the named configurations: name -> ElsaVGGT arguments (ElsaVGGT.from_config builds them).
VGGT_CONFIGS = MappingProxyType({k: MappingProxyType(v) for k, v in _model_cfgs.items()})


def _filter_fn(state_dict: dict[str, Tensor], model: ElsaVGGT) -> dict[str, Tensor]:
    """:func:`vggt_checkpoint_filter_fn` of :meth:`ElsaVGGT.from_vggt_checkpoint`: the dropped keys are logged
    and kept in ``model.dropped_checkpoint_keys``."""
    sd, dropped = vggt_checkpoint_filter_fn(state_dict, model)
    model.dropped_checkpoint_keys = dropped
    if dropped:
        _logger.warning("dropped %d checkpoint keys without a module here (%s)", len(dropped),
                        ", ".join(sorted({k.split(".")[0] for k in dropped})))
    return sd
