"""Multi-view pipeline: ground-truth normalisation, VGGT losses, CPU training of the small model lowers the
loss, Lightning fit/validate/test with the logged metric keys, Hydra configs, the inference CLI."""

import functools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from PIL import Image

from elsa_vision.data.geometry import depth_to_world_points, read_ply
from elsa_vision.data.multiview import MultiViewDataModule, SyntheticMultiViewDataset
from elsa_vision.inference.multiview import main as infer_main
from elsa_vision.models import ElsaVGGT
from elsa_vision.models.vggt import VGGT_CONFIGS
from elsa_vision.tasks.multiview import (
    MultiViewReconstructionModule,
    camera_loss,
    depth_loss,
    normalize_ground_truth,
)

ROOT = Path(__file__).resolve().parents[1]


def _umask() -> int:
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _batch(n=2, frames=3, size=(56, 56), seed=0):
    ds = SyntheticMultiViewDataset(n, frames, size, seed=seed)
    items = [ds[i] for i in range(n)]
    return {k: torch.stack([it[k] for it in items]) for k in items[0]}


def test_normalize_ground_truth():
    b = _batch()
    gt = normalize_ground_truth(b)
    eye = torch.eye(3).expand(2, 3, 3)
    assert (gt["extrinsics"][:, 0, :, :3] - eye).abs().max() <= 1e-6
    assert gt["extrinsics"][:, 0, :, 3].abs().max() <= 1e-6
    # mean distance of valid points from frame 0's camera is 1 after normalisation
    ext = gt["extrinsics"].double()
    for i in range(2):
        pts = depth_to_world_points(gt["depth"][i].double(), ext[i], gt["intrinsics"][i].double())
        d = pts[gt["valid"][i]].norm(dim=-1).mean()
        assert abs(float(d) - 1.0) <= 1e-5
    # relative poses are unchanged up to the scale: rotation part equals E_i R_0^T
    r_rel = b["extrinsics"][:, :, :, :3] @ b["extrinsics"][:, :1, :, :3].transpose(-1, -2)
    assert (gt["extrinsics"][..., :3] - r_rel).abs().max() <= 1e-5
    b["valid"][1] = False
    with pytest.raises(ValueError, match="no valid depth"):
        normalize_ground_truth(b)


def test_losses_minimum_and_weights():
    enc = torch.randn(2, 3, 9)
    out = camera_loss([enc + 1.0, enc], enc)
    # iteration weights 0.6, 1: only the first (off by 1 everywhere) contributes: 0.6·(1 + 1 + 0.5)
    assert float(out["loss_camera"]) == pytest.approx(0.6 * 2.5, rel=1e-6)
    gt = torch.rand(1, 2, 8, 8) + 0.5
    valid = torch.ones_like(gt, dtype=torch.bool)
    pred = gt + 0.1
    # γ|e|c − α log c is minimised at c = α / (γ|e|) = 2 for |e| = 0.1
    losses = [
        float(depth_loss(pred[..., None], torch.full_like(gt, c), gt, valid)["loss_conf_depth"])
        for c in (1.5, 2.0, 2.5)
    ]
    assert losses[1] < losses[0] and losses[1] < losses[2]
    assert (
        float(depth_loss(pred, torch.full_like(gt, 2.0), gt, valid)["loss_grad_depth"]) <= 1e-6
    )  # constant error
    ramp = gt + torch.linspace(0, 1, 8)
    assert float(depth_loss(ramp, torch.full_like(gt, 2.0), gt, valid)["loss_grad_depth"]) > 0.01


def test_cpu_training_steps_lower_the_loss():
    torch.manual_seed(0)
    net = ElsaVGGT.from_config("elsa_vggt_small")
    module = MultiViewReconstructionModule(net, functools.partial(torch.optim.AdamW, lr=2e-3))
    opt = module.configure_optimizers()["optimizer"]
    batch = _batch()
    first, _, _ = module._step(batch)
    for _ in range(30):
        losses, _, _ = module._step(batch)
        opt.zero_grad()
        losses["loss"].backward()
        opt.step()
    last, _, _ = module._step(batch)
    assert torch.isfinite(last["loss"])
    assert float(last["loss"]) < 0.6 * float(first["loss"]), (float(first["loss"]), float(last["loss"]))
    assert float(last["loss_camera"]) < float(first["loss_camera"])
    assert float(last["loss_depth"]) < float(first["loss_depth"])


def test_lightning_fit_validate_test_logs_metrics(tmp_path):
    torch.manual_seed(0)
    net = ElsaVGGT.from_config("elsa_vggt_small")
    module = MultiViewReconstructionModule(
        net,
        functools.partial(torch.optim.AdamW, lr=1e-3),
        functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1, gamma=0.5),
    )
    dm = MultiViewDataModule(train_size=4, val_size=2, test_size=2, batch_size=2, num_frames=3)
    trainer = L.Trainer(
        max_epochs=1,
        accelerator="cpu",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, dm)
    keys = set(trainer.callback_metrics)
    for k in ("train/loss", "val/loss", "val/auc30", "val/auc15", "val/auc5", "val/abs_rel", "val/delta1"):
        assert k in keys, k
    res = trainer.test(module, dm, verbose=False)[0]
    assert 0.0 <= res["test/auc30"] <= 1.0 and res["test/abs_rel"] >= 0.0 and 0.0 <= res["test/delta1"] <= 1.0
    # the Lightning checkpoint holds only tensors and plain values (the optimizer and scheduler factories
    # stay out of its hyper-parameters): it reloads weights-only, with the tensors export_net writes
    from elsa_vision.models.vggt import load_vggt_state_dict

    trainer.save_checkpoint(tmp_path / "last.ckpt")
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True, map_location="cpu")
    assert "optimizer" not in ckpt["hyper_parameters"] and "scheduler" not in ckpt["hyper_parameters"]
    sd = load_vggt_state_dict(module.export_net(tmp_path / "net.safetensors"))
    assert sd.keys() == net.state_dict().keys()
    assert all(torch.equal(sd[k], v) for k, v in net.state_dict().items())
    from_ckpt = load_vggt_state_dict(tmp_path / "last.ckpt")
    assert from_ckpt.keys() == sd.keys() and all(torch.equal(from_ckpt[k], v) for k, v in sd.items())
    # docs/vggt.md's export: the checkpoint rebuilds the module (the network from its recorded net_config,
    # no optimizer: a module for inference or export), weights-only
    loaded = MultiViewReconstructionModule.load_from_checkpoint(tmp_path / "last.ckpt", weights_only=True)
    assert loaded.optimizer_factory is None and loaded.net.config == net.config
    exported = load_vggt_state_dict(loaded.export_net(tmp_path / "exported.safetensors"))
    assert os.stat(tmp_path / "exported.safetensors").st_mode & 0o777 == 0o666 & ~_umask()
    assert exported.keys() == sd.keys() and all(torch.equal(exported[k], v) for k, v in sd.items())
    with pytest.raises(ValueError, match="no optimizer to fit with"):
        loaded.configure_optimizers()
    # a checkpoint of an older run, with the optimizer factory pickled in (and no net_config): refused,
    # with the export that works for it (trusted file: unpickled, the network named)
    ckpt["hyper_parameters"]["optimizer"] = functools.partial(torch.optim.AdamW, lr=1e-3)
    del ckpt["hyper_parameters"]["net_config"]
    torch.save(ckpt, tmp_path / "old.ckpt")
    with pytest.raises(ValueError, match=r"old\.ckpt.*functools\.partial.*load_from_checkpoint\(path, "
                                         r"weights_only=False, net=ElsaVGGT\.from_config\(name\)\)"
                                         r"\.export_net"):
        load_vggt_state_dict(tmp_path / "old.ckpt")
    old = MultiViewReconstructionModule.load_from_checkpoint(
        tmp_path / "old.ckpt", weights_only=False, net=ElsaVGGT.from_config("elsa_vggt_small"))
    assert all(torch.equal(v, sd[k]) for k, v in old.net.state_dict().items())
    with pytest.raises(ValueError, match="pass net .* or net_config"):
        MultiViewReconstructionModule.load_from_checkpoint(tmp_path / "old.ckpt", weights_only=False)


def test_synthetic_frames_command_writes_what_the_inference_cli_reads(tmp_path, capsys):
    """docs/vggt.md's ``python -m elsa_vision.data.multiview --out frames/``: a validation sequence as PNG
    frames (and its ground truth), read by the inference CLI; an existing output needs --overwrite."""
    from elsa_vision.data.multiview import main as frames_main

    frames = tmp_path / "frames"
    paths = frames_main(["--out", str(frames), "--num-frames", "3"])
    assert [p.name for p in paths] == ["frame_00.png", "frame_01.png", "frame_02.png"]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["frames"] == 3
    seq = SyntheticMultiViewDataset(1, 3, (56, 56), seed=1)[0]
    with Image.open(paths[1]) as im:
        assert im.size == (56, 56)
        assert np.abs(np.asarray(im) / 255.0 - seq["images"][1].permute(1, 2, 0).numpy()).max() <= 0.5 / 255
    truth = json.loads((frames / "ground_truth.json").read_text())
    assert torch.equal(torch.tensor(truth["frames"][2]["extrinsics"]), seq["extrinsics"][2])
    with pytest.raises(SystemExit):
        frames_main(["--out", str(frames)])
    assert "--overwrite" in capsys.readouterr().err
    frames_main(["--out", str(frames), "--num-frames", "2", "--overwrite"])
    assert sorted(p.name for p in frames.iterdir()) == [
        "frame_00.png", "frame_01.png", "ground_truth.json", "outputs.json"]
    torch.manual_seed(0)
    from safetensors.torch import save_file

    save_file(ElsaVGGT.from_config("elsa_vggt_small").state_dict(), str(tmp_path / "w.safetensors"))
    summary = infer_main(["--frames", str(frames), "--weights", str(tmp_path / "w.safetensors"),
                          "--out", str(tmp_path / "recon"), "--device", "cpu"])
    assert summary["frames"] == 2 and summary["image_size_hw"] == [56, 56]


def test_hydra_configs_instantiate():
    from hydra.utils import instantiate
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(ROOT / "configs/model/elsa_vggt_small.yaml")
    module = instantiate(cfg)
    assert isinstance(module, MultiViewReconstructionModule) and isinstance(module.net, ElsaVGGT)
    assert module.net.config["embed_dim"] == 48
    opt = module.configure_optimizers()
    assert isinstance(opt["optimizer"], torch.optim.AdamW)
    # The configs name the configurations; the architecture is listed once, in VGGT_CONFIGS.
    assert cfg.net._target_ == "elsa_vision.models.ElsaVGGT.from_config" and cfg.net.name == "elsa_vggt_small"
    big = OmegaConf.load(ROOT / "configs/model/elsa_vggt.yaml")
    assert big.net._target_ == "elsa_vision.models.ElsaVGGT.from_config" and big.net.name == "elsa_vggt"
    assert not set(big.net) & set(VGGT_CONFIGS["elsa_vggt"])
    with torch.device("meta"):
        net = instantiate(big.net)
    for k, v in VGGT_CONFIGS["elsa_vggt"].items():
        assert net.config[k] == (list(v) if isinstance(v, tuple) else v), k
    for name in ("multiview_synthetic", "multiview_nerf", "multiview_colmap"):
        d = OmegaConf.load(ROOT / f"configs/data/{name}.yaml")
        assert d._target_ == "elsa_vision.data.multiview.MultiViewDataModule"
    dm = instantiate(OmegaConf.load(ROOT / "configs/data/multiview_synthetic.yaml"), train_size=2)
    assert isinstance(dm, MultiViewDataModule)
    exp = OmegaConf.load(ROOT / "configs/experiment/vggt_synthetic.yaml")
    assert {"override /model": "elsa_vggt_small"} in list(exp.defaults)


def _frames_and_weights(tmp_path):
    seq = SyntheticMultiViewDataset(1, 3, (60, 80), seed=5)[0]
    frames = tmp_path / "frames"
    frames.mkdir()
    for i in range(3):
        Image.fromarray((seq["images"][i].permute(1, 2, 0).numpy() * 255).astype(np.uint8)).save(
            frames / f"{i:02d}.png"
        )
    torch.manual_seed(0)
    net = ElsaVGGT.from_config("elsa_vggt_small")
    from safetensors.torch import save_file

    save_file(net.state_dict(), str(tmp_path / "w.safetensors"))
    return frames, net


def test_inference_cli_writes_outputs(tmp_path, capsys):
    frames, net = _frames_and_weights(tmp_path)
    out = tmp_path / "out"
    summary = infer_main(
        [
            "--frames",
            str(frames),
            "--weights",
            str(tmp_path / "w.safetensors"),
            "--config",
            "elsa_vggt_small",
            "--out",
            str(out),
            "--device",
            "cpu",
        ]
    )
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last) == summary
    assert summary["frames"] == 3 and summary["image_size_hw"] == [42, 56] and summary["dtype"] == "float32"
    assert summary["exact_attention"] is True
    cams = json.loads((out / "cameras.json").read_text())
    assert [f["name"] for f in cams["frames"]] == ["00", "01", "02"]
    assert np.array(cams["frames"][0]["extrinsics"]).shape == (3, 4)
    d = np.load(out / "depth" / "01.npy")
    assert d.shape == (42, 56) and np.isfinite(d).all() and (d > 0).all()
    png = np.asarray(Image.open(out / "depth" / "01.png"))
    assert png.dtype == np.uint16 and png.shape == (42, 56)
    assert np.abs(png * cams["depth_png_scale"] - d).max() <= cams["depth_png_scale"]
    pts, cols = read_ply(out / "points.ply")
    assert len(pts) == summary["points"] and cols.shape == (len(pts), 3) and len(pts) >= 3 * 42 * 56 // 2 - 3
    # the outputs are the model's: recompute depth for the same input
    from elsa_vision.inference.multiview import load_frames

    _, imgs = load_frames(frames, 56, 14)
    with torch.no_grad():
        ref = net.eval()(imgs[None])["depth"][0, 1, ..., 0].numpy()
    assert np.abs(ref - d).max() / np.abs(ref).max() <= 1e-6


def _run_cli(tmp_path, frames, weights, *extra):
    return infer_main(["--frames", str(frames), "--weights", str(weights), "--out", str(tmp_path / "out"),
                       "--device", "cpu", "--max-frames", "2", *extra])


def test_inference_cli_infers_the_config_from_the_weights(tmp_path, capsys):
    """The README's command has no --config: the weights of `elsa_vggt_small` (what experiment=vggt_synthetic
    trains) select that architecture."""
    frames, _ = _frames_and_weights(tmp_path)
    assert _run_cli(tmp_path, frames, tmp_path / "w.safetensors")["config"] == "elsa_vggt_small"


def test_inference_cli_names_the_configs_that_fit(tmp_path):
    frames, _ = _frames_and_weights(tmp_path)
    with pytest.raises(ValueError, match=r"^--weights .*w\.safetensors does not fit --config elsa_vggt "
                                         r"\(.*\); configs that fit: elsa_vggt_small$"):
        _run_cli(tmp_path, frames, tmp_path / "w.safetensors", "--config", "elsa_vggt")
    from safetensors.torch import save_file

    other = ElsaVGGT.from_config("elsa_vggt_small", depth=3, intermediate_layer_idx=(0, 1, 2, 2))
    save_file(other.state_dict(), str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match=r"^--weights .*other\.safetensors fits no ElsaVGGT config "
                                         r"\(elsa_vggt: .*; elsa_vggt_small: .*\)$") as err:
        _run_cli(tmp_path, frames, tmp_path / "other.safetensors")
    assert "\n" not in str(err.value) and len(str(err.value)) < 400


def test_inference_cli_subprocess(tmp_path):
    frames, _ = _frames_and_weights(tmp_path)
    cmd = [
        sys.executable,
        "-m",
        "elsa_vision.inference.multiview",
        "--frames",
        str(frames),
        "--weights",
        str(tmp_path / "w.safetensors"),
        "--config",
        "elsa_vggt_small",
        "--out",
        str(tmp_path / "o"),
        "--device",
        "cpu",
        "--max-frames",
        "2",
    ]
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert res.returncode == 0, res.stderr
    summary = json.loads(res.stdout.strip().splitlines()[-1])
    assert summary["frames"] == 2 and (tmp_path / "o" / "points.ply").is_file()
    written = sorted(os.listdir(tmp_path / "o" / "depth"))
    # an earlier, longer run: one more frame in its cameras.json and depth/; a file of the user's beside them
    cams = json.loads((tmp_path / "o" / "cameras.json").read_text())
    cams["frames"].append(dict(cams["frames"][0], name="frame_of_a_longer_run"))
    (tmp_path / "o" / "cameras.json").write_text(json.dumps(cams))
    for suffix in (".npy", ".png"):
        (tmp_path / "o" / "depth" / f"frame_of_a_longer_run{suffix}").write_bytes(b"stale")
    (tmp_path / "o" / "depth" / "ground_truth.npy").write_bytes(b"the user's")
    merged = subprocess.run(
        cmd + ["--merge-ratio", "0.5", "--overwrite"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert merged.returncode == 0, merged.stderr
    assert json.loads(merged.stdout.strip().splitlines()[-1])["exact_attention"] is False
    # nothing of the earlier run is left; what it did not write stays
    assert sorted(os.listdir(tmp_path / "o" / "depth")) == sorted(written + ["ground_truth.npy"])
    bad = subprocess.run(
        cmd[:4] + [str(tmp_path / "missing")] + cmd[5:] + ["--overwrite"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert bad.returncode != 0 and "not a directory" in bad.stderr
    mismatch = subprocess.run(
        cmd[:8] + ["elsa_vggt"] + cmd[9:] + ["--overwrite"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
    )
    assert mismatch.returncode == 2 and mismatch.stdout == ""
    assert mismatch.stderr.count("\n") == 1 and "configs that fit: elsa_vggt_small" in mismatch.stderr


@pytest.mark.gpu
def test_gpu_model_matches_torch_backend():
    torch.manual_seed(0)
    net = ElsaVGGT.from_config("elsa_vggt_small").cuda().eval()
    x = torch.rand(1, 6, 3, 56, 70, device="cuda")
    with torch.no_grad():
        net.set_attention(backend="torch")
        ref = net(x)
        net.set_attention(backend="auto")
        out = net(x)
    for k in ("pose_enc", "depth", "depth_conf"):
        assert (out[k] - ref[k]).norm() / ref[k].norm() <= 1e-5, k


def test_inference_cli_checks_out_first(tmp_path, capsys, monkeypatch):
    """An unwritable --out, or the outputs of an earlier run, end the CLI before the weights are read."""
    import elsa_vision.inference.multiview as mv

    frames, _ = _frames_and_weights(tmp_path)
    args = ["--frames", str(frames), "--weights", str(tmp_path / "w.safetensors")]
    (tmp_path / "afile").write_text("")
    (tmp_path / "done").mkdir()
    (tmp_path / "done" / "cameras.json").write_text("{}")

    def no_work(*a, **k):
        raise AssertionError("the weights were read before --out was checked")

    monkeypatch.setattr(mv, "build_model", no_work)
    for out, why in ((tmp_path / "afile" / "o", "cannot be created"), (tmp_path / "done", "already holds")):
        with pytest.raises(SystemExit) as e:
            infer_main(args + ["--out", str(out)])
        assert e.value.code == 2 and why in capsys.readouterr().err
    assert (tmp_path / "done" / "cameras.json").read_text() == "{}"


def test_inference_cli_frames_sharing_a_stem_keep_their_own_outputs(tmp_path, capsys, monkeypatch):
    """a.jpg and a.png are two frames: two depth maps (named by the whole file name) and two cameras; names
    that differ only in letter case are refused in one line before the model is built."""
    import elsa_vision.inference.multiview as mv

    frames, _ = _frames_and_weights(tmp_path)
    os.rename(frames / "00.png", frames / "a.png")
    Image.open(frames / "01.png").save(frames / "a.jpg")
    (frames / "01.png").unlink()
    os.rename(frames / "02.png", frames / "b.png")
    out = tmp_path / "out"
    summary = _run_cli(tmp_path, frames, tmp_path / "w.safetensors", "--max-frames", "3")
    assert summary["frames"] == 3
    names = [f["name"] for f in json.loads((out / "cameras.json").read_text())["frames"]]
    assert names == ["a.jpg", "a.png", "b"]
    assert sorted(os.listdir(out / "depth")) == [
        "a.jpg.npy", "a.jpg.png", "a.png.npy", "a.png.png", "b.npy", "b.png"
    ]
    assert not np.array_equal(np.load(out / "depth" / "a.jpg.npy"), np.load(out / "depth" / "a.png.npy"))
    os.rename(frames / "b.png", frames / "A.png")
    monkeypatch.setattr(mv, "build_model", lambda *a, **k: pytest.fail("the model was built"))
    with pytest.raises(ValueError, match=r"^--frames: 'A\.png' and 'a\.png' would write the same depth map"):
        _run_cli(tmp_path, frames, tmp_path / "w.safetensors", "--max-frames", "3", "--overwrite")


def test_curves_plot_the_tasks_own_metrics(tmp_path, caplog):
    """curves.png of a multi-view run draws its losses (``train/loss_epoch``: the training loss is logged per
    step and per epoch), pose AUC and depth delta1 -- the module's ``curves`` -- where the classification
    panels drew no training loss and an empty accuracy panel."""
    from elsa_vision.utils.run import plot_curves

    csv = tmp_path / "metrics.csv"
    rows = ["epoch,step,train/loss_step,train/loss_epoch,val/loss,val/auc30,val/auc15,val/delta1"]
    rows += [f"{e},{10 * e},,{2 - e / 4},{2.1 - e / 4},{0.1 * e},{0.05 * e},{0.5 + 0.1 * e}"
             for e in range(3)]
    csv.write_text("\n".join(rows) + "\n")
    with caplog.at_level("WARNING"):
        png = plot_curves(csv, tmp_path / "curves.png", MultiViewReconstructionModule.curves)
    assert not caplog.records
    with Image.open(png) as im:
        assert im.width == 3 * 500  # three panels, 5 inches each at 100 dpi
    with caplog.at_level("WARNING"):
        png = plot_curves(csv, tmp_path / "classification.png")  # the classification panels
    assert "no logged values for top-1 accuracy (train/acc, val/acc)" in caplog.text
    with Image.open(png) as im:
        assert im.width == 500  # only the loss panel (val/loss), no empty accuracy panel


def test_per_step_warmup_cosine_schedule(tmp_path):
    """scheduler_interval="step": the scheduler is built as classification's is (total and per-epoch
    optimizer steps), e.g. elsa_vision.tasks.cosine_warmup_schedule, and stepped every optimizer step."""
    from elsa_vision.tasks import cosine_warmup_schedule

    torch.manual_seed(0)
    module = MultiViewReconstructionModule(
        ElsaVGGT.from_config("elsa_vggt_small"), functools.partial(torch.optim.AdamW, lr=1e-3),
        functools.partial(cosine_warmup_schedule, warmup_epochs=1, warmup_lr_ratio=0.1, min_lr_ratio=0.0),
        scheduler_interval="step",
    )
    dm = MultiViewDataModule(train_size=4, val_size=2, test_size=2, batch_size=2, num_frames=2)
    trainer = L.Trainer(max_epochs=2, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    trainer.fit(module, dm)
    config = trainer.lr_scheduler_configs[0]
    assert config.interval == "step" and config.scheduler.last_epoch == 4  # 2 epochs x 2 steps
    assert trainer.optimizers[0].param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5 * (1 + math.cos(math.pi)))
    with pytest.raises(ValueError, match="scheduler_interval must be 'epoch' or 'step'"):
        MultiViewReconstructionModule(ElsaVGGT.from_config("elsa_vggt_small"), scheduler_interval="batch")


def test_inference_cli_chunks_give_the_same_outputs_and_show_progress(tmp_path, capsys):
    """--frames-chunk / --token-chunk bound what one forward holds without changing the outputs (FP32 CPU,
    1e-6); the progress bar follows reading, the aggregator's layers and writing, on stderr only, and
    --no-progress hides it; a negative chunk is refused."""
    frames, _ = _frames_and_weights(tmp_path)
    common = ["--frames", str(frames), "--weights", str(tmp_path / "w.safetensors"), "--device", "cpu"]
    infer_main([*common, "--out", str(tmp_path / "a"), "--frames-chunk", "0", "--token-chunk", "0"])
    err = capsys.readouterr().err
    for what in ("reading frames", "aggregator", "writing depth maps"):
        assert what in err
    infer_main([*common, "--out", str(tmp_path / "b"), "--frames-chunk", "1", "--token-chunk", "5",
                "--no-progress"])
    assert capsys.readouterr().err == ""
    for name in ("00", "01", "02"):
        a, b = (np.load(tmp_path / run / "depth" / f"{name}.npy") for run in ("a", "b"))
        assert np.abs(a - b).max() <= 1e-6 * np.abs(a).max()
    cams_a = json.loads((tmp_path / "a" / "cameras.json").read_text())["frames"]
    cams_b = json.loads((tmp_path / "b" / "cameras.json").read_text())["frames"]
    for fa, fb in zip(cams_a, cams_b):
        assert np.allclose(fa["extrinsics"], fb["extrinsics"], rtol=1e-5, atol=1e-6)
    with pytest.raises(SystemExit):
        infer_main([*common, "--out", str(tmp_path / "c"), "--token-chunk", "-1"])
    assert "--token-chunk must be >= 0" in capsys.readouterr().err


def test_confidence_threshold_is_torch_quantile_and_takes_any_size():
    """The --conf-percentile threshold equals torch.quantile's (linear interpolation) and is taken of more
    than 2^24 values too (1,000 frames of 336x518 are 174M; torch.quantile refuses them)."""
    from elsa_vision.inference.multiview import confidence_threshold

    conf = 1 + torch.rand(7, 5, 9, generator=torch.Generator().manual_seed(0)).exp()
    for p in (0.0, 12.5, 50.0, 99.0):
        assert confidence_threshold(conf, p) == pytest.approx(torch.quantile(conf.double(), p / 100).item(),
                                                              rel=1e-12)
    assert confidence_threshold(conf[:0], 50.0) == 0.0
    big = torch.arange(2**24 + 1, dtype=torch.float32)
    assert confidence_threshold(big, 50.0) == 2**23


def _vggt_on_meta(dtype, **overrides):
    with torch.device("meta"):
        return ElsaVGGT.from_config("elsa_vggt", **overrides).to(dtype)


def test_memory_estimate_matches_the_measured_peak_of_a_thousand_frames():
    # The multiview CLI on an H100 (2026-11-27): VGGT-1B, 1,000 frames of 336x518 in bfloat16, chunks
    # (32, 65536): peak allocated 35.26 GiB (docs/benchmarks/vggt.md). The estimate is within 10 % of it.
    from elsa_vision.inference.multiview import estimate_memory

    est = estimate_memory(_vggt_on_meta(torch.bfloat16), 1000, (336, 518), torch.bfloat16, 32, 65536)
    assert est["total"] == est["weights"] + est["frames"] + est["activations"]
    assert 0.9 <= est["total"] / (35.26 * 2**30) <= 1.1, est["total"] / 2**30
    # weights (and buffers) in the model's dtype; the frames: float32 on the device, a bfloat16 copy, the
    # normalised copy
    model = _vggt_on_meta(torch.bfloat16)
    assert est["weights"] == sum(t.numel() * 2 for t in (*model.parameters(), *model.buffers()))
    assert est["frames"] == 1000 * 3 * 336 * 518 * (4 + 2 + 2)
    # linear in the frames past the chunks, as attention holds O(tokens)
    e2, e4 = (estimate_memory(_vggt_on_meta(torch.bfloat16), s, (336, 518), torch.bfloat16, 32, 65536)
              for s in (2000, 4000))
    assert e4["activations"] - e2["activations"] == 2 * (e2["activations"] - est["activations"])


def test_plan_memory_halves_the_chunks_then_refuses_with_the_frames_that_fit():
    from elsa_vision.inference.multiview import estimate_memory, plan_memory

    model, hw, dt = _vggt_on_meta(torch.float32), (336, 518), torch.float32
    tokens = 64 * (5 + 24 * 37)
    whole = estimate_memory(model, 64, hw, dt, None, None)["total"]
    assert plan_memory(model, 64, hw, dt, whole, None, None)[:2] == (None, None)  # fits as asked
    # one byte less: the first halving of both chunks that fits (all frames at once cost the most here)
    half = estimate_memory(model, 64, hw, dt, 32, tokens // 2)["total"]
    assert half < whole
    fc, tc, est = plan_memory(model, 64, hw, dt, whole - 1, None, None)
    assert (fc, tc) == (32, tokens // 2) and est["total"] == half
    budget = int(40 * 2**30)
    refusal = (r"^1,000 frames of 336x518 in float32 need about [\d.]+ GiB .*more than the budget of "
               r"40\.0 GiB .*at most ([\d,]+) frames fit: --max-frames (\d+), or a smaller --width or "
               r"--dtype bfloat16$")
    with pytest.raises(ValueError, match=refusal) as e:
        plan_memory(model, 1000, hw, dt, budget, 32, 65536)
    most = int(str(e.value).split("--max-frames ")[1].split(",")[0])
    assert estimate_memory(model, most, hw, dt, 1, 4096)["total"] <= budget
    assert estimate_memory(model, most + 1, hw, dt, 1, 4096)["total"] > budget
    with pytest.raises(ValueError, match="not even one frame fits, or a smaller --width$"):
        plan_memory(_vggt_on_meta(torch.bfloat16), 10, hw, torch.bfloat16, 2**20, 32, 65536)
    for frames, budget in ((0, 2**30), (10, 0)):
        with pytest.raises(ValueError, match="^plan_memory: frames must be >= 1 and budget > 0 bytes"):
            plan_memory(model, frames, hw, dt, budget)


def test_inference_cli_plans_its_memory(tmp_path, capsys):
    """The summary gives the memory estimate (and, with a budget, the chunks it chose); a budget no chunking
    meets ends the run in one line before the model runs, naming the frames that fit."""
    frames, _ = _frames_and_weights(tmp_path)
    summary = _run_cli(tmp_path, frames, tmp_path / "w.safetensors")
    assert summary["memory_budget_gb"] is None and summary["memory_estimate_gb"] > 0  # CPU: no default budget
    assert (summary["frames_chunk"], summary["token_chunk"]) == (32, 65536)
    with pytest.raises(ValueError, match=r"^2 frames of 42x56 in float32 need about .* more than the budget "
                                         r"of 0\.0 GiB .*not even one frame fits"):
        _run_cli(tmp_path, frames, tmp_path / "w.safetensors", "--overwrite", "--memory-budget-gb", "1e-6")
    with pytest.raises(SystemExit):
        _run_cli(tmp_path, frames, tmp_path / "w.safetensors", "--memory-budget-gb", "0")
    assert "--memory-budget-gb must be > 0" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_memory_estimate_against_the_measured_peak(dtype):
    # VGGT-1B's width at 336x518 with 4 of its 24 layers (and 2 of the patch embedding's), 48 frames, chunks
    # (16, 16384): the reconstruction's peak allocated memory against the estimate
    from elsa_vision.inference.multiview import estimate_memory, reconstruct

    torch.manual_seed(0)
    model = ElsaVGGT.from_config("elsa_vggt", depth=4, patch_embed_depth=2,
                                 intermediate_layer_idx=(0, 1, 2, 3)).cuda().to(dtype).eval()
    model.set_chunks(16, 16384)
    images = torch.rand(48, 3, 336, 518, device="cuda")
    est = estimate_memory(model, 48, (336, 518), dtype, 16, 16384)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    reconstruct(model, images, dtype)
    peak = torch.cuda.max_memory_allocated()
    print(f"{dtype}: estimate {est['total'] / 2**30:.3f} GiB, measured {peak / 2**30:.3f} GiB, "
          f"ratio {peak / est['total']:.3f}")
    assert 0.8 <= peak / est["total"] <= 1.1


@pytest.mark.gpu
def test_gpu_inference_cli_plans_within_the_free_memory(tmp_path):
    frames, _ = _frames_and_weights(tmp_path)
    summary = infer_main(["--frames", str(frames), "--weights", str(tmp_path / "w.safetensors"), "--out",
                          str(tmp_path / "out"), "--device", "cuda", "--no-progress"])
    free, total = torch.cuda.mem_get_info()
    assert 0 < summary["memory_budget_gb"] <= total / 2**30  # the free memory with the model on the device
    assert summary["memory_estimate_gb"] < summary["memory_budget_gb"] and summary["peak_gpu_gb"] > 0
    assert (summary["frames_chunk"], summary["token_chunk"]) == (32, 65536)
