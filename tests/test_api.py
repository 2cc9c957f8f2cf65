"""The public ``elsa_attention`` contract on the torch backend (CPU)."""

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F

from elsa_vision import elsa_attention
from elsa_vision.kernels.reference import softmax_attention
from tests.helpers import qkv, ref64, relerr

F64 = torch.float64


_qkv = functools.partial(qkv, device="cpu")  # this file tests the torch backend on CPU tensors


@pytest.mark.parametrize("N", [1, 17, 197, 785])
@pytest.mark.parametrize("D", [32, 64, 72, 80, 96, 128])
def test_fp32_is_fp32_accurate(N, D):
    q, k, v = _qkv(2, 3, N, N, D)
    out = elsa_attention(q, k, v)
    assert out.dtype == torch.float32 and out.shape == (2, 3, N, D)
    assert relerr(out, ref64(q, k, v)) <= 1e-6  # precision="auto" promises FP32 accuracy


def test_fp32_3137_tokens():
    q, k, v = _qkv(1, 2, 3137, 3137, 64)
    assert relerr(elsa_attention(q, k, v), ref64(q, k, v)) <= 1e-6


@pytest.mark.parametrize("Nq,Nk", [(113, 203), (1, 239), (3, 799), (127, 513), (1024, 1023)])
@pytest.mark.parametrize("causal", [False, True])
def test_cross_attention_lengths_and_value_dim(Nq, Nk, causal):
    q, k, v = _qkv(1, 2, Nq, Nk, 40, Dv=72)
    out = elsa_attention(q, k, v, causal=causal)
    assert out.shape == (1, 2, Nq, 72)
    assert relerr(out, ref64(q, k, v, causal=causal)) <= 1e-6


def test_causal_equals_sdpa_is_causal_when_square():
    q, k, v = _qkv(2, 3, 197, 197, 64, dtype=F64)
    out = elsa_attention(q, k, v, causal=True)
    assert relerr(out, F.scaled_dot_product_attention(q, k, v, is_causal=True)) <= 1e-13


def test_causal_is_bottom_right_aligned():
    q, k, v = _qkv(1, 1, 5, 9, 8, dtype=F64)
    out = elsa_attention(q, k, v, causal=True)
    allowed = torch.arange(9)[None, :] <= torch.arange(5)[:, None] + 4  # j <= i + (Nk - Nq)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
    assert relerr(out, ref) <= 1e-13
    # Nq > Nk: the first Nq - Nk rows see no key and are exactly 0.
    q2, k2, v2 = _qkv(1, 1, 9, 5, 8, dtype=F64)
    out2 = elsa_attention(q2, k2, v2, causal=True)
    assert torch.equal(out2[..., :4, :], torch.zeros(1, 1, 4, 8, dtype=F64))
    assert relerr(out2, ref64(q2, k2, v2, causal=True)) <= 1e-13


@pytest.mark.parametrize("bias_shape", [(2, 3, 97, 131), (1, 3, 97, 131), (2, 1, 1, 131), (1, 1, 97, 131),
                                        (97, 131), (131,)])
def test_attn_bias_broadcasts(bias_shape):
    q, k, v = _qkv(2, 3, 97, 131, 32)
    bias = torch.randn(bias_shape) * 2
    out = elsa_attention(q, k, v, attn_bias=bias)
    assert relerr(out, ref64(q, k, v, attn_bias=bias)) <= 1e-6
    ref_sdpa = F.scaled_dot_product_attention(q.double(), k.double(), v.double(),
                                              attn_mask=bias.double().expand(2, 3, 97, 131))
    assert relerr(out, ref_sdpa) <= 1e-6


def test_attn_bias_is_added_after_scaling():
    q, k, v = _qkv(1, 2, 33, 33, 16, dtype=F64)
    bias = torch.randn(1, 2, 33, 33, dtype=F64)
    out = elsa_attention(q, k, v, attn_bias=bias, scale=0.3)
    p = torch.softmax(q @ k.mT * 0.3 + bias, dim=-1)
    assert relerr(out, p @ v) <= 1e-13


def test_key_padding_mask_true_means_attend():
    q, k, v = _qkv(2, 2, 50, 70, 16, dtype=F64)
    kpm = torch.rand(2, 70) > 0.5
    out = elsa_attention(q, k, v, key_padding_mask=kpm)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=kpm[:, None, None, :])
    assert relerr(out, ref) <= 1e-13


@pytest.mark.parametrize("how", ["bool", "-inf", "finfo.min"])
def test_fully_masked_rows_are_zero_not_nan(how):
    q, k, v = _qkv(2, 2, 20, 30, 16)
    kpm, bias = None, None
    if how == "bool":
        kpm = torch.ones(2, 30, dtype=torch.bool)
        kpm[1] = False  # batch 1 sees nothing
    else:
        val = -math.inf if how == "-inf" else torch.finfo(torch.float32).min
        bias = torch.zeros(2, 2, 20, 30)
        bias[1] = val
        bias[0, :, 5] = val  # one row of batch 0
    out = elsa_attention(q, k, v, key_padding_mask=kpm, attn_bias=bias)
    assert torch.isfinite(out).all()
    if how != "finfo.min":  # finfo.min is a finite bias: the row is a softmax over equal logits
        assert torch.equal(out[1], torch.zeros_like(out[1]))
    if how == "-inf":
        assert torch.equal(out[0, :, 5], torch.zeros_like(out[0, :, 5]))
    ref = ref64(q, k, v, key_padding_mask=kpm, attn_bias=bias)
    assert relerr(out, ref) <= 1e-6


@pytest.mark.parametrize("mult", [5.0, 30.0, 100.0])
def test_large_magnitude_inputs(mult):
    q, k, v = _qkv(1, 2, 129, 129, 64)
    q, k = q * mult, k * mult
    out = elsa_attention(q, k, v)
    assert torch.isfinite(out).all()
    # fp32 rounding of logits of magnitude ~mult^2*8 limits what any fp32 kernel can reach.
    assert relerr(out, ref64(q, k, v)) <= 1e-6 * mult**2


def test_constant_huge_logits():
    q = torch.full((1, 1, 16, 8), 300.0)
    k = torch.full((1, 1, 16, 8), 300.0)
    v = torch.randn(1, 1, 16, 8)
    out = elsa_attention(q, k, v)
    assert torch.isfinite(out).all()
    assert relerr(out, v.mean(dim=-2, keepdim=True).expand_as(out)) <= 1e-6


@pytest.mark.parametrize("dtype,tol",
                         [(torch.float16, 2e-3), (torch.bfloat16, 1.6e-2), (torch.float64, 1e-13)])
def test_dtypes(dtype, tol):
    q, k, v = _qkv(2, 2, 97, 97, 64, dtype=dtype)
    out = elsa_attention(q, k, v)
    assert out.dtype == dtype
    # Half precision: compared the FlashAttention way, against the same math rounded to the dtype.
    ref = ref64(q, k, v)
    lp = F.scaled_dot_product_attention(q.float(), k.float(), v.float()).to(dtype)
    assert relerr(out, ref) <= max(tol, 2 * relerr(lp, ref))


@pytest.mark.parametrize("precision", ["auto", "ieee", "tf32x3", "fp16x3", "tf32"])
def test_precision_strings_cpu(precision):
    q, k, v = _qkv(1, 2, 65, 65, 32)
    out = elsa_attention(q, k, v, precision=precision)
    # On CPU every fp32 product is IEEE; "tf32" may only be less accurate on tensor-core hardware.
    assert relerr(out, ref64(q, k, v)) <= (5e-3 if precision == "tf32" else 1e-6)


def test_fused_qkv_views_without_copies():
    B, N, H, D = 2, 50, 4, 16
    qkv = torch.randn(B, N, 3, H, D).permute(2, 0, 3, 1, 4)
    q, k, v = qkv.unbind(0)
    assert not q.is_contiguous()
    out = elsa_attention(q, k, v)
    ref = elsa_attention(q.contiguous(), k.contiguous(), v.contiguous())
    assert torch.equal(out, ref)


def test_scale_default_and_explicit():
    q, k, v = _qkv(1, 1, 20, 20, 16, dtype=F64)
    torch.testing.assert_close(elsa_attention(q, k, v), elsa_attention(q, k, v, scale=0.25), rtol=0, atol=0)
    p = torch.softmax(q @ k.mT * 2.0, dim=-1)
    assert relerr(elsa_attention(q, k, v, scale=2.0), p @ v) <= 1e-13


def test_backend_torch_and_auto_on_cpu_agree():
    q, k, v = _qkv(1, 2, 40, 40, 16)
    assert torch.equal(elsa_attention(q, k, v, backend="auto"), elsa_attention(q, k, v, backend="torch"))


def test_gradcheck_float64():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 7, 9, 5, Dv=3, dtype=F64))
    bias = torch.randn(1, 2, 7, 9, dtype=F64, requires_grad=True)
    kpm = torch.ones(1, 9, dtype=torch.bool)
    kpm[0, 2] = False
    for causal in (False, True):
        assert torch.autograd.gradcheck(
            lambda q, k, v, b, causal=causal: elsa_attention(q, k, v, attn_bias=b, key_padding_mask=kpm,
                                                             causal=causal),
            (q, k, v, bias))


def test_gradcheck_broadcast_bias():
    q, k, v = (t.requires_grad_() for t in _qkv(2, 2, 6, 8, 4, dtype=F64))
    bias = torch.randn(2, 1, 1, 8, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda b: elsa_attention(q, k, v, attn_bias=b), (bias,))


def test_fully_masked_rows_have_zero_finite_grads():
    q, k, v = (t.requires_grad_() for t in _qkv(1, 2, 6, 8, 4, dtype=F64))
    bias = torch.zeros(1, 2, 6, 8, dtype=F64)
    bias[..., 2, :] = -math.inf
    bias = bias.requires_grad_()
    out = elsa_attention(q, k, v, attn_bias=bias)
    out.square().sum().backward()
    for t in (q, k, v, bias):
        assert torch.isfinite(t.grad).all()
    assert torch.equal(q.grad[..., 2, :], torch.zeros_like(q.grad[..., 2, :]))
    assert torch.equal(bias.grad[..., 2, :], torch.zeros_like(bias.grad[..., 2, :]))
    ref_inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    softmax_attention(*ref_inputs, attn_bias=bias.detach()).square().sum().backward()
    for got, ref in zip((q, k, v), ref_inputs):
        assert relerr(got.grad, ref.grad) <= 1e-12


def test_dropout_is_unbiased_and_off_at_zero():
    q, k, v = _qkv(1, 1, 8, 64, 4, dtype=F64)
    ref = elsa_attention(q, k, v)
    outs = torch.stack([elsa_attention(q, k, v, dropout_p=0.5) for _ in range(400)])
    assert relerr(outs.mean(0), ref) <= 0.1  # mean of dropout(softmax) @ v is softmax @ v
    assert not torch.equal(outs[0], outs[1])


BAD_CASES = [
    ("rank", lambda q, k, v: dict(q=q[0]), ValueError, "rank 4"),
    ("batch", lambda q, k, v: dict(k=k.expand(2, -1, -1, -1)), ValueError, "batch"),
    ("heads", lambda q, k, v: dict(k=k[:, :1], v=v[:, :1]), ValueError, "head count"),
    ("head dim", lambda q, k, v: dict(k=k[..., :4]), ValueError, "head dim"),
    ("v length", lambda q, k, v: dict(v=v[:, :, :3]), ValueError, "length"),
    ("mixed dtype", lambda q, k, v: dict(k=k.double()), TypeError, "dtype"),
    ("int dtype", lambda q, k, v: dict(q=q.int(), k=k.int(), v=v.int()), TypeError, "dtype"),
    ("not tensor", lambda q, k, v: dict(q=[1.0]), TypeError, "`q`"),
    ("bias dtype", lambda q, k, v: dict(attn_bias=torch.zeros(1, 2, 5, 7, dtype=torch.bool)), TypeError,
     "attn_bias"),
    ("bias shape", lambda q, k, v: dict(attn_bias=torch.zeros(1, 2, 5, 6)), ValueError, "attn_bias"),
    ("bias rank", lambda q, k, v: dict(attn_bias=torch.zeros(1, 1, 2, 5, 7)), ValueError, "attn_bias"),
    ("mask dtype", lambda q, k, v: dict(key_padding_mask=torch.ones(1, 7)), TypeError, "key_padding_mask"),
    ("mask shape", lambda q, k, v: dict(key_padding_mask=torch.ones(1, 6, dtype=torch.bool)), ValueError,
     "key_padding_mask"),
    ("mask rank", lambda q, k, v: dict(key_padding_mask=torch.ones(1, 1, 1, 7, dtype=torch.bool)), ValueError,
     "key_padding_mask"),
    ("precision", lambda q, k, v: dict(precision="fp32"), ValueError, "precision"),
    ("backend", lambda q, k, v: dict(backend="cuda"), ValueError, "backend"),
    ("causal type", lambda q, k, v: dict(causal="yes"), TypeError, "causal"),
    ("scale nan", lambda q, k, v: dict(scale=float("nan")), TypeError, "scale"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_errors(name, mutate, exc, match):
    q, k, v = _qkv(1, 2, 5, 7, 8)
    args = dict(q=q, k=k, v=v)
    args.update(mutate(q, k, v))
    with pytest.raises(exc, match=match):
        elsa_attention(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def test_mixed_devices_error():
    q, k, v = _qkv(1, 1, 4, 4, 4)
    meta = torch.empty(1, 1, 4, 4, device="meta")
    with pytest.raises(ValueError, match="device"):
        elsa_attention(q, meta, v)


_TRITON_ON_CPU = """
import os, tempfile
import torch
import torch.distributed as dist
from elsa_vision import elsa_attention
from elsa_vision.distributed import context_parallel_attention
from elsa_vision.kernels import triton_runs_on
from elsa_vision.ops.window_attention import window_attention

print("runs on cpu:", triton_runs_on("cpu"))
q = torch.randn(1, 2, 8, 16)
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "init"), rank=0,
                        world_size=1)
from elsa_vision.layers import ElsaAttention
from elsa_vision.ops.attention import elsa_attention_qkvpacked, elsa_attention_varlen, inference_call

layer = ElsaAttention(32, num_heads=2, backend="auto").eval()
layer.backend = "triton"  # a model kept on the CPU with the Triton backend chosen for it
cu = torch.tensor([0, 3, 8], dtype=torch.int32)


def layer_inference():
    with torch.no_grad():
        return layer(torch.randn(1, 5, 32))



packed = torch.randn(8, 2, 16)
calls = {
    "elsa_attention": lambda: elsa_attention(q, q, q, backend="triton"),
    "inference_call": lambda: inference_call(q, q, q, backend="triton"),
    "ElsaAttention": layer_inference,
    "elsa_attention_varlen": lambda: elsa_attention_varlen(packed, packed, packed, cu, cu, 5, 5,
                                                           backend="triton"),
    "elsa_attention_qkvpacked": lambda: elsa_attention_qkvpacked(torch.randn(1, 8, 3, 2, 16),
                                                                 backend="triton"),
    "elsa_attention_qkvpacked (autograd)": lambda: elsa_attention_qkvpacked(
        torch.randn(1, 8, 3, 2, 16, requires_grad=True), backend="triton"),
    "window_attention": lambda: window_attention(q, q, q, torch.zeros(2), torch.zeros(2, 8, 8)),
    "context_parallel_attention": lambda: context_parallel_attention(q, q, q, seq_len=8, backend="triton"),
}
for name, call in calls.items():
    try:
        call()
        print(name, "ran")
    except ValueError as e:
        print(name, "refused:", e)
dist.destroy_process_group()
"""


def test_triton_backend_refuses_cpu_tensors_outside_the_interpreter():
    """``backend="triton"`` with CPU tensors where Triton compiles (no ``TRITON_INTERPRET``; a GPU machine
    too): each public entry refuses in one line naming itself, instead of failing inside Triton's
    launcher."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", _TRITON_ON_CPU], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert "runs on cpu: False" in r.stdout
    for name in ("elsa_attention", "window_attention", "context_parallel_attention", "elsa_attention_varlen",
                 "elsa_attention_qkvpacked"):
        assert f"{name} refused: {name}: backend='triton' needs CUDA tensors" in r.stdout, r.stdout
    fn = "elsa_attention_qkvpacked"
    assert f"{fn} (autograd) refused: {fn}: backend='triton' needs CUDA tensors" in r.stdout, r.stdout
    # the planned inference path of the layer and its builder: the refusal of elsa_attention
    for name in ("inference_call", "ElsaAttention"):
        assert f"{name} refused: elsa_attention: backend='triton' needs CUDA tensors" in r.stdout, r.stdout
