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

    def _angles(self, pos: Tensor, head_dim: int, dtype: torch.dtype) -> tuple[tuple[Tensor, Tensor], ...]:
        """``((cos, sin) of the rows, (cos, sin) of the columns)``, each ``[B, 1, N, head_dim / 2]`` in
        ``dtype``: computed once per forward for q and k."""
        if head_dim % 4:
            raise ValueError(f"RoPE2D needs a head dim divisible by 4, got {head_dim}")
        half = head_dim // 2
        inv_freq = 1.0 / self.base_frequency ** (
            torch.arange(0, half, 2, device=pos.device, dtype=torch.float32) / half
        )
        out = []
        for axis in (0, 1):
            # The angles of the given positions only: no table sized by the largest position (a
            # data-dependent size that torch.export cannot trace). Same float32 products as a table lookup.
            ang = pos[..., axis][:, None, :, None].to(torch.float32) * inv_freq  # [B, 1, N, half / 2]
            ang = torch.cat([ang, ang], dim=-1)
            out.append((ang.cos().to(dtype), ang.sin().to(dtype)))
        return tuple(out)

    def _rotate(self, x: Tensor, angles) -> Tensor:
        halves = x.chunk(2, dim=-1)  # the rows' channels, the columns' channels
        return torch.cat([h * cos + self._rotate_half(h) * sin for h, (cos, sin) in zip(halves, angles)],
                         dim=-1)

    def forward(self, x: Tensor, pos: Tensor) -> Tensor:
        return self._rotate(x, self._angles(pos, x.shape[-1], x.dtype))

    def rotate(self, q: Tensor, k: Tensor, pos: Tensor) -> tuple[Tensor, Tensor]:
        """``(forward(q, pos), forward(k, pos))`` with the angles computed once."""
        angles = self._angles(pos, q.shape[-1], q.dtype)
        return self._rotate(q, angles), self._rotate(k, angles)

    def extra_repr(self) -> str:
        return f"frequency={self.base_frequency}"
