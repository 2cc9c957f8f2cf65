"""The Triton path as one autograd-aware torch operator: gradients, opcheck, torch.compile, CUDA graphs,
training.

On CPU the kernels run in Triton's interpreter (small odd shapes); the `gpu` tests repeat the checks at real
sizes on CUDA.
"""

import math

import pytest
import torch

from elsa_vision import ElsaAttention, elsa_attention, elsa_attention_qkvpacked, elsa_attention_varlen
from elsa_vision.kernels.reference import scan_attention, softmax_attention
from tests.helpers import NONFINITE_KINDS, assert_nonfinite_like, elsa_ops_seen, nonfinite_case, relerr

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(B, H, Nq, Nk, D, Dv, dtype=torch.float32, bias_shape=None, device=DEV):
    q = torch.randn(B, H, Nq, D, device=device, dtype=dtype)
    k = torch.randn(B, H, Nk, D, device=device, dtype=dtype)
    v = torch.randn(B, H, Nk, Dv, device=device, dtype=dtype)
    bias = None if bias_shape is None else torch.randn(bias_shape, device=device, dtype=dtype)
    return q, k, v, bias


def _grads(fn, tensors, dout):
    leaves = [None if t is None else t.detach().clone().requires_grad_() for t in tensors]
    out = fn(*leaves)
    out.backward(dout)
    return out.detach(), [None if t is None else t.grad for t in leaves]


CASES = [  # B, H, Nq, Nk, D, Dv, causal, bias shape
    (1, 2, 37, 37, 32, 32, False, None),
    (2, 1, 29, 45, 40, 24, True, (1, 1, 29, 45)),
    (1, 3, 50, 17, 16, 16, True, (1, 3, 50, 17)),
    (2, 2, 33, 33, 72, 72, False, (2, 1, 1, 33)),
]


def _case_id(c, precision):
    return "-".join(map(str, c[:7])) + f"-bias{c[7]}" + ("" if precision == "auto" else f"-{precision}")


# "tf32x3" (three TF32 products; "auto" on tensor-core GPUs other than sm90) on one case with bias and causal.
OP_CASES = [(c, "auto") for c in CASES] + [(CASES[1], "tf32x3")]


@pytest.mark.parametrize("case,precision", OP_CASES, ids=[_case_id(*c) for c in OP_CASES])
def test_triton_op_forward_and_gradients_match_float64(case, precision):
    B, H, Nq, Nk, D, Dv, causal, bias_shape = case
    q, k, v, bias = _inputs(B, H, Nq, Nk, D, Dv, bias_shape=bias_shape)
    dout = torch.randn(B, H, Nq, Dv, device=DEV)

    def ours(q, k, v, b):
        return elsa_attention(q, k, v, attn_bias=b, causal=causal, backend="triton", precision=precision)

    def ref(q, k, v, b):
        return softmax_attention(q, k, v, attn_bias=b, causal=causal)

    out, g = _grads(ours, (q, k, v, bias), dout)
    out_ref, g_ref = _grads(ref, [None if t is None else t.double() for t in (q, k, v, bias)], dout.double())
    assert relerr(out, out_ref) <= 1e-6  # "auto" and "tf32x3" are FP32-accurate
    for got, want in zip(g, g_ref):
        if want is not None:
            assert torch.isfinite(got).all()
            assert relerr(got, want) <= 1e-5  # backward FP32-accurate bound of the kernel tests


def test_fully_masked_rows_give_zero_finite_grads():
    q, k, v, bias = _inputs(1, 2, 21, 21, 16, 16, bias_shape=(1, 2, 21, 21))
    bias[..., 4, :] = -math.inf
    dout = torch.randn(1, 2, 21, 16, device=DEV)

    def fn(q, k, v, b):
        return elsa_attention(q, k, v, attn_bias=b, backend="triton")

    out, g = _grads(fn, (q, k, v, bias), dout)
    assert torch.equal(out[..., 4, :], torch.zeros_like(out[..., 4, :]))
    for t in g:
        assert torch.isfinite(t).all()
    assert torch.equal(g[0][..., 4, :], torch.zeros_like(g[0][..., 4, :]))
    assert torch.equal(g[3][..., 4, :], torch.zeros_like(g[3][..., 4, :]))


def test_opcheck():
    q, k, v, bias = _inputs(1, 2, 19, 23, 16, 8, bias_shape=(1, 2, 19, 23))
    kpm = torch.rand(1, 23, device=DEV) > 0.2
    for t in (q, k, v, bias):
        t.requires_grad_()
    torch.library.opcheck(torch.ops.elsa_vision.attention_fwd.default,
                          (q, k, v, bias, kpm, True, 0.25, "auto"))
    torch.library.opcheck(torch.ops.elsa_vision.attention_fwd.default,
                          (q, k, v, None, None, False, 0.25, "ieee"))


def test_eager_bypass_skips_the_dispatcher_only_when_nothing_can_intercept():
    """``_library.eager_bypass(t, body, op)``: the operator's body for a plain tensor in plain eager code, the
    operator for a tensor subclass, inside a dispatch or torch-function mode and under a functorch
    transform."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from elsa_vision.ops._library import eager_bypass

    class Sub(torch.Tensor):
        pass

    class Dispatch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    t = torch.zeros(3)
    assert eager_bypass(t, "body", "op") == "body"
    assert eager_bypass(t.as_subclass(Sub), "body", "op") == "op"
    with Dispatch():
        assert eager_bypass(t, "body", "op") == "op"
    with TorchFunctionMode():
        assert eager_bypass(t, "body", "op") == "op"
    seen = []
    torch.func.vmap(lambda x: seen.append(eager_bypass(x, "body", "op")) or x)(torch.zeros(2, 3))
    assert seen == ["op"]


def test_every_operator_call_reaches_a_dispatch_mode():
    """Each call site of the five operators (attention forward with and without autograd, its backward, the
    packed entry's forward with and without autograd and its backward, the window op's forward with and
    without autograd and its backward, ``ElsaAttention``'s planned inference) gives the operator to a
    dispatch mode instead of running its body."""
    from elsa_vision.ops.window_attention import window_attention

    q, k, v = (torch.randn(1, 2, 9, 16, device=DEV, requires_grad=True) for _ in range(3))
    wq, wk, wv = (torch.randn(2, 2, 16, 8, device=DEV, requires_grad=True) for _ in range(3))
    bias = torch.randn(2, 16, 16, device=DEV, requires_grad=True)
    packed = torch.randn(1, 9, 3, 2, 16, device=DEV, requires_grad=True)
    layer = ElsaAttention(32, num_heads=2, backend="triton").to(DEV).eval()
    with elsa_ops_seen() as mode:
        elsa_attention(q, k, v, backend="triton").sum().backward()
        elsa_attention_qkvpacked(packed, backend="triton").sum().backward()
        window_attention(wq, wk, wv, None, bias).sum().backward()
        with torch.no_grad():
            elsa_attention(q, k, v, backend="triton")
            elsa_attention_qkvpacked(packed, backend="triton")
            window_attention(wq, wk, wv, None, bias)
            layer(torch.randn(2, 5, 32, device=DEV))
    assert sorted(mode.ops) == sorted(["attention_fwd"] * 5 + ["attention_bwd", "attention_bwd_qkvpacked"]
                                      + ["window_attention_fwd"] * 2 + ["window_attention_bwd"])


def test_torch_compile_fullgraph_matches_eager():
    layer = ElsaAttention(dim=32, num_heads=2, qkv_bias=True, backend="triton").to(DEV)
    x = torch.randn(2, 17, 32, device=DEV, requires_grad=True)
    eager = layer(x)
    g_eager = torch.autograd.grad(eager.square().sum(), [x, *layer.parameters()])
    # CPU: aot_eager exercises fake tensors and the autograd graph without a C++ toolchain round trip.
    compiled = torch.compile(layer, fullgraph=True, backend="inductor" if DEV == "cuda" else "aot_eager")
    out = compiled(x)
    g = torch.autograd.grad(out.square().sum(), [x, *layer.parameters()])
    assert relerr(out, eager) <= 1e-6
    for a, b in zip(g, g_eager):
        assert relerr(a, b) <= 1e-5


def test_vit_trains_one_step_through_the_triton_op():
    import timm

    import elsa_vision  # noqa: F401

    model = timm.create_model("elsa_vit_tiny_patch16_224", img_size=32, patch_size=8, num_classes=5, depth=2,
                              attn_backend="triton").to(DEV)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x = torch.randn(4, 3, 32, 32, device=DEV)
    y = torch.tensor([0, 1, 2, 3], device=DEV)
    losses = []
    for _ in range(3):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)
    assert losses[-1] < losses[0]


def test_varlen_trains_through_the_differentiable_op():
    lens = [5, 11, 3]
    cu = torch.tensor([0, 5, 16, 19], dtype=torch.int32, device=DEV)
    q = torch.randn(19, 2, 16, device=DEV, requires_grad=True)
    k = torch.randn(19, 2, 16, device=DEV, requires_grad=True)
    v = torch.randn(19, 2, 16, device=DEV, requires_grad=True)
    out = elsa_attention_varlen(q, k, v, cu, cu, max(lens), max(lens), backend="triton")
    out.square().sum().backward()
    start = 0
    for n in lens:
        qs, ks, vs = (t.detach()[start:start + n].double().transpose(0, 1)[None].requires_grad_()
                      for t in (q, k, v))
        ref = softmax_attention(qs, ks, vs)
        ref.square().sum().backward()
        assert relerr(out[start:start + n].transpose(0, 1)[None], ref) <= 1e-6
        assert relerr(q.grad[start:start + n].transpose(0, 1)[None], qs.grad) <= 1e-5
        start += n


BACKENDS = ["torch", "triton"]


def _nan_case(where: str):
    q, k, v, bias = _inputs(1, 2, 13, 21, 16, 16, bias_shape=(1, 2, 13, 21))
    kpm = None
    if where == "q":
        q[0, 0, 3, 5] = math.nan
    elif where == "k":
        k[0, 1, 7, 2] = math.nan
    elif where == "v":
        v[0, 0, 2, 1] = math.nan
    elif where == "bias":
        bias[0, 0, 4, 6] = math.nan
    elif where == "hidden_k":  # a key the padding mask hides: must not leak
        k[0, 1, 7, 2] = math.nan
        v[0, 1, 7, :] = math.nan
        kpm = torch.ones(1, 21, dtype=torch.bool, device=DEV)
        kpm[0, 7] = False
    elif where == "overflow":  # logits past float32 range: +inf scores, as in softmax
        q = q * 1e20
        k = k * 1e20
    return q, k, v, bias, kpm


@pytest.mark.parametrize("where", ["q", "k", "v", "bias", "hidden_k", "overflow"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_propagates_as_in_softmax(where, backend):
    """A NaN logit or value of a visible key (or an overflowing logit) makes exactly the rows / entries NaN
    that float32 softmax attention (SDPA's math) makes NaN -- never a plausible 0 -- and a NaN behind the
    padding mask stays hidden."""
    q, k, v, bias, kpm = _nan_case(where)
    out = elsa_attention(q, k, v, attn_bias=bias, key_padding_mask=kpm, backend=backend, precision="ieee")
    mask = bias
    if kpm is not None:  # the reference is the clean run: SDPA multiplies the hidden NaN values by 0
        mask = bias.masked_fill(~kpm[:, None, None, :], -math.inf)
        k, v = (t.masked_fill(~kpm[:, None, :, None], 0.0) for t in (k, v))
    want = torch.nn.functional.scaled_dot_product_attention(q.cpu(), k.cpu(), v.cpu(), attn_mask=mask.cpu())
    assert torch.equal(torch.isnan(out).cpu(), torch.isnan(want))
    assert torch.isnan(want).any() == (where not in ("hidden_k",))
    ok = ~torch.isnan(want)
    assert torch.allclose(out.cpu()[ok], want[ok], rtol=1e-5, atol=1e-5)


def _spec_grads(q, k, v, kw, dout):
    """Output and gradients (q, k, v, bias) of the float64 reference scan: the rule every backend follows."""
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    bias = kw.get("attn_bias")
    b = None if bias is None else bias.detach().double().requires_grad_()
    out = scan_attention(*leaves, attn_bias=b, key_padding_mask=kw.get("key_padding_mask"),
                         causal=kw.get("causal", False))
    out.backward(dout.double())
    return out.detach(), [t.grad for t in leaves] + [None if b is None else b.grad]


def _check_backend_against_spec(q, k, v, kw, backend, precision, tol, grad_tol):
    dout = torch.randn(q.shape[:-1] + (v.shape[-1],), generator=torch.Generator().manual_seed(1)).to(q.device)
    bias = kw.get("attn_bias")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    b = None if bias is None else bias.detach().clone().requires_grad_()
    out = elsa_attention(*leaves, attn_bias=b, key_padding_mask=kw.get("key_padding_mask"),
                         causal=kw.get("causal", False), backend=backend, precision=precision)
    out.backward(dout.to(out.dtype))
    ref, ref_grads = _spec_grads(q, k, v, kw, dout)
    assert_nonfinite_like(out, ref, tol)
    got_grads = [t.grad for t in leaves] + [None if b is None else b.grad]
    for name, got, want in zip(("q", "k", "v", "bias"), got_grads, ref_grads):
        if want is not None:
            assert_nonfinite_like(got, want, grad_tol, some_finite=name in ("q", "bias"))


@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_hidden_nonfinite_inputs_follow_the_reference_rule(kind, backend):
    """NaN and infinities in key and value rows that the masks hide from some or every row: forward and
    backward of the public op, per backend, are non-finite exactly where the float64 reference scan is and
    match it elsewhere (``backend="eca"``: tests/kernels/test_eca.py)."""
    q, k, v, kw = nonfinite_case(kind, 1, 2, 45, 77, 24, Dv=40, seed=81)
    _check_backend_against_spec(q, k, v, kw, backend, "ieee", 1e-6, 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", [(0, 2, 5, 7), (2, 0, 5, 7), (2, 2, 0, 7), (2, 2, 5, 0)],
                         ids=["B0", "H0", "Nq0", "Nk0"])
def test_empty_inputs_give_empty_or_zero_outputs(backend, shape):
    """Empty in, empty out: an empty batch, head axis or query set gives an empty ``[B, H, Nq, Dv]`` result,
    no keys give zeros; the backward runs and gives zero gradients of the inputs' shapes."""
    B, H, Nq, Nk = shape
    q, k, v, _ = _inputs(B, H, Nq, Nk, 16, 8)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = elsa_attention(*leaves, backend=backend)
    assert out.shape == (B, H, Nq, 8) and out.dtype == q.dtype
    assert torch.equal(out, torch.zeros_like(out))
    out.sum().backward()
    for t in leaves:
        assert t.grad.shape == t.shape and torch.equal(t.grad, torch.zeros_like(t))


@pytest.mark.gpu
def test_cuda_graph_capture_and_replay_is_bitwise_stable():
    q, k, v, _ = _inputs(2, 4, 197, 197, 64, 64)
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dout = torch.randn(2, 4, 197, 64, device="cuda")
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm up (compiles and caches the kernels) on a side stream
        for _ in range(2):
            for t in leaves:
                t.grad = None
            elsa_attention(*leaves, backend="triton").backward(dout)
    torch.cuda.current_stream().wait_stream(s)
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = elsa_attention(*leaves, backend="triton")
        out.backward(dout)
    results = []
    for _ in range(2):
        graph.replay()
        torch.cuda.synchronize()
        results.append([out.clone()] + [t.grad.clone() for t in leaves])
    eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    eager = elsa_attention(*eager_leaves, backend="triton")
    eager.backward(dout)
    for a, b in zip(results[0], results[1]):
        assert torch.equal(a, b)
    assert torch.equal(results[0][0], eager.detach())
    for got, t in zip(results[0][1:], eager_leaves):
        assert torch.equal(got, t.grad)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", NONFINITE_KINDS)
@pytest.mark.parametrize("N,D", [(197, 64), (197, 72), (785, 128)])
@pytest.mark.parametrize("dtype,precision", [(torch.float32, "auto"), (torch.float32, "ieee"),
                                             (torch.float32, "tf32x3"), (torch.float32, "fp16x3"),
                                             (torch.bfloat16, "auto")])
def test_gpu_hidden_nonfinite_inputs_follow_the_reference_rule(kind, N, D, dtype, precision):
    """The rule at ViT sizes on the GPU's precisions, forward and backward of the public op, both backends;
    bfloat16 against the float64 reference of the rounded inputs (relative error of the finite entries)."""
    q, k, v, kw = nonfinite_case(kind, 2, 3, N, N + 13, D, seed=N + D, dtype=dtype)
    fp32 = dtype == torch.float32
    tol = 1e-6 if fp32 else 2e-2
    _check_backend_against_spec(q, k, v, kw, "triton", precision, tol, 1e-5 if fp32 else 5e-2)
    if precision == "auto":
        _check_backend_against_spec(q, k, v, kw, "torch", precision, tol, 1e-5 if fp32 else 5e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("N", [785, 3137])
def test_gpu_vit_sizes_fwd_bwd_float64_reference(N):
    q, k, v, bias = _inputs(2, 12, N, N, 64, 64, bias_shape=(1, 12, N, N))
    dout = torch.randn(2, 12, N, 64, device="cuda")

    def fn(q, k, v, b):
        return elsa_attention(q, k, v, attn_bias=b, backend="triton")

    out, g = _grads(fn, (q, k, v, bias), dout)
    out_ref, g_ref = _grads(lambda q, k, v, b: softmax_attention(q, k, v, attn_bias=b),
                            [t.double() for t in (q, k, v, bias)], dout.double())
    assert relerr(out, out_ref) <= 1e-6
    for got, want in zip(g, g_ref):
        assert relerr(got, want) <= 1e-5
