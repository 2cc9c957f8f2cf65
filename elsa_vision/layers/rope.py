"""2D rotary position embedding (RoPE2D) of q and k, as VGGT applies it before attention.

VGGT (https://arxiv.org/abs/2503.11651, ``vggt/layers/rope.py``) rotates each head's channels by integer
patch coordinates given per token: the first half of the channels by the row, the second half by the column;
within a half, channel pairs ``(i, i + d/2)`` rotate at angle ``pos / frequency^(2i/d)``. Tokens at position
``(0, 0)`` (VGGT's camera and register tokens) are left unrotated. timm's rotary embeddings
(``timm.layers.RotaryEmbeddingCat``) build their angles from a fixed feature grid, not from positions given
per token (VGGT's patch rows start at 1, its special tokens sit at 0, merged tokens keep the positions of
the tokens they stand for), so this one is kept.

:class:`elsa_vision.layers.ElsaAttention` takes a ``rope`` module and applies it to q and k (after the
per-head q/k norms) when its ``forward`` is given ``pos``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["RotaryPositionEmbedding2D"]


class RotaryPositionEmbedding2D(nn.Module):
    """2D rotary embedding: the first half of each head's channels rotates with the row index, the second
    half with the column index; within a half, channel pairs ``(i, i + d/2)`` rotate at angle
    ``pos / frequency^(2i/d)``.

    ``forward(x [B, H, N, D], pos [B, N, 2] int64) -> [B, H, N, D]``; ``D`` must be divisible by 4. No
    parameters or buffers: it adds nothing to a state_dict.
    """

    def __init__(self, frequency: float = 100.0, scaling_factor: float = 1.0) -> None:
        super().__init__()
        self.base_frequency = float(frequency)
        self.scaling_factor = float(scaling_factor)

    @staticmethod
    def _rotate_half(x: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat([-x2, x1], dim=-1)

    def _apply_1d(self, x: Tensor, pos: Tensor, inv_freq: Tensor) -> Tensor:
        # The angles of the given positions only: no table sized by the largest position (a data-dependent
        # size that torch.export cannot trace). Same float32 products as a table lookup.
        ang = pos[:, None, :, None].to(torch.float32) * inv_freq  # [B, 1, N, d/2]
        ang = torch.cat([ang, ang], dim=-1)
        return x * ang.cos().to(x.dtype) + self._rotate_half(x) * ang.sin().to(x.dtype)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        if x.shape[-1] % 4:
            raise ValueError(f"RoPE2D needs a head dim divisible by 4, got {x.shape[-1]}")
        half = x.shape[-1] // 2
        inv_freq = 1.0 / self.base_frequency ** (
            torch.arange(0, half, 2, device=x.device, dtype=torch.float32) / half
        )
        xv, xh = x.chunk(2, dim=-1)
        rows, cols = self._apply_1d(xv, pos[..., 0], inv_freq), self._apply_1d(xh, pos[..., 1], inv_freq)
        return torch.cat([rows, cols], dim=-1)

    def extra_repr(self) -> str:
        return f"frequency={self.base_frequency}"
