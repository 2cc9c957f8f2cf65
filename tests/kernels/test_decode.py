"""Stream-K few-query forward (``elsa_vision.kernels.decode``) against the float64 reference.

On CPU the kernels run in the Triton interpreter (``tests/conftest.py``) at small, odd shapes with lean tiles
of 16-64 keys and forced program counts, so that program ranges start and end inside heads; there every
float32 dot is exact float32 arithmetic. ``@pytest.mark.gpu`` tests run the long-cache shapes.

Thresholds (``relerr = ||out - ref64|| / ||ref64||``): float32 FP32-accurate paths <= 1e-6, tf32 <= 5e-3;
float16/bfloat16 the FlashAttention way: ``max|out - ref64| <= 2 max|out_lp - ref64| + atol`` where ``out_lp``
is the same attention computed by PyTorch in the low precision; lse: ``|lse - ref| <= 1e-5 max(1, |ref|)``.
"""

from __future__ import annotations

import math

import pytest
import torch

from elsa_vision import elsa_attention
from elsa_vision.kernels import decode
from elsa_vision.kernels.decode import choose_forward, decode_plan, elsa_decode
from elsa_vision.kernels.fwd import elsa_fwd
from elsa_vision.kernels.reference import softmax_attention
from tests.helpers import (
    DEVICE,
    FP32_ACCURATE,
    LOW_ATOL,
    TF32_BOUND,
    assert_lse,
    assert_nonfinite_like,
    compile_for_sm90,
    cuda_graph,
    gen,
    qkv,
    randn,
    relerr,
    scan64,
)


def assert_matches(q, k, v, out, lse, **kw):
    ref, ref_lse = scan64(q, k, v, **kw)
    assert relerr(out, ref) <= FP32_ACCURATE
    assert_lse(lse, ref_lse)


# ------------------------------------------------------------------------------------- plan structure


def test_plan_ranges_straddle_heads():
    # 6 heads x cdiv(100, 16) = 7 tiles = 42 flat tiles over 5 programs of 9: ranges [0,9), [9,18), ...
    p = decode_plan(2, 3, 1, 100, 32, torch.float32, block_n=16, programs=5)
    assert (p.tiles_per_head, p.total_tiles, p.programs, p.tiles_per_program) == (7, 42, 5, 9)
    starts = [i * p.tiles_per_program for i in range(p.programs)]
    assert any(s % p.tiles_per_head != 0 for s in starts), "some range must start inside a head"
    # Every head is covered by programs first..last, which fit in the workspace slots.
    for bh in range(6):
        first = bh * p.tiles_per_head // p.tiles_per_program
        last = ((bh + 1) * p.tiles_per_head - 1) // p.tiles_per_program
        assert last - first + 1 <= p.max_partials
    # Default: one wave of the given multiprocessors, equal non-empty ranges.
    p = decode_plan(1, 8, 1, 65536, 128, torch.bfloat16, sm_count=132)
    assert p.programs <= 2 * 132 and (p.programs - 1) * p.tiles_per_program < p.total_tiles
    assert p.total_tiles == 8 * p.tiles_per_head
    assert p.workspace_bytes == 8 * p.max_partials * 1 * (p.block_dv + 2) * 4
    # Many programs: one tile each.
    p = decode_plan(1, 1, 1, 50, 16, torch.float32, block_n=16, programs=99)
    assert (p.programs, p.tiles_per_program, p.max_partials) == (4, 1, 4)
    # Every flat tile belongs to exactly one program and every (program, head) run has its own slot.
    for bh_count in (1, 2, 5, 6):
        for nk in (1, 15, 16, 17, 100, 700):
            for programs in (1, 2, 3, 7, 11, 64):
                p = decode_plan(1, bh_count, 1, nk, 16, torch.float32, block_n=16, programs=programs)
                tpp, tph = p.tiles_per_program, p.tiles_per_head
                assert p.programs <= programs and (p.programs - 1) * tpp < p.total_tiles <= p.programs * tpp
                slots = set()
                for tile in range(p.total_tiles):
                    prog, bh = tile // tpp, tile // tph
                    slot = prog - bh * tph // tpp
                    assert 0 <= slot < p.max_partials
                    slots.add((bh, slot, prog))
                assert len({(bh, slot) for bh, slot, _ in slots}) == len(slots)
                for bh in range(bh_count):  # the merge reads slots 0 .. last - first
                    first, last = bh * tph // tpp, ((bh + 1) * tph - 1) // tpp
                    assert sorted(sl for h, sl, _ in slots if h == bh) == list(range(last - first + 1))


def test_choose_forward():
    assert choose_forward(1, 8, 1, 65536, sm_count=132) == "decode"
    assert choose_forward(1, 8, 16, 262144, sm_count=132) == "decode"
    assert choose_forward(1, 8, 17, 65536, sm_count=132) == "fwd"  # too many queries
    assert choose_forward(1, 8, 1, 4095, sm_count=132) == "fwd"  # too few keys
    assert choose_forward(32, 16, 1, 65536, sm_count=132) == "fwd"  # query tiles fill the machine
    assert choose_forward(1, 132, 1, 65536, sm_count=132) == "decode"
    assert choose_forward(1, 133, 1, 65536, sm_count=132) == "fwd"


# ------------------------------------------------------------------------------------- float32 accuracy


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "B,H,Nq,Nk,D,block_n,programs",
    [
        (1, 1, 1, 1, 16, 16, 1),  # one key
        (1, 3, 1, 100, 16, 16, 2),  # ragged last tile, ranges end mid-head
        (2, 3, 4, 77, 40, 32, 5),  # 6 heads, padded head dim
        (2, 1, 7, 700, 24, 64, 3),  # long-ish, odd Nq
        (1, 2, 16, 129, 64, 16, 7),  # Nq = 16, one key past a tile
        (3, 2, 2, 48, 16, 16, 4),  # even tiles (no bounds masks)
    ],
)
def test_fp32_matches_float64(B, H, Nq, Nk, D, block_n, programs, causal):
    q, k, v = qkv(B, H, Nq, Nk, D, seed=B * 100 + Nk)
    out, lse = elsa_decode(q, k, v, causal=causal, block_n=block_n, programs=programs)
    assert out.shape == (B, H, Nq, D) and out.dtype == q.dtype
    assert_matches(q, k, v, out, lse, causal=causal)


@pytest.mark.parametrize("precision", ["auto", "ieee", "tf32x3", "fp16x3", "tf32"])
def test_fp32_precisions(precision):
    q, k, v = qkv(2, 2, 3, 131, 40, seed=7)
    out, lse = elsa_decode(q, k, v, causal=True, precision=precision, block_n=32, programs=3)
    ref, ref_lse = scan64(q, k, v, causal=True)
    bound = TF32_BOUND if precision == "tf32" else FP32_ACCURATE
    assert relerr(out, ref) <= bound
    if precision != "tf32":
        assert_lse(lse, ref_lse)


@pytest.mark.parametrize("D,Dv", [(16, 16), (33, 20), (130, 70), (256, 256)])
def test_head_dims(D, Dv):
    q, k, v = qkv(2, 1, 3, 90, D, Dv, seed=D)
    out, lse = elsa_decode(q, k, v, block_n=32, programs=3)
    assert_matches(q, k, v, out, lse)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision(dtype):
    q, k, v = qkv(2, 2, 3, 300, 64, seed=11, dtype=dtype)
    out, lse = elsa_decode(q, k, v, causal=True, block_n=32, programs=5)
    assert out.dtype == dtype
    ref, ref_lse = scan64(q, k, v, causal=True)
    out_lp = softmax_attention(q, k, v, causal=True)
    err = (out.double() - ref).abs().max().item()
    base = (out_lp.double() - ref).abs().max().item()
    assert err <= 2 * base + LOW_ATOL[dtype], f"max err {err} vs low-precision torch {base}"
    assert_lse(lse, ref_lse)


def test_arbitrary_strides():
    # [B, N, H, D] storage viewed as [B, H, N, D] (a fused projection's layout), and a sliced head dim.
    B, H, Nq, Nk, D = 2, 3, 2, 150, 32
    qs = randn(B, Nq, H, D + 8, seed=3)[..., :D].transpose(1, 2)
    ks = randn(B, Nk, H, D, seed=4).transpose(1, 2)
    vs = randn(B, H, D, Nk, seed=5).transpose(2, 3)
    assert not (qs.is_contiguous() or ks.is_contiguous() or vs.is_contiguous())
    out, lse = elsa_decode(qs, ks, vs, block_n=16, programs=4)
    out_c, lse_c = elsa_decode(qs.contiguous(), ks.contiguous(), vs.contiguous(), block_n=16, programs=4)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)
    assert_matches(qs, ks, vs, out, lse)


# ------------------------------------------------------------------------------------- causal KV cache


def test_causal_single_query_sees_whole_cache():
    q, k, v = qkv(2, 2, 1, 333, 32, seed=21)
    out_c, lse_c = elsa_decode(q, k, v, causal=True, block_n=32, programs=3)
    out_n, lse_n = elsa_decode(q, k, v, causal=False, block_n=32, programs=3)
    assert torch.equal(out_c, out_n) and torch.equal(lse_c, lse_n)
    assert_matches(q, k, v, out_c, lse_c, causal=True)


def test_causal_kv_cache_steps():
    # Four decode queries against a cache: row i sees keys 0 .. Nk - 4 + i (bottom right), and each row
    # equals a one-query call on the cache truncated to its visible prefix.
    B, H, Nq, Nk, D = 1, 3, 4, 210, 16
    q, k, v = qkv(B, H, Nq, Nk, D, seed=31)
    out, lse = elsa_decode(q, k, v, causal=True, block_n=16, programs=5)
    assert_matches(q, k, v, out, lse, causal=True)
    for i in range(Nq):
        n = Nk - Nq + i + 1
        row, row_lse = elsa_decode(q[:, :, i:i + 1], k[:, :, :n], v[:, :, :n], causal=True, block_n=16,
                                   programs=5)
        assert relerr(row, out[:, :, i:i + 1].double()) <= FP32_ACCURATE
        assert (row_lse - lse[:, :, i:i + 1]).abs().max().item() <= 1e-5 * lse.abs().max().item()


def test_causal_more_queries_than_keys_gives_zero_rows():
    q, k, v = qkv(1, 2, 9, 5, 16, seed=41)
    out, lse = elsa_decode(q, k, v, causal=True, block_n=16, programs=2)
    # Rows 0..3 see j <= i - 4 < 0: nothing.
    assert torch.equal(out[:, :, :4], torch.zeros_like(out[:, :, :4]))
    assert bool((lse[:, :, :4] == -math.inf).all())
    assert_matches(q, k, v, out, lse, causal=True)


# ------------------------------------------------------------------------------------- masks and bias


@pytest.mark.parametrize("bshape", [(1, 1, 1, 111), (2, 1, 3, 111), (1, 3, 1, 1), (111,), (2, 3, 3, 111)])
def test_bias_broadcast(bshape):
    q, k, v = qkv(2, 3, 3, 111, 16, seed=51)
    bias = randn(*bshape, seed=52, scale=2.0)
    out, lse = elsa_decode(q, k, v, attn_bias=bias, block_n=16, programs=4)
    assert_matches(q, k, v, out, lse, attn_bias=bias)


def test_neg_inf_bias_and_key_padding_mask():
    B, H, Nq, Nk = 3, 2, 2, 95
    q, k, v = qkv(B, H, Nq, Nk, 16, seed=61)
    bias = torch.zeros(B, H, Nq, Nk, device=DEVICE)
    bias[:, :, 0, 10:70] = -math.inf  # a band hidden from row 0
    bias[1, 0, 1, :] = -math.inf  # a fully hidden row
    kpm = (torch.rand(B, Nk, generator=gen(62)) > 0.3).to(DEVICE)
    kpm[2] = False  # a batch with no key at all
    out, lse = elsa_decode(q, k, v, attn_bias=bias, key_padding_mask=kpm, block_n=16, programs=5)
    assert torch.isfinite(out).all()
    assert torch.equal(out[2], torch.zeros_like(out[2])) and bool((lse[2] == -math.inf).all())
    assert torch.equal(out[1, 0, 1], torch.zeros_like(out[1, 0, 1])) and lse[1, 0, 1].item() == -math.inf
    ref, ref_lse = scan64(q, k, v, attn_bias=bias, key_padding_mask=kpm)
    assert relerr(out, ref) <= FP32_ACCURATE
    assert_lse(lse, ref_lse)


@pytest.mark.parametrize("causal", [False, True])
def test_nan_in_masked_keys_and_tail_does_not_leak(causal):
    B, H, Nq, Nk, D, pad = 2, 2, 3, 77, 24, 19
    q, k_big, v_big = qkv(B, H, Nq, Nk + pad, D, seed=71)
    q = q[:, :, :Nq]
    kpm = (torch.rand(B, Nk, generator=gen(72)) > 0.25).to(DEVICE)
    kpm[:, -1] = True
    k_clean, v_clean = k_big[:, :, :Nk].clone(), v_big[:, :, :Nk].clone()
    poison = torch.zeros(B, 1, Nk + pad, 1, dtype=torch.bool, device=DEVICE)
    poison[:, :, :Nk, :] = ~kpm[:, None, :, None]
    poison[:, :, Nk:] = True  # the out-of-range tail right behind the last key
    k, v = k_big.masked_fill(poison, math.nan)[:, :, :Nk], v_big.masked_fill(poison, math.nan)[:, :, :Nk]
    out_p, lse_p = elsa_decode(q, k, v, key_padding_mask=kpm, causal=causal, block_n=32, programs=3)
    out_c, lse_c = elsa_decode(q, k_clean, v_clean, key_padding_mask=kpm, causal=causal, block_n=32,
                               programs=3)
    assert torch.isfinite(out_p).all()
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c)
    assert_matches(q, k_clean, v_clean, out_c, lse_c, key_padding_mask=kpm, causal=causal)


@pytest.mark.parametrize("mask", ["causal", "bias"])
@pytest.mark.parametrize("programs", [1, 3])
def test_hidden_nonfinite_keys_and_values_contribute_nothing(mask, programs):
    # A key a query cannot see (causal, or a -inf bias) contributes nothing whatever its rows hold; a visible
    # key's NaN key row makes its rows NaN, a visible non-finite value only its own columns.
    B, H, Nq, Nk, D = 1, 2, 4, 90, 24
    q, k, v = qkv(B, H, Nq, Nk, D, seed=73)
    if mask == "causal":  # query i sees the keys up to 86 + i
        kw = dict(causal=True)
        k[..., 89, 0] = math.nan  # the last row is NaN
        v[..., 87, 0] = -math.inf  # rows 1-3, column 0
    else:
        bias = randn(1, H, Nq, Nk, seed=74)
        bias[..., 20] = -math.inf  # key 20 hidden from every row
        bias[..., :2, 88] = -math.inf  # key 88 from rows 0-1
        kw = dict(attn_bias=bias)
        k[..., 20, :3] = torch.tensor([math.inf, -math.inf, math.nan])
        v[..., 20, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    v[..., 88, 1] = math.inf  # rows 2-3, columns 1-2
    v[..., 88, 2] = math.nan
    out, lse = elsa_decode(q, k, v, block_n=32, programs=programs, **kw)
    ref, _ = scan64(q, k, v, **kw)
    assert_nonfinite_like(out, ref, FP32_ACCURATE)
    assert torch.isfinite(out[..., 0, :]).all() and torch.isfinite(out[..., 2, 3:]).all()


def test_plus_inf_bias_makes_its_row_nan():
    q, k, v = qkv(1, 2, 3, 70, 16, seed=75)
    bias = randn(1, 2, 3, 70, seed=76)
    bias[..., 1, 33] = math.inf
    out, lse = elsa_decode(q, k, v, attn_bias=bias, block_n=16, programs=3)
    ref = softmax_attention(q.double(), k.double(), v.double(), attn_bias=bias.double())
    assert bool(torch.isnan(ref[..., 1, :]).all())
    assert_nonfinite_like(out, ref, FP32_ACCURATE)


def test_large_magnitude_logits():
    q, k, v = qkv(1, 2, 2, 200, 16, seed=81, scale=30.0)
    out, lse = elsa_decode(q, k, v, block_n=16, programs=3)
    assert torch.isfinite(out).all()
    assert_matches(q, k, v, out, lse)


# ------------------------------------------------------------------------------------- determinism


def test_reruns_bitwise_equal_and_program_counts_agree():
    q, k, v = qkv(2, 3, 2, 400, 32, seed=91)
    out0, lse0 = elsa_decode(q, k, v, causal=True, block_n=16, programs=7)
    for _ in range(2):
        out, lse = elsa_decode(q, k, v, causal=True, block_n=16, programs=7)
        assert torch.equal(out, out0) and torch.equal(lse, lse0)
    ref, _ = scan64(q, k, v, causal=True)
    for programs in (1, 6, 13, 40):
        out, lse = elsa_decode(q, k, v, causal=True, block_n=16, programs=programs)
        assert relerr(out, out0.double()) <= 2 * FP32_ACCURATE
        assert (lse - lse0).abs().max().item() <= 1e-5 * lse0.abs().max().item()
        assert relerr(out, ref) <= FP32_ACCURATE


def test_matches_regular_forward():
    q, k, v = qkv(1, 4, 5, 260, 40, seed=101)
    out_d, lse_d = elsa_decode(q, k, v, causal=True, block_n=64, programs=3)
    out_f, lse_f = elsa_fwd(q, k, v, causal=True)
    assert relerr(out_d, out_f.double()) <= 2 * FP32_ACCURATE
    assert (lse_d - lse_f).abs().max().item() <= 1e-5 * lse_f.abs().max().item()


# ------------------------------------------------------------------------------------- routing and grads


def test_op_routes_to_decode_and_gradients(monkeypatch):
    calls = []
    real = decode.decode_program  # where the operator's forward takes the few-query path

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(decode, "decode_program", spy)
    monkeypatch.setattr(decode, "DECODE_MIN_KEYS", 256)
    B, H, Nk, D = 1, 2, 300, 16
    assert choose_forward(B, H, 1, Nk, device=DEVICE) == "decode"
    q, k, v = qkv(B, H, 1, Nk, D, seed=111)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = elsa_attention(q, k, v, causal=True, backend="triton")
    assert calls == [torch.Size([B, H, 1, D])]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = softmax_attention(q64, k64, v64, causal=True)
    assert relerr(out, ref.detach()) <= FP32_ACCURATE
    dout = randn(B, H, 1, D, seed=112)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    for name, g, r in zip("qkv", grads, refs):
        assert relerr(g, r) <= 1e-5, name
    # Many query rows: the regular forward, the spy is not called again.
    q2, k2, v2 = qkv(B, H, 40, Nk, D, seed=113)
    elsa_attention(q2, k2, v2, backend="triton")
    assert len(calls) == 1


def test_bad_inputs():
    # The launcher trusts its tensors: elsa_attention (the public entry) checks them; the plan checks its
    # own knobs.
    q, k, v = qkv(1, 2, 2, 40, 16, seed=121)

    def fwd(q, k, v, **kw):
        return elsa_attention(q, k, v, backend="triton", **kw)

    with pytest.raises(TypeError, match="key_padding_mask"):
        fwd(q, k, v, key_padding_mask=torch.ones(1, 40, device=DEVICE))
    with pytest.raises(ValueError, match="key_padding_mask"):
        fwd(q, k, v, key_padding_mask=torch.ones(1, 41, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="attn_bias"):
        fwd(q, k, v, attn_bias=torch.zeros(3, 1, 1, 40, device=DEVICE))
    with pytest.raises(TypeError, match="attn_bias"):
        fwd(q, k, v, attn_bias=torch.zeros(1, 40, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match="head count H"):
        fwd(q, k[:, :1], v)
    with pytest.raises(TypeError, match="causal"):
        fwd(q, k, v, causal=1)
    with pytest.raises(ValueError, match="block_n"):
        elsa_decode(q, k, v, block_n=24)
    with pytest.raises(ValueError, match="programs"):
        elsa_decode(q, k, v, programs=0)
    with pytest.raises(ValueError, match="Nq"):
        elsa_decode(randn(1, 2, 129, 16), k, v)
    with pytest.raises(ValueError, match="precision"):
        fwd(q, k, v, precision="fp8")
    with pytest.raises(TypeError, match="dtype"):
        decode_plan(1, 1, 1, 10, 16, torch.float64)


def test_empty_keys():
    q, k, v = qkv(1, 2, 3, 0, 16, seed=131)
    out, lse = elsa_decode(q, k, v)
    assert torch.equal(out, torch.zeros_like(out)) and bool((lse == -math.inf).all())


# ------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("Nk", [65536, 262144])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_long_cache(Nk, dtype):
    B, H, D = 1, 8, 128
    q, k, v = qkv(B, H, 1, Nk, D, seed=Nk, dtype=dtype)
    assert choose_forward(B, H, 1, Nk, device=q.device) == "decode"
    out, lse = elsa_decode(q, k, v, causal=True)
    ref, ref_lse = scan64(q, k, v, causal=True)
    if dtype == torch.float32:
        assert relerr(out, ref) <= FP32_ACCURATE
    else:
        out_lp = softmax_attention(q, k, v, causal=True)
        err = (out.double() - ref).abs().max().item()
        base = (out_lp.double() - ref).abs().max().item()
        assert err <= 2 * base + LOW_ATOL[dtype], f"max err {err} vs low-precision torch {base}"
    assert_lse(lse, ref_lse)
    for _ in range(20):
        again, again_lse = elsa_decode(q, k, v, causal=True)
        assert torch.equal(again, out) and torch.equal(again_lse, lse)


@pytest.mark.gpu
@pytest.mark.parametrize("Nq", [4, 16])
def test_gpu_few_queries_masks(Nq):
    B, H, Nk, D = 2, 4, 65536 + 77, 128
    q, k, v = qkv(B, H, Nq, Nk, D, seed=Nq, dtype=torch.bfloat16)
    kpm = (torch.rand(B, Nk, generator=gen(5)) > 0.1).to(DEVICE)
    bias = randn(1, H, 1, Nk, seed=6, dtype=torch.float32)
    out, lse = elsa_decode(q, k, v, attn_bias=bias, key_padding_mask=kpm, causal=True)
    ref, ref_lse = scan64(q, k, v, attn_bias=bias, key_padding_mask=kpm, causal=True)
    out_lp = softmax_attention(q, k, v, attn_bias=bias.to(q.dtype), key_padding_mask=kpm, causal=True)
    err = (out.double() - ref).abs().max().item()
    base = (out_lp.double() - ref).abs().max().item()
    assert err <= 2 * base + LOW_ATOL[torch.bfloat16], f"max err {err} vs low-precision torch {base}"
    assert_lse(lse, ref_lse)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_hidden_nonfinite_keys_and_values(dtype):
    B, H, Nq, Nk, D = 2, 4, 4, 65536 + 77, 128
    q, k, v = qkv(B, H, Nq, Nk, D, seed=11, dtype=dtype)
    bias = randn(1, H, Nq, Nk, seed=12)
    bias[..., 1000] = -math.inf  # hidden from every row
    k[..., 1000, :3] = torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype)
    v[..., 1000, :3] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype)
    k[..., Nk - 1, 0] = math.nan  # causal: the last row sees it
    v[..., Nk - 2, 1] = math.inf  # rows 2-3, column 1
    out, _ = elsa_decode(q, k, v, attn_bias=bias, causal=True)
    ref, _ = scan64(q, k, v, attn_bias=bias, causal=True)
    assert_nonfinite_like(out, ref, FP32_ACCURATE if dtype == torch.float32 else 2e-2)
    assert torch.isfinite(out[..., :2, :]).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replay_bitwise():
    q, k, v = qkv(1, 8, 1, 65536, 128, seed=9, dtype=torch.bfloat16)
    eager, eager_lse = elsa_decode(q, k, v, causal=True)
    graph, (out, lse) = cuda_graph(lambda: elsa_decode(q, k, v, causal=True))
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager) and torch.equal(lse, eager_lse)


_SM90_COMPILE = r"""
import json
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from elsa_vision.kernels import decode

names = decode._decode_kernel.arg_names
aligned = {"Q", "K", "V", "Bias", "Kpm", "WsM", "WsS", "WsW", "stride_qb", "stride_qh", "stride_qm",
           "stride_kb", "stride_kh", "stride_kn", "stride_vb", "stride_vh", "stride_vn"}
report = []
for ptr, block_n, precision in (("*bf16", 128, "none"), ("*fp32", 64, "tf32x3")):
    consts = dict(D=128, DV=128, BLOCK_M=16, BLOCK_N=block_n, BLOCK_D=128, BLOCK_DV=128, PRECISION=precision,
                  CAUSAL=True, HAS_BIAS=True, HAS_KPM=True, EVEN_N=False, ACCUMULATE="plain",
                  stride_qd=1, stride_kd=1, stride_vd=1)
    sig = {n: "i32" for n in names}
    sig.update({"Q": ptr, "K": ptr, "V": ptr, "Bias": "*fp32", "Kpm": "*u8", "WsM": "*fp32", "WsS": "*fp32",
                "WsW": "*fp32", "qk_scale": "fp32"})
    sig.update({n: "constexpr" for n in consts})
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in aligned}
    k = triton.compile(ASTSource(fn=decode._decode_kernel, signature=sig, constexprs=consts, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 3})
    report.append({"dtype": ptr, "shared": k.metadata.shared, "cp_async": "cp.async" in k.asm["ptx"]})
merge_names = decode._decode_merge_kernel.arg_names
consts = dict(DV=128, BLOCK_M=16, BLOCK_DV=128, STORE_LSE=True)
sig = {n: "i32" for n in merge_names}
sig.update({"WsM": "*fp32", "WsS": "*fp32", "WsW": "*fp32", "Out": "*bf16", "Lse": "*fp32"})
sig.update({n: "constexpr" for n in consts})
k = triton.compile(ASTSource(fn=decode._decode_merge_kernel, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
report.append({"dtype": "merge", "shared": k.metadata.shared})
print(json.dumps(report))
"""


def test_compiles_for_sm90_without_a_gpu():
    # The real compiler (no interpreter) down to a cubin for an H100 with the GPU defaults of the plan
    # (bf16: 128-key tiles, fp32 tf32x3: 64-key tiles; D = 128, 3 stages, all masks): it must compile, fit
    # the 227 KB of shared memory per block and pipeline the K/V loads (cp.async); the merge kernel compiles.
    report = compile_for_sm90(_SM90_COMPILE)
    assert len(report) == 3
    for entry in report[:2]:
        assert 0 < entry["shared"] <= 232448, entry
        assert entry["cp_async"], entry
    assert report[2]["shared"] <= 232448
