"""The FP32-accurate linear layers: ``ElsaLinear`` / ``ElsaPatchConv2d`` in place of ``nn.Linear`` / a patch
embedding's ``nn.Conv2d`` (same parameters and keys), the linear kind of the patch walk, the models' own
linear layers, the setters, and the projections that follow their linear layer (``linear_of``)."""

from __future__ import annotations

import copy

import pytest
import timm
import torch
import torch.nn.functional as F
from torch import nn

from elsa_vision import ElsaSwinV2, ElsaViT, patch_attention, patch_model
from elsa_vision.layers import (
    ElsaAttention,
    ElsaLinear,
    ElsaLinearModule,
    ElsaMlp,
    ElsaMultiheadAttention,
    ElsaPatchConv2d,
    set_elsa_options,
    set_linear,
)
from tests.helpers import DEVICE, FP32_ACCURATE, randn, relerr

TRITON = "auto" if DEVICE == "cuda" else "triton"  # the GEMM on this machine (the interpreter on CPU)


def test_elsa_linear_is_the_linear_it_replaces():
    lin = nn.Linear(45, 29).to(DEVICE)
    keys, weight = list(lin.state_dict()), lin.weight
    same = ElsaLinear.convert(lin, backend=TRITON, precision="fp16x3")
    assert same is lin and isinstance(lin, nn.Linear) and list(lin.state_dict()) == keys
    assert lin.weight is weight and (lin.backend, lin.precision) == (TRITON, "fp16x3")
    x = randn(3, 5, 45, seed=1).requires_grad_()
    out = lin(x)
    out.square().sum().backward()
    x64 = x.detach().double().requires_grad_()
    w64, b64 = (p.detach().double().requires_grad_() for p in (lin.weight, lin.bias))
    ref = F.linear(x64, w64, b64)
    ref.square().sum().backward()
    assert relerr(out, ref) <= FP32_ACCURATE
    for got, want in ((x.grad, x64.grad), (lin.weight.grad, w64.grad), (lin.bias.grad, b64.grad)):
        assert relerr(got, want) <= FP32_ACCURATE
    built = ElsaLinear(45, 29, bias=False, precision="ieee")
    assert built.bias is None and built.precision == "ieee" and list(built.state_dict()) == ["weight"]
    with pytest.raises(ValueError, match="unknown backend 'eca'"):
        ElsaLinear(4, 4, backend="eca")
    with pytest.raises(ValueError, match="unknown precision"):
        ElsaLinear.convert(nn.Linear(4, 4), precision="fp8")


@pytest.mark.parametrize("size", [(50, 37), (32, 32)])
def test_patch_conv_is_the_convolution(size):
    conv = nn.Conv2d(3, 24, kernel_size=8, stride=8).to(DEVICE)
    ref_conv = copy.deepcopy(conv).double()
    ElsaPatchConv2d.convert(conv, backend=TRITON, precision="fp16x3")
    x = randn(2, 3, *size, seed=2).requires_grad_()
    out = conv(x)
    x64 = x.detach().double().requires_grad_()
    ref = ref_conv(x64)
    assert out.shape == ref.shape == (2, 24, size[0] // 8, size[1] // 8)
    assert relerr(out, ref) <= FP32_ACCURATE
    g = randn(*out.shape, seed=3)
    out.backward(g)
    ref.backward(g.double())
    assert relerr(x.grad, x64.grad) <= FP32_ACCURATE
    assert relerr(conv.weight.grad, ref_conv.weight.grad) <= FP32_ACCURATE
    assert relerr(conv.bias.grad, ref_conv.bias.grad) <= FP32_ACCURATE
    tokens = out.flatten(2).transpose(1, 2)  # a patch embedding's NLC tokens: a view, no copy
    assert tokens.is_contiguous()


def test_convolutions_that_are_no_patch_embedding_are_left_alone():
    model = nn.Sequential(nn.Conv2d(3, 8, 4, stride=4), nn.Conv2d(8, 8, 3, padding=1),
                          nn.Conv2d(8, 8, 2, 2, 1), nn.Conv2d(8, 8, 2, 2, groups=2))
    report = patch_model(model, kinds=("linear",))
    assert report.total == 1 and not report.skipped
    assert [type(m).__name__ for m in model] == ["ElsaPatchConv2d", "Conv2d", "Conv2d", "Conv2d"]
    with pytest.raises(ValueError, match="kernel_size"):
        ElsaPatchConv2d.convert(nn.Conv2d(3, 8, 3))


def test_elsa_mlp_is_timms_gelu_mlp():
    from timm.layers import Mlp, QuickGELU

    mlp = Mlp(45, 70, 29).to(DEVICE).eval()
    ref_mlp = copy.deepcopy(mlp)
    keys = list(mlp.state_dict())
    model = nn.Sequential(mlp)
    report = patch_model(model, kinds=("linear",), backend=TRITON, precision="fp16x3")
    assert model[0] is mlp and type(mlp) is ElsaMlp and isinstance(mlp, Mlp)
    assert type(mlp.fc1) is ElsaLinear and type(mlp.fc2) is ElsaLinear and report.counts["Mlp"] == 1
    assert list(mlp.state_dict()) == keys
    x = randn(3, 7, 45, seed=1)
    with torch.no_grad():
        ref = copy.deepcopy(ref_mlp).double()(x.double())
        assert relerr(mlp(x), ref) <= FP32_ACCURATE
        # a forward hook on one of its layers: the layers run one by one and the hook sees its call
        seen = []
        hook = mlp.fc1.register_forward_hook(lambda m, args, out: seen.append(tuple(out.shape)))
        assert relerr(mlp(x), ref) <= FP32_ACCURATE and seen == [(3, 7, 70)]
        hook.remove()
    # with gradients, and in training with dropout: timm's forward, layer by layer
    xg = x.clone().requires_grad_()
    mlp(xg).sum().backward()
    assert xg.grad is not None and mlp.fc1.weight.grad is not None
    mlp.drop1.p = 1.0  # drops the whole hidden activation: only fc2's bias is left
    mlp.train()
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), mlp.fc2.bias.expand(3, 7, 29), rtol=0, atol=0)
    # MLPs that are not exact-GELU MLPs stay timm's (and their linear layers are still swapped)
    others = nn.ModuleList([Mlp(8, 16, act_layer=nn.GELU), Mlp(8, 16, act_layer=QuickGELU),
                            Mlp(8, 16, norm_layer=nn.LayerNorm), Mlp(8, 16, use_conv=True)])
    others[0].act = nn.GELU(approximate="tanh")
    patch_model(others, kinds=("linear",))
    assert all(type(m) is Mlp for m in others)
    assert type(others[0].fc1) is ElsaLinear and type(others[3].fc1) is ElsaPatchConv2d  # 1x1: a GEMM


def test_patch_model_makes_a_timm_vit_fp32_accurate_with_its_keys():
    # ViT-Ti's layout at a third of its width (head dim 32): under the interpreter each product of the full
    # width takes seconds; the GEMM's accuracy at wider K is test_gemm's
    timm_model = timm.create_model("vit_tiny_patch16_224", img_size=32, patch_size=8, depth=2, num_classes=5,
                                   embed_dim=64, num_heads=2)
    timm_model = timm_model.to(DEVICE).eval()
    keys = list(timm_model.state_dict())
    model = copy.deepcopy(timm_model)
    report = patch_model(model, backend=TRITON, precision="fp16x3")
    assert list(model.state_dict()) == keys
    counts = report.counts
    assert counts["Attention"] == 2 and counts["Linear"] == 2 * 4 + 1 and counts["Conv2d"] == 1
    assert not any(type(m) in (nn.Linear, nn.Conv2d) for m in model.modules())
    x = randn(2, 3, 32, 32, seed=4)
    with torch.no_grad():
        ref = copy.deepcopy(timm_model).double()(x.double())
        assert relerr(model(x), ref) <= 10 * FP32_ACCURATE  # a whole network: errors of ~20 layers add up
    # patch_attention keeps to the attention: the linear layers stay timm's
    attn_only = copy.deepcopy(timm_model)
    patch_attention(attn_only)
    assert any(type(m) is nn.Linear for m in attn_only.modules())
    # and a model patched for attention first takes its linear layers afterwards
    assert patch_model(attn_only, kinds=("linear",)).counts["Linear"] == 2 * 4 + 1


def test_elsa_models_build_elsa_linear_layers_and_keep_them_for_a_new_head():
    vit = ElsaViT(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=3, num_classes=5,
                  attn_precision="tf32x3", linear_backend="torch")
    kinds = {type(m) for m in vit.modules()}
    assert nn.Linear not in kinds and nn.Conv2d not in kinds and {ElsaLinear, ElsaPatchConv2d} <= kinds
    assert all((m.backend, m.precision) == ("torch", "tf32x3") for m in vit.modules()
               if isinstance(m, ElsaLinearModule))
    vit.reset_classifier(7)
    assert type(vit.head) is ElsaLinear and (vit.head.backend, vit.head.precision) == ("torch", "tf32x3")
    with pytest.raises(ValueError, match="ElsaViT: unknown linear_backend 'eca'"):
        ElsaViT(img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3, linear_backend="eca")
    swin = ElsaSwinV2.from_timm("swinv2_tiny_window8_256", img_size=64, depths=(1, 1, 1, 1), embed_dim=24)
    assert not any(type(m) in (nn.Linear, nn.Conv2d) for m in swin.modules())
    assert type(swin.patch_embed.proj) is ElsaPatchConv2d


def test_setters_reach_the_linear_layers_only_where_asked():
    vit = ElsaViT(img_size=32, patch_size=8, embed_dim=48, depth=1, num_heads=3)
    linears = [m for m in vit.modules() if isinstance(m, ElsaLinearModule)]
    attns = [m for m in vit.modules() if isinstance(m, ElsaAttention)]
    assert set_linear(vit, backend="torch") == len(linears)
    assert all(m.backend == "torch" for m in linears) and all(m.backend == "auto" for m in attns)
    vit.set_linear(precision="ieee")
    assert all(m.precision == "ieee" for m in linears) and all(m.precision == "auto" for m in attns)
    set_elsa_options(vit, backend="eca", precision="tf32x3")  # eca: attention only, precision: all
    assert all(m.backend == "eca" and m.precision == "tf32x3" for m in attns)
    assert all(m.backend == "torch" and m.precision == "tf32x3" for m in linears)
    with pytest.raises(ValueError, match="unknown backend 'eca'"):
        set_linear(vit, backend="eca")


def test_projections_follow_their_linear_layer(monkeypatch):
    import elsa_vision.layers.linear as linear_mod

    calls = []  # the precision of every product an ELSA linear layer computes: its own forward and the
    # projections a module forms from its parameters (linear_of) both run linear_on_route
    real = linear_mod.linear_on_route

    def counted(x, weight, bias, precision, route):
        calls.append(precision)
        return real(x, weight, bias, precision, route)

    monkeypatch.setattr(linear_mod, "linear_on_route", counted)
    # nn.MultiheadAttention: in_proj follows out_proj
    enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(24, 3, 48, dropout=0.0, batch_first=True), 1)
    enc = enc.to(DEVICE).eval()
    ref_enc = copy.deepcopy(enc).double()
    patch_attention(enc)
    x = randn(2, 9, 24, seed=5)
    with torch.no_grad():
        enc(x)
    assert calls == []  # attention patched, linear layers not: F.linear everywhere
    patch_model(enc, backend=TRITON, precision="fp16x3", kinds=("linear",))
    mha = enc.layers[0].self_attn
    assert isinstance(mha, ElsaMultiheadAttention) and type(mha.out_proj) is ElsaLinear
    with torch.no_grad():
        out = enc(x)
        ref = ref_enc(x.double())
    assert len(calls) == 4  # in_proj (one GEMM), out_proj, linear1, linear2
    assert relerr(out, ref) <= 10 * FP32_ACCURATE
    # Swin-v2's qkv with its own (q, 0, v) bias follows the qkv layer: one GEMM fewer through elsa_linear
    # once that layer is a plain nn.Linear again
    swin = ElsaSwinV2.from_timm("swinv2_tiny_window8_256", img_size=32, depths=(1, 1, 1, 1), embed_dim=24,
                                linear_backend=TRITON).to(DEVICE).eval()
    img = randn(1, 3, 32, 32, seed=6)
    with torch.no_grad():
        swin(img)  # the position bias (cpb_mlp's two layers) is formed once, then reused in inference
    counts = []
    for _ in range(2):
        calls.clear()
        with torch.no_grad():
            swin(img)
        counts.append(len(calls))
        swin.layers[0].blocks[0].attn.qkv.__class__ = nn.Linear
    assert counts[0] - counts[1] == 1


@pytest.mark.gpu
def test_gpu_whole_vit_fp32_error_at_most_timm_fp32():
    timm_model = timm.create_model("vit_small_patch16_224", img_size=224, num_classes=100).cuda().eval()
    model = ElsaViT.from_timm(timm_model).eval()
    x = randn(4, 3, 224, 224, seed=7)
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.no_grad():
            ref = copy.deepcopy(timm_model).double()(x.double())
            theirs = relerr(timm_model(x), ref)
            ours = relerr(model(x), ref)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    assert ours <= theirs, (ours, theirs)
    compiled = torch.compile(model, fullgraph=True)
    with torch.no_grad():
        torch.testing.assert_close(compiled(x), model(x), rtol=1e-5, atol=1e-5)
