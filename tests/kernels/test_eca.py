"""Exact Causal Attention: exactness of the Stage I / Stage II products, their multiply-add counts, and the
``backend="eca"`` attention (forward, gradients, gradcheck) against the float64 oracle."""

from __future__ import annotations

import math
import zlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from elsa_vision.kernels import eca as eca_mod
from elsa_vision.kernels import eca_masked_matmul, eca_tril_matmul, softmax_attention
from elsa_vision.kernels.eca import eca_attention, eca_multiply_adds
from elsa_vision.kernels.reference import attention_backward, scan_attention
from elsa_vision.ops.attention import elsa_attention, resolve_backend
from tests.helpers import assert_nonfinite_like, relerr

# ‖out − ref‖ / ‖ref‖ bounds of the products against the exact result (float64 inputs, float64 reference).
REL_TOL = {torch.float64: 1e-12, torch.float32: 1e-5}
LENGTHS = (1, 3, 17, 64, 127)
HEAD_DIMS = (1, 7, 64, 96)


def _gen(*key) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


# ---------------------------------------------------------------------------------------------- the scheme
def test_scheme_is_the_lower_triangle_tensor():
    """sum_r alpha[r,x] beta[r,y] gamma[r,z] == 1 iff x=(i,c), y=(j,c), z=(i,j), i>=j: the 24 + 10 products
    reproduce exactly the ten lower output blocks (the mask is injective on coefficients, so this is the
    condition for exactness), and the 10 half products feed only the 4 diagonal blocks."""
    alpha, beta, gamma = eca_mod._ALPHA, eca_mod._BETA, eca_mod._GAMMA
    assert alpha.shape == (34, 16) and beta.shape == (34, 16) and gamma.shape == (34, 10)
    got = torch.einsum("rx,ry,rz->xyz", alpha, beta, gamma)
    want = torch.zeros_like(got)
    for z, (i, j) in enumerate(eca_mod._OUT_BLOCKS):
        assert i >= j
        for c in range(4):
            want[4 * i + c, 4 * j + c, z] = 1
    assert torch.equal(got, want)
    lower = [z for z, (i, j) in enumerate(eca_mod._OUT_BLOCKS) if i > j]
    assert (gamma[24:, lower] == 0).all(), "a half product feeds a strictly-lower block"
    assert (gamma[:24, lower] != 0).any(dim=1).all(), "every full product must feed a strictly-lower block"


# ---------------------------------------------------------------------------------------------- exactness
@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("length", LENGTHS)
def test_masked_matmul_exact(length, d, dtype, depth):
    g = _gen("masked", length, d, depth)
    a = torch.randn(2, 3, length, d, dtype=torch.float64, generator=g)
    b = torch.randn(2, 3, length, d, dtype=torch.float64, generator=g)
    out = eca_masked_matmul(a.to(dtype), b.to(dtype), depth=depth)
    assert out.shape == (2, 3, length, length) and out.dtype == dtype
    ref = torch.tril(a @ b.mT)
    assert relerr(out, ref) <= REL_TOL[dtype]
    assert (out.triu(1) == 0).all()


@pytest.mark.parametrize("depth", [0, 1, 2])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("length", LENGTHS)
def test_tril_matmul_exact(length, d, dtype, depth):
    g = _gen("tril", length, d, depth)
    p = torch.randn(2, 3, length, length, dtype=torch.float64, generator=g)
    v = torch.randn(2, 3, length, d, dtype=torch.float64, generator=g)
    out = eca_tril_matmul(p.to(dtype), v.to(dtype), depth=depth)
    assert out.shape == (2, 3, length, d) and out.dtype == dtype
    assert relerr(out, torch.tril(p) @ v) <= REL_TOL[dtype]


def test_broadcast_and_noncontiguous():
    g = _gen("broadcast")
    a = torch.randn(2, 1, 45, 30, dtype=torch.float64, generator=g)
    b = torch.randn(1, 3, 30, 45, dtype=torch.float64, generator=g).mT  # a transposed view
    assert not b.is_contiguous()
    out = eca_masked_matmul(a, b)
    assert out.shape == (2, 3, 45, 45)
    assert relerr(out, torch.tril(a @ b.mT)) <= 1e-12
    p = torch.randn(3, 45, 45, dtype=torch.float64, generator=g).mT
    v = torch.randn(2, 1, 45, 30, dtype=torch.float64, generator=g)
    out = eca_tril_matmul(p, v)
    assert out.shape == (2, 3, 45, 30)
    assert relerr(out, torch.tril(p) @ v) <= 1e-12


def test_tril_matmul_never_reads_the_upper_triangle():
    """NaN above the diagonal of ``p`` never reaches the output: it equals the clean run bit for bit."""
    g = _gen("nan")
    p = torch.randn(2, 61, 61, dtype=torch.float64, generator=g)
    v = torch.randn(2, 61, 19, dtype=torch.float64, generator=g)
    poisoned = p.masked_fill(torch.ones(61, 61, dtype=torch.bool).triu(1), math.nan)
    for depth in (0, 1, 2):
        out = eca_tril_matmul(poisoned, v, depth=depth)
        assert torch.isfinite(out).all()
        assert torch.equal(out, eca_tril_matmul(torch.tril(p), v, depth=depth))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_within_4x_of_matmul_tril(dtype):
    """In float16/bfloat16 the block sums are rounded too: measured error ~3.9-4.0x that of ``tril(a @ b^T)``
    (resp. ``tril(p) @ v``) computed in the same dtype; the bound is 6x."""
    g = _gen("lowp", str(dtype))
    a = torch.randn(2, 127, 96, dtype=torch.float64, generator=g)
    b = torch.randn(2, 127, 96, dtype=torch.float64, generator=g)
    p = torch.randn(2, 127, 127, dtype=torch.float64, generator=g)
    ref_s, ref_o = torch.tril(a @ b.mT), torch.tril(p) @ b
    lo = [t.to(dtype) for t in (a, b, p)]
    base_s = relerr(torch.tril(lo[0] @ lo[1].mT), ref_s)
    base_o = relerr(torch.tril(lo[2]) @ lo[1], ref_o)
    for depth in (1, 2):
        s = eca_masked_matmul(lo[0], lo[1], depth=depth)
        o = eca_tril_matmul(lo[2], lo[1], depth=depth)
        assert s.dtype == dtype and o.dtype == dtype
        assert relerr(s, ref_s) <= 6 * base_s
        assert relerr(o, ref_o) <= 6 * base_o


def test_products_are_differentiable():
    g = _gen("autograd")
    a = torch.randn(1, 10, 5, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(1, 10, 5, dtype=torch.float64, generator=g, requires_grad=True)
    p = torch.randn(1, 10, 10, dtype=torch.float64, generator=g, requires_grad=True)
    assert torch.autograd.gradcheck(lambda x, y: eca_masked_matmul(x, y, depth=1), (a, b))
    assert torch.autograd.gradcheck(lambda x, y: eca_tril_matmul(x, y, depth=1), (p, b))


# ---------------------------------------------------------------------------------------------- multiply-adds
def _multiply_adds(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops() // 2  # FlopCounterMode counts 2 FLOPs per multiply-add


# With a = 24/64 (full products per level) and b = 10/64 (half products), half products at the deepest level
# done as full products then masked, ECA costs L^2 d * (a * sum_{t=0..depth} b^t + b^(depth+1)) multiply-adds
#   depth 0: 0.53125 L^2 d,  depth 1: 0.4580078125 L^2 d,  depth 2: 0.446563720703125 L^2 d,
# against 0.5 L^2 d for an ideal triangle and L^2 d for matmul + tril. Measured below at L = 256, d = 64
# (divisible by 4^3, so no padding): exactly 2228224, 1921024 and 1873024 multiply-adds (L^2 d = 4194304).
EXPECTED_FRACTION = {0: 0.53125, 1: 0.4580078125, 2: 0.446563720703125}
MEASURED = {0: 2228224, 1: 1921024, 2: 1873024}


def _closed_form(depth: int) -> float:
    a, b = 24 / 64, 10 / 64
    return a * sum(b**t for t in range(depth + 1)) + b ** (depth + 1)


@pytest.mark.parametrize("depth", [0, 1, 2])
def test_multiply_add_count(depth):
    length, d = 256, 64
    g = _gen("flops", depth)
    a = torch.randn(length, d, generator=g)
    b = torch.randn(length, d, generator=g)
    p = torch.randn(length, length, generator=g)
    full = length * length * d
    assert _multiply_adds(lambda: torch.matmul(a, b.mT).tril_()) == full
    stage1 = _multiply_adds(lambda: eca_masked_matmul(a, b, depth=depth))
    stage2 = _multiply_adds(lambda: eca_tril_matmul(p, b, depth=depth))
    assert stage1 == stage2 == eca_multiply_adds(length, d, depth) == MEASURED[depth]
    assert stage1 == round(_closed_form(depth) * full) == round(EXPECTED_FRACTION[depth] * full)
    ideal = 0.5 * full
    if depth == 1:
        assert stage1 <= 0.92 * ideal  # >= 8% below the ideal triangle (measured 8.40%)
    if depth == 2:
        assert stage1 <= 0.90 * ideal  # >= 10% below (measured 10.69%)


def test_attention_forward_backward_all_eca():
    """Forward (QK^T, PV) and backward (dO V^T, dS K, dS^T Q, P^T dO): six ECA products, nothing else."""
    length, d = 64, 16
    g = _gen("attn-flops")
    q, k, v = (torch.randn(1, 1, length, d, generator=g, requires_grad=True) for _ in range(3))

    def run():
        eca_attention(q, k, v, depth=1).sum().backward()

    assert _multiply_adds(run) == 6 * eca_multiply_adds(length, d, 1)


# ---------------------------------------------------------------------------------------------- attention
ATTN_SHAPES = [(2, 3, 1, 8, 8), (2, 3, 17, 40, 24), (1, 5, 64, 59, 59), (2, 2, 97, 32, 48)]


@pytest.mark.parametrize("depth", [1, 2])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("shape", ATTN_SHAPES)
def test_eca_backend_matches_reference(shape, with_bias, depth):
    """float32 inputs: output and q/k/v/bias gradients within 1e-5 (relative) of the float64 oracle."""
    B, H, N, D, Dv = shape
    g = _gen("attn", shape, with_bias, depth)
    q = torch.randn(B, H, N, D, dtype=torch.float64, generator=g)
    k = torch.randn(B, H, N, D, dtype=torch.float64, generator=g)
    v = torch.randn(B, H, N, Dv, dtype=torch.float64, generator=g)
    dout = torch.randn(B, H, N, Dv, dtype=torch.float64, generator=g)
    bias = torch.randn(1, H, N, N, dtype=torch.float64, generator=g) if with_bias else None
    inputs64 = [t.clone().requires_grad_() for t in (q, k, v) + ((bias,) if with_bias else ())]
    inputs32 = [t.detach().float().requires_grad_() for t in inputs64]

    ref = softmax_attention(*inputs64[:3], attn_bias=inputs64[3] if with_bias else None, causal=True)
    ref.backward(dout)
    if depth == 1:
        out = elsa_attention(*inputs32[:3], attn_bias=inputs32[3] if with_bias else None, causal=True,
                             backend="eca")
    else:
        out = eca_attention(*inputs32[:3], attn_bias=inputs32[3] if with_bias else None, depth=depth)
    out.backward(dout.float())
    assert out.dtype == torch.float32
    assert relerr(out, ref) <= 1e-5
    for got, want in zip(inputs32, inputs64):
        assert relerr(got.grad, want.grad) <= 1e-5


def test_rows_without_keys_are_zero_with_zero_grads():
    """Key 0 padded out: query 0 sees no key (causal), so its output row and gradients are 0, never NaN."""
    g = _gen("empty-rows")
    q, k, v = (torch.randn(2, 2, 13, 8, dtype=torch.float64, generator=g).requires_grad_() for _ in range(3))
    kpm = torch.ones(2, 13, dtype=torch.bool)
    kpm[:, 0] = False
    bias = torch.zeros(1, 2, 13, 13, dtype=torch.float64)
    bias[..., 5, :] = -math.inf  # row 5 hidden entirely by the bias
    out = elsa_attention(q, k, v, key_padding_mask=kpm, attn_bias=bias, causal=True, backend="eca")
    ref = softmax_attention(q, k, v, key_padding_mask=kpm, attn_bias=bias, causal=True)
    assert torch.isfinite(out).all()
    assert (out[:, :, 0] == 0).all() and (out[:, :, 5] == 0).all()
    assert relerr(out, ref) <= 1e-12
    out.sum().backward()
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[:, :, 0] == 0).all() and (q.grad[:, :, 5] == 0).all()
    assert (k.grad[:, :, 0] == 0).all()


@pytest.mark.parametrize("mask", ["causal", "bias", "kpm"])
def test_nonfinite_inputs_follow_the_reference_rule(mask):
    """A key a row cannot see (causality, a -inf bias, the padding mask) contributes nothing to it, forward
    and backward, whatever its key and value rows hold; a visible key's NaN logit makes its row NaN, a visible
    non-finite value its own column. ECA's block sums would spread them: such inputs take the reference
    scan."""
    g = _gen("nonfinite", mask)
    B, H, N, D = 1, 2, 40, 8
    q, k, v = (torch.randn(B, H, N, D, generator=g) for _ in range(3))
    kw = {}
    k[..., 30, 0] = math.nan  # rows 30-39 see it: NaN
    v[..., 30, 1] = math.inf
    v[..., 20, 2] = -math.inf  # rows 20-39: -inf in column 2
    hidden = 5  # hidden from every row by the mask below
    k[..., hidden, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    v[..., hidden, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    if mask == "bias":
        kw["attn_bias"] = torch.zeros(1, H, N, N).index_fill_(-1, torch.tensor([hidden]), -math.inf)
    elif mask == "kpm":
        kpm = torch.ones(B, N, dtype=torch.bool)
        kpm[:, hidden] = False
        kw["key_padding_mask"] = kpm
    else:
        k[..., hidden, :], v[..., hidden, :] = 1.0, 1.0  # causality alone: key 5 is visible to rows 5-39
        k[..., 35, :3] = torch.tensor([math.inf, -math.inf, math.nan])  # hidden from rows 0-34
        v[..., 35, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = elsa_attention(*leaves, causal=True, backend="eca", **kw)
    kw64 = {n: t.double() if n == "attn_bias" else t for n, t in kw.items()}
    ref, lse = scan_attention(*(t.double() for t in (q, k, v)), causal=True, return_lse=True, **kw64)
    assert_nonfinite_like(out, ref, 1e-5)
    assert torch.isfinite(out[..., :20, :]).all()
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    want = attention_backward(dout.double(), *(t.double() for t in (q, k, v)), ref, lse, causal=True, **kw64)
    assert_nonfinite_like(leaves[0].grad, want[0], 1e-5)  # the rows before key 20 keep finite gradients
    for got, ref_grad in zip((leaves[1].grad, leaves[2].grad), want[1:3]):
        assert_nonfinite_like(got, ref_grad, 1e-5, some_finite=False)


def test_gradcheck_float64():
    g = _gen("gradcheck")
    q, k = (torch.randn(1, 2, 6, 3, dtype=torch.float64, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(1, 2, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(2, 1, 6, dtype=torch.float64, generator=g, requires_grad=True)  # [H, 1, N] broadcast
    fn = lambda q, k, v, b: eca_attention(q, k, v, attn_bias=b, scale=0.7, depth=1)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v, bias))


def test_half_precision_attention_is_computed_in_float32():
    """float16/bfloat16 inputs: within 2x of the error of exact attention on the rounded inputs."""
    g = _gen("attn-half")
    q, k, v = (torch.randn(1, 2, 33, 16, dtype=torch.float64, generator=g) for _ in range(3))
    ref = softmax_attention(q, k, v, causal=True)
    for dtype in (torch.float16, torch.bfloat16):
        low = [t.to(dtype) for t in (q, k, v)]
        out = elsa_attention(*low, causal=True, backend="eca")
        assert out.dtype == dtype
        base = softmax_attention(*(t.double() for t in low), causal=True).to(dtype)
        assert relerr(out, ref) <= 2 * relerr(base, ref)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_products_and_attention():
    """On the GPU (float32, TF32 off): products and the attention backend within 1e-5 of float64."""
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        g = _gen("cuda")
        a = torch.randn(3, 1023, 111, dtype=torch.float64, generator=g)
        b = torch.randn(3, 1023, 111, dtype=torch.float64, generator=g)
        p = torch.randn(3, 1023, 1023, dtype=torch.float64, generator=g)
        for depth in (1, 2):
            s = eca_masked_matmul(a.float().cuda(), b.float().cuda(), depth=depth)
            o = eca_tril_matmul(p.float().cuda(), b.float().cuda(), depth=depth)
            assert relerr(s.cpu(), torch.tril(a @ b.mT)) <= 1e-5
            assert relerr(o.cpu(), torch.tril(p) @ b) <= 1e-5
        q, k, v = (torch.randn(2, 3, 197, 64, dtype=torch.float64, generator=g) for _ in range(3))
        inputs = [t.float().cuda().requires_grad_() for t in (q, k, v)]
        out = elsa_attention(*inputs, causal=True, backend="eca")
        out.sum().backward()
        ref_inputs = [t.clone().requires_grad_() for t in (q, k, v)]
        ref = softmax_attention(*ref_inputs, causal=True)
        ref.sum().backward()
        assert relerr(out.cpu(), ref) <= 1e-5
        for got, want in zip(inputs, ref_inputs):
            assert relerr(got.grad.cpu(), want.grad) <= 1e-5
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


# ---------------------------------------------------------------------------------------------- validation
def test_backend_eca_validation():
    q = torch.randn(1, 2, 9, 4)
    with pytest.raises(ValueError, match="causal=True"):
        elsa_attention(q, q, q, backend="eca")
    with pytest.raises(ValueError, match="Nq == Nk"):
        elsa_attention(q, torch.randn(1, 2, 11, 4), torch.randn(1, 2, 11, 4), causal=True, backend="eca")
    with pytest.raises(ValueError, match="dropout"):
        elsa_attention(q, q, q, causal=True, backend="eca", dropout_p=0.1)
    assert resolve_backend("auto", q) != "eca"
    assert resolve_backend("eca", q) == "eca"


def test_product_validation():
    a = torch.randn(5, 3)
    with pytest.raises(TypeError, match="floating-point"):
        eca_masked_matmul(a.long(), a)
    with pytest.raises(TypeError, match="share one dtype"):
        eca_masked_matmul(a, a.double())
    with pytest.raises(ValueError, match="equal L and d"):
        eca_masked_matmul(a, torch.randn(5, 4))
    with pytest.raises(ValueError, match="rank >= 2"):
        eca_masked_matmul(torch.randn(5), torch.randn(5))
    with pytest.raises(ValueError, match="depth"):
        eca_masked_matmul(a, a, depth=-1)
    with pytest.raises(ValueError, match="depth"):
        eca_tril_matmul(torch.randn(5, 5), a, depth=True)
    with pytest.raises(ValueError, match=r"\[\.\.\., L, L\]"):
        eca_tril_matmul(torch.randn(5, 4), a)
    with pytest.raises(ValueError, match="do not broadcast"):
        eca_masked_matmul(torch.randn(2, 5, 3), torch.randn(3, 5, 3))
    with pytest.raises(TypeError, match="torch.Tensor"):
        eca_tril_matmul([[1.0]], a)
    with pytest.raises(TypeError, match="`p` and `v` must share one dtype"):
        eca_tril_matmul(torch.randn(5, 5), a.double())
    with pytest.raises(ValueError, match=r"leading dims of p=\[2, 5, 5\] and v=\[3, 5, 3\] do not broadcast"):
        eca_tril_matmul(torch.randn(2, 5, 5), torch.randn(3, 5, 3))
    with pytest.raises(ValueError, match="`a` and `b` must be on one device"):
        eca_masked_matmul(a, a.to("meta"))
    with pytest.raises(ValueError, match=">= 1"):
        eca_masked_matmul(torch.randn(0, 3), torch.randn(0, 3))
