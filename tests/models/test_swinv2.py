"""ElsaSwinV2 against timm's SwinTransformerV2: registry, state_dict layout, forward/gradient parity,
from_timm, window resizing, features_only, options and errors."""

from __future__ import annotations

import pytest
import timm
import torch
from timm.models import swin_transformer_v2 as _timm_swinv2
from timm.models.swin_transformer_v2 import SwinTransformerV2

import elsa_vision  # noqa: F401  (registers the elsa_* names)
from elsa_vision.models import ElsaSwinV2
from elsa_vision.models.swinv2 import ElsaSwinV2Attention
from tests.helpers import relerr

# The fused W-ELSA op runs compiled on CUDA, else in the Triton interpreter (tests/conftest.py).
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

NAMES = (
    "elsa_swinv2_tiny_window8_256",
    "elsa_swinv2_tiny_window16_256",
    "elsa_swinv2_small_window8_256",
    "elsa_swinv2_small_window16_256",
    "elsa_swinv2_base_window8_256",
    "elsa_swinv2_base_window16_256",
    "elsa_swinv2_base_window12to24_192to384",
)
# Narrow and shallow for CPU speed; still 4 stages, shifted blocks (depth 2) and several head counts.
SMALL = dict(embed_dim=24, depths=(2, 2, 2, 1), num_heads=(2, 3, 4, 6), num_classes=10, drop_path_rate=0.0)


def _randomize(model: torch.nn.Module) -> None:
    """Non-trivial logit scales, cpb MLP, q/v biases and post-norms (timm's init zeroes the biases and the
    res-post-norm weights, which would hide the attention from the output)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("logit_scale"):
                p.copy_(torch.empty_like(p).uniform_(1.0, 5.0))  # some above log(100): the clamp acts
            elif name.endswith(("q_bias", "v_bias")) or "cpb_mlp" in name:
                p.add_(torch.randn_like(p) * 0.5)
            elif name.endswith(("norm1.weight", "norm2.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))


def _pair(img_size=256, dtype=torch.float32, **kw):
    try:
        ref = SwinTransformerV2(img_size=img_size, **dict(SMALL, window_size=8, **kw))
    except RuntimeError as err:  # older timm cannot pad a strict size that is no window multiple
        pytest.skip(f"timm {timm.__version__} cannot build the reference SwinTransformerV2: {err}")
    _randomize(ref)
    ref = ref.to(dtype).eval()
    return ref, ElsaSwinV2.from_timm(ref, attn_backend="torch").eval()


def test_registry_lists_all_names():
    assert set(NAMES) <= set(timm.list_models("elsa_swinv2*"))


@pytest.mark.parametrize("name", NAMES)
def test_registered_layout_equals_timm(name):
    """Every registered name has timm's exact state_dict keys and shapes (built on the meta device)."""
    with torch.device("meta"):
        model = timm.create_model(name)
        ref = timm.create_model(name.removeprefix("elsa_"))
    assert isinstance(model, ElsaSwinV2)
    got = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    want = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert got == want
    attns = [m for m in model.modules() if isinstance(m, ElsaSwinV2Attention)]
    assert len(attns) == sum(len(stage.blocks) for stage in ref.layers)
    assert [m.window_size for m in attns] == [b.window_size for s in ref.layers for b in s.blocks]


@pytest.mark.parametrize("img_size,strict", [(256, True), (200, True), (200, False)])
def test_forward_matches_timm(img_size, strict):
    """fp32 parity ``<= 1e-5``: at 256 (all windows full) and at 200 px (stage maps 50, 25, 13, 7: padded to
    the window multiple with a static mask, or built per call with ``strict_img_size=False``; the last stage's
    window is clipped to 7)."""
    ref, model = _pair(img_size, strict_img_size=strict)
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        want, got = ref(x), model(x)
    assert relerr(got, want) <= 1e-5
    # The comparison is sensitive to the attention: dropping the ELSA path's logit-scale clamp changes it.
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, ElsaSwinV2Attention):
                m.logit_scale.add_(0.5)
        assert relerr(model(x), want) > 1e-3


def test_dynamic_size_other_resolution():
    """``strict_img_size=False`` accepts a non-square input of another size (timm pads, masks per call)."""
    ref, model = _pair(64, strict_img_size=False)
    x = torch.randn(1, 3, 72, 104)
    with torch.no_grad():
        assert relerr(model(x), ref(x)) <= 1e-5


def test_one_by_one_window_stage_is_finite(monkeypatch):
    """A last stage clamped to a 1x1 window (32 px): timm <= 1.0.29 normalises its coordinate table by
    ``window - 1 = 0`` (NaN table, NaN logits); ELSA's layer sets that 0/0 to 0, timm 1.0.31's value, when it
    converts the module and when ``set_window_size`` rebuilds the table."""
    import timm.models.swin_transformer_v2 as swin2

    real = swin2.WindowAttention._make_pair_wise_relative_positions

    def as_in_timm_1_0_29(self, *args, **kwargs):  # 0/0 for a side of 1, as the older timm computes it
        table, index = real(self, *args, **kwargs)
        side_of_one = torch.tensor([w == 1 for w in self.window_size])
        return torch.where(side_of_one, torch.nan, table), index

    monkeypatch.setattr(swin2.WindowAttention, "_make_pair_wise_relative_positions", as_in_timm_1_0_29)
    stock = timm.create_model("swinv2_tiny_window8_256", img_size=32, **SMALL).eval()
    assert stock.layers[3].blocks[0].attn.window_size == (1, 1)
    with torch.no_grad():
        assert torch.isnan(stock(torch.randn(1, 3, 32, 32))).all()  # the older timm's own result
    model = ElsaSwinV2.from_timm(stock, attn_backend="torch").eval()
    attn = model.layers[3].blocks[0].attn
    assert torch.equal(attn.relative_coords_table, torch.zeros_like(attn.relative_coords_table))
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.isfinite(model(x)).all()
        attn.set_window_size((1, 1))  # the table rebuilt
        assert torch.isfinite(attn.relative_coords_table).all() and torch.isfinite(model(x)).all()


def test_gradients_match_timm_float64():
    """float64 gradients of every parameter ``<= 1e-10`` (logit_scale and cpb_mlp named explicitly)."""
    ref, model = _pair(64, dtype=torch.float64)  # stage maps 16, 8, 4, 2: windows 8, 8, 4, 2 (clipped)
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    w = torch.randn(2, 10, dtype=torch.float64)
    (ref(x) * w).sum().backward()
    (model(x) * w).sum().backward()
    got = dict(model.named_parameters())
    checked = 0
    for name, p in ref.named_parameters():
        assert p.grad is not None and got[name].grad is not None, name
        assert relerr(got[name].grad, p.grad) <= 1e-10, name
        checked += ("logit_scale" in name) + ("cpb_mlp" in name)
    assert checked >= 3 * sum(SMALL["depths"])


def test_from_timm_instance_and_name(tmp_path):
    ref, model = _pair(256)
    assert model.state_dict().keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert torch.equal(model.state_dict()[k], v), k
    assert type(ref) is SwinTransformerV2  # the source is left untouched

    path = tmp_path / "swinv2.pth"
    torch.save(ref.state_dict(), path)
    loaded = ElsaSwinV2.from_timm("swinv2_tiny_window8_256", checkpoint_path=path, **SMALL)
    assert loaded.load_report.ok and not loaded.training
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        assert relerr(loaded(x), ref(x)) <= 1e-5
    # The same file through timm's registry with a local-file overlay (runs timm's checkpoint_filter_fn; the
    # overlay's num_classes keeps timm from dropping the 10-class head as a 1000-class mismatch).
    reg = timm.create_model("elsa_swinv2_tiny_window8_256", pretrained=True,
                            pretrained_cfg_overlay=dict(file=str(path), num_classes=10), **SMALL).eval()
    with torch.no_grad():
        assert relerr(reg(x), ref(x)) <= 1e-5


def test_pretrained_window_resizing(tmp_path):
    """A window-8 checkpoint into a window-16 model with ``pretrained_window_sizes=8``: the coords table is
    rebuilt (normalised by the pretraining window, as timm), the weights load strictly, outputs match timm."""
    src, _ = _pair(256)
    path = tmp_path / "w8.pth"
    torch.save(src.state_dict(), path)
    kw = dict(SMALL, window_size=16, pretrained_window_sizes=(8, 8, 8, 8))
    ref = timm.create_model("swinv2_tiny_window16_256", **kw)
    ref.load_state_dict(torch.load(path, weights_only=True), strict=True)
    ref.eval()
    model = ElsaSwinV2.from_timm("swinv2_tiny_window16_256", checkpoint_path=path, **kw)
    attn = model.layers[0].blocks[0].attn
    assert attn.window_size == (16, 16) and attn.relative_coords_table.shape == (1, 31, 31, 2)
    assert torch.equal(attn.relative_coords_table, ref.layers[0].blocks[0].attn.relative_coords_table)
    # Normalised by (8 - 1), not (16 - 1): the largest offset 15 maps beyond the pretraining range 1.
    assert attn.relative_coords_table.abs().max() > 1.05
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        assert relerr(model(x), ref(x)) <= 1e-5


def test_features_only_matches_timm():
    kw = dict(SMALL, out_indices=(0, 1, 2, 3))
    kw.pop("num_classes")
    torch.manual_seed(1)
    ref = timm.create_model("swinv2_tiny_window8_256", features_only=True, **kw).eval()
    model = timm.create_model("elsa_swinv2_tiny_window8_256", features_only=True, attn_backend="torch", **kw)
    model.load_state_dict(ref.state_dict())
    model.eval()
    assert model.feature_info.channels() == [24, 48, 96, 192]
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    x = torch.randn(1, 3, 256, 256)
    with torch.no_grad():
        got, want = model(x), ref(x)
    shapes = [(1, 64, 64, 24), (1, 32, 32, 48), (1, 16, 16, 96), (1, 8, 8, 192)]
    assert [tuple(t.shape) for t in got] == shapes
    for g, w in zip(got, want):
        assert relerr(g, w) <= 1e-5


def test_set_attention_and_errors():
    ref, model = _pair(64)
    model.set_attention(backend="torch", precision="ieee")
    attns = [m for m in model.modules() if isinstance(m, ElsaSwinV2Attention)]
    assert attns and all(m.backend == "torch" and m.precision == "ieee" for m in attns)
    with pytest.raises(ValueError, match="ElsaSwinV2.set_attention: unknown backend 'cuda'"):
        model.set_attention(backend="cuda")
    with pytest.raises(ValueError, match="attn_precision"):
        ElsaSwinV2(attn_precision="fp8", **SMALL)
    with pytest.raises(TypeError, match="SwinTransformerV2"):
        ElsaSwinV2.from_timm(timm.create_model("vit_tiny_patch16_224"))
    with pytest.raises(TypeError, match="SwinTransformerV2"):
        ElsaSwinV2.from_timm("vit_tiny_patch16_224")
    with pytest.raises(TypeError, match="model name"):
        ElsaSwinV2.from_timm(ref, img_size=128)
    with pytest.raises(TypeError, match="checkpoint_path"):
        ElsaSwinV2.from_timm(ref, checkpoint_path="x.pth")
    with pytest.raises(TypeError, match="WindowAttention"):
        ElsaSwinV2Attention.convert(torch.nn.Linear(2, 2))


def _fresh_bias(m: ElsaSwinV2Attention) -> torch.Tensor:
    """The position bias computed from scratch (timm's formula), for comparison with the cached one."""
    N = m.relative_position_index.shape[0]
    table = m.cpb_mlp(m.relative_coords_table).view(-1, m.num_heads)
    return 16 * torch.sigmoid(table[m.relative_position_index.view(-1)].view(N, N, -1).permute(2, 0, 1))


def test_position_bias_cached_in_inference_only():
    """With autograd off the ``[H, N, N]`` bias is computed once per block and reused; an in-place weight
    update, a replaced parameter, a dtype change or autocast recompute it; with autograd on it is never
    cached (it must carry the graph to ``cpb_mlp``)."""
    _, model = _pair(64)
    m = next(a for a in model.modules() if isinstance(a, ElsaSwinV2Attention))
    with torch.no_grad():
        b1 = m.position_bias()
        assert m.position_bias() is b1  # cache hit
        assert relerr(b1, _fresh_bias(m)) == 0.0
        m.cpb_mlp[0].weight.add_(0.5)  # in-place update (e.g. an optimizer step): version bump
        b2 = m.position_bias()
        assert b2 is not b1 and relerr(b2, _fresh_bias(m)) == 0.0 and relerr(b2, b1) > 1e-3
    with torch.inference_mode():
        assert m.position_bias() is b2
    m.cpb_mlp[2].weight = torch.nn.Parameter(m.cpb_mlp[2].weight.detach() * 2)  # a replaced parameter
    with torch.no_grad():
        b3 = m.position_bias()
        assert b3 is not b2 and relerr(b3, _fresh_bias(m)) == 0.0
        with torch.autocast("cpu", dtype=torch.bfloat16):
            b4 = m.position_bias()
            assert b4 is not b3 and b4.dtype == torch.bfloat16 and m.position_bias() is b4
        assert m.position_bias() is not b4 and m.position_bias().dtype == torch.float32
    model.double()
    with torch.no_grad():
        assert m.position_bias().dtype == torch.float64
    b5 = m.position_bias()  # autograd on: a fresh bias attached to cpb_mlp's graph
    assert b5.requires_grad and b5 is not m.position_bias()
    b5.sum().backward()
    assert m.cpb_mlp[0].weight.grad is not None
    assert "_elsa_position_bias" not in model.state_dict() and not any(
        "position_bias" in k for k in model.state_dict())
    with torch.inference_mode():  # weights made under inference_mode have no version counter: no cache
        _, model = _pair(64)
        m = next(a for a in model.modules() if isinstance(a, ElsaSwinV2Attention))
        b6 = m.position_bias()
        assert m.position_bias() is not b6 and relerr(m.position_bias(), b6) == 0.0
        m.cpb_mlp[0].weight.add_(0.5)
        assert relerr(m.position_bias(), _fresh_bias(m)) == 0.0 and relerr(m.position_bias(), b6) > 1e-3
        x = torch.randn(1, 3, 64, 64)
        assert torch.isfinite(model(x)).all()


def test_attention_dropout_in_training_only():
    ref, model = _pair(64, attn_drop_rate=0.5)
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        assert relerr(model(x), ref(x)) <= 1e-5  # eval: no dropout
        model.train()
        torch.manual_seed(3)
        a = model(x)
        torch.manual_seed(4)
        assert relerr(model(x), a) > 1e-4


def test_triton_backend_matches_timm():
    """``attn_backend="triton"`` runs the fused W-ELSA op in every block (CPU: Triton interpreter). Against
    timm in float64: forward ``<= 1e-5``; the gradient of every attention parameter (logit_scale, cpb_mlp,
    qkv, q/v bias, proj) ``<= 3e-5`` (the bound of tests/kernels/test_window.py) or within 3x timm's own
    float32 error where that is larger."""
    import copy

    import elsa_vision.layers.window_attention as wa  # where the Swin layers look the op up

    ref, model = _pair(64)  # stage maps 16, 8, 4, 2: windows 8 (shifted), 8, 4, 2
    ref, model = ref.to(DEVICE), model.to(DEVICE)
    ref64 = copy.deepcopy(ref).double()
    model.set_attention(backend="triton", precision="ieee")
    calls = []
    real = wa.window_attention

    def counting(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    wa.window_attention = counting
    try:
        x = torch.randn(2, 3, 64, 64, device=DEVICE)
        w = torch.randn(2, 10, device=DEVICE)
        got, want, want64 = model(x), ref(x), ref64(x.double())
        assert len(calls) == sum(SMALL["depths"])
        assert relerr(got, want64) <= 1e-5
        for out, ww in ((got, w), (want, w), (want64, w.double())):
            (out * ww).sum().backward()
    finally:
        wa.window_attention = real
    ours, timm32 = dict(model.named_parameters()), dict(ref.named_parameters())
    checked = 0
    for name, p in ref64.named_parameters():
        if "attn." in name:
            err, err32 = relerr(ours[name].grad, p.grad), relerr(timm32[name].grad, p.grad)
            bound = max(3 * err32, 3e-5)
            assert err <= bound, f"{name}: {err:.2e} > {bound:.1e} (timm float32 {err32:.2e})"
            checked += 1
    assert checked == 9 * sum(SMALL["depths"])


def test_non_square_windows_and_image_triton():
    """Window (6, 10) on a 96x160 image: stage maps 24x40, 12x20, 6x10 (shifted by (3, 5)) and 3x5 (window
    clipped to the map), fused W-ELSA op in every block; fp32 forward ``<= 1e-5`` against timm."""
    ref = SwinTransformerV2(img_size=(96, 160), **dict(SMALL, window_size=(6, 10)))
    _randomize(ref)
    ref = ref.to(DEVICE).eval()
    assert ref.layers[3].blocks[0].window_size == (3, 5) and ref.layers[1].blocks[1].shift_size == (3, 5)
    model = ElsaSwinV2.from_timm(ref, attn_backend="triton", attn_precision="ieee").eval()
    x = torch.randn(2, 3, 96, 160, device=DEVICE)
    with torch.no_grad():
        assert relerr(model(x), ref(x)) <= 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["swinv2_tiny_window8_256", "swinv2_small_window16_256"])
def test_gpu_full_model_matches_timm(name):
    """Full-size models on CUDA (default ``auto`` backend: the W-ELSA op, ``tf32x3``) against timm in float64:
    fp32 forward ``<= 1e-5``; bfloat16 autocast forward ``<= 3x`` timm's own bfloat16 autocast error."""
    import copy

    ref = timm.create_model(name)
    _randomize(ref)
    ref = ref.cuda().eval()
    ref64 = copy.deepcopy(ref).double()
    model = ElsaSwinV2.from_timm(ref).eval()
    x = torch.randn(4, 3, 256, 256, device="cuda")
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # IEEE float32 for the linear layers of both models
    try:
        with torch.no_grad():
            want = ref64(x.double())
            assert relerr(model(x).double(), want) <= 1e-5
            with torch.autocast("cuda", dtype=torch.bfloat16):
                got_bf, ref_bf = model(x), ref(x)
            assert relerr(got_bf.double(), want) <= 3 * relerr(ref_bf.double(), want)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32


def test_qkv_bias_kept_in_inference_only():
    """The ``(q_bias, 0, v_bias)`` concatenation is formed once in inference and again after an in-place
    update of ``q_bias``; with autograd on it is formed at every call (its gradient reaches q_bias)."""
    ref, model = _pair(64)
    m = next(a for a in model.modules() if isinstance(a, ElsaSwinV2Attention))
    x = torch.randn(2, 64, m.qkv.in_features)
    with torch.no_grad():
        m._qkv(x)
        kept = m.__dict__["_elsa_qkv_bias"][1]
        m._qkv(x)
        assert m.__dict__["_elsa_qkv_bias"][1] is kept
        assert torch.equal(kept, torch.cat((m.q_bias, m.k_bias, m.v_bias)))
        m.q_bias.add_(1.0)
        q, _, _ = m._qkv(x)
        again = m.__dict__["_elsa_qkv_bias"][1]
        assert again is not kept and torch.equal(again[: m.q_bias.numel()], m.q_bias)
        ref_q = (x @ m.qkv.weight.T + torch.cat((m.q_bias, m.k_bias, m.v_bias)))[..., : m.q_bias.numel()]
        assert relerr(q.transpose(1, 2).reshape(ref_q.shape), ref_q) <= 1e-6
    q, _, _ = m._qkv(x)
    q.sum().backward()
    assert m.q_bias.grad is not None and torch.count_nonzero(m.q_bias.grad) > 0
    # the whole model after the update, against timm's with the same update (the block's kept bias renewed)
    r = next(a for a in ref.modules() if isinstance(a, _timm_swinv2.WindowAttention))
    img = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        r.q_bias.add_(1.0)
        assert relerr(model(img), ref(img)) <= 1e-5
