"""ElsaViT: registry, timm parity of every feature, from_timm, local checkpoints and their errors.

All parity checks compare against timm's own VisionTransformer with the same (randomised) weights:
‖elsa − timm‖/‖timm‖ <= 1e-5 in float32 (both sides are FP32-accurate; the difference is rounding order).
"""

import pytest
import timm
import torch
from safetensors.torch import save_file
from timm.layers import Attention
from timm.models.swin_transformer_v2 import SwinTransformerV2, checkpoint_filter_fn
from timm.models.vision_transformer import VisionTransformer
from torch import nn

import elsa_vision
import elsa_vision.layers.attention as elsa_attention_module
import elsa_vision.layers.attention_pool as elsa_pool_module
from elsa_vision import ElsaViT
from elsa_vision.layers import ElsaAttention, ElsaAttentionPoolLatent
from elsa_vision.models import ElsaSwinV2, elsa_checkpoint_filter_fn
from elsa_vision.models._builder import FromTimm
from tests.helpers import randomize_, relerr

TOL = 1e-5

# elsa name -> the timm name whose architecture (state_dict keys/shapes, norms, activation) it must equal
TIMM_TWINS = {
    "elsa_vit_tiny_patch16_224": "vit_tiny_patch16_224",
    "elsa_vit_small_patch16_224": "vit_small_patch16_224",
    "elsa_vit_base_patch16_224": "vit_base_patch16_224",
    "elsa_vit_large_patch16_224": "vit_large_patch16_224",
    "elsa_vit_base_patch16_384": "vit_base_patch16_384",
    "elsa_vit_large_patch14_clip_224": "vit_large_patch14_clip_224",
    "elsa_vit_base_patch14_reg4_dinov2": "vit_base_patch14_reg4_dinov2",
}


class CountCalls:
    """Counts calls of ``elsa_attention`` made by ElsaAttention and the ELSA MAP head."""

    def __init__(self, monkeypatch):
        self.n = 0
        for mod in (elsa_attention_module, elsa_pool_module):
            orig = mod.elsa_attention

            def counted(*a, _orig=orig, **k):
                self.n += 1
                return _orig(*a, **k)

            monkeypatch.setattr(mod, "elsa_attention", counted)


def test_registry_lists_all_names():
    assert set(TIMM_TWINS) <= set(timm.list_models("elsa_*"))


@pytest.mark.parametrize("name", timm.list_models("elsa_vit_*"))
def test_registered_config_equals_timm_architecture(name):
    # The real config (full depth/width), built on the meta device: no memory, no init time.
    ours = timm.create_model(name, device="meta")
    twin = timm.create_model(TIMM_TWINS[name], device="meta")
    assert isinstance(ours, ElsaViT)
    shapes = lambda m: {k: v.shape for k, v in m.state_dict().items()}  # noqa: E731
    assert shapes(ours) == shapes(twin)
    norms = lambda m: [str(x) for x in m.modules() if isinstance(x, nn.LayerNorm)]  # noqa: E731
    assert norms(ours) == norms(twin)
    assert ours.pretrained_cfg["input_size"] == twin.pretrained_cfg["input_size"]
    assert all(isinstance(b.attn, ElsaAttention) for b in ours.blocks)


@pytest.mark.parametrize("name", timm.list_models("elsa_vit_*"))
def test_registered_name_runs(name, monkeypatch):
    # Same config, two blocks and a 4x4 patch grid so that every name runs in a fraction of a second.
    patch = 14 if "patch14" in name else 16
    model = timm.create_model(name, depth=2, img_size=4 * patch).eval()
    calls = CountCalls(monkeypatch)
    x = torch.randn(2, 3, 4 * patch, 4 * patch)
    with torch.no_grad():
        out = model(x)
    assert out.shape == (2, model.num_classes or model.embed_dim)
    assert torch.isfinite(out).all()
    assert calls.n == 2


# Every ElsaViT feature against timm's VisionTransformer with identical weights (small configs).
_BASE = dict(img_size=64, patch_size=16, embed_dim=64, depth=2, num_heads=4, num_classes=7)
FEATURES = {
    "token": {},
    "reg_no_embed_class": dict(reg_tokens=3, no_embed_class=True),
    "layer_scale_qk_norm": dict(init_values=1e-5, qk_norm=True),
    "clip_pre_norm_quick_gelu": dict(pre_norm=True, act_layer="quick_gelu"),
    "avg_pool": dict(global_pool="avg", class_token=False),
    "map_pool": dict(global_pool="map", class_token=False),
    "map_pool_cls_reg": dict(global_pool="map", reg_tokens=2),
    "in_chans_5": dict(in_chans=5),
    "no_head": dict(num_classes=0),
    "dynamic_img_size": dict(dynamic_img_size=True),
}


@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_parity_with_timm(feature, monkeypatch):
    kwargs = dict(_BASE, **FEATURES[feature])
    torch.manual_seed(0)
    ref = randomize_(VisionTransformer(**kwargs)).eval()
    ours = ElsaViT(**kwargs).eval()
    ours.load_state_dict(ref.state_dict())  # strict: identical state_dict layout
    calls = CountCalls(monkeypatch)
    sizes = [(64, 64)] + ([(48, 112), (96, 80)] if kwargs.get("dynamic_img_size") else [])
    for h, w in sizes:
        x = torch.randn(2, kwargs.get("in_chans", 3), h, w)
        with torch.no_grad():
            e, t = ours.forward_features(x), ref.forward_features(x)
            assert relerr(e, t) <= TOL, (feature, h, w)
            assert relerr(ours.forward_head(e), ref.forward_head(t)) <= TOL
    n_attn = _BASE["depth"] + (1 if kwargs.get("global_pool") == "map" else 0)
    assert calls.n == n_attn * len(sizes)
    if kwargs.get("global_pool") == "map":
        assert isinstance(ours.attn_pool, ElsaAttentionPoolLatent)


def test_non_square_without_dynamic_size_is_refused():
    model = ElsaViT(**_BASE).eval()
    with pytest.raises(AssertionError):  # timm's PatchEmbed checks the fixed input size
        model(torch.randn(1, 3, 48, 112))


def test_gradient_checkpointing_same_grads():
    torch.manual_seed(0)
    model = randomize_(ElsaViT(**_BASE, qk_norm=True))
    x = torch.randn(2, 3, 64, 64)
    grads = []
    for ckpt in (False, True):
        model.set_grad_checkpointing(ckpt)
        model.zero_grad()
        model(x).square().sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    assert model.grad_checkpointing
    for n in grads[0]:
        assert relerr(grads[1][n], grads[0][n]) <= TOL, n


def test_grads_match_timm():
    torch.manual_seed(0)
    ref = randomize_(VisionTransformer(**_BASE, reg_tokens=2))
    ours = ElsaViT.from_timm(ref)
    x = torch.randn(2, 3, 64, 64)
    for m in (ref, ours):
        m(x).square().sum().backward()
    gr = dict(ref.named_parameters())
    for n, p in ours.named_parameters():
        assert relerr(p.grad, gr[n].grad) <= 1e-5, n


def test_attention_options_and_errors():
    model = ElsaViT(**_BASE, attn_backend="torch", attn_precision="ieee")
    assert {(b.attn.backend, b.attn.precision) for b in model.blocks} == {("torch", "ieee")}
    model.set_attention(precision="tf32x3")
    assert {b.attn.precision for b in model.blocks} == {"tf32x3"}
    with pytest.raises(ValueError, match="attn_backend"):
        ElsaViT(**_BASE, attn_backend="cuda")
    with pytest.raises(ValueError, match="attn_precision"):
        ElsaViT(**_BASE, attn_precision="fp8")
    with pytest.raises(ValueError, match="attn_layer"):
        ElsaViT(**_BASE, attn_layer=Attention)
    with pytest.raises(ValueError, match="prr"):
        ElsaViT(**dict(_BASE, global_pool="prr"))


# from_timm on real timm configs: same output at 224 and at a larger non-square size (dynamic_img_size).
FROM_TIMM = {
    "vit_small_patch16_224": dict(hw=(256, 352)),
    "vit_base_patch32_224": dict(hw=(320, 448)),
    "deit_tiny_patch16_224": dict(hw=(288, 400)),
    "vit_small_patch14_reg4_dinov2": dict(kw=dict(img_size=224), hw=(266, 350)),
    "vit_base_patch32_clip_quickgelu_224": dict(hw=(288, 384)),
}


@pytest.mark.parametrize("name", list(FROM_TIMM))
def test_from_timm_instance_equals_timm(name):
    spec = FROM_TIMM[name]
    torch.manual_seed(0)
    ref = randomize_(timm.create_model(name, dynamic_img_size=True, **spec.get("kw", {}))).eval()
    ours = ElsaViT.from_timm(ref)
    # src is untouched
    assert type(ref) is VisionTransformer and all(type(b.attn) is Attention for b in ref.blocks)
    assert all(isinstance(b.attn, ElsaAttention) for b in ours.blocks)
    assert not ours.training
    for h, w in [(224, 224), spec["hw"]]:
        x = torch.randn(1, 3, h, w)
        with torch.no_grad():
            t, e = ref.forward_features(x), ours.forward_features(x)
            assert relerr(e, t) <= TOL, (name, h, w)
            assert relerr(ours.forward_head(e), ref.forward_head(t)) <= TOL


def test_from_timm_rejects_other_models():
    with pytest.raises(TypeError, match="VisionTransformer"):
        ElsaViT.from_timm(nn.Linear(2, 2))
    with pytest.raises(TypeError, match="not a VisionTransformer"):
        ElsaViT.from_timm("resnet18")
    with pytest.raises(TypeError, match="only apply when src is a model name"):
        ElsaViT.from_timm(VisionTransformer(**_BASE), img_size=32)


def test_from_timm_is_one_method():
    """ElsaViT and ElsaSwinV2 share the one ``FromTimm.from_timm``; each names its timm class and filter."""
    assert ElsaViT.from_timm.__func__ is ElsaSwinV2.from_timm.__func__ is FromTimm.from_timm.__func__
    assert ElsaViT._timm_class is VisionTransformer and ElsaViT._timm_filter_fn is elsa_checkpoint_filter_fn
    assert ElsaSwinV2._timm_class is SwinTransformerV2 and ElsaSwinV2._timm_filter_fn is checkpoint_filter_fn
    assert ElsaViT.load_report is None and ElsaSwinV2.load_report is None


# Local checkpoints.
_TINY = dict(depth=2)


@pytest.fixture(scope="module")
def deit_ref():
    torch.manual_seed(0)
    return randomize_(timm.create_model("deit_tiny_patch16_224", **_TINY)).eval()


@pytest.mark.parametrize("fmt", ["safetensors", "pth", "bin", "pth_nested"])
def test_checkpoint_round_trip(deit_ref, tmp_path, fmt):
    sd = deit_ref.state_dict()
    path = tmp_path / f"w.{fmt.split('_')[0]}"
    if fmt == "safetensors":
        save_file({k: v.contiguous() for k, v in sd.items()}, str(path))
    elif fmt == "pth_nested":  # a training checkpoint: nested dict, DDP prefix, non-tensor entries
        torch.save({"epoch": 3, "state_dict": {f"module.{k}": v for k, v in sd.items()}}, path)
    else:
        torch.save(sd, path)
    ours = ElsaViT.from_timm("deit_tiny_patch16_224", path, **_TINY)
    assert ours.load_report.ok
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert relerr(ours(x), deit_ref(x)) <= TOL


def test_checkpoint_resampled_and_in_chans(deit_ref, tmp_path):
    path = tmp_path / "w.pth"
    torch.save(deit_ref.state_dict(), path)
    ours = ElsaViT.from_timm("deit_tiny_patch16_224", path, img_size=160, in_chans=1, **_TINY)
    assert ours.pos_embed.shape == (1, 1 + 10 * 10, 192)
    # 1 input channel: timm's rule sums the RGB filters; a grey image then equals the RGB model on 3 copies.
    x = torch.randn(2, 1, 160, 160)
    ref = timm.create_model("deit_tiny_patch16_224", img_size=160, **_TINY).eval()
    ref.load_state_dict(timm.models.vision_transformer.checkpoint_filter_fn(deit_ref.state_dict(), ref))
    with torch.no_grad():
        assert relerr(ours(x), ref(x.expand(-1, 3, -1, -1))) <= TOL


def test_registered_name_loads_local_file(deit_ref, tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in deit_ref.state_dict().items()}, str(path))
    ours = timm.create_model(
        "elsa_vit_tiny_patch16_224", pretrained=True, pretrained_cfg_overlay=dict(file=str(path)), **_TINY
    ).eval()
    assert isinstance(ours, ElsaViT)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert relerr(ours(x), deit_ref(x)) <= TOL


def test_openai_clip_layout(tmp_path):
    pytest.importorskip("open_clip")
    from open_clip.transformer import QuickGELU
    from open_clip.transformer import VisionTransformer as OpenClipVisionTower

    torch.manual_seed(0)
    # The image tower of OpenAI's ViT-B/32 (QuickGELU), two blocks deep.
    tower = OpenClipVisionTower(image_size=224, patch_size=32, width=768, layers=2, heads=12, mlp_ratio=4.0,
                                output_dim=512, act_layer=QuickGELU)
    randomize_(tower).eval()
    # OpenAI-CLIP layout: visual.{class_embedding, positional_embedding, conv1, ln_pre, transformer..., proj}
    sd = {f"visual.{k}": v for k, v in tower.state_dict().items()}
    path = tmp_path / "openai_clip.pth"
    torch.save(sd, path)
    ours = ElsaViT.from_timm("vit_base_patch32_clip_quickgelu_224", path, num_classes=512, depth=2)
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert relerr(ours(x), tower(x)) <= TOL


def test_dinov2_layout(tmp_path):
    torch.manual_seed(0)
    ref = randomize_(timm.create_model("vit_small_patch14_reg4_dinov2", img_size=112, depth=2)).eval()
    sd = ref.state_dict()
    # Meta's DINOv2 layout: register_tokens, pos_embed with the class position, bare cls_token, mask_token.
    cls_pos = torch.randn(1, 384)
    dino = {k: v for k, v in sd.items() if k not in ("reg_token", "cls_token", "pos_embed")}
    dino.update(register_tokens=sd["reg_token"], cls_token=sd["cls_token"] - cls_pos,
                pos_embed=torch.cat([cls_pos[None], sd["pos_embed"]], 1), mask_token=torch.zeros(1, 384))
    path = tmp_path / "dinov2.pth"
    torch.save(dino, path)
    ours = ElsaViT.from_timm("vit_small_patch14_reg4_dinov2", path, img_size=112, depth=2)
    x = torch.randn(2, 3, 112, 112)
    with torch.no_grad():
        assert relerr(ours(x), ref(x)) <= TOL


def test_checkpoint_errors(deit_ref, tmp_path):
    # every error starts with the argument's name and names the file
    with pytest.raises(FileNotFoundError, match=r"^checkpoint_path: '.*missing\.pth' does not exist"):
        ElsaViT.from_timm("deit_tiny_patch16_224", tmp_path / "missing.pth", **_TINY)
    garbage = tmp_path / "garbage.pth"
    garbage.write_bytes(b"\x00not a checkpoint\xff" * 50)
    with pytest.raises(ValueError, match=r"^checkpoint_path: '.*garbage\.pth' is not a checkpoint"):
        ElsaViT.from_timm("deit_tiny_patch16_224", garbage, **_TINY)
    bad_st = tmp_path / "garbage.safetensors"
    bad_st.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}")
    with pytest.raises(ValueError, match=r"^checkpoint_path: '.*garbage\.safetensors' is a damaged"):
        ElsaViT.from_timm("deit_tiny_patch16_224", bad_st, **_TINY)
    # Shape mismatch: the error names the offending key.
    sd = dict(deit_ref.state_dict())
    sd["blocks.1.mlp.fc1.weight"] = torch.zeros(10, 192)
    wrong = tmp_path / "wrong.pth"
    torch.save(sd, wrong)
    with pytest.raises(ValueError, match=r"blocks\.1\.mlp\.fc1\.weight.*\(10, 192\).*\(768, 192\)"):
        ElsaViT.from_timm("deit_tiny_patch16_224", wrong, **_TINY)
    # Missing / unexpected keys: listed; strict=False keeps them in the report.
    sd = dict(deit_ref.state_dict())
    sd.pop("blocks.0.norm1.weight")
    sd["extra.thing"] = torch.zeros(3)
    partial = tmp_path / "partial.pth"
    torch.save(sd, partial)
    pattern = r"missing keys \(1\): blocks\.0\.norm1\.weight(.|\n)*unexpected keys \(1\): extra\.thing"
    with pytest.raises(ValueError, match=pattern):
        ElsaViT.from_timm("deit_tiny_patch16_224", partial, **_TINY)
    ours = ElsaViT.from_timm("deit_tiny_patch16_224", partial, strict=False, **_TINY)
    assert ours.load_report.missing == ["blocks.0.norm1.weight"]
    assert ours.load_report.unexpected == ["extra.thing"]
    # No tensors at all.
    empty = tmp_path / "empty.pth"
    torch.save({"epoch": 1}, empty)
    with pytest.raises(ValueError, match="holds no tensors"):
        ElsaViT.from_timm("deit_tiny_patch16_224", empty, **_TINY)


def test_package_exports():
    for name in ("ElsaViT", "patch_attention", "patch_vit_attention", "patch_swin_attention", "sdpa_override",
                 "PatchReport"):
        assert name in elsa_vision.__all__ and hasattr(elsa_vision, name)


def test_models_the_readme_names_import_from_the_package():
    """``from elsa_vision import ElsaSwinV2`` works for every model class the README names."""
    import pathlib
    import re

    readme = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text()
    named = set(re.findall(r"\bElsa[A-Za-z0-9]+", readme)) & set(elsa_vision.models.__all__)
    assert {"ElsaViT", "ElsaSwinV2"} <= named
    missing = sorted(n for n in named if n not in elsa_vision.__all__ or not hasattr(elsa_vision, n))
    assert not missing, f"named in the README but not importable from elsa_vision: {missing}"


def test_attention_dropout_in_training_only():
    model = ElsaViT(**dict(_BASE, attn_drop_rate=0.5))
    x = torch.randn(2, 3, 64, 64)
    torch.manual_seed(0)
    a = model(x)
    torch.manual_seed(1)
    b = model(x)
    assert relerr(a, b) > 1e-3  # dropout masks differ between the two training runs
    model.eval()
    with torch.no_grad():
        assert torch.equal(model(x), model(x))


def test_timm_without_attn_layer_kwarg(monkeypatch):
    # timm < 1.0.23 has no `attn_layer`: ElsaViT builds timm's Attention and converts it, weights kept.
    import elsa_vision.models.vit as vit_module

    monkeypatch.setattr(vit_module, "_TIMM_HAS_ATTN_LAYER", False)
    torch.manual_seed(0)
    ref = randomize_(VisionTransformer(**_BASE, qk_norm=True)).eval()
    ours = ElsaViT(**_BASE, qk_norm=True, attn_precision="ieee").eval()
    assert all(isinstance(b.attn, ElsaAttention) and b.attn.precision == "ieee" for b in ours.blocks)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        assert relerr(ours(x), ref(x)) <= TOL
