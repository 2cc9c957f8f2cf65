"""ElsaHSIViT: shapes for any band count, ELSA vs SDPA parity, key-mask semantics, token layout, registry."""

import pytest
import timm
import torch

import elsa_vision  # noqa: F401  (registers elsa_hsi_vit_*)
from elsa_vision.layers import ElsaAttention
from elsa_vision.models import ElsaHSIViT
from elsa_vision.models.hsi_vit import HSIMAEDecoder
from tests.helpers import relerr

TINY = dict(embed_dim=32, num_heads=4, branch_depth=1, fusion_depth=1)


@pytest.mark.parametrize(
    "bands,group,expect_groups", [(1, 8, 1), (7, 8, 1), (24, 8, 3), (103, 8, 13), (30, 7, 5)]
)
def test_any_band_count(bands, group, expect_groups):
    m = ElsaHSIViT(bands, 5, img_size=9, band_group=group, spatial_patch=3, **TINY)
    assert m.num_groups == expect_groups and m.num_spatial == 9
    x = torch.randn(2, bands, 9, 9)
    out = m(x)
    assert out.shape == (2, 5) and torch.isfinite(out).all()
    out.sum().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())


def test_padded_bands_equal_explicit_zero_bands():
    """Band padding to a multiple of band_group is zero padding: the same weights on explicitly padded input
    (16 bands, last 6 zero) give the same logits."""
    m10 = ElsaHSIViT(10, 3, img_size=3, band_group=8, spatial_patch=1, **TINY).double().eval()
    m16 = ElsaHSIViT(16, 3, img_size=3, band_group=8, spatial_patch=1, **TINY).double().eval()
    m16.load_state_dict(m10.state_dict())
    x = torch.randn(4, 10, 3, 3, dtype=torch.float64)
    xp = torch.cat([x, torch.zeros(4, 6, 3, 3, dtype=torch.float64)], 1)
    assert relerr(m10(x), m16(xp)) <= 1e-14


def test_uses_elsa_attention_in_timm_blocks():
    from timm.models.vision_transformer import Block

    m = ElsaHSIViT(16, 3, img_size=9, **TINY)
    blocks = [b for b in m.modules() if isinstance(b, Block)]
    assert len(blocks) == 3 and all(isinstance(b.attn, ElsaAttention) for b in blocks)
    m.set_attention(backend="torch", precision="ieee")
    assert all(b.attn.backend == "torch" and b.attn.precision == "ieee" for b in blocks)
    with pytest.raises(ValueError, match="ElsaHSIViT.set_attention: unknown backend 'cuda'"):
        m.set_attention(backend="cuda")


def test_elsa_matches_sdpa_with_same_weights():
    """Same weights, ELSA vs SDPA (``attn_layer=timm.layers.Attention``): float64 both (<= 1e-12), and ELSA in
    float32 vs the float64 SDPA model (<= 1e-5: the whole network in float32, not just attention)."""
    from timm.layers import Attention

    torch.manual_seed(1)
    cfg = dict(
        img_size=9, band_group=4, spatial_patch=3, embed_dim=48, num_heads=3, branch_depth=2, fusion_depth=2
    )
    sdpa = ElsaHSIViT(17, 6, attn_layer=Attention, **cfg).eval()
    elsa = ElsaHSIViT(17, 6, **cfg).eval()
    assert not any(isinstance(m, ElsaAttention) for m in sdpa.modules())
    elsa.load_state_dict(sdpa.state_dict())
    x = torch.randn(5, 17, 9, 9)
    ref = sdpa.double()(x.double())
    assert relerr(elsa.double()(x.double()), ref) <= 1e-12
    elsa.float()
    assert relerr(elsa(x), ref) <= 1e-5


def test_key_mask_hides_masked_tokens():
    """With a visibility mask, the outputs at visible tokens do not depend on the masked tokens' inputs."""
    torch.manual_seed(2)
    m = (
        ElsaHSIViT(
            24,
            0,
            img_size=6,
            band_group=8,
            spatial_patch=2,
            embed_dim=32,
            num_heads=4,
            branch_depth=2,
            fusion_depth=2,
        )
        .double()
        .eval()
    )
    t = m.embed(torch.randn(3, 24, 6, 6, dtype=torch.float64))  # (B, G=3, S=9, D)
    visible = torch.rand(3, 3, 9) < 0.5
    visible[:, 0, 0] = True
    out = m.forward_tokens(t, visible)
    t2 = torch.where(visible[..., None], t, 1e3 * torch.randn_like(t))
    out2 = m.forward_tokens(t2, visible)
    vis = visible.reshape(3, -1)
    assert relerr(out2[vis], out[vis]) <= 1e-12
    assert relerr(out2[~vis], out[~vis]) > 1e-3  # masked positions themselves do change
    # Without the mask the visible outputs would change: the test can fail.
    assert relerr(m.forward_tokens(t2)[vis], m.forward_tokens(t)[vis]) > 1e-3


def test_patchify_matches_conv3d_token_order():
    """The MAE target layout: token i of ``patchify`` is exactly what the Conv3d kernel of token i sees."""
    torch.manual_seed(3)
    m = ElsaHSIViT(13, 0, img_size=6, band_group=4, spatial_patch=2, **TINY).double()
    x = torch.randn(2, 13, 6, 6, dtype=torch.float64)
    pe = m.patch_embed
    tokens = pe(x).reshape(2, pe.num_groups * pe.num_spatial, -1)
    w = pe.proj.weight.reshape(pe.proj.weight.shape[0], -1)
    assert relerr(pe.patchify(x) @ w.T + pe.proj.bias, tokens) <= 1e-12


def test_center_pool_and_head_reset():
    m = ElsaHSIViT(8, 4, img_size=9, band_group=8, spatial_patch=3, global_pool="center", **TINY).eval()
    x = torch.randn(2, 8, 9, 9)
    feats = m.forward_features(x)
    pooled = m.forward_head(feats, pre_logits=True)
    assert torch.equal(pooled, feats.reshape(2, 1, 9, -1)[:, :, 4].mean(1))
    m.reset_classifier(7)
    assert m(x).shape == (2, 7) and m.config["num_classes"] == 7


def test_forward_intermediates_stages():
    """Stage 0 is the fused branches, then one stage per fusion block; the last normed one is the output."""
    m = ElsaHSIViT(8, 4, img_size=9, **dict(TINY, fusion_depth=2)).eval()
    x = torch.randn(2, 8, 9, 9)
    with torch.no_grad():
        final, stages = m.forward_intermediates(x)
        assert len(stages) == 3 and all(t.shape == (2, 9, 32) for t in stages)
        assert torch.equal(stages[0], m._branches(m.embed(x)))
        assert torch.equal(m.norm(stages[-1]), final) and torch.equal(final, m.forward_features(x))
        early = m.forward_intermediates(x, indices=[1], stop_early=True, norm=True, intermediates_only=True)
        assert len(early) == 1 and torch.equal(early[0], m.norm(stages[1]))
        no_branch = ElsaHSIViT(8, 4, img_size=9, **dict(TINY, branch_depth=0)).eval()
        assert len(no_branch.forward_intermediates(x, intermediates_only=True)) == 1
    with pytest.raises(ValueError, match="output_fmt must be 'NLC'"):
        m.forward_intermediates(x, output_fmt="NCHW")


def test_constructor_and_input_errors():
    with pytest.raises(ValueError, match="img_size \\(9\\) must be a multiple of spatial_patch \\(2\\)"):
        ElsaHSIViT(8, 3, img_size=9, spatial_patch=2)
    with pytest.raises(ValueError, match="attn_impl"), pytest.warns(DeprecationWarning):
        ElsaHSIViT(8, 3, attn_impl="flash")
    with pytest.raises(ValueError, match="embed_dim \\(30\\) must be divisible by num_heads \\(4\\)"):
        ElsaHSIViT(8, 3, embed_dim=30, num_heads=4)
    with pytest.raises(ValueError, match="in_chans must be an int >= 1"):
        ElsaHSIViT(0, 3)
    m = ElsaHSIViT(8, 3, img_size=9, **TINY)
    with pytest.raises(ValueError, match=r"input must be \(B, 8, P, P\), got \(1, 9, 9, 9\)"):
        m(torch.randn(1, 9, 9, 9))
    with pytest.raises(ValueError, match="input patch must be 9x9, got 7x7"):
        m(torch.randn(1, 8, 7, 7))


def test_config_of_older_checkpoints_still_builds():
    """Checkpoints written before ``attn_layer`` hold ``attn_impl`` in the network config: it still builds,
    with a DeprecationWarning, to the same network."""
    from timm.layers import Attention

    new = ElsaHSIViT(8, 3, img_size=9, **TINY)
    with pytest.warns(DeprecationWarning, match="attn_layer"):
        old = ElsaHSIViT(**{**new.config, "attn_impl": "elsa"})
    assert "attn_impl" not in new.config and old.config == new.config
    assert all(isinstance(b.attn, ElsaAttention) for b in old.fusion_blocks)
    with pytest.warns(DeprecationWarning):
        sdpa = ElsaHSIViT(**{**new.config, "attn_impl": "sdpa"})
    assert all(type(b.attn) is Attention for b in sdpa.fusion_blocks)


def test_fx_trace_keeps_the_input_checks():
    """The input checks are an FX leaf: the traced model still refuses a wrong patch with the same error."""
    from timm.models import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor

    m = ElsaHSIViT(8, 3, img_size=9, **TINY).eval()
    fx = create_feature_extractor(m, ["head"], tracer_kwargs=dict(
        leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions()))
    x = torch.randn(2, 8, 9, 9)
    assert torch.equal(fx(x)["head"], m(x))
    with pytest.raises(ValueError, match="input patch must be 9x9, got 7x7"):
        fx(torch.randn(1, 8, 7, 7))


def test_registered_presets():
    names = timm.list_models("elsa_hsi_vit_*")
    assert names == ["elsa_hsi_vit_base", "elsa_hsi_vit_small", "elsa_hsi_vit_tiny"]
    m = timm.create_model("elsa_hsi_vit_tiny", in_chans=30, num_classes=16, img_size=13, spatial_patch=1)
    assert m(torch.randn(2, 30, 13, 13)).shape == (2, 16)
    with torch.device("meta"):
        base = timm.create_model("elsa_hsi_vit_base", in_chans=103, num_classes=9)
    n = sum(p.numel() for p in base.parameters())
    assert 80e6 < n < 95e6, n  # ViT-B-sized: 12 blocks of width 768 (ViT-B/16 has 86M parameters)


def test_mae_decoder_shapes():
    d = HSIMAEDecoder(32, num_tokens=27, out_dim=72, decoder_dim=16, depth=1, num_heads=2)
    z = torch.randn(2, 27, 32)
    visible = torch.rand(2, 27) < 0.5
    assert d(z, visible).shape == (2, 27, 72)
