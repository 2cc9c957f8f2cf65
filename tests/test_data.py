"""Data modules: the digits split, robust class-folder loading, ImageNet transforms, bad inputs."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.utils.data import DataLoader

from elsa_vision.data import (
    DigitsDataModule,
    ImageFolderDataModule,
    ImageNetDataModule,
    RobustImageFolder,
    load_digits_splits,
    load_rgb,
)
from tests.train_helpers import make_image_tree, write_image


# ------------------------------------------------------------------------------------------------ digits
def test_digits_split_is_fixed_stratified_and_disjoint():
    a = load_digits_splits(seed=0)
    b = load_digits_splits(seed=0)
    sizes = {k: len(v[1]) for k, v in a.items()}
    assert sizes == {"train": 1257, "val": 180, "test": 360}
    for k in a:
        assert torch.equal(a[k][0], b[k][0]) and torch.equal(a[k][1], b[k][1])
        assert a[k][0].shape[1:] == (1, 32, 32) and a[k][0].dtype == torch.float32
        assert 0.0 <= float(a[k][0].min()) and float(a[k][0].max()) <= 1.0
    # stratified: every class holds the same share of each split as of the whole set (within one sample)
    all_y = torch.cat([a[k][1] for k in a])
    for k, (_, y) in a.items():
        expected = torch.bincount(all_y, minlength=10).double() * len(y) / len(all_y)
        assert (torch.bincount(y, minlength=10).double() - expected).abs().max() <= 1.0, k
    # disjoint: no image appears in two splits (the 8x8 originals are distinct per index)
    flat = {k: {tuple(x.flatten().tolist()) for x in v[0][:, :, ::4, ::4]} for k, v in a.items()}
    assert len(flat["test"] & flat["train"]) < 5  # the raw data itself has a few exact duplicates
    c = load_digits_splits(seed=1)
    assert not torch.equal(a["test"][1], c["test"][1])


def test_digits_upsampling_preserves_the_native_image():
    native = load_digits_splits(img_size=8)["train"][0]
    up = load_digits_splits(img_size=32)["train"][0]
    down = torch.nn.functional.avg_pool2d(up, 4).flatten(1)
    native = native.flatten(1)
    # bilinear blur moves some mass between neighbouring pixels, but every image stays itself: its
    # pooled upsample is nearer to its own native image than to any other one
    assert (down - native).norm() / native.norm() < 0.25
    nearest = torch.cdist(down, native).argmin(dim=1)
    assert (nearest == torch.arange(len(native))).float().mean() > 0.99


def test_digits_datamodule_loaders_and_channels():
    dm = DigitsDataModule(batch_size=50, in_chans=3)
    dm.setup()
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (50, 3, 32, 32) and y.shape == (50,)
    assert torch.equal(x[:, 0], x[:, 2])
    xt = torch.cat([b[0] for b in dm.test_dataloader()])
    assert xt.shape[0] == 360
    # standardised with the training statistics
    xtr = torch.stack([dm.data_train.images[i] for i in range(len(dm.data_train))])
    assert abs(float(((xtr - dm.data_train.mean) / dm.data_train.std).mean())) < 1e-4


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(img_size=4), "img_size"),
        (dict(in_chans=2), "in_chans"),
        (dict(num_classes=12), "num_classes"),
        (dict(batch_size=0), "batch_size"),
    ],
)
def test_digits_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DigitsDataModule(**kwargs)


# ------------------------------------------------------------------------------------------ image folder
@pytest.fixture
def messy_tree(tmp_path):
    """A class-folder tree with every kind of awkward file next to clean ones."""
    root = make_image_tree(tmp_path / "ds", classes=("a", "b"), n_train=3, n_val=2)
    tr = root / "train"
    write_image(tr / "a" / "gray.png", "L")
    write_image(tr / "a" / "rgba.png", "RGBA")
    write_image(tr / "a" / "la.png", "LA")
    write_image(tr / "b" / "cmyk.jpg", "CMYK")
    write_image(tr / "b" / "sixteen.png", "I;16")
    (tr / "a" / "zero.jpg").write_bytes(b"")
    good = (tr / "b" / "0.png").read_bytes()
    (tr / "b" / "truncated.png").write_bytes(good[: len(good) // 2])
    write_image(tmp_path / "full.jpg", "RGB", size=(64, 64))
    jpg = (tmp_path / "full.jpg").read_bytes()
    (tr / "b" / "truncated.jpg").write_bytes(jpg[: len(jpg) // 3])
    (tr / "a" / "garbage.jpg").write_bytes(b"this is not an image" * 10)
    (tr / "a" / "notes.txt").write_text("ignored: not an image extension")
    return root


@pytest.mark.parametrize("mode", ["RGB", "RGBA", "L", "LA", "CMYK", "I;16"])
def test_load_rgb_converts_every_mode(tmp_path, mode):
    p = write_image(tmp_path / ("x.jpg" if mode == "CMYK" else "x.png"), mode)
    img = load_rgb(p)
    assert img.mode == "RGB" and img.size == (20, 24)
    assert load_rgb(p, "L").mode == "L"


def test_robust_image_folder_skips_and_counts(messy_tree, caplog):
    from timm.data import create_transform

    tf = create_transform(input_size=(3, 16, 16), is_training=False, crop_pct=1.0)
    with caplog.at_level(logging.WARNING, logger="elsa_vision.data.imagefolder"):
        ds = RobustImageFolder(messy_tree / "train", tf)
        # zero-byte file dropped (and logged) at scan time; .txt ignored
        assert "zero.jpg" in caplog.text
        assert all(not p.endswith(("zero.jpg", ".txt")) for p, _ in ds.samples)
        assert len(ds) == 3 * 2 + 5 + 3  # clean + converted modes + 3 broken (still listed)
        loader = DataLoader(ds, batch_size=len(ds), shuffle=False, num_workers=0)
        x, y = next(iter(loader))  # collate sees only good samples
    assert x.shape == (len(ds), 3, 16, 16) and torch.isfinite(x).all()
    broken = {p.rsplit("/", 1)[-1] for p in ds.skipped}
    assert {"zero.jpg", "truncated.png", "truncated.jpg", "garbage.jpg"} <= broken
    for name in ("truncated.png", "truncated.jpg", "garbage.jpg"):
        assert name in caplog.text
    assert "skipped so far" in caplog.text


def test_robust_image_folder_verify_drops_broken_up_front(messy_tree):
    ds = RobustImageFolder(messy_tree / "train", verify=True)
    names = {p.rsplit("/", 1)[-1] for p, _ in ds.samples}
    assert not names & {"truncated.png", "truncated.jpg", "garbage.jpg", "zero.jpg"}
    assert len(ds) == 3 * 2 + 5
    assert all(ds[i][0].mode == "RGB" for i in range(len(ds)))


def test_imagefolder_datamodule_batches(messy_tree):
    dm = ImageFolderDataModule(root=str(messy_tree), img_size=32, batch_size=4, num_workers=0)
    dm.setup("fit")
    assert dm.num_classes == 2 and dm.class_names == ("a", "b")
    for x, y in dm.train_dataloader():
        assert x.shape == (4, 3, 32, 32) and y.dtype == torch.int64
    x, _ = next(iter(dm.test_dataloader()))  # no test/: falls back to val
    assert x.shape[1:] == (3, 32, 32)
    grey = ImageFolderDataModule(root=str(messy_tree), img_size=32, in_chans=1, batch_size=2, num_workers=0)
    grey.setup("fit")
    assert next(iter(grey.val_dataloader()))[0].shape == (2, 1, 32, 32)


def test_empty_class_folder_is_an_error_naming_it(tmp_path):
    root = make_image_tree(tmp_path / "ds")
    (root / "train" / "empty_class").mkdir()
    dm = ImageFolderDataModule(root=str(root), img_size=32, num_workers=0)
    with pytest.raises(ValueError, match=r"class folder .*empty_class.* holds no non-empty image"):
        dm.setup("fit")
    # a folder whose only image is zero bytes is empty too
    (root / "train" / "empty_class" / "z.png").write_bytes(b"")
    with pytest.raises(ValueError, match="empty_class"):
        RobustImageFolder(root / "train")


def test_missing_root_and_split_are_errors_naming_them(tmp_path):
    missing = tmp_path / "no_such_dataset"
    with pytest.raises(FileNotFoundError, match="no_such_dataset"):
        ImageFolderDataModule(root=str(missing)).setup("fit")
    root = make_image_tree(tmp_path / "ds")
    for p in sorted((root / "val").rglob("*"), reverse=True):
        p.unlink() if p.is_file() else p.rmdir()
    (root / "val").rmdir()
    with pytest.raises(FileNotFoundError, match=r"ds/val"):
        ImageFolderDataModule(root=str(root)).setup("fit")


def test_class_mismatch_between_splits(tmp_path):
    root = make_image_tree(tmp_path / "ds")
    write_image(root / "val" / "bird" / "0.png")
    with pytest.raises(ValueError, match=r"extra \['bird'\]"):
        ImageFolderDataModule(root=str(root), num_workers=0).setup("fit")
    root2 = make_image_tree(tmp_path / "ds2")
    with pytest.raises(ValueError, match="num_classes=5"):
        ImageFolderDataModule(root=str(root2), num_classes=5, num_workers=0).setup("fit")


# ------------------------------------------------------------------------------------------------ imagenet
def test_imagenet_transforms_follow_the_models_data_config(tmp_path):
    import timm

    from elsa_vision.tasks import model_data_config

    root = make_image_tree(
        tmp_path / "in1k", classes=("n01440764", "n01443537"), n_train=2, n_val=1, size=(300, 200)
    )
    dm = ImageNetDataModule(root=str(root), num_classes=2, batch_size=2, num_workers=0)
    # timm's ImageNet defaults until the model's data config arrives
    assert dm.data_config["mean"] == (0.485, 0.456, 0.406) and dm.data_config["crop_pct"] == 0.875
    dm.setup("fit")
    with torch.device("meta"):
        net = timm.create_model("elsa_vit_small_patch16_224", depth=1)
    dm.set_data_config(model_data_config(net))  # datasets already built get the new transforms
    assert dm.data_config["mean"] == (0.5, 0.5, 0.5) and dm.data_config["crop_pct"] == 0.9
    x, _ = next(iter(dm.val_dataloader()))
    assert x.shape == (2, 3, 224, 224)
    # eval = resize(224 / 0.9) + centre crop + normalise(0.5, 0.5): values span [-1, 1]
    assert -1.0 - 1e-6 <= float(x.min()) and float(x.max()) <= 1.0 + 1e-6
    xt, _ = next(iter(dm.train_dataloader()))
    assert xt.shape == (2, 3, 224, 224)
    # under a Trainer the data module takes the config of the model being fit by itself (a driver that only
    # calls trainer.fit(model, datamodule) gets it too); a config it was given is kept
    from types import SimpleNamespace

    fresh = ImageNetDataModule(root=str(root), num_classes=2, batch_size=2, num_workers=0)
    fresh.trainer = SimpleNamespace(lightning_module=SimpleNamespace(net=net))
    fresh.setup("fit")
    assert fresh.data_config["mean"] == (0.5, 0.5, 0.5) and fresh.data_config["crop_pct"] == 0.9
    given = ImageNetDataModule(root=str(root), num_classes=2, batch_size=2, num_workers=0)
    given.set_data_config({"mean": (0.2, 0.2, 0.2), "std": (0.3, 0.3, 0.3), "crop_pct": 0.8})
    given.trainer = fresh.trainer
    given.setup("fit")
    assert given.data_config["mean"] == (0.2, 0.2, 0.2) and given.data_config["crop_pct"] == 0.8
    with pytest.raises(ValueError, match="in_chans"):
        ImageNetDataModule(root=str(root), in_chans=1)


def test_decompression_bomb_is_skipped_and_named(tmp_path, caplog):
    """A 69-byte PNG declaring 100000 x 100000 pixels in a class folder: refused before decoding, named in the
    log and skipped like an undecodable image (also by verify=True); nothing crashes in the loader."""
    from elsa_vision.files import FileTooLargeError
    from tests.helpers import bomb_png

    root = make_image_tree(tmp_path / "ds", classes=("a", "b"), n_train=3, n_val=1)
    bomb = bomb_png(root / "train" / "a" / "bomb.png")
    with pytest.raises(FileTooLargeError, match=r"bomb\.png' declares 10,000,000,000 pixels"):
        load_rgb(bomb)
    ds = RobustImageFolder(root / "train")
    with caplog.at_level(logging.WARNING):
        items = [ds[i] for i in range(len(ds))]
    assert len(items) == len(ds) == 7 and str(bomb) in ds.skipped
    assert "bomb.png" in caplog.text and "declares 10,000,000,000 pixels" in caplog.text
    verified = RobustImageFolder(root / "train", verify=True)
    assert str(bomb) not in [p for p, _ in verified.samples] and len(verified) == 6


def test_loaders_start_no_more_workers_than_usable_cpus(monkeypatch, caplog):
    """num_workers above the CPUs this process may use (4 on a 2-core machine) is lowered to them, logged
    once: torch warned at every loader it started (twice per zero-shot run)."""
    import elsa_vision.data.samplers as samplers
    from elsa_vision.data.samplers import epoch_loader, usable_workers

    monkeypatch.setattr(samplers.os, "sched_getaffinity", lambda pid: {0, 1}, raising=False)
    monkeypatch.setattr(samplers, "_lowered", set())
    ds = torch.utils.data.TensorDataset(torch.arange(8.0))
    with caplog.at_level(logging.INFO, logger="elsa_vision.data.samplers"):
        loaders = [epoch_loader(ds, train, batch_size=2, seed=0, num_workers=4, pin_memory=False)
                   for train in (True, False)]
    assert [loader.num_workers for loader in loaders] == [2, 2]
    assert [r.getMessage() for r in caplog.records] == [
        "num_workers=4 lowered to 2: this process may run on 2 CPUs"]
    assert usable_workers(0) == 0 and usable_workers(2) == 2
    with pytest.raises(ValueError, match="num_workers must be >= 0"):
        usable_workers(-1)
