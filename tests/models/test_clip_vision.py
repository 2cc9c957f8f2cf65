"""ElsaCLIPVision equals open_clip's image tower; elsa_clip keeps a whole open_clip model's outputs.

References are open_clip's own modules evaluated in float64 on the same weights; the ELSA tower runs in
float32 and must satisfy ‖out − ref64‖/‖ref64‖ <= 1e-5 (the issue's bound; float32 open_clip itself is
~1e-7 off).
"""

import copy
import json

import pytest
import torch

open_clip = pytest.importorskip("open_clip")
from open_clip.model import CLIP, CLIPTextCfg, CLIPVisionCfg, _build_vision_tower, resize_pos_embed  # noqa: E402

from elsa_vision.models import ElsaCLIPVision, create_elsa_clip_vision, from_open_clip  # noqa: E402
from elsa_vision.models.clip_patch import elsa_clip  # noqa: E402
from elsa_vision.models.clip_vision import (  # noqa: E402
    CLIP_VISION_ARCHITECTURES,
    ElsaMultiheadAttention,
    load_clip_state_dict,
)
from tests.helpers import relerr  # noqa: E402

TOL = 1e-5
TINY_TEXT = CLIPTextCfg(context_length=16, vocab_size=500, width=32, heads=2, layers=1)


def _perturb(module: torch.nn.Module, seed: int = 0, sharpen: float = 2.0) -> None:
    """Move vectors off their init (LayerNorm gains off 1, biases off 0) and sharpen the attention logits.

    Matrices keep their random init: larger changes make a 12-layer tower ill-conditioned (float32 open_clip
    itself then drifts from float64 by more than the bound).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() == 1:
                p.add_(0.05 * torch.randn(p.shape, generator=g, dtype=p.dtype))
            if name.endswith("in_proj_weight") or name.endswith("proj_weight"):
                p.mul_(sharpen)


def _tower(embed_dim=48, quick_gelu=False, **vision):
    cfg = dict(layers=2, width=64, head_width=16, patch_size=8, image_size=32)
    cfg.update(vision)
    t = _build_vision_tower(embed_dim, CLIPVisionCfg(**cfg), quick_gelu=quick_gelu).eval()
    _perturb(t)
    return t


def _ref64(module, x):
    """Run a float64 deep copy of an open_clip module (the reference)."""
    out = copy.deepcopy(module).double()(x.double())
    return out


def _assert_close(out, ref):
    if isinstance(ref, tuple):
        assert isinstance(out, tuple) and len(out) == len(ref)
        for o, r in zip(out, ref):
            _assert_close(o, r)
        return
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert out.dtype == torch.float32
    err = relerr(out, ref)
    assert err <= TOL, f"relerr {err:.3e} > {TOL}"


# ---------------------------------------------------------------------------------------------- ViT-B-16


def test_vit_b16_features_match_open_clip():
    mc = open_clip.get_model_config("ViT-B-16")
    ref = _build_vision_tower(mc["embed_dim"], mc["vision_cfg"]).eval()
    _perturb(ref)
    ours = from_open_clip(ref).eval()
    # the state_dict contract: identical keys, shapes and values
    sd_ref, sd = ref.state_dict(), ours.state_dict()
    assert list(sd) == list(sd_ref)
    assert all(torch.equal(sd[k], sd_ref[k]) for k in sd)
    assert sd["transformer.resblocks.0.attn.in_proj_weight"].shape == (3 * 768, 768)
    assert (
        "conv1.bias" not in sd
        and sd["positional_embedding"].shape == (197, 768)
        and sd["proj"].shape == (768, 512)
    )
    # the registered config builds the same layout
    with torch.device("meta"):
        reg = create_elsa_clip_vision("elsa_clip_b16")
    assert {k: v.shape for k, v in reg.state_dict().items()} == {k: v.shape for k, v in sd.items()}
    x = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        out = ours(x)
        ref64 = _ref64(ref, x)
        ref32 = ref(x)
    _assert_close(out, ref64)
    assert relerr(ref32, ref64) <= TOL  # the reference itself is within the bound in float32


@pytest.mark.parametrize("name", sorted(CLIP_VISION_ARCHITECTURES))
def test_registered_architectures_match_open_clip_configs(name):
    oc_name = {"elsa_clip_b16": "ViT-B-16", "elsa_clip_l14": "ViT-L-14", "elsa_clip_l14_336": "ViT-L-14-336"}[
        name
    ]
    mc = open_clip.get_model_config(oc_name)
    with torch.device("meta"):
        ours = create_elsa_clip_vision(name)
        ref = _build_vision_tower(mc["embed_dim"], mc["vision_cfg"])
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: v.shape for k, v in ref.state_dict().items()
    }


# ------------------------------------------------------------------------------------------ small variants

VARIANTS = {
    "coca_attn_pool": dict(
        attentional_pool=True, attn_pooler_queries=7, attn_pooler_heads=4, output_tokens=True
    ),
    "attn_pool_parallel": dict(
        width=48, attentional_pool="parallel", attn_pooler_queries=5, attn_pooler_heads=3
    ),
    "attn_pool_cascade": dict(
        width=48, attentional_pool="cascade", attn_pooler_queries=5, attn_pooler_heads=3
    ),
    "quickgelu_layerscale": dict(quick_gelu=True, ls_init_value=0.3),
    "avg_final_ln_no_ln_pre": dict(pool_type="avg", final_ln_after_pool=True, no_ln_pre=True),
    "output_tokens_rect": dict(output_tokens=True, image_size=(32, 48), layers=3, mlp_ratio=2.5),
    "sincos_pos": dict(pos_embed_type="sin_cos_2d"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_matches_open_clip(variant):
    kw = dict(VARIANTS[variant])
    ref = _tower(
        embed_dim=48, **kw
    )  # parallel/cascade pooling needs width == embed_dim (open_clip's ln_post)
    ours = from_open_clip(ref).eval()
    if kw.get("quick_gelu"):
        assert type(ours.transformer.resblocks[0].mlp.gelu).__name__ == "QuickGELU"
    if "ls_init_value" in kw:
        assert "transformer.resblocks.1.ls_2.gamma" in ours.state_dict()
    if kw.get("attentional_pool"):
        assert isinstance(ours.attn_pool.attn, ElsaMultiheadAttention)
        assert (ours.attn_pool_contrastive is not None) == isinstance(kw["attentional_pool"], str)
    H, W = kw.get("image_size", (32, 32)) if isinstance(kw.get("image_size"), tuple) else (32, 32)
    x = torch.randn(3, 3, H, W)
    with torch.no_grad():
        out, ref64 = ours(x), _ref64(ref, x)
    _assert_close(out, ref64)
    if kw.get("pos_embed_type") == "sin_cos_2d":  # a fresh tower builds open_clip's fixed embedding
        fresh = ElsaCLIPVision(
            image_size=32, patch_size=8, width=64, layers=1, heads=4, pos_embed_type="sin_cos_2d"
        )
        oc = _build_vision_tower(
            48,
            CLIPVisionCfg(
                layers=1, width=64, head_width=16, patch_size=8, image_size=32, pos_embed_type="sin_cos_2d"
            ),
        )
        assert not fresh.positional_embedding.requires_grad
        assert relerr(fresh.positional_embedding, oc.positional_embedding) <= 1e-6
    if kw.get("output_tokens"):
        n_tok = (kw["attn_pooler_queries"] - 1) if kw.get("attentional_pool") else (H // 8) * (W // 8)
        assert out[1].shape[:2] == (3, n_tok)


@pytest.mark.parametrize("unlocked", [0, 1, 2, 4])
def test_lock_matches_open_clip(unlocked):
    ref = _tower(layers=3)
    ours = from_open_clip(ref)
    ref.lock(unlocked_groups=unlocked)
    ours.lock(unlocked_groups=unlocked)
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable == [n for n, p in ref.named_parameters() if p.requires_grad]
    assert (len(trainable) > 0) == (unlocked > 0)


def test_coca_pooler_uses_elsa_cross_attention(monkeypatch):
    """The pooler's learned queries go through elsa_attention with Nq = n_queries, Nk = 1 + grid tokens."""
    import elsa_vision.layers.multihead_attention as cv

    ours = from_open_clip(_tower(**VARIANTS["coca_attn_pool"])).eval()
    calls = []
    real = cv.elsa_attention

    def spy(q, k, v, **kw):
        calls.append((tuple(q.shape), tuple(k.shape)))
        return real(q, k, v, **kw)

    monkeypatch.setattr(cv, "elsa_attention", spy)
    with torch.no_grad():
        ours(torch.randn(2, 3, 32, 32))
    assert calls[:2] == [((2, 4, 17, 16), (2, 4, 17, 16))] * 2  # two self-attention blocks
    assert calls[2] == ((2, 4, 7, 12), (2, 4, 17, 12))  # 7 queries of width 48 (4 heads x 12) over 17 tokens


def test_multihead_attention_masks_match_torch():
    """ElsaMultiheadAttention equals nn.MultiheadAttention (float64): bool/float masks, kdim != embed_dim."""
    torch.manual_seed(1)
    for kw, cross in (
        (dict(embed_dim=24, num_heads=3), False),
        (dict(embed_dim=24, num_heads=2, kdim=20, vdim=20), True),
    ):
        mha = torch.nn.MultiheadAttention(**kw, batch_first=True).double().eval()
        _perturb(mha)
        ours = ElsaMultiheadAttention.convert(copy.deepcopy(mha)).eval()
        assert isinstance(ours, torch.nn.MultiheadAttention)
        q = torch.randn(2, 5, 24, dtype=torch.float64)
        kv = torch.randn(2, 9, 20 if cross else 24, dtype=torch.float64) if cross else q
        Nk = kv.shape[1]
        bool_mask = torch.rand(5, Nk) < 0.3
        bool_mask[:, 0] = False
        kpm = torch.zeros(2, Nk, dtype=torch.bool)
        kpm[1, -2:] = True
        for am, kp in ((None, None), (bool_mask, None), (torch.randn(5, Nk, dtype=torch.float64), kpm)):
            ref = mha(q, kv, kv, need_weights=False, attn_mask=am, key_padding_mask=kp)[0]
            out = ours(q, kv, kv, need_weights=False, attn_mask=am, key_padding_mask=kp)[0]
            assert relerr(out, ref) <= 1e-12
    with pytest.raises(ValueError, match="need_weights"):
        ours(q, kv, kv, need_weights=True)


# --------------------------------------------------------------------------------------- higher resolution


def test_higher_resolution_matches_open_clip_resized():
    ref = _tower()
    ours = from_open_clip(ref).eval()
    # open_clip's way: build the tower at 48 px and load the 32 px weights through resize_pos_embed
    big = _build_vision_tower(
        48, CLIPVisionCfg(layers=2, width=64, head_width=16, patch_size=8, image_size=48)
    )
    holder = torch.nn.Module()
    holder.visual = big
    sd = {f"visual.{k}": v for k, v in ref.state_dict().items()}
    resize_pos_embed(sd, holder)
    big.load_state_dict({k[7:]: v for k, v in sd.items()})
    big.eval()
    x = torch.randn(2, 3, 48, 48)
    with torch.no_grad():
        ref64 = _ref64(big, x)
        dynamic = ours(x)  # resampled on the fly
        fixed = from_open_clip(ref, image_size=48).eval()
        assert fixed.positional_embedding.shape == (37, 64) and fixed.grid_size == (6, 6)
        _assert_close(dynamic, ref64)
        _assert_close(fixed(x), ref64)
        # the native size still uses the stored embedding
        x32 = torch.randn(1, 3, 32, 32)
        _assert_close(ours(x32), _ref64(ref, x32))
    with pytest.raises(ValueError, match="multiple of patch_size"):
        ours(torch.randn(1, 3, 36, 32))
    with pytest.raises(ValueError, match=r"\[B, 3, H, W\]"):
        ours(torch.randn(1, 1, 32, 32))


# ------------------------------------------------------------------------------------- whole-model patching


def _tiny_clip(quick_gelu=False, **vision):
    vc = dict(layers=2, width=64, head_width=16, patch_size=8, image_size=32)
    vc.update(vision)
    m = CLIP(48, vision_cfg=CLIPVisionCfg(**vc), text_cfg=TINY_TEXT, quick_gelu=quick_gelu).eval()
    _perturb(m)
    return m


def test_elsa_clip_patched_model_logits_equal_original():
    model = _tiny_clip(attentional_pool=True, attn_pooler_queries=4, attn_pooler_heads=4)
    original = copy.deepcopy(model)
    params = [id(p) for p in model.parameters()]
    keys = list(model.state_dict())
    report = elsa_clip(model)
    assert report["replaced"] == 3 and report["modules"][-1] == "attn_pool.attn"
    assert [id(p) for p in model.parameters()] == params and list(model.state_dict()) == keys
    assert all(isinstance(b.attn, ElsaMultiheadAttention) for b in model.visual.transformer.resblocks)
    assert all(
        isinstance(b.attn, torch.nn.MultiheadAttention) for b in model.transformer.resblocks
    )  # text kept
    img, txt = torch.randn(3, 3, 32, 32), torch.randint(1, 500, (4, 16))
    with torch.no_grad():
        logits, _ = model.get_logits(img, txt)
        ref64, _ = copy.deepcopy(original).double().get_logits(img.double(), txt)
        assert torch.equal(model.encode_text(txt), original.encode_text(txt))
    assert logits.shape == (3, 4)
    assert relerr(logits, ref64) <= TOL
    assert elsa_clip(model)["replaced"] == 0  # idempotent


def test_elsa_clip_on_coca():
    from open_clip.coca_model import CoCa, MultimodalCfg

    text = CLIPTextCfg(
        context_length=16, vocab_size=500, width=32, heads=2, layers=1, embed_cls=True, output_tokens=True
    )
    vision = CLIPVisionCfg(
        layers=2,
        width=64,
        head_width=16,
        patch_size=8,
        image_size=32,
        attentional_pool=True,
        attn_pooler_queries=5,
        attn_pooler_heads=4,
        output_tokens=True,
    )
    model = CoCa(
        32,
        multimodal_cfg=MultimodalCfg(context_length=16, vocab_size=500, width=32, heads=2, layers=1),
        text_cfg=text,
        vision_cfg=vision,
    ).eval()
    _perturb(model.visual)
    original = copy.deepcopy(model)
    assert elsa_clip(model)["replaced"] == 3
    img, txt = torch.randn(2, 3, 32, 32), torch.randint(1, 500, (2, 16))
    with torch.no_grad():
        ref64 = copy.deepcopy(original).double().encode_image(img.double())
        assert relerr(model.encode_image(img), ref64) <= TOL
        out, ref = model(img, txt), original(img, txt)
    assert torch.equal(out["text_features"], ref["text_features"])
    assert relerr(out["image_features"], ref["image_features"]) <= TOL


def test_elsa_clip_bad_inputs():
    with pytest.raises(TypeError, match="nn.Module"):
        elsa_clip("ViT-B-16")
    with pytest.raises(ValueError, match="backend"):
        elsa_clip(_tiny_clip(), backend="cuda")
    with pytest.raises(ValueError, match="no nn.MultiheadAttention"):
        elsa_clip(torch.nn.Linear(3, 3))


# --------------------------------------------------------------------------------------------- checkpoints


@pytest.fixture()
def tiny_config(tmp_path):
    cfg = {
        "embed_dim": 48,
        "vision_cfg": {"image_size": 32, "layers": 2, "width": 64, "head_width": 16, "patch_size": 8},
        "text_cfg": {"context_length": 16, "vocab_size": 500, "width": 32, "heads": 2, "layers": 1},
    }
    path = tmp_path / "elsa-test-tiny-clip.json"
    path.write_text(json.dumps(cfg))
    open_clip.add_model_config(path)
    return "elsa-test-tiny-clip"


def test_checkpoint_round_trip(tmp_path, tiny_config):
    from safetensors.torch import save_file

    model = _tiny_clip()
    pt, st = tmp_path / "clip.pt", tmp_path / "clip.safetensors"
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, pt)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(st))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref64 = _ref64(model.visual, x)
        for path in (pt, st):
            ours = from_open_clip(tiny_config, pretrained=path).eval()
            _assert_close(ours(x), ref64)
        # open_clip's own loader reads the same file: the ELSA tower of the loaded model agrees
        loaded = open_clip.create_model(tiny_config, pretrained=str(pt)).eval()
        _assert_close(from_open_clip(loaded).eval()(x), ref64)
        # an image-tower-only state_dict saved from ElsaCLIPVision loads back bit-exactly
        torch.save(ours.state_dict(), tmp_path / "tower.pt")
        back = ElsaCLIPVision(image_size=32, patch_size=8, width=64, layers=2, heads=4, output_dim=48)
        back.load_state_dict(load_clip_state_dict(tmp_path / "tower.pt"))
        assert torch.equal(back.eval()(x), ours(x))


def test_openai_format_checkpoints(tmp_path):
    """OpenAI layout (visual.* keys, QuickGELU, head width 64): plain state_dict and TorchScript archive."""
    model = _tiny_clip(quick_gelu=True, width=128, head_width=64)
    sd = dict(model.state_dict())
    sd["input_resolution"] = torch.tensor(32)
    sd["context_length"] = torch.tensor(16)
    torch.save(sd, tmp_path / "openai.pt")
    traced = torch.jit.trace_module(model, {"encode_image": (torch.randn(1, 3, 32, 32),)}, check_trace=False)
    traced.save(str(tmp_path / "openai_jit.pt"))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        ref64 = _ref64(model.visual, x)
        for name in ("openai.pt", "openai_jit.pt"):
            ours = from_open_clip(tmp_path / name).eval()
            assert ours.transformer.resblocks[0].attn.num_heads == 2
            assert type(ours.transformer.resblocks[0].mlp.gelu).__name__ == "QuickGELU"
            _assert_close(ours(x), ref64)
        # a higher-resolution tower from the 32 px checkpoint: positional embedding resampled on load
        big = create_elsa_clip_vision(
            "elsa_clip_b16",
            width=128,
            heads=2,
            layers=2,
            patch_size=8,
            image_size=48,
            output_dim=48,
            act_layer="quick_gelu",
            pretrained=tmp_path / "openai.pt",
        )
        assert big.positional_embedding.shape == (37, 128)


class _Payload(torch.nn.Module):
    """A module whose TorchScript ``__setstate__`` overwrites the first bytes of a file (``torch.from_file``
    maps it shared): what ``torch.jit.load`` runs while reading an archive."""

    def __init__(self, victim: str):
        super().__init__()
        self.victim = victim

    def forward(self, x):
        return x

    @torch.jit.export
    def __getstate__(self) -> tuple[str, bool]:
        return (self.victim, self.training)

    @torch.jit.export
    def __setstate__(self, state: tuple[str, bool]) -> None:
        self.victim = state[0]
        written = torch.from_file(state[0], shared=True, size=4, dtype=torch.uint8).fill_(88)
        self.training = bool(written[0] == 88) and state[1]


class _CLIPLayout(torch.nn.Module):
    """OpenAI's layout (``visual.*``, ``logit_scale``) for TorchScript archives; optionally with a payload."""

    def __init__(self, victim: str | None = None):
        super().__init__()
        self.visual = _tower(quick_gelu=True, width=128, head_width=64)
        self.logit_scale = torch.nn.Parameter(torch.tensor(4.6))
        self.register_buffer("input_resolution", torch.tensor(32))
        self.payload = _Payload(victim) if victim else torch.nn.Identity()

    def forward(self, x):
        return self.payload(self.visual(x))


def test_torchscript_archive_code_is_never_run(tmp_path):
    """A "CLIP weights" TorchScript archive whose __setstate__ writes to disk: torch.jit.load runs it (shown
    here on a scratch file), the CLIP loaders refuse the archive and nothing is written."""
    import warnings

    victim = tmp_path / "victim.bin"
    victim.write_bytes(b"abcdefgh")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.script / save are deprecated
        torch.jit.save(torch.jit.script(_CLIPLayout(str(victim))), str(tmp_path / "evil.pt"))
        torch.jit.load(str(tmp_path / "evil.pt"))
    assert victim.read_bytes() == b"XXXXefgh"  # the archive's code ran inside torch.jit.load
    victim.write_bytes(b"abcdefgh")
    for load in (load_clip_state_dict, from_open_clip):
        with pytest.raises(ValueError, match=r"evil\.pt.*__getstate__/__setstate__ code, which is never run"):
            load(tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="never run"):
        create_elsa_clip_vision("elsa_clip_b16", pretrained=tmp_path / "evil.pt")
    assert victim.read_bytes() == b"abcdefgh"
    victim.unlink()  # a payload aimed at a missing file would create it
    with pytest.raises(ValueError, match="never run"):
        load_clip_state_dict(tmp_path / "evil.pt")
    assert not victim.exists()


@pytest.mark.parametrize("export", ["script", "trace"])
def test_torchscript_archive_reads_the_same_tensors(tmp_path, export):
    """A genuine TorchScript archive of a CLIP-layout module: the tensors torch.jit.load gives, bit for bit,
    with dtypes kept (a float16 parameter) and buffers included."""
    import warnings

    model = _CLIPLayout().eval()
    model.half_param = torch.nn.Parameter(torch.randn(3).half())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if export == "script":
            archive = torch.jit.script(model)
        else:
            archive = torch.jit.trace(model, torch.randn(1, 3, 32, 32), check_trace=False)
        torch.jit.save(archive, str(tmp_path / "clip.pt"))
        ref = torch.jit.load(str(tmp_path / "clip.pt")).state_dict()
    from elsa_vision.files import read_torchscript_state_dict

    sd = read_torchscript_state_dict(tmp_path / "clip.pt")
    assert list(sd) == list(ref) and "input_resolution" in sd and "half_param" in sd
    for k, v in ref.items():
        assert sd[k].dtype == v.dtype and sd[k].shape == v.shape and torch.equal(sd[k], v), k
    loaded = load_clip_state_dict(tmp_path / "clip.pt")
    assert "input_resolution" not in loaded and loaded.keys() == ref.keys() - {"input_resolution"}
    tower = from_open_clip(tmp_path / "clip.pt").eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        _assert_close(tower(x), _ref64(model.visual, x))


def test_torchscript_archive_with_foreign_globals_is_refused(tmp_path):
    """A zip shaped like a TorchScript archive whose data.pkl calls os.system: refused by name, not run."""
    import pickle
    import zipfile

    marker = tmp_path / "ran"

    class Call:
        def __reduce__(self):
            import os

            return (os.system, (f"touch {marker}",))

    with zipfile.ZipFile(tmp_path / "forged.pt", "w") as zf:
        zf.writestr("forged/data.pkl", pickle.dumps(Call(), protocol=2))
        zf.writestr("forged/code/__torch__.py", "class CLIP(Module):\n  __parameters__ = []\n")
        zf.writestr("forged/constants.pkl", pickle.dumps((), protocol=2))
    with pytest.raises(ValueError, match=r"forged\.pt.*(posix|os)\.system"):
        load_clip_state_dict(tmp_path / "forged.pt")
    assert not marker.exists()


def test_bad_inputs(tmp_path, tiny_config):
    with pytest.raises(ValueError, match="unknown open_clip config"):
        from_open_clip("ViT-Nonexistent-99")
    with pytest.raises(ValueError, match="unknown name"):
        create_elsa_clip_vision("elsa_clip_h14")
    with pytest.raises(ValueError, match="local checkpoint file"):
        from_open_clip(tiny_config, pretrained="openai")
    with pytest.raises(TypeError, match="model_or_name"):
        from_open_clip(42)
    with pytest.raises(ValueError, match="custom attention"):
        from_open_clip(_tower(qk_norm=True))
    with pytest.raises(ValueError, match="custom attention"):
        from_open_clip(_tower(scaled_cosine_attn=True))
    # a checkpoint of another width: the error names the tensor and both shapes
    other = CLIP(
        48,
        vision_cfg=CLIPVisionCfg(layers=2, width=96, head_width=16, patch_size=8, image_size=32),
        text_cfg=TINY_TEXT,
    )
    torch.save(other.state_dict(), tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"has shape \[.*96.*\], the model expects \[.*64"):
        from_open_clip(tiny_config, pretrained=tmp_path / "other.pt")
    # a checkpoint with no image tower
    torch.save({"token_embedding.weight": torch.zeros(3, 2)}, tmp_path / "text_only.pt")
    with pytest.raises(ValueError, match="visual"):
        from_open_clip(tiny_config, pretrained=tmp_path / "text_only.pt")
    # a checkpoint that is not a weights-only state_dict
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match=r"^pretrained: '.*junk\.pt' is not a checkpoint"):
        from_open_clip(tiny_config, pretrained=tmp_path / "junk.pt")
    with pytest.raises(FileNotFoundError, match=r"^pretrained: '.*missing\.pt' does not exist"):
        load_clip_state_dict(tmp_path / "missing.pt")
    with pytest.raises(ValueError, match="pool_type"):
        ElsaCLIPVision(pool_type="max")
    with pytest.raises(ValueError, match="act_layer"):
        ElsaCLIPVision(act_layer="relu6")
    with pytest.raises(ValueError, match="divisible"):
        ElsaCLIPVision(width=100, heads=3)


def test_architecture_read_from_a_file_cannot_ask_for_more_than_the_file_holds(tmp_path, monkeypatch):
    """from_open_clip(<file>) reads width, depth and MLP ratio from a few tensors' shapes: a 1024-wide conv1
    of 1x1 patches and a one-column c_fc (a few KB) described a 50 MB tower (at width 32768, 50 GB). The
    tower is built on the meta device first and every tensor must be in the file: refused in one line."""
    import elsa_vision.models.clip_vision as cv

    real = cv.ElsaCLIPVision

    class Recorded(real):
        def __init__(self, *args, **kwargs):
            if torch.empty(0).device.type != "meta":
                raise AssertionError("a tower was allocated for an architecture the file does not hold")
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(cv, "ElsaCLIPVision", Recorded)
    forged = {"conv1.weight": torch.zeros(1024, 3, 1, 1), "positional_embedding": torch.zeros(2, 1024),
              "proj": torch.zeros(1024, 8), "transformer.resblocks.0.mlp.c_fc.weight": torch.zeros(4096, 1)}
    torch.save(forged, tmp_path / "forged.pt")
    refused = r"forged\.pt.: .transformer\.resblocks\.0\.mlp\.c_fc\.weight. has shape \[4096, 1\], the model"
    with pytest.raises(ValueError, match=refused):
        from_open_clip(tmp_path / "forged.pt")
