"""What every ELSA layer shares (``layers/elsa_module.py``): the two options under one pair of names, checked
against the backends the layer's kind accepts, the one in-place swap (``ElsaModule.convert``), the patching
protocol (``from_module``, ``after_patching``), and the model-wide setters ``set_elsa_options`` and
``set_attention``, which every model's methods call.

A toy layer kind defined here (``ElsaScale``, converted in place, and ``ElsaDoubler``, built from its
constructor, both accepting two backends) plugs into the mixin, the setters and the patch walk the way a new
kind of ELSA layer does: no code of the package names it.
"""

import importlib
import inspect
import pkgutil
import re

import pytest
import timm
import torch
from timm.layers import AttentionPoolLatent
from torch import nn

import elsa_vision.layers as layers
from elsa_vision import patching
from elsa_vision.kernels.precision import PRECISIONS
from elsa_vision.layers import (
    ElsaAttention,
    ElsaAttentionModule,
    ElsaAttentionPoolLatent,
    ElsaModel,
    ElsaModule,
    ElsaMultiheadAttention,
    ElsaSwinV2WindowAttention,
    set_attention,
    set_elsa_options,
)
from elsa_vision.models import ElsaCLIPVision, ElsaHSIViT, ElsaSwinV2, ElsaVGGT, ElsaViT
from elsa_vision.ops.attention import BACKENDS
from elsa_vision.patching import patch_model


def _elsa_layer_classes():
    """Every ``Elsa*`` module class defined in a module of ``elsa_vision.layers`` (found by walking the
    package, so a new layer is found without being listed)."""
    found = set()
    for info in pkgutil.iter_modules(layers.__path__):
        module = importlib.import_module(f"{layers.__name__}.{info.name}")
        found |= {obj for obj in vars(module).values()
                  if inspect.isclass(obj) and issubclass(obj, nn.Module) and obj.__name__.startswith("Elsa")
                  and obj.__module__ == module.__name__}
    return sorted(found, key=lambda c: c.__name__)


def test_every_layer_is_an_elsa_module():
    classes = _elsa_layer_classes()
    assert {layer for _, layer in patching.SWAPS.values()} <= set(classes)
    for c in classes:
        assert issubclass(c, ElsaModule) and getattr(layers, c.__name__) is c, c
        # its kind names the backends it accepts; the precision vocabulary is every kind's
        assert c.backends and "auto" in c.backends, c
        assert c.backends == BACKENDS or not issubclass(c, ElsaAttentionModule), c
        with pytest.raises(ValueError, match=rf"^{c.__name__}: unknown precision 'fp8'; expected one of "
                                             rf"{re.escape(str(PRECISIONS))}"):
            c.check_options("auto", "fp8")
        # one way in: the swap is ElsaModule.convert (a layer adjusts the module after it in ``_converted``);
        # a layer built from its own constructor says what replaces a module (``from_module``)
        if c._converts is None:
            assert c.from_module.__func__ is not ElsaModule.from_module.__func__, c
        else:
            assert c.convert.__func__ is ElsaModule.convert.__func__, c
            assert c.from_module.__func__ is ElsaModule.from_module.__func__, c


def test_convert_keeps_the_object_and_sets_the_options():
    pool = AttentionPoolLatent(32, num_heads=2)
    params = dict(pool.named_parameters())
    hook = pool.register_forward_hook(lambda *a: None)
    out = ElsaAttentionPoolLatent.convert(pool, backend="torch", precision="ieee")
    assert out is pool and type(pool) is ElsaAttentionPoolLatent
    assert dict(pool.named_parameters()) == params and hook.id in pool._forward_hooks
    assert (pool.backend, pool.precision) == ("torch", "ieee")
    assert not hasattr(pool, "elsa_backend") and not hasattr(pool, "elsa_precision")  # one pair of names
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
    linears = [m for m in model.modules()
               if isinstance(m, ElsaModule) and not isinstance(m, ElsaAttentionModule)]
    before = [(m.backend, m.precision) for m in linears]
    model.set_attention(backend="torch", precision="ieee")
    assert seen == [1]
    elsa = [m for m in model.modules() if isinstance(m, ElsaAttentionModule)]
    assert elsa and all((m.backend, m.precision) == ("torch", "ieee") for m in elsa)
    assert [(m.backend, m.precision) for m in linears] == before  # attention only
    model.set_attention(precision="tf32x3")
    assert all((m.backend, m.precision) == ("torch", "tf32x3") for m in elsa)
    with pytest.raises(ValueError, match=rf"^{who}\.set_attention: unknown backend 'cuda'"):
        model.set_attention(backend="cuda")
    model.set_elsa_options(backend="auto", precision="ieee")  # every ELSA layer: attention and linear
    assert all((m.backend, m.precision) == ("auto", "ieee") for m in elsa + linears)
    with pytest.raises(ValueError, match=rf"^{who}\.set_elsa_options: unknown backend 'cuda'"):
        model.set_elsa_options(backend="cuda")


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


# A toy layer kind, as a new kind of ELSA layer would be written: a torch module ``Scale`` and its ELSA
# subclass converted in place, a module ``Doubler`` whose ELSA layer is built from its own constructor.


class Scale(nn.Module):
    def __init__(self, n: int = 4) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((n,), 3.0))

    def forward(self, x):
        return x * self.weight


class ElsaScale(ElsaModule, Scale):
    backends = ("auto", "torch")
    _converts = Scale
    patched = []  # models after_patching saw

    @classmethod
    def after_patching(cls, model):
        cls.patched.append(model)


class Doubler(nn.Module):
    def forward(self, x):
        return 2 * x


class ElsaDoubler(ElsaModule, nn.Module):
    backends = ("auto", "torch")

    def __init__(self, *, backend: str = "auto", precision: str = "auto") -> None:
        self.check_options(backend, precision)
        super().__init__()
        self.backend, self.precision = backend, precision

    @classmethod
    def from_module(cls, module, *, backend="auto", precision="auto"):
        return cls(backend=backend, precision=precision)

    def forward(self, x):
        return 2 * x


def test_a_layer_kind_checks_its_own_backends():
    scale = ElsaScale.convert(Scale(), backend="torch", precision="ieee")
    assert type(scale) is ElsaScale and (scale.backend, scale.precision) == ("torch", "ieee")
    with pytest.raises(ValueError, match=r"^ElsaScale: unknown backend 'eca'; expected one of "
                                         r"\('auto', 'torch'\)"):
        ElsaScale.convert(Scale(), backend="eca")
    with pytest.raises(ValueError, match="^ElsaDoubler: unknown precision 'fp8'"):
        ElsaDoubler(precision="fp8")
    with pytest.raises(ValueError, match="^ElsaAttention: unknown backend 'toy'"):
        ElsaAttention(16, num_heads=2, backend="toy")


def test_the_model_wide_setter_on_a_mixed_model():
    """``set_elsa_options``: the precision goes to every ELSA layer, a backend to the layers whose kind
    accepts it; ``set_attention`` reaches the attention layers only."""

    class Net(ElsaModel, nn.Sequential):
        pass

    attn, scale = ElsaAttention(16, num_heads=2), ElsaScale.convert(Scale(16))
    model = Net(attn, scale, nn.Linear(16, 16))
    assert model.set_elsa_options(precision="ieee") is None
    assert (attn.precision, scale.precision) == ("ieee", "ieee")
    assert set_elsa_options(model, backend="eca") == 1  # ElsaScale does not take eca
    assert (attn.backend, scale.backend) == ("eca", "auto")
    assert set_elsa_options(model, backend="torch", precision="tf32x3") == 2
    assert [(m.backend, m.precision) for m in (attn, scale)] == [("torch", "tf32x3")] * 2
    with pytest.raises(ValueError, match=r"^Net\.set_elsa_options: unknown backend 'cuda'; expected one of "
                                         + re.escape(str(BACKENDS))):
        model.set_elsa_options(backend="cuda")
    with pytest.raises(ValueError, match=r"^Sequential\.set_elsa_options: unknown backend 'eca'; expected "
                                         r"one of \('auto', 'torch'\)"):
        set_elsa_options(nn.Sequential(scale), backend="eca")  # no layer of this model takes it
    assert set_attention(model, backend="auto", precision="ieee") == 1
    assert [(m.backend, m.precision) for m in (attn, scale)] == [("auto", "ieee"), ("torch", "tf32x3")]
    model.set_attention(precision="fp16x3")
    assert (attn.precision, scale.precision) == ("fp16x3", "tf32x3")
    with torch.no_grad():
        assert model(torch.randn(2, 5, 16)).shape == (2, 5, 16)


def test_patch_model_swaps_a_new_kind_from_one_table_entry(monkeypatch):
    """One entry of ``patching.SWAPS`` per kind is all a new layer kind needs: the walk converts in place or
    puts the layer's new module in place (``from_module``), sets the options, calls ``after_patching``;
    ``patch_attention`` keeps to the attention kinds."""
    monkeypatch.setitem(patching.SWAPS, Scale, ("scale", ElsaScale))
    monkeypatch.setitem(patching.SWAPS, Doubler, ("double", ElsaDoubler))
    monkeypatch.setattr(ElsaScale, "patched", [])
    scale = Scale()
    model = nn.Sequential(scale, nn.Sequential(Doubler()), timm.layers.Attention(16, num_heads=2))
    with pytest.raises(ValueError, match=r"^patch_model: unknown backend 'eca'; expected one of "
                                         r"\('auto', 'torch'\)"):
        patch_model(model, kinds=("scale", "vit"), backend="eca")
    with pytest.raises(ValueError, match=r"^patch_attention: unknown kinds \['scale'\]"):
        patching.patch_attention(model, kinds=("scale",))
    report = patch_model(model, kinds=("scale", "double"), backend="torch", precision="ieee")
    assert dict(report.counts) == {"Scale": 1, "Doubler": 1} and "patched 2 modules" in str(report)
    assert model[0] is scale and type(scale) is ElsaScale and isinstance(model[1][0], ElsaDoubler)
    assert [(m.backend, m.precision) for m in (model[0], model[1][0])] == [("torch", "ieee")] * 2
    assert ElsaScale.patched == [model]
    assert type(model[2]) is timm.layers.Attention  # not a kind asked for
    x = torch.randn(2, 5, 4)
    assert torch.equal(model[1](model[0](x)), 6 * x)
    # every kind: the attention (and its linear layers, new ones of the ElsaAttention put in its place)
    assert patch_model(model).counts == {"Attention": 1, "Linear": 2}
    with pytest.raises(ValueError, match="^patch_model: the model itself is a Doubler"):
        patch_model(Doubler(), kinds=("double",))
