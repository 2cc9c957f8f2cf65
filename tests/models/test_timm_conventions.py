"""Every model in timm's registry under ``elsa_*`` keeps timm's conventions, checked as timm's own
``tests/test_models.py`` checks timm's models: forward and backward, FX tracing (torchvision's feature
extraction with timm's leaf registries: forward equal to eager, backward reaching every parameter), timm's
FX feature wrapper and ``features_only``, the classifier API (``num_classes``, ``num_classes=0`` features,
``reset_classifier``), ``forward_intermediates`` and the pretrained cfg (input sizes timm's tests and tools
pick fit the model); ``torch.export`` of every model (and of the VGGT encoder) with the exported program equal
to eager; ``torch.jit.script`` refused in one error (TorchScript is not a goal). The CLIP image towers are
timm models as timm's CLIP ViTs are: their head is the projection ``proj``. The multi-frame VGGT is not an
image model and is not registered (``ElsaVGGT.from_config`` builds it); it is exported and refused by
TorchScript here as ``TOWERS``.

CPU budget: every model is built shallow (a depth override through ``timm.create_model``) for a small input,
once per process (``_model``); tests that change a model work on a copy.
"""

from __future__ import annotations

import copy
import functools

import pytest
import timm
import torch
from timm.models import get_notrace_functions, get_notrace_modules
from timm.models._features import FeatureGetterNet
from torchvision.models.feature_extraction import (
    NodePathTracer,
    create_feature_extractor,
    get_graph_node_names,
)

import elsa_vision  # noqa: F401  (registers the elsa_* names)
from elsa_vision.models import ElsaCLIPVision, ElsaVGGT
from elsa_vision.models.clip_vision import CLIP_VISION_ARCHITECTURES
from elsa_vision.ops.attention import resolve_backend

# torchvision notes that train- and eval-mode graphs differ (dropout, drop-path); timm's FX tests get it too.
pytestmark = pytest.mark.filterwarnings("ignore:NOTE. The nodes obtained by tracing the model in eval mode")

NAMES = timm.list_models("elsa_*")
CLIP_NAMES = timm.list_models("elsa_clip_*")
NUM_CLASSES = 42  # timm's backward test: a head other than the default


def _small(name: str) -> tuple[dict, tuple[int, ...]]:
    """``timm.create_model`` overrides and the input size ``(C, H, W)`` of a cheap CPU build of ``name``."""
    if name.startswith("elsa_vit_"):
        side = 2 * (14 if "patch14" in name else 16)  # 2 x 2 patches plus the prefix tokens
        return dict(img_size=side, depth=2), (3, side, side)
    if name.startswith("elsa_swinv2_"):
        # 64 px: stage grids 16, 8, 4, 2; two blocks in stage 0 so that a shifted-window block runs.
        return dict(img_size=64, depths=(2, 1, 1, 1)), (3, 64, 64)
    if name.startswith("elsa_hsi_vit_"):
        return dict(branch_depth=1, fusion_depth=1), tuple(timm.get_pretrained_cfg_value(name, "input_size"))
    if name.startswith("elsa_clip_"):
        side = 2 * (14 if "_l14" in name else 16)  # 2 x 2 patches plus the class token
        return dict(image_size=side, layers=2), (3, side, side)
    raise AssertionError(f"{name}: no small build here; add one for the new model family")


@functools.cache
def _model(name: str) -> torch.nn.Module:
    """The shared eval-mode build of ``name`` (``NUM_CLASSES`` classes). Callers that change it copy it."""
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=NUM_CLASSES, **_small(name)[0]).eval()


def _input(name: str, batch_size: int) -> torch.Tensor:
    return torch.randn(batch_size, *_small(name)[1], generator=torch.Generator().manual_seed(1))


def _head(model: torch.nn.Module):
    """The head ``get_classifier`` returns: a module named by the cfg's ``classifier``, or, for a CLIP
    tower, the projection ``proj`` (a parameter of open_clip's layout)."""
    if isinstance(model, ElsaCLIPVision):
        return model.proj
    return model.get_submodule(model.pretrained_cfg["classifier"])


def _assert_all_params_have_grads(model: torch.nn.Module) -> None:
    missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missing, f"no gradient for {missing}"


@pytest.mark.parametrize("name", NAMES)
def test_forward_backward(name):
    """timm's test_model_forward / test_model_backward: finite outputs, a gradient for every parameter."""
    model = copy.deepcopy(_model(name))
    out = model(_input(name, 1))
    assert out.shape == (1, NUM_CLASSES) and torch.isfinite(out).all()
    model.train()
    out = model(_input(name, 2))
    out.mean().backward()
    assert out.shape == (2, NUM_CLASSES) and torch.isfinite(out).all()
    _assert_all_params_have_grads(model)


# ---------------------------------------------------------------------------------------------------- FX
def _tracer_kwargs() -> dict:
    return dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                param_shapes_constant=True)


def _fx_model(model: torch.nn.Module, train: bool = False) -> torch.fx.GraphModule:
    """timm's ``_create_fx_model``: the traced model returning the nodes that feed the graph's output."""
    kw = _tracer_kwargs()
    train_nodes, eval_nodes = get_graph_node_names(model, tracer_kwargs=kw)
    train_return, eval_return = [train_nodes[-1]], [eval_nodes[-1]]
    if train:
        graph_nodes = list(reversed(NodePathTracer(**kw).trace(model).nodes))
        names = [n.name for n in graph_nodes]
        train_return = [train_nodes[-names.index(n.name)] for n in graph_nodes[0]._input_nodes]
    return create_feature_extractor(model, train_return_nodes=train_return, eval_return_nodes=eval_return,
                                    tracer_kwargs=kw)


@pytest.mark.parametrize("name", NAMES)
def test_fx_forward_equals_eager(name):
    model = copy.deepcopy(_model(name))
    x = _input(name, 1)
    with torch.inference_mode():
        expected = model(x)
        actual = torch.cat(tuple(_fx_model(model)(x).values()))
    assert torch.equal(actual, expected)


@pytest.mark.parametrize("name", NAMES)
def test_fx_backward(name):
    model = copy.deepcopy(_model(name)).train()
    fx = _fx_model(model, train=True)
    out = torch.cat(tuple(fx(_input(name, 2)).values()))
    out.mean().backward()
    assert out.shape == (2, NUM_CLASSES) and torch.isfinite(out).all()
    _assert_all_params_have_grads(fx)


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("elsa_hsi_vit_")])
def test_fx_feature_wrapper_equals_hook_wrapper(name):
    """``features_only=True, feature_cls="fx"`` (timm's FeatureGraphNet) returns the hook wrapper's maps."""
    kw = dict(_small(name)[0], features_only=True)
    if name.startswith(("elsa_vit_", "elsa_clip_")):
        kw["out_indices"] = kw.get("depth", kw.get("layers"))  # the last blocks (the default 3 exceeds them)
    nets = []
    for feature_cls in ("fx", "hook"):
        torch.manual_seed(0)  # the same weights in both
        nets.append(timm.create_model(name, feature_cls=feature_cls, **kw).eval())
    x = _input(name, 1)
    with torch.inference_mode():
        fx_maps, hook_maps = nets[0](x), nets[1](x)
    assert len(fx_maps) == len(hook_maps) >= 2
    for a, b in zip(fx_maps, hook_maps, strict=True):
        assert torch.equal(a, b)


# ------------------------------------------------------------------------------------------ model API
def _pool_levels(model: torch.nn.Module) -> int:
    """How many intermediates ``forward_intermediates`` returns by default (one per block / stage)."""
    if hasattr(model, "feature_info"):
        return len(model.feature_info)
    return (1 if len(model.spatial_blocks) else 0) + len(model.fusion_blocks)  # ElsaHSIViT


@pytest.mark.parametrize("name", NAMES)
def test_classifier_api(name):
    """timm's test_model_default_cfgs(_non_std): features, pre-logits, get/reset_classifier, no pooling."""
    model = copy.deepcopy(_model(name))
    x = _input(name, 2)
    assert model.num_classes == NUM_CLASSES and model.num_features > 0 and model.head_hidden_size > 0
    assert model.get_classifier() is _head(model)
    with torch.no_grad():
        feats = model.forward_features(x)
        pre = model.forward_head(feats, pre_logits=True)
        logits = model.forward_head(feats)
        assert feats.shape[-1] == model.num_features  # token / NHWC layouts: features last
        assert pre.shape == (2, model.head_hidden_size) and logits.shape == (2, NUM_CLASSES)
        assert torch.equal(model(x), logits)
        model.reset_classifier(0)
        head = model.get_classifier()
        assert model.num_classes == 0
        assert head is None if isinstance(model, ElsaCLIPVision) else isinstance(head, torch.nn.Identity)
        assert torch.equal(model(x), pre)
        model.reset_classifier(7)
        assert model.num_classes == 7 and model(x).shape == (2, 7)
        model.reset_classifier(0, global_pool="")  # timm: no classifier, no pooling -> the features
        assert torch.equal(model(x), feats)
    unpooled = timm.create_model(name, num_classes=0, global_pool="", **_small(name)[0]).eval()
    with torch.no_grad():
        assert unpooled(x).shape == feats.shape


@pytest.mark.parametrize("name", NAMES)
def test_forward_intermediates(name):
    """timm's test_model_forward_intermediates: the final output is forward_features', one intermediate per
    block (or stage), ``indices`` / ``intermediates_only`` select them."""
    model = _model(name)
    x = _input(name, 1)
    fmt = "NLC" if name.startswith("elsa_hsi_vit_") else "NCHW"
    with torch.no_grad():
        final, intermediates = model.forward_intermediates(x, output_fmt=fmt)
        assert torch.allclose(final, model.forward_features(x))
        assert len(intermediates) == _pool_levels(model)
        assert all(t.shape[0] == 1 and torch.isfinite(t).all() for t in intermediates)
        last = model.forward_intermediates(x, indices=1, output_fmt=fmt, intermediates_only=True)
        assert len(last) == 1 and torch.equal(last[0], intermediates[-1])


@pytest.mark.parametrize("name", NAMES)
def test_pretrained_cfg(name):
    """The cfg keys timm's tests read, naming modules the model has (timm checks ``<classifier>.weight`` when
    the cfg's ``num_classes`` is set: the CLIP towers' head, ``proj``, is a parameter, so they name none)."""
    model = _model(name)
    cfg = model.pretrained_cfg
    assert model.default_cfg == cfg
    tower = isinstance(model, ElsaCLIPVision)
    for key in ("input_size", "first_conv") + (() if tower else ("num_classes", "classifier")):
        assert key in cfg, key
    assert len(cfg["input_size"]) == 3
    params = dict(model.named_parameters())
    assert cfg["first_conv"] + ".weight" in params
    if tower:  # None values are left out of timm's cfg dict
        assert cfg.get("num_classes") is None and cfg.get("classifier") is None and "proj" in params
    else:
        assert cfg["classifier"] + ".weight" in params
    assert cfg["input_size"][0] == params[cfg["first_conv"] + ".weight"].shape[1] or name.startswith(
        "elsa_hsi_vit_")  # Conv3d over one channel: the bands are its depth


@pytest.mark.parametrize("name", CLIP_NAMES)
def test_clip_towers_at_full_size(name):
    """A registered CLIP tower as ``timm.create_model`` builds it (on the meta device: ViT-L is large): the
    CLIP embedding by default, ``num_classes=0`` the pooled ``width`` features, ``in_chans`` honoured; the
    sizes timm's tests and tools pick (the input size, the minimum they fall back to below their target, never
    an arbitrary side) are multiples of the patch, and the cfg's input size is the tower's own."""
    with torch.device("meta"):
        model = timm.create_model(name)
        features = timm.create_model(name, num_classes=0)
        grey = timm.create_model(name, in_chans=1)
    arch = CLIP_VISION_ARCHITECTURES[name]
    assert model.num_classes == arch["output_dim"] and tuple(model.proj.shape) == (arch["width"],
                                                                                   arch["output_dim"])
    assert features.num_classes == 0 and features.proj is None and features.head_hidden_size == arch["width"]
    assert grey.conv1.weight.shape[1] == 1
    cfg, patch = model.pretrained_cfg, arch["patch_size"]
    assert not cfg["fixed_input_size"] and cfg["input_size"] == (3, arch["image_size"], arch["image_size"])
    for size in (cfg["input_size"], cfg["min_input_size"]):
        assert size[1] % patch == 0 and size[2] % patch == 0, size
    assert max(cfg["min_input_size"]) <= 128  # what timm's backward / FX / feature tests fall back to


@pytest.mark.parametrize("name", [n for n in NAMES if n.startswith(("elsa_vit_", "elsa_clip_"))])
def test_features_only_getter_equals_forward_intermediates(name):
    """``features_only=True`` of a token model (timm's ``FeatureGetterNet``, as for timm's ViTs) returns the
    maps ``forward_intermediates`` gives for its ``out_indices``, with the channels and reductions of
    ``feature_info``. (Swin's hook-based feature maps are checked against FX above.)"""
    kw = dict(_small(name)[0])
    torch.manual_seed(0)
    features = timm.create_model(name, features_only=True, out_indices=(0, 1), **kw).eval()
    torch.manual_seed(0)
    model = timm.create_model(name, **kw).eval()
    x = _input(name, 1)
    with torch.inference_mode():
        maps = features(x)
        expected = model.forward_intermediates(x, indices=[0, 1], intermediates_only=True)
    assert isinstance(features, FeatureGetterNet) and len(maps) == len(expected) == 2
    info = features.feature_info
    for m, e, ch, red in zip(maps, expected, info.channels(), info.reduction(), strict=True):
        assert torch.equal(m, e)
        assert m.shape[1] == ch and m.shape[-1] == x.shape[-1] // red


def test_vggt_is_not_in_timms_registry():
    """ElsaVGGT (multi-frame input, cameras and depth out) is no image model: timm's registry does not list
    it; ``ElsaVGGT.from_config`` builds its configurations."""
    assert not [n for n in timm.list_models() if "vggt" in n]
    assert isinstance(_vggt("auto"), ElsaVGGT)


def test_features_only_refused_for_hsi_vit():
    """A model without spatial feature maps refuses ``features_only`` in one line naming it."""
    for name in timm.list_models("elsa_hsi_vit_*"):
        with pytest.raises(ValueError, match=f"{name}: features_only=True is not supported"):
            timm.create_model(name, features_only=True)


# ------------------------------------------------------------------------------------------- torch.export
# The Triton path runs compiled on CUDA, else in the Triton interpreter (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _elsa_ops(program: torch.export.ExportedProgram) -> set[str]:
    """The elsa_vision operators (``elsa_vision::attention_fwd``, ``window_attention_fwd``) in the graph."""
    return {str(n.target) for n in program.graph.nodes
            if n.op == "call_function" and str(n.target).startswith("elsa_vision.")}


def _export_equals_eager(model: torch.nn.Module, x: torch.Tensor) -> set[str]:
    """Export ``model`` for ``x``, check the program's outputs against eager's; returns its ELSA ops."""
    program = torch.export.export(model, (x,))
    with torch.no_grad():
        expected = model(x)
        actual = program.module()(x)
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
    return _elsa_ops(program)


@pytest.mark.parametrize("name", NAMES)
def test_export_equals_eager(name):
    """``torch.export.export(model, (x,))`` with the default backend: the program computes what eager does.
    Where ``"auto"`` picks the Triton path the ELSA operator is a node of the graph; on the torch path the
    reference scan is traced into aten operators."""
    model = _model(name)
    x = _input(name, 2)
    ops = _export_equals_eager(model, x)
    assert bool(ops) == (resolve_backend("auto", x) == "triton"), ops


def _clip_tower(backend: str) -> ElsaCLIPVision:
    return timm.create_model("elsa_clip_b16", image_size=32, patch_size=8, width=64, layers=2, heads=4,
                             output_dim=32, attn_backend=backend)


def _vggt(backend: str) -> ElsaVGGT:
    return ElsaVGGT.from_config("elsa_vggt_small", attn_backend=backend)


TOWERS = {  # builder, input [B, ...]
    "clip_vision": (_clip_tower, (2, 3, 32, 32)),
    "vggt": (_vggt, (1, 2, 3, 28, 42)),  # 2 frames of 2 x 3 patches
}


@pytest.mark.parametrize("tower", sorted(TOWERS))
def test_export_clip_vision_and_vggt(tower):
    build, shape = TOWERS[tower]
    torch.manual_seed(0)
    model = build("auto").eval()
    x = torch.rand(shape, generator=torch.Generator().manual_seed(2))
    ops = _export_equals_eager(model, x)
    assert bool(ops) == (resolve_backend("auto", x) == "triton"), ops


TRITON_CASES = {  # name -> (model builder, input shape, the operator its attention runs)
    "vit": (lambda: timm.create_model("elsa_vit_tiny_patch16_224", img_size=32, depth=1, num_classes=5,
                                      attn_backend="triton"), (2, 3, 32, 32), "elsa_vision.attention_fwd"),
    # 64 px: the last stage's window is 2x2 (timm 1.0.29 builds a NaN position table for a 1x1 window: 0/0)
    "swinv2": (lambda: timm.create_model("elsa_swinv2_tiny_window8_256", img_size=64, embed_dim=24,
                                         depths=(2, 1, 1, 1), num_heads=(2, 2, 2, 2), num_classes=5,
                                         attn_backend="triton"), (2, 3, 64, 64),
               "elsa_vision.window_attention_fwd"),
    "hsi_vit": (lambda: timm.create_model("elsa_hsi_vit_tiny", in_chans=16, num_classes=5,
                                          attn_backend="triton"), (2, 16, 9, 9), "elsa_vision.attention_fwd"),
    "clip_vision": (lambda: _clip_tower("triton"), (2, 3, 32, 32), "elsa_vision.attention_fwd"),
    "vggt": (lambda: _vggt("triton"), (1, 2, 3, 28, 28), "elsa_vision.attention_fwd"),
}


@pytest.mark.parametrize("case", sorted(TRITON_CASES))
def test_export_keeps_the_triton_operator(case):
    """The Triton path (what ``"auto"`` picks on CUDA) exports as the ELSA operator node, and the program runs
    the kernels to eager's result."""
    build, shape, op = TRITON_CASES[case]
    torch.manual_seed(0)
    model = build().eval().to(DEVICE)
    x = torch.rand(shape, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ops = _export_equals_eager(model, x)
    assert op + ".default" in ops, ops


# ------------------------------------------------------------------------------------------- TorchScript
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
@pytest.mark.parametrize("name", NAMES + sorted(TOWERS))
def test_torchscript_is_refused_in_one_line(name):
    """TorchScript is not a goal: ``torch.jit.script`` stops at the first ELSA module with one clear error
    pointing to torch.export / torch.compile."""
    model = TOWERS[name][0]("auto") if name in TOWERS else _model(name)
    with pytest.raises(RuntimeError, match=r"is not scriptable: elsa_vision does not support TorchScript .*"
                                           r"torch\.export\.export"):
        torch.jit.script(model)
