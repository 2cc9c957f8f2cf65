"""In-place merge of attention results over disjoint key sets (``kernels.monoid.merge_outputs_``, the ring's
merge in context parallelism) against float64: the whole attention, and ``reference.merge_outputs``.

Bounds: merged float32 results against the float64 attention over both key sets, ``relerr <= 1e-6`` for the
output and ``|lse - ref| <= 1e-6 max(1, |ref|)`` (each side rounded to float32 once, one merge: a few ulps);
non-finite entries exactly where the reference has them. A chain of 16 merges of float32 outputs with float64
lse (the forward's partial results) stays within ``2.5e-7`` of float64 (its float32 outputs' own rounding,
``~6e-8`` each, and one per merge: 1.6e-7 measured); the same chain with float32 lse measures 3.4x that."""

from __future__ import annotations

import math

import pytest
import torch

from elsa_vision.kernels.monoid import merge_outputs_
from elsa_vision.kernels.reference import merge_outputs, softmax_attention
from tests.helpers import DEVICE, assert_nonfinite_like, gen, relerr


def _attention_lse(q, k, v):
    """Float64 ``(out, lse)`` of softmax attention (natural-log lse)."""
    s = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    lse = torch.logsumexp(s, -1)
    return softmax_attention(q, k, v), lse


@pytest.mark.parametrize("N, Dv, split", [(37, 24, 11), (5, 72, 3), (64, 16, 63)])
def test_merge_equals_attention_over_both_key_sets(N, Dv, split):
    g = gen(N + Dv)
    B, H, D, Nk = 2, 3, 16, 50
    q, k = (torch.randn(B, H, n, D, generator=g, dtype=torch.float64) for n in (N, Nk))
    v = torch.randn(B, H, Nk, Dv, generator=g, dtype=torch.float64)
    k[..., split:, :] *= 3.0  # the second key set's logits larger: the factors differ widely
    ref, ref_lse = _attention_lse(q, k, v)
    out_a, lse_a = _attention_lse(q, k[..., :split, :], v[..., :split, :])
    out_b, lse_b = _attention_lse(q, k[..., split:, :], v[..., split:, :])
    out = out_a.float().to(DEVICE)
    lse = lse_a.float().to(DEVICE)
    # the second result as the forward kernels store it: [B, N, H, Dv] memory seen as [B, H, N, Dv]
    ob = out_b.float().transpose(1, 2).contiguous().transpose(1, 2).to(DEVICE)
    merge_outputs_(out, lse, ob, lse_b.float().to(DEVICE))
    assert relerr(out.cpu(), ref) <= 1e-6
    assert ((lse.cpu().double() - ref_lse).abs() <= 1e-6 * ref_lse.abs().clamp_min(1)).all()


def test_chain_of_merges_with_float64_lse_keeps_float32_accuracy():
    # 16 partial results of 2,048 keys each (lse near 8, where a float32 rounding is up to 4.8e-7 absolute),
    # merged one after the other into the first, as the ring does with its pieces.
    g = gen(16)
    B, H, N, D, parts, per = 1, 2, 48, 64, 16, 2048
    q = torch.randn(B, H, N, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, parts * per, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, parts * per, D, generator=g, dtype=torch.float64)
    ref, _ = _attention_lse(q, k, v)
    results = [_attention_lse(q, k[..., i * per:(i + 1) * per, :], v[..., i * per:(i + 1) * per, :])
               for i in range(parts)]
    errs = {}
    for lse_dtype in (torch.float64, torch.float32):
        out = results[0][0].float().to(DEVICE)
        lse = results[0][1].to(lse_dtype).clone().to(DEVICE)  # never the reference itself
        for out_b, lse_b in results[1:]:
            merge_outputs_(out, lse, out_b.float().to(DEVICE), lse_b.to(lse_dtype).to(DEVICE))
        errs[lse_dtype] = relerr(out.cpu(), ref)
    assert errs[torch.float64] <= 2.5e-7, errs
    assert errs[torch.float32] > 2 * errs[torch.float64], errs  # what the float64 lse buys


@pytest.mark.parametrize("lse_dtype", [torch.float32, torch.float64])
def test_merge_edge_rows_follow_the_reference(lse_dtype):
    """Rows that see no key on one side or on both, a factor that underflows to 0, a NaN lse, and visible
    non-finite values (an infinity carried through an underflowed factor, opposite infinities -> NaN)."""
    B, H, N, Dv = 1, 2, 8, 5
    g = gen(7)
    oa, ob = (torch.randn(B, H, N, Dv, generator=g) for _ in range(2))
    la, lb = (torch.randn(B, H, N, generator=g) * 3 for _ in range(2))
    la[..., 0], oa[..., 0, :] = -math.inf, 0.0                      # side a sees no key
    lb[..., 1], ob[..., 1, :] = -math.inf, 0.0                      # side b sees no key
    la[..., 2], lb[..., 2] = -math.inf, -math.inf                   # neither side
    oa[..., 2, :], ob[..., 2, :] = 0.0, 0.0
    lb[..., 3] = la[..., 3] - 200.0                                 # b's factor underflows to 0
    ob[..., 3, 1] = math.inf                                        # ... and carries an infinity
    la[..., 4] = math.nan                                           # a NaN logit on side a: the row is NaN
    oa[..., 5, 2], ob[..., 5, 2] = -math.inf, math.inf               # opposite infinities: NaN
    ob[..., 6, 0] = math.nan                                        # a NaN value: its column
    la[..., 7] = lb[..., 7] + 150.0                                 # a huge gap the other way
    ref_out, ref_lse = merge_outputs(oa.double(), la.double(), ob.double(), lb.double())
    out, lse = oa.clone().to(DEVICE), la.clone().to(lse_dtype).to(DEVICE)
    merge_outputs_(out, lse, ob.to(DEVICE), lb.to(lse_dtype).to(DEVICE))
    assert lse.dtype == lse_dtype
    assert_nonfinite_like(out.cpu(), ref_out, 1e-6)
    assert_nonfinite_like(lse.cpu(), ref_lse, 1e-6)
    assert torch.equal(out[..., 2, :].cpu(), torch.zeros(B, H, Dv))  # no key at all: 0, never NaN
    assert torch.isnan(out[..., 4, :]).all() and torch.isposinf(out[..., 3, 1]).all()
