"""float64 ``torch.autograd.gradcheck`` of the torch backend of ``elsa_attention`` (the training fallback).

Finite differences against autograd for q, k, v and ``attn_bias`` at small odd shapes: plain, causal with
Nq > Nk (rows that see no key), a ``-inf`` bias band with a fully masked row, key padding, Dv != D, and the
broadcast biases whose gradients are reductions ((1, H, N, N), (B, 1, 1, N)).
"""

from __future__ import annotations

import math

import pytest
import torch

from elsa_vision.ops.attention import elsa_attention


def _inputs(B, H, Nq, Nk, D, Dv, bias_shape, seed):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).requires_grad_()  # noqa: E731
    q, k, v = mk(B, H, Nq, D), mk(B, H, Nk, D), mk(B, H, Nk, Dv)
    bias = None if bias_shape is None else mk(*bias_shape)
    return q, k, v, bias


CASES = [  # (B, H, Nq, Nk, D, Dv, bias shape, causal, key padding, -inf band)
    (1, 2, 5, 7, 3, 4, None, False, False, False),
    (1, 2, 7, 5, 3, 3, None, True, False, False),             # rows 0, 1 see no key (bottom-right causal)
    (2, 2, 5, 6, 4, 3, (1, 2, 5, 6), False, False, True),     # relative-position style + fully masked row
    (2, 3, 4, 6, 3, 3, (2, 1, 1, 6), True, True, False),      # padding-style bias, key padding mask
    (2, 1, 3, 9, 2, 5, (2, 1, 3, 9), False, True, True),      # a batch with every key padded away
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,Dv,bshape,causal,kpm,band", CASES)
def test_gradcheck_torch_backend(B, H, Nq, Nk, D, Dv, bshape, causal, kpm, band):
    q, k, v, bias = _inputs(B, H, Nq, Nk, D, Dv, bshape, seed=B * 100 + Nq * 10 + Nk)
    mask = None
    if kpm:
        mask = torch.ones(B, Nk, dtype=torch.bool)
        mask[0, 1] = False
        mask[-1, -2:] = False
        if band:
            mask[-1] = False
    if band:
        with torch.no_grad():
            bias[..., 1, :] = -math.inf   # a fully masked query row
            bias[..., :, 0] = -math.inf   # a masked key column

    def fn(q, k, v, *b):
        return elsa_attention(q, k, v, attn_bias=b[0] if b else None, key_padding_mask=mask, causal=causal,
                              backend="torch")

    args = (q, k, v) + ((bias,) if bias is not None else ())
    out = fn(*args)
    assert torch.isfinite(out).all()
    assert torch.autograd.gradcheck(fn, args, eps=1e-6, atol=1e-8, rtol=1e-6)
    out.backward(torch.randn_like(out))
    for t in args:
        assert torch.isfinite(t.grad).all()
    if band:
        assert (q.grad[..., 1, :] == 0).all() and (bias.grad[..., 1, :] == 0).all()
