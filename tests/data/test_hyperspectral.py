"""Hyperspectral readers, validation, splits, spectral transforms, patches and the DataModule."""

import io

import h5py
import numpy as np
import pytest
import scipy.io
import tifffile
import torch

from elsa_vision.data.hyperspectral import (
    HSIDataModule,
    SpectralTransform,
    encode_labels,
    extract_patches,
    pad_cube,
    split_indices,
    synthetic_scene,
)
from elsa_vision.data.readers import list_arrays, load_cube, load_gt, load_scene
from elsa_vision.files import FileTooLargeError


@pytest.fixture(scope="module")
def scene():
    return synthetic_scene(height=20, width=18, bands=12, num_classes=4, block=3, seed=3)


def write_mat73(path, arrays):
    """Write arrays the way MATLAB's ``save -v7.3`` does: an HDF5 file with a 512-byte user block holding the
    MAT header, each array transposed (column-major) with a ``MATLAB_class`` attribute."""
    with h5py.File(path, "w", userblock_size=512) as f:
        for name, a in arrays.items():
            ds = f.create_dataset(name, data=np.ascontiguousarray(a.T))
            ds.attrs["MATLAB_class"] = np.bytes_(
                {"float32": "single", "float64": "double", "uint8": "uint8", "int64": "int64"}[a.dtype.name]
            )
        f.create_group("#refs#")
    with open(path, "r+b") as fh:
        text = (
            b"MATLAB 7.3 MAT-file, Platform: GLNXA64, Created on: Mon Jan  1 00:00:00 2024 HDF5 schema 1.00 ."
        )
        fh.write(
            text.ljust(116, b" ") + b"\0" * 8 + b"\x00\x02" + b"IM"
        )  # text, subsys, version 0x0200, endian


# ---------------------------------------------------------------------------------------------------------
# Readers
# ---------------------------------------------------------------------------------------------------------


def test_one_file_scene_is_read_once(tmp_path, scene, monkeypatch):
    """A cube and its labels in one file (``gt_key`` without ``gt_path``): the file is read once."""
    import elsa_vision.data.readers.cubes as cubes

    cube, gt = scene
    scipy.io.savemat(tmp_path / "both.mat", {"img": cube, "labels": gt})
    reads = []
    real = cubes.list_arrays
    monkeypatch.setattr(cubes, "list_arrays", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    s = load_scene(tmp_path / "both.mat", gt_key="labels", key="img")
    assert len(reads) == 1
    np.testing.assert_array_equal(s.cube, cube)
    np.testing.assert_array_equal(s.gt, gt)
    with pytest.raises(ValueError, match="nan_policy"):
        load_scene(tmp_path / "both.mat", nan_policy="zero")


def test_mat_v73_counts_all_datasets_against_the_limit(tmp_path):
    """Each dataset under the limit, together over it: refused before the second is read, as the v5 reader
    counts every variable."""
    a = np.zeros((10, 10, 6), np.float32)  # 2400 bytes each
    write_mat73(tmp_path / "two.mat", {"a": a, "b": a})
    assert set(list_arrays(tmp_path / "two.mat", max_bytes=4800)) == {"a", "b"}
    with pytest.raises(FileTooLargeError, match="the datasets up to"):
        list_arrays(tmp_path / "two.mat", max_bytes=4000)


def test_mat_v5_round_trip_and_auto_keys(tmp_path, scene):
    cube, gt = scene
    scipy.io.savemat(tmp_path / "scene.mat", {"paviaU": cube})
    scipy.io.savemat(tmp_path / "scene_gt.mat", {"paviaU_gt": gt})
    s = load_scene(tmp_path / "scene.mat", tmp_path / "scene_gt.mat")
    assert s.cube.dtype == np.float32 and s.cube.shape == cube.shape
    np.testing.assert_array_equal(s.cube, cube)
    np.testing.assert_array_equal(s.gt, gt.astype(np.int64))
    # One file holding both: keys are told apart by rank and integer type.
    scipy.io.savemat(tmp_path / "both.mat", {"img": cube.astype(np.float64), "labels": gt})
    s2 = load_scene(tmp_path / "both.mat", tmp_path / "both.mat")
    np.testing.assert_array_equal(s2.cube, cube)
    np.testing.assert_array_equal(s2.gt, gt)


def test_mat_v73_round_trip(tmp_path, scene):
    cube, gt = scene
    write_mat73(tmp_path / "v73.mat", {"WHU_Hi_LongKou": cube})
    with h5py.File(tmp_path / "v73_gt_named.mat", "w") as f:  # a char variable beside the labels is ignored
        f.create_dataset("gt", data=np.ascontiguousarray(gt.T)).attrs["MATLAB_class"] = np.bytes_("uint8")
        name = f.create_dataset("name", data=np.frombuffer(b"p\0a\0v\0i\0a\0", dtype=np.uint16)[:, None])
        name.attrs["MATLAB_class"] = np.bytes_("char")
    np.testing.assert_array_equal(load_gt(tmp_path / "v73_gt_named.mat"), gt)
    write_mat73(tmp_path / "v73_gt.mat", {"WHU_Hi_LongKou_gt": gt})
    with pytest.raises(NotImplementedError):  # it is a real v7.3 file: scipy refuses it
        scipy.io.loadmat(tmp_path / "v73.mat")
    s = load_scene(tmp_path / "v73.mat", tmp_path / "v73_gt.mat")
    assert s.cube.shape == cube.shape  # (H, W, bands), not MATLAB's stored (bands, W, H)
    np.testing.assert_array_equal(s.cube, cube)
    np.testing.assert_array_equal(s.gt, gt)
    assert load_cube(tmp_path / "v73.mat", key="WHU_Hi_LongKou").shape == cube.shape


def test_envi_round_trip(tmp_path, scene):
    import spectral.io.envi as envi

    cube, _ = scene
    for interleave in ("bip", "bil", "bsq"):
        hdr = tmp_path / f"scene_{interleave}.hdr"
        envi.save_image(str(hdr), cube, dtype=np.float32, interleave=interleave, ext=".img", force=True)
        np.testing.assert_array_equal(load_cube(hdr), cube)
        np.testing.assert_array_equal(load_cube(hdr.with_suffix(".img")), cube)  # the data file works too


def test_tiff_and_numpy_round_trip(tmp_path, scene):
    cube, gt = scene
    tifffile.imwrite(tmp_path / "hwc.tif", cube, photometric="minisblack", planarconfig="contig")
    tifffile.imwrite(
        tmp_path / "chw.tif", np.ascontiguousarray(cube.transpose(2, 0, 1)), photometric="minisblack"
    )
    tifffile.imwrite(tmp_path / "gt.tif", gt)
    np.testing.assert_array_equal(load_cube(tmp_path / "hwc.tif"), cube)
    np.testing.assert_array_equal(load_cube(tmp_path / "chw.tif"), cube)
    np.testing.assert_array_equal(load_gt(tmp_path / "gt.tif"), gt)
    np.save(tmp_path / "cube.npy", cube)
    np.save(tmp_path / "gt.npy", gt)
    np.savez(tmp_path / "scene.npz", cube=cube, gt=gt)
    np.testing.assert_array_equal(load_cube(tmp_path / "cube.npy"), cube)
    np.testing.assert_array_equal(load_gt(tmp_path / "gt.npy"), gt)
    s = load_scene(tmp_path / "scene.npz", tmp_path / "scene.npz")
    np.testing.assert_array_equal(s.cube, cube)
    np.testing.assert_array_equal(s.gt, gt)


# ---------------------------------------------------------------------------------------------------------
# Bad files
# ---------------------------------------------------------------------------------------------------------


def test_key_errors_list_available_arrays(tmp_path, scene):
    cube, gt = scene
    scipy.io.savemat(tmp_path / "two.mat", {"a": cube, "b": cube + 1, "gt": gt})
    with pytest.raises(ValueError, match=r"ambiguous.*'a'.*'b'"):
        load_cube(tmp_path / "two.mat")
    np.testing.assert_array_equal(load_cube(tmp_path / "two.mat", key="b"), cube + 1)
    with pytest.raises(ValueError, match=r"key 'paviaU' not found.*available arrays: .*'a' \(20, 18, 12\)"):
        load_cube(tmp_path / "two.mat", key="paviaU")
    with pytest.raises(ValueError, match=r"rank 3"):
        load_cube(tmp_path / "two.mat", key="gt")
    scipy.io.savemat(tmp_path / "gt_only.mat", {"gt": gt, "mask": gt > 0})
    with pytest.raises(ValueError, match=r"no 3-D array for the cube.*'gt' \(20, 18\)"):
        load_cube(tmp_path / "gt_only.mat")
    scipy.io.savemat(tmp_path / "two_gt.mat", {"g1": gt, "g2": gt})
    with pytest.raises(ValueError, match=r"ground-truth key is ambiguous"):
        load_gt(tmp_path / "two_gt.mat")
    scipy.io.savemat(tmp_path / "cube_only.mat", {"c": cube})
    with pytest.raises(ValueError, match=r"must have rank 2 \(H, W\), got shape \(20, 18, 12\)"):
        load_gt(tmp_path / "cube_only.mat")
    scipy.io.savemat(tmp_path / "no_int.mat", {"c": cube, "f": cube[..., 0] + 0.5})
    with pytest.raises(ValueError, match=r"no 2-D integer array for the ground-truth"):
        load_gt(tmp_path / "no_int.mat")


def test_size_mismatch_nan_and_label_errors(tmp_path, scene):
    cube, gt = scene
    np.save(tmp_path / "cube.npy", cube)
    np.save(tmp_path / "gt_small.npy", gt[:-1])
    with pytest.raises(ValueError, match=r"gt/image size mismatch.*19x18.*20x18"):
        load_scene(tmp_path / "cube.npy", tmp_path / "gt_small.npy")
    bad = cube.copy()
    bad[2, 3, 3] = np.nan
    bad[:, :, 7] = np.inf
    np.save(tmp_path / "nan.npy", bad)
    with pytest.raises(ValueError, match=r"NaN/inf values in 2 band\(s\) \[3, 7\]"):
        load_cube(tmp_path / "nan.npy")
    filled = load_cube(tmp_path / "nan.npy", nan_policy="fill")
    assert np.isfinite(filled).all()
    finite3 = np.delete(cube[..., 3].ravel(), 2 * cube.shape[1] + 3)
    assert abs(filled[2, 3, 3] - finite3.mean()) <= 1e-6 * abs(finite3.mean())
    assert (filled[..., 7] == 0).all()  # no finite value in the band
    np.testing.assert_array_equal(np.delete(filled, [3, 7], axis=2), np.delete(cube, [3, 7], axis=2))
    with pytest.raises(ValueError, match="nan_policy"):
        load_cube(tmp_path / "cube.npy", nan_policy="zero")
    np.save(tmp_path / "neg.npy", gt.astype(np.int64) - 1)
    with pytest.raises(ValueError, match="negative labels"):
        load_gt(tmp_path / "neg.npy")
    np.save(tmp_path / "frac.npy", gt + 0.5)
    with pytest.raises(ValueError, match="integer labels"):
        load_gt(tmp_path / "frac.npy")
    np.save(tmp_path / "rank2.npy", cube[..., 0])
    with pytest.raises(ValueError, match="rank 3"):
        load_cube(tmp_path / "rank2.npy")


def test_unreadable_files(tmp_path):
    (tmp_path / "junk.mat").write_bytes(b"not a mat file at all" * 10)
    with pytest.raises(ValueError, match="junk.mat"):
        load_cube(tmp_path / "junk.mat")
    (tmp_path / "trunc.npy").write_bytes(b"\x93NUMPY\x01\x00")
    with pytest.raises(ValueError, match="trunc.npy"):
        load_cube(tmp_path / "trunc.npy")
    (tmp_path / "a.hdr").write_text("not an envi header")
    with pytest.raises(ValueError, match="a.hdr"):
        load_cube(tmp_path / "a.hdr")
    (tmp_path / "b.img").write_bytes(b"\0" * 64)
    with pytest.raises(ValueError, match="without a header"):
        load_cube(tmp_path / "b.img")
    with pytest.raises(ValueError, match="file not found"):
        load_cube(tmp_path / "missing.mat")
    (tmp_path / "x.jpg").write_bytes(b"")
    with pytest.raises(ValueError, match="unsupported file type '.jpg'"):
        list_arrays(tmp_path / "x.jpg")


# ---------------------------------------------------------------------------------------------------------
# Labels and splits
# ---------------------------------------------------------------------------------------------------------


def test_encode_labels_shifts_and_ignores_zero():
    gt = np.array([[0, 3, 3], [7, 0, 5]])
    enc, values = encode_labels(gt)
    np.testing.assert_array_equal(values, [3, 5, 7])
    np.testing.assert_array_equal(enc, [[-1, 0, 0], [2, -1, 1]])
    with pytest.raises(ValueError, match=r"labels \[7\] outside the known classes \[3, 5\]"):
        encode_labels(gt, class_values=[3, 5])
    with pytest.raises(ValueError, match="no labelled pixel"):
        encode_labels(np.zeros((3, 3), dtype=np.int64))


def test_split_protocols():
    rng = np.random.default_rng(0)
    counts = np.array([50, 7, 200, 3])
    labels = rng.permutation(np.repeat(np.arange(4), counts))
    tr, va, te = split_indices(labels, "ratio", ratio=0.1, val_ratio=0.2, seed=5)
    for c, n in enumerate(counts):
        assert (labels[tr] == c).sum() == max(1, round(0.1 * n))
        assert (labels[va] == c).sum() == min(round(0.2 * n), n - max(1, round(0.1 * n)))
    assert len(np.intersect1d(tr, va)) == len(np.intersect1d(tr, te)) == len(np.intersect1d(va, te)) == 0
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, va, te])), np.arange(labels.size))

    tr, va, te = split_indices(labels, "per_class", samples_per_class=5, val_samples_per_class=4, seed=5)
    # Classes larger than N give exactly N; the 3-sample class gives 3 // 2 = 1;
    # val takes at most half of the rest.
    assert [(labels[tr] == c).sum() for c in range(4)] == [5, 5, 5, 1]
    assert [(labels[va] == c).sum() for c in range(4)] == [4, 1, 4, 1]
    np.testing.assert_array_equal(np.sort(np.concatenate([tr, va, te])), np.arange(labels.size))

    a = split_indices(labels, "per_class", samples_per_class=5, seed=1)
    b = split_indices(labels, "per_class", samples_per_class=5, seed=1)
    c = split_indices(labels, "per_class", samples_per_class=5, seed=2)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not np.array_equal(a[0], c[0])

    with pytest.raises(ValueError, match="protocol"):
        split_indices(labels, "random")
    with pytest.raises(ValueError, match="ratio must be in"):
        split_indices(labels, "ratio", ratio=1.5)
    with pytest.raises(ValueError, match="samples_per_class must be >= 1"):
        split_indices(labels, "per_class", samples_per_class=0)


# ---------------------------------------------------------------------------------------------------------
# Spectral transform
# ---------------------------------------------------------------------------------------------------------


def test_normalisation_uses_training_pixels_only(scene):
    cube, _ = scene
    pixels = cube.reshape(-1, cube.shape[-1]).astype(np.float64)
    train = pixels[:100]
    t = SpectralTransform(normalize=True).fit(train.astype(np.float32))
    ref = (pixels - train.mean(0)) / train.std(0)
    out = t.apply(cube).reshape(-1, cube.shape[-1])
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel <= 1e-6, rel  # float32 output vs float64 reference


@pytest.mark.parametrize("groups", [1, 3])
def test_pca_matches_float64_eigendecomposition(scene, groups):
    cube, _ = scene
    rng = np.random.default_rng(1)
    pixels = cube.reshape(-1, cube.shape[-1]).astype(np.float64)
    train = pixels[rng.choice(len(pixels), 150, replace=False)]
    t = SpectralTransform(normalize=True, n_components=6, groups=groups).fit(train.astype(np.float32))
    assert t.num_bands_out == 6
    z = (train.astype(np.float32).astype(np.float64) - t.mean) / t.std
    zall = (pixels - t.mean) / t.std
    edges = np.linspace(0, cube.shape[-1], groups + 1).round().astype(int)
    per = [6 // groups + (g < 6 % groups) for g in range(groups)]
    refs = []
    for g in range(groups):
        zg = z[:, edges[g] : edges[g + 1]]
        mu = zg.mean(0)
        w, v = np.linalg.eigh(np.cov(zg - mu, rowvar=False))
        comps = v[:, ::-1][:, : per[g]]  # top components
        proj = (zall[:, edges[g] : edges[g + 1]] - mu) @ comps
        refs.append(proj)
    ref = np.concatenate(refs, 1)
    out = t.apply(cube).reshape(-1, 6).astype(np.float64)
    # Components are defined up to sign: align each column's sign with the reference.
    out *= np.sign((out * ref).sum(0))
    rel = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert rel <= 1e-5, rel  # float32 output vs float64 eigendecomposition
    # The fitted state survives a weights-only checkpoint round trip.
    buf = io.BytesIO()
    torch.save(t.state_dict(), buf)
    buf.seek(0)
    t2 = SpectralTransform.from_state_dict(torch.load(buf, weights_only=True))
    np.testing.assert_array_equal(t2.apply(cube), t.apply(cube))


def test_pca_argument_errors(scene):
    cube, _ = scene
    px = cube.reshape(-1, cube.shape[-1])
    with pytest.raises(ValueError, match="n_components \\(20\\) must be <= the number of bands \\(12\\)"):
        SpectralTransform(n_components=20).fit(px)
    with pytest.raises(ValueError, match="cannot give"):
        SpectralTransform(n_components=6).fit(px[:3])
    with pytest.raises(ValueError, match="fitted on 12 bands"):
        SpectralTransform().fit(px).apply(cube[..., :5])


# ---------------------------------------------------------------------------------------------------------
# Patches and the DataModule
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("p", [1, 3, 7])
def test_patches_reflect_at_borders(scene, p):
    cube, _ = scene
    h, w, _ = cube.shape
    padded = pad_cube(cube, p)
    r = p // 2
    ref_pad = np.pad(cube, ((r, r), (r, r), (0, 0)), mode="reflect")
    rows = torch.tensor([0, 0, h - 1, h - 1, 5])
    cols = torch.tensor([0, w - 1, 0, w - 1, 6])
    out = extract_patches(padded, rows, cols, p)
    assert out.shape == (5, cube.shape[-1], p, p)
    for i in range(5):
        ref = ref_pad[rows[i] : rows[i] + p, cols[i] : cols[i] + p].transpose(2, 0, 1)
        np.testing.assert_array_equal(out[i].numpy(), ref)
        np.testing.assert_array_equal(out[i, :, r, r].numpy(), cube[rows[i], cols[i]])  # centred on the pixel


def test_patch_size_errors(scene):
    cube, _ = scene
    with pytest.raises(ValueError, match="odd"):
        pad_cube(cube, 4)
    with pytest.raises(ValueError, match="too large for a 20x18 scene"):
        pad_cube(cube, 41)
    with pytest.raises(TypeError, match="patch_size"):
        pad_cube(cube, 3.0)


def test_datamodule(tmp_path, scene):
    cube, gt = scene
    np.save(tmp_path / "c.npy", cube)
    np.save(tmp_path / "g.npy", gt)
    dm = HSIDataModule(
        str(tmp_path / "c.npy"),
        str(tmp_path / "g.npy"),
        patch_size=5,
        pca={"n_components": 6, "groups": 2},
        split={"protocol": "per_class", "samples_per_class": 8},
        batch_size=16,
        seed=0,
    )
    dm.setup("fit")
    assert dm.num_bands == 6 and dm.num_classes == 4
    assert dm.split_sizes["train"] == 32
    assert dm.split_sizes["train"] + dm.split_sizes["val"] + dm.split_sizes["test"] == int((gt > 0).sum())
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (16, 6, 5, 5) and x.dtype == torch.float32
    assert y.min() >= 0 and y.max() < 4
    # Every epoch's order is a function of (seed, epoch) alone: a resumed run replays it.
    from elsa_vision.data.samplers import EpochShuffleSampler

    def order(module, epoch, consume_first):
        loader = module.train_dataloader()
        if consume_first:
            list(loader)  # an earlier epoch drawn in this process
        loader.sampler.set_epoch(epoch)
        return torch.cat([y for _, y in loader]).tolist(), list(loader.sampler)

    assert isinstance(dm.train_dataloader().sampler, EpochShuffleSampler)
    # every training pixel in every epoch: 32 at batch 16 and, below, a last partial batch kept
    assert sum(len(y) for _, y in dm.train_dataloader()) == dm.split_sizes["train"]
    dm.batch_size = 24
    assert [len(y) for _, y in dm.train_dataloader()] == [24, 8]
    dm.batch_size = 16
    assert order(dm, 3, True) == order(dm, 3, False) and order(dm, 3, False) != order(dm, 4, False)
    # The training pixels' centre spectra, after the transform, equal the transform applied directly.
    rc = dm.split_coords["train"]
    direct = dm.transform.apply(cube[rc[:, 0], rc[:, 1]])
    centres = torch.stack([dm.train_set.padded[:, r + 2, c + 2] for r, c in rc]).numpy()
    np.testing.assert_allclose(centres, direct, rtol=0, atol=1e-6)
    # Labels of the datasets are the encoded ground truth at the centres.
    for name, ds in (("val", dm.val_set), ("test", dm.test_set)):
        coords = dm.split_coords[name]
        np.testing.assert_array_equal(ds.labels.numpy(), gt[coords[:, 0], coords[:, 1]].astype(np.int64) - 1)
    # Statistics and PCA come from training pixels only: scaling every other pixel changes nothing.
    other = np.ones(gt.shape, dtype=bool)
    other[rc[:, 0], rc[:, 1]] = False
    cube2 = cube.copy()
    cube2[other] *= 100.0
    np.save(tmp_path / "c2.npy", cube2)
    dm2 = HSIDataModule(
        str(tmp_path / "c2.npy"),
        str(tmp_path / "g.npy"),
        patch_size=5,
        pca={"n_components": 6, "groups": 2},
        split={"protocol": "per_class", "samples_per_class": 8},
        batch_size=16,
        seed=0,
    )
    dm2.setup("fit")
    np.testing.assert_array_equal(dm2.transform.mean, dm.transform.mean)
    np.testing.assert_array_equal(dm2.transform.std, dm.transform.std)
    for g1, g2 in zip(dm.transform.pca, dm2.transform.pca):
        np.testing.assert_array_equal(g1["components"], g2["components"])
    meta = dm.hsi_meta
    buf = io.BytesIO()
    torch.save(meta, buf)
    buf.seek(0)
    assert torch.load(buf, weights_only=True)["patch_size"] == 5

    pre = HSIDataModule(
        str(tmp_path / "c.npy"),
        str(tmp_path / "g.npy"),
        patch_size=3,
        pretrain=True,
        max_pretrain_samples=100,
    )
    pre.setup("fit")
    assert len(pre.train_set) == 100 and (pre.train_set.labels == -1).all()
    with pytest.raises(ValueError, match="split: unknown keys"):
        HSIDataModule("c.npy", split={"protocl": "ratio"})
    with pytest.raises(ValueError, match="patch_size must be odd"):
        HSIDataModule("c.npy", patch_size=4)


def test_labels_out_of_range_are_named_and_cost_no_memory(tmp_path):
    """One pixel labelled 2**40: a clear error naming the label and where it is (the label lookup used to be
    sized by the largest label: 8 TiB); encode_labels itself needs memory for the pixels only."""
    import tracemalloc

    from elsa_vision.data.readers import MAX_CLASSES, MAX_LABEL

    gt = np.zeros((6, 5), np.int64)
    gt[1, 1], gt[2, 2], gt[4, 3] = 1, 3, 2**40
    np.save(tmp_path / "gt.npy", gt)
    refused = rf"gt\.npy has label 1099511627776 at row 4, column 3: .* 0\.\.{MAX_LABEL} "
    with pytest.raises(ValueError, match=refused):
        load_gt(tmp_path / "gt.npy")
    np.save(tmp_path / "gt_float.npy", gt.astype(np.float64))
    with pytest.raises(ValueError, match="at row 4, column 3"):
        load_gt(tmp_path / "gt_float.npy")
    tracemalloc.start()
    try:
        enc, values = encode_labels(gt)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 2**20 and values.tolist() == [1, 3, 2**40]
    assert enc[1, 1] == 0 and enc[2, 2] == 1 and enc[4, 3] == 2 and (enc[gt == 0] == -1).all()
    enc2, _ = encode_labels(gt, class_values=[3, 1, 2**40])  # any order of the known classes
    assert enc2[1, 1] == 1 and enc2[2, 2] == 0 and enc2[4, 3] == 2
    with pytest.raises(ValueError, match=r"labels \[1099511627776\] outside the known classes"):
        encode_labels(gt, class_values=[1, 3])
    many = np.arange(1, 31 * 40 + 1).reshape(31, 40) % (MAX_CLASSES + 5) + 1
    np.save(tmp_path / "band.npy", many)
    refused = rf"band\.npy has {MAX_CLASSES + 5} distinct labels, more than {MAX_CLASSES}"
    with pytest.raises(ValueError, match=refused):
        load_gt(tmp_path / "band.npy")


# ---------------------------------------------------------------------------------------------------------
# What a file can make the readers allocate or open
# ---------------------------------------------------------------------------------------------------------


def _peak_bytes(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), peak bytes traced while it ran)``: NumPy's and Python's allocations."""
    import tracemalloc

    tracemalloc.start()
    try:
        out = fn(*args, **kwargs)
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_mat_v5_reads_numeric_variables_only(tmp_path):
    """A cell whose header declares 8 bytes holds 8 MiB (deflated to a few KB), a complex double declares
    half what scipy allocates for it: neither is read, so the cube's file stays within its limit."""
    cell = np.empty((1, 1), dtype=object)
    cell[0, 0] = np.zeros(2**20)  # 8 MiB of zeros
    small = np.arange(4 * 5 * 3, dtype=np.float32).reshape(4, 5, 3)
    variables = {"cube": small, "cell": cell, "z": np.full((256, 256), 1 + 2j), "note": "text"}
    scipy.io.savemat(tmp_path / "cells.mat", variables, do_compression=True)
    assert (tmp_path / "cells.mat").stat().st_size < 64 * 2**10
    arrays, peak = _peak_bytes(list_arrays, tmp_path / "cells.mat", max_bytes=2**20)
    assert set(arrays) == {"cube"} and np.array_equal(arrays["cube"], small)
    assert peak < 2**20, peak  # the cell (8 MiB) and the complex variable (3 MiB to read) were never read
    scipy.io.savemat(tmp_path / "plain.mat", {"cube": small, "z": np.full((4, 5), 2j)})  # uncompressed
    assert set(list_arrays(tmp_path / "plain.mat")) == {"cube"}


def test_cube_and_labels_allocate_within_the_limit(tmp_path, monkeypatch):
    """The limit bounds what a read allocates: the uint8 cube as read, its float32 copy beside it and the
    non-finite masks (a slice at a time) together; the same for the int64 copy of a label map."""
    from elsa_vision.data.readers import _common

    monkeypatch.setattr(_common, "SLICE_BYTES", 4096, raising=False)
    cube = np.random.default_rng(0).integers(0, 255, (64, 64, 64), dtype=np.uint8)  # 256 KiB; float32: 1 MiB
    np.save(tmp_path / "cube.npy", cube)
    with pytest.raises(FileTooLargeError, match=r"cube\.npy'.*cube 'array' in float32 .* beside"):
        load_cube(tmp_path / "cube.npy", max_bytes=2**20)  # what it declares fits, with its copy it does not
    limit = 2**20 + 2**18
    read, peak = _peak_bytes(load_cube, tmp_path / "cube.npy", max_bytes=limit)
    assert np.array_equal(read, cube) and read.dtype == np.float32
    assert peak < limit + 64 * 2**10, peak
    gt = np.ones((256, 256), np.uint8)  # 64 KiB, 512 KiB in int64
    np.save(tmp_path / "gt.npy", gt)
    with pytest.raises(FileTooLargeError, match=r"gt\.npy'.*ground truth 'array' in int64"):
        load_gt(tmp_path / "gt.npy", max_bytes=2**19)
    labels, peak = _peak_bytes(load_gt, tmp_path / "gt.npy", max_bytes=2**19 + 2**16)
    assert np.array_equal(labels, gt) and peak < 2**19 + 2**16 + 192 * 2**10, peak  # + 64 KiB label table
    bad = cube.astype(np.float32)
    bad[1, 2, 5] = np.nan
    np.save(tmp_path / "nan.npy", bad)
    filled, peak = _peak_bytes(load_cube, tmp_path / "nan.npy", nan_policy="fill", max_bytes=2**20)
    assert filled[1, 2, 5] == pytest.approx(np.delete(bad[..., 5].ravel(), 64 + 2).mean(dtype=np.float64))
    assert peak < 2**20 + 64 * 2**10, peak  # read as float32, filled in place


def test_one_file_scene_named_twice_is_read_once(tmp_path, scene, monkeypatch):
    """``gt_path`` naming the cube's own file (as HSIDataModule passes it) reads that file once."""
    import elsa_vision.data.readers.cubes as cubes

    cube, gt = scene
    np.savez(tmp_path / "scene.npz", cube=cube, gt=gt)
    reads = []
    real = cubes.list_arrays
    monkeypatch.setattr(cubes, "list_arrays", lambda *a, **k: reads.append(a[0]) or real(*a, **k))
    s = load_scene(tmp_path / "scene.npz", tmp_path / "scene.npz")
    assert len(reads) == 1 and np.array_equal(s.gt, gt) and np.array_equal(s.cube, cube)


def test_hdf5_that_reads_other_files_is_refused(tmp_path):
    """A v7.3 file whose dataset is stored in another file (here a secret beside it; a FIFO would hang),
    maps one (a virtual dataset) or links to one is refused before any dataset is read."""
    secret = tmp_path / "secret.txt"
    secret.write_bytes(b"root:x:0:0:root:/root:/bin/bash\n" * 2)
    with h5py.File(tmp_path / "external.mat", "w") as f:
        f.create_dataset("cube", (4, 4, 4), "u1", external=[(str(secret), 0, 64)])
    with pytest.raises(ValueError, match=r"external\.mat: HDF5 dataset with external storage 'cube' reads"):
        load_cube(tmp_path / "external.mat")
    with h5py.File(tmp_path / "source.h5", "w") as f:
        f["cube"] = np.zeros((4, 4, 4), np.uint8)
    with h5py.File(tmp_path / "virtual.mat", "w") as f:
        layout = h5py.VirtualLayout((4, 4, 4), "u1")
        layout[:] = h5py.VirtualSource(str(tmp_path / "source.h5"), "cube", (4, 4, 4))
        f.create_virtual_dataset("cube", layout)
    with pytest.raises(ValueError, match=r"virtual\.mat: HDF5 virtual dataset 'cube'"):
        load_cube(tmp_path / "virtual.mat")
    with h5py.File(tmp_path / "linked.mat", "w") as f:
        f["gt"] = np.ones((4, 4), np.uint8)
        f["cube"] = h5py.ExternalLink(str(tmp_path / "source.h5"), "/cube")
    with pytest.raises(ValueError, match=r"linked\.mat: HDF5 external link 'cube' \(to '.*source\.h5'\)"):
        list_arrays(tmp_path / "linked.mat")


def test_envi_data_is_read_as_its_header_declares(tmp_path, scene):
    """The ENVI data file is read with NumPy from the header's shape, type, byte order, offset and
    interleave (spectral's loader held three copies); a data file shorter than its header is named."""
    import spectral.io.envi as envi

    cube, gt = scene
    ints = (cube * 100).astype(np.int16)
    envi.save_image(str(tmp_path / "ints.hdr"), ints, dtype=np.int16, interleave="bil", ext=".img",
                    byteorder=1, metadata={"reflectance scale factor": 100.0})
    np.testing.assert_array_equal(load_cube(tmp_path / "ints.hdr"), ints.astype(np.float32) / np.float32(100))
    counts = np.stack([gt, gt + 1], -1)
    envi.save_image(str(tmp_path / "counts.hdr"), counts, dtype=np.uint8, ext=".raw")
    assert list_arrays(tmp_path / "counts.hdr")["image"].dtype == np.uint8  # as stored, not float32
    np.testing.assert_array_equal(load_cube(tmp_path / "counts.hdr"), counts)
    data = (tmp_path / "counts.raw").read_bytes()
    (tmp_path / "counts.raw").write_bytes(data[:-10])
    refused = r"counts\.hdr: cannot read ENVI image: the data file .*counts\.raw holds 710 bytes"
    with pytest.raises(ValueError, match=refused):
        load_cube(tmp_path / "counts.hdr")


def _refused(fn, path, match, exc=ValueError, **kwargs):
    """The peak bytes traced while ``fn(path, **kwargs)`` is refused with ``exc`` matching ``match``."""

    def refuse():
        with pytest.raises(exc, match=match):
            fn(path, **kwargs)

    return _peak_bytes(refuse)[1]


def test_npz_member_shorter_than_its_header_is_refused(tmp_path):
    """An ``.npz`` member holding only a ``.npy`` header for 64 MiB (stored or deflated) is refused from the
    member's size in the zip directory, before NumPy allocates the array it declares."""
    import zipfile

    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (256, 256, 256)})
    for method in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
        path = tmp_path / f"short_{method}.npz"
        with zipfile.ZipFile(path, "w", method) as z:
            z.writestr("cube.npy", header.getvalue())
            z.writestr("gt.npy", np.save(buf := io.BytesIO(), np.ones((4, 4), np.uint8)) or buf.getvalue())
        refused = rf"short_{method}\.npz.*'cube'.*67,108,864 bytes.* holds 0 bytes"
        assert _refused(load_cube, path, refused) < 2**20
        assert _refused(list_arrays, path, refused) < 2**20


def test_mat_v5_variable_past_the_end_is_refused(tmp_path):
    """An uncompressed v5 variable (or its data element) declaring 64 MiB of single data that the file does
    not hold is refused before ``np.fromfile`` allocates it."""
    import struct

    def element(kind, payload):
        return struct.pack("<II", kind, len(payload)) + payload + b"\0" * (-len(payload) % 8)

    shape, nbytes = (256, 256, 256), 4 * 256**3
    flags, dims = element(6, struct.pack("<II", 7, 0)), element(5, struct.pack("<3i", *shape))
    body = flags + dims + element(1, b"cube") + struct.pack("<II", 7, nbytes)  # miSINGLE data tag, no data
    header = b"MATLAB 5.0 MAT-file".ljust(116, b" ") + b"\0" * 8 + struct.pack("<H", 0x0100) + b"IM"
    (tmp_path / "past_file.mat").write_bytes(header + struct.pack("<II", 14, len(body) + nbytes) + body)
    declared = len(body) + nbytes
    refused = rf"past_file\.mat: cannot read MATLAB file: variable at byte 128 declares {declared:,} bytes"
    assert _refused(load_cube, tmp_path / "past_file.mat", refused) < 2**20
    # the variable fits the file, its data element does not
    (tmp_path / "past_var.mat").write_bytes(header + struct.pack("<II", 14, len(body)) + body)
    refused = r"past_var\.mat: cannot read MATLAB file: variable 'cube' .* past the end of the variable"
    assert _refused(load_cube, tmp_path / "past_var.mat", refused) < 2**20


def test_mat_v4_headers_are_bounded_by_the_file(tmp_path):
    """A v4 variable header declaring a name or data the file does not hold is refused before scipy reads
    them (it reads the declared size first); valid v4 files (real, complex, text, sparse) read as before."""
    import struct

    import scipy.sparse

    (tmp_path / "name.mat").write_bytes(struct.pack("<5i", 0, 2, 2, 0, 2**26) + b"cube\0" + b"\0" * 16)
    refused = r"name\.mat: cannot read MATLAB file: variable at byte 0 declares a 67108864-byte name"
    assert _refused(load_cube, tmp_path / "name.mat", refused) < 2**20
    (tmp_path / "data.mat").write_bytes(struct.pack("<5i", 0, 2048, 2048, 0, 5) + b"cube\0" + b"\0" * 16)
    refused = r"data\.mat: cannot read MATLAB file: variable at byte 0 .* 33,554,432 bytes of data, past the"
    assert _refused(load_cube, tmp_path / "data.mat", refused) < 2**20
    cube = np.arange(4 * 5 * 3, dtype=np.float64).reshape(4, 5 * 3)
    scipy.io.savemat(tmp_path / "v4.mat", {"note": "text", "z": np.full((3, 2), 1 + 2j), "cube": cube,
                                          "s": scipy.sparse.csc_matrix(np.eye(5)), "gt": np.ones((4, 5))},
                     format="4")
    (tmp_path / "v4_big.mat").write_bytes((tmp_path / "v4.mat").read_bytes()[:-8])  # one value short
    arrays = list_arrays(tmp_path / "v4.mat")
    np.testing.assert_array_equal(arrays["cube"], cube)
    assert set(arrays) == {"cube", "gt"}  # the sparse, complex and text variables before them are skipped
    with pytest.raises(ValueError, match=r"v4_big\.mat: cannot read MATLAB file: variable at byte \d+ "):
        list_arrays(tmp_path / "v4_big.mat")


def test_hdf5_chunks_are_counted_against_the_limit(tmp_path):
    """HDF5 decodes whole chunks, and a chunk may be larger than its dataset when its maxshape is unlimited:
    a chunk larger than its dataset and than a slice is refused, a smaller one counts against the limit."""
    import struct

    scale_offset_chunk = struct.pack("<I", 0) + bytes([8]) + b"\0" * 16  # minbits 0: every value the minimum
    for name, chunks in (("huge", (32, 1024, 1024)), ("small", (64, 64, 64))):
        with h5py.File(tmp_path / f"{name}.mat", "w") as f:
            d = f.create_dataset("cube", (2, 2, 2), "i1", maxshape=(None,) * 3, chunks=chunks, scaleoffset=0)
            d.id.write_direct_chunk((0, 0, 0), scale_offset_chunk, 0)
    refused = r"huge\.mat: HDF5 dataset 'cube' of shape \(2, 2, 2\) is stored in chunks of shape \(32, 1024, "
    with pytest.raises(ValueError, match=refused):
        load_cube(tmp_path / "huge.mat")
    with pytest.raises(FileTooLargeError, match=r"small\.mat'.*a chunk of HDF5 dataset 'cube' of shape"):
        load_cube(tmp_path / "small.mat", max_bytes=2**16)
    assert load_cube(tmp_path / "small.mat", max_bytes=2**19).shape == (2, 2, 2)
    a = np.arange(10 * 12 * 6, dtype=np.float32).reshape(10, 12, 6)
    for chunks in (True, (3, 4, 5)):  # h5py's own chunks and chunks that do not divide the shape
        with h5py.File(tmp_path / "compressed.mat", "w") as f:
            f.create_dataset("a", data=np.ascontiguousarray(a.T), chunks=chunks, compression="gzip")
        np.testing.assert_array_equal(load_cube(tmp_path / "compressed.mat"), a)


def test_envi_negative_header_offset_is_refused(tmp_path):
    (tmp_path / "neg.hdr").write_text("ENVI\nsamples = 2\nlines = 2\nbands = 2\nheader offset = -100\n"
                                      "data type = 1\ninterleave = bsq\nbyte order = 0\n")
    (tmp_path / "neg.img").write_bytes(b"\0" * 8)
    with pytest.raises(ValueError, match=r"neg\.hdr: cannot read ENVI image: header offset -100 is negative"):
        load_cube(tmp_path / "neg.hdr")
