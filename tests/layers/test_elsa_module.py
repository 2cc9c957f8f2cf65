"""What every ELSA layer shares (``layers/elsa_module.py``): the two options under one pair of names, the one
in-place swap (``ElsaModule.convert``), and ``set_attention``, which every model's one method
(``ElsaModel.set_attention``) calls."""

import inspect

import pytest
import timm
import torch
from timm.layers import AttentionPoolLatent
from torch import nn

import elsa_vision.layers as layers
from elsa_vision.layers import (
    ElsaAttention,
    ElsaAttentionPoolLatent,
    ElsaModel,
    ElsaModule,
    ElsaMultiheadAttention,
    ElsaSwinV2WindowAttention,
    set_attention,
)
from elsa_vision.models import ElsaCLIPVision, ElsaHSIViT, ElsaSwinV2, ElsaVGGT, ElsaViT


def _elsa_layer_classes():
    return [obj for obj in vars(layers).values()
            if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__name__.startswith("Elsa")]


def test_every_layer_is_an_elsa_module():
    classes = _elsa_layer_classes()
    assert len(classes) == 7, classes
    assert all(issubclass(c, ElsaModule) for c in classes)
    # one way in: the swap is ElsaModule.convert (a layer adjusts the module after it in ``_converted``)
    swapped = [c for c in classes if c._converts is not None]
    assert {c.__name__ for c in classes} - {c.__name__ for c in swapped} == {"ElsaAttention"}
    assert all(c.convert.__func__ is ElsaModule.convert.__func__ for c in swapped)


def test_convert_keeps_the_object_and_sets_the_options():
    pool = AttentionPoolLatent(32, num_heads=2)
    params = dict(pool.named_parameters())
    hook = pool.register_forward_hook(lambda *a: None)
    out = ElsaAttentionPoolLatent.convert(pool, backend="torch", precision="ieee")
    assert out is pool and type(pool) is ElsaAttentionPoolLatent
    assert dict(pool.named_parameters()) == params and hook.id in pool._forward_hooks
    assert (pool.backend, pool.precision) == ("torch", "ieee")
    # the names converted layers had before stay as aliases of the two options
    assert (pool.elsa_backend, pool.elsa_precision) == ("torch", "ieee")
    pool.elsa_precision = "tf32x3"
    assert pool.precision == "tf32x3"
    with pytest.raises(TypeError, match=r"expected timm\.layers\..*AttentionPoolLatent, got Linear"):
        ElsaAttentionPoolLatent.convert(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="unknown precision 'fp8'"):
        ElsaAttentionPoolLatent.convert(AttentionPoolLatent(32, num_heads=2), precision="fp8")
    with pytest.raises(ValueError, match="add_bias_kv is not supported"):
        ElsaMultiheadAttention.convert(nn.MultiheadAttention(8, 2, add_bias_kv=True))
    with pytest.raises(TypeError, match="built from its constructor"):
        ElsaAttention.convert(nn.Linear(2, 2))


BUILDS = {
    "ElsaViT": lambda: timm.create_model("elsa_vit_tiny_patch16_224", img_size=32, depth=1,
                                         global_pool="map"),
    "ElsaSwinV2": lambda: timm.create_model("elsa_swinv2_tiny_window8_256", img_size=64, depths=(1, 1, 1, 1)),
    "ElsaHSIViT": lambda: ElsaHSIViT(8, 3, embed_dim=32, num_heads=2, branch_depth=1, fusion_depth=1),
    "ElsaCLIPVision": lambda: ElsaCLIPVision(image_size=32, patch_size=16, width=32, layers=1, heads=2,
                                             output_dim=16, attentional_pool=True, attn_pooler_queries=4),
    "ElsaVGGT": lambda: ElsaVGGT.from_config("elsa_vggt_small"),
}


@pytest.mark.parametrize("who", sorted(BUILDS))
def test_every_model_sets_its_attention_through_set_attention(who, monkeypatch):
    """Every model's ``set_attention`` is the one ``ElsaModel.set_attention``, which calls
    ``layers.set_attention``: it reaches every ELSA layer, and its errors name the model's class."""
    model = BUILDS[who]()
    assert isinstance(model, (ElsaViT, ElsaSwinV2, ElsaHSIViT, ElsaCLIPVision, ElsaVGGT))
    assert type(model).__name__ == who and type(model).set_attention is ElsaModel.set_attention
    seen = []
    monkeypatch.setattr("elsa_vision.layers.elsa_module.set_attention",
                        lambda *a, **k: seen.append(1) or set_attention(*a, **k))
    model.set_attention(backend="torch", precision="ieee")
    assert seen == [1]
    elsa = [m for m in model.modules() if isinstance(m, ElsaModule)]
    assert elsa and all((m.backend, m.precision) == ("torch", "ieee") for m in elsa)
    model.set_attention(precision="tf32x3")
    assert all((m.backend, m.precision) == ("torch", "tf32x3") for m in elsa)
    with pytest.raises(ValueError, match=rf"^{who}\.set_attention: unknown backend 'cuda'"):
        model.set_attention(backend="cuda")


def test_every_registered_model_has_the_one_set_attention():
    """Every ``elsa_*`` name of timm's registry and every VGGT configuration (``ElsaVGGT.from_config``, not
    in timm's registry) builds (on the meta device: no memory, no init) a model whose ``set_attention`` is
    ``ElsaModel.set_attention``; the five model classes are all reached."""
    from elsa_vision.models.vggt import VGGT_CONFIGS

    classes = set()
    builds = [(name, timm.create_model) for name in timm.list_models("elsa_*")]
    for name, build in builds + [(name, ElsaVGGT.from_config) for name in VGGT_CONFIGS]:
        with torch.device("meta"):
            model = build(name)
        assert type(model).set_attention is ElsaModel.set_attention, name
        classes.add(type(model))
    assert classes == {ElsaViT, ElsaSwinV2, ElsaHSIViT, ElsaCLIPVision, ElsaVGGT}


def test_set_attention_on_any_module():
    model = nn.Sequential(ElsaAttention(16, num_heads=2), nn.Linear(16, 16),
                          ElsaSwinV2WindowAttention(16, (4, 4), 2))
    assert set_attention(model, backend="torch") == 2
    assert [m.backend for m in model if isinstance(m, ElsaModule)] == ["torch", "torch"]
    with pytest.raises(ValueError, match=r"^Sequential\.set_attention: unknown backend 'cuda'"):
        set_attention(model, backend="cuda")
    with pytest.raises(ValueError, match=r"^mine: unknown precision 'fp8'"):
        set_attention(model, precision="fp8", who="mine")
    with pytest.raises(ValueError, match="unknown backend ''"):  # an empty name is not "keep"
        set_attention(model, backend="")
    assert [m.backend for m in model if isinstance(m, ElsaModule)] == ["torch", "torch"]
    assert set_attention(nn.Linear(2, 2), precision="ieee") == 0
    x = torch.randn(2, 16, 16)
    with torch.no_grad():
        assert model(x).shape == x.shape


@pytest.mark.parametrize("name", ["ElsaEvaAttention", "ElsaAttentionRope"])
def test_sdpa_routed_layers_built_directly_run_elsa(name, monkeypatch):
    """Built from their own constructor (not converted), the SDPA-routed layers take the ELSA options and
    run elsa_attention, whatever timm's fused-attention default is."""
    import timm.layers.config

    import elsa_vision.layers.sdpa as sdpa

    monkeypatch.setattr(timm.layers.config, "_USE_FUSED_ATTN", 0)  # TIMM_FUSED_ATTN=0
    cls = getattr(layers, name)
    layer = cls(32, num_heads=2, norm_layer=nn.LayerNorm, backend="torch", precision="ieee").eval()
    assert layer.fused_attn and (layer.backend, layer.precision) == ("torch", "ieee")
    calls = []
    real = sdpa.elsa_attention
    monkeypatch.setattr(sdpa, "elsa_attention", lambda *a, **k: calls.append(k) or real(*a, **k))
    with torch.no_grad():
        layer(torch.randn(2, 5, 32))
    assert calls and calls[0]["backend"] == "torch" and calls[0]["precision"] == "ieee"
    with pytest.raises(ValueError, match=f"{name}: unknown backend 'cuda'"):
        cls(32, num_heads=2, norm_layer=nn.LayerNorm, backend="cuda")
