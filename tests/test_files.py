"""elsa_vision.files: checkpoints read without executing anything, declared sizes checked before decoding,
atomic writes, output directories checked before work starts."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from PIL import Image

from elsa_vision.files import (
    NotACheckpointError,
    UnsafeCheckpointError,
    checkpoint_kind,
    read_checkpoint,
)


class _Touch:
    """Pickles to a call of os.system (what an attacker's "checkpoint" does on a plain pickle load)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_files_that_are_not_checkpoints_are_named(tmp_path):
    Image.new("RGB", (4, 4)).save(tmp_path / "photo.jpg")
    (tmp_path / "notes.ckpt").write_text("epoch=3\n")
    (tmp_path / "empty.pt").write_bytes(b"")
    for name, what in (("photo.jpg", "a JPEG image"), ("notes.ckpt", "a text file"), ("empty.pt", "empty")):
        with pytest.raises(NotACheckpointError, match=rf"{name}' is not a checkpoint: it is {what}"):
            read_checkpoint(tmp_path / name)
    with pytest.raises(FileNotFoundError, match="missing.ckpt"):
        read_checkpoint(tmp_path / "missing.ckpt")


def test_pickled_code_is_refused_not_run(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "hook": _Touch(marker)}, tmp_path / "evil.ckpt")
    refused = r"evil\.ckpt' holds Python objects.*names (posix|os)\.system"
    with pytest.raises(UnsafeCheckpointError, match=refused) as e:
        read_checkpoint(tmp_path / "evil.ckpt")
    assert "weights_only=False" not in str(e.value)
    assert not marker.exists()
    with open(tmp_path / "legacy.pt", "wb") as f:  # the pre-zip torch.save format, same refusal
        torch.save({"hook": _Touch(marker)}, f, _use_new_zipfile_serialization=False)
    assert checkpoint_kind(tmp_path / "legacy.pt") == "torch-legacy"
    with pytest.raises(UnsafeCheckpointError):
        read_checkpoint(tmp_path / "legacy.pt")
    assert not marker.exists()
    (tmp_path / "plain.pkl").write_bytes(pickle.dumps(_Touch(marker)))
    with pytest.raises(NotACheckpointError):
        read_checkpoint(tmp_path / "plain.pkl")
    assert not marker.exists()


def test_truncated_checkpoint_and_torchscript_are_reported(tmp_path):
    torch.save({"w": torch.randn(64, 64)}, tmp_path / "full.pt")
    data = (tmp_path / "full.pt").read_bytes()
    (tmp_path / "cut.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.pt"):
        read_checkpoint(tmp_path / "cut.pt")
    assert torch.equal(read_checkpoint(tmp_path / "full.pt")["w"], torch.load(tmp_path / "full.pt")["w"])
    scripted = torch.jit.script(torch.nn.Linear(2, 3))
    torch.jit.save(scripted, str(tmp_path / "lin.pt"))
    with pytest.raises(ValueError, match="TorchScript archive, not a checkpoint"):
        read_checkpoint(tmp_path / "lin.pt")
    sd = read_checkpoint(tmp_path / "lin.pt", torchscript=True)
    assert sd.keys() == {"weight", "bias"} and torch.equal(sd["weight"], scripted.weight.detach())
