"""W-ELSA (``window_attention``: Triton forward, dense per-window backward) vs a float64 Swin-v2 reference.

The backward runs the fused Triton kernel (``window_bwd``) for windows of up to 64 tokens and PyTorch's dense
chunks above that (the 12x12 and larger cases).

Runs the kernels under the CPU interpreter at small odd windows (7x7, 8x8, 12x12, 6x10, shifted and not);
the ``gpu`` tests take Swin-T/S/B window shapes. Relative Frobenius errors ``||x - ref|| / ||ref||``:

* forward, float32: ``<= 5e-6`` (measured 5e-7 to 8e-7, the same as PyTorch's own float32 of this math).
* gradients, float32: ``<= 3e-5``. The logits reach ``100 cos + 16 sigmoid`` (and -200 with the mask): one
  float32 rounding of a logit near 116 is ~7e-6 absolute, which the probabilities and the gradients inherit
  (measured 1e-6 to 6e-6, PyTorch's own float32 of this math 1e-6 to 4e-5 on the logit_scale gradient).
* bfloat16 forward: ``<= 3x`` the error of PyTorch's bfloat16 computation of the same math.
* the torch path of the bias / logit-scale chain (``ElsaSwinV2Attention``, backend torch) passes
  ``torch.autograd.gradcheck`` in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

import torch.nn.functional as F  # noqa: E402
from timm.models.swin_transformer_v2 import WindowAttention  # noqa: E402

from elsa_vision.kernels.reference import scan_attention  # noqa: E402
from elsa_vision.kernels.window import (  # noqa: E402
    BWD_MAX_TOKENS,
    window_bwd,
    window_bwd_plan,
    window_fwd,
)
from elsa_vision.models.swinv2 import ElsaSwinV2Attention  # noqa: E402
from elsa_vision.ops.window_attention import window_attention  # noqa: E402

from ..helpers import DEVICE, assert_nonfinite_like, relerr  # noqa: E402

FWD_BOUND = 5e-6
GRAD_BOUND = 3e-5
# The fused backward's q, k, v and bias gradients: measured <= 8.5e-7 (CPU interpreter) and <= 4.2e-7 (H100,
# Swin-v2-T/W8 stage shapes); the few-element logit-scale gradient, a sum over every score, reaches 6.5e-6
# and keeps GRAD_BOUND.
FUSED_GRAD_BOUND = 5e-6
LOWP_FACTOR = 3.0


def reference(q, k, v, logit_scale, bias, mask):
    """Swin-v2 window attention as timm writes it (dense scores), in the inputs' dtype."""
    attn = F.normalize(q, dim=-1) @ F.normalize(k, dim=-1).transpose(-2, -1)
    attn = attn * torch.clamp(logit_scale, max=math.log(100.0)).exp().view(1, -1, 1, 1) + bias.unsqueeze(0)
    if mask is not None:
        nW = mask.shape[0]
        attn = (attn.view(-1, nW, *attn.shape[1:]) + mask.to(attn.dtype)[None, :, None]).view(attn.shape)
    return attn.softmax(-1) @ v


def shift_mask(wh: int, ww: int, nh: int, nw: int) -> torch.Tensor:
    """timm's shifted-window mask (0 / -100) for an ``(nh*wh) x (nw*ww)`` map shifted by half a window."""
    H, W = nh * wh, nw * ww
    img = torch.zeros(H, W)
    cnt = 0
    for hs in ((0, -wh), (-wh, -(wh // 2)), (-(wh // 2), None)):
        for ws in ((0, -ww), (-ww, -(ww // 2)), (-(ww // 2), None)):
            img[hs[0]:hs[1], ws[0]:ws[1]] = cnt
            cnt += 1
    win = img.view(nh, wh, nw, ww).permute(0, 2, 1, 3).reshape(nh * nw, wh * ww)
    diff = win.unsqueeze(1) - win.unsqueeze(2)
    return torch.where(diff != 0, -100.0, 0.0)


def make_inputs(wh, ww, H, D, B, shift, dtype=torch.float32, grid=(2, 2)):
    """q, k, v as strided views of one fused qkv, a permuted ``[H, N, N]`` bias view (as the model passes)."""
    N = wh * ww
    nW = grid[0] * grid[1] if shift else 1
    Bw = B * nW
    qkv = torch.randn(Bw, N, 3, H, D, device=DEVICE).to(dtype)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    logit_scale = torch.tensor([1.0, 5.0, 2.3, 3.9] * 3, device=DEVICE)[:H]  # 5.0 > log 100: clamped
    bias = (16 * torch.sigmoid(torch.randn(N, N, H, device=DEVICE))).permute(2, 0, 1).to(dtype)
    mask = shift_mask(wh, ww, *grid).to(DEVICE) if shift else None
    return q, k, v, logit_scale, bias, mask


CASES = [
    # (wh, ww), H, D, B, shifted
    ((7, 7), 3, 32, 2, True),
    ((7, 7), 2, 24, 3, False),
    ((8, 8), 2, 16, 2, True),
    ((8, 8), 3, 32, 1, False),
    ((12, 12), 2, 24, 1, True),
    ((6, 10), 3, 16, 2, True),
    ((8, 8), 3, 32, 2, False, (4.6, 4.6, 4.6)),  # every head at the clamp's edge: logits near 100
]


def _case_id(c) -> str:
    return f"{c[0][0]}x{c[0][1]}_h{c[1]}_d{c[2]}_b{c[3]}_s{int(c[4])}" + ("_ls" if len(c) > 5 else "")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_forward_and_grads_match_float64(case):
    window, H, D, B, shift = case[:5]
    q, k, v, ls, bias, mask = make_inputs(*window, H, D, B, shift)
    if len(case) > 5:
        ls = torch.tensor(case[5], device=DEVICE)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, ls, bias)]
    out = window_attention(*leaves, mask, precision="ieee")
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = reference(*ref_leaves, None if mask is None else mask.double())
    assert relerr(out, ref) <= FWD_BOUND
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    for name, a, b in zip(("q", "k", "v", "logit_scale", "bias"), grads, ref_grads):
        assert a.shape == b.shape, name
        assert relerr(a, b) <= GRAD_BOUND, f"{name}: {relerr(a, b):.3e}"
    if len(case) == 5:  # logit_scale[1] = 5 is above the clamp: no gradient there, as torch.clamp.
        assert ref_grads[3][1] == 0 and grads[3][1] == 0


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_every_window_written(precision):
    """18 windows of 4x4 tokens, two per image of a 3x3 grid's shift mask: every window's output written
    (into an uninitialised tensor) from its own inputs and mask."""
    q, k, v, ls, bias, mask = make_inputs(4, 4, 4, 16, 2, True, grid=(3, 3))
    assert q.shape[0] == 18
    out = window_fwd(q, k, v, ls, bias, mask, precision)
    ref = reference(*(t.double() for t in (q, k, v, ls, bias)), mask.double())
    assert relerr(out, ref) <= FWD_BOUND
    for b in range(18):  # every window written (the output starts uninitialised)
        assert relerr(out[b], ref[b]) <= FWD_BOUND, b
    assert out.transpose(1, 2).is_contiguous()  # [B*nW, N, H, Dv]: the projection's input, no copy


def test_bfloat16_forward():
    q, k, v, ls, bias, mask = make_inputs(7, 7, 2, 32, 2, True, dtype=torch.bfloat16)
    out = window_attention(q, k, v, ls, bias, mask)
    assert out.dtype == torch.bfloat16
    ref = reference(*(t.double() for t in (q, k, v, ls, bias)), mask.double())
    lowp = reference(q, k, v, ls.to(torch.bfloat16), bias, mask.to(torch.bfloat16))
    assert relerr(out, ref) <= LOWP_FACTOR * relerr(lowp, ref)


def _spec64(q, k, v, logit_scale, bias, mask):
    """The window attention through the reference scan in float64 (its rule for non-finite inputs)."""
    q, k, v, bias = (t.double() for t in (q, k, v, bias))
    scale = torch.clamp(logit_scale.double(), max=math.log(100.0)).exp().view(1, -1, 1, 1)
    qn = F.normalize(q, dim=-1) * scale
    full = bias.unsqueeze(0).expand(q.shape[0], -1, -1, -1)
    if mask is not None:
        nW = mask.shape[0]
        full = (full.reshape(-1, nW, *full.shape[1:]) + mask.double()[None, :, None]).reshape(full.shape)
    return scan_attention(qn, F.normalize(k, dim=-1), v, attn_bias=full, scale=1.0)


def _hiding_mask(N, nW):
    """A user mask with ``-inf``: key 5 hidden from every row, key 20 from the first half of the rows, key
    40 hidden by Swin's ``-100`` only (that hides nothing)."""
    mask = torch.zeros(nW, N, N, device=DEVICE)
    mask[..., 5] = -math.inf
    mask[:, : N // 2, 20] = -math.inf
    mask[..., 40] = -100.0
    return mask


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_hidden_nonfinite_keys_and_values_contribute_nothing(precision):
    q, k, v, ls, bias, _ = make_inputs(8, 8, 2, 16, 2, False)
    mask = _hiding_mask(64, 1)
    q, k, v = q.clone(), k.clone(), v.clone()
    k[:, :, 5, :3] = torch.tensor([math.inf, -math.inf, math.nan])
    v[:, :, 5, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    v[:, :, 20, 1] = math.nan  # the rows of the second half see it: NaN in column 1
    v[:, :, 40, 2] = math.inf  # every row sees it (-100 is a tiny weight, not a mask): +inf in column 2
    out = window_attention(q, k, v, ls, bias, mask, precision=precision)
    ref = _spec64(q, k, v, ls, bias, mask)
    assert bool(torch.isposinf(ref[..., 2]).all()) and bool(torch.isnan(ref[..., 32:, 1]).all())
    assert_nonfinite_like(out, ref, FWD_BOUND)
    assert torch.isfinite(out[..., :32, :2]).all()


@pytest.mark.parametrize("precision", ["ieee", "tf32x3"])
def test_hidden_nonfinite_keys_reach_no_gradient(precision):
    """Key rows hidden from every row by a -inf mask hold NaN and infinities: the fused backward's gradients
    are the clean inputs' (theirs 0), a fully masked row has zero gradients."""
    q, k, v, ls, bias, _ = make_inputs(7, 7, 2, 32, 2, True, grid=(1, 2))
    mask = torch.zeros(2, 49, 49, device=DEVICE)
    mask[..., [3, 30]] = -math.inf
    mask[1, 7, :] = -math.inf  # row 7 of window 1 (of each image) sees nothing
    dout = torch.randn(q.shape[0], 2, 49, 32, device=DEVICE)
    clean = window_bwd(dout, q, k, v, ls, bias, mask, precision)
    kp, vp = k.clone(), v.clone()
    kp[:, :, [3, 30], :3] = torch.tensor([math.inf, -math.inf, math.nan], device=DEVICE)
    vp[:, :, [3, 30], :3] = torch.tensor([math.nan, math.inf, -math.inf], device=DEVICE)
    got = window_bwd(dout, q, kp, vp, ls, bias, mask, precision)
    for name, a, b in zip(("q", "k", "v", "bias", "logit_scale"), got, clean):
        assert torch.isfinite(a).all(), name
        assert relerr(a, b) <= FUSED_GRAD_BOUND, f"{name}: {relerr(a, b):.3e}"
    assert (got[1][:, :, [3, 30]] == 0).all() and (got[2][:, :, [3, 30]] == 0).all()
    assert (got[0][1::2, :, 7] == 0).all()


def test_dense_backward_hidden_nonfinite_keys_reach_no_gradient():
    """Windows past the fused backward (12x12 = 144 tokens: PyTorch's dense chunks) follow the same rule."""
    q, k, v, ls, bias, _ = make_inputs(12, 12, 2, 16, 1, False)
    mask = torch.zeros(1, 144, 144, device=DEVICE)
    mask[..., [9, 100]] = -math.inf
    mask[..., 50, :] = -math.inf  # row 50 sees nothing
    kp, vp = k.clone(), v.clone()
    kp[:, :, [9, 100], :3] = torch.tensor([math.inf, -math.inf, math.nan], device=DEVICE)
    vp[:, :, [9, 100], :3] = torch.tensor([math.nan, math.inf, -math.inf], device=DEVICE)
    g = torch.randn(q.shape[0], 2, 144, 16, device=DEVICE)
    grads = []
    for kk, vv in ((k, v), (kp, vp)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, kk, vv, ls, bias)]
        out = window_attention(*leaves, mask, precision="ieee")
        grads.append(torch.autograd.grad(out, leaves, g))
        assert bool((out[..., 50, :] == 0).all())
    for name, a, b in zip(("q", "k", "v", "logit_scale", "bias"), grads[1], grads[0]):
        assert torch.isfinite(a).all(), name
        assert relerr(a, b) <= GRAD_BOUND, f"{name}: {relerr(a, b):.3e}"
    assert (grads[1][1][:, :, [9, 100]] == 0).all() and (grads[1][2][:, :, [9, 100]] == 0).all()
    assert (grads[1][0][:, :, 50] == 0).all()


def test_bias_and_logit_scale_chain_gradcheck():
    """float64 gradcheck of the torch path: logit_scale, cpb_mlp weights (through 16 sigmoid and the index
    gather) and the input, with a shift mask on a 3x3 window."""
    torch.manual_seed(2)
    attn = WindowAttention(dim=8, window_size=(3, 3), num_heads=2).double()
    with torch.no_grad():
        attn.logit_scale.copy_(torch.tensor([1.5, 2.5]).view(2, 1, 1))
        attn.q_bias.normal_()
        attn.v_bias.normal_()
    ElsaSwinV2Attention.convert(attn, backend="torch")
    mask = shift_mask(3, 3, 1, 2).double()
    x = torch.randn(4, 9, 8, dtype=torch.float64)
    names = ["logit_scale", "cpb_mlp.0.weight", "cpb_mlp.0.bias", "cpb_mlp.2.weight"]
    params = dict(attn.named_parameters())

    def f(x, *vals):
        return torch.func.functional_call(attn, {**params, **dict(zip(names, vals))}, (x, mask))

    inputs = (x.requires_grad_(True), *(params[n].detach().clone().requires_grad_(True) for n in names))
    assert torch.autograd.gradcheck(f, inputs, eps=1e-6, atol=1e-7, rtol=1e-5, fast_mode=True)


def test_bad_inputs():
    q, k, v, ls, bias, mask = make_inputs(4, 4, 2, 16, 2, True)
    with pytest.raises(ValueError, match="bias"):
        window_attention(q, k, v, ls, bias[:, :-1], mask)
    with pytest.raises(ValueError, match="mask"):
        window_attention(q, k, v, ls, bias, mask[:3])
    with pytest.raises(ValueError, match="logit_scale"):
        window_attention(q, k, v, ls[:1], bias, mask)
    with pytest.raises(ValueError, match="k must be"):
        window_attention(q, k[:, :, :-1], v, ls, bias, mask)
    with pytest.raises(TypeError, match="dtype"):
        window_attention(q.double(), k.double(), v.double(), ls, bias, mask)
    with pytest.raises(ValueError, match="precision"):
        window_attention(q, k, v, ls, bias, mask, precision="fp8")
    with pytest.raises(ValueError, match="4-D"):
        window_attention(q[0], k, v, ls, bias, mask)
    with pytest.raises(ValueError, match=r"head dims must be in \[1, 256\], got D=0"):  # not 0 ** -0.5
        window_attention(q[..., :0], k[..., :0], v, None, bias, mask)


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(7, 7), (8, 8), (16, 16)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_hidden_nonfinite_keys(window, dtype):
    """Swin shapes on CUDA (fused backward up to 8x8, dense above) with a shift mask that also holds -inf:
    the forward follows the reference rule (the -100 entries hide nothing), the gradients of keys hidden
    from every row holding NaN and infinities are the clean inputs'."""
    wh, ww = window
    N = wh * ww
    q, k, v, ls, bias, mask = make_inputs(wh, ww, 4, 32, 4, True, dtype=dtype, grid=(2, 2))
    mask = mask.clone()
    mask[..., [3, N - 5]] = -math.inf
    kp, vp = k.clone(), v.clone()
    kp[:, :, [3, N - 5], :3] = torch.tensor([math.inf, -math.inf, math.nan], dtype=dtype, device=DEVICE)
    vp[:, :, [3, N - 5], :3] = torch.tensor([math.nan, math.inf, -math.inf], dtype=dtype, device=DEVICE)
    vp[:, :, 10, 4] = math.nan  # visible to every row (where the shift mask has -100, with a tiny weight)
    out = window_attention(q, kp, vp, ls, bias, mask)
    bound = FWD_BOUND if dtype == torch.float32 else 3e-2
    assert_nonfinite_like(out, _spec64(q, kp, vp, ls, bias, mask), bound)
    g = torch.randn(q.shape[0], 4, N, 32, device=DEVICE, dtype=dtype)
    vp[:, :, 10, 4] = v[:, :, 10, 4]  # the gradients compare hidden keys only: the visible entry clean again
    grads = []
    for kk, vv in ((k, v), (kp, vp)):
        leaves = [t.detach().clone().requires_grad_(True) for t in (q, kk, vv, ls, bias)]
        grads.append(torch.autograd.grad(window_attention(*leaves, mask), leaves, g))
    for name, a, b in zip(("q", "k", "v", "logit_scale", "bias"), grads[1], grads[0]):
        assert torch.isfinite(a).all(), name
        assert relerr(a, b) <= (GRAD_BOUND if dtype == torch.float32 else 1e-2), name


@pytest.mark.gpu
@pytest.mark.parametrize("window,H,D,B,nW", [((8, 8), 3, 32, 8, 64), ((16, 16), 6, 32, 8, 16),
                                               ((24, 24), 4, 32, 2, 4), ((7, 7), 12, 32, 4, 9)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_swin_shapes(window, H, D, B, nW, dtype):
    """Swin-v2 T/S/B window shapes on CUDA, forward and gradients (float32: the bounds above; bfloat16: 3x
    PyTorch's bfloat16 error)."""
    wh, ww = window
    grid = (int(math.isqrt(nW)), nW // int(math.isqrt(nW)))
    q, k, v, ls, bias, mask = make_inputs(wh, ww, H, D, B, True, dtype=dtype, grid=grid)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, ls, bias)]
    out = window_attention(*leaves, mask)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = reference(*ref_leaves, mask.double())
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    if dtype == torch.float32:
        assert relerr(out, ref) <= FWD_BOUND
        for a, b in zip(grads, ref_grads):
            assert relerr(a, b) <= GRAD_BOUND
    else:
        lp_leaves = [t.detach().clone().to(dtype).requires_grad_(True) for t in leaves]
        lp = reference(*lp_leaves, mask.to(dtype))
        lp_grads = torch.autograd.grad(lp, lp_leaves, g)
        assert relerr(out, ref) <= LOWP_FACTOR * relerr(lp, ref)
        for a, b, c in zip(grads, ref_grads, lp_grads):
            assert relerr(a, b) <= LOWP_FACTOR * relerr(c, b)


def test_opcheck_and_compile():
    """Schema, fake tensor, autograd registration of the operator; ``torch.compile(fullgraph=True)`` traces
    it without a graph break and gives the eager result."""
    q, k, v, ls, bias, mask = make_inputs(3, 5, 2, 16, 2, True, grid=(1, 2))
    args = (q.contiguous().requires_grad_(True), k.contiguous(), v.contiguous(), ls.requires_grad_(True),
            bias.contiguous().requires_grad_(True), mask, "ieee", 1.0)
    torch.library.opcheck(torch.ops.elsa_vision.window_attention_fwd.default, args,
                          test_utils=("test_schema", "test_autograd_registration", "test_faketensor"))
    eager = window_attention(*args[:6], precision="ieee")
    compiled = torch.compile(lambda *a: window_attention(*a, precision="ieee"), fullgraph=True,
                             backend="eager")
    assert torch.equal(compiled(*args[:6]), eager)


def test_dense_backward_chunks_over_images():
    """The dense backward bounds its memory by chunks of whole images: one chunk and one image at a time
    both match the float64 gradients (dq, dk, dv, bias, logit scale) within the float32 gradient bound
    ``GRAD_BOUND`` (``dscale = sum dS * L`` cancels, ``sum_j dS_ij = 0``: its float32 roundoff measured
    4e-7 on the CPU and 4.2e-6 on an H100, where cuBLAS picks the matmul by batch size)."""
    from elsa_vision.ops.window_attention import _dense_window_grads

    q, k, v, ls, bias, mask = make_inputs(5, 3, 2, 16, 3, True, grid=(2, 2))
    full = bias.unsqueeze(0) + mask.unsqueeze(1)
    dout = torch.randn(q.shape[0], 2, 15, 16, device=DEVICE)
    qd, kd, vd, dd = (t.double() for t in (q, k, v, dout))
    logits = (qd @ kd.transpose(-2, -1)).view(3, 4, 2, 15, 15)
    p = (logits + full.double()).softmax(-1)
    dp = (dd @ vd.transpose(-2, -1)).view(3, 4, 2, 15, 15)
    ds = p * (dp - (p * dp).sum(-1, keepdim=True))
    p4, ds4 = p.view(12, 2, 15, 15), ds.view(12, 2, 15, 15)
    want = (ds4 @ kd, ds4.transpose(-2, -1) @ qd, p4.transpose(-2, -1) @ dd, ds.sum(0),
            (ds * logits).sum((0, 1, 3, 4)))
    one = _dense_window_grads(dout, q, k, v, full, 4)
    per_image = _dense_window_grads(dout, q, k, v, full, 4, max_elements=1)
    for got in (one, per_image):
        for a, b in zip(got, want, strict=True):
            assert relerr(a, b) <= GRAD_BOUND
    no_qkv = _dense_window_grads(dout, q, k, v, full, 4, need_qkv=False)
    assert no_qkv[:3] == (None, None, None) and torch.equal(no_qkv[3], one[3])


def _float64_grads(q, k, v, ls, bias, mask, dout):
    leaves = [t.detach().double().requires_grad_(True) for t in (q, k, v, ls, bias)]
    ref = reference(*leaves, None if mask is None else mask.double())
    return torch.autograd.grad(ref, leaves, dout.double())


@pytest.mark.parametrize("precision", ["ieee", "tf32x3", "fp16x3"])
def test_fused_backward_tail_and_zero_rows(precision):
    """``window_bwd`` straight: 27 windows of 7x7 (on the CPU 4 per program, the last group partial), a query
    row and a key row of zeros (``F.normalize``'s clamped branch: gradient ``dy / eps``), logit scales at
    and above the clamp. Every gradient within ``GRAD_BOUND`` of float64 autograd; ``dscale`` is the
    logit-scale gradient before the clamp."""
    q, k, v, ls, bias, mask = make_inputs(7, 7, 3, 32, 3, True, grid=(3, 3))
    q, k = q.clone(), k.clone()
    q[4, 1, 10] = 0
    k[11, 2, 0] = 0
    ls = torch.tensor([2.0, 4.6, 3.1], device=DEVICE)
    Bw, H, N = q.shape[:3]
    cfg = window_bwd_plan(Bw, H, N, 32, 32, q.device)
    if DEVICE == "cpu":  # a GPU's SM count gives one window per program at this size
        assert cfg["WINDOWS"] == 4 and Bw % cfg["WINDOWS"] != 0
    dout = torch.randn(Bw, H, N, 32, device=DEVICE)
    dq, dk, dv, dbias, dscale = window_bwd(dout, q, k, v, ls, bias, mask, precision)
    want = _float64_grads(q, k, v, ls, bias, mask, dout)
    for name, a, b in zip(("q", "k", "v", "logit_scale", "bias"), (dq, dk, dv, dscale, dbias), want):
        assert a.shape == b.shape, name
        assert torch.isfinite(a).all(), name
        bound = GRAD_BOUND if name == "logit_scale" else FUSED_GRAD_BOUND
        assert relerr(a, b) <= bound, f"{name}: {relerr(a, b):.3e}"
    assert relerr(dq[4, 1, 10], want[0][4, 1, 10]) <= FUSED_GRAD_BOUND  # the clamped row alone
    none = window_bwd(dout, q, k, v, ls, bias, mask, precision, need_qkv=False)
    assert none[:3] == (None, None, None)
    assert relerr(none[3], dbias) <= 1e-6 and relerr(none[4], dscale) <= 1e-6


def test_fused_backward_agrees_with_dense_backward():
    """The two backward routes of the operator (fused kernel up to 64 tokens, PyTorch dense chunks above)
    give the same gradients on the same 8x8 windows within the float32 gradient bound."""
    from elsa_vision.ops.window_attention import _dense_backward

    q, k, v, ls, bias, mask = make_inputs(8, 8, 2, 16, 2, True)
    dout = torch.randn(q.shape[0], 2, 64, 16, device=DEVICE)
    fused = window_bwd(dout, q, k, v, ls, bias, mask, "ieee")
    dense = _dense_backward(dout, q, k, v, ls, bias, mask, "ieee", 1.0, True, True)
    for name, a, b in zip(("q", "k", "v", "bias", "logit_scale"), fused, dense):
        assert relerr(a, b.to(a.dtype)) <= GRAD_BOUND, name


def test_fused_backward_bfloat16():
    """bfloat16 inputs: float32 arithmetic inside, gradients in bfloat16 within 3x the error of PyTorch's
    bfloat16 autograd of the same math."""
    q, k, v, ls, bias, mask = make_inputs(7, 7, 2, 32, 2, True, dtype=torch.bfloat16)
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, ls, bias)]
    out = window_attention(*leaves, mask)
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, g)
    want = _float64_grads(q, k, v, ls, bias, mask, g)
    lp_leaves = [t.detach().clone().to(torch.bfloat16).requires_grad_(True) for t in (q, k, v, ls, bias)]
    lp_grads = torch.autograd.grad(reference(*lp_leaves, mask.to(torch.bfloat16)), lp_leaves, g)
    assert all(t.dtype == torch.bfloat16 for t in grads[:3])
    for name, a, b, c in zip(("q", "k", "v", "logit_scale", "bias"), grads, want, lp_grads):
        assert relerr(a, b) <= LOWP_FACTOR * relerr(c, b), f"{name}: {relerr(a, b):.3e} vs {relerr(c, b):.3e}"


def test_fused_backward_bad_inputs():
    q, k, v, ls, bias, mask = make_inputs(9, 8, 2, 16, 1, False)
    assert q.shape[2] > BWD_MAX_TOKENS
    with pytest.raises(ValueError, match="at most 64 tokens"):
        window_bwd(torch.zeros_like(v), q, k, v, ls, bias, mask)



# ------------------------------------------------------------------------------ Swin v1 (plain logits)


def reference_v1(q, k, v, scale, bias, mask):
    """Swin-v1 window attention as timm's math path writes it (dense scores), in the inputs' dtype."""
    attn = (q * scale) @ k.transpose(-2, -1) + bias.unsqueeze(0)
    if mask is not None:
        nW = mask.shape[0]
        attn = (attn.view(-1, nW, *attn.shape[1:]) + mask.to(attn.dtype)[None, :, None]).view(attn.shape)
    return attn.softmax(-1) @ v


V1_CASES = [((7, 7), 3, 32, 2, True), ((8, 8), 2, 24, 1, False), ((12, 12), 2, 16, 1, True)]


@pytest.mark.parametrize("case", V1_CASES, ids=_case_id)
def test_swin_v1_logits_match_float64(case):
    """``logit_scale=None``: plain ``q . k * scale`` logits (timm Swin v1), forward and gradients of q, k, v
    and the bias against float64, through the fused backward (7x7, 8x8) and the dense one (12x12)."""
    window, H, D, B, shift = case
    q, k, v, _, bias, mask = make_inputs(*window, H, D, B, shift)
    bias = bias - 8.0  # a relative-position table's range, centred
    scale = D ** -0.5
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v, bias)]
    out = window_attention(leaves[0], leaves[1], leaves[2], None, leaves[3], mask, precision="ieee",
                           scale=scale)
    ref_leaves = [t.detach().double().requires_grad_(True) for t in leaves]
    ref = reference_v1(ref_leaves[0], ref_leaves[1], ref_leaves[2], scale, ref_leaves[3],
                       None if mask is None else mask.double())
    assert relerr(out, ref) <= FWD_BOUND
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, leaves, dout)
    want = torch.autograd.grad(ref, ref_leaves, dout.double())
    for name, a, b in zip("qkvb", grads, want):
        assert relerr(a, b) <= FUSED_GRAD_BOUND, name
    # the default scale is D ** -0.5
    assert torch.equal(window_attention(q, k, v, None, bias, mask, precision="ieee"),
                       window_attention(q, k, v, None, bias, mask, precision="ieee", scale=scale))


def test_swin_v1_layer_fused_equals_fallback():
    """The converted timm Swin v1 module: the W-ELSA route (backend triton) and the elsa_attention fallback
    (backend torch) give the same block output."""
    from timm.models.swin_transformer import WindowAttention as V1

    from elsa_vision.layers import ElsaSwinWindowAttention

    attn = V1(32, num_heads=2, window_size=(7, 7)).to(DEVICE).eval()
    with torch.no_grad():
        attn.relative_position_bias_table.normal_()
    ElsaSwinWindowAttention.convert(attn, backend="triton", precision="ieee")
    x = torch.randn(2 * 4, 49, 32, device=DEVICE)
    mask = shift_mask(7, 7, 2, 2).to(DEVICE)
    with torch.no_grad():
        fused = attn(x, mask)
        attn.backend = "torch"
        fallback = attn(x, mask)
    assert relerr(fused, fallback.double()) <= FWD_BOUND
