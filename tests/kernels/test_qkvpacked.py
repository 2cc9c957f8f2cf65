"""``elsa_attention_qkvpacked``: attention of a packed ``[B, N, 3, H, D]`` projection whose backward writes
the projection's gradient in one piece (``elsa_bwd(..., grads=...)``).

Every path against the float64 reference and against the unpacked ``elsa_attention`` of the same views:
the same kernels with other output strides, so the same bits wherever the backward is deterministic. On the
CPU the kernels run in Triton's interpreter (small odd shapes); the ``gpu`` tests repeat the checks at ViT
and long-sequence sizes, the Hopper backwards (five-product and two-pass) included.
"""

import math

import pytest
import torch

from elsa_vision import ElsaAttention, elsa_attention, elsa_attention_qkvpacked
from elsa_vision.kernels.reference import softmax_attention
from elsa_vision.ops.attention import unpack_qkv
from tests.helpers import DEVICE, elsa_ops_seen, randn, relerr


def _packed(B, N, H, D, seed, dtype=torch.float32, scale=1.0):
    return randn(B, N, 3, H, D, seed=seed, dtype=dtype, scale=scale)


def _run(fn, qkv, dout):
    """``(out [B, N, H, D], dqkv)`` of ``fn(qkv)`` on a fresh leaf."""
    leaf = qkv.detach().clone().requires_grad_()
    out = fn(leaf)
    out.backward(dout)
    return out.detach(), leaf.grad


def _unpacked(causal=False, precision="auto", backend="triton"):
    def fn(qkv):
        q, k, v = unpack_qkv(qkv)
        return elsa_attention(q, k, v, causal=causal, precision=precision, backend=backend).transpose(1, 2)
    return fn


def _reference(qkv, dout, causal=False):
    """Float64 output and ``dqkv`` of the textbook softmax attention."""
    def fn(t):
        q, k, v = unpack_qkv(t)
        return softmax_attention(q, k, v, causal=causal).transpose(1, 2)
    return _run(fn, qkv.double(), dout.double())


CASES = [  # B, N, H, D, causal, dtype
    (1, 37, 2, 32, False, torch.float32),
    (2, 29, 3, 72, True, torch.float32),
    (2, 45, 1, 16, False, torch.bfloat16),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:5])) + f"-{str(c[5])[6:]}")
def test_packed_matches_float64_and_the_unpacked_call(case):
    """Output and ``dqkv`` within the kernels' bounds of float64 (FP32-accurate: 1e-6 forward, 1e-5
    backward; bfloat16: the rounding of its inputs' products, 2e-2 / 5e-2) and bitwise the unpacked call's
    (the same kernels, the gradients written through other strides); ``dqkv`` is one contiguous tensor."""
    B, N, H, D, causal, dtype = case
    qkv = _packed(B, N, H, D, seed=N + D, dtype=dtype)
    dout = randn(B, N, H, D, seed=N + D + 1, dtype=dtype)
    out, g = _run(lambda t: elsa_attention_qkvpacked(t, causal=causal, backend="triton"), qkv, dout)
    out_u, g_u = _run(_unpacked(causal), qkv, dout)
    out_ref, g_ref = _reference(qkv, dout, causal)
    assert out.shape == (B, N, H, D) and out.dtype == dtype
    assert g.shape == qkv.shape and g.is_contiguous() and g.dtype == dtype
    fp32 = dtype == torch.float32
    assert relerr(out, out_ref) <= (1e-6 if fp32 else 2e-2)
    assert relerr(g, g_ref) <= (1e-5 if fp32 else 5e-2)
    assert torch.equal(out, out_u) and torch.equal(g, g_u)


@pytest.mark.parametrize("backend", ["torch", "eca"])
def test_other_backends_give_the_unpacked_call(backend):
    """The torch and ECA backends run the unpacked call on the views (autograd through them): the same
    output and gradient."""
    qkv = _packed(2, 13, 2, 8, seed=5)
    dout = randn(2, 13, 2, 8, seed=6)
    out, g = _run(lambda t: elsa_attention_qkvpacked(t, causal=True, backend=backend), qkv, dout)
    out_u, g_u = _run(_unpacked(True, backend=backend), qkv, dout)
    assert torch.equal(out, out_u) and torch.equal(g, g_u)


def test_inference_and_non_contiguous_inputs():
    """Without autograd the forward runs alone; a strided ``qkv`` (a slice of a wider projection) gives the
    result of its contiguous copy, and its gradient comes back in ``qkv``'s shape."""
    wide = _packed(2, 21, 4, 16, seed=9)
    qkv = wide[:, :, :, 1:3]  # H = 2 of 4: every stride but the head dim's is not the contiguous one
    assert not qkv.is_contiguous()
    with torch.no_grad():
        out = elsa_attention_qkvpacked(qkv, backend="triton")
    assert torch.equal(out, elsa_attention_qkvpacked(qkv.contiguous(), backend="triton").detach())
    dout = randn(2, 21, 2, 16, seed=10)
    _, g = _run(lambda t: elsa_attention_qkvpacked(t[:, :, :, 1:3], backend="triton"), wide, dout)
    _, g_ref = _reference(qkv, dout)
    assert relerr(g[:, :, :, 1:3], g_ref) <= 1e-5
    assert torch.equal(g[:, :, :, [0, 3]], torch.zeros_like(g[:, :, :, [0, 3]]))


def test_large_logits_and_empty_inputs_stay_finite():
    """Logits in the thousands (rows close to one-hot, far past ``exp``'s float32 range) give finite outputs
    and gradients, the output within the FP32-accurate bound of float64 and ``dv`` within what float32
    logits allow: the backward recomputes ``P = exp(s - lse)``, whose exponent carries the rounding of the
    largest logit ``L`` (4 roundings: ``4 L 2^-24``, 7e-4 here; 1.1e-4 measured on an H100); empty batches
    and sequences give empty results and zero gradients."""
    qkv = _packed(1, 19, 2, 16, seed=11)
    qkv[:, :, :2] *= 30.0  # q and k: logits up to about 3,000
    dout = randn(1, 19, 2, 16, seed=12)
    out, g = _run(lambda t: elsa_attention_qkvpacked(t, backend="triton"), qkv, dout)
    out_ref, g_ref = _reference(qkv, dout)
    q, k, _ = unpack_qkv(qkv.double())
    largest = ((q @ k.transpose(-1, -2)) * 16**-0.5).abs().max().item()
    assert torch.isfinite(out).all() and torch.isfinite(g).all()
    assert relerr(out, out_ref) <= 1e-6
    assert relerr(g[:, :, 2], g_ref[:, :, 2]) <= 4 * largest * 2**-24
    for shape in ((0, 5, 3, 2, 8), (2, 0, 3, 2, 8)):
        leaf = torch.randn(shape, device=DEVICE, requires_grad=True)
        out = elsa_attention_qkvpacked(leaf, backend="triton")
        assert out.shape == (shape[0], shape[1], 2, 8)
        out.sum().backward()
        assert torch.equal(leaf.grad, torch.zeros_like(leaf))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_huge_logits_give_finite_gradients(dtype):
    """Logits near 1e36 (``q``, ``k`` ~1e18: rows one-hot) give the output within the bounds of float64 and
    finite gradients, never NaN: the backward's recomputed ``P = exp(s - lse)`` is clamped at 1, which the
    rounding of ``s`` (~1e29 here) would otherwise push to ``inf``. Their values are not checked: no float32
    recomputation of such logits can resolve ``s - lse`` (``Large finite logits in the backward``)."""
    qkv = _packed(2, 23, 2, 16, seed=13).to(dtype)
    qkv[:, :, :2] *= 1e18
    dout = randn(2, 23, 2, 16, seed=14, dtype=dtype)
    out, g = _run(lambda t: elsa_attention_qkvpacked(t, backend="triton"), qkv, dout)
    out_ref, _ = _reference(qkv, dout)
    assert relerr(out, out_ref) <= (1e-6 if dtype == torch.float32 else 1e-2)
    assert torch.isfinite(g).all()


SHAPE = r"`qkv` must have shape \[B, N, 3, H, D\], "


@pytest.mark.parametrize("bad,err,match", [
    (torch.zeros(2, 5, 2, 8), ValueError, SHAPE + r"got \[2, 5, 2, 8\]"),
    (torch.zeros(2, 5, 4, 2, 8), ValueError, SHAPE + r"got \[2, 5, 4, 2, 8\]"),
    (torch.zeros(2, 5, 3, 2, 8, dtype=torch.int32), TypeError, "unsupported dtype torch.int32"),
    (torch.zeros(2, 5, 3, 2, 0), ValueError, "head dims must be >= 1"),
    ("qkv", TypeError, "`qkv` must be a torch.Tensor"),
])
def test_bad_inputs_are_refused_naming_the_entry(bad, err, match):
    with pytest.raises(err, match=r"^elsa_attention_qkvpacked: .*" + match):
        elsa_attention_qkvpacked(bad)


def test_bad_options_are_refused_naming_the_entry():
    qkv = torch.zeros(1, 4, 3, 1, 8)
    with pytest.raises(ValueError, match="^elsa_attention_qkvpacked: unknown precision 'fp8'"):
        elsa_attention_qkvpacked(qkv, precision="fp8")
    with pytest.raises(TypeError, match="^elsa_attention_qkvpacked: `causal` must be a bool"):
        elsa_attention_qkvpacked(qkv, causal=1)
    with pytest.raises(ValueError, match="^elsa_attention_qkvpacked: backend='eca' computes causal"):
        elsa_attention_qkvpacked(qkv, backend="eca")


def test_backward_operator_passes_opcheck():
    qkv = _packed(1, 11, 2, 16, seed=12)
    q, k, v = unpack_qkv(qkv)
    out, lse = torch.ops.elsa_vision.attention_fwd(q, k, v, None, None, False, 0.25, "auto")
    dout = torch.randn_like(out)
    torch.library.opcheck(torch.ops.elsa_vision.attention_bwd_qkvpacked.default,
                          (dout, qkv, out, lse, False, 0.25, "auto"))


def test_layer_trains_on_the_packed_entry_only_where_it_applies():
    """``ElsaAttention`` with autograd attends the packed projection (the packed backward operator runs),
    with a q/k norm or a mask the unpacked call (the plain backward operator), with attention dropout the
    torch backend (no operator), without autograd its planned forward; the packed route's output and
    gradients are the unpacked route's."""
    torch.manual_seed(3)
    layer = ElsaAttention(32, num_heads=2, qkv_bias=True, backend="triton").to(DEVICE)
    normed = ElsaAttention(32, num_heads=2, qk_norm=True, norm_layer=torch.nn.LayerNorm, backend="triton")
    normed = normed.to(DEVICE)
    dropped = ElsaAttention(32, num_heads=2, attn_drop=0.1, backend="triton").to(DEVICE)
    x = torch.randn(2, 9, 32, device=DEVICE)
    mask = torch.ones(9, 9, dtype=torch.bool, device=DEVICE)
    with elsa_ops_seen() as mode:
        layer(x).sum().backward()
    assert mode.ops == ["attention_fwd", "attention_bwd_qkvpacked"]
    for call in (lambda: normed(x), lambda: layer(x, attn_mask=mask)):
        with elsa_ops_seen() as mode:
            call().sum().backward()
        assert mode.ops == ["attention_fwd", "attention_bwd"]
    with elsa_ops_seen() as mode:
        dropped(x).sum().backward()
        with torch.no_grad():
            layer(x)
    assert mode.ops == ["attention_fwd"]  # the planned inference call (the dropout layer's: none)
    grads = {}
    for route, m in (("packed", None), ("unpacked", mask)):
        layer.zero_grad()
        xl = x.clone().requires_grad_()
        out = layer(xl, attn_mask=m)
        out.backward(torch.ones_like(out))
        grads[route] = [out.detach(), xl.grad] + [p.grad.clone() for p in layer.parameters()]
    for a, b in zip(grads["packed"], grads["unpacked"]):
        assert relerr(a, b) <= 1e-6  # an all-True mask is a zero bias: the same sums, bias added


# --- GPU: ViT and long-sequence sizes, the Hopper backwards -----------------------------------------------

GPU_CASES = [  # B, N, H, D, dtype, precision: the generic kernels at ViT sizes, the Hopper backwards past
    (8, 197, 12, 64, torch.bfloat16, "auto"),  # their minimum lengths (head dim 128 from 192 keys, 64 from
    (2, 785, 12, 72, torch.float32, "auto"),   # 1,024), FP32 on fp16x3 with its operands split once
    (2, 197, 6, 128, torch.bfloat16, "auto"),
    (1, 2053, 4, 64, torch.bfloat16, "auto"),
    (1, 1031, 4, 128, torch.float16, "auto"),
    (2, 3137, 2, 64, torch.float32, "fp16x3"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("deterministic", [False, True], ids=["default", "deterministic"])
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: "-".join(map(str, c[:4])) + f"-{str(c[4])[6:]}")
def test_gpu_packed_matches_float64_and_the_unpacked_call(case, deterministic):
    """At real sizes, with the GPU's routes (deterministic algorithms: the Hopper two-pass backward instead of
    the five-product one): within the bounds of float64 and the unpacked call's results, bitwise except the
    five-product backward's dQ, a float32 sum in no fixed order (its rerun spread, 1e-3 in half precision)."""
    B, N, H, D, dtype, precision = case
    qkv = _packed(B, N, H, D, seed=N + D, dtype=dtype)
    dout = randn(B, N, H, D, seed=N, dtype=dtype)
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        out, g = _run(lambda t: elsa_attention_qkvpacked(t, precision=precision, backend="triton"), qkv, dout)
        out_u, g_u = _run(_unpacked(precision=precision), qkv, dout)
    finally:
        torch.use_deterministic_algorithms(before)
    out_ref, g_ref = _reference(qkv, dout)
    fp32 = dtype == torch.float32
    assert relerr(out, out_ref) <= (1e-6 if fp32 else 2e-2)
    assert relerr(g, g_ref) <= (1e-5 if fp32 else 5e-2)
    assert torch.equal(out, out_u)
    assert torch.equal(g[:, :, 1:], g_u[:, :, 1:])  # dK, dV
    five_product = not fp32 and not deterministic and N >= {64: 1024, 128: 192}.get(D, math.inf)
    if five_product:
        assert relerr(g[:, :, 0], g_u[:, :, 0]) <= 1e-3
    else:
        assert torch.equal(g[:, :, 0], g_u[:, :, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("N,D", [(1031, 128), (2053, 64)])
def test_gpu_huge_logits_give_finite_gradients_on_the_hopper_backward(N, D):
    """Logits near 1e36 through the half-precision Hopper backwards (five-product and, with deterministic
    algorithms, two passes): the tiles whose gradients come out non-finite are redone by the generic kernels,
    whose ``P`` is clamped at 1: finite gradients."""
    qkv = _packed(1, N, 2, D, seed=N).to(torch.bfloat16)
    qkv[:, :, :2] *= 1e18
    dout = randn(1, N, 2, D, seed=N + 1, dtype=torch.bfloat16)
    before = torch.are_deterministic_algorithms_enabled()
    for deterministic in (False, True):
        torch.use_deterministic_algorithms(deterministic)
        try:
            out, g = _run(lambda t: elsa_attention_qkvpacked(t), qkv, dout)
        finally:
            torch.use_deterministic_algorithms(before)
        assert torch.isfinite(out).all() and torch.isfinite(g).all()


@pytest.mark.gpu
def test_gpu_cuda_graph_replays_the_packed_backward():
    """Captured in a CUDA graph (forward and backward), replays give the eager call's output and gradient."""
    from tests.helpers import cuda_graph

    qkv = _packed(4, 197, 12, 64, seed=21, dtype=torch.bfloat16).requires_grad_()
    dout = randn(4, 197, 12, 64, seed=22, dtype=torch.bfloat16)

    def step():
        qkv.grad = None
        out = elsa_attention_qkvpacked(qkv)
        out.backward(dout)
        return out, qkv.grad

    graph, (out, g) = cuda_graph(step)
    graph.replay()
    torch.cuda.synchronize()
    got = (out.clone(), g.clone())
    want = step()
    assert torch.equal(got[0], want[0].detach()) and torch.equal(got[1], want[1])
