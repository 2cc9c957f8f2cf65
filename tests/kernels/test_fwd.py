"""ELSA forward kernels (``elsa_vision.kernels.fwd``) against the float64 reference.

Without CUDA the kernels run in the Triton interpreter (``tests/conftest.py`` sets ``TRITON_INTERPRET=1``
before Triton is imported) at small, odd shapes; there every float32 dot is exact float32 arithmetic.
``@pytest.mark.gpu`` tests run the large shapes, races and tensor-core precisions on a GPU.

Thresholds (``relerr = ||out - ref64|| / ||ref64||``): FP32-accurate paths (ieee, tf32x3, fp16x3,
auto) <= 1e-6, tf32 <= 5e-3; float16/bfloat16 the FlashAttention way:
``max|out - ref64| <= 2 max|out_lp - ref64| + atol`` where ``out_lp`` is the same attention computed by
PyTorch in the low precision.
"""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from elsa_vision import elsa_attention, elsa_attention_varlen
from elsa_vision.kernels import elsa_fwd, elsa_fwd_varlen, plan
from elsa_vision.kernels import fwd as fwd_module
from elsa_vision.kernels.fwd import fwd_program, segment_keys
from elsa_vision.kernels.launch import ProgramCache
from elsa_vision.kernels.monoid import merge_states
from elsa_vision.kernels.reference import merge_depth, softmax_attention
from tests.helpers import (
    DEVICE,
    FP32_ACCURATE,
    LOW_ATOL,
    NONFINITE_KINDS,
    TF32_BOUND,
    assert_lse,
    assert_nonfinite_like,
    compile_for_sm90,
    fused_qkv_views,
    gen,
    nonfinite_case,
    qkv,
    randn,
    ref64,
    relerr,
    scan64,
)


def spec64(q, k, v, attn_bias=None, **kw):
    """The reference scan in float64 (the rule for non-finite inputs; ``softmax_attention`` turns a hidden
    key's NaN into a NaN row through ``0 * NaN``)."""
    return scan64(q, k, v, attn_bias=attn_bias, **kw)[0]


def assert_low_precision(out, q, k, v, **kw):
    """FlashAttention's criterion against the same math in the low precision."""
    ref = ref64(q, k, v, **kw)
    bias = kw.pop("attn_bias", None)
    out_lp = softmax_attention(q, k, v, attn_bias=bias, **kw)
    err = (out.double() - ref).abs().max().item()
    base = (out_lp.double() - ref).abs().max().item()
    assert err <= 2 * base + LOW_ATOL[q.dtype], f"max err {err} vs low-precision torch {base}"


# ------------------------------------------------------------------------------- the monoid helpers


@triton.jit
def _store_state(OUT_M, OUT_S, OUT_W, slot, m, s, w, r, wp, R: tl.constexpr, DV: tl.constexpr):
    tl.store(OUT_M + slot * R + r[:, None], m)
    tl.store(OUT_S + slot * R + r[:, None], s)
    tl.store(OUT_W + slot * R * DV + wp, w)


@triton.jit
def _monoid_probe(M, S, W, OUT_M, OUT_S, OUT_W, R: tl.constexpr, DV: tl.constexpr):
    """Rows of three states a, b, c -> e(+)a, a(+)e, (a(+)b)(+)c, a(+)(b(+)c) (slots 0..3)."""
    r = tl.arange(0, R)
    d = tl.arange(0, DV)
    ma, mb, mc = tl.load(M + r), tl.load(M + R + r), tl.load(M + 2 * R + r)
    sa, sb, sc = tl.load(S + r), tl.load(S + R + r), tl.load(S + 2 * R + r)
    wp = r[:, None] * DV + d[None, :]
    wa, wb, wc = tl.load(W + wp), tl.load(W + R * DV + wp), tl.load(W + 2 * R * DV + wp)
    me = tl.full([R], float("-inf"), tl.float32)
    se = tl.zeros([R], tl.float32)
    we = tl.zeros([R, DV], tl.float32)
    m0, s0, w0 = merge_states(me[:, None], se[:, None], we, ma[:, None], sa[:, None], wa)
    m1, s1, w1 = merge_states(ma[:, None], sa[:, None], wa, me[:, None], se[:, None], we)
    mab, sab, wab = merge_states(ma[:, None], sa[:, None], wa, mb[:, None], sb[:, None], wb)
    m2, s2, w2 = merge_states(mab, sab, wab, mc[:, None], sc[:, None], wc)
    mbc, sbc, wbc = merge_states(mb[:, None], sb[:, None], wb, mc[:, None], sc[:, None], wc)
    m3, s3, w3 = merge_states(ma[:, None], sa[:, None], wa, mbc, sbc, wbc)
    _store_state(OUT_M, OUT_S, OUT_W, 0, m0, s0, w0, r, wp, R, DV)
    _store_state(OUT_M, OUT_S, OUT_W, 1, m1, s1, w1, r, wp, R, DV)
    _store_state(OUT_M, OUT_S, OUT_W, 2, m2, s2, w2, r, wp, R, DV)
    _store_state(OUT_M, OUT_S, OUT_W, 3, m3, s3, w3, r, wp, R, DV)


def test_monoid_merge_identity_and_associativity():
    R, DV = 16, 16
    m = randn(3, R, seed=200) * 4
    m[0, :3] = -math.inf  # identity-like rows (nothing visible) inside a
    m[1, 5] = -math.inf
    s = torch.rand(3, R, generator=gen(201)).to(DEVICE) + 0.5
    s[m == -math.inf] = 0.0
    w = randn(3, R, DV, seed=202)
    w[m == -math.inf] = 0.0
    out_m = torch.empty(4, R, device=DEVICE)
    out_s = torch.empty(4, R, device=DEVICE)
    out_w = torch.empty(4, R, DV, device=DEVICE)
    _monoid_probe[(1,)](m.contiguous(), s.contiguous(), w.contiguous(), out_m, out_s, out_w, R=R, DV=DV)
    for slot in (0, 1):  # e (+) a == a (+) e == a exactly
        assert torch.equal(out_m[slot], m[0]) and torch.equal(out_s[slot], s[0])
        assert torch.equal(out_w[slot], w[0])
    torch.testing.assert_close(out_m[2], out_m[3], rtol=0, atol=0)
    torch.testing.assert_close(out_s[2], out_s[3], rtol=1e-6, atol=0)
    torch.testing.assert_close(out_w[2], out_w[3], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------- the matrix

SHAPES = [
    # B, H, Nq, Nk, D, Dv, causal
    (1, 3, 17, 17, 40, 40, False),
    (2, 2, 113, 203, 72, 72, False),
    (1, 2, 1, 239, 32, 32, False),
    (1, 1, 97, 97, 111, 111, True),
    (2, 1, 113, 50, 16, 24, True),  # Nq > Nk causal: the first 63 rows see nothing
    (1, 2, 3, 199, 59, 80, True),  # Nq < Nk causal
    (1, 5, 129, 128, 64, 64, False),
]


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:6])) + ("c" if s[6] else ""))
def test_fp32_matches_float64(shape, precision):
    B, H, Nq, Nk, D, Dv, causal = shape
    q, k, v = qkv(B, H, Nq, Nk, D, Dv, seed=sum(shape))
    out, lse = elsa_fwd(q, k, v, causal=causal, precision=precision)
    assert out.shape == (B, H, Nq, Dv) and out.dtype == torch.float32 and lse.shape == (B, H, Nq)
    assert relerr(out, ref64(q, k, v, causal=causal)) <= FP32_ACCURATE
    assert_lse(lse, scan64(q, k, v, causal=causal)[1])
    if causal and Nq > Nk:
        assert bool((out[:, :, : Nq - Nk] == 0).all()) and bool((lse[:, :, : Nq - Nk] == -math.inf).all())


@pytest.mark.parametrize("precision", ["auto", "tf32x3", "fp16x3", "tf32"])
@pytest.mark.parametrize("causal", [False, True])
def test_fp32_precisions(precision, causal):
    q, k, v = qkv(2, 3, 77, 131, 40, seed=11)
    out, _ = elsa_fwd(q, k, v, causal=causal, precision=precision)
    bound = TF32_BOUND if precision == "tf32" else FP32_ACCURATE
    assert relerr(out, ref64(q, k, v, causal=causal)) <= bound


# q, k, v magnitudes (q and k reciprocal so that the logits stay of order one): "fp16x3" scales every tile
# by a power of two into float16 range, so the whole float32 range must come out FP32-accurate.
RANGES = [(1e-20, 1e20, 1e-30), (1e20, 1e-20, 1e30), (1e-3, 1e-3, 1e-38), (1.0, 1.0, 1e37)]


@pytest.mark.parametrize("precision", ["ieee", "fp16x3", "tf32x3"])
@pytest.mark.parametrize("mags", RANGES, ids=lambda m: "q{:g}-k{:g}-v{:g}".format(*m))
def test_fp32_input_ranges(mags, precision):
    if precision == "tf32x3" and DEVICE == "cuda" and min(mags) < torch.finfo(torch.float32).tiny:
        # Measured on an H100: relerr 3.6e-4 with values of 1e-38 (the CPU interpreter multiplies exactly).
        pytest.skip("TF32 tensor cores flush subnormal operands to zero: tf32x3 does not resolve "
                    "inputs below float32's normal range (fp16x3 and ieee do)")
    q, k, v = qkv(1, 2, 97, 97, 64, seed=12)
    q, k, v = q * mags[0], k * mags[1], v * mags[2]
    out, _ = elsa_fwd(q, k, v, precision=precision)
    assert relerr(out, ref64(q, k, v)) <= FP32_ACCURATE


@pytest.mark.parametrize("precision", ["ieee", "fp16x3", "tf32x3"])
def test_fp32_mixed_magnitudes_in_one_tile(precision):
    # Rows of q and k spread over 1e-6..1e3 and values over 1e-8..1e8 inside every tile: one power-of-two
    # scale per tile must still leave each element 22 significant bits (or an error far below the tile's
    # largest contribution).
    q, k, v = qkv(1, 2, 97, 97, 64, seed=13)
    q = q * 10 ** (torch.rand(1, 2, 97, 1, generator=gen(1)) * 9 - 6).to(DEVICE)
    k = k * 10 ** (torch.rand(1, 2, 97, 1, generator=gen(2)) * 9 - 6).to(DEVICE)
    v = v * 10 ** (torch.rand(1, 2, 97, 64, generator=gen(3)) * 16 - 8).to(DEVICE)
    out, _ = elsa_fwd(q, k, v, precision=precision)
    assert relerr(out, ref64(q, k, v)) <= FP32_ACCURATE


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 97, 97, 64, 64, False), (1, 2, 45, 130, 72, 40, True)])
def test_half_precision(dtype, shape):
    B, H, Nq, Nk, D, Dv, causal = shape
    q, k, v = qkv(B, H, Nq, Nk, D, Dv, seed=5, dtype=dtype)
    out, lse = elsa_fwd(q, k, v, causal=causal)
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert_low_precision(out, q, k, v, causal=causal)


# ------------------------------------------------------------------------------------ bias and masks


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("bshape", [(1, 3, 37, 70), (2, 1, 1, 70), (37, 70), (2, 3, 37, 1)])
def test_bias_broadcast(bshape, precision):
    q, k, v = qkv(2, 3, 37, 70, 32, seed=21)
    bias = randn(*bshape, seed=3)
    out, lse = elsa_fwd(q, k, v, attn_bias=bias, precision=precision)
    assert relerr(out, ref64(q, k, v, attn_bias=bias)) <= FP32_ACCURATE
    assert_lse(lse, scan64(q, k, v, attn_bias=bias)[1])


def test_bias_stride0_view_equals_contiguous():
    q, k, v = qkv(2, 3, 37, 70, 32, seed=22)
    rel = randn(1, 3, 37, 70, seed=4)
    view = rel.expand(2, 3, 37, 70)
    assert view.stride(0) == 0
    a, _ = elsa_fwd(q, k, v, attn_bias=view, precision="ieee")
    b, _ = elsa_fwd(q, k, v, attn_bias=view.contiguous(), precision="ieee")
    assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_neg_inf_bias_bands_and_fully_masked_rows(precision):
    B, H, Nq, Nk, D = 1, 2, 41, 90, 32
    q, k, v = qkv(B, H, Nq, Nk, D, seed=31)
    bias = randn(1, H, Nq, Nk, seed=5)
    bias[..., 10:40] = -math.inf  # a band of hidden keys
    bias[:, :, 5] = -math.inf  # row 5 sees nothing
    bias[:, 1, 20:23] = -math.inf  # rows 20-22 of head 1 see nothing
    out, lse = elsa_fwd(q, k, v, attn_bias=bias, precision=precision)
    assert torch.isfinite(out).all()
    assert bool((out[:, :, 5] == 0).all()) and bool((out[:, 1, 20:23] == 0).all())
    assert bool((lse[:, :, 5] == -math.inf).all())
    assert relerr(out, ref64(q, k, v, attn_bias=bias)) <= FP32_ACCURATE
    assert_lse(lse, scan64(q, k, v, attn_bias=bias)[1])


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_finfo_min_and_extreme_bias(precision):
    q, k, v = qkv(1, 2, 33, 70, 32, seed=32)
    bias = randn(1, 2, 33, 70, seed=6) * 1e4
    bias[..., :20] = torch.finfo(torch.float32).min
    bias[:, :, 3] = torch.finfo(
        torch.float32
    ).min  # a whole row at finfo.min: uniform weights, as the reference
    bias[:, :, 4, 30:] = -100.0  # Swin's shift-mask value
    out, lse = elsa_fwd(q, k, v, attn_bias=bias, precision=precision)
    ref = ref64(q, k, v, attn_bias=bias)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert relerr(out, ref) <= FP32_ACCURATE
    torch.testing.assert_close(out[:, :, 3].double(), v.double().mean(-2), rtol=0, atol=1e-6)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_key_padding_mask_and_fully_masked_batch(precision):
    B, H, Nq, Nk, D = 3, 2, 29, 83, 40
    q, k, v = qkv(B, H, Nq, Nk, D, seed=41)
    kpm = torch.rand(B, Nk, generator=gen(7)) > 0.3
    kpm[1] = False  # batch 1 sees no key at all
    kpm = kpm.to(DEVICE)
    out, lse = elsa_fwd(q, k, v, key_padding_mask=kpm, precision=precision)
    assert bool((out[1] == 0).all()) and bool((lse[1] == -math.inf).all())
    assert relerr(out, ref64(q, k, v, key_padding_mask=kpm)) <= FP32_ACCURATE
    assert_lse(lse, scan64(q, k, v, key_padding_mask=kpm)[1])


# Nq 45: one query tile per head (fp16x3 splits keys and values in its loop); 97: two (the pre-pass).
@pytest.mark.parametrize("Nq", [45, 97])
@pytest.mark.parametrize("precision", ["auto", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("partitions", [1, 3])
def test_nan_in_masked_keys_and_tail_does_not_leak(causal, partitions, precision, Nq):
    B, H, Nk, D, pad = 2, 2, 77, 40, 19
    q, k_big, v_big = qkv(B, H, Nq, Nk + pad, D, seed=51)
    q = q[:, :, :Nq]
    kpm = (torch.rand(B, Nk, generator=gen(8)) > 0.25).to(DEVICE)
    kpm[:, -1] = True
    k_clean, v_clean = k_big[:, :, :Nk].clone(), v_big[:, :, :Nk].clone()
    poison = torch.zeros(B, 1, Nk + pad, 1, dtype=torch.bool, device=DEVICE)
    poison[:, :, :Nk, :] = ~kpm[:, None, :, None]
    poison[:, :, Nk:] = True  # the out-of-range tail of the storage
    k_big = k_big.masked_fill(poison, math.nan)
    v_big = v_big.masked_fill(poison, math.nan)
    k, v = k_big[:, :, :Nk], v_big[:, :, :Nk]  # views: the NaN tail lies right behind the last key
    kw = dict(key_padding_mask=kpm, causal=causal, partitions=partitions, precision=precision)
    out_p, lse_p = elsa_fwd(q, k, v, **kw)
    out_c, lse_c = elsa_fwd(q, k_clean, v_clean, **kw)
    assert torch.isfinite(out_p).all()
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    assert relerr(out_c, ref64(q, k_clean, v_clean, key_padding_mask=kpm, causal=causal)) <= FP32_ACCURATE


# A hidden key contributes nothing, whatever its key and value rows hold; a visible key's NaN logit makes its
# row NaN, its non-finite values reach their own columns (the rule of kernels/reference.py).


@pytest.mark.parametrize("Nq", [45, 97])  # one query tile per head, two (fp16x3: in the loop, the pre-pass)
@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("partitions", [1, 3])
def test_hidden_nonfinite_keys_and_values_contribute_nothing(kind, precision, partitions, Nq):
    q, k, v, kw = nonfinite_case(kind, 1, 2, Nq, 77, 24, Dv=40, seed=61)
    out, lse = elsa_fwd(q, k, v, precision=precision, partitions=partitions, **kw)
    assert_nonfinite_like(out, spec64(q, k, v, **kw), FP32_ACCURATE)
    _, lse_ref = scan64(q, k, v, **kw)
    assert torch.equal(torch.isnan(lse), torch.isnan(lse_ref))


@pytest.mark.parametrize("Nq", [37, 97])  # one query tile per head, two (fp16x3: in the loop, the pre-pass)
@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
@pytest.mark.parametrize("partitions", [1, 2])
def test_visible_nonfinite_values_reach_only_their_columns(precision, partitions, Nq):
    q, k, v = qkv(1, 2, Nq, 70, 24, seed=63)
    v[..., 3, 1] = math.nan
    v[..., 5, 2] = math.inf
    v[..., 66, 3] = -math.inf
    v[..., 5, 4] = math.inf
    v[..., 66, 4] = -math.inf  # both signs meet: NaN
    out, _ = elsa_fwd(q, k, v, precision=precision, partitions=partitions)
    ref = ref64(q, k, v)  # no hidden key: the textbook softmax is the reference
    assert bool(torch.isnan(ref[..., [1, 4]]).all()) and bool(torch.isposinf(ref[..., 2]).all())
    assert_nonfinite_like(out, ref, FP32_ACCURATE)
    q2 = q.clone()
    q2[..., 7, 0] = math.nan  # a NaN query: its row is NaN, the others are untouched
    out, _ = elsa_fwd(q2, k, v, precision=precision, partitions=partitions)
    assert_nonfinite_like(out, ref64(q2, k, v), FP32_ACCURATE)


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_plus_inf_bias_makes_its_row_nan(precision):
    # As softmax: a +inf logit gives exp(inf - inf) = NaN (it is not clamped to a finite bias).
    q, k, v = qkv(1, 2, 29, 50, 16, seed=64)
    bias = randn(1, 2, 29, 50, seed=65)
    bias[..., 3, 7] = math.inf
    bias[:, 1, 11, :] = math.inf
    out, lse = elsa_fwd(q, k, v, attn_bias=bias, precision=precision)
    ref = ref64(q, k, v, attn_bias=bias)
    assert bool(torch.isnan(ref[..., 3, :]).all())
    assert_nonfinite_like(out, ref, FP32_ACCURATE)
    assert torch.equal(torch.isnan(lse), torch.isnan(ref).any(-1))


def test_fp16x3_nonfinite_key_hidden_from_a_whole_tile_keeps_the_scale():
    # Nq > Nk, causal: the first query tile (64 rows) sees keys 0-3 only, so key 10 lies in its masked tile
    # hidden from all of its rows; its infinities must not set that tile's split scale (which would flush
    # the other keys' logits to 0 without any NaN to show for it). Under the float16 split a non-finite key
    # entry gives NaN logits: the rows of the second tile that see key 10 are NaN, the others exact.
    q, k, v = qkv(1, 1, 100, 40, 32, seed=66)
    k[..., 10, 0] = math.inf
    k[..., 10, 1] = -math.inf
    out, _ = elsa_fwd(q, k, v, causal=True, precision="fp16x3")
    ref = spec64(q, k, v, causal=True)
    assert bool((out[..., :60, :] == 0).all())
    assert relerr(out[..., 60:70, :], ref[..., 60:70, :]) <= FP32_ACCURATE
    assert bool(torch.isnan(out[..., 70:, :]).all())


def test_fp16x3_nonfinite_query_row_keeps_the_scale():
    q, k, v = qkv(1, 2, 40, 50, 32, seed=67)
    q[..., 6, 2] = math.inf
    out, _ = elsa_fwd(q, k, v, precision="fp16x3")
    assert bool(torch.isnan(out[..., 6, :]).all())
    rows = [i for i in range(40) if i != 6]
    assert relerr(out[..., rows, :], ref64(q, k, v)[..., rows, :]) <= FP32_ACCURATE


@pytest.mark.parametrize("causal", [False, True])
def test_fp16x3_keys_and_values_split_once_or_in_the_loop(monkeypatch, causal):
    # The same forward with the keys and values split by the pre-pass (the default) and in the loop:
    # both within FP32 accuracy of float64, with a bias, a padding mask and key partitions.
    from elsa_vision.kernels import fwd

    q, k, v = qkv(2, 2, 70, 150, 40, seed=71)
    bias = randn(2, 1, 70, 150, seed=72)
    kpm = (torch.rand(2, 150, generator=gen(9)) > 0.3).to(DEVICE)
    ref = ref64(q, k, v, attn_bias=bias, key_padding_mask=kpm, causal=causal)
    outs = []
    for min_keys in (0, 1 << 40):
        monkeypatch.setattr(fwd, "PRESPLIT_MIN_KEYS", min_keys)
        fwd._plan_cached.cache_clear()
        fwd._PROGRAMS.clear()
        assert fwd.plan(2, 2, 70, 150, 40, 40, torch.float32, causal, device=q.device, precision="fp16x3",
                        has_bias=True).presplit == (min_keys == 0)
        for partitions in (1, 3):
            out, _ = elsa_fwd(q, k, v, attn_bias=bias, key_padding_mask=kpm, causal=causal,
                              partitions=partitions, precision="fp16x3")
            assert relerr(out, ref) <= FP32_ACCURATE, (min_keys, partitions)
            outs.append(out)
    fwd._plan_cached.cache_clear()
    fwd._PROGRAMS.clear()
    assert relerr(outs[0], outs[2]) <= FP32_ACCURATE


@pytest.mark.parametrize("nq", [1, 37, 64])
def test_fp16x3_heads_of_one_query_tile_split_in_the_loop(nq):
    # At most PRESPLIT_MAX_ONE_TILE queries per head: no pre-pass, the loop splits each key tile it reads
    # (once); FP32-accurate against float64 with a bias, a padding mask and key partitions.
    from elsa_vision.kernels import fwd

    q, k, v = qkv(2, 3, nq, 150, 40, seed=74)
    bias = randn(2, 1, nq, 150, seed=75)
    kpm = (torch.rand(2, 150, generator=gen(11)) > 0.3).to(DEVICE)
    ref = ref64(q, k, v, attn_bias=bias, key_padding_mask=kpm)
    for partitions in (1, 3):
        program = fwd.fwd_program(q, k, v, bias, kpm, False, 40 ** -0.5, "fp16x3", partitions)
        assert program.split is None
        out, _ = elsa_fwd(q, k, v, attn_bias=bias, key_padding_mask=kpm, partitions=partitions,
                          precision="fp16x3")
        assert relerr(out, ref) <= FP32_ACCURATE, partitions


def test_fp16x3_split_values_keep_each_key_tiles_own_scale():
    # The pre-split values carry one power of two per key tile and value column: keys 0-63 hold values
    # near 1e6 and the rest near 1e-6. A row that cannot see the large keys (padding mask of batch 0,
    # causality) must keep FP32 accuracy on its small values, which one scale per column over the whole
    # sequence would flush (2^-25 of 1e6 is about 3e-2). Keys get one scale per row: their rows spread
    # over 1e-4 .. 1e4.
    q, k, v = qkv(2, 1, 96, 200, 64, seed=73)
    v[:, :, :64] *= 1e6
    v[:, :, 64:] *= 1e-6
    k = k * 10 ** (torch.rand(2, 1, 200, 1, generator=gen(10)) * 8 - 4).to(DEVICE)
    kpm = torch.ones(2, 200, dtype=torch.bool, device=DEVICE)
    kpm[0, :64] = False
    out, _ = elsa_fwd(q, k, v, key_padding_mask=kpm, precision="fp16x3")
    ref = ref64(q, k, v, key_padding_mask=kpm)
    assert relerr(out[0], ref[0]) <= FP32_ACCURATE
    assert relerr(out[1], ref[1]) <= FP32_ACCURATE


@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
@pytest.mark.parametrize("mult", [30.0, 100.0])
def test_large_magnitude_inputs(mult, precision):
    q, k, v = qkv(1, 2, 67, 67, 64, seed=61, scale=mult)
    out, lse = elsa_fwd(q, k, v, precision=precision)
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    ref = ref64(q, k, v)
    # Logits of size ~1e4 carry an fp32 rounding of ~1e-3 in the exponent: judge against fp32 torch math.
    base = relerr(softmax_attention(q, k, v), ref)
    assert relerr(out, ref) <= 2 * base + FP32_ACCURATE
    assert_lse(lse, scan64(q, k, v)[1])
    const = torch.full((1, 1, 20, 64), 1e3, device=DEVICE)
    out_c, _ = elsa_fwd(const, const, randn(1, 1, 20, 64, seed=9), precision=precision)
    assert torch.isfinite(out_c).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_qkv_views_bitwise_equal_contiguous(dtype):
    B, N, H, D = 2, 53, 3, 40
    q, k, v = fused_qkv_views(B, N, H, D, seed=71, dtype=dtype)
    assert not q.is_contiguous()
    a, la = elsa_fwd(q, k, v, causal=True)
    b, lb = elsa_fwd(q.contiguous(), k.contiguous(), v.contiguous(), causal=True)
    assert torch.equal(a, b) and torch.equal(la, lb)
    kt = k.transpose(-1, -2).contiguous().transpose(-1, -2)  # D-major keys
    c, _ = elsa_fwd(q, kt, v, causal=True)
    assert torch.equal(a, c)


@pytest.mark.parametrize("precision", ["auto", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("D", [40, 72, 111])
def test_odd_head_dims_deterministic(D, precision):
    q, k, v = qkv(1, 2, 45, 61, D, seed=D)
    a, _ = elsa_fwd(q, k, v, precision=precision)
    b, _ = elsa_fwd(q, k, v, precision=precision)
    assert torch.equal(a, b)
    assert relerr(a, ref64(q, k, v)) <= FP32_ACCURATE


def test_empty_keys_and_length_one():
    q, k, v = qkv(1, 2, 5, 0, 32, seed=3)
    out, lse = elsa_fwd(q, k, v)
    assert bool((out == 0).all()) and bool((lse == -math.inf).all())
    # One key: its weight is exactly 1. The no-tensor-core path returns v bitwise; the float32 tensor-core
    # paths carry v through the hi/lo split of tf32x3 (FP32-accurate, not bitwise).
    q, k, v = qkv(2, 1, 1, 1, 16, seed=4)
    out, _ = elsa_fwd(q, k, v, precision="ieee")
    assert torch.equal(out, v)
    for precision in ("auto", "tf32x3", "fp16x3"):
        out, _ = elsa_fwd(q, k, v, precision=precision)
        assert relerr(out, v) <= FP32_ACCURATE


# ----------------------------------------------------------------------------- two levels, plan


def test_plan_structure():
    p = plan(1, 8, 16384, 16384, 64, 64, torch.float32, sm_count=132)
    assert p.partitions == 1 and p.tree_depth == 0
    assert p.merge_depth == merge_depth(16384, p.block_n)
    p = plan(1, 2, 256, 16384, 64, 64, torch.float32, sm_count=132)
    assert p.partitions > 1 and p.tree_depth == math.ceil(math.log2(p.partitions))
    per_part = p.workspace_bytes // p.partitions
    assert per_part == 4 * 2 * 256 * (p.block_dv + 2)
    with pytest.raises(TypeError, match="dtype"):
        plan(1, 1, 8, 8, 8, 8, torch.float64)


def test_forced_partitions_report_their_workspace():
    from elsa_vision.kernels.fwd import fwd_program

    q, k, v = qkv(1, 3, 70, 333, 48, 40, seed=83)
    fused = fwd_program(q, k, v, None, None, False, 48 ** -0.5, "auto", partitions=1).plan
    split = fwd_program(q, k, v, None, None, False, 48 ** -0.5, "auto", partitions=3).plan
    assert fused.partitions == 1 and fused.workspace_bytes == 0
    assert split.partitions == 3 and split.tree_depth == 2
    assert split.workspace_bytes == 4 * 3 * 70 * (split.block_dv + 2) * 3


@pytest.mark.parametrize("precision", ["auto", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("partitions", [2, 5])
def test_multi_partition_equals_fused(causal, partitions, precision):
    q, k, v = qkv(1, 3, 70, 333, 48, 40, seed=81)
    bias = randn(1, 3, 1, 333, seed=10)
    fused, lf = elsa_fwd(q, k, v, attn_bias=bias, causal=causal, partitions=1, precision=precision)
    split, ls = elsa_fwd(q, k, v, attn_bias=bias, causal=causal, partitions=partitions, precision=precision)
    ref = ref64(q, k, v, attn_bias=bias, causal=causal)
    assert relerr(split, ref) <= FP32_ACCURATE and relerr(fused, ref) <= FP32_ACCURATE
    assert (split - fused).abs().max().item() <= 1e-6
    assert_lse(ls, scan64(q, k, v, attn_bias=bias, causal=causal)[1])


@pytest.mark.parametrize("precision", ["tf32x3", "fp16x3"])
def test_long_key_range_folds_in_segments(precision, monkeypatch):
    # Past two segments' keys (monoid.SEGMENT_KEYS) the unmasked tiles fold in segments merged into the
    # running state (a two-level sum): full segments, a short one, then the masked tail; with a bias and a
    # padding mask, causal, and two key partitions (each two segments and a bit). Under the interpreter the
    # segments are 256 keys long (the kernel's SEGMENT constexpr, the same code; 17,084 keys of the shipped
    # 8,192-key segments take minutes there); a GPU runs the shipped length, and
    # test_gpu_error_flat_in_the_key_count its accuracy at 262,144 keys.
    seg = segment_keys(precision, 64, 10**9)
    assert seg > 0 and segment_keys(precision, 64, 2 * seg + 700) == seg
    assert segment_keys(precision, 64, 2 * seg) == 0
    if DEVICE == "cpu":
        monkeypatch.setitem(fwd_module.SEGMENT_KEYS, precision, 256)
        monkeypatch.setattr(fwd_module, "_PROGRAMS", ProgramCache())  # programs built with other segments
        seg = segment_keys(precision, 64, 10**9)
        assert seg == 256
    Nk = 2 * seg + 700
    q, k, v = qkv(1, 2, 21, Nk, 32, seed=41)
    bias = randn(1, 2, 21, Nk, seed=42)
    kpm = torch.rand(1, Nk, generator=gen(43)).to(DEVICE) > 0.2
    for kw, partitions in ((dict(attn_bias=bias, key_padding_mask=kpm), None), (dict(causal=True), None),
                           (dict(attn_bias=bias), 2)):
        out, lse = elsa_fwd(q, k, v, precision=precision, partitions=partitions, **kw)
        assert relerr(out, ref64(q, k, v, **kw)) <= FP32_ACCURATE, (kw.keys(), partitions)
        assert torch.isfinite(lse).all()


@pytest.mark.parametrize("partitions", [None, 3])
def test_partial_program_float32_out_float64_lse(partitions):
    # Context parallelism's partial results (fwd_program(partial=True)): the output in float32 whatever the
    # inputs' dtype, the lse in float64 formed from the row state. Under the interpreter (exact exponentials)
    # it is within 1e-7 of float64 on average where a float32 lse near ln(4500) = 8.4 is off by ~2.4e-7
    # (measured: 5e-8 against 2.4e-7). On a GPU the state's own normaliser carries the approximate exp2 of
    # every score (measured on an H100: 2.3e-7 against 3.3e-7 for the float32 lse), which the merges of the
    # ring transport unchanged; tests/kernels/test_merge.py checks the transport itself.
    q, k, v = qkv(1, 2, 21, 4500, 64, seed=44)
    lse_ref = torch.logsumexp((q.double() @ k.double().transpose(-1, -2)) * 0.125, -1)
    program = fwd_program(q, k, v, None, None, False, 0.125, "fp16x3", partitions, partial=True)
    out, lse = program(q, k, v, None, None)
    assert out.dtype == torch.float32 and lse.dtype == torch.float64
    assert relerr(out, ref64(q, k, v)) <= FP32_ACCURATE
    _, lse32 = elsa_fwd(q, k, v, precision="fp16x3", partitions=partitions)
    err64, err32 = (lse - lse_ref).abs().mean().item(), (lse32.double() - lse_ref).abs().mean().item()
    if DEVICE == "cpu":
        assert err64 <= 1e-7 and err64 < err32 / 2, (err64, err32)
    else:
        assert err64 <= 3e-7 and err64 < err32, (err64, err32)
    # hidden rows: lse -inf, out 0
    kpm = torch.zeros(1, 4500, dtype=torch.bool, device=DEVICE)
    program = fwd_program(q, k, v, None, kpm, False, 0.125, "fp16x3", partitions, partial=True)
    out, lse = program(q, k, v, None, kpm)
    assert torch.isneginf(lse).all() and (out == 0).all()
    # bfloat16 inputs: one rounding of the output, into float32
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    program = fwd_program(qb, kb, vb, None, None, False, 0.125, "auto", partitions, partial=True)
    out, lse = program(qb, kb, vb, None, None)
    assert out.dtype == torch.float32
    assert relerr(out, ref64(qb, kb, vb)) <= relerr(elsa_fwd(qb, kb, vb)[0], ref64(qb, kb, vb))


def test_plan_on_sm90_picks_fp16x3_without_narrow_value_tiles(monkeypatch):
    # The planner as it runs on an H100 (132 SMs, sm90, 227 KiB shared memory per block), without one.
    from elsa_vision.kernels import fwd, host

    monkeypatch.setattr(host, "_device_info", lambda device=None: (132, (9, 0), 232448))
    p = fwd._plan(1, 8, 16384, 16384, 64, 64, torch.float32)
    assert p.precision == "fp16x3" and p.presplit
    assert (p.block_m, p.block_n, p.num_warps, p.num_stages) == (128, 128, 8, 3)
    # the packed (varlen) layout splits in its loop, with that loop's tiles
    p = fwd._plan(1, 8, 16384, 16384, 64, 64, torch.float32, varlen=True)
    assert p.precision == "fp16x3" and not p.presplit
    assert (p.block_m, p.block_n, p.num_warps, p.num_stages) == (128, 64, 4, 3)
    # a head whose queries fit one tile reads each key tile once: no pre-pass (one launch, not two)
    for nq, presplit in ((1, False), (64, False), (65, True), (197, True)):
        p = fwd._plan(4, 12, nq, 197, 64, 64, torch.float32)
        assert p.precision == "fp16x3" and p.presplit == presplit, nq
    assert fwd._plan(1, 8, 4096, 4096, 128, 128, torch.float32).precision == "fp16x3"
    assert fwd._plan(1, 8, 4096, 4096, 256, 256, torch.float32).precision == "tf32x3"  # > 128: unmeasured
    assert fwd._plan(1, 8, 4096, 4096, 64, 64, torch.float32, precision="tf32x3").precision == "tf32x3"
    assert fwd._plan(1, 8, 4096, 4096, 256, 64, torch.float32, precision="fp16x3").precision == "tf32x3"
    assert fwd._plan(1, 8, 4096, 4096, 64, 64, torch.bfloat16).precision == "none"
    # value tiles narrower than 64 take 32-key tiles (Triton 3.6 miscompiles wider ones with fp16x3)
    for D, Dv in ((64, 32), (40, 24), (16, 16)):
        assert fwd._plan(2, 3, 1000, 1000, D, Dv, torch.float32).block_n == 32
    # sm80/sm89 keep tf32x3 under "auto"
    monkeypatch.setattr(host, "_device_info", lambda device=None: (108, (8, 0), 166912))
    assert fwd._plan(1, 8, 4096, 4096, 64, 64, torch.float32).precision == "tf32x3"


def test_plan_on_sm90_at_vit_lengths(monkeypatch):
    # Half precision at 129-256 query rows (ViT at 224 px: 197 tokens) takes 64 x 32 tiles on 4 warps, 3
    # stages (docs/kernel_notes.md, "ViT lengths"); 257-1024 rows 64 x 64; longer calls 128 x 64 on 4 stages.
    from elsa_vision.kernels import fwd, host

    monkeypatch.setattr(host, "_device_info", lambda device=None: (132, (9, 0), 232448))

    def tiles(B, H, N, dtype=torch.bfloat16, D=64):
        p = fwd._plan(B, H, N, N, D, D, dtype)
        return p.block_m, p.block_n, p.num_warps, p.num_stages

    assert tiles(64, 12, 197) == tiles(16, 12, 145) == tiles(8, 12, 256, torch.float16) == (64, 32, 4, 3)
    assert tiles(8, 12, 785) == (64, 64, 4, 3)
    assert tiles(1, 8, 4096) == (128, 64, 4, 4)
    assert tiles(64, 12, 197, D=128) == (128, 128, 8, 3)  # head dim 128: unchanged
    assert tiles(64, 12, 197, torch.float32)[:2] == (64, 64)  # float32: its own rules


# ------------------------------------------------------------------------------------------ varlen


@pytest.mark.parametrize("precision", ["auto", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_per_sequence(causal, precision):
    H, D, Dv = 3, 40, 24
    lq, lk = [17, 1, 0, 45], [30, 7, 5, 45]
    q = randn(sum(lq), H, D, seed=91)
    k = randn(sum(lk), H, D, seed=92)
    v = randn(sum(lk), H, Dv, seed=93)
    cu_q = torch.tensor([0] + list(torch.tensor(lq).cumsum(0)), dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0] + list(torch.tensor(lk).cumsum(0)), dtype=torch.int32, device=DEVICE)
    out, lse = elsa_fwd_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, precision=precision)
    assert out.shape == (sum(lq), H, Dv) and lse.shape == (H, sum(lq))
    cq, ck = cu_q.tolist(), cu_k.tolist()
    for i in range(len(lq)):
        if lq[i] == 0:
            continue
        qi, ki, vi = (
            t.transpose(0, 1)[None]
            for t in (q[cq[i] : cq[i + 1]], k[ck[i] : ck[i + 1]], v[ck[i] : ck[i + 1]])
        )
        ref = ref64(qi, ki, vi, causal=causal)[0].transpose(0, 1)
        assert relerr(out[cq[i] : cq[i + 1]], ref) <= FP32_ACCURATE
        assert_lse(lse[:, cq[i] : cq[i + 1]], scan64(qi, ki, vi, causal=causal)[1][0])
    public = elsa_attention_varlen(q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="triton",
                                   precision=precision)
    torch.testing.assert_close(public, out, rtol=0, atol=0)
    torch_backend = elsa_attention_varlen(
        q, k, v, cu_q, cu_k, max(lq), max(lk), causal=causal, backend="torch"
    )
    assert relerr(out, torch_backend.double()) <= 2 * FP32_ACCURATE


def test_varlen_hidden_nonfinite_values_contribute_nothing():
    # Causal within each packed sequence: a later key of the same sequence, and the keys of the next
    # sequence (read through the same tile), are hidden.
    H, D = 2, 16
    lq = lk = [20, 33]
    q = randn(sum(lq), H, D, seed=96)
    k = randn(sum(lk), H, D, seed=97)
    v = randn(sum(lk), H, D, seed=98)
    k[15, :, 0] = math.nan
    v[15, :, :] = math.nan
    v[30, :, 1] = math.inf
    cu = torch.tensor([0, 20, 53], dtype=torch.int32, device=DEVICE)
    out, _ = elsa_fwd_varlen(q, k, v, cu, cu, 33, 33, causal=True, precision="ieee")
    for a, b in ((0, 20), (20, 53)):
        qi, ki, vi = (t[a:b].transpose(0, 1)[None] for t in (q, k, v))
        assert_nonfinite_like(out[a:b], spec64(qi, ki, vi, causal=True)[0].transpose(0, 1), FP32_ACCURATE)
    assert torch.isfinite(out[:15]).all() and torch.isfinite(out[20:30]).all()


def test_public_api_routes_to_kernel():
    q, k, v = qkv(2, 2, 31, 47, 32, seed=95)
    kpm = torch.ones(2, 47, dtype=torch.bool, device=DEVICE)
    kpm[0, 40:] = False
    out = elsa_attention(q, k, v, key_padding_mask=kpm, causal=True, backend="triton")
    direct, _ = elsa_fwd(q, k, v, key_padding_mask=kpm, causal=True)
    assert torch.equal(out, direct)
    ref = elsa_attention(q, k, v, key_padding_mask=kpm, causal=True, backend="torch")
    assert relerr(out, ref.double()) <= 2 * FP32_ACCURATE


# ------------------------------------------------------------------------------------------- errors


def test_bad_inputs():
    # The launchers trust their inputs: elsa_attention (the public entry) checks them, once.
    q, k, v = qkv(1, 2, 8, 9, 16, seed=1)

    def fwd(q, k, v, **kw):
        return elsa_attention(q, k, v, backend="triton", **kw)

    with pytest.raises(ValueError, match="rank 4"):
        fwd(q[0], k, v)
    with pytest.raises(TypeError, match="share one dtype"):
        fwd(q, k.half(), v)
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        fwd(q.double(), k.double(), v.double())
    with pytest.raises(ValueError, match="head dim D of k"):
        fwd(q, k[..., :8], v)
    with pytest.raises(ValueError, match="same length Nk"):
        fwd(q, k, v[:, :, :5])
    with pytest.raises(ValueError, match="precision"):
        fwd(q, k, v, precision="fp8")
    with pytest.raises(ValueError, match="not broadcastable"):
        fwd(q, k, v, attn_bias=randn(3, 8, 9))
    with pytest.raises(TypeError, match="key_padding_mask"):
        fwd(q, k, v, key_padding_mask=torch.ones(1, 9, device=DEVICE))
    with pytest.raises(ValueError, match=r"\[B, Nk\]"):
        fwd(q, k, v, key_padding_mask=torch.ones(1, 8, dtype=torch.bool, device=DEVICE))
    with pytest.raises(TypeError, match="causal"):
        fwd(q, k, v, causal=1)
    with pytest.raises(ValueError, match="head dims up to 256"):
        fwd(randn(1, 1, 4, 264), randn(1, 1, 4, 264), randn(1, 1, 4, 8))
    qv, kv, vv = randn(10, 2, 16), randn(12, 2, 16), randn(12, 2, 16)
    cu = torch.tensor([0, 4, 10], dtype=torch.int32, device=DEVICE)
    cuk = torch.tensor([0, 5, 12], dtype=torch.int32, device=DEVICE)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        elsa_attention_varlen(qv, kv, vv, cu.float(), cuk, 6, 7)
    if DEVICE == "cpu":  # on CUDA the offsets' values are not read back (that would synchronise)
        with pytest.raises(ValueError, match="rise from 0"):
            elsa_attention_varlen(
                qv, kv, vv, cu, torch.tensor([0, 5, 11], dtype=torch.int32, device=DEVICE), 6, 7
            )
        with pytest.raises(ValueError, match="longest sequence"):
            elsa_attention_varlen(qv, kv, vv, cu, cuk, 5, 7)
    with pytest.raises(ValueError, match="rank 3"):
        elsa_attention_varlen(q, kv, vv, cu, cuk, 6, 7)
    with pytest.raises(TypeError, match="float64"):
        elsa_attention(q.double(), k.double(), v.double(), backend="triton")


# --------------------------------------------------------------------------- compiled without a GPU

_SM90_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from elsa_vision.kernels import fwd

names = fwd._fwd_kernel.arg_names
consts = dict(D=64, DV=64, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64, PRECISION="@PRECISION@",
              CAUSAL=True, HAS_BIAS=True, HAS_KPM=True, IS_VARLEN=False, SPLIT=False, ACCUMULATE="plain",
              STORE_LSE=True, SEGMENT=0, PRESPLIT=@PRESPLIT@,
              stride_qd=1, stride_kd=1, stride_vd=1)
sig = {n: "i32" for n in names}
sig.update({n: "*fp32" for n in ("Q", "K", "V", "Bias", "Out", "Lse", "WsM", "WsS", "WsW")})
sig.update({"Kpm": "*u8", "CuQ": "*i32", "CuK": "*i32", "qk_scale": "fp32", "KP": "*fp16", "VP": "*fp16",
            "KE": "*i32", "VE": "*i32", "Redo": "*i32"})
sig.update({n: "constexpr" for n in consts})
k = triton.compile(ASTSource(fn=fwd._fwd_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
ptx = k.asm["ptx"]
print(json.dumps({"shared": k.metadata.shared, "wgmma": "wgmma.mma_async" in ptx,
                  "cvt_tf32": "cvt.rna.tf32" in ptx, "wgmma_f16": ".f32.f16.f16" in ptx}))
"""


@pytest.mark.parametrize("presplit", [False, True])
def test_fp16x3_compiles_for_sm90_without_a_gpu(presplit):
    # "fp16x3" must reach the half-precision tensor cores: wgmma on float16 operands, no TF32 rounding, with
    # the keys and values split in the loop or beforehand (PRESPLIT).
    script = _SM90_COMPILE.replace("@PRECISION@", "fp16x3").replace("@PRESPLIT@", str(presplit))
    report = compile_for_sm90(script)
    assert 0 < report["shared"] <= 232448 and report["wgmma_f16"] and not report["cvt_tf32"], report


_SM90_HALF = r"""
import json
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from elsa_vision.kernels import fwd

report = {}
for defer in (False, True):
    consts = dict(D=64, DV=64, BLOCK_M=128, BLOCK_N=64, BLOCK_D=64, BLOCK_DV=64, PRECISION="none",
                  CAUSAL=False, HAS_BIAS=False, HAS_KPM=False, IS_VARLEN=False, SPLIT=False,
                  ACCUMULATE="plain", STORE_LSE=True, SEGMENT=0, PRESPLIT=False, DEFER_SCALE=defer,
                  stride_qd=1, stride_kd=1, stride_vd=1)
    sig = {n: "i32" for n in fwd._fwd_kernel.arg_names}
    sig.update({n: "*bf16" for n in ("Q", "K", "V", "Out")})
    sig.update({n: "*fp32" for n in ("Bias", "Lse", "WsM", "WsS", "WsW")})
    sig.update({"Kpm": "*u8", "CuQ": "*i32", "CuK": "*i32", "qk_scale": "fp32", "KP": "*fp16",
                "VP": "*fp16", "KE": "*i32", "VE": "*i32", "Redo": "*i32"})
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(ASTSource(fn=fwd._fwd_kernel, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 4})
    ptx = k.asm["ptx"]
    report[str(defer)] = {"mul": len(re.findall(r"\bmul(\.rn)?\.f32", ptx)), "ex2": ptx.count("ex2.approx"),
                          "fma": len(re.findall(r"\bfma\.rn\.f32", ptx)), "shared": k.metadata.shared}
print(json.dumps(report))
"""


def test_half_precision_scale_joins_the_exponent_on_sm90():
    # bf16 without a bias, compiled for an H100: with DEFER_SCALE the scores are not multiplied by qk_scale
    # one by one; the scale joins the exponent's subtraction in a fused multiply-add. Per thread of a
    # 128 x 64 tile on 4 warps, 64 scores per loop (two loops: unmasked and masked): at least 64 fewer
    # float32 multiplies, more FMAs, the same exp2 count.
    report = compile_for_sm90(_SM90_HALF)
    late, early = report["True"], report["False"]
    assert late["mul"] <= early["mul"] - 64 and late["fma"] > early["fma"], report
    assert late["ex2"] == early["ex2"] and 0 < late["shared"] <= 232448, report


# ------------------------------------------------------------------------------------------- GPU


def _rows_ref(q, k, v, rows, causal=False, attn_bias=None):
    """float64 reference for selected query rows (all keys): for shapes whose full reference is too big."""
    Nq, Nk = q.shape[-2], k.shape[-2]
    qs = q[..., rows, :].double()
    s = (qs @ k.double().transpose(-1, -2)) * q.shape[-1] ** -0.5
    if attn_bias is not None:
        s = s + attn_bias[..., rows, :].double()
    if causal:
        cols = torch.arange(Nk, device=q.device)
        s = s.masked_fill(cols[None, :] > (rows[:, None] + Nk - Nq), -math.inf)
    return torch.softmax(s, -1) @ v.double()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["auto", "ieee", "tf32x3", "fp16x3", "tf32"])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_fp32_precision_thresholds(precision, D):
    q, k, v = qkv(2, 4, 1023, 1025, D, seed=101)
    for causal in (False, True):
        out, _ = elsa_fwd(q, k, v, causal=causal, precision=precision)
        err = relerr(out, ref64(q, k, v, causal=causal))
        assert err <= (TF32_BOUND if precision == "tf32" else FP32_ACCURATE), (precision, causal, err)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "D,Dv",
    [(16, 16), (32, 32), (40, 24), (48, 48), (64, 32), (64, 64), (72, 72), (80, 80), (96, 96), (111, 111),
     (128, 128), (64, 128), (128, 64), (24, 64), (256, 256), (200, 40)],
)
def test_gpu_default_plan_head_dims(D, Dv):
    # The planner's default tiles for every head-dim pair (fp16x3 up to 128 on sm90, with the 32-key tiles
    # that avoid Triton's miscompiled narrow value tiles), plain and causal with a bias, Nk = Nq + 13.
    for N in (70, 300, 1000):
        q, k, v = qkv(2, 3, N, N + 13, D, Dv, seed=N + D)
        bias = randn(1, 3, N, N + 13, seed=D)
        for causal, b in ((False, None), (True, bias)):
            out, _ = elsa_fwd(q, k, v, attn_bias=b, causal=causal)
            err = relerr(out, ref64(q, k, v, attn_bias=b, causal=causal))
            assert err <= FP32_ACCURATE, (D, Dv, N, causal, err)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["auto", "ieee", "tf32x3", "fp16x3", "tf32"])
@pytest.mark.parametrize("D", [64, 72, 128])
def test_gpu_hidden_nonfinite_keys_and_values(precision, D):
    # The rule on the GPU's tiles, fused and split (a few rows: partitions), and the float16 split's scale
    # guard at a real query tile: Nq - Nk = 300 leaves keys in the masked tile of rows 256-383 that none of
    # those rows sees.
    bound = TF32_BOUND if precision == "tf32" else FP32_ACCURATE
    for kind in NONFINITE_KINDS:
        for Nq, Nk in ((197, 197), (785, 798), (7, 785)):
            q, k, v, kw = nonfinite_case(kind, 2, 3, Nq, Nk, D, seed=Nq + D)
            out, _ = elsa_fwd(q, k, v, precision=precision, **kw)
            assert_nonfinite_like(out, spec64(q, k, v, **kw), bound)
    q, k, v = qkv(1, 2, 400, 100, D, seed=D)
    k[..., 90, 0] = math.inf
    k[..., 90, 1] = -math.inf
    out, _ = elsa_fwd(q, k, v, causal=True, precision=precision)
    ref = spec64(q, k, v, causal=True)
    assert relerr(out[..., 300:390, :], ref[..., 300:390, :]) <= bound
    assert not torch.isfinite(out[..., 390:, :]).all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_hidden_nonfinite_half_precision(dtype):
    for kind in NONFINITE_KINDS:
        q, k, v, kw = nonfinite_case(kind, 2, 3, 785, 798, 64, seed=7, dtype=dtype)
        out, _ = elsa_fwd(q, k, v, **kw)
        assert_nonfinite_like(out, spec64(q, k, v, **kw), 2e-2)


@pytest.mark.gpu
def test_gpu_auto_is_tensor_core_path():
    p = plan(1, 8, 4096, 4096, 64, 64, torch.float32, device="cuda")
    major, _ = torch.cuda.get_device_capability()
    assert p.precision == ("fp16x3" if major == 9 else "tf32x3" if major >= 8 else "ieee")
    # head dims past 128: the float16 split is not used
    p = plan(1, 8, 4096, 4096, 256, 256, torch.float32, device="cuda")
    assert p.precision == ("tf32x3" if major >= 8 else "ieee")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_gpu_half_precision(dtype, D):
    q, k, v = qkv(2, 4, 1023, 1025, D, seed=102, dtype=dtype)
    for causal in (False, True):
        out, _ = elsa_fwd(q, k, v, causal=causal)
        assert_low_precision(out, q, k, v, causal=causal)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 72, 80, 96, 128])
def test_gpu_half_precision_vit_lengths(dtype, D):
    # 257..1024 query rows run 64-row tiles in half precision (ViT-B at 448 px: 785 tokens).
    B, H, N = 2, 3, 785
    assert plan(B, H, N, N, D, D, dtype, device="cuda").block_m == 64
    q, k, v = qkv(B, H, N, N, D, seed=105, dtype=dtype)
    bias = randn(1, H, N, N, seed=106, dtype=dtype)
    kpm = torch.rand(B, N, generator=gen(107)).to(DEVICE) > 0.1
    out, _ = elsa_fwd(q, k, v, attn_bias=bias, key_padding_mask=kpm)
    assert_low_precision(out, q, k, v, attn_bias=bias, key_padding_mask=kpm)


@pytest.mark.gpu
@pytest.mark.parametrize(
    "N,dtype,causal",
    [
        (3137, torch.float32, False),
        (16384, torch.float32, True),
        (2**16 + 1, torch.bfloat16, True),
        (2**16 + 1, torch.float32, False),
    ],
)
def test_gpu_large_lengths(N, dtype, causal):
    q, k, v = qkv(1, 2, N, N, 64, seed=103, dtype=dtype)
    out, lse = elsa_fwd(q, k, v, causal=causal)
    rows = torch.cat(
        [torch.arange(0, 64), torch.randint(0, N, (192,), generator=gen(1)), torch.arange(N - 64, N)]
    )
    rows = rows.to(DEVICE)
    ref = _rows_ref(q, k, v, rows, causal=causal)
    if dtype == torch.float32:
        assert relerr(out[..., rows, :], ref) <= FP32_ACCURATE
    else:
        assert (out[..., rows, :].double() - ref).abs().max().item() <= 2e-2
    assert torch.isfinite(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["fp16x3", "tf32x3"])
def test_gpu_error_flat_in_the_key_count(precision):
    # The segments' two-level sum (monoid.SEGMENT_KEYS) keeps the running sums' rounding from growing with
    # the tile count: one running sum over 4,096 key tiles would measure ~1.5e-6 at 262,144 keys.
    Nk = 2**18
    q, k, v = qkv(1, 2, 256, Nk, 64, seed=108)
    out, _ = elsa_fwd(q, k, v, precision=precision)
    rows = torch.arange(256, device=DEVICE)
    assert relerr(out, _rows_ref(q, k, v, rows)) <= 5e-7


@pytest.mark.gpu
def test_gpu_more_than_2_pow_31_elements():
    B, H, N, D = 8200, 16, 129, 128  # 2.17e9 elements of q
    assert B * H * N * D > 2**31
    q = torch.randn(B, H, N, D, device="cuda", dtype=torch.float16)
    k = torch.randn_like(q)
    v = torch.randn_like(q)
    out, _ = elsa_fwd(q, k, v)
    for b in (0, B // 2, B - 1):
        ref = softmax_attention(q[b : b + 1].double(), k[b : b + 1].double(), v[b : b + 1].double())
        assert (out[b : b + 1].double() - ref).abs().max().item() <= 2e-3
    del q, k, v, out
    torch.cuda.empty_cache()
    # A bias with more than 2**31 elements: row offsets of the bias need 64-bit arithmetic.
    H, N = 2, 33000
    q, k, v = qkv(1, H, N, N, 64, seed=104, dtype=torch.float16)
    bias = torch.randn(1, H, N, N, device="cuda", dtype=torch.float16)
    assert bias.numel() > 2**31
    out, _ = elsa_fwd(q, k, v, attn_bias=bias)
    rows = torch.tensor([0, 1, N // 2, N - 2, N - 1], device="cuda")
    ref = _rows_ref(q, k, v, rows, attn_bias=bias)
    assert (out[..., rows, :].double() - ref).abs().max().item() <= 2e-3


@pytest.mark.gpu
@pytest.mark.parametrize("partitions", [None, 4])
def test_gpu_race_bitwise_reruns(partitions):
    q, k, v = qkv(2, 8, 1537, 1537, 64, seed=105)
    kpm = torch.ones(2, 1537, dtype=torch.bool, device="cuda")
    kpm[1, 1000:] = False
    first, lse0 = elsa_fwd(q, k, v, key_padding_mask=kpm, causal=True, partitions=partitions)
    for _ in range(20):
        out, lse = elsa_fwd(q, k, v, key_padding_mask=kpm, causal=True, partitions=partitions)
        assert torch.equal(out, first) and torch.equal(lse, lse0)


@pytest.mark.gpu
def test_gpu_peak_memory_linear():
    def peak(n):
        q, k, v = qkv(1, 8, n, n, 64, seed=106)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        elsa_fwd(q, k, v)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    p1, p2 = peak(4096), peak(8192)
    assert p2 <= 2.2 * p1  # outputs only: linear in N (an N^2 buffer would quadruple)
