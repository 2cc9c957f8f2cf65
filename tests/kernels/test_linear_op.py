"""``elsa_linear``: ``F.linear``'s contract, FP32-accurate on tensor cores, forward and backward, against
float64; the paths that stay ``F.linear``; refusals; the operators under opcheck, compile and CUDA graphs.
``elsa_mlp`` (timm's GELU MLP as one operator without gradients) the same way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from elsa_vision.ops.linear import elsa_linear, elsa_mlp, linear_route  # noqa: E402
from tests.helpers import DEVICE, FP32_ACCURATE, cuda_graph, randn, relerr  # noqa: E402

# the Triton path on this machine: CUDA, or the interpreter on CPU tensors (backend="triton" asks for it)
TRITON = "auto" if DEVICE == "cuda" else "triton"


def _grads64(x, w, b, g):
    x64, w64 = x.double().requires_grad_(), w.double().requires_grad_()
    b64 = b.double().requires_grad_() if b is not None else None
    out = F.linear(x64, w64, b64)
    out.backward(g.double())
    return out, x64.grad, w64.grad, (b64.grad if b is not None else None)


@pytest.mark.parametrize("shape,out_features", [((3, 7, 45), 29), ((1, 130), 70), ((2, 5, 3, 33), 17)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("precision", ["auto", "fp16x3", "tf32x3"])
def test_forward_and_backward_against_float64(shape, out_features, bias, precision):
    x = randn(*shape, seed=1).requires_grad_()
    w = randn(out_features, shape[-1], seed=2).requires_grad_()
    b = randn(out_features, seed=3).requires_grad_() if bias else None
    g = randn(*shape[:-1], out_features, seed=4)
    out = elsa_linear(x, w, b, precision=precision, backend=TRITON)
    out.backward(g)
    ref, dx, dw, db = _grads64(x.detach(), w.detach(), b.detach() if bias else None, g)
    assert out.shape == ref.shape and out.dtype == torch.float32
    assert relerr(out, ref) <= FP32_ACCURATE
    assert relerr(x.grad, dx) <= FP32_ACCURATE and relerr(w.grad, dw) <= FP32_ACCURATE
    if bias:
        assert relerr(b.grad, db) <= FP32_ACCURATE


def test_strided_input_and_partial_grads():
    base = randn(40, 90, seed=1)
    x = base[::2, ::2]  # [20, 45], strided both ways
    w = randn(29, 45, seed=2).requires_grad_()
    out = elsa_linear(x, w, precision="fp16x3", backend=TRITON)
    out.sum().backward()  # only the weight wants a gradient: no dX product
    ref, _, dw, _ = _grads64(x, w.detach(), None, torch.ones(20, 29, device=DEVICE))
    assert relerr(out, ref) <= FP32_ACCURATE and relerr(w.grad, dw) <= FP32_ACCURATE


def test_routes_that_stay_f_linear():
    x, w, b = randn(4, 16, seed=1), randn(8, 16, seed=2), randn(8, seed=3)
    # half precisions and float64: F.linear bit for bit
    for dtype in (torch.bfloat16, torch.float16, torch.float64):
        xd, wd, bd = x.to(dtype), w.to(dtype), b.to(dtype)
        assert linear_route(xd, "auto", "auto") == "torch"
        assert torch.equal(elsa_linear(xd, wd, bd), F.linear(xd, wd, bd))
    # backend="torch", and ieee / tf32 precisions: PyTorch's own GEMM
    for precision, backend in (("auto", "torch"), ("ieee", "auto"), ("tf32", "auto")):
        assert linear_route(x, precision, backend) == "torch"
    assert torch.equal(elsa_linear(x, w, b, backend="torch"), F.linear(x, w, b))
    assert torch.equal(elsa_linear(x, w, b, precision="ieee"), F.linear(x, w, b))
    # autocast regions: the autocast dtype, as nn.Linear
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert linear_route(x, "auto", TRITON) == "torch"
        out = elsa_linear(x, w, b, backend=TRITON)
        mixed = elsa_linear(x.bfloat16(), w, b)  # an earlier autocast op's output beside float32 weights
        assert torch.equal(mixed, F.linear(x.bfloat16(), w, b))
    assert out.dtype == torch.bfloat16
    if DEVICE == "cpu":  # the CPU's float32 "auto" is F.linear itself
        assert linear_route(x, "auto", "auto") == "torch"
        assert torch.equal(elsa_linear(x, w, b), F.linear(x, w, b))


@pytest.mark.parametrize("call,error,match", [
    (lambda x, w, b: elsa_linear(x, w[:, :3], b), ValueError, "in_features = 3"),
    (lambda x, w, b: elsa_linear(x, w[0], b), ValueError, "rank 2"),
    (lambda x, w, b: elsa_linear(x, w.double(), b), TypeError, "share dtype"),
    (lambda x, w, b: elsa_linear(x, w, b[:3]), ValueError, "`bias` must be"),
    (lambda x, w, b: elsa_linear(x.int(), w, b), TypeError, "floating-point"),
    (lambda x, w, b: elsa_linear(x, w, b, precision="fp8"), ValueError, "unknown precision"),
    (lambda x, w, b: elsa_linear(x, w, b, backend="eca"), ValueError, "unknown backend"),
    (lambda x, w, b: elsa_linear(x.bfloat16(), w.bfloat16(), b.bfloat16(), backend="triton"), TypeError,
     "float32"),
    (lambda x, w, b: elsa_linear(x, w, [0.0] * 8), TypeError, "`bias` must be a tensor"),
])
def test_refusals_name_the_argument(call, error, match):
    x, w, b = randn(4, 16, seed=1), randn(8, 16, seed=2), randn(8, seed=3)
    with pytest.raises(error, match=match):
        call(x, w, b)


def test_operators_pass_opcheck():
    import elsa_vision.ops.linear  # noqa: F401  (registers the operators)

    x, w, b = randn(9, 20, seed=1), randn(7, 20, seed=2), randn(7, seed=3)
    dy = randn(9, 7, seed=4)
    torch.library.opcheck(torch.ops.elsa_vision.linear_fwd.default, (x, w, b, "fp16x3", True),
                          test_utils=("test_schema", "test_faketensor"))
    torch.library.opcheck(torch.ops.elsa_vision.linear_bwd.default, (dy, x, w, "fp16x3", True, True, True),
                          test_utils=("test_schema", "test_faketensor"))


def test_empty_batch_and_zero_in_features():
    w, b = randn(5, 8, seed=2), randn(5, seed=3)
    assert elsa_linear(randn(0, 8, seed=1), w, b, backend=TRITON).shape == (0, 5)
    out = elsa_linear(randn(3, 0, seed=1), randn(5, 0, seed=2), b, backend=TRITON)
    torch.testing.assert_close(out, b.expand(3, 5), rtol=0, atol=0)


def _mlp_inputs(shape, hidden, out_features, bias=True):
    x = randn(*shape, seed=1)
    w1, w2 = randn(hidden, shape[-1], seed=2), randn(out_features, hidden, seed=4)
    b1, b2 = (randn(hidden, seed=3), randn(out_features, seed=5)) if bias else (None, None)
    return x, w1, b1, w2, b2


def _mlp64(x, w1, b1, w2, b2):
    d = [t.double() if t is not None else None for t in (x, w1, b1, w2, b2)]
    return F.linear(F.gelu(F.linear(d[0], d[1], d[2])), d[3], d[4])


@pytest.mark.parametrize("shape,hidden,out_features", [((3, 7, 45), 70, 29), ((1, 130), 33, 40),
                                                      ((2, 5, 3, 33), 97, 17)])
@pytest.mark.parametrize("bias", [True, False])
def test_mlp_without_gradients_against_float64(shape, hidden, out_features, bias):
    args = _mlp_inputs(shape, hidden, out_features, bias)
    out = elsa_mlp(*args, precision="fp16x3", backend=TRITON)
    assert out.shape == (*shape[:-1], out_features) and out.dtype == torch.float32
    assert relerr(out, _mlp64(*args)) <= FP32_ACCURATE
    # the same products as the two elsa_linear calls, up to the hidden activation's 22 bits
    unfused = elsa_linear(F.gelu(elsa_linear(args[0], args[1], args[2], backend=TRITON)), args[3], args[4],
                          backend=TRITON)
    assert relerr(out, unfused.double()) <= FP32_ACCURATE


def test_mlp_with_gradients_is_the_two_linear_layers():
    x, w1, b1, w2, b2 = (t.requires_grad_() for t in _mlp_inputs((4, 9, 45), 70, 29))
    out = elsa_mlp(x, w1, b1, w2, b2, backend=TRITON)
    out.square().sum().backward()
    grads = [t.grad for t in (x, w1, b1, w2, b2)]
    d = [t.detach().double().requires_grad_() for t in (x, w1, b1, w2, b2)]
    ref = _mlp64(*d)
    ref.square().sum().backward()
    assert relerr(out, ref) <= FP32_ACCURATE
    for g, r in zip(grads, d):
        assert relerr(g, r.grad) <= FP32_ACCURATE


def test_mlp_routes_that_stay_torch():
    x, w1, b1, w2, b2 = _mlp_inputs((4, 16), 24, 8)
    for dtype in (torch.bfloat16, torch.float64):  # F.linear, F.gelu, F.linear bit for bit
        t = [a.to(dtype) for a in (x, w1, b1, w2, b2)]
        assert torch.equal(elsa_mlp(*t), F.linear(F.gelu(F.linear(t[0], t[1], t[2])), t[3], t[4]))
    assert torch.equal(elsa_mlp(x, w1, b1, w2, b2, backend="torch"),
                       F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2))


@pytest.mark.parametrize("call,error,match", [
    (lambda a: elsa_mlp(a[0], a[1], a[2], a[3][:, :5], a[4]), ValueError, "`fc2_weight` .* must take fc1's"),
    (lambda a: elsa_mlp(a[0], a[1][:, :3], a[2], a[3], a[4]), ValueError, "in_features = 3"),
    (lambda a: elsa_mlp(a[0], a[1], a[2], a[3], a[4][:3]), ValueError, "`fc2_bias` must be"),
    (lambda a: elsa_mlp(a[0], a[1], a[2], a[3].double(), a[4]), TypeError, "x and fc2_weight must share"),
    (lambda a: elsa_mlp(a[0], a[1], a[2][:2], a[3], a[4]), ValueError, "`fc1_bias` must be"),
    (lambda a: elsa_mlp(a[0], a[1], a[2], a[3], a[4], precision="fp8"), ValueError, "unknown precision"),
])
def test_mlp_refusals_name_the_argument(call, error, match):
    with pytest.raises(error, match=match):
        call(_mlp_inputs((4, 16), 24, 8))


def test_mlp_operator_passes_opcheck():
    x, w1, b1, w2, b2 = _mlp_inputs((9, 20), 33, 7)
    torch.library.opcheck(torch.ops.elsa_vision.mlp_fwd.default, (x, w1, b1, w2, b2, "fp16x3"),
                          test_utils=("test_schema", "test_faketensor"))


# --------------------------------------------------------------------------- inference: weight split once


def _splits():
    from elsa_vision.kernels import gemm

    return gemm._SPLITS


def test_inference_reuses_a_weights_split_until_it_changes_in_place():
    """Without gradients a weight is split once: the kept parts are the split of its values, reruns are
    bitwise equal, and an in-place change (any version bump) is seen at the next call."""
    from elsa_vision.kernels.gemm import split_rows

    splits = _splits()
    splits.clear()
    x, w, b = randn(37, 48, seed=1), randn(29, 48, seed=2), randn(29, seed=3)
    with torch.no_grad():
        first = elsa_linear(x, w, b, precision="fp16x3", backend=TRITON)
        assert len(splits) == 1
        parts, exp = splits._entries[id(w)][2]
        want_parts, want_exp = split_rows(w)
        assert torch.equal(parts, want_parts) and torch.equal(exp, want_exp)
        assert torch.equal(elsa_linear(x, w, b, precision="fp16x3", backend=TRITON), first)
        w.mul_(-3.0)  # in place: a new version of the same storage
        changed = elsa_linear(x, w, b, precision="fp16x3", backend=TRITON)
    ref = F.linear(x.double(), w.double(), b.double())
    assert relerr(changed, ref) <= FP32_ACCURATE
    assert len(splits) == 1


def test_training_calls_drop_the_kept_split_and_dead_weights_leave_none():
    splits = _splits()
    splits.clear()
    x, w = randn(9, 32, seed=1), randn(11, 32, seed=2).requires_grad_()
    with torch.no_grad():
        elsa_linear(x, w, precision="fp16x3", backend=TRITON)
    assert len(splits) == 1
    out = elsa_linear(x, w, precision="fp16x3", backend=TRITON)  # with autograd: the weight will change
    assert len(splits) == 0
    out.sum().backward()
    with torch.no_grad():
        elsa_linear(x, w, precision="fp16x3", backend=TRITON)
        elsa_linear(x, w[:, :], precision="fp16x3", backend=TRITON)  # a view: not kept
        assert len(splits) == 1
        elsa_mlp(x, randn(16, 32, seed=3), None, randn(8, 16, seed=4), None, precision="fp16x3",
                 backend=TRITON)  # the fused MLP's two weights, dead after the call
    del w, out  # the graph of `out` holds the weight too
    assert len(splits) == 0


def test_inference_mode_weights_are_split_at_every_call():
    """Weights made under ``torch.inference_mode`` have no version counter: nothing is kept for them, and
    ordinary weights called under it are kept as under ``no_grad``."""
    splits = _splits()
    splits.clear()
    x, w = randn(6, 24, seed=1), randn(10, 24, seed=2)
    with torch.inference_mode():
        w_inf = randn(10, 24, seed=2)
        out = elsa_linear(x, w_inf, precision="fp16x3", backend=TRITON)
        assert len(splits) == 0
        w_inf.mul_(2.0)  # in place, unseen by any version counter
        twice = elsa_linear(x, w_inf, precision="fp16x3", backend=TRITON)
        assert torch.equal(twice, 2 * out)  # a power of two: the split scales exactly
        assert torch.equal(elsa_linear(x, w, precision="fp16x3", backend=TRITON), out)
        assert len(splits) == 1


# ------------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_compile_fullgraph_and_cuda_graph_match_eager():
    x = randn(197, 768, seed=1).requires_grad_()
    w = randn(2304, 768, seed=2).requires_grad_()
    b = randn(2304, seed=3).requires_grad_()

    def loss(x, w, b):
        return elsa_linear(x, w, b).square().sum()

    compiled = torch.compile(loss, fullgraph=True)  # the forward and, through AOT autograd, the backward
    eager_loss, compiled_loss = loss(x, w, b), compiled(x, w, b)
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-6, atol=0)
    grads = torch.autograd.grad(compiled_loss, (x, w, b)), torch.autograd.grad(eager_loss, (x, w, b))
    for c, e in zip(*grads):
        torch.testing.assert_close(c, e, rtol=1e-5, atol=1e-3)
    with torch.no_grad():
        static = x.detach().clone()
        graph, replayed = cuda_graph(lambda: elsa_linear(static, w, b))
        graph.replay()
        first = replayed.clone()
        graph.replay()
        assert torch.equal(replayed, first) and torch.equal(first, elsa_linear(static, w, b))


@pytest.mark.gpu
def test_gpu_cuda_graph_reads_the_weight_at_each_replay():
    """A graph captured with a weight whose split is kept splits it inside the graph: an in-place update
    after the capture (``load_state_dict``, an EMA step) reaches every replay."""
    splits = _splits()
    splits.clear()
    x, w, b = randn(300, 256, seed=1), randn(320, 256, seed=2), randn(320, seed=3)
    with torch.no_grad():
        elsa_linear(x, w, b)  # kept before the capture
        assert len(splits) == 1
        graph, replayed = cuda_graph(lambda: elsa_linear(x, w, b))
        w.copy_(randn(320, 256, seed=4))
        graph.replay()
        ref = F.linear(x.double(), w.double(), b.double())
        assert relerr(replayed, ref) <= FP32_ACCURATE
        assert torch.equal(replayed, elsa_linear(x, w, b))


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,N", [(12608, 768, 2304), (785, 3072, 768), (197, 1024, 4096)])
def test_gpu_error_at_most_torch_fp32(M, K, N):
    x, w, b = randn(M, K, seed=5), randn(N, K, seed=6), randn(N, seed=7)
    ref = F.linear(x.double(), w.double(), b.double())
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        theirs = relerr(F.linear(x, w, b), ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert linear_route(x, "auto", "auto") == "triton"
    assert relerr(elsa_linear(x, w, b), ref) <= max(theirs, 2e-7)


@pytest.mark.gpu
@pytest.mark.parametrize("M,K,H", [(12608, 768, 3072), (785, 384, 1536), (4096, 96, 384)])
def test_gpu_mlp_error_at_most_torch_fp32(M, K, H):
    args = _mlp_inputs((M, K), H, K)
    ref = _mlp64(*args)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        theirs = relerr(F.linear(F.gelu(F.linear(args[0], args[1], args[2])), args[3], args[4]), ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert relerr(elsa_mlp(*args), ref) <= max(theirs, 2e-7)


@pytest.mark.gpu
def test_gpu_mlp_compiles_and_replays_in_a_cuda_graph():
    args = _mlp_inputs((197, 768), 3072, 768)
    eager = elsa_mlp(*args)
    compiled = torch.compile(lambda *a: elsa_mlp(*a), fullgraph=True)
    torch.testing.assert_close(compiled(*args), eager, rtol=0, atol=0)
    static = args[0].clone()
    graph, replayed = cuda_graph(lambda: elsa_mlp(static, *args[1:]))
    graph.replay()
    assert torch.equal(replayed, eager)
