"""train(cfg): smoke runs, exact resume, DDP on CPU, bad inputs, the CLI's JSON line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
import torch
from hydra.errors import InstantiationException, MissingConfigException
from torchmetrics.classification import MulticlassAccuracy

import elsa_vision.tasks.train as train_mod
from elsa_vision.tasks import ClassificationModule, cosine_warmup_schedule, step_accuracy
from elsa_vision.tasks.train import train
from tests.helpers import device_reads
from tests.train_helpers import (
    QUIET,
    ROOT,
    TINY_NET,
    StopAfterEpoch,
    compose_cfg,
    make_image_tree,
    write_image,
)

FAST = ["trainer.limit_train_batches=3", "trainer.limit_val_batches=2", "trainer.limit_test_batches=2"]


def test_train_digits_smoke(tmp_path):
    cfg = compose_cfg("train", TINY_NET + FAST + ["trainer.max_epochs=1", "logger=csv"], tmp_path / "run")
    metrics, obj = train(cfg)
    run = tmp_path / "run"
    for rel in ("checkpoints/last.ckpt", "metrics.csv", "curves.png", "config_resolved.yaml"):
        assert (run / rel).is_file(), rel
    assert obj["best_checkpoint"] and os.path.isfile(obj["best_checkpoint"])
    for key in ("train/loss", "val/acc", "val/acc5", "test/acc", "test/acc5", "test/loss"):
        assert key in metrics, key
    assert 0.0 <= metrics["test/acc"] <= metrics["test/acc5"] <= 1.0
    # checkpoints load without unpickling code
    ckpt = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["epoch"] == 0 and "lr_schedulers" in ckpt and "optimizer_states" in ckpt
    assert ckpt["hyper_parameters"]["attention"] == {"backend": "auto", "precision": "auto"}


def test_default_config_is_digits_on_cpu(tmp_path):
    cfg = compose_cfg("train", [], tmp_path / "run")
    assert cfg.data._target_.endswith("DigitsDataModule") and cfg.trainer.accelerator == "cpu"
    assert cfg.model.net.img_size == 32 and cfg.model.net.patch_size == 8 and cfg.model.net.in_chans == 1
    assert cfg.model.net.attn_backend == cfg.model.attention.backend


@pytest.mark.parametrize("model", ["elsa_vit_t", "elsa_vit_s", "elsa_vit_b", "elsa_vit_l"])
def test_every_model_config_adapts_to_the_data(tmp_path, model):
    import hydra

    cfg = compose_cfg("train", [f"model={model}", "+model.net.depth=1"], tmp_path / "run")
    net = hydra.utils.instantiate(cfg.model.net)
    # the data's image size, channels and classes; the model's own patch size
    assert net.patch_embed.img_size == (32, 32) and net.patch_embed.patch_size == (16, 16)
    assert net.patch_embed.proj.in_channels == 1 and net.head.out_features == 10
    assert net(torch.randn(2, 1, 32, 32)).shape == (2, 10)


def test_train_vit_s_fast_dev_run_with_mixup_and_attention_options(tmp_path):
    cfg = compose_cfg(
        "train",
        [
            "model=elsa_vit_s",
            "+model.net.depth=1",
            "debug=fdr",
            "data.batch_size=8",
            "model.attention.backend=torch",
            "model.attention.precision=ieee",
            "+model.mixup={mixup_alpha: 0.8, cutmix_alpha: 1.0, prob: 1.0, switch_prob: 0.5, mode: batch}",
        ],
        tmp_path / "run",
    )
    metrics, obj = train(cfg)
    net = obj["model"].net
    assert net.blocks[0].attn.backend == "torch" and net.blocks[0].attn.precision == "ieee"
    assert obj["model"].mixup_fn is not None and "train/loss" in metrics


def test_resume_matches_uninterrupted_run(tmp_path, monkeypatch):
    base = (
        TINY_NET
        + QUIET
        + [
            "trainer.limit_train_batches=4",
            "trainer.limit_val_batches=1",
            "test=false",
            "trainer.max_epochs=2",
            "trainer.min_epochs=1",
            "model.net.drop_path_rate=0.1",
            "+model.mixup={mixup_alpha: 0.8, cutmix_alpha: 0.0, prob: 0.5}",
        ]
    )
    _, full = train(compose_cfg("train", base, tmp_path / "full"))
    assert full["trainer"].current_epoch == 2

    orig = train_mod.instantiate_callbacks
    monkeypatch.setattr(train_mod, "instantiate_callbacks", lambda c: orig(c) + [StopAfterEpoch(1)])
    _, part = train(compose_cfg("train", base, tmp_path / "resumed"))
    monkeypatch.undo()
    assert part["trainer"].current_epoch == 1
    first = {k: v.clone() for k, v in part["model"].net.state_dict().items()}

    _, resumed = train(compose_cfg("train", base + ["ckpt_path=last"], tmp_path / "resumed"))
    tr = resumed["trainer"]
    assert tr.current_epoch == 2 and tr.global_step == 8
    sched = tr.lr_scheduler_configs[0].scheduler
    assert sched.last_epoch == 8  # the LambdaLR continued, per step
    a, b = full["model"].net.state_dict(), resumed["model"].net.state_dict()
    moved = max(float((b[k] - first[k]).abs().max()) for k in a)
    assert moved > 1e-4  # the second epoch really trained
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= 1e-6, f"resumed weights differ from the uninterrupted run by {worst}"


def test_resume_last_without_checkpoint_is_an_error(tmp_path):
    cfg = compose_cfg("train", TINY_NET + ["ckpt_path=last"], tmp_path / "sub" / "run")
    with pytest.raises(FileNotFoundError, match="no last.ckpt"):
        train(cfg)
    cfg = compose_cfg("train", TINY_NET + ["ckpt_path=/no/such/file.ckpt"], tmp_path / "run")
    with pytest.raises(FileNotFoundError, match="/no/such/file.ckpt"):
        train(cfg)


def test_cosine_warmup_schedule_shape():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    s = cosine_warmup_schedule(
        opt, total_steps=100, steps_per_epoch=10, warmup_epochs=2, warmup_lr_ratio=0.0, min_lr_ratio=0.1
    )
    lrs = []
    for _ in range(100):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        s.step()
    assert lrs[0] == 0.0 and abs(lrs[10] - 0.5) < 1e-12 and abs(lrs[20] - 1.0) < 1e-12
    assert abs(lrs[60] - (0.1 + 0.9 * 0.5)) < 1e-12  # half-way through the cosine
    assert all(x >= y for x, y in zip(lrs[20:], lrs[21:])) and lrs[-1] > 0.1
    with pytest.raises(ValueError, match="total_steps"):
        cosine_warmup_schedule(opt, total_steps=0, steps_per_epoch=1)


def test_module_rejects_bad_arguments():
    net = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="num_classes"):
        ClassificationModule(net, optimizer=torch.optim.SGD, num_classes=1)
    with pytest.raises(ValueError, match="label_smoothing"):
        ClassificationModule(net, optimizer=torch.optim.SGD, num_classes=3, label_smoothing=1.0)


def test_training_step_reads_nothing_back_from_the_device():
    # A value read back (``.item()``, ``bool(tensor)``, the size of ``unique``'s output) in the step would
    # make the host wait for the forward before it launches the backward: torchmetrics' NaN check of the loss
    # mean did once per step.
    torch.manual_seed(0)
    module = ClassificationModule(torch.nn.Linear(4, 3), optimizer=torch.optim.SGD, num_classes=3)
    batch = (torch.randn(6, 4), torch.randint(0, 3, (6,)))
    with device_reads() as mode:
        loss = module.training_step(batch, 0)
    assert mode.seen == [] and loss.requires_grad
    module.validation_step(batch, 0)  # (its top-5 accuracy reads the labels back: torchmetrics' one_hot)
    torch.testing.assert_close(module.train_loss.compute(), loss.detach())
    assert module.train_acc.compute() == module.val_acc.compute()


def test_device_reads_sees_the_checks_that_wait_for_the_device():
    from torchmetrics.classification import MulticlassAccuracy

    logits, y = torch.randn(6, 3), torch.randint(0, 3, (6,))
    with device_reads() as mode:
        MulticlassAccuracy(3, average="micro").update(logits.argmax(-1), y)  # label check: unique x 2
        _ = logits[logits > 0]
        torch.tensor(1.0).item()
    unique, index, item = "aten._unique2.default", "aten.index.Tensor", "aten._local_scalar_dense.default"
    assert mode.seen == [unique, unique, index, item]
    with device_reads() as mode:
        step_accuracy(3).update(logits.argmax(-1), y)
        step_accuracy(3).update(logits, y)
        _ = logits[torch.tensor([0, 2])]  # integer indices: no wait
    assert mode.seen == []


def test_step_accuracy_counts_as_torchmetrics_accuracy():
    g = torch.Generator().manual_seed(3)
    acc, ref = step_accuracy(5), MulticlassAccuracy(5, top_k=1, average="micro")
    for _ in range(3):
        logits, y = torch.randn(17, 5, generator=g), torch.randint(0, 5, (17,), generator=g)
        acc.update(logits, y)
        ref.update(logits, y)
        acc.update(logits.argmax(-1), y)  # label predictions (the hyperspectral task's)
        ref.update(logits.argmax(-1), y)
    assert acc.compute() == ref.compute() and 0 < acc.compute() < 1


def test_loss_mean_keeps_a_nan_step_visible():
    from elsa_vision.tasks import loss_mean

    m = loss_mean()
    for v in (1.0, 2.0, 4.5):
        m.update(torch.tensor(v))
    assert m.compute().item() == 2.5
    m.update(torch.tensor(float("nan")))  # a diverged step: the epoch's mean shows it, not drops it
    assert m.compute().isnan()


def test_ddp_two_cpu_processes_run_a_step(tmp_path):
    cfg = compose_cfg(
        "train",
        TINY_NET
        + QUIET
        + [
            "trainer=ddp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.strategy.start_method=spawn",
            "trainer.max_epochs=1",
            "trainer.limit_train_batches=2",
            "trainer.limit_val_batches=1",
            "test=false",
            "data.batch_size=16",
        ],
        tmp_path / "run",
    )
    metrics, obj = train(cfg)
    tr = obj["trainer"]
    assert tr.world_size == 2 and tr.strategy._get_process_group_backend() == "gloo"
    # the workers' results come back to this process: metrics, and the checkpoint rank 0 wrote
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    ckpt = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["global_step"] == 2  # 2 steps of 2 processes x 16 images


def test_fsdp_config_wraps_timm_blocks(tmp_path):
    import hydra
    from timm.models.vision_transformer import Block

    cfg = compose_cfg(
        "train", ["trainer=fsdp", "trainer.strategy.activation_checkpointing=true"], tmp_path / "r"
    )
    strategy = hydra.utils.instantiate(cfg.trainer.strategy)
    assert strategy.kwargs["auto_wrap_policy"]._module_classes == {Block}
    assert strategy._activation_checkpointing_kwargs


def test_train_on_messy_imagefolder(tmp_path):
    root = make_image_tree(tmp_path / "ds", classes=("a", "b", "c"), n_train=4, n_val=2)
    write_image(root / "train" / "a" / "rgba.png", "RGBA")
    write_image(root / "train" / "b" / "gray.png", "L")
    (root / "train" / "c" / "zero.png").write_bytes(b"")
    (root / "train" / "c" / "broken.png").write_bytes((root / "train" / "c" / "0.png").read_bytes()[:60])
    cfg = compose_cfg(
        "train",
        TINY_NET
        + QUIET
        + [
            "data=imagefolder",
            f"data.root={root}",
            "data.img_size=32",
            "model.net.patch_size=8",
            "data.batch_size=4",
            "data.num_workers=0",
            "trainer.max_epochs=1",
        ],
        tmp_path / "run",
    )
    metrics, obj = train(cfg)
    assert cfg.data.num_classes == 3 and obj["model"].net.head.out_features == 3
    # transforms normalise as the model's pretrained cfg says (timm's resolve_data_config of the model)
    assert obj["datamodule"].data_config["mean"] == obj["model"].net.pretrained_cfg["mean"] == (0.5, 0.5, 0.5)
    assert "test/acc" in metrics


def test_missing_data_root_names_it(tmp_path):
    cfg = compose_cfg(
        "train", TINY_NET + ["data=imagefolder", f"data.root={tmp_path}/nowhere"], tmp_path / "r"
    )
    with pytest.raises(FileNotFoundError, match="nowhere"):
        train(cfg)


@pytest.mark.parametrize("group, name", [("model", "elsa_vit_xl"), ("data", "mnist")])
def test_unknown_group_option_lists_valid_names(tmp_path, group, name):
    with pytest.raises(MissingConfigException) as e:
        compose_cfg("train", [f"{group}={name}"], tmp_path / "r")
    valid = ["elsa_vit_b", "elsa_vit_digits", "elsa_vit_s"] if group == "model" else ["digits", "imagefolder"]
    for v in valid:
        assert v in str(e.value)


def test_cli_last_line_is_json_and_bad_names_exit_nonzero(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "train.py", "debug=fdr", "model.net.depth=1", f"hydra.run.dir={tmp_path}/cli"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    assert payload["run_dir"] == f"{tmp_path}/cli" and "train/loss" in payload["metrics"]
    bad = subprocess.run(
        [sys.executable, "train.py", "model=elsa_vit_xl"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode != 0
    assert "elsa_vit_xl" in bad.stderr and "elsa_vit_s" in bad.stderr and "elsa_vit_digits" in bad.stderr


def test_cli_logs_each_line_once_and_keeps_stdout_for_results(tmp_path):
    """``python train.py`` with stdout and stderr redirected, as a terminal shows both: every log line once
    (Lightning's own stderr handler no longer repeats what Hydra's console prints), no advertisement for
    Lightning's cloud packages, no torch deprecation about Lightning's internals, no "Total FLOPs: 0" (nothing
    was counted), the network named as it is built (the default is patch 8, width 96, depth 4, not the
    registered elsa_vit_tiny_patch16_224), and the progress bar on stderr: stdout holds the logs, the tables
    and, last, the JSON line."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "train.py", *FAST, "trainer.max_epochs=1", f"paths.log_dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    both = out.stdout + out.stderr
    assert both.count("Seed set to 12345") == 1 and both.count("`Trainer.fit` stopped") == 1, both[-3000:]
    assert "Tip:" not in both and "litlogger" not in both and "litmodels" not in both
    assert "LeafSpec" not in both and "FLOPs" not in both and "Total params" in out.stdout
    network = next(line for line in out.stdout.splitlines() if "Network: " in line)
    assert "ElsaViT" in network and "elsa_vit_tiny_patch16_224 with" in network
    assert all(f"{k}={v}" in network for k, v in (("patch_size", 8), ("embed_dim", 96), ("depth", 4)))
    assert "it/s" not in out.stdout and "Epoch 0: 100%" in out.stderr  # the bar: on stderr only
    payload = json.loads(out.stdout.strip().splitlines()[-1])
    assert payload["metrics"]["epochs"] == 1


def test_unknown_backbone_name_lists_registered_models(tmp_path):
    cfg = compose_cfg("train", ["model.net.model_name=elsa_vit_huge_patch16_224"], tmp_path / "r")
    # Hydra wraps errors raised while instantiating; the message is create_backbone's
    with pytest.raises(
        InstantiationException, match=r"unknown model_name 'elsa_vit_huge_patch16_224'.*elsa_vit_small"
    ):
        train(cfg)
    cfg = compose_cfg("train", ["model.pretrained_file=/no/weights.safetensors"], tmp_path / "r2")
    with pytest.raises(  # FileNotFoundError inside Hydra's wrapper
        InstantiationException,
        match=r"FileNotFoundError.*backbone: pretrained_file: '/no/weights\.safetensors' does not exist",
    ):
        train(cfg)
    # the model's patch size must tile the data's image size
    cfg = compose_cfg("train", ["model.net.patch_size=5"], tmp_path / "r3")
    with pytest.raises(InstantiationException, match=r"patch_size \(5\) must divide img_size \(32\)"):
        train(cfg)


def test_grad_checkpointing_keeps_the_gradients():
    """create_backbone(grad_checkpointing=True): timm's checkpointing of the blocks, the same loss and
    gradients as without (CPU, float64: bitwise); a model that cannot checkpoint is refused by name."""
    from elsa_vision.tasks import create_backbone

    kw = dict(img_size=32, patch_size=8, embed_dim=32, depth=3, num_heads=2, attn_backend="torch")
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    grads = []
    for ckpt in (False, True):
        torch.manual_seed(2)
        net = create_backbone("elsa_vit_tiny_patch16_224", num_classes=3, grad_checkpointing=ckpt, **kw)
        assert net.grad_checkpointing is ckpt
        net = net.double().train()
        net(x).square().sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in net.parameters()]))
    assert grads[1].abs().sum() > 0 and torch.equal(grads[0], grads[1])
    refused = r"^create_backbone: grad_checkpointing: convit_tiny does not support"
    with pytest.raises(ValueError, match=refused):
        create_backbone("convit_tiny", num_classes=2, grad_checkpointing=True)


def test_memory_check_counts_checkpointed_blocks_and_advises_it(tmp_path):
    """With model.net.grad_checkpointing=true a ViT keeps each block's input and one block's activations
    instead of every block's (``(6 + 2 r) N C`` floats each): the estimate drops by exactly that; a run that
    fits only with checkpointing is refused with that advice, and fits with it."""
    base = TINY_NET + ["data.img_size=512", "trainer.accelerator=cpu", "model.net.depth=4"]
    cfgs = {ckpt: compose_cfg("train", base + [f"model.net.grad_checkpointing={ckpt}"], tmp_path / "r")
            for ckpt in ("false", "true")}
    est = {ckpt: train_mod.check_training_memory(cfg, available_mb=1e9) for ckpt, cfg in cfgs.items()}
    net = train_mod._meta_network(cfgs["false"])
    tokens = net.patch_embed.num_patches + net.num_prefix_tokens
    kept = cfgs["false"].data.batch_size * tokens * net.embed_dim * 4 / 2**20  # one block's input, MiB
    per_block = (6 + 2 * 2.0) * kept  # TINY_NET's mlp_ratio 2
    assert est["false"] - est["true"] == pytest.approx(4 * per_block - (4 * kept + per_block), rel=1e-6)
    limit = (est["true"] + est["false"]) / 2
    with pytest.raises(ValueError, match=r"or set model\.net\.grad_checkpointing=true \(then about "):
        train_mod.check_training_memory(compose_cfg("train", base, tmp_path / "r"), available_mb=limit)
    with_ckpt = compose_cfg("train", base + ["model.net.grad_checkpointing=true"], tmp_path / "r")
    assert train_mod.check_training_memory(with_ckpt, available_mb=limit)


def test_pretrained_file_loads_through_timm_without_copying_the_weights(tmp_path, monkeypatch):
    """create_backbone(pretrained_file=...) hands the file's tensors to timm's loader (its filter fn drops a
    head of another width) without timm's pretrained cfg deep-copying them (twice the weights at peak)."""
    from safetensors.torch import save_file

    from elsa_vision.tasks import create_backbone

    kw = dict(img_size=32, patch_size=8, embed_dim=48, depth=2, num_heads=4)
    torch.manual_seed(1)
    src = create_backbone("elsa_vit_tiny_patch16_224", num_classes=5, **kw)
    path = tmp_path / "w.safetensors"
    save_file({k: v.contiguous() for k, v in src.state_dict().items()}, str(path))

    def refuse(self, memo):
        raise AssertionError("a weights tensor was deep-copied")

    monkeypatch.setattr(torch.Tensor, "__deepcopy__", refuse)
    net = create_backbone("elsa_vit_tiny_patch16_224", num_classes=3, pretrained_file=str(path), **kw)
    monkeypatch.undo()
    want, got = src.state_dict(), net.state_dict()
    assert got["head.weight"].shape == (3, 48)  # the 5-class head of the file is dropped
    for k, v in got.items():
        if not k.startswith("head."):
            torch.testing.assert_close(v, want[k], rtol=0, atol=0, msg=k)
    assert "state_dict" not in net.pretrained_cfg


def test_extras_num_threads(tmp_path):
    from elsa_vision.utils import extras

    before = torch.get_num_threads()
    try:
        extras(compose_cfg("train", ["extras.num_threads=1"], tmp_path / "r"))
        assert torch.get_num_threads() == 1
        with pytest.raises(ValueError, match="num_threads"):
            extras(compose_cfg("train", ["extras.num_threads=0"], tmp_path / "r"))
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("experiment", ["digits_vit_s", "imagenet_vit_b", "finetune_imagefolder"])
def test_experiment_configs_compose(tmp_path, experiment):
    import hydra

    cfg = compose_cfg("train", [f"experiment={experiment}", f"paths.data_dir={tmp_path}"], tmp_path / "r")
    dm = hydra.utils.instantiate(cfg.data, _convert_="partial")
    assert "patch_size" not in cfg.data and "model_name" not in cfg.data  # model hyperparameters stay out
    assert dm.hparams.img_size % cfg.model.net.patch_size == 0
    assert cfg.model.net.img_size == cfg.data.img_size and cfg.model.net.in_chans == cfg.data.in_chans
    if experiment == "imagenet_vit_b":
        assert cfg.model.net.model_name == "elsa_vit_base_patch16_224" and cfg.data.num_classes == 1000
        assert cfg.model.mixup.cutmix_alpha == 1.0 and cfg.trainer.strategy._target_.endswith("DDPStrategy")
        from elsa_vision.tasks import model_data_config

        with torch.device("meta"):
            net = hydra.utils.instantiate(cfg.model.net)
        dm.set_data_config(model_data_config(net))
        assert dm.data_config["crop_pct"] == 0.9  # from the model's pretrained cfg


def test_extras_max_image_pixels(tmp_path):
    from PIL import Image

    from elsa_vision.utils import extras

    before = Image.MAX_IMAGE_PIXELS
    try:
        extras(compose_cfg("train", ["extras.max_image_pixels=1000"], tmp_path / "r"))
        assert Image.MAX_IMAGE_PIXELS == 1000
        with pytest.raises(ValueError, match="max_image_pixels"):
            extras(compose_cfg("train", ["extras.max_image_pixels=0"], tmp_path / "r"))
    finally:
        Image.MAX_IMAGE_PIXELS = before


def test_refusals_come_before_the_data_or_the_model_is_built(tmp_path, monkeypatch):
    """A checkpoint that holds Python objects, a size that cannot fit in memory, a trainer that would train
    nothing: each is refused in one line before the data module (and so the model) is built."""
    import functools

    from elsa_vision.files import UnsafeCheckpointError
    from elsa_vision.utils.run import refusal_message

    monkeypatch.setattr(train_mod, "instantiate_data", lambda cfg: pytest.fail("the data was built"))
    torch.save({"state_dict": {"w": torch.ones(2)}, "hook": functools.partial(print)}, tmp_path / "evil.ckpt")
    cases = [
        ([f"ckpt_path={tmp_path / 'evil.ckpt'}"], UnsafeCheckpointError,
         r"^ckpt_path: '.*evil\.ckpt' holds Python objects"),
        (["data.img_size=100000"], ValueError,
         r"^data\.img_size=100000: training elsa_vit_tiny_patch16_224 needs at least [\d,.]+ GiB \(.*largest "
         r"pos_embed [\d,.]+ GiB.*\), more than the [\d,.]+ [GM]iB available .*; lower data\.img_size"),
        (["trainer.max_epochs=0"], ValueError, r"^trainer\.max_epochs=0: nothing would be trained"),
    ]
    for overrides, cls, refused in cases:
        with pytest.raises(cls, match=refused) as e:
            train(compose_cfg("train", TINY_NET + overrides, tmp_path / "r"))
        assert "\n" not in refusal_message(e.value)
    # activations: a moderate size with a small limit names the image size and the batch
    cfg = compose_cfg("train", TINY_NET + ["data.img_size=256"], tmp_path / "r")
    assert train_mod.check_training_memory(cfg, available_mb=1e6) < 1e6
    refused = (r"^data\.img_size=256: .*, more than the 10\.0 MiB available \(the given limit\); "
               r"lower data\.img_size or data\.batch_size$")
    with pytest.raises(ValueError, match=refused):
        train_mod.check_training_memory(cfg, available_mb=10)


def test_memory_check_counts_a_context_parallel_ranks_share_of_the_tokens(tmp_path):
    """Under trainer=cp each rank keeps the activations of 1/cp_size of an image's tokens: the estimate's
    activation part shrinks by cp_size (the parameters, optimizer state and input image stay whole)."""
    base = TINY_NET + ["data.img_size=512", "trainer.accelerator=cpu"]
    one = train_mod.check_training_memory(compose_cfg("train", base, tmp_path / "r"), available_mb=1e9)
    est = {}
    for cp in (1, 2, 4):
        cfg = compose_cfg("train", base + ["trainer=cp", "trainer.accelerator=cpu", f"trainer.devices={cp}",
                                           f"trainer.strategy.cp_size={cp}"], tmp_path / "r")
        est[cp] = train_mod.check_training_memory(cfg, available_mb=1e9)
    assert est[1] == pytest.approx(one)
    fixed = 2 * est[2] - est[1]  # parameters, state and input: what does not shrink
    assert 0 < fixed < est[2] < est[1]
    assert est[4] == pytest.approx(fixed + (est[1] - fixed) / 4, rel=1e-3)  # tokens 1025: ceil per rank


def test_cli_refusals_are_one_line_and_leave_no_run_directory(tmp_path):
    """A GPU setting on a machine without one and a missing HSI data file: one `error:` line on stderr, no
    traceback, no run directory left in the log directory (evaluate.py: tests/test_evaluate.py)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    calls = [
        ("train.py", ["model=elsa_hsi", "data=hsi", f"data.path={tmp_path / 'PaviaU.mat'}"],
         rf"error: data\.path: '{tmp_path}/PaviaU\.mat' does not exist or is not a file"),
    ]
    if not torch.cuda.is_available():
        calls.append(("train.py", ["trainer=gpu"], r"error: trainer\.accelerator=gpu needs a GPU"))
    for script, args, refused in calls:
        out = subprocess.run([sys.executable, script, *args, f"paths.log_dir={tmp_path / 'logs'}"], cwd=ROOT,
                             env=env, capture_output=True, text=True, timeout=300)
        assert out.returncode != 0 and out.stdout == "", out.stderr
        assert re.fullmatch(refused + r"[^\n]*\n", out.stderr), out.stderr
        assert not (tmp_path / "logs").exists(), list((tmp_path / "logs").rglob("*"))


@pytest.mark.gpu
def test_gpu_memory_check_uses_the_gpus_memory(tmp_path):
    """On a GPU machine the training memory check compares with the GPU's total memory (cuda:0) and names
    it; a digits model at data.img_size=100000 is refused, the default one fits."""
    from elsa_vision.utils.accelerator import available_memory_mb

    total, where = available_memory_mb("gpu")
    assert where == "cuda:0" and total == torch.cuda.get_device_properties(0).total_memory / 2**20
    fits = train_mod.check_training_memory(compose_cfg("train", ["trainer=gpu"], tmp_path / "r"))
    assert 0 < fits < total
    huge = compose_cfg("train", ["trainer=gpu", "data.img_size=100000"], tmp_path / "r")
    with pytest.raises(ValueError, match=r"^data\.img_size=100000: .* \(cuda:0\); lower data\.img_size"):
        train_mod.check_training_memory(huge)
