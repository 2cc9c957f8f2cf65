"""``ElsaAttention`` is a drop-in for timm's ``Attention``: same names, same constructor, same outputs."""

import inspect

import pytest
import torch
from timm.layers import Attention

from elsa_vision import ElsaAttention
from tests.helpers import emulate_cuda_autocast_layer_norm, relerr

CONFIGS = [
    dict(dim=64, num_heads=4),
    dict(dim=96, num_heads=3, qkv_bias=True),
    dict(dim=80, num_heads=2, qk_norm=True, norm_layer=torch.nn.LayerNorm),
    dict(dim=64, num_heads=4, scale_norm=True, norm_layer=torch.nn.LayerNorm, proj_bias=False),
]
if "gated" in inspect.signature(Attention.__init__).parameters:
    CONFIGS.append(dict(dim=64, num_heads=2, gated=True, qkv_bias=True))


def _pair(cfg):
    ref = Attention(**cfg).double()
    ours = ElsaAttention(**cfg).double()
    assert set(ours.state_dict()) == set(ref.state_dict())
    ours.load_state_dict(ref.state_dict())
    return ref, ours


def test_constructor_accepts_timm_arguments():
    timm_args = set(inspect.signature(Attention.__init__).parameters) - {"self"}
    ours = set(inspect.signature(ElsaAttention.__init__).parameters)
    assert timm_args <= ours, f"missing: {timm_args - ours}"


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()
                                                              if k != "norm_layer"))
def test_same_output_and_grads_as_timm(cfg):
    ref, ours = _pair(cfg)
    x = torch.randn(2, 197, cfg["dim"], dtype=torch.float64, requires_grad=True)
    y_ref = ref(x)
    g_ref = torch.autograd.grad(y_ref.square().sum(), [x, *ref.parameters()])
    y = ours(x)
    g = torch.autograd.grad(y.square().sum(), [x, *ours.parameters()])
    assert relerr(y, y_ref) <= 1e-12
    # Some gradients are exactly 0 in exact arithmetic (k_norm's bias shifts every logit of a row
    # equally), so each is judged relative to the largest gradient norm: ‖g − g_ref‖ <= 1e-11 · max‖g_ref‖.
    scale = max(b.norm().item() for b in g_ref)
    for a, b in zip(g, g_ref):
        assert (a - b).norm().item() <= 1e-11 * scale


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_attn_mask_and_causal(mask_kind):
    ref, ours = _pair(dict(dim=32, num_heads=2))
    x = torch.randn(2, 13, 32, dtype=torch.float64)
    if mask_kind == "bool":
        mask = torch.rand(2, 1, 13, 13) > 0.3
        mask[..., 0] = True  # every row keeps a key: SDPA returns NaN for empty rows, ELSA returns 0
    else:
        mask = torch.randn(2, 1, 13, 13, dtype=torch.float64)
    assert relerr(ours(x, attn_mask=mask), ref(x, attn_mask=mask)) <= 1e-12
    if "is_causal" in inspect.signature(Attention.forward).parameters:
        assert relerr(ours(x, is_causal=True), ref(x, is_causal=True)) <= 1e-12


def test_float32_matches_float64_reference():
    ref, ours = _pair(dict(dim=64, num_heads=4, qkv_bias=True))
    ref32 = Attention(dim=64, num_heads=4, qkv_bias=True)
    ours32 = ElsaAttention(dim=64, num_heads=4, qkv_bias=True)
    ref32.load_state_dict(ref.state_dict())
    ours32.load_state_dict(ref.state_dict())
    x = torch.randn(3, 785, 64, dtype=torch.float64)
    expected = ref(x)
    assert relerr(ours32(x.float()), expected) <= 1e-6


def test_dropout_only_in_training():
    layer = ElsaAttention(dim=32, num_heads=2, attn_drop=0.5)
    x = torch.randn(1, 20, 32)
    layer.eval()
    assert torch.equal(layer(x), layer(x))
    layer.train()
    assert not torch.equal(layer(x), layer(x))


def test_trains_one_step():
    layer = ElsaAttention(dim=32, num_heads=4, qkv_bias=True)
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    x, target = torch.randn(4, 10, 32), torch.randn(4, 10, 32)
    loss0 = torch.nn.functional.mse_loss(layer(x), target)
    loss0.backward()
    opt.step()
    assert torch.nn.functional.mse_loss(layer(x), target) < loss0


def test_bad_arguments():
    with pytest.raises(ValueError, match="backend"):
        ElsaAttention(32, backend="cudnn")
    with pytest.raises(ValueError, match="precision"):
        ElsaAttention(32, precision="half")
    with pytest.raises(ValueError, match="divisible"):
        ElsaAttention(30, num_heads=4)
    with pytest.raises(ValueError, match="norm_layer"):
        ElsaAttention(32, qk_norm=True)
    with pytest.raises(TypeError, match="attn_mask"):
        ElsaAttention(32, num_heads=2)(torch.randn(1, 4, 32),
                                       attn_mask=torch.ones(1, 1, 4, 4, dtype=torch.int64))


@pytest.mark.parametrize("qk_norm", [False, True])
def test_inference_path_is_planned_once_and_equals_the_general_path(qk_norm, monkeypatch):
    """Inference without a mask: the call is checked and planned once per input signature
    (``ops.attention.inference_call``), later calls go straight to the launch program; the output equals
    the general ``elsa_attention`` path (grad on), a precision change re-plans, copies and pickles drop the
    plans."""
    import copy
    import io

    import elsa_vision.layers.attention as layer_module

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    attn = ElsaAttention(64, num_heads=4, qkv_bias=True, qk_norm=qk_norm,
                         norm_layer=torch.nn.LayerNorm if qk_norm else None, backend="triton").to(dev).eval()
    x = torch.randn(2, 37, 64, device=dev)
    planned = []
    real = layer_module.inference_call
    monkeypatch.setattr(layer_module, "inference_call", lambda *a, **k: planned.append(1) or real(*a, **k))
    with torch.no_grad():
        first, second = attn(x), attn(x)
    assert len(planned) == 1 and torch.equal(first, second)
    general = attn(x)  # grad enabled: the autograd path of elsa_attention
    assert relerr(first, general.detach().double()) <= 1e-6
    attn.precision = "ieee"
    with torch.no_grad():
        attn(x)
    assert len(planned) == 2
    clone = copy.deepcopy(attn)
    assert "_elsa_calls" not in clone.__dict__
    buf = io.BytesIO()
    torch.save(attn, buf)  # the planned programs are not part of the module's state
    with torch.no_grad():
        assert torch.equal(clone(x), attn(x))


def test_inference_plan_follows_autocast():
    """Under autocast ``x`` keeps its dtype but q, k, v take the autocast dtype: the planned call of one must
    not be reused for the other."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    attn = ElsaAttention(32, num_heads=2, backend="triton").to(dev).eval()
    x = torch.randn(2, 19, 32, device=dev)
    with torch.no_grad():
        with torch.autocast(dev, dtype=torch.bfloat16):
            low = attn(x)
        full = attn(x)
    assert low.dtype == torch.bfloat16 and full.dtype == torch.float32
    general = attn(x).detach()  # grad enabled: not the planned path
    assert relerr(full, general.double()) <= 1e-6
    assert relerr(low.float(), general.double()) <= 2e-2


def test_qk_norm_in_float32_under_autocast_attends_in_one_dtype(monkeypatch):
    """CUDA autocast computes ``layer_norm`` in float32 and returns float32 (the CPU's keeps bfloat16), so the
    q/k norms give float32 q, k beside the projection's bfloat16 v; the layer hands the kernels q, k, v of v's
    dtype (as SDPA's autocast does). The CUDA policy is emulated on the CPU by a float32 ``F.layer_norm``."""
    torch.manual_seed(0)
    attn = ElsaAttention(32, num_heads=2, qk_norm=True, norm_layer=torch.nn.LayerNorm, backend="torch")
    x = torch.randn(2, 19, 32)
    with torch.no_grad():
        ref = attn(x)
    seen = emulate_cuda_autocast_layer_norm(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        assert attn.q_norm(torch.ones(2, 16, dtype=torch.bfloat16)).dtype == torch.float32  # the emulation
        out = attn(x)
    assert seen and all(d == (torch.bfloat16,) * 3 for d in seen), seen
    assert out.dtype == torch.bfloat16 and relerr(out.float(), ref.double()) <= 2e-2


@pytest.mark.parametrize("cfg", [dict(qkv_bias=True), dict(qk_norm=True, scale_norm=True,
                                                           norm_layer=torch.nn.LayerNorm, gated=True)],
                         ids=["plain", "norms-gate"])
def test_query_chunk_is_the_same_attention(cfg, monkeypatch):
    """``query_chunk``: query rows attend a chunk at a time against all keys (each row is independent), so
    outputs and gradients equal the unchunked layer's in float64 (<= 1e-12), with and without a mask whose
    rows are sliced per chunk; the attention calls see ``query_chunk`` rows and every key."""
    import elsa_vision.layers.attention as layer_module

    torch.manual_seed(0)
    whole = ElsaAttention(32, num_heads=4, backend="torch", **cfg).double()
    chunked = ElsaAttention(32, num_heads=4, backend="torch", query_chunk=7, **cfg).double()
    chunked.load_state_dict(whole.state_dict())
    x = torch.randn(2, 30, 32, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(2, 1, 30, 30) > 0.3
    mask[..., 0] = True
    shapes = []
    real = layer_module.elsa_attention

    def spy(q, k, v, **kw):
        shapes.append((q.shape[-2], k.shape[-2]))
        return real(q, k, v, **kw)

    monkeypatch.setattr(layer_module, "elsa_attention", spy)
    for m in (None, mask, mask[:, :, :1]):
        y = chunked(x, attn_mask=m)
        y_ref = whole(x, attn_mask=m)
        assert relerr(y, y_ref) <= 1e-12
        g, g_ref = (torch.autograd.grad(t.square().sum(), [x, *mod.parameters()])
                    for t, mod in ((y, chunked), (y_ref, whole)))
        assert all((a - b).norm() <= 1e-11 * max(r.norm() for r in g_ref) for a, b in zip(g, g_ref))
    assert shapes[:5] == [(7, 30), (7, 30), (7, 30), (7, 30), (2, 30)]
    with torch.no_grad():
        assert relerr(chunked(x), whole(x)) <= 1e-12  # inference: chunks are never planned launches
    assert "query_chunk=7" in repr(chunked)


def test_query_chunk_errors():
    with pytest.raises(ValueError, match="query_chunk must be None or an int >= 1"):
        ElsaAttention(32, num_heads=2, query_chunk=0)
    layer = ElsaAttention(32, num_heads=2, query_chunk=4)
    with pytest.raises(ValueError, match="query_chunk is not available with is_causal=True"):
        layer(torch.randn(1, 9, 32), is_causal=True)
    assert layer(torch.randn(1, 4, 32), is_causal=True).shape == (1, 4, 32)  # one chunk: no chunking
    for bad in (0, -3, 2.5, True):  # set after construction (as high-resolution inference does): checked too
        with pytest.raises(ValueError, match="query_chunk must be None or an int >= 1"):
            layer.query_chunk = bad
    assert layer.query_chunk == 4
