"""elsa_vision.files: checkpoints read without executing anything, declared sizes checked before decoding,
atomic writes, output directories checked before work starts."""

from __future__ import annotations

import json
import os
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

from elsa_vision.files import (
    OUTPUT_MANIFEST,
    FileTooLargeError,
    NotACheckpointError,
    UnsafeCheckpointError,
    atomic_torch_save,
    atomic_write,
    checkpoint_kind,
    link_atomically,
    open_image,
    prepare_output_dir,
    read_checkpoint,
    read_npy,
    read_safetensors_metadata,
    read_weights,
    record_outputs,
    remove_outputs,
    remove_stale_temp_files,
    submodule_weights,
    unwrap_weights,
)
from tests.helpers import bomb_png, forged_npy, forged_tiff


class _Settings:
    """A training script's own class, pickled into a checkpoint beside the weights."""

    def __init__(self, lr):
        self.lr = lr


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


def _rezip(src, dst, deflate):
    """``src`` (a torch.save zip) rewritten with the records whose names end with one of ``deflate``
    deflate-compressed."""
    import zipfile

    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        for info in zin.infolist():
            method = zipfile.ZIP_DEFLATED if info.filename.endswith(deflate) else zipfile.ZIP_STORED
            zout.writestr(info.filename, zin.read(info), compress_type=method)
    return dst


def _declare_record_size(path, name, size):
    """Overwrite the sizes the central directory of zip ``path`` declares for record ``name``."""
    import struct

    data = bytearray(path.read_bytes())
    end = data.rfind(b"PK\x05\x06")  # end of central directory: its offset at bytes 16..20
    pos = struct.unpack("<I", data[end + 16 : end + 20])[0]
    while data[pos + 46 : pos + 46 + len(name)] != name.encode():
        nlen, xlen, clen = struct.unpack("<HHH", data[pos + 28 : pos + 34])
        pos += 46 + nlen + xlen + clen
    data[pos + 20 : pos + 28] = struct.pack("<II", size, size)  # compressed and uncompressed sizes
    path.write_bytes(bytes(data))
    return path


class _Expanded(torch.nn.Module):
    """A TorchScript module whose buffer is one float viewed as 2**40 (stride 0)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.zeros(1).expand(2**40))

    def forward(self, x):
        return x


def test_compressed_or_overlapping_records_are_refused_before_inflating(tmp_path, monkeypatch):
    """A deflated data.pkl or data/N record inflates to whatever its header declares (here 8 MiB from a few
    KB); records reaching into each other would each be read in full. Refused from the zip directory,
    before torch.load reads any record."""
    torch.save({"w": torch.zeros(2**21)}, tmp_path / "plain.pt")
    assert read_checkpoint(tmp_path / "plain.pt")["w"].shape == (2**21,)
    bomb = _rezip(tmp_path / "plain.pt", tmp_path / "bomb.pt", deflate=("/data/0",))
    pickled = _rezip(tmp_path / "plain.pt", tmp_path / "pickle.pt", deflate=("/data.pkl",))
    assert bomb.stat().st_size < 64 * 2**10
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load read a refused archive"))
    with pytest.raises(ValueError, match=r"bomb\.pt': record '.*data/0' is compressed .* declaring 8,388,"):
        read_checkpoint(bomb)
    with pytest.raises(ValueError, match=r"pickle\.pt': record '.*data\.pkl' is compressed"):
        read_weights(pickled, arg="--weights")
    forged = _declare_record_size(tmp_path / "plain.pt", "plain/data/0", 2**30)
    with pytest.raises(ValueError, match=r"record 'plain/data/0' declares 1,073,741,824 bytes .* forged"):
        read_checkpoint(forged)
    scripted = torch.jit.script(torch.nn.Linear(2, 3))
    torch.jit.save(scripted, str(tmp_path / "lin.pt"))
    _rezip(tmp_path / "lin.pt", tmp_path / "lin_deflated.pt", deflate=("/data.pkl",))
    with pytest.raises(ValueError, match=r"record 'lin/data\.pkl' is compressed"):
        read_checkpoint(tmp_path / "lin_deflated.pt", torchscript=True)
    assert read_checkpoint(tmp_path / "lin.pt", torchscript=True).keys() == {"weight", "bias"}


def test_tensors_larger_than_their_storage_are_refused(tmp_path):
    """A stride-0 (expanded) view declares any number of elements over a few bytes: 3,000,000 classes from
    16 bytes, 2**40 floats in a TorchScript buffer; the same bytes viewed under many names likewise. Shared
    weights as modules save them (tied, registered twice, transposed) still load."""
    torch.save({"head.weight": torch.zeros(1, 4).expand(3_000_000, 4)}, tmp_path / "head.pt")
    assert (tmp_path / "head.pt").stat().st_size < 2000
    refused = r"head\.pt': tensor \['head\.weight'\] declares shape \(3000000, 4\) .* storage of 4 elements"
    with pytest.raises(ValueError, match=refused):
        read_weights(tmp_path / "head.pt")
    base = torch.randn(1024)
    torch.save({f"k{i}": base[i : i + 1000] for i in range(5)}, tmp_path / "views.pt")
    with pytest.raises(ValueError, match=r"views\.pt': its tensors describe 20,000 bytes over 4,096 bytes"):
        read_checkpoint(tmp_path / "views.pt")
    torch.jit.save(torch.jit.script(_Expanded()), str(tmp_path / "expanded.pt"))
    with pytest.raises(ValueError, match=r"expanded\.pt': tensor \['b'\] declares shape \(1099511627776,\)"):
        read_checkpoint(tmp_path / "expanded.pt", torchscript=True)
    emb = torch.nn.Embedding(10, 4)
    net = torch.nn.ModuleDict({"a": emb, "b": emb, "c": emb, "d": torch.nn.Linear(4, 10)})
    net["d"].weight = emb.weight  # tied: one storage, two names (and three registrations of emb)
    state = dict(net.state_dict(), transposed=emb.weight.detach().t())
    torch.save(state, tmp_path / "shared.pt")
    loaded = read_weights(tmp_path / "shared.pt")
    assert set(loaded) == set(state) and torch.equal(loaded["d.weight"], emb.weight.detach())


# --------------------------------------------------------------------------------------- declared sizes


def test_read_weights_unwraps_a_lightning_checkpoint(tmp_path):
    w, b = torch.randn(3, 2), torch.randn(3)
    torch.save(
        {
            "epoch": 3,
            "global_step": 30,
            "pytorch-lightning_version": "2.4.0",
            "state_dict": {"net.head.weight": w, "net.head.bias": b},
            "optimizer_states": [{"state": {0: {"exp_avg": torch.ones(3, 2)}}, "param_groups": []}],
            "lr_schedulers": [{"last_epoch": 3}],
            "hyper_parameters": {"lr": 0.1, "num_classes": 3},
            "loops": {"fit_loop": {"epoch_progress": {"current": {"completed": 3}}}},
        },
        tmp_path / "last.ckpt",
    )
    sd = read_weights(tmp_path / "last.ckpt")
    # the module's own prefix stays (the caller knows it); optimizer tensors are not weights
    assert list(sd) == ["net.head.weight", "net.head.bias"]
    assert torch.equal(sd["net.head.weight"], w) and torch.equal(sd["net.head.bias"], b)


def test_read_weights_takes_timms_ema_weights(tmp_path):
    raw, ema = torch.zeros(4), torch.ones(4)
    torch.save(
        {"epoch": 9, "arch": "vit_small_patch16_224", "state_dict": {"fc.bias": raw},
         "optimizer": {"state": {}, "param_groups": []}, "version": 2, "state_dict_ema": {"fc.bias": ema}},
        tmp_path / "model_best.pth.tar",
    )
    sd = read_weights(tmp_path / "model_best.pth.tar")
    assert list(sd) == ["fc.bias"] and torch.equal(sd["fc.bias"], ema)
    torch.save({"model": {"fc.bias": raw}, "epoch": 1}, tmp_path / "mae.pth")  # DeiT / MAE layout
    assert torch.equal(read_weights(tmp_path / "mae.pth")["fc.bias"], raw)


def test_read_weights_removes_ddp_and_compile_prefixes(tmp_path):
    t = torch.arange(4.0)
    torch.save({"state_dict": {"module.blocks.0.w": t, "module.head.b": t}}, tmp_path / "ddp.pth")
    assert list(read_weights(tmp_path / "ddp.pth")) == ["blocks.0.w", "head.b"]
    nested = {"module._orig_mod.blocks.0.w": t, "module._orig_mod.head.b": t}
    assert list(unwrap_weights(nested, "x.pth")) == ["blocks.0.w", "head.b"]
    assert list(unwrap_weights({"_orig_mod.module.head.b": t}, "x.pth")) == ["head.b"]
    # a prefix that only some keys carry is a submodule's name, not a wrapper: kept
    own = {"module.w": t, "head.b": t}
    assert list(unwrap_weights(own, "x.pth")) == ["module.w", "head.b"]
    from safetensors.torch import save_file

    save_file({"module.head.b": t}, str(tmp_path / "w.safetensors"), metadata={"arch": "tiny"})
    assert list(read_weights(tmp_path / "w.safetensors")) == ["head.b"]
    assert read_safetensors_metadata(tmp_path / "w.safetensors") == {"arch": "tiny"}
    assert read_safetensors_metadata(tmp_path / "ddp.pth") == {}
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{garbage")
    with pytest.raises(ValueError, match=r"bad\.safetensors' is a damaged"):
        read_safetensors_metadata(tmp_path / "bad.safetensors")


def test_read_weights_without_tensors_names_the_file(tmp_path):
    torch.save({"epoch": 3, "state_dict": {}, "hyper_parameters": {"lr": 0.1}}, tmp_path / "empty.ckpt")
    no_weights = r"empty\.ckpt' holds no tensors \(keys \['epoch', 'state_dict', 'hyper_parameters'\]"
    with pytest.raises(ValueError, match=no_weights + r", none in \['state_dict'\]\)"):
        read_weights(tmp_path / "empty.ckpt")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ValueError, match=r"list\.pt' holds no tensors \(a list\)"):
        read_weights(tmp_path / "list.pt")


def test_read_weights_refuses_pickled_code(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"state_dict": {"w": torch.ones(2)}, "callbacks": _Touch(marker)}, tmp_path / "evil.ckpt")
    with pytest.raises(UnsafeCheckpointError, match=r"evil\.ckpt' holds Python objects"):
        read_weights(tmp_path / "evil.ckpt")
    assert not marker.exists()


def test_read_weights_errors_start_with_the_callers_name_for_the_file(tmp_path):
    """``arg``: every error starts with the caller's name for the file, names the file, keeps its class."""
    Image.new("RGB", (4, 4)).save(tmp_path / "photo.png")
    os.replace(tmp_path / "photo.png", tmp_path / "photo.pth")
    torch.save({"state_dict": {"w": torch.ones(2)}, "settings": _Settings(0.1)}, tmp_path / "custom.pth")
    torch.save({"epoch": 3}, tmp_path / "no_weights.ckpt")
    cases = [
        ("missing.pth", FileNotFoundError, r"missing\.pth' does not exist"),
        ("photo.pth", NotACheckpointError, r"photo\.pth' is not a checkpoint: it is a PNG image"),
        ("custom.pth", UnsafeCheckpointError, r"custom\.pth' holds Python objects.*_Settings"),
        ("no_weights.ckpt", ValueError, r"no_weights\.ckpt' holds no tensors"),
    ]
    for name, cls, says in cases:
        for arg in ("checkpoint_path", "--weights"):
            with pytest.raises(cls, match=rf"^{arg}: '.*{says}") as e:
                read_weights(tmp_path / name, arg=arg)
            assert type(e.value) is cls, (name, arg)
            assert "weights_only=False" not in str(e.value)
        with pytest.raises(cls, match=rf"^'.*{says}"):  # without arg: the file's own message
            read_weights(tmp_path / name)
    with pytest.raises(NotACheckpointError, match=r"^ckpt_path: '.*photo\.pth' is not a checkpoint"):
        checkpoint_kind(tmp_path / "photo.pth", arg="ckpt_path")
    with pytest.raises(FileNotFoundError, match=r"^ckpt_path: '.*missing\.pth' does not exist"):
        read_checkpoint(tmp_path / "missing.pth", arg="ckpt_path")
    with pytest.raises(ValueError, match=r"^ckpt_path: 'x\.ckpt' holds no tensors"):
        unwrap_weights({"epoch": 3}, "x.ckpt", arg="ckpt_path")
    # an error class whose constructor takes other arguments comes through as it is, not as a TypeError
    from elsa_vision.files.checkpoints import _named

    with pytest.raises(UnicodeDecodeError):
        with _named("ckpt_path"):
            b"\xff".decode("utf-8")


def test_read_weights_takes_a_training_modules_network(tmp_path):
    """``submodule``: the network of a Lightning checkpoint, without the metric states beside it."""
    a, b, x = torch.zeros(2), torch.ones(3), torch.full((1,), 7.0)
    torch.save({"epoch": 1, "state_dict": {"net.a": a, "net.b": b, "metric.x": x}}, tmp_path / "last.ckpt")
    sd = read_weights(tmp_path / "last.ckpt", submodule="net")
    assert set(sd) == {"a", "b"} and torch.equal(sd["a"], a) and torch.equal(sd["b"], b)
    # a file without the prefix (the network saved alone) is taken as it is
    torch.save({"a": a, "metric.x": x}, tmp_path / "net.pth")
    assert set(read_weights(tmp_path / "net.pth", submodule="net")) == {"a", "metric.x"}
    assert set(read_weights(tmp_path / "last.ckpt")) == {"net.a", "net.b", "metric.x"}
    # wrapper prefixes inside the submodule (a compiled network) are removed as everywhere
    compiled = {"net._orig_mod.a": a, "net._orig_mod.b": b, "val_acc_best.max_val": x}
    assert set(unwrap_weights({"state_dict": compiled}, "c.ckpt", submodule="net")) == {"a", "b"}
    assert set(unwrap_weights({"state_dict": compiled}, "c.ckpt", submodule="encoder")) == set(compiled)


def test_submodule_weights():
    t = torch.zeros(1)
    state = {"net.a": t, "net.b.c": t, "network.d": t, "net": t, "decoder.e": t}
    assert set(submodule_weights(state, "net")) == {"a", "b.c"}  # not "network.d", not "net" itself
    assert set(submodule_weights(state, "decoder")) == {"e"}
    assert submodule_weights(state, "encoder") is None and submodule_weights({}, "net") is None


def test_strip_prefixes():
    """The one remover of a prefix every key carries: wrappers in any order (repeat), a training module's
    prefix in one pass and only where the caller's rule keeps it."""
    from elsa_vision.files import strip_prefixes

    t = torch.zeros(1)
    nested = {"_orig_mod.module.a": t, "_orig_mod.module.b": t}
    assert set(strip_prefixes(nested, ("module.", "_orig_mod."), repeat=True)) == {"a", "b"}
    assert set(strip_prefixes(nested, ("module.", "_orig_mod."))) == {"module.a", "module.b"}
    assert set(strip_prefixes({"module.a": t, "b": t}, ("module.",))) == {"module.a", "b"}  # not every key
    assert set(strip_prefixes({"net.a": t}, ("net.",), keep=lambda new, old: "a" not in new)) == {"net.a"}


def test_png_bomb_is_refused_before_decoding_naming_the_file(tmp_path):
    bomb = bomb_png(tmp_path / "bomb.png")
    assert bomb.stat().st_size < 100
    refused = r"bomb\.png' declares 10,000,000,000 pixels, more than the limit of 89,478,485"
    with pytest.raises(FileTooLargeError, match=refused):
        open_image(bomb)
    small = tmp_path / "small.png"
    Image.new("L", (20, 24)).save(small)
    with pytest.raises(FileTooLargeError, match="20x24 = 480 pixels, more than the limit of 100 "):
        open_image(small, max_pixels=100)  # the limit applies at 1x (Pillow only refuses above 2x)
    open_image(small, max_pixels=480).close()


def test_png_bomb_limit_follows_pillows_setting(tmp_path, monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 10**10 + 1)
    with open_image(bomb_png(tmp_path / "bomb.png")) as im:  # allowed now: only the header was read
        assert im.size == (100_000, 100_000)


def test_forged_tiff_and_npy_are_refused_before_allocation(tmp_path):
    import tracemalloc

    from elsa_vision.data.readers import iter_images, load_cube

    tif, npy = forged_tiff(tmp_path / "forged.tif"), forged_npy(tmp_path / "forged.npy")
    assert tif.stat().st_size < 1000 and npy.stat().st_size < 200
    tracemalloc.start()
    try:
        too_large = r"forged\.tif'.*9\.3 GiB when decoded.*limit of 4\.0 GiB"
        with pytest.raises(FileTooLargeError, match=too_large):
            next(iter_images(tif))
        with pytest.raises(FileTooLargeError, match=r"forged\.tif'.*9\.3 GiB"):
            load_cube(tif)
        with pytest.raises(FileTooLargeError, match=r"forged\.npy'.*\(500000, 500000\).*931\.3 GiB"):
            read_npy(npy)
        with pytest.raises(FileTooLargeError, match=r"forged\.npy'.*931\.3 GiB"):
            load_cube(npy)
        # a larger limit: the header is still checked against the data the file holds
        short = r"forged\.npy'.*holds 0 bytes of data \(truncated or forged header\)"
        with pytest.raises(ValueError, match=short):
            read_npy(npy, max_bytes=2**50)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20, peak  # nothing near the declared sizes was allocated
    np.save(tmp_path / "ok.npy", np.arange(12.0).reshape(3, 4))
    assert np.array_equal(read_npy(tmp_path / "ok.npy"), np.arange(12.0).reshape(3, 4))
    with pytest.raises(FileTooLargeError, match="limit of 0.0 GiB"):
        read_npy(tmp_path / "ok.npy", max_bytes=64)


def test_forged_hdf5_and_npz_are_refused_before_reading(tmp_path):
    import h5py

    from elsa_vision.data.readers import load_cube

    with h5py.File(tmp_path / "cube.mat", "w") as f:  # MATLAB v7.3: chunked, nothing written, 4 KB on disk
        f.create_dataset("cube", (200, 100_000, 100), "f4", chunks=(1, 1000, 100), compression="gzip")
    with pytest.raises(FileTooLargeError, match=r"cube\.mat'.*HDF5 dataset 'cube'.*7\.5 GiB"):
        load_cube(tmp_path / "cube.mat")
    cube = np.zeros((8, 8, 4), np.float32)
    np.savez_compressed(tmp_path / "scene.npz", cube=cube)
    assert load_cube(tmp_path / "scene.npz").shape == (8, 8, 4)
    with pytest.raises(FileTooLargeError, match=r"scene\.npz'.*array 'cube'"):
        load_cube(tmp_path / "scene.npz", max_bytes=100)


@pytest.fixture
def fifo(tmp_path):
    """Makes FIFOs in ``tmp_path``. A reader that opens one anyway would wait for a writer for ever: a
    watchdog opens each FIFO for writing whenever a reader waits on it and closes it at once, so that such a
    reader reads end-of-file and the test fails instead of hanging."""
    import threading

    made, done = [], threading.Event()

    def release():
        while not done.wait(0.05):
            for path in made:
                try:  # succeeds only while a reader has the FIFO open
                    os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass

    def make(name):
        os.mkfifo(tmp_path / name)
        made.append(tmp_path / name)
        return tmp_path / name

    watchdog = threading.Thread(target=release, daemon=True)
    watchdog.start()
    yield make
    done.set()
    watchdog.join()


def test_readers_refuse_fifos_before_opening_them(tmp_path, fifo):
    """A FIFO given as an input (a cube, an image, an array, an ENVI data file, a checkpoint) would block its
    reader until another process writes to it; every reader refuses it by name before opening it."""
    from elsa_vision.data.readers import iter_images, list_arrays, load_cube, load_rgb, read_image, read_tiff

    refused = r"'.*{}' is a FIFO \(named pipe\); only regular files are read"
    for name in ("cube.npy", "cube.mat", "cube.tif", "cube.npz"):
        with pytest.raises(ValueError, match=refused.format(name)):
            load_cube(fifo(name))
    with pytest.raises(ValueError, match=refused.format("depth.npy")):
        read_npy(fifo("depth.npy"))
    with pytest.raises(ValueError, match=refused.format("frame.png")):
        open_image(fifo("frame.png"))
    with pytest.raises(ValueError, match=refused.format("photo.jpg")):
        load_rgb(fifo("photo.jpg"))
    with pytest.raises(ValueError, match=refused.format("scan")):  # no extension: the format is sniffed
        read_image(fifo("scan"))
    with pytest.raises(ValueError, match=refused.format("slide.tif")):
        read_tiff(fifo("slide.tif"))
    with pytest.raises(ValueError, match=r"slide\.tif"):
        next(iter_images(tmp_path / "slide.tif"))
    (tmp_path / "scene.hdr").write_text(
        "ENVI\nsamples = 2\nlines = 2\nbands = 1\nheader offset = 0\ndata type = 1\n"
        "interleave = bsq\nbyte order = 0\n"
    )
    fifo("scene.img")  # the data file beside the header
    with pytest.raises(ValueError, match=refused.format("scene.img")):
        list_arrays(tmp_path / "scene.hdr")
    import nibabel as nib

    nib.save(nib.Nifti1Pair(np.zeros((4, 4, 4), np.int16), np.eye(4)), tmp_path / "scan.hdr")
    (tmp_path / "scan.img").unlink()
    fifo("scan.img")  # the image file of a NIfTI-1 pair, beside its header
    with pytest.raises(ValueError, match=refused.format("scan.img")):
        read_image(tmp_path / "scan.hdr")
    with pytest.raises(FileNotFoundError, match=r"weights\.pt"):
        read_checkpoint(fifo("weights.pt"))
    (tmp_path / "dir.npy").mkdir()
    with pytest.raises(ValueError, match=r"'.*dir\.npy' is a directory"):
        read_npy(tmp_path / "dir.npy")


# ------------------------------------------------------------------------------------- output directories


def test_prepare_output_dir(tmp_path):
    out = tmp_path / "a" / "b"
    assert prepare_output_dir(out, ["x.json"]) == out and not out.exists()  # checked, nothing created
    (tmp_path / "file").write_text("")
    refused = r"--out '.*file/sub' cannot be created: '.*file' is not a directory"
    with pytest.raises(ValueError, match=refused):
        prepare_output_dir(tmp_path / "file" / "sub", ["x.json"])
    out.mkdir(parents=True)
    (out / "x.json").write_text("{}")
    (out / "slice_0001").mkdir()
    with pytest.raises(ValueError, match=r"already holds outputs of an earlier run \(x\.json, slice_0001\)"):
        prepare_output_dir(out, ["x.json", "y.png", "slice_*"])
    prepare_output_dir(out, ["x.json", "slice_*"], overwrite=True)
    prepare_output_dir(out, ["y.png"])  # other files in the directory are not outputs of this kind of run
    assert sorted(p.name for p in out.iterdir()) == ["slice_0001", "x.json"]  # the write probe is gone
    with pytest.raises(TypeError, match="outputs must be a list of names, got one name 'x.json'"):
        prepare_output_dir(out, "x.json")  # not its characters one by one


# ------------------------------------------------------------------------------------------ atomic writes


def test_remove_outputs_removes_only_what_the_manifest_records(tmp_path):
    """--overwrite removes the files an earlier run recorded in outputs.json and the folders they leave
    empty, the fixed output names, and nothing else: not a slice_* file or folder of the user's, not a
    user's file inside a recorded folder, not what a link points to, not a path an edited manifest names."""
    out = tmp_path / "out"
    record_outputs(out, ["report.json", "slice_0001/report.json", "slice_0001/overlay.png"])
    record_outputs(out, ["slice_0002/report.json", "slice_0003/report.json", "slice_0004/x.json"])
    for name in ("report.json", "slice_0001/report.json", "slice_0001/overlay.png", "slice_0003/report.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text("{}")
    assert json.loads((out / OUTPUT_MANIFEST).read_text())["outputs"][-1] == "slice_0004/x.json"
    (out / "slice_notes.txt").write_text("mine")
    (out / "slice_0003" / "mine.txt").write_text("mine")
    keep = tmp_path / "elsewhere"
    keep.mkdir()
    (keep / "report.json").write_text("theirs")
    (out / "slice_0002").symlink_to(keep, target_is_directory=True)
    (out / "notes.txt").write_text("mine")
    removed = remove_outputs(out, ["report.json", "slice_*", "overlay.png"])
    assert sorted(removed) == [
        "report.json", "slice_0001/overlay.png", "slice_0001/report.json", "slice_0003/report.json"
    ]
    assert sorted(os.listdir(out)) == ["notes.txt", "slice_0002", "slice_0003", "slice_notes.txt"]
    assert os.listdir(out / "slice_0003") == ["mine.txt"] and (keep / "report.json").read_text() == "theirs"
    # an edited manifest naming files outside the run's outputs removes none of them
    (out / OUTPUT_MANIFEST).write_text(json.dumps({"outputs": ["notes.txt", "../elsewhere/report.json",
                                                               "/etc/passwd", "slice_0003/../notes.txt"]}))
    assert remove_outputs(out, ["report.json", "slice_*"]) == []
    assert (out / "notes.txt").exists() and (keep / "report.json").exists()
    # what another tool recorded in the same folder stays, and stays recorded
    record_outputs(out, ["labels.npy", "report.json"])
    (out / "labels.npy").write_text("x")
    assert remove_outputs(out, ["report.json"]) == [] and (out / "labels.npy").exists()
    assert json.loads((out / OUTPUT_MANIFEST).read_text())["outputs"] == ["notes.txt", "labels.npy"]
    assert remove_outputs(tmp_path / "absent", ["x"]) == []
    with pytest.raises(TypeError, match="list of names"):
        remove_outputs(out, "report.json")
    with pytest.raises(ValueError, match="not a relative path"):
        record_outputs(out, ["../x.json"])


def test_prepare_output_dir_resolves_the_path_before_checking(tmp_path):
    """`missing/../out` is `out` (where the writes land): its earlier outputs are refused, and the returned
    path is the resolved one, so no stray `missing/` is created by the run."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "x.json").write_text("{}")
    given = tmp_path / "missing" / ".." / "out"
    with pytest.raises(ValueError, match=r"--out '.*missing/\.\./out \(= .*/out\)' already holds outputs"):
        prepare_output_dir(given, ["x.json"])
    assert prepare_output_dir(given, ["x.json"], overwrite=True) == out
    (tmp_path / "link").symlink_to(out, target_is_directory=True)
    with pytest.raises(ValueError, match="already holds outputs"):
        prepare_output_dir(tmp_path / "link", ["x.json"])
    assert not (tmp_path / "missing").exists()


def test_atomic_write_text_replaces_whole_or_not_at_all(tmp_path):
    target = tmp_path / "sub" / "metrics.csv"
    with atomic_write(target, "w", newline="") as f:
        f.write("step,loss\n0,1.0\n")
    assert target.read_text() == "step,loss\n0,1.0\n"
    with pytest.raises(KeyboardInterrupt):
        with atomic_write(target, "w") as f:
            f.write("step,loss\n")
            raise KeyboardInterrupt
    assert target.read_text() == "step,loss\n0,1.0\n" and os.listdir(target.parent) == ["metrics.csv"]
    with pytest.raises(ValueError, match="mode must be 'w' or 'wb'"):
        with atomic_write(target, "a"):
            pass


def test_trim_metrics_csv_drops_rows_from_the_resumed_step_atomically(tmp_path):
    from elsa_vision.utils.run import trim_metrics_csv

    path = tmp_path / "metrics.csv"
    path.write_text("epoch,step,loss\n" + "".join(f"0,{i},{i / 10}\n" for i in range(6)) + "0,,\n")
    assert trim_metrics_csv(path, before_step=3) == 3
    assert path.read_text().splitlines() == ["epoch,step,loss", "0,0,0.0", "0,1,0.1", "0,2,0.2", "0,,"]
    assert os.listdir(tmp_path) == ["metrics.csv"]
    assert trim_metrics_csv(path, before_step=3) == 0 and trim_metrics_csv(tmp_path / "none.csv", 1) == 0


def test_atomic_save_keeps_the_previous_file_on_failure(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    atomic_torch_save({"epoch": 1}, target)
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        f.write(b"PK\x03\x04 half a checkpoint")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="No space left"):
        atomic_torch_save({"epoch": 2}, target)
    monkeypatch.setattr(torch, "save", real_save)
    assert read_checkpoint(target) == {"epoch": 1} and os.listdir(tmp_path) == ["last.ckpt"]
    stale = tmp_path / ".last.ckpt.123.0123abcd.tmp"
    stale.write_bytes(b"partial")
    assert remove_stale_temp_files(tmp_path) == [stale.name] and not stale.exists()
    assert link_atomically(target, tmp_path / "other.ckpt")
    assert os.path.samefile(target, tmp_path / "other.ckpt")


def test_max_input_gib_takes_finite_positive_numbers():
    import argparse

    from elsa_vision.files import add_max_input_argument

    parser = argparse.ArgumentParser()
    add_max_input_argument(parser, "input")
    assert parser.parse_args(["--max-input-gib", "0.5"]).max_input_gib == 0.5
    for bad in ("0", "-1", "inf", "nan", "lots"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--max-input-gib", bad])


def test_npy_header_with_a_negative_size_is_named(tmp_path):
    """A header declaring shape (-2, -3, 4) (whose product looks positive) gave numpy's 'can only specify one
    unknown dimension', naming neither file nor field."""
    from elsa_vision.data.readers import load_cube

    path = forged_npy(tmp_path / "neg.npy", shape=(-2, -3, 4))
    with open(path, "ab") as f:
        f.write(bytes(96))
    refused = r"^'.*neg\.npy': the \.npy array declares shape \(-2, -3, 4\), with a negative size"
    for read in (read_npy, load_cube):
        with pytest.raises(ValueError, match=refused):
            read(path)


def test_deeply_nested_torchscript_archive_is_refused_in_one_line(tmp_path):
    """A 3000-level module tree (a few KB) ended the walk over the modules in a RecursionError; it is refused
    as a ValueError naming the file."""
    import sys
    import types
    import zipfile

    fake = types.ModuleType("__torch__")

    class M:
        pass

    M.__module__, M.__qualname__ = "__torch__", "M"
    fake.M = M
    root = node = M()
    for _ in range(3000):
        node.child = M()
        node = node.child
    limit = sys.getrecursionlimit()
    sys.modules["__torch__"] = fake
    sys.setrecursionlimit(20_000)  # the test's own pickler is recursive
    try:
        data = pickle.dumps(root, protocol=2)
    finally:
        sys.setrecursionlimit(limit)
        del sys.modules["__torch__"]
    with zipfile.ZipFile(tmp_path / "deep.pt", "w") as zf:
        zf.writestr("deep/data.pkl", data)
        zf.writestr("deep/code/__torch__.py", "class M(Module):\n  __parameters__ = []\n  __buffers__ = []\n")
        zf.writestr("deep/constants.pkl", pickle.dumps((), protocol=2))
    with pytest.raises(ValueError, match=r"deep\.pt'.*nested more than 100 levels deep"):
        read_checkpoint(tmp_path / "deep.pt", torchscript=True)


def test_safetensors_outputs_get_the_mode_of_every_other_output(tmp_path):
    """safetensors writes 0600 (a temporary file renamed over the target): features, embeddings and exported
    weights were readable by their owner only, next to 0644 checkpoints, images and JSON files.
    save_safetensors gives them the mode a plain open() gives, and it is the package's only safetensors
    writer."""
    import ast
    from pathlib import Path

    from safetensors.torch import load_file

    from elsa_vision.files import save_safetensors

    umask = os.umask(0o022)  # the usual one, whatever the test runner's
    try:
        (tmp_path / "plain.json").write_text("{}")
        atomic_torch_save({"a": torch.ones(2)}, tmp_path / "c.ckpt")
        out = save_safetensors({"a": torch.arange(3.0)}, tmp_path / "w.safetensors", metadata={"k": "v"})
    finally:
        os.umask(umask)
    modes = {p.name: os.stat(p).st_mode & 0o777 for p in tmp_path.iterdir()}
    assert modes == {"plain.json": 0o644, "c.ckpt": 0o644, "w.safetensors": 0o644}, modes
    assert torch.equal(load_file(out)["a"], torch.arange(3.0))
    package = Path(__file__).resolve().parents[1] / "elsa_vision"
    writers = []
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", "")) in (
                    "save_file", "save_model"):
                writers.append(f"{path.relative_to(package)}:{node.lineno}")
    assert len(writers) == 1 and writers[0].startswith("files/outputs.py:"), writers


# ------------------------------------------------------------------------- sizes declared inside the archive


def _legacy_file(path, numel):
    """A legacy (pre-1.6, non-zip) ``torch.save`` file of ``{"w": zeros(4)}`` whose storage declares
    ``numel`` floats, in the main pickle's persistent id and in the count before its data."""
    import io
    import struct

    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf, _use_new_zipfile_serialization=False)
    raw = buf.getvalue()
    i = raw.index(b"X\x03\x00\x00\x00cpuq\x06K\x04N")  # ('storage', FloatStorage, key, 'cpu', 4, None)
    raw = raw[:i] + b"X\x03\x00\x00\x00cpuq\x06J" + struct.pack("<i", numel) + b"N" + raw[i + 13 :]
    j = raw.rindex(struct.pack("<q", 4))  # the element count before the storage's bytes
    path.write_bytes(raw[:j] + struct.pack("<q", numel) + raw[j + 8 :])
    return path


def test_legacy_torch_file_storages_are_bounded_by_its_size(tmp_path, monkeypatch):
    """torch's legacy loader reserves each storage at the size the pickle declares before reading it: 8 GiB
    from a 368-byte file. The declared sizes are read from the pickle (nothing rebuilt) and refused before
    torch.load when they exceed the file; legacy checkpoints that hold what they declare load as before."""
    with open(tmp_path / "good.pt", "wb") as f:
        torch.save({"w": torch.arange(4.0), "v": torch.ones(2, 3, dtype=torch.float64)}, f,
                   _use_new_zipfile_serialization=False)
    loaded = read_checkpoint(tmp_path / "good.pt")
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["v"].dtype == torch.float64
    forged = _legacy_file(tmp_path / "legacy.pt", 2**31 - 1)
    assert forged.stat().st_size < 400
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load read a refused file"))
    refused = r"^'.*legacy\.pt': its tensors' storages declare 8,589,934,588 bytes, more than the \d+-byte"
    with pytest.raises(ValueError, match=refused):
        read_checkpoint(forged)
    with pytest.raises(ValueError, match=r"^--weights: '.*legacy\.pt': its tensors' storages declare"):
        read_weights(forged, arg="--weights")
    # a string or buffer opcode of the pickle itself declaring more bytes than the file holds: refused where
    # it is declared (Python's unpickler reserves the declared 2 GiB first), nothing that size allocated
    import io
    import pickle
    import struct
    import tracemalloc

    raw = (tmp_path / "good.pt").read_bytes()
    f = io.BytesIO(raw)
    for _ in range(3):  # the magic number, protocol and system-information pickles
        pickle.load(f)
    bytes8 = b"\x80\x04\x8e" + struct.pack("<Q", 2**31)  # protocol 4, BINBYTES8 of 2 GiB
    (tmp_path / "bytes8.pt").write_bytes(raw[: f.tell()] + bytes8 + b"\0" * 64)
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=r"^'.*bytes8\.pt' is a truncated or damaged checkpoint: exp"):
            read_checkpoint(tmp_path / "bytes8.pt")
        assert tracemalloc.get_traced_memory()[1] < 2**27
    finally:
        tracemalloc.stop()


def _ts_with_buffer_declaring(tmp_path, name, size):
    """A scripted module whose zero-size buffer's record is patched to declare ``size`` elements (its storage
    record stays empty)."""
    import zipfile

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("b", torch.zeros(0))

        def forward(self, x):
            return x

    torch.jit.save(torch.jit.script(M()), str(tmp_path / "src.pt"))
    with zipfile.ZipFile(tmp_path / "src.pt") as zin, zipfile.ZipFile(tmp_path / name, "w") as zout:
        for info in zin.infolist():
            body = zin.read(info.filename)
            if info.filename.endswith("/data.pkl") and "constants" not in info.filename:
                old = b"K\x00(K\x00t(K\x01t"  # offset 0, size (0,), stride (1,)
                assert old in body
                new = b"K\x00(J" + size.to_bytes(4, "little", signed=True) + b"t(K\x01t"
                body = body.replace(old, new, 1)
            zout.writestr(info, body)
    return tmp_path / name


def test_torchscript_view_past_its_storage_is_refused_before_it_is_made(tmp_path):
    """An empty storage record became a resizable torch.empty(0), which Tensor.set_ grew to the size the
    pickle declares (8 GiB from a 1.5 KB file) before the tensors were checked; the view is now checked
    against its storage first."""
    path = _ts_with_buffer_declaring(tmp_path, "empty.pt", 2**20)
    assert path.stat().st_size < 4000
    refused = (r"^TorchScript archive '.*empty\.pt' refused: a tensor record declares shape \(1048576,\) "
               r"\(strides \(1,\), offset 0\) over a storage of 0 elements")
    with pytest.raises(ValueError, match=refused):
        read_checkpoint(path, torchscript=True)
    with pytest.raises(ValueError, match=r"negative.*nothing in it was run"):
        read_checkpoint(_ts_with_buffer_declaring(tmp_path, "negative.pt", -5), torchscript=True)
    assert read_checkpoint(tmp_path / "src.pt", torchscript=True)["b"].shape == (0,)


def test_torchscript_code_records_are_scanned_in_bounded_memory(tmp_path, monkeypatch):
    """A deflated code record of short lines (8 MiB of b'ab\\n' in 8 KB) was read whole and split into 2.8
    million str objects (64 MiB of it: 1.6 GiB); it is scanned a block at a time, and the code records
    together are bounded."""
    import tracemalloc
    import zipfile

    from elsa_vision.files import torchscript

    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 3)), str(tmp_path / "lin.pt"))

    def padded(name, *sizes):
        with zipfile.ZipFile(tmp_path / "lin.pt") as zin, zipfile.ZipFile(tmp_path / name, "w") as zout:
            for info in zin.infolist():
                zout.writestr(info, zin.read(info.filename))
            for i, size in enumerate(sizes):
                zout.writestr(f"lin/code/__torch__/pad{i}.py", b"ab\n" * (size // 3),
                              compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        return tmp_path / name

    path = padded("pad.pt", 8 * 2**20)
    assert path.stat().st_size < 64 * 2**10
    tracemalloc.start()
    try:
        state = read_checkpoint(path, torchscript=True)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert state.keys() == {"weight", "bias"}
    assert peak < 4 * 2**20, f"{peak:,} bytes"
    monkeypatch.setattr(torchscript, "_TS_MAX_CODE_BYTES", 5 * 2**20)
    refused = r"^TorchScript archive '.*two\.pt': its code records hold more than 5,242,880 bytes"
    with pytest.raises(ValueError, match=refused):
        read_checkpoint(padded("two.pt", 3 * 2**20, 3 * 2**20), torchscript=True)


def test_images_in_formats_the_package_does_not_read_are_refused_by_content(tmp_path):
    """Pillow picks the format from the content: a 60-byte ICNS icon named frame.png, whose JPEG 2000 block
    declares 4 GiB, made load_rgb read(4 GiB). Only the formats image folders and frames are read in (PNG,
    JPEG, TIFF, BMP, WebP, GIF, PPM/PGM) are opened."""
    import struct

    from PIL import UnidentifiedImageError

    from elsa_vision.data.readers import load_rgb, read_rgb

    icns = tmp_path / "frame.png"
    block = b"ic08" + struct.pack(">I", 0xFFFFFFF0) + b"\0\0\0\x0cjP  \r\n\x87\n" + b"\0" * 32
    icns.write_bytes(b"icns" + struct.pack(">I", 0xFFFFFFF0) + block)
    refused = r"^image '.*frame\.png' is not a readable PNG, JPEG, BMP, GIF, PPM, TIFF or WebP image"
    with pytest.raises(UnidentifiedImageError, match=refused):
        open_image(icns)
    with pytest.raises(UnidentifiedImageError, match=refused):
        load_rgb(icns)
    with pytest.raises(ValueError, match=r"frame\.png"):
        read_rgb(icns)
    for ext in ("png", "jpg", "tif", "bmp", "webp", "gif", "ppm", "pgm"):
        Image.new("L" if ext == "pgm" else "RGB", (5, 4), 7).save(tmp_path / f"a.{ext}")
        with open_image(tmp_path / f"a.{ext}") as im:
            assert im.size == (5, 4)
        assert read_rgb(tmp_path / f"a.{ext}").shape == (3, 4, 5)
