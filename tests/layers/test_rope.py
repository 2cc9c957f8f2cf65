"""RoPE2D (``layers/rope.py``) against a float64 rotation, and as ``ElsaAttention``'s ``rope`` option."""

import math

import pytest
import torch
from torch import nn

from elsa_vision.layers import ElsaAttention, RotaryPositionEmbedding2D


def _rope_ref(x: torch.Tensor, pos: torch.Tensor, freq: float) -> torch.Tensor:
    """Float64 RoPE2D: half 0 rotates pairs (i, i + d/2) of the first D/2 channels by row·freq^(-2i/(D/2)),
    half 1 the same with the column."""
    x = x.double()
    D = x.shape[-1]
    d = D // 2
    out = torch.empty_like(x)
    for half in range(2):
        xs = x[..., half * d : (half + 1) * d]
        p = pos[..., half].double()[:, None, :, None]  # [B,1,N,1]
        i = torch.arange(d // 2, dtype=torch.float64)
        theta = p * freq ** (-2 * i / d)
        a, b = xs[..., : d // 2], xs[..., d // 2 :]
        out[..., half * d : half * d + d // 2] = a * theta.cos() - b * theta.sin()
        out[..., half * d + d // 2 : (half + 1) * d] = b * theta.cos() + a * theta.sin()
    return out


def test_rope2d_matches_float64_rotation():
    rope = RotaryPositionEmbedding2D(100.0)
    x = torch.randn(2, 3, 29, 24)
    pos = torch.randint(0, 37, (2, 29, 2))
    out = rope(x, pos)
    ref = _rope_ref(x, pos, 100.0)
    assert (out.double() - ref).norm() / ref.norm() <= 1e-6
    # a rotation: norms of each rotated pair are preserved
    assert torch.allclose(out.norm(dim=-1), x.norm(dim=-1), rtol=1e-5)
    with pytest.raises(ValueError, match="divisible by 4"):
        rope(torch.randn(1, 1, 3, 6), torch.zeros(1, 3, 2, dtype=torch.long))


def test_attention_with_rope_qknorm_matches_float64_reference():
    """ElsaAttention with the ``rope`` option (VGGT's attention: q/k LayerNorm, then RoPE2D of q and k)."""
    torch.manual_seed(1)
    attn = ElsaAttention(40, num_heads=5, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm,
                         rope=RotaryPositionEmbedding2D(100.0), backend="torch").eval()
    for p in attn.parameters():
        torch.nn.init.normal_(p, std=0.3)
    x = torch.randn(3, 37, 40)
    pos = torch.randint(0, 9, (3, 37, 2))
    out = attn(x, pos=pos)
    assert torch.equal(attn(x), attn(x, pos=torch.zeros_like(pos)))  # position (0, 0) is no rotation
    # float64 reference from the same weights
    a64 = ElsaAttention(40, num_heads=5, qkv_bias=True, qk_norm=True, norm_layer=nn.LayerNorm,
                        backend="torch").double()
    a64.load_state_dict(attn.state_dict())
    xd = x.double()
    q, k, v = a64.qkv(xd).reshape(3, 37, 3, 5, 8).permute(2, 0, 3, 1, 4)
    q, k = a64.q_norm(q), a64.k_norm(k)
    q, k = _rope_ref(q, pos, 100.0), _rope_ref(k, pos, 100.0)
    w = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(8), dim=-1)
    ref = a64.proj((w @ v).transpose(1, 2).reshape(3, 37, 40))
    assert (out.double() - ref).norm() / ref.norm() <= 1e-5
