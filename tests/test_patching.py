"""patch_attention / sdpa_override: outputs unchanged after patching, ELSA actually called, errors.

Model-level checks compare the patched model with an unpatched deep copy, both float32:
‖patched − original‖/‖original‖ <= 1e-5. Functional checks of the SDPA mapping compare with SDPA run in
float64 on the same inputs: relative error <= 1e-6.
"""

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

import elsa_vision.layers.attention as elsa_attention_module
import elsa_vision.layers.attention_pool as elsa_pool_module
import elsa_vision.layers.multihead_attention as elsa_mha_module
import elsa_vision.layers.sdpa as elsa_sdpa_module
import elsa_vision.layers.window_attention as elsa_window_module
from elsa_vision import (
    ElsaAttention,
    PatchReport,
    patch_attention,
    patch_swin_attention,
    patch_vit_attention,
    sdpa_override,
)
from elsa_vision.patching import ElsaMultiheadAttention, ElsaSwinV2WindowAttention, ElsaSwinWindowAttention
from tests.helpers import randomize_, relerr

TOL = 1e-5
SDPA = F.scaled_dot_product_attention  # the function as shipped, captured before any override


@pytest.fixture
def elsa_calls(monkeypatch):
    """Counts every elsa_attention (and W-ELSA window op) call made by patched modules and by the SDPA
    override."""
    calls = {"n": 0}
    for mod, fn in ((elsa_sdpa_module, "elsa_attention"), (elsa_attention_module, "elsa_attention"),
                    (elsa_pool_module, "elsa_attention"), (elsa_mha_module, "elsa_attention"),
                    (elsa_window_module, "elsa_attention"), (elsa_window_module, "window_attention")):
        orig = getattr(mod, fn)

        def counted(*a, _orig=orig, **k):
            calls["n"] += 1
            return _orig(*a, **k)

        monkeypatch.setattr(mod, fn, counted)
    return calls


def _patched_equals(model, x, expect_counts, elsa_calls, **opts):
    model = randomize_(model).eval()
    ref_model = copy.deepcopy(model)
    report = patch_attention(model, **opts)
    assert isinstance(report, PatchReport)
    assert dict(report.counts) == expect_counts and report.total == sum(expect_counts.values())
    with torch.no_grad():
        ref = ref_model(x)
        before = elsa_calls["n"]
        out = model(x)
    assert elsa_calls["n"] - before >= report.total
    assert relerr(out, ref) <= TOL
    # Weights are the same tensors' values: the state_dicts agree key by key.
    sd_ref = ref_model.state_dict()
    assert all(torch.equal(v, sd_ref[k]) for k, v in model.state_dict().items())
    return model, report


def test_patch_vit(elsa_calls):
    model = timm.create_model("vit_small_patch16_224", depth=2, img_size=96, qk_norm=True, init_values=0.1)
    model, report = _patched_equals(model, torch.randn(2, 3, 96, 96), {"Attention": 2}, elsa_calls)
    assert all(isinstance(b.attn, ElsaAttention) for b in model.blocks)
    assert "2 x Attention" in str(report)


def test_patch_vit_map_head_and_timm_math_path(elsa_calls):
    model = timm.create_model("vit_small_patch16_224", depth=2, img_size=64, global_pool="map",
                              class_token=False)
    for blk in model.blocks:  # the unfused (math) timm path is the reference here
        blk.attn.fused_attn = False
    _patched_equals(model, torch.randn(2, 3, 64, 64), {"Attention": 2, "AttentionPoolLatent": 1}, elsa_calls)


def test_patch_swin_v1(elsa_calls):
    model = timm.create_model("swin_tiny_patch4_window7_224", embed_dim=32, depths=(2, 2, 2, 2),
                              num_heads=(2, 2, 4, 4), num_classes=10)
    model, _ = _patched_equals(model, torch.randn(2, 3, 224, 224), {"WindowAttention": 8}, elsa_calls)
    attns = [m for m in model.modules() if isinstance(m, ElsaSwinWindowAttention)]
    assert len(attns) == 8
    # The shifted blocks' mask matters: dropping it changes the block output far beyond the tolerance.
    blk = model.layers[0].blocks[1]
    assert blk.attn_mask is not None
    x = torch.randn(2 * 64, 49, 32)
    with torch.no_grad():
        assert relerr(blk.attn(x, mask=None), blk.attn(x, mask=blk.attn_mask)) > 1e-3


def test_patch_swin_v1_mask_against_float64(elsa_calls):
    # One window attention with relative position bias and a Swin shift mask (-100), vs the float64 formula.
    model = timm.create_model("swin_tiny_patch4_window7_224", embed_dim=32, depths=(2, 2, 2, 2),
                              num_heads=(2, 2, 4, 4))
    attn = randomize_(model).layers[0].blocks[1].attn
    mask = model.layers[0].blocks[1].attn_mask  # [nW, 49, 49]
    patch_swin_attention(model)
    x = torch.randn(3 * mask.shape[0], 49, 32)
    with torch.no_grad():
        out = attn(x, mask=mask)
        a64 = copy.deepcopy(attn).double()
        xd = x.double()
        qkv = a64.qkv(xd).reshape(x.shape[0], 49, 3, 2, 16).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        s = (q * a64.scale) @ k.transpose(-2, -1) + a64._get_rel_pos_bias()
        s = s.view(3, mask.shape[0], 2, 49, 49) + mask.double()[None, :, None]
        ref = a64.proj((s.view(-1, 2, 49, 49).softmax(-1) @ v).transpose(1, 2).reshape(x.shape[0], 49, 32))
    assert relerr(out, ref) <= 1e-6


def test_patch_swin_v2(elsa_calls):
    model = timm.create_model("swinv2_tiny_window8_256", embed_dim=32, depths=(2, 2, 2, 2),
                              num_heads=(2, 2, 4, 4), num_classes=10)
    with torch.no_grad():  # a position bias and logit scales that vary (timm's init makes both ~constant)
        for m in model.modules():
            if hasattr(m, "cpb_mlp"):
                m.cpb_mlp[-1].weight.normal_(0, 1.0)
                m.logit_scale.uniform_(1.0, 3.0)
    model, report = _patched_equals(model, torch.randn(2, 3, 256, 256), {"WindowAttention": 8}, elsa_calls)
    assert sum(isinstance(m, ElsaSwinV2WindowAttention) for m in model.modules()) == 8


def test_patch_eva(elsa_calls):
    model = timm.create_model("eva02_tiny_patch14_224", depth=2, img_size=112)
    model, _ = _patched_equals(model, torch.randn(2, 3, 112, 112), {"EvaAttention": 2}, elsa_calls)


_NARROW_SWIN = dict(embed_dim=32, depths=(2, 1, 1, 1), num_heads=(2, 2, 4, 4))


@pytest.mark.parametrize("name,kw,side", [
    ("swin_tiny_patch4_window7_224", _NARROW_SWIN, 224),
    ("swinv2_tiny_window8_256", dict(_NARROW_SWIN, img_size=64), 64),
    ("eva02_tiny_patch14_224", dict(depth=1, img_size=28), 28),
    ("vit_small_patch16_224", dict(depth=1, img_size=32, global_pool="map"), 32),
])
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_patched_models_trace_with_fx(name, kw, side):
    """Patched timm models stay FX-traceable as timm's originals are: the converted attention modules are
    leaves of timm's registry (torchvision's feature extraction with timm's tracer arguments). TorchScript is
    refused in one error."""
    from timm.models import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names

    model = timm.create_model(name, num_classes=5, **kw).eval()
    assert patch_attention(model).total >= 1
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions())
    last = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)[1][-1]
    fx = create_feature_extractor(model, [last], tracer_kwargs=tracer_kwargs)
    x = torch.randn(1, 3, side, side)
    with torch.no_grad():
        assert torch.equal(fx(x)[last], model(x))
    with pytest.raises(RuntimeError, match="is not scriptable: elsa_vision does not support TorchScript"):
        torch.jit.script(model)


def test_patch_torch_encoder_fast_path_off(elsa_calls):
    layer = nn.TransformerEncoderLayer(48, 4, dim_feedforward=96, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
    x = torch.randn(2, 11, 48)
    model, _ = _patched_equals(model, x, {"MultiheadAttention": 2}, elsa_calls)
    assert all(isinstance(m.self_attn, ElsaMultiheadAttention) for m in model.layers)


@pytest.mark.parametrize("batch_first", [True, False])
def test_multihead_attention_masks(batch_first, elsa_calls):
    torch.manual_seed(0)
    ref = randomize_(nn.MultiheadAttention(40, 5, batch_first=batch_first)).eval()
    mha = copy.deepcopy(ref)
    patch_attention(mha)
    B, L, S = 3, 7, 9
    shape = lambda n: (B, n, 40) if batch_first else (n, B, 40)  # noqa: E731
    q, kv = torch.randn(shape(L)), torch.randn(shape(S))
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1, 5:] = True
    cases = [
        {},
        {"key_padding_mask": kpm},
        {"key_padding_mask": torch.zeros(B, S).masked_fill(kpm, float("-inf"))},
        {"attn_mask": torch.rand(L, S) < 0.3},
        {"attn_mask": torch.randn(L, S)},
        {"attn_mask": torch.randn(B * 5, L, S), "key_padding_mask": kpm.float() * -1e4},
    ]
    for kw in cases:
        with torch.no_grad():
            out, w = mha(q, kv, kv, need_weights=False, **kw)
            expect, _ = ref(q, kv, kv, need_weights=False, **kw)
        assert w is None
        assert relerr(out, expect) <= TOL, kw
    # Self-attention (one fused projection) with both masks.
    self_mask, self_kpm = torch.rand(L, L) < 0.3, torch.zeros(B, L, dtype=torch.bool)
    self_kpm[2, 4:] = True
    with torch.no_grad():
        out, _ = mha(q, q, q, need_weights=False, attn_mask=self_mask, key_padding_mask=self_kpm)
        expect, _ = ref(q, q, q, need_weights=False, attn_mask=self_mask, key_padding_mask=self_kpm)
    assert relerr(out, expect) <= TOL
    # Unbatched input [L, E].
    with torch.no_grad():
        assert relerr(mha(q[0] if batch_first else q[:, 0], kv[0] if batch_first else kv[:, 0],
                          kv[0] if batch_first else kv[:, 0], need_weights=False)[0],
                      ref(q[0] if batch_first else q[:, 0], kv[0] if batch_first else kv[:, 0],
                          kv[0] if batch_first else kv[:, 0], need_weights=False)[0]) <= TOL
    with pytest.raises(ValueError, match="need_weights"):
        mha(q, kv, kv)


def test_open_clip_towers(elsa_calls):
    open_clip = pytest.importorskip("open_clip")
    from open_clip.transformer import TextTransformer, VisionTransformer

    vis = VisionTransformer(image_size=64, patch_size=16, width=64, layers=2, heads=4, mlp_ratio=4.0,
                            output_dim=32, attentional_pool=True, attn_pooler_queries=8, attn_pooler_heads=4)
    _patched_equals(vis, torch.randn(2, 3, 64, 64), {"MultiheadAttention": 3}, elsa_calls)
    # The text tower runs its blocks with a causal float mask.
    text = TextTransformer(context_length=12, vocab_size=50, width=64, heads=4, layers=2, output_dim=32)
    tokens = torch.randint(1, 50, (3, 12))
    _patched_equals(text, tokens, {"MultiheadAttention": 2}, elsa_calls)
    assert open_clip is not None


def test_patch_errors():
    with pytest.raises(ValueError, match="no module of kinds"):
        patch_attention(nn.Sequential(nn.Linear(4, 4), nn.ReLU()))
    with pytest.raises(ValueError, match="skipped"):
        patch_attention(nn.Sequential(nn.MultiheadAttention(8, 2, add_bias_kv=True)))
    vit = timm.create_model("vit_small_patch16_224", depth=1, img_size=32)
    with pytest.raises(ValueError, match="no module of kinds"):
        patch_swin_attention(vit)
    with pytest.raises(ValueError, match="backend"):
        patch_attention(vit, backend="cuda")
    with pytest.raises(ValueError, match="kinds"):
        patch_attention(vit, kinds=("conv",))
    assert patch_vit_attention(vit).total == 1
    with pytest.raises(ValueError, match="no module of kinds"):  # already patched: nothing left to do
        patch_vit_attention(vit)


def test_patch_sets_the_options_of_the_swapped_layers_only():
    """The options go to the layers ``patch_attention`` swapped (through ``layers.set_attention``); ELSA
    layers the model already had keep theirs."""
    model = nn.Sequential(ElsaAttention(16, num_heads=2, precision="ieee"), nn.MultiheadAttention(16, 2),
                          timm.layers.Attention(16, num_heads=2))
    report = patch_attention(model, backend="torch", precision="tf32x3")
    assert report.total == 2 and isinstance(model[1], ElsaMultiheadAttention)
    assert (model[0].backend, model[0].precision) == ("auto", "ieee")
    assert all((m.backend, m.precision) == ("torch", "tf32x3") for m in (model[1], model[2]))
    assert isinstance(model[2], ElsaAttention)


# sdpa_override


def test_sdpa_override_timm_vit(elsa_calls):
    model = randomize_(timm.create_model("vit_small_patch16_224", depth=2, img_size=64)).eval()
    assert model.blocks[0].attn.fused_attn
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        ref = model(x)
        with sdpa_override():
            assert F.scaled_dot_product_attention is not SDPA
            out = model(x)
    assert elsa_calls["n"] == 2
    assert F.scaled_dot_product_attention is SDPA
    assert relerr(out, ref) <= TOL


def test_sdpa_override_restores_on_error_and_nesting():
    with pytest.raises(RuntimeError, match="boom"):
        with sdpa_override():
            raise RuntimeError("boom")
    assert F.scaled_dot_product_attention is SDPA
    with sdpa_override(precision="ieee"):
        outer = F.scaled_dot_product_attention
        with sdpa_override():
            assert F.scaled_dot_product_attention is not outer
        assert F.scaled_dot_product_attention is outer
    assert F.scaled_dot_product_attention is SDPA
    with pytest.raises(ValueError, match="precision"):
        with sdpa_override(precision="fp8"):
            pass
    assert F.scaled_dot_product_attention is SDPA
    assert elsa_sdpa_module.elsa_sdpa("torch", "ieee") is elsa_sdpa_module.elsa_sdpa("torch", "ieee")  # once
    with pytest.raises(ValueError, match="elsa_sdpa: unknown backend 'cuda'"):  # checked where it is built
        elsa_sdpa_module.elsa_sdpa("cuda")


def _sdpa_cases():
    g = torch.Generator().manual_seed(7)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    q, k, v = r(2, 3, 13, 24), r(2, 3, 17, 24), r(2, 3, 17, 20)
    bool_mask = torch.rand(13, 17, generator=g) > 0.4
    bool_mask[:, 0] = True
    return {
        "plain": ((q, k, v), {}),
        "bool_mask": ((q, k, v), {"attn_mask": bool_mask}),
        "float_mask_bcast": ((q, k, v), {"attn_mask": r(2, 1, 13, 17)}),
        "causal_square": ((q, k[:, :, :13], v[:, :, :13]), {"is_causal": True}),
        "causal_top_left": ((q, k, v), {"is_causal": True}),
        "causal_more_queries": ((r(2, 3, 17, 24), q, r(2, 3, 13, 20)), {"is_causal": True}),
        "scale": ((q, k, v), {"scale": 0.37}),
        "rank3": ((q[0], k[0], v[0]), {"attn_mask": bool_mask}),
        "rank5": ((r(2, 2, 3, 13, 24), r(2, 2, 3, 17, 24), r(2, 2, 3, 17, 20)), {"attn_mask": r(13, 17)}),
        "gqa": ((r(2, 6, 13, 24), k, v), {"enable_gqa": True}),
    }


@pytest.mark.parametrize("case", list(_sdpa_cases()))
def test_sdpa_override_functional(case, elsa_calls):
    (q, k, v), kw = _sdpa_cases()[case]
    with sdpa_override():
        out = F.scaled_dot_product_attention(q, k, v, **kw)
    kw64 = {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t)
            for n, t in kw.items()}
    ref = SDPA(q.double(), k.double(), v.double(), **kw64)
    assert elsa_calls["n"] == 1
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert relerr(out, ref) <= 1e-6


def test_sdpa_override_fully_masked_rows_are_zero():
    q, k, v = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    mask = torch.ones(4, 5, dtype=torch.bool)
    mask[2] = False
    with sdpa_override():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert torch.isfinite(out).all() and out[:, :, 2].abs().max() == 0
    assert relerr(out[:, :, [0, 1, 3]], SDPA(q, k, v)[:, :, [0, 1, 3]]) <= 1e-6


def test_sdpa_override_dropout_and_errors():
    q = torch.randn(2, 2, 9, 8)
    with sdpa_override():
        torch.manual_seed(0)
        a = F.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
        b = F.scaled_dot_product_attention(q, q, q)
        assert a.shape == b.shape and relerr(a, b) > 1e-2  # dropout was applied
        with pytest.raises(ValueError, match="not both"):
            mask = torch.ones(9, 9, dtype=torch.bool)
            F.scaled_dot_product_attention(q, q, q, attn_mask=mask, is_causal=True)
        with pytest.raises(ValueError, match="enable_gqa"):
            F.scaled_dot_product_attention(torch.randn(2, 4, 9, 8), q, q)
        with pytest.raises(ValueError, match="rank >= 2"):
            F.scaled_dot_product_attention(torch.randn(8), q, q)


def test_patch_swin_v2_gradients_float64():
    # Training through the patched model: each parameter gradient (logit_scale, cpb_mlp, q/v bias ...) equals
    # timm's. Both run in float64 so that the check isolates the patch's mapping of the attention (cosine
    # logits, per-head scale, bias, mask) from float32 rounding of either implementation: rel. error <= 1e-10.
    model = randomize_(timm.create_model("swinv2_tiny_window8_256", embed_dim=16, depths=(2, 2, 2, 2),
                                         num_heads=(1, 2, 2, 4), num_classes=5, img_size=128,
                                         drop_path_rate=0.0)).double()
    with torch.no_grad():
        for m in model.modules():
            if hasattr(m, "cpb_mlp"):
                m.cpb_mlp[-1].weight.normal_(0, 1.0)
    ref = copy.deepcopy(model)
    assert patch_swin_attention(model).total == 8
    x = torch.randn(2, 3, 128, 128, dtype=torch.float64)
    for m in (model, ref):
        m(x).square().sum().backward()
    grads = dict(ref.named_parameters())
    for n, p in model.named_parameters():
        assert relerr(p.grad, grads[n].grad) <= 1e-10, n
