"""High-resolution inference: CLI end to end on CPU with a tiny ViT, parity with timm's stock model, the
query-chunked and tiled paths, and bad inputs."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import load_file

import elsa_vision  # noqa: F401
from elsa_vision.inference.highres import (
    Plan,
    build_model,
    forward_tokens,
    plan_execution,
    resolve_model_name,
    run_plan,
    tile_starts,
)
from elsa_vision.inference.image import main
from tests.helpers import relerr

pydicom = pytest.importorskip("pydicom")
tifffile = pytest.importorskip("tifffile")
nib = pytest.importorskip("nibabel")
from PIL import Image  # noqa: E402

TINY = "elsa_vit_tiny_patch16_224"
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _ct_small():
    from pydicom.data import get_testdata_file

    return get_testdata_file("CT_small.dcm", download=False)


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    """Random tiny-ViT weights: 1 input channel, 7 classes, trained-size (224) position embeddings."""
    d = tmp_path_factory.mktemp("w")
    w1 = str(d / "tiny_gray.safetensors")
    main(
        [
            "--save-random-weights",
            w1,
            "--model",
            "elsa_vit_t_patch16",
            "--in-chans",
            "1",
            "--num-classes",
            "7",
        ]
    )
    w3 = str(d / "tiny_rgb.pth")
    torch.manual_seed(1)
    m = timm.create_model(TINY, num_classes=5, in_chans=3)
    torch.save(m.state_dict(), w3)
    return {"gray": w1, "rgb": w3}


def _strict_json(text: str):
    """JSON as the standard defines it: a bare NaN / Infinity (Python's json extension) fails the test."""

    def reject(constant):
        raise AssertionError(f"not valid JSON: bare {constant}")

    return json.loads(text, parse_constant=reject)


def _outputs(out):
    with open(os.path.join(out, "report.json")) as f:
        report = _strict_json(f.read())
    with open(os.path.join(out, "prediction.json")) as f:
        pred = _strict_json(f.read())
    feats = load_file(os.path.join(out, "features.safetensors"))
    assert os.path.getsize(os.path.join(out, "overlay.png")) > 0
    return report, pred, feats


def _check_consistent(report, pred, feats, num_classes, embed_dim=192):
    C, h, w = feats["features"].shape
    assert C == embed_dim and [h, w] == report["grid"]
    assert report["tokens"] == h * w + 1  # + cls
    assert feats["cls"].shape == (embed_dim,) and torch.equal(feats["prefix"][0], feats["cls"])
    assert torch.isfinite(feats["features"]).all()
    probs = np.asarray(pred["probabilities"])
    assert probs.shape == (num_classes,) and abs(probs.sum() - 1.0) < 1e-6 and (probs >= 0).all()
    assert len(pred["top5"]) == min(5, num_classes)
    assert pred["top5"][0]["probability"] == pytest.approx(probs.max())
    for k in ("tokens", "seconds", "peak_memory_mb", "precision", "tiled"):
        assert k in report
    assert report["seconds"] > 0 and report["peak_memory_mb"] > 0


def test_cli_subprocess_ct_small_compare_sdpa(weights, tmp_path):
    out = tmp_path / "ct"
    env = dict(
        os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elsa_vision.inference.image",
            "--model",
            "elsa_vit_t_patch16",
            "--weights",
            weights["gray"],
            "--input",
            _ct_small(),
            "--img-size",
            "96",
            "--compare-sdpa",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    summary = _strict_json(r.stdout.strip().splitlines()[-1])
    assert "compare-sdpa: max deviation" in r.stdout and "speed ratio" in r.stdout
    report, pred, feats = _outputs(out)
    _check_consistent(report, pred, feats, 7)
    assert summary["tokens"] == report["tokens"] == 37 and summary["tiled"] is False
    assert report["precision"] == "fp32" and report["mode"] == "whole" and report["global_attention"]
    assert report["max_deviation_vs_sdpa"] < 1e-5
    assert report["sdpa_seconds"] > 0 and report["speed_ratio"] > 0
    if torch.cuda.is_available():  # the subprocess runs on the GPU: its peak memory is measured
        assert report["sdpa_peak_memory_mb"] > 0
    else:
        assert report["sdpa_peak_memory_mb"] is None  # not measured on the CPU: null, not NaN
    assert report["reader"]["rescale_intercept"] == -1024.0
    assert report["random_weights"] is True and "randomly initialised weights" in r.stderr
    with Image.open(out / "overlay.png") as im:
        assert im.size == (96, 96) and im.mode == "RGB"


def _models(name, img, num_classes=6, in_chans=1, seed=0):
    torch.manual_seed(seed)
    sd = timm.create_model(name, num_classes=num_classes, in_chans=in_chans).state_dict()
    sd = {k: v + 0.02 * torch.randn_like(v) for k, v in sd.items()}  # non-trivial biases / layer scales
    elsa = build_model(name, sd, img, attn_backend="torch")
    stock = build_model(name, sd, img, stock=True)
    return elsa, stock


@pytest.mark.parametrize("name,img", [(TINY, (96, 80)), ("elsa_vit_base_patch14_reg4_dinov2", (42, 56))])
def test_forward_matches_stock_timm_and_float64(name, img):
    elsa, stock = _models(name, img)
    x = torch.randn(1, 1, *img)
    with torch.no_grad():
        ref64 = stock.double().forward_features(x.double())
        stock.float()
        ref32 = stock.forward_features(x)
        out = forward_tokens(elsa, x)
        mlps = [blk.mlp for blk in elsa.blocks]
        rows = []
        hook = mlps[0].fc1.register_forward_pre_hook(lambda m, args: rows.append(args[0].shape[1]))
        out_chunked = forward_tokens(elsa, x, query_chunk=7)
        hook.remove()
    # the MLP ran over 7 tokens at a time, every token once; the blocks have their own MLPs back
    assert max(rows) == 7 and sum(rows) == out.shape[1]
    assert [blk.mlp for blk in elsa.blocks] == mlps
    assert out.shape == ref32.shape
    assert (out - ref32).abs().max().item() < 1e-5  # vs timm's stock SDPA model, FP32
    assert relerr(out, ref64) <= 1e-6  # FP32-accurate vs the float64 model
    assert relerr(out_chunked, ref64) <= 1e-6  # query-chunked global attention is the same maths
    assert (out_chunked - out).abs().max().item() < 1e-5


def test_cls_attention_matches_timm_attention_weights():
    elsa, stock = _models(TINY, (80, 64))
    for blk in stock.blocks:
        blk.attn.fused_attn = False  # timm then materialises softmax(q k^T) and passes it through attn_drop
    seen = []
    stock.blocks[-1].attn.attn_drop.register_forward_hook(lambda m, i, o: seen.append(o.detach()))
    x = torch.randn(1, 1, 80, 64)
    with torch.no_grad():
        stock.double().forward_features(x.double())
        tokens, cls_map = forward_tokens(elsa, x, with_cls_attention=True)
        tokens_c, cls_map_c = forward_tokens(elsa, x, with_cls_attention=True, query_chunk=6)
    ref = seen[0][:, :, 0, 1:].mean(dim=1)  # class-token row, patch keys, mean over heads
    assert cls_map.shape == (1, 20)
    assert relerr(cls_map, ref) <= 1e-5 and relerr(cls_map_c, ref) <= 1e-5
    assert torch.equal(tokens, forward_tokens(elsa, x))


def test_cli_cls_attention_overlay(weights, tmp_path):
    main(
        [
            "--model",
            TINY,
            "--weights",
            weights["gray"],
            "--input",
            _ct_small(),
            "--img-size",
            "64",
            "--overlay",
            "cls-attn",
            "--out",
            str(tmp_path),
        ]
    )
    r, _, f = _outputs(tmp_path)
    assert r["overlay"] == "cls_attention_last_block"
    a = f["cls_attention"]
    assert a.shape == (4, 4) and (a > 0).all() and float(a.sum()) < 1.0


def test_pos_embed_resampled_from_checkpoint(weights):
    from timm.layers import resample_abs_pos_embed

    sd = load_file(weights["gray"])
    model = build_model(TINY, sd, (128, 96))
    assert model.patch_embed.grid_size == (8, 6) and model.num_classes == 7
    assert model.patch_embed.proj.in_channels == 1
    ref = resample_abs_pos_embed(sd["pos_embed"], new_size=[8, 6], old_size=[14, 14], num_prefix_tokens=1)
    torch.testing.assert_close(model.pos_embed.data, ref, rtol=0, atol=0)
    torch.testing.assert_close(model.pos_embed.data[:, 0], sd["pos_embed"][:, 0], rtol=0, atol=0)


def test_tiled_single_tile_equals_whole():
    elsa, _ = _models(TINY, (64, 80))
    x = torch.randn(1, 64, 80)
    whole = run_plan(elsa, x, Plan("whole", 0.0, None))
    one = run_plan(elsa, x, Plan("tiled", 0.0, None, tile=80, overlap=0))
    assert one.tiles == 1
    assert relerr(one.features, whole.features) <= 1e-6 and relerr(one.logits, whole.logits) <= 1e-6
    assert not whole.logits.requires_grad and not one.features.requires_grad  # inference: no graph kept


def test_tiled_blend_and_position_crop():
    elsa, _ = _models(TINY, (96, 96))
    x = torch.randn(1, 96, 96)
    res = run_plan(elsa, x, Plan("tiled", 0.0, None, tile=64, overlap=32))
    assert res.tiles == 4 and res.features.shape == (192, 6, 6)
    # the top-left 2x2 patches are covered by tile (0, 0) alone: they equal that tile's own features,
    # computed with the top-left crop of the full-grid position embeddings
    with torch.no_grad():
        t = forward_tokens(elsa, x[None, :, :64, :64])
    tile00 = t[0, 1:].reshape(4, 4, -1).permute(2, 0, 1)
    assert relerr(res.features[:, :2, :2], tile00[:, :2, :2]) <= 1e-6
    # the bottom-right tile sees the position embeddings of grid cells (2..5, 2..5), not (0..3, 0..3)
    with torch.no_grad():
        t22 = forward_tokens(elsa, x[None, :, 32:, 32:], offset=(2, 2))
        t_wrong = forward_tokens(elsa, x[None, :, 32:, 32:], offset=(0, 0))
    br = t22[0, 1:].reshape(4, 4, -1).permute(2, 0, 1)
    assert relerr(res.features[:, 4:, 4:], br[:, 2:, 2:]) <= 1e-6
    assert (
        relerr(res.features[:, 4:, 4:], t_wrong[0, 1:].reshape(4, 4, -1).permute(2, 0, 1)[:, 2:, 2:]) > 1e-3
    )
    assert (
        tile_starts(6, 4, 2) == [0, 2] and tile_starts(7, 4, 2) == [0, 2, 3] and tile_starts(3, 4, 2) == [0]
    )


def test_cli_tiling_forced_by_budget(weights, tmp_path, capsys):
    base = ["--model", TINY, "--weights", weights["gray"], "--input", _ct_small(), "--img-size", "128"]
    main(base + ["--out", str(tmp_path / "g")])
    rg, _, fg = _outputs(tmp_path / "g")
    assert rg["tiled"] is False and rg["mode"] == "whole"
    capsys.readouterr()
    summary = main(
        base + ["--memory-budget-mb", str(rg["estimated_peak_mb"] - 0.05), "--out", str(tmp_path / "t")]
    )
    printed = capsys.readouterr().out
    assert "TILED" in printed and json.loads(printed.strip().splitlines()[-1])["tiled"] is True
    rt, pt, ft = _outputs(tmp_path / "t")
    assert summary["tiled"] is True and rt["tiled"] is True and rt["global_attention"] is False
    assert rt["tiles"] > 1 and rt["tile_size"] < 128 and rt["estimated_peak_mb"] <= rt["memory_budget_mb"]
    _check_consistent(rt, pt, ft, 7)
    assert ft["features"].shape == fg["features"].shape and rt["tokens"] == rg["tokens"]
    with pytest.raises(ValueError, match="memory budget 1.0 MiB is too small"):
        main(base + ["--memory-budget-mb", "1", "--out", str(tmp_path / "x")])


def test_plan_prefers_query_chunks_before_tiles():
    elsa, _ = _models(TINY, (512, 512))
    dev = torch.device("cpu")
    whole = plan_execution(elsa, (512, 512), device=dev)
    assert whole.mode == "whole"
    p = plan_execution(elsa, (512, 512), device=dev, budget_mb=whole.estimated_peak_mb - 1.0)
    assert p.mode == "query_chunked" and p.query_chunk < 1025 and p.estimated_peak_mb <= p.budget_mb
    q = plan_execution(elsa, (512, 512), device=dev, query_chunk=100)
    assert q.mode == "query_chunked" and q.query_chunk == 100


def test_cli_png16_rgb_weights_replicate_vs_adapt(weights, tmp_path):
    from skimage import data

    cam = data.camera().astype(np.uint16) * 257  # 16-bit values up to 65535
    png = tmp_path / "camera16.png"
    Image.fromarray(cam).save(png)
    base = [
        "--model",
        TINY,
        "--weights",
        weights["rgb"],
        "--input",
        str(png),
        "--img-size",
        "64",
        "--norm",
        "minmax",
    ]
    main(base + ["--out", str(tmp_path / "rep")])
    main(base + ["--gray", "adapt", "--out", str(tmp_path / "ada")])
    rr, pr, fr = _outputs(tmp_path / "rep")
    ra, pa, fa = _outputs(tmp_path / "ada")
    _check_consistent(rr, pr, fr, 5)
    assert rr["reader"]["source_dtype"] == "uint16" and rr["preprocess"]["raw_max"] == 65535.0
    assert rr["random_weights"] is False
    # summing the RGB patch weights is the same linear map as replicating the grey channel
    assert relerr(fa["features"], fr["features"]) <= 1e-5


def test_cli_bf16_close_to_fp32(weights, tmp_path):
    base = ["--model", TINY, "--weights", weights["gray"], "--input", _ct_small(), "--img-size", "64"]
    main(base + ["--out", str(tmp_path / "f32")])
    s = main(base + ["--precision", "bf16", "--out", str(tmp_path / "b16")])
    r32, _, f32 = _outputs(tmp_path / "f32")
    r16, p16, f16 = _outputs(tmp_path / "b16")
    assert s["precision"] == "bf16" and r16["precision"] == "bf16" and r32["precision"] == "fp32"
    _check_consistent(r16, p16, f16, 7)
    err = relerr(f16["features"], f32["features"])
    assert 0 < err <= 5e-2  # bfloat16 (8-bit mantissa) through 12 blocks


def test_linear_backend_reaches_every_linear_layer(weights, tmp_path):
    from elsa_vision.layers import ElsaLinear, ElsaLinearModule, ElsaPatchConv2d

    for backend in ("auto", "torch"):
        model = build_model(TINY, None, (32, 32), linear_backend=backend)
        linears = [m for m in model.modules() if isinstance(m, (ElsaLinear, ElsaPatchConv2d))]
        assert len(linears) == 4 * 12 + 2 and all(m.backend == backend for m in linears)  # + patch, head
        assert all(m.backend == backend for m in model.modules() if isinstance(m, ElsaLinearModule))  # MLPs
        assert not any(type(m) in (torch.nn.Linear, torch.nn.Conv2d) for m in model.modules())
    base = ["--model", TINY, "--weights", weights["gray"], "--input", _ct_small(), "--img-size", "32"]
    summary = main(base + ["--linear-backend", "torch", "--out", str(tmp_path / "torch")])
    report = json.loads((tmp_path / "torch" / "report.json").read_text())
    assert summary["linear_backend"] == report["linear_backend"] == "torch"
    with pytest.raises(SystemExit):
        main(base + ["--linear-backend", "eca", "--out", str(tmp_path / "eca")])


def test_cli_nifti_all_slices(weights, tmp_path, monkeypatch):
    vol = np.random.default_rng(0).normal(size=(40, 36, 3)).astype(np.float32)
    p = tmp_path / "v.nii.gz"
    nib.save(nib.Nifti1Image(vol, np.eye(4)), p)
    s = main(
        [
            "--model",
            TINY,
            "--weights",
            weights["gray"],
            "--input",
            str(p),
            "--img-size",
            "32",
            "--slice",
            "all",
            "--norm",
            "zscore",
            "--out",
            str(tmp_path / "o"),
        ]
    )
    assert s["images"] == 3
    for i in range(3):
        r, pr, f = _outputs(tmp_path / "o" / f"slice_{i:04d}")
        assert r["index"] == i and r["count"] == 3
        _check_consistent(r, pr, f, 7)
    # the slices are decoded as they are run (one ahead), not all before the first
    import elsa_vision.inference.image as image_cli

    yielded, seen_at_load = [], []
    real_iter, real_load = image_cli.iter_images, image_cli.load_image

    def counting_iter(*a, **k):
        for im in real_iter(*a, **k):
            yielded.append(im.index)
            yield im

    def recording_load(im, **k):
        seen_at_load.append(len(yielded))
        return real_load(im, **k)

    monkeypatch.setattr(image_cli, "iter_images", counting_iter)
    monkeypatch.setattr(image_cli, "load_image", recording_load)
    main(["--model", TINY, "--weights", weights["gray"], "--input", str(p), "--img-size", "32",
          "--slice", "all", "--out", str(tmp_path / "o"), "--overwrite"])
    assert yielded == [0, 1, 2] and seen_at_load == [2, 2, 3]
    monkeypatch.undo()
    # --overwrite with one slice: the earlier run's slice folders go, none stays beside the new outputs
    args = ["--model", TINY, "--weights", weights["gray"], "--input", str(p), "--img-size", "32",
            "--slice", "1", "--out", str(tmp_path / "o"), "--overwrite"]
    assert main(args)["tokens"] == 5  # 2 x 2 patches and the class token
    assert sorted(os.listdir(tmp_path / "o")) == ["features.safetensors", "outputs.json", "overlay.png",
                                                 "prediction.json", "report.json"]


def test_cli_overwrite_removes_only_what_it_recorded(weights, tmp_path):
    """--overwrite removes the files the earlier run recorded in outputs.json, not a file of the user's
    named slice_* nor one the user put inside a slice folder."""
    vol = np.random.default_rng(0).normal(size=(32, 32, 3)).astype(np.float32)
    p = tmp_path / "v.nii.gz"
    nib.save(nib.Nifti1Image(vol, np.eye(4)), p)
    out = tmp_path / "o"
    base = ["--model", TINY, "--weights", weights["gray"], "--input", str(p), "--img-size", "32", "--out",
            str(out)]
    main(base + ["--slice", "all"])
    recorded = json.loads((out / "outputs.json").read_text())["outputs"]
    assert len(recorded) == 12 and "slice_0002/features.safetensors" in recorded
    (out / "slice_notes.txt").write_text("mine")
    (out / "slice_0001" / "mine.txt").write_text("mine")
    main(base + ["--slice", "1", "--overwrite"])
    assert sorted(os.listdir(out)) == ["features.safetensors", "outputs.json", "overlay.png",
                                       "prediction.json", "report.json", "slice_0001", "slice_notes.txt"]
    assert os.listdir(out / "slice_0001") == ["mine.txt"]
    assert json.loads((out / "outputs.json").read_text())["outputs"] == [
        "prediction.json", "features.safetensors", "overlay.png", "report.json"]


def test_cli_random_weights_warns(tmp_path, capsys):
    s = main(
        ["--model", "elsa_vit_t_patch16", "--input", _ct_small(), "--img-size", "32", "--out", str(tmp_path)]
    )
    assert "RANDOMLY INITIALISED" in capsys.readouterr().err
    r, pred, _ = _outputs(tmp_path)
    assert (
        r["random_weights"] is True and pred["random_weights"] is True and len(pred["probabilities"]) == 1000
    )
    assert s["tokens"] == 5


def test_cli_bad_inputs(weights, tmp_path):
    # one --out for every call (one of them succeeds and writes there): --overwrite
    base = ["--model", TINY, "--weights", weights["gray"], "--out", str(tmp_path / "o"), "--overwrite"]
    nan = np.ones((64, 64), np.float32)
    nan[10, 10] = np.nan
    tifffile.imwrite(tmp_path / "nan.tif", nan)
    with pytest.raises(ValueError, match="NaN or infinite"):
        main(base + ["--input", str(tmp_path / "nan.tif"), "--img-size", "32"])
    s = main(base + ["--input", str(tmp_path / "nan.tif"), "--img-size", "32", "--nan-policy", "mean"])
    assert s["tokens"] == 5
    Image.fromarray(np.zeros((8, 40), np.uint8)).save(tmp_path / "small.png")
    with pytest.raises(ValueError, match="smaller than one 16x16 patch"):
        main(base + ["--input", str(tmp_path / "small.png"), "--img-size", "32"])
    with pytest.raises(ValueError, match="multiple of the patch size 16"):
        main(base + ["--input", _ct_small(), "--img-size", "40"])
    with pytest.raises(ValueError, match="not a registered elsa"):
        main(["--model", "vit_tiny_patch16_224", "--input", _ct_small(), "--out", str(tmp_path)])
    (tmp_path / "broken.safetensors").write_bytes(b"\x10\x00garbage")
    with pytest.raises(ValueError, match=r"^--weights: '.*broken\.safetensors' is a damaged"):
        main(
            [
                "--model",
                TINY,
                "--weights",
                str(tmp_path / "broken.safetensors"),
                "--input",
                _ct_small(),
                "--out",
                str(tmp_path),
            ]
        )
    small_w = tmp_path / "small.pth"
    torch.save(timm.create_model("elsa_vit_small_patch16_224", num_classes=3).state_dict(), small_w)
    with pytest.raises(ValueError, match="embed_dim 384"):
        main(["--model", TINY, "--weights", str(small_w), "--input", _ct_small(), "--out", str(tmp_path)])
    with pytest.raises(ValueError, match="--num-classes 9 contradicts the weights, which have 7"):
        main(base + ["--input", _ct_small(), "--num-classes", "9"])
    # sizes a zero-element tensor declares are refused before a model is built with them (a 5,000,000-class
    # head would allocate 3.8 GB; here 7 classes keep a regression cheap)
    from safetensors.torch import save_file

    for name, tensors in (("head", {"patch_embed.proj.weight": torch.zeros(192, 1, 16, 16),
                                    "head.weight": torch.zeros(7, 0)}),
                          ("embed", {"patch_embed.proj.weight": torch.zeros(0, 1, 16, 16)})):
        save_file(tensors, tmp_path / f"{name}.safetensors")
        with pytest.raises(ValueError, match=rf"^--weights: '.*{name}\.safetensors': '(head|patch_embed)"):
            main(["--model", TINY, "--weights", str(tmp_path / f"{name}.safetensors"), "--input", _ct_small(),
                  "--out", str(tmp_path / "z")])
    (tmp_path / "bad.dcm").write_bytes(b"not a dicom at all" * 20)
    with pytest.raises(ValueError, match="bad.dcm"):
        main(base + ["--input", str(tmp_path / "bad.dcm")])


def test_model_aliases():
    assert resolve_model_name("elsa_vit_b_patch16") == "elsa_vit_base_patch16_224"
    assert resolve_model_name("elsa_vit_base_patch16_384") == "elsa_vit_base_patch16_384"
    with pytest.raises(ValueError, match="alias"):
        resolve_model_name("elsa_vit_huge")


@pytest.mark.gpu
def test_gpu_cli_ct_small_fp32_matches_sdpa(weights, tmp_path):
    s = main(
        [
            "--model",
            TINY,
            "--weights",
            weights["gray"],
            "--input",
            _ct_small(),
            "--img-size",
            "1024",
            "--device",
            "cuda",
            "--compare-sdpa",
            "--out",
            str(tmp_path),
        ]
    )
    r, pred, feats = _outputs(tmp_path)
    _check_consistent(r, pred, feats, 7)
    assert r["device"].startswith("cuda") and r["peak_memory_kind"] == "cuda_max_allocated"
    assert s["tokens"] == 4097 and r["tiled"] is False
    assert r["max_deviation_vs_sdpa"] < 1e-5  # FP32 with TF32 off, both models


@pytest.mark.gpu
def test_gpu_vit_b16_4096_goal():
    """ViT-B/16, 4096^2 single channel (65,537 tokens), FP32: < 16 GB peak and >= 2x timm's stock model."""
    from benchmarks.highres import Case, run_case

    row = run_case(
        Case("elsa_vit_base_patch16_224", 4096), torch.device("cuda"), repeats=2, attn_backend="auto"
    )
    assert row["tokens"] == 65537 and row["elsa_mode"] == "whole"
    assert row["relerr"] <= 1e-5
    assert row["elsa_peak_mb"] < 16 * 1024
    assert row["speed_ratio"] >= 2.0, row


def test_cli_subprocess_bad_input_exit_code(tmp_path):
    bad = tmp_path / "corrupt.tif"
    bad.write_bytes(b"II*\x00" + os.urandom(300))
    env = dict(
        os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
    )
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "elsa_vision.inference.image",
            "--model",
            TINY,
            "--input",
            str(bad),
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 2
    assert "corrupt.tif" in json.loads(r.stdout.strip().splitlines()[-1])["error"]
    assert "error:" in r.stderr and not (tmp_path / "o").exists()


def test_cli_missing_weights_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys):
    from elsa_vision.inference.image import cli

    args = ["--model", TINY, "--weights", str(tmp_path / "nope.pth"), "--input", _ct_small()]
    with pytest.raises(FileNotFoundError, match=r"^--weights: '.*nope\.pth' does not exist"):
        main(args + ["--out", str(tmp_path / "o")])
    monkeypatch.setattr(sys, "argv", ["image", *args, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as e:
        cli()
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert "nope.pth' does not exist" in json.loads(out.strip().splitlines()[-1])["error"]
    assert err.startswith("error: --weights: ") and not (tmp_path / "o").exists()


def test_cli_refuses_bombs_before_decoding(weights, tmp_path):
    from elsa_vision.files import FileTooLargeError
    from tests.helpers import bomb_png, forged_tiff

    base = ["--model", TINY, "--weights", weights["gray"], "--img-size", "32"]
    bomb = bomb_png(tmp_path / "bomb.png")
    refused = r"bomb\.png' declares 10,000,000,000 pixels.*--max-image-pixels"
    with pytest.raises(FileTooLargeError, match=refused):
        main(base + ["--input", str(bomb), "--out", str(tmp_path / "a")])
    forged = forged_tiff(tmp_path / "forged.tif", 3000, 3000)  # 8.6 MiB declared by a 282-byte file
    with pytest.raises(FileTooLargeError, match=r"forged\.tif'.*TIFF image series.*--max-input-gib"):
        main(base + ["--input", str(forged), "--out", str(tmp_path / "b"), "--max-input-gib", "0.005"])
    Image.fromarray(np.zeros((40, 48), np.uint8)).save(tmp_path / "small.png")
    small = ["--input", str(tmp_path / "small.png"), "--out", str(tmp_path / "c"), "--max-image-pixels"]
    with pytest.raises(FileTooLargeError, match=r"small\.png' declares 48x40 = 1,920 pixels.*limit of 1,000"):
        main(base + small + ["1000"])
    assert not any((tmp_path / d).exists() for d in "abc")


def test_cli_checks_out_before_computing(weights, tmp_path, monkeypatch):
    """--out is checked first: an unwritable one fails in one line before the image is read or the model
    built; earlier outputs are refused unless --overwrite."""
    import elsa_vision.inference.image as image_cli

    base = ["--model", TINY, "--weights", weights["gray"], "--input", _ct_small(), "--img-size", "32"]
    (tmp_path / "afile").write_text("")

    def no_work(*args, **kwargs):
        raise AssertionError("the input was read before --out was checked")

    with monkeypatch.context() as m:
        m.setattr(image_cli, "iter_images", no_work)
        m.setattr(image_cli, "build_model", no_work)
        refused = r"--out '.*afile/out' cannot be created: '.*afile' is not a dir"
        with pytest.raises(ValueError, match=refused):
            main(base + ["--out", str(tmp_path / "afile" / "out")])
    out = tmp_path / "out"
    main(base + ["--out", str(out)])
    before = (out / "report.json").read_bytes()
    with monkeypatch.context() as m:
        m.setattr(image_cli, "iter_images", no_work)
        with pytest.raises(ValueError, match=r"already holds outputs of an earlier run \(prediction\.json"):
            main(base + ["--out", str(out), "--precision", "tf32"])
    assert (out / "report.json").read_bytes() == before
    s = main(base + ["--out", str(out), "--precision", "tf32", "--overwrite"])
    assert s["precision"] == "tf32" and json.loads((out / "report.json").read_text())["precision"] == "tf32"
    w = tmp_path / "w.safetensors"
    w.write_bytes(b"keep")
    with pytest.raises(ValueError, match=r"w\.safetensors' exists; pass --overwrite"):
        main(["--save-random-weights", str(w), "--model", TINY])
    assert w.read_bytes() == b"keep"
    r = subprocess.run(
        [sys.executable, "-m", "elsa_vision.inference.image", *base, "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --out") and "--overwrite" in r.stderr


def _build_on_meta_only(monkeypatch):
    """The image CLI may build its model on the meta device only (to plan): a real build fails the test."""
    import elsa_vision.inference.image as image_cli

    real_build = image_cli.build_model

    def meta_only(*a, **k):
        if torch.empty(0).device.type != "meta":
            raise AssertionError("a model was built for a size that cannot fit")
        return real_build(*a, **k)

    monkeypatch.setattr(image_cli, "build_model", meta_only)
    return image_cli


def test_cli_refuses_a_size_that_cannot_fit_before_building_the_model(weights, tmp_path, monkeypatch):
    """--img-size 100000 asked for a 30 GB position embedding before any plan: the plan is made on the meta
    device and a size no mode fits is refused in one line naming --img-size and the estimate; so is one
    context-parallel rank's share (a one-rank gloo group here) and an explicit --query-chunk."""
    import socket

    image_cli = _build_on_meta_only(monkeypatch)
    monkeypatch.setattr(image_cli, "default_budget_mb", lambda device: 16_000.0)
    base = ["--model", TINY, "--weights", weights["gray"], "--input", _ct_small(), "--out",
            str(tmp_path / "o")]
    refused = (r"^--img-size 100000 100000 \(6250x6250 patches of 16px\): memory budget 16,000\.0 MiB is too "
               r"small: even one 16x16-patch tile needs more \(weights alone [\d,]+ MiB\); lower --img-size$")
    with pytest.raises(ValueError, match=refused):
        main(base + ["--img-size", "100000"])
    with pytest.raises(ValueError, match=r"^--img-size 100000 100000 .*query-chunked attention over "
                                         r"39,062,501 tokens needs about [\d,]+ MiB, more than the budget"):
        main(base + ["--img-size", "100000", "--query-chunk", "256"])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port)).items():
        monkeypatch.setenv(key, value)
    refused = (r"^--img-size 4096 4096 \(256x256 patches of 16px, --context-parallel\): context parallelism "
               r"over 1 ranks needs about [\d,]+ MiB per rank for 65,537 tokens, more than the budget of 50 "
               r"MiB per rank; lower --img-size or run on more ranks or raise --memory-budget-mb$")
    with pytest.raises(ValueError, match=refused):
        main(base + ["--img-size", "4096", "--context-parallel", "--memory-budget-mb", "50"])
    assert not torch.distributed.is_initialized()
    assert not (tmp_path / "o").exists()


@pytest.mark.gpu
def test_gpu_cli_refuses_a_size_that_cannot_fit_the_gpu(weights, tmp_path, monkeypatch):
    """On CUDA the plan is made against 90% of the free GPU memory, on the meta device: --img-size 200000
    (a 114 GB position embedding) is refused in one line and no model is built."""
    _build_on_meta_only(monkeypatch)
    with pytest.raises(ValueError, match=r"^--img-size 200000 200000 \(12500x12500 patches of 16px\): memory "
                                         r"budget [\d,.]+ MiB is too small"):
        main(["--model", TINY, "--weights", weights["gray"], "--input", _ct_small(), "--img-size", "200000",
              "--device", "cuda", "--out", str(tmp_path / "o")])
