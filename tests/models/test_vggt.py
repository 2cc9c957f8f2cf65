"""ElsaVGGT: VGGT state_dict layout, checkpoint loading, frame structure (frame 0 distinct, other frames
permutation-equivariant), frame-count agnosticism, token merging, the registry. Its attention (ElsaAttention
with RoPE2D) is tested in tests/layers/test_rope.py."""


import pytest
import torch

from elsa_vision.layers import ElsaAttention
from elsa_vision.models import ElsaVGGT
from elsa_vision.models.vggt import (
    VGGT_CONFIGS,
    TokenMerge,
    load_vggt_state_dict,
)
from tests.helpers import emulate_cuda_autocast_layer_norm

# The test configuration: dim 32, depth 2, 2 heads, 4 registers, 28 px / patch 14, a 1-block DINOv2 patch
# embed, camera trunk depth 1, DPT features 16 with out_channels (8, 16, 32, 32), point head enabled.
SMALL = dict(
    img_size=28,
    patch_size=14,
    embed_dim=32,
    depth=2,
    num_heads=2,
    num_register_tokens=4,
    patch_embed="dinov2",
    patch_embed_depth=1,
    camera_trunk_depth=1,
    camera_num_heads=2,
    dpt_features=16,
    dpt_out_channels=(8, 16, 32, 32),
    intermediate_layer_idx=(0, 1, 1, 1),
    enable_point=True,
)

# Key names and shapes of facebookresearch/vggt's VGGT (aggregator with a DINOv2 ViT patch embed, camera head,
# point and depth DPT heads; track head excluded) for the configuration SMALL, written out from the VGGT
# sources: models/aggregator.py, layers/{block,attention,vision_transformer,layer_scale,mlp}.py,
# heads/{camera_head,dpt_head}.py.
VGGT_SMALL_KEYS = """
aggregator.camera_token 1,2,1,32
aggregator.frame_blocks.0.attn.k_norm.bias 16
aggregator.frame_blocks.0.attn.k_norm.weight 16
aggregator.frame_blocks.0.attn.proj.bias 32
aggregator.frame_blocks.0.attn.proj.weight 32,32
aggregator.frame_blocks.0.attn.q_norm.bias 16
aggregator.frame_blocks.0.attn.q_norm.weight 16
aggregator.frame_blocks.0.attn.qkv.bias 96
aggregator.frame_blocks.0.attn.qkv.weight 96,32
aggregator.frame_blocks.0.ls1.gamma 32
aggregator.frame_blocks.0.ls2.gamma 32
aggregator.frame_blocks.0.mlp.fc1.bias 128
aggregator.frame_blocks.0.mlp.fc1.weight 128,32
aggregator.frame_blocks.0.mlp.fc2.bias 32
aggregator.frame_blocks.0.mlp.fc2.weight 32,128
aggregator.frame_blocks.0.norm1.bias 32
aggregator.frame_blocks.0.norm1.weight 32
aggregator.frame_blocks.0.norm2.bias 32
aggregator.frame_blocks.0.norm2.weight 32
aggregator.frame_blocks.1.attn.k_norm.bias 16
aggregator.frame_blocks.1.attn.k_norm.weight 16
aggregator.frame_blocks.1.attn.proj.bias 32
aggregator.frame_blocks.1.attn.proj.weight 32,32
aggregator.frame_blocks.1.attn.q_norm.bias 16
aggregator.frame_blocks.1.attn.q_norm.weight 16
aggregator.frame_blocks.1.attn.qkv.bias 96
aggregator.frame_blocks.1.attn.qkv.weight 96,32
aggregator.frame_blocks.1.ls1.gamma 32
aggregator.frame_blocks.1.ls2.gamma 32
aggregator.frame_blocks.1.mlp.fc1.bias 128
aggregator.frame_blocks.1.mlp.fc1.weight 128,32
aggregator.frame_blocks.1.mlp.fc2.bias 32
aggregator.frame_blocks.1.mlp.fc2.weight 32,128
aggregator.frame_blocks.1.norm1.bias 32
aggregator.frame_blocks.1.norm1.weight 32
aggregator.frame_blocks.1.norm2.bias 32
aggregator.frame_blocks.1.norm2.weight 32
aggregator.global_blocks.0.attn.k_norm.bias 16
aggregator.global_blocks.0.attn.k_norm.weight 16
aggregator.global_blocks.0.attn.proj.bias 32
aggregator.global_blocks.0.attn.proj.weight 32,32
aggregator.global_blocks.0.attn.q_norm.bias 16
aggregator.global_blocks.0.attn.q_norm.weight 16
aggregator.global_blocks.0.attn.qkv.bias 96
aggregator.global_blocks.0.attn.qkv.weight 96,32
aggregator.global_blocks.0.ls1.gamma 32
aggregator.global_blocks.0.ls2.gamma 32
aggregator.global_blocks.0.mlp.fc1.bias 128
aggregator.global_blocks.0.mlp.fc1.weight 128,32
aggregator.global_blocks.0.mlp.fc2.bias 32
aggregator.global_blocks.0.mlp.fc2.weight 32,128
aggregator.global_blocks.0.norm1.bias 32
aggregator.global_blocks.0.norm1.weight 32
aggregator.global_blocks.0.norm2.bias 32
aggregator.global_blocks.0.norm2.weight 32
aggregator.global_blocks.1.attn.k_norm.bias 16
aggregator.global_blocks.1.attn.k_norm.weight 16
aggregator.global_blocks.1.attn.proj.bias 32
aggregator.global_blocks.1.attn.proj.weight 32,32
aggregator.global_blocks.1.attn.q_norm.bias 16
aggregator.global_blocks.1.attn.q_norm.weight 16
aggregator.global_blocks.1.attn.qkv.bias 96
aggregator.global_blocks.1.attn.qkv.weight 96,32
aggregator.global_blocks.1.ls1.gamma 32
aggregator.global_blocks.1.ls2.gamma 32
aggregator.global_blocks.1.mlp.fc1.bias 128
aggregator.global_blocks.1.mlp.fc1.weight 128,32
aggregator.global_blocks.1.mlp.fc2.bias 32
aggregator.global_blocks.1.mlp.fc2.weight 32,128
aggregator.global_blocks.1.norm1.bias 32
aggregator.global_blocks.1.norm1.weight 32
aggregator.global_blocks.1.norm2.bias 32
aggregator.global_blocks.1.norm2.weight 32
aggregator.patch_embed.blocks.0.attn.proj.bias 32
aggregator.patch_embed.blocks.0.attn.proj.weight 32,32
aggregator.patch_embed.blocks.0.attn.qkv.bias 96
aggregator.patch_embed.blocks.0.attn.qkv.weight 96,32
aggregator.patch_embed.blocks.0.ls1.gamma 32
aggregator.patch_embed.blocks.0.ls2.gamma 32
aggregator.patch_embed.blocks.0.mlp.fc1.bias 128
aggregator.patch_embed.blocks.0.mlp.fc1.weight 128,32
aggregator.patch_embed.blocks.0.mlp.fc2.bias 32
aggregator.patch_embed.blocks.0.mlp.fc2.weight 32,128
aggregator.patch_embed.blocks.0.norm1.bias 32
aggregator.patch_embed.blocks.0.norm1.weight 32
aggregator.patch_embed.blocks.0.norm2.bias 32
aggregator.patch_embed.blocks.0.norm2.weight 32
aggregator.patch_embed.cls_token 1,1,32
aggregator.patch_embed.mask_token 1,32
aggregator.patch_embed.norm.bias 32
aggregator.patch_embed.norm.weight 32
aggregator.patch_embed.patch_embed.proj.bias 32
aggregator.patch_embed.patch_embed.proj.weight 32,3,14,14
aggregator.patch_embed.pos_embed 1,5,32
aggregator.patch_embed.register_tokens 1,4,32
aggregator.register_token 1,2,4,32
camera_head.embed_pose.bias 64
camera_head.embed_pose.weight 64,9
camera_head.empty_pose_tokens 1,1,9
camera_head.poseLN_modulation.1.bias 192
camera_head.poseLN_modulation.1.weight 192,64
camera_head.pose_branch.fc1.bias 32
camera_head.pose_branch.fc1.weight 32,64
camera_head.pose_branch.fc2.bias 9
camera_head.pose_branch.fc2.weight 9,32
camera_head.token_norm.bias 64
camera_head.token_norm.weight 64
camera_head.trunk.0.attn.proj.bias 64
camera_head.trunk.0.attn.proj.weight 64,64
camera_head.trunk.0.attn.qkv.bias 192
camera_head.trunk.0.attn.qkv.weight 192,64
camera_head.trunk.0.ls1.gamma 64
camera_head.trunk.0.ls2.gamma 64
camera_head.trunk.0.mlp.fc1.bias 256
camera_head.trunk.0.mlp.fc1.weight 256,64
camera_head.trunk.0.mlp.fc2.bias 64
camera_head.trunk.0.mlp.fc2.weight 64,256
camera_head.trunk.0.norm1.bias 64
camera_head.trunk.0.norm1.weight 64
camera_head.trunk.0.norm2.bias 64
camera_head.trunk.0.norm2.weight 64
camera_head.trunk_norm.bias 64
camera_head.trunk_norm.weight 64
depth_head.norm.bias 64
depth_head.norm.weight 64
depth_head.projects.0.bias 8
depth_head.projects.0.weight 8,64,1,1
depth_head.projects.1.bias 16
depth_head.projects.1.weight 16,64,1,1
depth_head.projects.2.bias 32
depth_head.projects.2.weight 32,64,1,1
depth_head.projects.3.bias 32
depth_head.projects.3.weight 32,64,1,1
depth_head.resize_layers.0.bias 8
depth_head.resize_layers.0.weight 8,8,4,4
depth_head.resize_layers.1.bias 16
depth_head.resize_layers.1.weight 16,16,2,2
depth_head.resize_layers.3.bias 32
depth_head.resize_layers.3.weight 32,32,3,3
depth_head.scratch.layer1_rn.weight 16,8,3,3
depth_head.scratch.layer2_rn.weight 16,16,3,3
depth_head.scratch.layer3_rn.weight 16,32,3,3
depth_head.scratch.layer4_rn.weight 16,32,3,3
depth_head.scratch.output_conv1.bias 8
depth_head.scratch.output_conv1.weight 8,16,3,3
depth_head.scratch.output_conv2.0.bias 32
depth_head.scratch.output_conv2.0.weight 32,8,3,3
depth_head.scratch.output_conv2.2.bias 2
depth_head.scratch.output_conv2.2.weight 2,32,1,1
depth_head.scratch.refinenet1.out_conv.bias 16
depth_head.scratch.refinenet1.out_conv.weight 16,16,1,1
depth_head.scratch.refinenet1.resConfUnit1.conv1.bias 16
depth_head.scratch.refinenet1.resConfUnit1.conv1.weight 16,16,3,3
depth_head.scratch.refinenet1.resConfUnit1.conv2.bias 16
depth_head.scratch.refinenet1.resConfUnit1.conv2.weight 16,16,3,3
depth_head.scratch.refinenet1.resConfUnit2.conv1.bias 16
depth_head.scratch.refinenet1.resConfUnit2.conv1.weight 16,16,3,3
depth_head.scratch.refinenet1.resConfUnit2.conv2.bias 16
depth_head.scratch.refinenet1.resConfUnit2.conv2.weight 16,16,3,3
depth_head.scratch.refinenet2.out_conv.bias 16
depth_head.scratch.refinenet2.out_conv.weight 16,16,1,1
depth_head.scratch.refinenet2.resConfUnit1.conv1.bias 16
depth_head.scratch.refinenet2.resConfUnit1.conv1.weight 16,16,3,3
depth_head.scratch.refinenet2.resConfUnit1.conv2.bias 16
depth_head.scratch.refinenet2.resConfUnit1.conv2.weight 16,16,3,3
depth_head.scratch.refinenet2.resConfUnit2.conv1.bias 16
depth_head.scratch.refinenet2.resConfUnit2.conv1.weight 16,16,3,3
depth_head.scratch.refinenet2.resConfUnit2.conv2.bias 16
depth_head.scratch.refinenet2.resConfUnit2.conv2.weight 16,16,3,3
depth_head.scratch.refinenet3.out_conv.bias 16
depth_head.scratch.refinenet3.out_conv.weight 16,16,1,1
depth_head.scratch.refinenet3.resConfUnit1.conv1.bias 16
depth_head.scratch.refinenet3.resConfUnit1.conv1.weight 16,16,3,3
depth_head.scratch.refinenet3.resConfUnit1.conv2.bias 16
depth_head.scratch.refinenet3.resConfUnit1.conv2.weight 16,16,3,3
depth_head.scratch.refinenet3.resConfUnit2.conv1.bias 16
depth_head.scratch.refinenet3.resConfUnit2.conv1.weight 16,16,3,3
depth_head.scratch.refinenet3.resConfUnit2.conv2.bias 16
depth_head.scratch.refinenet3.resConfUnit2.conv2.weight 16,16,3,3
depth_head.scratch.refinenet4.out_conv.bias 16
depth_head.scratch.refinenet4.out_conv.weight 16,16,1,1
depth_head.scratch.refinenet4.resConfUnit2.conv1.bias 16
depth_head.scratch.refinenet4.resConfUnit2.conv1.weight 16,16,3,3
depth_head.scratch.refinenet4.resConfUnit2.conv2.bias 16
depth_head.scratch.refinenet4.resConfUnit2.conv2.weight 16,16,3,3
point_head.norm.bias 64
point_head.norm.weight 64
point_head.projects.0.bias 8
point_head.projects.0.weight 8,64,1,1
point_head.projects.1.bias 16
point_head.projects.1.weight 16,64,1,1
point_head.projects.2.bias 32
point_head.projects.2.weight 32,64,1,1
point_head.projects.3.bias 32
point_head.projects.3.weight 32,64,1,1
point_head.resize_layers.0.bias 8
point_head.resize_layers.0.weight 8,8,4,4
point_head.resize_layers.1.bias 16
point_head.resize_layers.1.weight 16,16,2,2
point_head.resize_layers.3.bias 32
point_head.resize_layers.3.weight 32,32,3,3
point_head.scratch.layer1_rn.weight 16,8,3,3
point_head.scratch.layer2_rn.weight 16,16,3,3
point_head.scratch.layer3_rn.weight 16,32,3,3
point_head.scratch.layer4_rn.weight 16,32,3,3
point_head.scratch.output_conv1.bias 8
point_head.scratch.output_conv1.weight 8,16,3,3
point_head.scratch.output_conv2.0.bias 32
point_head.scratch.output_conv2.0.weight 32,8,3,3
point_head.scratch.output_conv2.2.bias 4
point_head.scratch.output_conv2.2.weight 4,32,1,1
point_head.scratch.refinenet1.out_conv.bias 16
point_head.scratch.refinenet1.out_conv.weight 16,16,1,1
point_head.scratch.refinenet1.resConfUnit1.conv1.bias 16
point_head.scratch.refinenet1.resConfUnit1.conv1.weight 16,16,3,3
point_head.scratch.refinenet1.resConfUnit1.conv2.bias 16
point_head.scratch.refinenet1.resConfUnit1.conv2.weight 16,16,3,3
point_head.scratch.refinenet1.resConfUnit2.conv1.bias 16
point_head.scratch.refinenet1.resConfUnit2.conv1.weight 16,16,3,3
point_head.scratch.refinenet1.resConfUnit2.conv2.bias 16
point_head.scratch.refinenet1.resConfUnit2.conv2.weight 16,16,3,3
point_head.scratch.refinenet2.out_conv.bias 16
point_head.scratch.refinenet2.out_conv.weight 16,16,1,1
point_head.scratch.refinenet2.resConfUnit1.conv1.bias 16
point_head.scratch.refinenet2.resConfUnit1.conv1.weight 16,16,3,3
point_head.scratch.refinenet2.resConfUnit1.conv2.bias 16
point_head.scratch.refinenet2.resConfUnit1.conv2.weight 16,16,3,3
point_head.scratch.refinenet2.resConfUnit2.conv1.bias 16
point_head.scratch.refinenet2.resConfUnit2.conv1.weight 16,16,3,3
point_head.scratch.refinenet2.resConfUnit2.conv2.bias 16
point_head.scratch.refinenet2.resConfUnit2.conv2.weight 16,16,3,3
point_head.scratch.refinenet3.out_conv.bias 16
point_head.scratch.refinenet3.out_conv.weight 16,16,1,1
point_head.scratch.refinenet3.resConfUnit1.conv1.bias 16
point_head.scratch.refinenet3.resConfUnit1.conv1.weight 16,16,3,3
point_head.scratch.refinenet3.resConfUnit1.conv2.bias 16
point_head.scratch.refinenet3.resConfUnit1.conv2.weight 16,16,3,3
point_head.scratch.refinenet3.resConfUnit2.conv1.bias 16
point_head.scratch.refinenet3.resConfUnit2.conv1.weight 16,16,3,3
point_head.scratch.refinenet3.resConfUnit2.conv2.bias 16
point_head.scratch.refinenet3.resConfUnit2.conv2.weight 16,16,3,3
point_head.scratch.refinenet4.out_conv.bias 16
point_head.scratch.refinenet4.out_conv.weight 16,16,1,1
point_head.scratch.refinenet4.resConfUnit2.conv1.bias 16
point_head.scratch.refinenet4.resConfUnit2.conv1.weight 16,16,3,3
point_head.scratch.refinenet4.resConfUnit2.conv2.bias 16
point_head.scratch.refinenet4.resConfUnit2.conv2.weight 16,16,3,3"""


def _expected_layout() -> dict[str, tuple[int, ...]]:
    out = {}
    for line in VGGT_SMALL_KEYS.strip().splitlines():
        name, shape = line.split()
        out[name] = tuple(int(s) for s in shape.split(","))
    return out


def _small(**kw) -> ElsaVGGT:
    return ElsaVGGT(**{**SMALL, **kw}).eval()


def test_state_dict_layout_equals_vggt():
    expected = _expected_layout()
    assert len(expected) == 247
    got = {k: tuple(v.shape) for k, v in _small().state_dict().items()}
    assert sorted(set(expected) - set(got)) == []
    assert sorted(set(got) - set(expected)) == []
    mismatched = {k: (got[k], expected[k]) for k in expected if got[k] != expected[k]}
    assert mismatched == {}


def test_vggt_1b_layout_on_meta():
    with torch.device("meta"):
        model = ElsaVGGT.from_config("elsa_vggt")
    sd = model.state_dict()
    # facts of the released VGGT-1B checkpoint layout
    assert tuple(sd["aggregator.patch_embed.pos_embed"].shape) == (1, 1 + 37 * 37, 1024)
    assert tuple(sd["aggregator.patch_embed.patch_embed.proj.weight"].shape) == (1024, 3, 14, 14)
    assert tuple(sd["aggregator.register_token"].shape) == (1, 2, 4, 1024)
    assert tuple(sd["aggregator.global_blocks.23.attn.q_norm.weight"].shape) == (64,)
    assert tuple(sd["camera_head.trunk.3.attn.qkv.weight"].shape) == (6144, 2048)
    assert tuple(sd["depth_head.projects.3.weight"].shape) == (1024, 2048, 1, 1)
    assert tuple(sd["depth_head.scratch.output_conv2.2.weight"].shape) == (2, 32, 1, 1)
    assert (
        "aggregator.patch_embed.blocks.23.ls2.gamma" in sd
        and "aggregator.frame_blocks.24.norm1.weight" not in sd
    )
    n_agg = sum(v.numel() for k, v in sd.items() if k.startswith("aggregator."))
    # 24 DINOv2 ViT-L blocks + 48 aggregator blocks of ~12.6M parameters each, plus embeddings
    assert 0.90e9 < n_agg < 0.93e9, n_agg


@pytest.mark.parametrize("fmt", ["safetensors", "pt"])
def test_from_vggt_checkpoint_strict_and_drops_track_head(tmp_path, fmt):
    src = _small()
    sd = {k: torch.randn_like(v) for k, v in src.state_dict().items()}
    track = {
        "track_head.feature_extractor.norm.weight": torch.randn(64),
        "track_head.tracker.corr_mlp.fc1.weight": torch.randn(8, 4),
    }
    path = tmp_path / f"model.{fmt}"
    if fmt == "safetensors":
        from safetensors.torch import save_file

        save_file({**sd, **track}, str(path))
    else:
        torch.save({"model": {**sd, **track}}, path)
    model = ElsaVGGT.from_vggt_checkpoint(path, config="elsa_vggt_small", **{k: v for k, v in SMALL.items()})
    assert sorted(model.dropped_checkpoint_keys) == sorted(track)
    for k, v in model.state_dict().items():
        assert torch.equal(v, sd[k]), k


def test_checkpoint_pos_embed_resampled_for_other_resolution(tmp_path):
    sd = _small().state_dict()
    from safetensors.torch import save_file

    save_file(sd, str(tmp_path / "m.safetensors"))
    model = ElsaVGGT.from_vggt_checkpoint(
        tmp_path / "m.safetensors", config="elsa_vggt_small", **{**SMALL, "img_size": 42}
    )
    assert tuple(model.aggregator.patch_embed.pos_embed.shape) == (1, 10, 32)
    assert torch.equal(
        model.aggregator.patch_embed.pos_embed[:, 0], sd["aggregator.patch_embed.pos_embed"][:, 0]
    )


def test_from_vggt_checkpoint_reads_the_config_from_the_weights(tmp_path):
    from safetensors.torch import save_file

    from elsa_vision.models.vggt import find_vggt_config

    src = ElsaVGGT.from_config("elsa_vggt_small")
    save_file(src.state_dict(), str(tmp_path / "net.safetensors"))
    model = ElsaVGGT.from_vggt_checkpoint(tmp_path / "net.safetensors")
    assert model.config == src.config
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in model.state_dict().items())
    with torch.device("meta"):
        assert find_vggt_config(ElsaVGGT.from_config("elsa_vggt").state_dict()) == "elsa_vggt"
    narrow = ElsaVGGT.from_config("elsa_vggt_small", embed_dim=32).state_dict()  # same keys, other shapes
    with pytest.raises(ValueError, match=r"^x fits no ElsaVGGT config \(elsa_vggt: \d+ missing keys, e\.g\. "
                                         r".*; elsa_vggt_small: aggregator\.camera_token is \[1, 2, 1, 32\], "
                                         r"the config's is \[1, 2, 1, 48\]\)$"):
        find_vggt_config(narrow, "x")


def test_load_rejects_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^checkpoint: '.*nope\.pt' does not exist"):
        load_vggt_state_dict(tmp_path / "nope.pt")
    with pytest.raises(FileNotFoundError, match=r"^--weights: '.*nope\.pt' does not exist"):
        load_vggt_state_dict(tmp_path / "nope.pt", arg="--weights")


def test_forward_shapes_frame_agnostic_and_rectangular():
    model = _small()
    for S in (1, 2, 5):
        with torch.no_grad():
            out = model(torch.rand(2, S, 3, 28, 42))
        assert out["pose_enc"].shape == (2, S, 9)
        assert len(out["pose_enc_list"]) == 4
        assert out["depth"].shape == (2, S, 28, 42, 1) and out["depth_conf"].shape == (2, S, 28, 42)
        assert out["world_points"].shape == (2, S, 28, 42, 3)
        assert bool((out["depth"] > 0).all()) and bool((out["depth_conf"] > 1).all())
        assert bool((out["pose_enc"][..., 7:] >= 0).all())  # FoV through relu
    with pytest.raises(ValueError, match="multiples of patch_size"):
        model(torch.rand(1, 2, 3, 28, 30))


def _randomize(model):
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return model


def test_reference_frame_is_distinct_and_other_frames_are_equivariant():
    model = _randomize(_small(patch_embed="conv"))
    x = torch.rand(1, 4, 3, 28, 28)
    perm = torch.tensor([0, 3, 1, 2])
    with torch.no_grad():
        a = model(x)
        b = model(x[:, perm])
        c = model(x[:, torch.tensor([1, 0, 2, 3])])
    # permuting frames 1..S-1 permutes every output the same way (global attention is set attention)
    for key in ("pose_enc", "depth", "depth_conf"):
        assert torch.isfinite(a[key]).all()
        rel = (b[key] - a[key][:, perm]).norm() / a[key].norm()
        assert rel <= 1e-5, (key, float(rel))
    # exchanging the reference frame changes the result (frame 0 has its own camera/register tokens)
    assert (c["pose_enc"][:, 1] - a["pose_enc"][:, 0]).abs().max() > 1e-3


def test_global_attention_mixes_frames_and_frame_attention_does_not():
    model = _randomize(_small(patch_embed="conv", depth=1, intermediate_layer_idx=(0, 0, 0, 0)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma"):
                p.fill_(1.0)
    x = torch.rand(1, 3, 3, 28, 28)
    x2 = x.clone()
    x2[:, 2] = torch.rand(3, 28, 28)
    with torch.no_grad():
        ta, _ = model.aggregator(x)
        tb, _ = model.aggregator(x2)
    C = 32
    frame_a, frame_b = ta[0][..., :C], tb[0][..., :C]
    glob_a, glob_b = ta[0][..., C:], tb[0][..., C:]
    assert torch.equal(frame_a[:, :2], frame_b[:, :2])  # frame block: frames 0, 1 untouched by frame 2
    assert (
        glob_a[:, :2] - glob_b[:, :2]
    ).abs().max() > 1e-4  # global block: they see frame 2 (fp32 noise ~1e-7)


def test_token_merging_is_opt_in_and_routes_to_most_similar():
    tm = TokenMerge(num_frames=3, tokens_per_frame=7, patch_start_idx=1, ratio=0.5)
    # frame 0 and the special tokens are destinations; half of the other patch tokens are merged
    assert set(range(7)).issubset(set(tm.dst.tolist())) and {7, 14}.issubset(set(tm.dst.tolist()))
    assert len(tm.src) == 6 and len(tm.dst) == 15
    x = torch.randn(2, 21, 16)
    x[:, tm.src] = x[:, tm.dst[:6]] * 3.0  # each source is a scaled copy of one destination
    merged, _, assign = tm.merge(x, None)
    assert torch.equal(assign, torch.arange(6).expand(2, 6))
    assert torch.allclose(merged[:, :6], 2.0 * x[:, tm.dst[:6]])  # mean of d and 3d
    y = tm.unmerge(merged, assign, 21)
    assert torch.equal(y[:, tm.src], merged[:, :6])
    exact = _randomize(_small(patch_embed="conv"))
    approx = _small(patch_embed="conv", merge_ratio=0.5)
    approx.load_state_dict(exact.state_dict())
    x = torch.rand(1, 3, 3, 28, 28)
    with torch.no_grad():
        a, b = exact(x), approx(x)
    assert b["depth"].shape == a["depth"].shape and torch.isfinite(b["depth"]).all()
    assert not torch.equal(a["depth"], b["depth"])  # merging is approximate
    with pytest.raises(ValueError, match="merge_ratio"):
        _small(merge_ratio=1.0)


def test_configs_and_bad_arguments():
    assert VGGT_CONFIGS["elsa_vggt"]["embed_dim"] == 1024 and VGGT_CONFIGS["elsa_vggt"]["depth"] == 24
    assert VGGT_CONFIGS["elsa_vggt"]["num_heads"] == 16 and VGGT_CONFIGS["elsa_vggt"]["img_size"] == 518
    with pytest.raises(ValueError, match="unknown ElsaVGGT config"):
        ElsaVGGT.from_config("vggt_huge")
    with pytest.raises(ValueError, match="patch_embed"):
        _small(patch_embed="resnet")
    with pytest.raises(ValueError, match="intermediate_layer_idx"):
        _small(intermediate_layer_idx=(0, 1, 2, 5))
    with pytest.raises(ValueError, match="images"):
        _small()(torch.rand(1, 2, 4, 28, 28))
    model = _small()
    model.set_attention(backend="torch", precision="ieee")
    attns = [m for m in model.modules() if isinstance(m, ElsaAttention)]
    assert attns and all(m.backend == "torch" and m.precision == "ieee" for m in attns)
    with pytest.raises(ValueError, match="unknown backend"):
        model.set_attention(backend="cuda")


def test_configurations_are_named_and_not_timm_models(tmp_path):
    """Each configuration is listed once: ``VGGT_CONFIGS`` is a read-only view of the arguments
    ``ElsaVGGT.from_config`` builds with. ElsaVGGT is a multi-frame reconstruction model, not an image model:
    it is not in timm's registry (whose every name must pass timm's image-model tests), and
    ``from_vggt_checkpoint`` is its local-weights path."""
    import timm
    from safetensors.torch import save_file

    assert sorted(VGGT_CONFIGS) == ["elsa_vggt", "elsa_vggt_small"]
    assert timm.list_models("*vggt*") == [] and not timm.is_model("elsa_vggt_small")
    with pytest.raises(TypeError):
        VGGT_CONFIGS["elsa_vggt"]["depth"] = 2
    torch.manual_seed(0)
    src = ElsaVGGT.from_config("elsa_vggt_small")
    assert {k: src.config[k] for k in VGGT_CONFIGS["elsa_vggt_small"]} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in VGGT_CONFIGS["elsa_vggt_small"].items()}
    shallow = ElsaVGGT.from_config("elsa_vggt_small", depth=2, intermediate_layer_idx=(0, 1, 1, 1))
    assert shallow.config["depth"] == 2
    sd = dict(src.state_dict(), **{"track_head.w": torch.zeros(2)})
    save_file(sd, str(tmp_path / "w.safetensors"))
    loaded = ElsaVGGT.from_vggt_checkpoint(tmp_path / "w.safetensors")
    assert loaded.dropped_checkpoint_keys == ["track_head.w"]
    assert all(torch.equal(v, src.state_dict()[k]) for k, v in loaded.state_dict().items())


def test_chunked_inference_equals_the_plain_forward():
    """Frames chunked through the patch embedding and frame blocks, MLPs over token chunks, heads over frame
    chunks: every output of an FP32 no-grad forward is within 1e-6 of the plain forward, whichever the chunk
    sizes (odd ones included); with autograd the chunks are not used."""
    model = _randomize(_small())
    x = torch.rand(2, 5, 3, 28, 42, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model(x)
        for frames, tokens, heads in ((1, None, 8), (3, 7, 2), (4, 1, 1), (None, 11, 3), (64, 4096, 64)):
            model.set_chunks(frames=frames, tokens=tokens)
            for h in (model.depth_head, model.point_head):
                h.frames_chunk_size = heads
            out = model(x)
            for key in ("pose_enc", "depth", "depth_conf", "world_points", "world_points_conf"):
                err = ((out[key] - ref[key]).norm() / ref[key].norm()).item()
                assert err < 1e-6, (frames, tokens, heads, key, err)
            for a, b in zip(out["pose_enc_list"], ref["pose_enc_list"]):
                assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)
    # gradients: the chunked paths step aside (in-place writes would not be differentiable)
    model.set_chunks(frames=1, tokens=3)
    model(x[:, :2])["depth"].sum().backward()
    assert model.aggregator.frame_blocks[0].mlp.fc1.weight.grad is not None
    model.set_chunks()
    assert model.aggregator.frames_chunk is None
    assert all(b.token_chunk is None for b in model.aggregator.global_blocks)


@pytest.mark.parametrize("bad", [0, -1, 2.5, True])
def test_set_chunks_refuses_bad_sizes(bad):
    with pytest.raises(ValueError, match="set_chunks"):
        _small().set_chunks(frames=bad)
    with pytest.raises(ValueError, match="set_chunks"):
        _small().set_chunks(tokens=bad)


def test_bf16_autocast_with_float32_layer_norm(monkeypatch):
    """CUDA autocast computes ``layer_norm`` in float32 and returns float32 (the CPU's keeps bfloat16): the
    q/k norms must still hand ``elsa_attention`` q, k, v of one dtype. The CUDA policy is emulated on the CPU
    by a float32 ``F.layer_norm``; the forward runs, every attention sees bfloat16 q, k, v, outputs are
    finite and near the FP32 forward."""
    model = _randomize(_small())
    model.set_attention(backend="torch")
    x = torch.rand(1, 3, 3, 28, 42, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        ref = model(x)
    seen = emulate_cuda_autocast_layer_norm(monkeypatch)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        # the emulated policy holds: a q/k norm returns float32 (ElsaAttention casts q, k back to v's dtype)
        assert model.aggregator.frame_blocks[0].attn.q_norm(torch.ones(2, 16, dtype=torch.bfloat16)).dtype \
            == torch.float32
        out = model(x)
    assert seen and all(len(set(d)) == 1 for d in seen), seen
    assert any(d == (torch.bfloat16,) * 3 for d in seen)
    for key in ("pose_enc", "depth", "depth_conf"):
        assert torch.isfinite(out[key]).all(), key
        err = ((out[key].float() - ref[key]).norm() / ref[key].norm()).item()
        assert err < 0.1, (key, err)
