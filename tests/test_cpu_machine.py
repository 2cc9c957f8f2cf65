"""What a user on a CPU machine gets for GPU-only settings: one-line refusals at build time, not tracebacks.

The test session runs Triton in its CPU interpreter (``tests/conftest.py``); ``cpu_machine`` takes both that
and CUDA away, which is the machine a newcomer has.
"""

from __future__ import annotations

import hydra
import pytest
import timm
import torch
from hydra.errors import InstantiationException

from elsa_vision.models import ElsaCLIPVision, ElsaHSIViT, ElsaVGGT
from tests.train_helpers import TINY_NET, compose_cfg


@pytest.fixture
def cpu_machine(monkeypatch):
    """No CUDA, and Triton's interpreter off."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TRITON_INTERPRET", "0")


BUILDS = {
    "ElsaViT": lambda backend: timm.create_model(
        "elsa_vit_tiny_patch16_224", img_size=32, depth=1, attn_backend=backend),
    "ElsaSwinV2": lambda backend: timm.create_model(
        "elsa_swinv2_tiny_window8_256", img_size=64, depths=(1, 1, 1, 1), attn_backend=backend),
    "ElsaHSIViT": lambda backend: ElsaHSIViT(
        8, 3, embed_dim=32, num_heads=2, branch_depth=1, fusion_depth=1, attn_backend=backend),
    "ElsaCLIPVision": lambda backend: ElsaCLIPVision(
        image_size=32, patch_size=16, width=32, layers=1, heads=2, output_dim=16, attn_backend=backend),
    "ElsaVGGT": lambda backend: ElsaVGGT.from_config("elsa_vggt_small", attn_backend=backend),
}


@pytest.mark.parametrize("who", sorted(BUILDS))
def test_triton_backend_refused_at_build_time(who, cpu_machine):
    refusal = "backend='triton' needs a CUDA GPU"
    with pytest.raises(ValueError, match=rf"^{who}: attn_{refusal}.*attn_backend='auto'"):
        BUILDS[who]("triton")
    model = BUILDS[who]("auto")
    with pytest.raises(ValueError, match=rf"^{who}\.set_attention: (attn_)?{refusal}"):
        model.set_attention(backend="triton")


def test_triton_backend_builds_where_triton_runs():
    """With CUDA, or with Triton's interpreter (this session), the Triton backend builds."""
    for build in BUILDS.values():
        build("triton")


def test_config_with_triton_backend_refused_in_one_line(cpu_machine, tmp_path):
    """``python train.py model.attention.backend=triton`` stops when the model is built, with one line."""
    cfg = compose_cfg("train", TINY_NET + ["model.attention.backend=triton"], tmp_path / "run")
    with pytest.raises(InstantiationException, match="attn_backend='triton' needs a CUDA GPU"):
        hydra.utils.instantiate(cfg.model, _convert_="partial")


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)


GPU_ONLY = [  # the README's GPU commands
    ["trainer=gpu"],
    ["trainer=ddp", "trainer.devices=4"],
    ["trainer=fsdp", "model=elsa_vit_l"],
    ["trainer=cp", "trainer.devices=2"],
    ["experiment=imagenet_vit_b", "data.root=/data/imagenet"],
    ["experiment=finetune_imagefolder", "data.root=/data/flowers"],
]
ONE_LINE = (r"^trainer\.accelerator=gpu needs a GPU and this machine has none: run on a GPU machine or pass "
            r"trainer\.accelerator=cpu$")


@pytest.mark.parametrize("overrides", GPU_ONLY, ids=lambda o: o[0])
def test_gpu_trainer_refused_in_one_line(overrides, no_gpu, tmp_path):
    """Instead of Lightning's ``No supported gpu backend found!``, before data or model are built."""
    from elsa_vision.tasks.train import train

    with pytest.raises(ValueError, match=ONE_LINE):
        train(compose_cfg("train", overrides, tmp_path / "run"))


def test_gpu_evaluation_refused_in_one_line(no_gpu, tmp_path):
    from elsa_vision.tasks.evaluate import evaluate

    overrides = ["trainer=gpu", "model.pretrained_file=/weights/vit.safetensors"]
    cfg = compose_cfg("eval", overrides, tmp_path / "run")
    with pytest.raises(ValueError, match=ONE_LINE):
        evaluate(cfg)


def test_cpu_and_auto_accelerators_pass(no_gpu):
    from elsa_vision.utils.accelerator import check_accelerator

    for accelerator in ("cpu", "auto"):
        check_accelerator({"accelerator": accelerator})
    with pytest.raises(ValueError, match="trainer.accelerator=cuda needs a CUDA GPU"):
        check_accelerator({"accelerator": "cuda"})


def test_device_the_machine_lacks_is_refused_in_one_line(cpu_machine, monkeypatch):
    from elsa_vision.utils.accelerator import resolve_device

    assert resolve_device(None) == torch.device("cpu")
    assert resolve_device("cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^--device cuda: this machine has no CUDA GPU; pass --device cpu$"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"^--device 'gpu0' is not a torch device"):
        resolve_device("gpu0")
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(ValueError, match="no Apple MPS device"):
        resolve_device("mps")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert resolve_device(None) == torch.device("cuda")
    with pytest.raises(ValueError, match=r"^--device cuda:3: this machine has 1 CUDA device\(s\)$"):
        resolve_device("cuda:3")


def test_inference_clis_refuse_a_missing_gpu_before_reading(cpu_machine, tmp_path, capsys):
    """--device cuda on a CPU machine: one line naming the setting, before any file is read (the files here
    do not exist)."""
    from elsa_vision.inference import hsi, multiview

    with pytest.raises(ValueError, match=r"^device cuda: this machine has no CUDA GPU"):
        hsi.main(["--checkpoint", str(tmp_path / "no.ckpt"), "--input", str(tmp_path / "no.mat"),
                  "--out", str(tmp_path / "h"), "--device", "cuda"])
    with pytest.raises(SystemExit) as exit_info:
        multiview.main(["--frames", str(tmp_path / "none"), "--weights", str(tmp_path / "no.pt"),
                        "--out", str(tmp_path / "m"), "--device", "cuda"])
    assert exit_info.value.code == 2
    assert "--device cuda: this machine has no CUDA GPU" in capsys.readouterr().err
