"""Whole-image ViT inference at high resolution: model building from weights, memory planning, execution.

Three execution modes, all on ``ElsaViT`` models built with ``timm.create_model``:

* ``"whole"``: global attention over all ``(H/p)(W/p) + prefix`` tokens, block by block (timm's ``Block``).
* ``"query_chunked"``: the same blocks and the same global attention (the same maths: each query row is
  independent), with every ``ElsaAttention`` attending ``query_chunk`` query rows at a time against the keys
  and values of all tokens (its ``query_chunk`` option): the attention workspace is one chunk's.
* ``"tiled"``: sliding windows with overlap; each tile sees the position embeddings of its place in the full
  grid, and tile features are blended with a separable ramp weight. Only used when the memory budget rules
  out both global modes; attention is then no longer global, and the report says so.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from collections.abc import Iterator, Sequence
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from timm.models import get_deprecated_models
from torch import Tensor, nn

from .. import models  # noqa: F401  (registers the elsa_* names and their short aliases with timm)
from ..layers.attention import ElsaAttention
from ..utils.accelerator import host_available_mb

__all__ = [
    "MODEL_ALIASES",
    "resolve_model_name",
    "stock_model_name",
    "load_weights",
    "weights_shape_info",
    "build_model",
    "Plan",
    "plan_execution",
    "estimate_memory_mb",
    "forward_tokens",
    "query_chunked",
    "cls_attention",
    "run_plan",
    "run_context_parallel",
    "InferenceResult",
    "tile_starts",
]

# Short names -> registered names: the elsa_* aliases in timm's registry (elsa_vision.models.vit).
MODEL_ALIASES = MappingProxyType(
    {k: v for k, v in get_deprecated_models().items() if k.startswith("elsa_") and v is not None})
MODES = ("whole", "query_chunked", "tiled", "context_parallel")
_QUERY_CHUNKS = (16384, 8192, 4096, 2048, 1024, 512, 256, 128, 64)
# rows per call inside the torch attention backend (elsa_vision.ops.attention._TORCH_QUERY_CHUNK)
_TORCH_BACKEND_ROWS = 1024


def resolve_model_name(name: str) -> str:
    """A registered ``elsa_*`` model name from a registered name or a short alias."""
    import timm

    full = MODEL_ALIASES.get(name, name)
    if not full.startswith("elsa_") or full not in timm.list_models("elsa_*"):
        raise ValueError(
            f"model {name!r} is not a registered elsa_* model; expected one of {timm.list_models('elsa_*')} "
            f"or an alias {sorted(MODEL_ALIASES)}"
        )
    return full


def stock_model_name(name: str) -> str:
    """timm's stock (SDPA) counterpart of an ``elsa_*`` model, e.g. ``vit_base_patch16_224``."""
    import timm

    stock = resolve_model_name(name)[len("elsa_") :]
    if stock not in timm.list_models(stock):
        raise ValueError(f"model {name!r} has no stock timm counterpart {stock!r}")
    return stock


def load_weights(path: str | os.PathLike) -> dict[str, Tensor]:
    """The state_dict of a ``--weights`` file (``.safetensors`` or a torch checkpoint), read by
    :func:`elsa_vision.files.read_weights` (``weights_only=True``; wrappers unpacked, timm's EMA weights
    taken first).

    Raises:
        FileNotFoundError: ``path`` is not a file.
        ValueError: the file is not a checkpoint of weights. Messages start with ``--weights:`` and name the
            file.
    """
    from ..files import read_weights

    return read_weights(path, arg="--weights")


def weights_shape_info(sd: dict[str, Tensor], source: str = "weights") -> dict[str, int]:
    """``num_classes`` (0 without a head), ``in_chans``, ``embed_dim``, ``patch_size`` of the weights.

    The model is built with these sizes before the weights are loaded into it, so the shapes they come from
    must fit together first: a zero-element tensor can declare any size (a ``head.weight`` of shape
    ``[5_000_000, 0]`` in a file of a few hundred bytes would build a 3.8 GB classifier). ``source`` names
    the weights in errors (e.g. ``"--weights: 'vit.safetensors'"``).

    Raises:
        ValueError: no 4-D ``patch_embed.proj.weight`` with every dimension >= 1, or a ``head.weight`` that
            is not ``[num_classes >= 1, embed_dim]``.
    """
    if "patch_embed.proj.weight" not in sd:
        raise ValueError(
            f"{source}: no 'patch_embed.proj.weight'; expected a timm VisionTransformer state_dict"
        )
    w = sd["patch_embed.proj.weight"]
    if w.dim() != 4 or min(w.shape) < 1:
        raise ValueError(
            f"{source}: 'patch_embed.proj.weight' must be a conv weight [C, in_chans, p, p] of sizes >= 1, "
            f"got {list(w.shape)}"
        )
    head = sd.get("head.weight")
    if head is not None and (head.dim() != 2 or head.shape[0] < 1 or head.shape[1] != w.shape[0]):
        raise ValueError(
            f"{source}: 'head.weight' must be [num_classes >= 1, embed_dim {w.shape[0]}] (the patch "
            f"embedding's width), got {list(head.shape)}"
        )
    return {
        "num_classes": int(head.shape[0]) if head is not None else 0,
        "in_chans": int(w.shape[1]),
        "embed_dim": int(w.shape[0]),
        "patch_size": int(w.shape[-1]),
    }


def _prefix_in_pos(model: nn.Module) -> int:
    return 0 if getattr(model, "no_embed_class", False) else model.num_prefix_tokens


def build_model(
    name: str,
    state_dict: dict[str, Tensor] | None,
    img_size: tuple[int, int],
    *,
    in_chans: int | None = None,
    num_classes: int | None = None,
    gray_adapt: bool = False,
    stock: bool = False,
    attn_backend: str = "auto",
    attn_precision: str = "auto",
    linear_backend: str = "auto",
) -> nn.Module:
    """Build ``name`` (or its stock timm counterpart) for ``img_size`` and load ``state_dict``.

    ``num_classes`` and ``in_chans`` come from the weights when given. The checkpoint's ``pos_embed`` is
    resampled to the ``img_size`` patch grid with ``timm.layers.resample_abs_pos_embed``. ``gray_adapt``
    turns an RGB patch embedding into a one-channel one by summing over input channels (exactly the same
    as feeding the grey image replicated three times, at a third of the patch-embedding cost).
    """
    import timm
    from timm.layers import resample_abs_pos_embed

    full = resolve_model_name(name)
    sd = dict(state_dict) if state_dict is not None else None
    if sd is not None:
        info = weights_shape_info(sd)
        num_classes = info["num_classes"]
        in_chans = info["in_chans"]
        if gray_adapt and in_chans != 1:
            sd["patch_embed.proj.weight"] = sd["patch_embed.proj.weight"].sum(dim=1, keepdim=True)
            in_chans = 1
    kwargs: dict[str, Any] = dict(
        num_classes=1000 if num_classes is None else num_classes,
        in_chans=3 if in_chans is None else in_chans,
        img_size=tuple(img_size),
    )
    if stock:
        model = timm.create_model(stock_model_name(full), pretrained=False, **kwargs)
        for blk in model.blocks:
            if hasattr(blk.attn, "fused_attn"):
                blk.attn.fused_attn = True  # F.scaled_dot_product_attention
    else:
        model = timm.create_model(full, pretrained=False, attn_backend=attn_backend,
                                  attn_precision=attn_precision, linear_backend=linear_backend, **kwargs)
    if sd is not None:
        if sd["patch_embed.proj.weight"].shape[0] != model.embed_dim:
            raise ValueError(
                f"weights have embed_dim {sd['patch_embed.proj.weight'].shape[0]}, model {full!r} has "
                f"{model.embed_dim}"
            )
        p_ckpt = tuple(sd["patch_embed.proj.weight"].shape[-2:])
        if p_ckpt != tuple(model.patch_embed.patch_size):
            raise ValueError(
                f"weights have patch size {p_ckpt}, model {full!r} has {model.patch_embed.patch_size}"
            )
        pos = sd.get("pos_embed")
        if pos is not None and model.pos_embed is not None and pos.shape != model.pos_embed.shape:
            npt = _prefix_in_pos(model)
            n_old = pos.shape[1] - npt
            side = math.isqrt(n_old)
            if side * side != n_old:
                raise ValueError(f"weights' pos_embed has {n_old} patch positions, not a square grid")
            sd["pos_embed"] = resample_abs_pos_embed(
                pos.float(),
                new_size=list(model.patch_embed.grid_size),
                old_size=[side, side],
                num_prefix_tokens=npt,
            ).to(pos.dtype)
        try:
            model.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise ValueError(f"weights do not fit model {full!r}: {e}") from e
    return model.eval()


# ------------------------------------------------------------------------------------------ memory plan


def _param_bytes(model: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters()) + sum(
        b.numel() * b.element_size() for b in model.buffers()
    )


def _resolved_backend(model: nn.Module, device: torch.device) -> str:
    from ..ops.attention import resolve_backend

    for m in model.modules():
        if isinstance(m, ElsaAttention):
            return resolve_backend(m.backend, torch.empty(0, device=device))
    return "sdpa"


def estimate_memory_mb(
    model: nn.Module,
    tokens: int,
    *,
    mode: str,
    backend: str,
    query_chunk: int | None = None,
    image_elems: int = 0,
    act_bytes: int = 4,
    world: int = 1,
) -> float:
    """Peak memory estimate (MiB) of one forward over ``tokens`` tokens (batch 1, no autograd); with
    ``mode="context_parallel"``, of one of ``world`` ranks.

    Counted: weights; the input image; per block, the live activations (residual, norm, qkv, attention
    output, about ``6 N C``, and the MLP's hidden activations before and after its nonlinearity, ``2 r C``
    per token for ``rows`` tokens); and the attention workspace of ``rows`` query rows at a time (``N``
    whole, ``query_chunk`` query_chunked, where the MLP runs over that many tokens at a time too): the
    torch backend holds about five ``H x rows x N`` float32
    tensors per call (logits, padded logits, their exponentials, block value states) with ``rows <= 1024``;
    the Triton backend only ``O(rows (D + 2) H)``, plus in float32 the keys and values split into float16
    parts (as many bytes as the keys and values; on Hopper, counted everywhere as an upper bound); SDPA's
    efficient kernel likewise. A context-parallel rank
    holds the embedded tokens of the whole image and the gathered output (``2 N C``), the activations of
    its ``n = N / world`` tokens, the keys and values it sends and receives around the ring (``4 n C``), its
    queries' running states and the attention workspace of ``n`` queries against ``n`` keys.
    """
    if mode not in ("whole", "query_chunked", "context_parallel"):
        raise ValueError(f"mode must be 'whole', 'query_chunked' or 'context_parallel', got {mode!r}")
    C = model.embed_dim
    blk = model.blocks[0]
    heads = blk.attn.num_heads
    hidden = blk.mlp.fc1.out_features if hasattr(blk.mlp, "fc1") else 4 * C
    ratio = hidden / C
    N = tokens
    if mode == "context_parallel":
        n = -(-N // max(1, world))
        keys, rows = n, n
        activations = 2 * N * C + 6 * n * C + 2 * ratio * n * C + 4 * n * C + heads * n * (C // heads + 2)
    else:
        keys, rows = N, N if mode == "whole" else min(N, query_chunk)
        activations = 6 * N * C + 2 * ratio * rows * C
    if backend == "torch":
        workspace = 5 * heads * min(rows, _TORCH_BACKEND_ROWS) * keys
    else:
        workspace = 2 * heads * rows * (C // heads + 2)
        if act_bytes == 4:  # FP32 on Hopper: K and V as float16 parts (kernels.fwd); elsewhere a bound
            workspace += 2 * keys * C
    total = _param_bytes(model) + 2 * image_elems * 4 + (activations + workspace) * act_bytes
    return total / 2**20


@dataclasses.dataclass
class Plan:
    """How to run: ``mode`` in :data:`MODES`; ``query_chunk`` (query_chunked); tile side/overlap in pixels."""

    mode: str
    estimated_peak_mb: float
    budget_mb: float | None
    query_chunk: int | None = None
    tile: int | None = None
    overlap: int | None = None
    reason: str = ""


def tile_starts(size: int, tile: int, stride: int) -> list[int]:
    """Start offsets covering ``[0, size)`` with windows of ``tile`` and at most ``stride`` apart."""
    if tile >= size:
        return [0]
    starts = list(range(0, size - tile + 1, stride))
    if starts[-1] != size - tile:
        starts.append(size - tile)
    return starts


def plan_execution(
    model: nn.Module,
    img_size: tuple[int, int],
    *,
    device: torch.device,
    budget_mb: float | None = None,
    query_chunk: int | None = None,
    overlap_frac: float = 0.25,
    act_bytes: int = 4,
    context_parallel: int | None = None,
) -> Plan:
    """Choose whole-image, query-chunked or tiled execution, or size a context-parallel run.

    ``model`` may live on the meta device (the plan reads shapes only): a size that cannot fit is refused
    before the model is built. ``context_parallel`` (the number of ranks): the per-rank estimate of
    :func:`run_context_parallel`, refused when it exceeds ``budget_mb`` (each rank's). ``query_chunk``
    given: query-chunked with that chunk (global attention), refused when its estimate exceeds
    ``budget_mb``. Otherwise the first of these whose estimate fits ``budget_mb`` (default: whole): whole;
    query-chunked with the largest chunk in :data:`_QUERY_CHUNKS`; tiled with the largest square tile
    (multiple of the patch) that fits, overlapping by ``overlap_frac`` of the tile.

    Raises:
        ValueError: in one line, with the estimate, when no mode fits ``budget_mb``.
    """
    if not 0.0 <= overlap_frac < 1.0:
        raise ValueError(f"tile overlap fraction must be in [0, 1), got {overlap_frac}")
    H, W = img_size
    p = model.patch_embed.patch_size[0]
    gh, gw = H // p, W // p
    N = gh * gw + model.num_prefix_tokens
    backend = _resolved_backend(model, device)
    image_elems = model.patch_embed.proj.in_channels * H * W
    est = dict(backend=backend, image_elems=image_elems, act_bytes=act_bytes)
    if budget_mb is not None and budget_mb <= 0:
        raise ValueError(f"memory budget must be > 0 MiB, got {budget_mb}")
    if context_parallel is not None:
        e = estimate_memory_mb(model, N, mode="context_parallel", world=context_parallel, **est)
        if budget_mb is not None and e > budget_mb:
            raise ValueError(
                f"context parallelism over {context_parallel} ranks needs about {e:,.0f} MiB per rank for "
                f"{N:,} tokens, more than the budget of {budget_mb:,.0f} MiB per rank"
            )
        return Plan("context_parallel", e, budget_mb,
                    reason=f"tokens split over {context_parallel} ranks, ring attention; the estimate is "
                           "one rank's")
    if query_chunk is not None:
        if query_chunk < 1:
            raise ValueError(f"query_chunk must be >= 1, got {query_chunk}")
        e = estimate_memory_mb(model, N, mode="query_chunked", query_chunk=query_chunk, **est)
        if budget_mb is not None and e > budget_mb:
            raise ValueError(
                f"query-chunked attention over {N:,} tokens needs about {e:,.0f} MiB, more than the budget "
                f"of {budget_mb:,.0f} MiB"
            )
        return Plan("query_chunked", e, budget_mb, query_chunk=query_chunk, reason="query_chunk given")
    whole = estimate_memory_mb(model, N, mode="whole", **est)
    if budget_mb is None or whole <= budget_mb:
        return Plan("whole", whole, budget_mb, reason="fits the budget" if budget_mb else "no budget given")
    for qc in _QUERY_CHUNKS:
        if qc >= N:
            continue
        e = estimate_memory_mb(model, N, mode="query_chunked", query_chunk=qc, **est)
        if e <= budget_mb:
            return Plan(
                "query_chunked",
                e,
                budget_mb,
                query_chunk=qc,
                reason=f"whole-image estimate {whole:.1f} MiB > budget {budget_mb:.1f} MiB",
            )
    side = min(gh, gw)
    while side >= 1:
        tile = side * p
        ov = int(round(side * overlap_frac)) * p
        n_t = side * side + model.num_prefix_tokens
        # accumulators: blended features + weights over the whole grid
        acc = 2 * (gh * gw * (model.embed_dim + 1)) * 4 / 2**20
        e = (
            estimate_memory_mb(
                model, n_t, mode="whole", backend=backend, image_elems=image_elems, act_bytes=act_bytes
            )
            + acc
        )
        if e <= budget_mb:
            return Plan(
                "tiled",
                e,
                budget_mb,
                tile=tile,
                overlap=ov,
                reason=f"global attention does not fit the budget {budget_mb:.1f} MiB "
                f"(whole {whole:.1f} MiB); sliding windows of {tile}px, overlap {ov}px",
            )
        side = side - max(1, side // 8)
    raise ValueError(
        f"memory budget {budget_mb:,.1f} MiB is too small: even one {p}x{p}-patch tile needs more (weights "
        f"alone {_param_bytes(model) / 2**20:,.0f} MiB)"
    )


# --------------------------------------------------------------------------------------------- forward


def _embed(model: nn.Module, x: Tensor, offset: tuple[int, int] = (0, 0)) -> Tensor:
    """Patch tokens plus prefix tokens, with the position embeddings of grid cell ``offset`` onwards.

    Equal to timm's ``patch_embed`` + ``_pos_embed`` + ``norm_pre`` when the image covers the model's grid.
    """
    pe = model.patch_embed
    t = pe.proj(x)  # [B, C, h, w]
    B, C, h, w = t.shape
    t = pe.norm(t.flatten(2).transpose(1, 2))
    npt = _prefix_in_pos(model)
    prefix = []
    if model.cls_token is not None:
        prefix.append(model.cls_token.expand(B, -1, -1))
    if model.reg_token is not None:
        prefix.append(model.reg_token.expand(B, -1, -1))
    if model.pos_embed is not None:
        gh, gw = pe.grid_size
        r0, c0 = offset
        if r0 + h > gh or c0 + w > gw:
            raise ValueError(f"tile at grid {offset} of {h}x{w} patches exceeds the model grid {gh}x{gw}")
        grid = model.pos_embed[:, npt:].reshape(1, gh, gw, C)
        t = t + grid[:, r0 : r0 + h, c0 : c0 + w].reshape(1, h * w, C)
        if prefix:
            pre = torch.cat(prefix, dim=1)
            if npt:
                pre = pre + model.pos_embed[:, :npt]
            t = torch.cat([pre, t], dim=1)
    elif prefix:
        t = torch.cat(prefix + [t], dim=1)
    return model.norm_pre(model.pos_drop(t))


def _check_chunkable(model: nn.Module) -> None:
    for i, blk in enumerate(model.blocks):
        if not isinstance(getattr(blk, "attn", None), ElsaAttention):
            raise ValueError(
                f"query-chunked execution needs blocks with ElsaAttention; block {i} has "
                f"{type(getattr(blk, 'attn', None)).__name__}"
            )


class _TokenChunkedMlp(nn.Module):
    """A block's MLP applied to ``chunk`` tokens at a time, written into one output: the hidden activations
    (``mlp_ratio`` times the width) exist for ``chunk`` tokens, not all. The same result (the MLP is
    per-token)."""

    def __init__(self, mlp: nn.Module, chunk: int) -> None:
        super().__init__()
        self.mlp, self.chunk = mlp, chunk

    def forward(self, x: Tensor) -> Tensor:
        n = x.shape[1]
        if n <= self.chunk:
            return self.mlp(x)
        first = self.mlp(x[:, : self.chunk])
        out = first.new_empty(x.shape[0], n, first.shape[-1])
        out[:, : self.chunk] = first
        for i in range(self.chunk, n, self.chunk):
            out[:, i : i + self.chunk] = self.mlp(x[:, i : i + self.chunk])
        return out


@contextlib.contextmanager
def query_chunked(model: nn.Module, query_chunk: int | None) -> Iterator[None]:
    """Inside the block every block's ``ElsaAttention`` attends ``query_chunk`` query rows at a time (its
    ``query_chunk`` option) and its MLP runs over ``query_chunk`` tokens at a time (None: the model as it
    is); the previous settings are restored on exit."""
    if query_chunk is None:
        yield
        return
    _check_chunkable(model)
    attns = [blk.attn for blk in model.blocks]
    previous = [a.query_chunk for a in attns]
    mlps = [blk.mlp for blk in model.blocks]
    try:
        for a in attns:
            a.query_chunk = query_chunk
        for blk, mlp in zip(model.blocks, mlps):
            blk.mlp = _TokenChunkedMlp(mlp, query_chunk)
        yield
    finally:
        for blk, mlp in zip(model.blocks, mlps):
            blk.mlp = mlp
        for a, q in zip(attns, previous):
            a.query_chunk = q


def cls_attention(model: nn.Module, blk: nn.Module, t: Tensor) -> Tensor:
    """Head-averaged attention of the class token over the patch tokens in block ``blk`` (input ``t``).

    Only the class query row is formed: ``O(N C)`` work and memory. Returns ``[B, h*w]`` (each row sums to
    at most 1: the prefix tokens' share is left out).
    """
    if model.cls_token is None:
        raise ValueError("a class-token attention map needs a model with a class token (class_token=True)")
    attn = blk.attn
    B, N, _ = t.shape
    Hh, D = attn.num_heads, attn.head_dim
    A = Hh * D
    xn = blk.norm1(t)
    w, b = attn.qkv.weight, attn.qkv.bias
    q = F.linear(xn[:, :1], w[:A], None if b is None else b[:A]).view(B, 1, Hh, D).transpose(1, 2)
    k = F.linear(xn, w[A : 2 * A], None if b is None else b[A : 2 * A]).view(B, N, Hh, D).transpose(1, 2)
    q, k = attn.q_norm(q), attn.k_norm(k)
    p = ((q.float() * attn.scale) @ k.float().transpose(-2, -1)).softmax(dim=-1)  # [B, H, 1, N]
    return p[:, :, 0, model.num_prefix_tokens :].mean(dim=1)


@torch.no_grad()
def forward_tokens(
    model: nn.Module,
    x: Tensor,
    *,
    query_chunk: int | None = None,
    offset: tuple[int, int] = (0, 0),
    with_cls_attention: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Final-norm tokens ``[B, prefix + h*w, C]`` of image ``x [B, in_chans, H, W]``.

    Every block is timm's own forward; with ``query_chunk`` its attention attends that many query rows at a
    time (:func:`query_chunked`, the same result). ``with_cls_attention`` also returns the last block's
    class-token attention ``[B, h*w]`` (:func:`cls_attention`).
    """
    t = _embed(model, x, offset)
    last = len(model.blocks) - 1
    cls_attn = None
    with query_chunked(model, query_chunk):
        for i, blk in enumerate(model.blocks):
            if with_cls_attention and i == last:
                cls_attn = cls_attention(model, blk, t)
            t = blk(t)
    t = model.norm(t)
    return (t, cls_attn) if with_cls_attention else t


def _ramp(n: int, device) -> Tensor:
    """1-D blending weight over ``n`` patches: a triangle, strictly positive at the borders."""
    i = torch.arange(n, device=device, dtype=torch.float32)
    return torch.minimum(i + 1, n - i) / ((n + 1) / 2)


@dataclasses.dataclass
class InferenceResult:
    """``features [C, h, w]``, ``prefix [P, C]`` (cls first), ``logits [num_classes]`` (None without head),
    ``cls_attention [h, w]`` (last block, global modes, when asked for)."""

    features: Tensor
    prefix: Tensor
    logits: Tensor | None
    plan: Plan
    seconds: float
    peak_memory_mb: float
    peak_memory_kind: str
    tiles: int = 1
    cls_attention: Tensor | None = None


def _peak_rss_mb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _split(model: nn.Module, tokens: Tensor, h: int, w: int) -> tuple[Tensor, Tensor]:
    npt = model.num_prefix_tokens
    feats = tokens[0, npt:].reshape(h, w, -1).permute(2, 0, 1)
    return feats, tokens[0, :npt]


def _grid_and_autocast(model: nn.Module, image: Tensor, autocast_dtype) -> tuple[int, int, int, Any]:
    """(patch size, token grid height, width, the autocast context) of one ``[C, H, W]`` image."""
    p = model.patch_embed.patch_size[0]
    _, H, W = image.shape
    if autocast_dtype is not None:
        amp = torch.autocast(image.device.type, dtype=autocast_dtype)
    else:
        amp = torch.autocast(image.device.type, enabled=False)
    return p, H // p, W // p, amp


@torch.no_grad()
def run_plan(
    model: nn.Module,
    image: Tensor,
    plan: Plan,
    *,
    autocast_dtype: torch.dtype | None = None,
    with_cls_attention: bool = False,
) -> InferenceResult:
    """Run ``model`` on ``image [in_chans, H, W]`` (already on the model's device) following ``plan``.

    ``with_cls_attention`` (global modes only) also returns the last block's class-token attention map.
    """
    if with_cls_attention and plan.mode == "tiled":
        raise ValueError("with_cls_attention needs global attention; the plan is tiled")
    device = image.device
    p, gh, gw, amp = _grid_and_autocast(model, image, autocast_dtype)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    _sync(device)
    t0 = time.perf_counter()
    n_tiles = 1
    cls_map = None
    with amp:
        x = image[None]
        if plan.mode in ("whole", "query_chunked"):
            tokens = forward_tokens(
                model, x, query_chunk=plan.query_chunk, with_cls_attention=with_cls_attention
            )
            if with_cls_attention:
                tokens, cls_map = tokens
                cls_map = cls_map[0].float().reshape(gh, gw)
            logits = model.forward_head(tokens)[0] if model.num_classes else None
            feats, prefix = _split(model, tokens.float(), gh, gw)
        else:
            ts, ov = plan.tile // p, plan.overlap // p
            stride = max(1, ts - ov)
            acc = torch.zeros(model.embed_dim, gh, gw, device=device)
            wsum = torch.zeros(1, gh, gw, device=device)
            pre_sum = None
            logit_sum = None
            rows, cols = tile_starts(gh, min(ts, gh), stride), tile_starts(gw, min(ts, gw), stride)
            th, tw = min(ts, gh), min(ts, gw)
            wt = _ramp(th, device)[:, None] * _ramp(tw, device)[None, :]
            for r in rows:
                for c in cols:
                    tile = x[:, :, r * p : (r + th) * p, c * p : (c + tw) * p]
                    tokens = forward_tokens(model, tile, offset=(r, c))
                    f, pre = _split(model, tokens.float(), th, tw)
                    acc[:, r : r + th, c : c + tw] += f * wt
                    wsum[:, r : r + th, c : c + tw] += wt
                    pre_sum = pre if pre_sum is None else pre_sum + pre
                    if model.num_classes:
                        lg = model.forward_head(tokens)[0].float()
                        logit_sum = lg if logit_sum is None else logit_sum + lg
            n_tiles = len(rows) * len(cols)
            feats = acc / wsum
            prefix = pre_sum / n_tiles
            logits = logit_sum / n_tiles if logit_sum is not None else None
    _sync(device)
    seconds = time.perf_counter() - t0
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    else:
        peak, kind = _peak_rss_mb(), "cpu_process_max_rss"
    return InferenceResult(
        feats.float(),
        prefix.float(),
        None if logits is None else logits.float(),
        plan,
        seconds,
        peak,
        kind,
        n_tiles,
        cls_map,
    )


@torch.no_grad()
def run_context_parallel(
    model: nn.Module,
    image: Tensor,
    group,
    *,
    layout: str = "contiguous",
    autocast_dtype: torch.dtype | None = None,
) -> InferenceResult:
    """Global attention over one image whose tokens are split over the ranks of ``group``.

    Every rank passes the same ``image [in_chans, H, W]`` (on its own device); each rank embeds it, keeps its
    shard of the tokens (:meth:`elsa_vision.models.ElsaViT.set_context_parallel`), runs the blocks with
    ring attention, and the final tokens are all-gathered: every rank returns the same result, equal to a
    whole-image run on one device up to the summation order of the attention. Memory per rank: the
    embedded tokens of the whole image plus ``1/world`` of every block's activations.
    ``peak_memory_mb`` is this rank's. The model's context-parallel setting is restored afterwards.
    """
    from ..models.vit import ElsaViT

    if not isinstance(model, ElsaViT):
        raise TypeError(f"run_context_parallel: model must be an ElsaViT, got {type(model).__name__}")
    device = image.device
    p, gh, gw, amp = _grid_and_autocast(model, image, autocast_dtype)
    previous = model.context_parallel
    model.set_context_parallel(group, layout=layout)
    try:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        _sync(device)
        t0 = time.perf_counter()
        with amp:
            local = model.forward_features(image[None])
            logits = model.forward_head(local)[0] if model.num_classes else None
            tokens = model.gather_tokens(local)
            feats, prefix = _split(model, tokens.float(), gh, gw)
        _sync(device)
        seconds = time.perf_counter() - t0
    finally:
        if previous is None:
            model.set_context_parallel(None)
        else:
            model.set_context_parallel(previous.group, layout=previous.layout)
    if device.type == "cuda":
        peak, kind = torch.cuda.max_memory_allocated(device) / 2**20, "cuda_max_allocated"
    else:
        peak, kind = _peak_rss_mb(), "cpu_process_max_rss"
    world = torch.distributed.get_world_size(group)
    per_rank = estimate_memory_mb(model, gh * gw + model.num_prefix_tokens, mode="context_parallel",
                                  backend=_resolved_backend(model, device), image_elems=image.numel(),
                                  world=world)
    plan = Plan("context_parallel", estimated_peak_mb=per_rank, budget_mb=None,
                reason=f"tokens split over {world} ranks ({layout} layout), ring attention; "
                       f"estimated_peak_mb is one rank's")
    return InferenceResult(feats.float(), prefix.float(), None if logits is None else logits.float(), plan,
                           seconds, peak, kind)


def default_budget_mb(device: torch.device) -> float:
    """90% of the free device memory (CUDA) or of the available RAM (CPU, from /proc/meminfo).

    On CUDA the memory this process already holds through the caching allocator (the model's weights,
    which the estimate counts) is added back.
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return (0.9 * free + torch.cuda.memory_reserved(device)) / 2**20
    return 0.9 * host_available_mb()


def resize_image(image: Tensor, size: Sequence[int]) -> Tensor:
    """Bilinear (antialiased when shrinking) resize of float32 ``[C, H, W]`` to ``size``."""
    H, W = image.shape[-2:]
    if (H, W) == tuple(size):
        return image
    shrink = size[0] < H or size[1] < W
    return F.interpolate(
        image[None], size=tuple(size), mode="bilinear", align_corners=False, antialias=shrink
    )[0]
