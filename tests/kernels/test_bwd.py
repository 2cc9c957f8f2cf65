"""Triton ELSA backward (``elsa_bwd``) against float64 autograd of the textbook softmax attention.

On machines without CUDA the kernels run under Triton's CPU interpreter (``TRITON_INTERPRET=1``) at small,
deliberately odd shapes; the ``gpu`` tests take the large shapes, reruns and memory growth.

Bounds (relative Frobenius error ``||g - ref|| / ||ref||`` against float64 autograd on the same inputs):

* float32, FP32-accurate paths (``ieee``, ``tf32x3``, ``fp16x3``, ``auto``): ``<= 1e-5``. Each gradient is
  a chain of three to four float32 products of length <= N, so rounding gives ~1e-7 * sqrt(N) (measured 3e-7
  to 4e-7 here); a single TF32 pass anywhere (unit roundoff 4.9e-4) lands near 1e-4 to 1e-3 and fails the
  bound.
* float32 ``tf32``: ``<= 5e-3``. (The CPU interpreter evaluates every float32 product exactly, so on CPU
  this checks the plumbing; the GPU test checks the TF32 rounding itself.)
* float16/bfloat16: FlashAttention's rule: ``<= 3x`` the error of the same math done by PyTorch in the
  input precision (``softmax_attention`` autograd in float16/bfloat16) against the same float64 reference.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from elsa_vision import elsa_attention  # noqa: E402
from elsa_vision.kernels.bwd import BwdConfig, elsa_bwd  # noqa: E402
from elsa_vision.kernels.fwd import elsa_fwd  # noqa: E402
from elsa_vision.kernels.precision import resolve_precision  # noqa: E402
from elsa_vision.kernels.reference import (  # noqa: E402
    attention_backward,
    attention_bias_grad,
    scan_attention,
    softmax_attention,
)
from tests.helpers import (  # noqa: E402
    DEVICE,
    NONFINITE_KINDS,
    TF32_BOUND,
    assert_nonfinite_like,
    compile_for_sm90,
    nonfinite_case,
)

FP32_ACCURATE = 1e-5  # the gradients' bound (the forward's, tests.helpers.FP32_ACCURATE, is 1e-6)
LOWP_FACTOR = 3.0


def _expand_bias(bias: torch.Tensor | None, B: int) -> torch.Tensor | None:
    """The window layout ``(nW, ...)`` on ``B = batch * nW`` as an ordinary broadcastable bias."""
    if bias is None or bias.dim() < 4 or bias.shape[0] in (1, B):
        return bias
    return bias.repeat(B // bias.shape[0], 1, 1, 1)


def _problem(B, H, Nq, Nk, D, Dv, *, bias_shape=None, kpm=False, seed=0, device=DEVICE):
    g = torch.Generator(device="cpu").manual_seed(seed)
    q = torch.randn(B, H, Nq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, H, Nk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, H, Nk, Dv, generator=g, dtype=torch.float64)
    do = torch.randn(B, H, Nq, Dv, generator=g, dtype=torch.float64)
    bias = None if bias_shape is None else torch.randn(*bias_shape, generator=g, dtype=torch.float64)
    mask = None
    if kpm:
        mask = torch.rand(B, Nk, generator=g) > 0.3
        mask[:, 0] = True
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return move(q), move(k), move(v), move(do), move(bias), move(mask)


def _reference(q, k, v, do, bias=None, mask=None, causal=False, scale=None):
    """float64 autograd grads of ``softmax_attention`` (dq, dk, dv, dbias) plus float64 (out, lse)."""
    B = q.shape[0]
    leaves = [t.detach().double().clone().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().double().clone().requires_grad_()
    out = softmax_attention(*leaves, attn_bias=_expand_bias(b, B), key_padding_mask=mask, causal=causal,
                            scale=scale)
    out.backward(do.double())
    with torch.no_grad():
        o, lse = scan_attention(*(t.detach().double() for t in (q, k, v)), attn_bias=_expand_bias(
            None if bias is None else bias.double(), B), key_padding_mask=mask, causal=causal, scale=scale,
            return_lse=True)
    grads = [t.grad for t in leaves] + [None if b is None else b.grad]
    return grads, o, lse


def _lowp_grads(q, k, v, do, bias=None, mask=None, causal=False):
    """The same math in the inputs' low precision (FlashAttention's yardstick)."""
    B = q.shape[0]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_()
    out = softmax_attention(*leaves, attn_bias=_expand_bias(b, B), key_padding_mask=mask, causal=causal)
    out.backward(do)
    return [t.grad for t in leaves] + [None if b is None else b.grad]


def _relerr(a: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(a).all(), "non-finite gradient"
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _run(q, k, v, do, o, lse, dtype, **kw):
    cast = lambda t: None if t is None else t.to(dtype)  # noqa: E731
    bias = kw.pop("attn_bias", None)
    return elsa_bwd(cast(do), cast(q), cast(k), cast(v), cast(o), lse.float(), attn_bias=cast(bias), **kw)


def _check_fp32(grads, refs, bound, names=("dq", "dk", "dv", "dbias")):
    for name, g, r in zip(names, grads, refs):
        if r is None:
            assert g is None
            continue
        assert g.shape == r.shape, f"{name}: shape {tuple(g.shape)} vs {tuple(r.shape)}"
        err = _relerr(g, r)
        assert err <= bound, f"{name}: relerr {err:.3e} > {bound:.1e}"


# ------------------------------------------------------------------------------------------- CPU matrix

MATRIX = [  # (B, H, Nq, Nk, D, Dv, causal)
    (1, 2, 97, 97, 64, 64, False),
    (1, 2, 97, 97, 40, 40, True),
    (2, 3, 113, 203, 72, 72, False),
    (1, 2, 113, 203, 40, 72, True),
    (1, 2, 1, 239, 64, 64, False),
    (1, 2, 1, 239, 72, 40, True),
    (1, 2, 127, 63, 40, 40, False),
    (1, 2, 127, 63, 64, 64, True),  # Nq > Nk causal: the first 64 rows see no key
    (1, 2, 113, 97, 111, 40, True),  # head dim 111 padded to 128, Dv != D
]


@pytest.mark.parametrize("precision", ["auto", "fp16x3"])
@pytest.mark.parametrize("B,H,Nq,Nk,D,Dv,causal", MATRIX)
def test_grads_fp32(B, H, Nq, Nk, D, Dv, causal, precision):
    q, k, v, do, _, _ = _problem(B, H, Nq, Nk, D, Dv, seed=Nq * 7 + Nk + D)
    refs, o, lse = _reference(q, k, v, do, causal=causal)
    grads = _run(q, k, v, do, o, lse, torch.float32, causal=causal, precision=precision)
    _check_fp32(grads, refs, FP32_ACCURATE)
    for g, t in zip(grads[:3], (q, k, v)):
        assert g.dtype == torch.float32 and g.is_contiguous() and g.shape == t.shape


@pytest.mark.parametrize("precision,bound", [("ieee", FP32_ACCURATE), ("tf32x3", FP32_ACCURATE),
                                             ("fp16x3", FP32_ACCURATE), ("auto", FP32_ACCURATE),
                                             ("tf32", TF32_BOUND)])
def test_precisions(precision, bound):
    q, k, v, do, bias, _ = _problem(1, 2, 113, 203, 64, 64, bias_shape=(1, 2, 113, 203), seed=11)
    refs, o, lse = _reference(q, k, v, do, bias=bias, causal=True)
    grads = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, causal=True, precision=precision,
                 bias_requires_grad=True)
    _check_fp32(grads, refs, bound)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("Nq,Nk,D,causal,with_bias", [(97, 97, 64, False, True), (113, 203, 72, True, False),
                                                       (127, 63, 40, True, True)])
def test_grads_half(dtype, Nq, Nk, D, causal, with_bias):
    B, H = 1, 2
    q, k, v, do, bias, _ = _problem(B, H, Nq, Nk, D, D, bias_shape=(1, H, Nq, Nk) if with_bias else None,
                                    seed=Nq + D)
    q, k, v, do = (t.to(dtype) for t in (q, k, v, do))
    bias = None if bias is None else bias.to(dtype)
    refs, o, lse = _reference(q, k, v, do, bias=bias, causal=causal)
    lowp = _lowp_grads(q, k, v, do, bias=bias, causal=causal)
    grads = _run(q, k, v, do, o, lse, dtype, attn_bias=bias, causal=causal, bias_requires_grad=with_bias)
    for name, g, r, lp in zip(("dq", "dk", "dv", "dbias"), grads, refs, lowp):
        if r is None:
            assert g is None
            continue
        assert g.dtype == dtype
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"


BIAS_CASES = [  # (B, H, Nq, Nk, head dim, bias shape, causal, key padding)
    (2, 3, 97, 97, 40, (1, 3, 97, 97), False, False),     # relative-position bias, shared over the batch
    (4, 2, 49, 49, 40, (2, 1, 49, 49), False, False),     # window mask: B = batch 2 x nW 2, window b % nW
    (3, 2, 1, 239, 40, (3, 1, 1, 239), False, True),      # padding-style bias, reduced over heads and queries
    (2, 2, 113, 203, 40, (113, 203), True, False),        # 2-D bias broadcast over B and H
    (2, 2, 127, 63, 40, (2, 2, 127, 1), True, True),      # per-row bias, reduced over keys (true grad: 0)
    (2, 2, 97, 97, 40, (2, 2, 97, 97), False, True),      # full bias, nothing to reduce
    # Head dim 16 (the smallest dot tile): a pipelined (num_stages=2) dbias loop returned wrong values
    # here on the H100; causal with Nq > Nk leaves rows with no visible key.
    (1, 3, 50, 17, 16, (1, 3, 50, 17), True, False),
    (1, 2, 19, 23, 16, (1, 2, 19, 23), True, True),
]


@pytest.mark.parametrize("B,H,Nq,Nk,D,bshape,causal,kpm", BIAS_CASES)
def test_bias_grads(B, H, Nq, Nk, D, bshape, causal, kpm):
    q, k, v, do, bias, mask = _problem(B, H, Nq, Nk, D, D, bias_shape=bshape, kpm=kpm, seed=sum(bshape))
    refs, o, lse = _reference(q, k, v, do, bias=bias, mask=mask, causal=causal)
    grads = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, key_padding_mask=mask, causal=causal,
                 bias_requires_grad=True)
    assert grads[3].shape == bias.shape and grads[3].dtype == torch.float32
    if bshape[-1] == 1:
        # A bias constant along the keys shifts a softmax row and changes nothing: its exact gradient
        # sum_j P_ij (dP_ij - Delta_i) is 0, so judge the rounding residue against the scale of dS itself.
        _check_fp32(grads[:3], refs[:3], FP32_ACCURATE)
        full = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias.expand(B, H, Nq, Nk).contiguous(),
                    key_padding_mask=mask, causal=causal, bias_requires_grad=True)[3]
        assert grads[3].abs().max() <= FP32_ACCURATE * full.abs().max()
        return
    _check_fp32(grads, refs, FP32_ACCURATE)
    # Without bias_requires_grad no dbias is computed.
    no_grad = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, key_padding_mask=mask, causal=causal)
    assert no_grad[3] is None


@pytest.mark.parametrize("precision", ["auto", "fp16x3"])
def test_fully_masked_rows_give_zero_finite_grads(precision):
    B, H, Nq, Nk = 2, 2, 61, 75
    q, k, v, do, bias, mask = _problem(B, H, Nq, Nk, 72, 72, bias_shape=(B, H, Nq, Nk), kpm=True, seed=5)
    bias[:, :, 5:12, :] = -math.inf          # -inf band: rows 5..11 see nothing
    bias[:, :, :, 30:40] = -math.inf         # -inf key band
    bias[0, 1, 20, :] = -math.inf            # one more fully masked row
    mask[1] = False                          # batch 1: no key at all
    refs, o, lse = _reference(q, k, v, do, bias=bias, mask=mask)
    assert torch.isinf(lse[:, :, 5:12]).all() and torch.isinf(lse[1]).all()
    grads = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, key_padding_mask=mask,
                 bias_requires_grad=True, precision=precision)
    for g in grads:
        assert torch.isfinite(g).all()
    dq, dk, dv, db = grads
    assert (dq[:, :, 5:12] == 0).all() and (dq[0, 1, 20] == 0).all() and (dq[1] == 0).all()
    assert (dk[1] == 0).all() and (dv[1] == 0).all()
    assert (db[:, :, 5:12] == 0).all() and (db[:, :, :, 30:40] == 0).all() and (db[1] == 0).all()
    _check_fp32(grads, refs, FP32_ACCURATE)


def test_finfo_min_bias_is_finite():
    """Rows whose logits all sit at float32's most negative value stay finite (lse cannot resolve them)."""
    q, k, v, do, bias, _ = _problem(1, 2, 33, 47, 64, 64, bias_shape=(1, 2, 33, 47), seed=8)
    bias[:, :, 3:9] = torch.finfo(torch.float32).min
    _, o, lse = _reference(q, k, v, do, bias=bias)
    grads = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, bias_requires_grad=True)
    for g in grads:
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("precision", ["auto", "fp16x3"])
def test_nan_poisoned_keys_do_not_leak(precision):
    """NaN in keys hidden by the padding mask and past the end of the sequence: bitwise the clean run."""
    B, H, Nq, Nk, D = 2, 2, 97, 113, 40
    q, k, v, do, bias, mask = _problem(B, H, Nq, Nk, D, D, bias_shape=(1, H, Nq, Nk), kpm=True, seed=21)
    _, o, lse = _reference(q, k, v, do, bias=bias, mask=mask, causal=True)
    kw = dict(attn_bias=bias, key_padding_mask=mask, causal=True, bias_requires_grad=True,
              precision=precision)
    clean = _run(q, k, v, do, o, lse, torch.float32, **kw)
    # Poisoned storage: buffers longer than the sequence, NaN in the tail and in every hidden key.
    kbuf = torch.full((B, H, Nk + 29, D), math.nan, dtype=torch.float64, device=DEVICE)
    vbuf = torch.full_like(kbuf, math.nan)
    kbuf[:, :, :Nk], vbuf[:, :, :Nk] = k, v
    hidden = ~mask[:, None, :, None].expand(B, H, Nk, D)
    kbuf[:, :, :Nk][hidden] = math.nan
    vbuf[:, :, :Nk][hidden] = math.nan
    poisoned = _run(q, kbuf[:, :, :Nk], vbuf[:, :, :Nk], do, o, lse, torch.float32, **kw)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)


def _poison_hidden_keys(k, v, keys):
    """NaN and infinities in the key and value rows of ``keys`` (a copy)."""
    k, v = k.clone(), v.clone()
    k[..., keys, 0], k[..., keys, 1], k[..., keys, 2] = math.inf, -math.inf, math.nan
    v[..., keys, 0], v[..., keys, 1], v[..., keys, 2] = math.nan, math.inf, -math.inf
    return k, v


@pytest.mark.parametrize("case", ["causal_bias", "bands"])
@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_hidden_nonfinite_keys_reach_no_gradient(case, precision):
    """Keys hidden from every row by a -inf bias (causal too, or a band) whose key and value rows hold NaN
    and infinities: every gradient is the clean run's (theirs 0), not 0 * NaN."""
    B, H, Nq, Nk, D = 1, 2, 70, 83, 40
    q, k, v, do, bias, _ = _problem(B, H, Nq, Nk, D, 24, bias_shape=(1, H, Nq, Nk), seed=31)
    causal = case == "causal_bias"
    keys = [7, 40, 41] if causal else list(range(50, 62))
    bias[..., keys] = -math.inf
    refs, o, lse = _reference(q, k, v, do, bias=bias, causal=causal)
    kp, vp = _poison_hidden_keys(k, v, keys)
    grads = _run(q, kp, vp, do, o, lse, torch.float32, attn_bias=bias, causal=causal, bias_requires_grad=True,
                 precision=precision)
    _check_fp32(grads, refs, FP32_ACCURATE)
    assert (grads[1][..., keys, :] == 0).all() and (grads[2][..., keys, :] == 0).all()
    # the forward of the poisoned inputs is the clean one, and so are the gradients through it
    out, lse_p = elsa_fwd(q.float(), kp.float(), vp.float(), attn_bias=bias.float(), causal=causal,
                          precision=precision)
    assert torch.allclose(out.double(), o, rtol=0, atol=1e-5) and torch.equal(torch.isfinite(lse_p),
                                                                              torch.isfinite(lse))


@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_nonfinite_inputs_follow_the_reference_rule(kind, precision):
    """Non-finite keys and values some rows see (their rows NaN) and others do not: every gradient is
    non-finite exactly where the float64 reference backward's is (a hidden pair contributes nothing, dS = 0
    where P = 0), and matches it elsewhere."""
    q, k, v, kw = nonfinite_case(kind, 1, 2, 45, 77, 24, Dv=40, seed=61)
    out, lse = elsa_fwd(q, k, v, precision=precision, **kw)
    do = torch.randn(out.shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    bias = kw.get("attn_bias")
    dq, dk, dv, db = elsa_bwd(do, q, k, v, out, lse, precision=precision, bias_requires_grad=bias is not None,
                              **kw)
    kw64 = {n: t.double() if n == "attn_bias" else t for n, t in kw.items()}
    q64, k64, v64, do64 = (t.double() for t in (q, k, v, do))
    o64, l64 = scan_attention(q64, k64, v64, return_lse=True, **kw64)
    refs = attention_backward(do64, q64, k64, v64, o64, l64, **kw64)[:3]
    assert_nonfinite_like(dq, refs[0], FP32_ACCURATE)  # the rows that see no poisoned key are finite
    assert_nonfinite_like(dk, refs[1], FP32_ACCURATE, some_finite=False)
    assert_nonfinite_like(dv, refs[2], FP32_ACCURATE, some_finite=False)
    if bias is not None:
        ref_db = attention_bias_grad(do64, q64, k64, v64, o64, l64, bias.double(),
                                     **{n: t for n, t in kw.items() if n != "attn_bias"})
        assert_nonfinite_like(db, ref_db, FP32_ACCURATE)


def test_noncontiguous_views_match_contiguous():
    """q, k, v as views of a fused qkv projection, dO and the bias transposed views: bitwise equal."""
    B, N, H, D = 2, 97, 3, 72
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(B, N, 3, H, D, generator=g).to(DEVICE)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, N, D] with token stride 3*H*D
    do = torch.randn(B, N, H, D, generator=g).to(DEVICE).transpose(1, 2)
    bias = torch.randn(1, H, N, N, generator=g).to(DEVICE).transpose(-1, -2)
    mask = (torch.rand(1, N, generator=g) > 0.2).to(DEVICE)
    _, o, lse = _reference(q, k, v, do, bias=bias, mask=mask)
    o = o.float().transpose(1, 2).contiguous().transpose(1, 2)
    kw = dict(attn_bias=bias, key_padding_mask=mask, bias_requires_grad=True)
    assert not q.is_contiguous() and not do.is_contiguous() and not bias.is_contiguous()
    strided = elsa_bwd(do, q, k, v, o, lse.float(), **kw)
    kw["attn_bias"] = bias.contiguous()
    dense = elsa_bwd(do.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), o.contiguous(),
                     lse.float(), **kw)
    for a, b in zip(strided, dense):
        assert torch.equal(a, b)


@pytest.mark.parametrize("precision", ["auto", "fp16x3"])
def test_deterministic_reruns_bitwise_equal(precision):
    q, k, v, do, bias, mask = _problem(2, 2, 113, 97, 64, 64, bias_shape=(1, 2, 113, 97), kpm=True, seed=9)
    _, o, lse = _reference(q, k, v, do, bias=bias, mask=mask, causal=True)
    kw = dict(attn_bias=bias, key_padding_mask=mask, causal=True, bias_requires_grad=True,
              precision=precision)
    first = _run(q, k, v, do, o, lse, torch.float32, **kw)
    second = _run(q, k, v, do, o, lse, torch.float32, **kw)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


@pytest.mark.parametrize("case", [
    dict(B=2, H=2, Nq=113, Nk=97, D=64, Dv=64, causal=True, bias=True, kpm=True),
    dict(B=1, H=1, Nq=150, Nk=70, D=40, Dv=72, causal=False, bias=False, kpm=False),
    dict(B=2, H=1, Nq=45, Nk=130, D=72, Dv=40, causal=True, bias=False, kpm=True),
])
def test_fp16x3_operands_split_once_equal_the_loops_splits(monkeypatch, case):
    # The fp16x3 backward splits Q, dO (for the dK/dV loop) and K, V (for the dQ loop) beforehand, in the
    # tiles the loops read: the same parts and scales the loops form. Under the interpreter the gradients
    # are bitwise those of the loops' own splits. Compiled for a GPU the two kernels round differently in
    # dQ and dK (H100: dV bitwise equal; dQ, dK differ in about a third of their elements, by <= 1.0e-7 of
    # the gradient's norm in every case measured, one float32 rounding): there the bound is 5e-7, far below
    # what a wrong part or scale gives. With a bias, a padding mask, causality, Dv != D and B * H == 1.
    from elsa_vision.kernels import bwd

    bias_shape = (1, case["H"], case["Nq"], case["Nk"]) if case["bias"] else None
    q, k, v, do, bias, mask = _problem(case["B"], case["H"], case["Nq"], case["Nk"], case["D"], case["Dv"],
                                       bias_shape=bias_shape, kpm=case["kpm"], seed=21)
    refs, o, lse = _reference(q, k, v, do, bias=bias, mask=mask, causal=case["causal"])
    kw = dict(attn_bias=bias, key_padding_mask=mask, causal=case["causal"], precision="fp16x3")
    grads = []
    for presplit in (False, True):
        monkeypatch.setattr(bwd, "PRESPLIT", presplit)
        bwd._PROGRAMS.clear()
        grads.append(_run(q, k, v, do, o, lse, torch.float32, **kw))
        program = next(iter(bwd._PROGRAMS._programs.values()))
        assert (program.split_kv is not None) == (program.split_qdo is not None) == presplit
    bwd._PROGRAMS.clear()
    for name, a, b in zip(("dq", "dk", "dv"), grads[0][:3], grads[1][:3]):
        if DEVICE == "cpu":
            assert torch.equal(a, b), name
        else:
            assert _relerr(b, a) <= 5e-7, f"{name}: {_relerr(b, a):.2e}"
    _check_fp32(grads[1][:3], refs[:3], FP32_ACCURATE)


_SM90_COMPILE = r"""
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from elsa_vision.kernels import bwd

report = {}
for fn, ptrs, (bm, bn, warps, stages) in (
        (bwd._bwd_dkdv_kernel, ("Q", "K", "V", "DO", "LSE", "DELTA", "BIAS", "DK", "DV"), (64, 128, 8, 3)),
        (bwd._bwd_dq_kernel, ("Q", "K", "V", "DO", "O", "LSE", "DELTA", "BIAS", "DQ"), (128, 64, 8, 3))):
    names = fn.arg_names
    consts = dict(D=64, Dv=64, HAS_BIAS=True, HAS_KPM=True, CAUSAL=True, PREC="fp16x3", DOT_UPCAST=False,
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_D=64, BLOCK_DV=64, PRESPLIT=@PRESPLIT@)
    if "WRITE_DELTA" in names:
        consts["WRITE_DELTA"] = True
    if "REDO" in names:
        consts["REDO"] = False
    sig = {n: "i32" for n in names}
    sig.update({n: "*fp32" for n in ptrs})
    sig.update({"KPM": "*u8", "sm_scale": "fp32", "qk_scale": "fp32"})
    sig.update({n: "*fp16" for n in ("QP", "DOP", "KP", "VP") if n in names})
    sig.update({n: "*i32" for n in ("QE", "DOE", "KE", "VE", "Redo") if n in names})
    sig.update({n: "constexpr" for n in consts})
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = k.asm["ptx"]
    report[fn.__name__] = {"shared": k.metadata.shared, "wgmma_f16": ".f32.f16.f16" in ptx}
print(json.dumps(report))
"""


@pytest.mark.parametrize("presplit", [False, True])
def test_fp16x3_kernels_compile_for_sm90_without_a_gpu(presplit):
    # Both backward kernels at their fp16x3 tiles, with a bias, a padding mask and causality, reading Q/dO and
    # K/V split in their loops or beforehand: float16 wgmma products within sm90's shared memory.
    report = compile_for_sm90(_SM90_COMPILE.replace("@PRESPLIT@", str(presplit)))
    for name, kernel in report.items():
        assert 0 < kernel["shared"] <= 232448 and kernel["wgmma_f16"], (name, kernel)


def test_default_half_dq_tiles_on_sm90(monkeypatch):
    # dQ tiles of 128 query rows on 4 warps at 193-256 keys (ViT's 197 tokens: 64- and 128-row tiles both
    # pad to 256) where B x H give at least one such tile per SM; 64 x 64 up to 1,024 keys otherwise (145
    # tokens would pad to 256 rows instead of 192; 12 heads would leave most SMs idle); 128 x 64 on 8 warps
    # past 1,024 keys.
    from elsa_vision.kernels import host
    from elsa_vision.kernels.bwd import bwd_config

    monkeypatch.setattr(host, "_device_info", lambda device=None: (132, (9, 0), 232448))
    cuda = torch.device("cuda", 0)

    def dq(n_k, heads, dtype=torch.bfloat16, D=64):
        c = bwd_config(dtype, D, D, cuda, "none", n_k, False, heads)
        return c.block_m2, c.block_n2, c.warps2, c.stages2

    assert dq(197, 768) == dq(256, 66) == dq(197, 768, torch.float16) == (128, 64, 4, 3)
    assert dq(197, 12) == dq(145, 768) == dq(257, 768) == dq(785, 96) == dq(197, None) == (64, 64, 4, 3)
    assert dq(4096, 8) == (128, 64, 8, 3)
    assert dq(197, 768, D=128) == (128, 64, 8, 3)  # head dim 128: unchanged


def test_explicit_tiles_and_scale():
    """Non-default tiles (the GPU's half-precision shapes) and a custom scale give the same gradients."""
    q, k, v, do, bias, mask = _problem(1, 2, 113, 203, 64, 64, bias_shape=(1, 1, 113, 203), kpm=True, seed=4)
    refs, o, lse = _reference(q, k, v, do, bias=bias, mask=mask, causal=True, scale=0.3)
    cfg = BwdConfig(block_m1=16, block_n1=128, block_m2=128, block_n2=16, block_m3=16, block_n3=128)
    grads = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, key_padding_mask=mask, causal=True,
                 scale=0.3, bias_requires_grad=True, config=cfg)
    _check_fp32(grads, refs, FP32_ACCURATE)


# q, k, v, dO magnitudes (q and k reciprocal so that the logits stay of order one, every gradient inside
# float32's normal range): "fp16x3" scales each tile by a power of two into float16 range.
RANGES = [(1e-10, 1e10, 1e-12, 1e-12), (1e10, 1e-10, 1e12, 1e12), (1e-3, 1e-3, 1e-30, 1.0),
          (1.0, 1.0, 1e17, 1e17)]


@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
@pytest.mark.parametrize("mags", RANGES, ids=lambda m: "q{:g}-k{:g}-v{:g}-do{:g}".format(*m))
def test_fp32_input_ranges(mags, precision):
    q, k, v, do, _, _ = _problem(1, 2, 97, 75, 64, 64, seed=31)
    q, k, v, do = q * mags[0], k * mags[1], v * mags[2], do * mags[3]
    refs, o, lse = _reference(q, k, v, do, causal=True)
    grads = _run(q, k, v, do, o, lse, torch.float32, causal=True, precision=precision)
    _check_fp32(grads, refs, FP32_ACCURATE)


@pytest.mark.parametrize("precision", ["ieee", "fp16x3"])
def test_fp32_mixed_magnitudes_in_one_tile(precision):
    """Rows of q, k and dO over several decades and values over 1e-8..1e8 inside every tile: one
    power-of-two scale per tile still leaves each element 22 significant bits, or an error far below the
    tile's largest contribution. (q and k rows stay below ~3 so that the logits stay of order one: logits
    of ~1e4 and more carry an exponent rounding that no float32 backward, ``ieee`` included, resolves.)"""
    q, k, v, do, bias, mask = _problem(2, 2, 97, 113, 64, 64, bias_shape=(1, 2, 97, 113), kpm=True, seed=33)
    g = torch.Generator().manual_seed(34)
    spread = lambda shape, lo, hi: (10 ** (torch.rand(*shape, generator=g, dtype=torch.float64)  # noqa: E731
                                           * (hi - lo) + lo)).to(DEVICE)
    q, k = q * spread((2, 2, 97, 1), -6, 0.5), k * spread((2, 2, 113, 1), -6, 0.5)
    v, do = v * spread((2, 2, 113, 64), -8, 8), do * spread((2, 2, 97, 1), -4, 4)
    refs, o, lse = _reference(q, k, v, do, bias=bias, mask=mask)
    grads = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, key_padding_mask=mask,
                 precision=precision, bias_requires_grad=True)
    _check_fp32(grads, refs, FP32_ACCURATE)


def test_resolve_precision():
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_precision("auto", f32, cpu, "bwd", 64) == "ieee"
    assert resolve_precision("fp16x3", f32, cpu, "bwd", 128) == "fp16x3"
    assert resolve_precision("fp16x3", f32, cpu, "bwd", 129) == "tf32x3"  # pads to 256: measured to 128
    for kernel in ("decode", "window"):  # no fp16x3 path at any width: the other FP32-accurate one
        assert resolve_precision("fp16x3", f32, cpu, kernel, 64) == "tf32x3"
        assert resolve_precision("fp16x3", f32, cpu, kernel) == "tf32x3"
    assert resolve_precision("fp16x3", f32, cpu, "gemm") == "fp16x3"  # split tiles independent of the call
    with pytest.raises(ValueError, match="unknown precision 'tf32x3s'"):
        resolve_precision("tf32x3s", f32, cpu, "bwd", 64)  # removed: the same products as tf32x3, 1-5% faster
    assert resolve_precision("fp16x3", torch.bfloat16, cpu, "bwd", 64) == "none"  # half: as they are


@pytest.mark.parametrize("precision", ["auto", "fp16x3"])
def test_precomputed_delta_and_one_sided_passes(precision):
    """``delta`` given (``out`` then unread: None), and ``compute_dq`` / ``compute_dkdv`` switched off, give
    the same gradients as the full call, within the float32 bound against float64, and None where skipped."""
    q, k, v, do, bias, mask = _problem(1, 2, 97, 130, 40, 72, bias_shape=(1, 2, 97, 130), kpm=True, seed=21)
    refs, o, lse = _reference(q, k, v, do, bias=bias, mask=mask, causal=True)
    delta = (o * do).sum(-1).float()
    full = _run(q, k, v, do, o, lse, torch.float32, attn_bias=bias, key_padding_mask=mask, causal=True,
                precision=precision)
    args = [t.float() for t in (do, q, k, v)] + [None, lse.float()]
    kw = dict(attn_bias=bias.float(), key_padding_mask=mask, causal=True, precision=precision, delta=delta)
    dq_only = elsa_bwd(*args, **kw, compute_dkdv=False)
    dkdv_only = elsa_bwd(*args, **kw, compute_dq=False)
    assert dq_only[1] is None and dq_only[2] is None and dkdv_only[0] is None
    _check_fp32([dq_only[0], dkdv_only[1], dkdv_only[2]], refs[:3], FP32_ACCURATE)
    # the same kernels on the same inputs: equal to the full call up to the delta's summation order
    for part, whole in ((dq_only[0], full[0]), (dkdv_only[1], full[1]), (dkdv_only[2], full[2])):
        assert _relerr(part, whole.double()) <= 1e-6


def test_input_validation():
    # elsa_bwd trusts its tensors (the public elsa_attention checks them before the forward that saved them);
    # bad inputs are refused there, and elsa_bwd keeps its one contract: `out` or `delta`.
    q, k, v, do, _, _ = _problem(1, 2, 9, 11, 16, 16, seed=1)
    q, k, v, do = (t.float() for t in (q, k, v, do))
    lse = torch.zeros(1, 2, 9, device=DEVICE)

    def fwd(q, k, v, **kw):
        return elsa_attention(q, k, v, backend="triton", **kw)

    with pytest.raises(ValueError, match="head count H"):
        fwd(q, k[:, :1], v)
    with pytest.raises(TypeError, match="dtype"):
        fwd(q, k.double(), v)
    with pytest.raises(ValueError, match="attn_bias"):
        fwd(q, k, v, attn_bias=torch.zeros(1, 3, 9, 11, device=DEVICE))
    with pytest.raises(TypeError, match="key_padding_mask"):
        fwd(q, k, v, key_padding_mask=torch.ones(1, 11, device=DEVICE))
    with pytest.raises(ValueError, match="precision"):
        fwd(q, k, v, precision="fp8")
    with pytest.raises(ValueError, match="pass `out`"):
        elsa_bwd(do, q, k, v, None, lse)


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.parametrize("N", [785, 3137, 4096])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "auto"), (torch.float32, "tf32x3"),
                                             (torch.float32, "fp16x3"), (torch.float32, "tf32"),
                                             (torch.bfloat16, "auto")])
def test_gpu_large(N, dtype, precision):
    B, H, D = 1, 2, 64
    q, k, v, do, bias, _ = _problem(B, H, N, N, D, D, bias_shape=(1, H, N, N), seed=N)
    q, k, v, do, bias = (t.to(dtype) for t in (q, k, v, do, bias))
    causal = N == 3137
    refs, o, lse = _reference(q, k, v, do, bias=bias, causal=causal)
    grads = _run(q, k, v, do, o, lse, dtype, attn_bias=bias, causal=causal, precision=precision,
                 bias_requires_grad=True)
    if dtype == torch.float32:
        _check_fp32(grads, refs, TF32_BOUND if precision == "tf32" else FP32_ACCURATE)
        return
    lowp = _lowp_grads(q, k, v, do, bias=bias, causal=causal)
    for name, g, r, lp in zip(("dq", "dk", "dv", "dbias"), grads, refs, lowp):
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"


@pytest.mark.gpu
@pytest.mark.parametrize("N,D,causal", [(785, 128, False), (2100, 80, True), (4096, 128, False)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_half_precision_wide_heads(N, D, causal, dtype):
    # Head dims 65-128 in half precision take their own tiles (dK/dV 64 x 128, dQ 128 x 64 on 8 warps)
    B, H = 1, 2
    q, k, v, do, bias, _ = _problem(B, H, N, N, D, D, bias_shape=(1, H, N, N), seed=N + D)
    q, k, v, do, bias = (t.to(dtype) for t in (q, k, v, do, bias))
    refs, o, lse = _reference(q, k, v, do, bias=bias, causal=causal)
    grads = _run(q, k, v, do, o, lse, dtype, attn_bias=bias, causal=causal, precision="auto",
                 bias_requires_grad=True)
    lowp = _lowp_grads(q, k, v, do, bias=bias, causal=causal)
    for name, g, r, lp in zip(("dq", "dk", "dv", "dbias"), grads, refs, lowp):
        err, err_lp = _relerr(g, r), _relerr(lp, r)
        assert err <= LOWP_FACTOR * err_lp, f"{name}: {err:.3e} > {LOWP_FACTOR} x low-precision {err_lp:.3e}"


FP32_DEFAULT_TILES = 2e-6  # the float32 default at the GPU's own tiles measures 5e-7 to 8e-7 (H100)


@pytest.mark.gpu
@pytest.mark.parametrize("N,D,Dv", [(2100, 64, 64), (4096, 32, 32), (1500, 128, 128), (2100, 80, 80),
                                    (1300, 64, 128)])
@pytest.mark.parametrize("kpm,causal", [(False, False), (True, True)])
def test_gpu_fp32_default_tiles_past_1024_keys(N, D, Dv, kpm, causal):
    """The float32 default past 1,024 keys without a bias (on sm90 ``fp16x3`` with Q/dO and K/V split once,
    128 x 128 dQ tiles at head dims <= 64, three stages at 128), against float64: these tiles are not the
    ones ``test_gpu_large`` runs (its bias keeps the dQ tiles at 128 x 64)."""
    q, k, v, do, _, mask = _problem(1, 2, N, N, D, Dv, kpm=kpm, seed=N + D + Dv)
    refs, o, lse = _reference(q, k, v, do, mask=mask, causal=causal)
    grads = _run(q, k, v, do, o, lse, torch.float32, key_padding_mask=mask, causal=causal)
    _check_fp32(grads, refs, FP32_DEFAULT_TILES)


@pytest.mark.gpu
@pytest.mark.parametrize("D,Dv", [(16, 16), (32, 32), (40, 40), (32, 64), (64, 32), (64, 64), (72, 72),
                                  (80, 80), (96, 96), (111, 40), (128, 128), (128, 64), (64, 128),
                                  (160, 160)])
def test_gpu_fp16x3_head_dims(D, Dv):
    """The default float32 backward (fp16x3 on sm90, tf32x3 past head dim 128) at every head-dim pair, with
    a key padding mask and causal, against float64 (fresh inputs per pair)."""
    q, k, v, do, _, mask = _problem(2, 3, 785, 785, D, Dv, kpm=True, seed=D * 1000 + Dv)
    for causal in (False, True):
        refs, o, lse = _reference(q, k, v, do, mask=mask, causal=causal)
        grads = _run(q, k, v, do, o, lse, torch.float32, key_padding_mask=mask, causal=causal)
        _check_fp32(grads, refs, FP32_ACCURATE)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["auto", "ieee", "tf32x3", "fp16x3"])
@pytest.mark.parametrize("N,D", [(197, 64), (785, 72), (785, 128)])
def test_gpu_hidden_nonfinite_keys_reach_no_gradient(precision, N, D):
    """Keys hidden from every row (a -inf bias, causal too, or a band) holding NaN and infinities: the
    gradients are the clean inputs' at the GPU's tiles; and the reference rule with rows that see them."""
    q, k, v, do, bias, _ = _problem(2, 3, N, N + 13, D, D, bias_shape=(1, 3, N, N + 13), seed=N + D)
    for causal, keys in ((True, [7, N // 2, N // 2 + 1]), (False, list(range(100, 140)))):
        b = bias.clone()
        b[..., keys] = -math.inf
        refs, o, lse = _reference(q, k, v, do, bias=b, causal=causal)
        kp, vp = _poison_hidden_keys(k, v, keys)
        grads = _run(q, kp, vp, do, o, lse, torch.float32, attn_bias=b, causal=causal,
                     bias_requires_grad=True, precision=precision)
        _check_fp32(grads, refs, FP32_ACCURATE)
    for kind in NONFINITE_KINDS:
        q2, k2, v2, kw = nonfinite_case(kind, 1, 2, N, N + 13, D, seed=N)
        out, lse2 = elsa_fwd(q2, k2, v2, precision=precision, **kw)
        do2 = torch.randn(out.shape, generator=torch.Generator().manual_seed(2)).to(DEVICE)
        got = elsa_bwd(do2, q2, k2, v2, out, lse2, precision=precision, **kw)[:3]
        kw64 = {n: t.double() if n == "attn_bias" else t for n, t in kw.items()}
        q64, k64, v64 = (t.double() for t in (q2, k2, v2))
        o64, l64 = scan_attention(q64, k64, v64, return_lse=True, **kw64)
        want = attention_backward(do2.double(), q64, k64, v64, o64, l64, **kw64)[:3]
        for name, a, r in zip(("dq", "dk", "dv"), got, want):
            assert_nonfinite_like(a, r, FP32_ACCURATE, some_finite=name == "dq")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_reruns_bitwise(dtype):
    B, H, N, D = 2, 4, 3137, 64
    q, k, v, do, bias, mask = _problem(B, H, N, N, D, D, bias_shape=(1, H, N, N), kpm=True, seed=17)
    q, k, v, do, bias = (t.to(dtype) for t in (q, k, v, do, bias))
    with torch.no_grad():
        o, lse = scan_attention(q.float(), k.float(), v.float(), attn_bias=bias.float(),
                                key_padding_mask=mask, causal=True, return_lse=True, query_chunk=1024)
    o = o.to(dtype)
    kw = dict(attn_bias=bias, key_padding_mask=mask, causal=True, bias_requires_grad=True)
    first = elsa_bwd(do, q, k, v, o, lse, **kw)
    for _ in range(19):
        again = elsa_bwd(do, q, k, v, o, lse, **kw)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.gpu
def test_gpu_memory_linear_in_n():
    """Workspace + outputs of the backward grow linearly: peak growth at 2N over N is ~2, never ~4."""
    B, H, D = 1, 8, 64

    def extra(N):
        q, k, v, do = (torch.randn(B, H, N, D, device="cuda") for _ in range(4))
        o = torch.randn_like(q)
        lse = torch.randn(B, H, N, device="cuda")
        elsa_bwd(do, q, k, v, o, lse)  # compile outside the measurement
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        grads = elsa_bwd(do, q, k, v, o, lse)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
        del grads
        return peak

    small, large = extra(8192), extra(16384)
    assert small > 0
    assert 1.5 <= large / small <= 2.5, f"peak growth {large / small:.2f} (N^2 would be ~4)"
