"""Medical and large-image readers: every format on generated files, values kept in float32 (no 8-bit
squeeze), bad input."""

import gzip
import os
import zlib

import numpy as np
import pytest

from elsa_vision.data.readers import (
    apply_nan_policy,
    detect_format,
    iter_images,
    load_image,
    map_channels,
    normalize,
    read_image,
)

tifffile = pytest.importorskip("tifffile")
nib = pytest.importorskip("nibabel")
pydicom = pytest.importorskip("pydicom")
PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402


def _u16(shape, seed=0):
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 65535, size=shape, dtype=np.uint16)
    a.flat[0] = 65535  # values far above 255 must survive
    return a


# ------------------------------------------------------------------------------------------------ TIFF


def test_tiff_16bit_memmap_exact(tmp_path):
    a = _u16((37, 53))
    p = tmp_path / "a.tif"
    tifffile.imwrite(p, a)
    im = read_image(p)
    assert im.data.dtype == np.float32 and im.data.shape == (1, 37, 53)
    assert im.meta["memmap"] is True and im.meta["source_dtype"] == "uint16"
    np.testing.assert_array_equal(im.data[0], a.astype(np.float32))
    assert im.data.max() == 65535.0


def test_tiff_compressed_not_memmapped(tmp_path):
    a = _u16((40, 33), 1)
    p = tmp_path / "z.tif"
    tifffile.imwrite(p, a, compression="zlib")
    im = read_image(p)
    assert im.meta["memmap"] is False
    np.testing.assert_array_equal(im.data[0], a.astype(np.float32))


def test_tiff_float32_copy_is_counted_before_decoding(tmp_path, monkeypatch):
    """A 1 MiB uint8 image (a few KB of zlib strips) is 4 MiB in float32: the limit bounds the decoded
    series and that copy together, checked before a strip is decoded (it was checked after decoding)."""
    from elsa_vision.files import FileTooLargeError

    a = np.zeros((1024, 1024), np.uint8)
    tifffile.imwrite(tmp_path / "z.tif", a, compression="zlib")
    assert (tmp_path / "z.tif").stat().st_size < 16 * 2**10
    with monkeypatch.context() as m:
        m.setattr(tifffile.TiffPageSeries, "asarray", lambda *a, **k: pytest.fail("decoded"))
        refused = r"z\.tif'.*one TIFF image \(float32\) .* beside 0\.0 GiB"
        for limit in (3 * 2**20, 5 * 2**20 - 1):  # 4 MiB in float32 fits the second, not beside 1 MiB
            with pytest.raises(FileTooLargeError, match=refused):
                read_image(tmp_path / "z.tif", max_bytes=limit)
    assert read_image(tmp_path / "z.tif", max_bytes=5 * 2**20).data.shape == (1, 1024, 1024)
    tifffile.imwrite(tmp_path / "plain.tif", a)  # memory-mapped: only the float32 copy is allocated
    assert read_image(tmp_path / "plain.tif", max_bytes=4 * 2**20).meta["memmap"] is True


def test_tiff_is_read_from_its_own_file_only(tmp_path):
    """An OME-TIFF can name other files for some of its planes (any name: ../secret.tif, a FIFO); only the
    file given is read, its own pages as a plain series."""
    from elsa_vision.data.readers import read_tiff

    tifffile.imwrite(tmp_path / "a.ome.tif", np.full((8, 8), 1, np.uint8))
    tifffile.imwrite(tmp_path / "other.ome.tif", np.full((8, 8), 7, np.uint8))
    plane = ('<TiffData FirstC="{c}" IFD="0" PlaneCount="1">'
             '<UUID FileName="{f}">urn:uuid:{u}</UUID></TiffData>')
    xml = (
        '<?xml version="1.0" encoding="UTF-8"?>'
        '<OME xmlns="http://www.openmicroscopy.org/Schemas/OME/2016-06" UUID="urn:uuid:a">'
        '<Image ID="Image:0"><Pixels ID="Pixels:0" DimensionOrder="XYCZT" Type="uint8" '
        'SizeX="8" SizeY="8" SizeC="2" SizeZ="1" SizeT="1"><Channel ID="Channel:0:0" SamplesPerPixel="1"/>'
        '<Channel ID="Channel:0:1" SamplesPerPixel="1"/>'
        + plane.format(c=0, f="a.ome.tif", u="a") + plane.format(c=1, f="other.ome.tif", u="b")
        + "</Pixels></Image></OME>"
    )
    with tifffile.TiffFile(tmp_path / "a.ome.tif", mode="r+b") as tf:
        tf.pages[0].tags["ImageDescription"].overwrite(xml)
    with tifffile.TiffFile(tmp_path / "a.ome.tif") as tf:  # what tifffile itself reads: both files
        assert tf.series[0].asarray().max(axis=(1, 2)).tolist() == [1, 7]
    tif = read_tiff(tmp_path / "a.ome.tif")
    assert tif.data.shape == (8, 8) and tif.data.max() == 1


def test_ome_tiff_pyramid_levels(tmp_path):
    a = _u16((96, 128), 2)
    levels = [a, a[::2, ::2].copy(), a[::4, ::4].copy()]
    p = tmp_path / "pyr.ome.tif"
    with tifffile.TiffWriter(p, ome=True) as tw:
        tw.write(levels[0], subifds=2, metadata={"axes": "YX"})
        for lv in levels[1:]:
            tw.write(lv, subfiletype=1)
    assert detect_format(p) == "tiff"
    for i, ref in enumerate(levels):
        im = read_image(p, level=i)
        assert im.meta["levels"] == 3 and im.meta["level"] == i
        assert im.data.shape == (1,) + ref.shape
        np.testing.assert_array_equal(im.data[0], ref.astype(np.float32))
    with pytest.raises(ValueError, match="pyramid level=3 is out of range"):
        read_image(p, level=3)


def test_tiff_stack_and_rgb(tmp_path):
    z = _u16((5, 20, 24), 3)
    p = tmp_path / "z.tif"
    tifffile.imwrite(p, z, metadata={"axes": "ZYX"})
    np.testing.assert_array_equal(read_image(p, slice_index=3).data[0], z[3].astype(np.float32))
    all_ = list(iter_images(p, slice_index="all"))
    assert [im.index for im in all_] == list(range(5)) and all(im.count == 5 for im in all_)
    rgb = _u16((20, 24, 3), 4)
    q = tmp_path / "rgb.tif"
    tifffile.imwrite(q, rgb, photometric="rgb")
    im = read_image(q)
    assert im.data.shape == (3, 20, 24)
    np.testing.assert_array_equal(im.data, np.moveaxis(rgb, -1, 0).astype(np.float32))


def test_tiff_float64_and_int32(tmp_path):
    f = np.random.default_rng(5).normal(size=(17, 19)) * 1e5
    tifffile.imwrite(tmp_path / "f.tif", f)
    np.testing.assert_allclose(read_image(tmp_path / "f.tif").data[0], f, rtol=1e-7)
    i = np.arange(17 * 19, dtype=np.int32).reshape(17, 19) * 100000 - 5
    tifffile.imwrite(tmp_path / "i.tif", i)
    np.testing.assert_array_equal(read_image(tmp_path / "i.tif").data[0], i.astype(np.float32))


@pytest.mark.parametrize("dtype", [np.complex64, bool])
def test_tiff_unsupported_dtype(tmp_path, dtype):
    a = (np.arange(16 * 16).reshape(16, 16) % 3).astype(dtype)
    p = tmp_path / "bad.tif"
    tifffile.imwrite(p, a, compression="zlib")  # compressed: decoding it would be work done for nothing
    import tifffile as tf_module

    def no_decode(*args, **kwargs):
        raise AssertionError("the pixels were decoded before the dtype was checked")

    with pytest.MonkeyPatch.context() as m:
        m.setattr(tf_module.TiffPageSeries, "asarray", no_decode)
        m.setattr(tf_module, "memmap", no_decode)
        with pytest.raises(TypeError, match="unsupported pixel dtype"):
            read_image(p)


# ----------------------------------------------------------------------------------------------- NIfTI


@pytest.mark.parametrize("ext", [".nii", ".nii.gz"])
def test_nifti_3d_slices(tmp_path, ext):
    vol = np.random.default_rng(6).integers(-2000, 3000, size=(21, 18, 7), dtype=np.int16)
    img = nib.Nifti1Image(vol, np.eye(4))
    img.header.set_slope_inter(2.0, -1024.0)
    p = tmp_path / f"v{ext}"
    nib.save(img, p)
    ref = vol.astype(np.float64) * 2.0 - 1024.0
    im = read_image(p)  # middle slice of axis 2
    assert im.data.dtype == np.float32 and im.data.shape == (1, 21, 18) and im.index == 3 and im.count == 7
    np.testing.assert_array_equal(im.data[0], ref[:, :, 3].astype(np.float32))
    for axis in (0, 1, 2):
        idx = [slice(None)] * 3
        idx[axis] = 4
        im = read_image(p, slice_index=4, slice_axis=axis)
        np.testing.assert_array_equal(im.data[0], ref[tuple(idx)].astype(np.float32))
    ims = list(iter_images(p, slice_index="all", slice_axis=0))
    assert len(ims) == 21
    np.testing.assert_array_equal(ims[20].data[0], ref[20].astype(np.float32))
    with pytest.raises(ValueError, match="slice_index=7 is out of range"):
        read_image(p, slice_index=7)


def test_nifti_reads_lazily(tmp_path, monkeypatch):
    from nibabel.arrayproxy import ArrayProxy

    vol = np.arange(12 * 10 * 6, dtype=np.float32).reshape(12, 10, 6)
    p = tmp_path / "lazy.nii"
    nib.save(nib.Nifti1Image(vol, np.eye(4)), p)
    sliced = []
    real_getitem = ArrayProxy.__getitem__

    def getitem(self, idx):
        sliced.append(idx)
        return real_getitem(self, idx)

    def whole(self, *a, **k):
        raise AssertionError("the whole volume was read")

    monkeypatch.setattr(ArrayProxy, "__getitem__", getitem)
    monkeypatch.setattr(ArrayProxy, "__array__", whole)
    monkeypatch.setattr(nib.Nifti1Image, "get_fdata", whole)
    im = read_image(p, slice_index=2, slice_axis=1)
    np.testing.assert_array_equal(im.data[0], vol[:, 2, :])
    assert sliced == [(slice(None), 2, slice(None))]


def test_nifti_4d_frame(tmp_path):
    vol = np.random.default_rng(7).normal(size=(9, 10, 4, 3)).astype(np.float32)
    p = tmp_path / "t.nii.gz"
    nib.save(nib.Nifti1Image(vol, np.eye(4)), p)
    np.testing.assert_array_equal(read_image(p, slice_index=1, frame=2).data[0], vol[:, :, 1, 2])


def test_nifti_complex_and_truncated(tmp_path):
    p = tmp_path / "c.nii"
    nib.save(nib.Nifti1Image(np.ones((8, 8, 2), np.complex64), np.eye(4)), p)
    with pytest.raises(TypeError, match="complex"):
        read_image(p)
    good = tmp_path / "g.nii.gz"
    nib.save(nib.Nifti1Image(np.ones((64, 64, 16), np.float32), np.eye(4)), good)
    raw = good.read_bytes()
    bad = tmp_path / "trunc.nii.gz"
    bad.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(ValueError, match="trunc.nii.gz"):
        list(iter_images(bad, slice_index="all"))


# ----------------------------------------------------------------------------------------------- DICOM


def _write_dicom(path, pixels, *, slope=1.0, intercept=0.0, photometric="MONOCHROME2", window=None):
    from pydicom.dataset import FileDataset, FileMetaDataset
    from pydicom.uid import CTImageStorage, ExplicitVRLittleEndian, generate_uid

    meta = FileMetaDataset()
    meta.MediaStorageSOPClassUID = CTImageStorage
    meta.MediaStorageSOPInstanceUID = generate_uid()
    meta.TransferSyntaxUID = ExplicitVRLittleEndian
    ds = FileDataset(str(path), {}, file_meta=meta, preamble=b"\0" * 128)
    ds.SOPClassUID, ds.SOPInstanceUID = meta.MediaStorageSOPClassUID, meta.MediaStorageSOPInstanceUID
    ds.Modality = "CT"
    frames = pixels.shape[0] if pixels.ndim == 3 else 1
    if frames > 1:
        ds.NumberOfFrames = frames
    ds.Rows, ds.Columns = pixels.shape[-2:]
    ds.SamplesPerPixel = 1
    ds.PhotometricInterpretation = photometric
    ds.BitsAllocated = ds.BitsStored = 16
    ds.HighBit = 15
    ds.PixelRepresentation = 1 if pixels.dtype == np.int16 else 0
    ds.RescaleSlope, ds.RescaleIntercept = slope, intercept
    if window is not None:
        ds.WindowCenter, ds.WindowWidth = window
    ds.PixelData = pixels.tobytes()
    ds.save_as(path, enforce_file_format=True)


def test_dicom_rescale_and_frames(tmp_path):
    px = _u16((3, 30, 26), 8)
    p = tmp_path / "mf.dcm"
    _write_dicom(p, px, slope=2.5, intercept=-1024.0)
    frames = list(iter_images(p))
    assert len(frames) == 3
    for i, im in enumerate(frames):
        assert im.data.dtype == np.float32 and im.data.shape == (1, 30, 26)
        np.testing.assert_array_equal(
            im.data[0], (px[i].astype(np.float64) * 2.5 - 1024.0).astype(np.float32)
        )
    assert read_image(p).index == 0
    np.testing.assert_array_equal(read_image(p, frame=2).data[0], (px[2] * 2.5 - 1024.0).astype(np.float32))


def test_dicom_window_and_monochrome1(tmp_path):
    px = np.arange(-500, 500, dtype=np.int16).reshape(25, 40)
    p = tmp_path / "w.dcm"
    _write_dicom(p, px, window=(40.0, 400.0), photometric="MONOCHROME1")
    im = read_image(p)
    assert im.meta["file_window"] == (40.0, 400.0)
    x, facts = load_image(im, in_chans=1, window="file", norm="none")
    ref = 1.0 - np.clip((px.astype(np.float64) - (40 - 200)) / 400.0, 0, 1)  # windowed, then inverted
    np.testing.assert_allclose(x[0], ref, atol=1e-6)
    assert facts["inverted_monochrome1"] and facts["window"] == [40.0, 400.0]
    x2, _ = load_image(im, in_chans=1, window=(0.0, 100.0), norm="none", invert_monochrome1=False)
    np.testing.assert_allclose(x2[0], np.clip((px + 50.0) / 100.0, 0, 1), atol=1e-6)
    with pytest.warns(UserWarning, match="window"):
        load_image(im, in_chans=1, norm="none")


def test_dicom_ct_small_sample():
    from pydicom.data import get_testdata_file

    path = get_testdata_file("CT_small.dcm", download=False)
    ds = pydicom.dcmread(path)
    im = read_image(path)
    assert im.data.shape == (1, 128, 128) and im.format == "dicom"
    ref = ds.pixel_array.astype(np.float64) * float(ds.RescaleSlope) + float(ds.RescaleIntercept)
    np.testing.assert_array_equal(im.data[0], ref.astype(np.float32))
    assert im.data.max() > 255  # int16 CT values are kept, not squeezed


def test_dicom_corrupt(tmp_path):
    p = tmp_path / "x.dcm"
    p.write_bytes(b"\0" * 128 + b"DICM" + os.urandom(200))
    with pytest.raises(ValueError, match="x.dcm"):
        read_image(p)


def test_dicom_attributes_that_are_not_numbers_are_named(tmp_path):
    """NumberOfFrames = "abc" and WindowCenter = "abc" (written raw, as a forged file would hold them): one
    ValueError naming the file and the attribute, not int()'s or float()'s own message."""
    from pydicom.dataelem import RawDataElement
    from pydicom.tag import Tag

    for tag, vr, name in ((0x00280008, "IS", "NumberOfFrames"), (0x00281050, "DS", "WindowCenter")):
        p = tmp_path / f"{name}.dcm"
        _write_dicom(p, _u16((2, 8, 6), 1), window=(40.0, 400.0))
        ds = pydicom.dcmread(p)
        ds._dict[Tag(tag)] = RawDataElement(Tag(tag), vr, 4, b"abc ", 0, False, True)
        ds.save_as(p)
        kind = "an integer" if vr == "IS" else "a number"
        refused = rf"^input file '.*{name}\.dcm': DICOM {name} = 'abc' is not {kind}$"
        with pytest.raises(ValueError, match=refused):
            read_image(p)


# -------------------------------------------------------------------------------------------- PNG/JPEG


def test_png_16bit_kept(tmp_path):
    a = _u16((31, 45), 9)
    p = tmp_path / "a.png"
    Image.fromarray(a).save(p)
    im = read_image(p)
    assert im.data.dtype == np.float32 and im.data.shape == (1, 31, 45)
    np.testing.assert_array_equal(im.data[0], a.astype(np.float32))
    assert im.data.max() == 65535.0


def test_png_16bit_colour_refused(tmp_path):
    p = tmp_path / "rgb16.png"
    import struct  # 16-bit RGB PNG written by hand: Pillow cannot write it
    import zlib

    h, w = 4, 5
    raw = b"".join(b"\0" + np.full((w, 3), 1000, ">u2").tobytes() for _ in range(h))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)

    p.write_bytes(
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 16, 2, 0, 0, 0))
        + chunk(b"IDAT", zlib.compress(raw))
        + chunk(b"IEND", b"")
    )
    with pytest.raises(ValueError, match="16-bit colour PNG"):
        read_image(p)


def test_jpeg_rgb_and_gray(tmp_path):
    rng = np.random.default_rng(10)
    base = np.kron(rng.integers(0, 255, size=(6, 8, 3)), np.ones((8, 8, 1))).astype(np.uint8)
    p = tmp_path / "a.jpg"
    Image.fromarray(base).save(p, quality=98)
    im = read_image(p)
    assert im.data.shape == (3, 48, 64) and im.data.dtype == np.float32
    decoded = np.asarray(Image.open(p))  # the reader must not alter the decoded values
    np.testing.assert_array_equal(im.data, np.moveaxis(decoded, -1, 0).astype(np.float32))
    assert np.abs(im.data - np.moveaxis(base, -1, 0)).mean() < 12.0  # lossy, but the same picture
    g = tmp_path / "g.jpeg"
    Image.fromarray(base[..., 0]).save(g, quality=98)
    assert read_image(g).data.shape == (1, 48, 64)


# ----------------------------------------------------------------------------------------- bad inputs


def test_missing_empty_unknown(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_image(tmp_path / "nope.png")
    e = tmp_path / "e.tif"
    e.write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        read_image(e)
    u = tmp_path / "u.xyz"
    u.write_bytes(b"hello world" * 40)
    with pytest.raises(ValueError, match="unknown format"):
        read_image(u)


@pytest.mark.parametrize("name", ["c.png", "c.jpg", "c.tif", "c.nii", "c.nii.gz"])
def test_corrupt_files(tmp_path, name):
    p = tmp_path / name
    body = os.urandom(600)
    p.write_bytes(gzip.compress(body)[:300] if name.endswith(".gz") else body)
    with pytest.raises(ValueError, match=name):
        list(iter_images(p))


def test_nan_policy_and_small_image(tmp_path):
    a = np.random.default_rng(11).normal(size=(20, 20)).astype(np.float32)
    a[3, 4] = np.nan
    a[5, 6] = np.inf
    p = tmp_path / "n.tif"
    tifffile.imwrite(p, a)
    im = read_image(p)
    with pytest.raises(ValueError, match="2 of 400 values are NaN or infinite"):
        load_image(im, in_chans=1)
    z, facts = load_image(im, in_chans=1, nan_policy="zero", norm="none")
    assert facts["non_finite_replaced"] == 2 and z[0, 3, 4] == 0 and z[0, 5, 6] == 0
    m, _ = load_image(im, in_chans=1, nan_policy="mean", norm="none")
    finite = a[np.isfinite(a)]
    np.testing.assert_allclose(m[0, 3, 4], finite.mean(dtype=np.float64), rtol=1e-6)
    with pytest.raises(ValueError, match="smaller than one 32x32 patch"):
        load_image(im, in_chans=1, nan_policy="zero", min_size=32)
    with pytest.raises(ValueError, match="nan_policy"):
        apply_nan_policy(a, "ignore")


# ------------------------------------------------------------------------------------ value transforms


def test_normalize_and_channels():
    rng = np.random.default_rng(12)
    x = (rng.normal(size=(1, 30, 30)) * 1000 + 3000).astype(np.float32)
    mm = normalize(x, "minmax")
    assert mm.min() == 0.0 and mm.max() == 1.0
    np.testing.assert_allclose(mm, (x - x.min()) / (x.max() - x.min()), rtol=1e-6)
    pc = normalize(x, "percentile", percentiles=(5, 95))
    lo, hi = np.percentile(x, [5, 95])
    np.testing.assert_allclose(pc, (np.clip(x, lo, hi) - lo) / (hi - lo), rtol=1e-5, atol=1e-6)
    z = normalize(x, "zscore")
    assert abs(z.mean()) < 1e-5 and abs(z.std() - 1) < 1e-5
    with pytest.raises(ValueError, match="normalisation must be one of"):
        normalize(x, "l2")
    rep = map_channels(x, 3)
    assert rep.shape == (3, 30, 30) and (rep == x).all()
    rgb = rng.normal(size=(3, 5, 5)).astype(np.float32)
    np.testing.assert_allclose(
        map_channels(rgb, 1)[0], 0.299 * rgb[0] + 0.587 * rgb[1] + 0.114 * rgb[2], rtol=1e-6
    )
    with pytest.raises(ValueError, match="in_chans=4"):
        map_channels(rgb, 4)


def test_load_image_pretrained_mean_std(tmp_path):
    a = _u16((20, 22), 13)
    p = tmp_path / "a.png"
    Image.fromarray(a).save(p)
    x, _ = load_image(
        read_image(p), in_chans=3, norm="pretrained", mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225)
    )
    unit = (a - a.min()) / (a.max() - a.min())
    for c, (m, s) in enumerate(zip((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))):
        np.testing.assert_allclose(x[c], (unit - m) / s, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="mean and std"):
        load_image(read_image(p), in_chans=1, norm="pretrained")


# ------------------------------------------------------------------------ forged sizes and sniffed files


def _peak_bytes(fn):
    """(the exception ``fn()`` raised, the peak of what Python allocated meanwhile)."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - returned for the caller to check
        raised = e
    else:
        raised = None
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return raised, peak


def _tiff_one_strip(compression, bytecount, strip=b"x\x9c\x63\x00\x00\x00\x01\x00"):
    """A 1x1 uint8 TIFF whose one strip, ``strip`` at byte 8, declares ``bytecount`` bytes."""
    import struct

    entries = [(256, 3, 1, 1), (257, 3, 1, 1), (258, 3, 1, 8), (259, 3, 1, compression), (262, 3, 1, 1),
               (273, 4, 1, 8), (277, 3, 1, 1), (278, 3, 1, 1), (279, 4, 1, bytecount)]
    ifd = struct.pack("<H", len(entries)) + b"".join(struct.pack("<HHII", *e) for e in entries) + b"\0" * 4
    return b"II*\0" + struct.pack("<I", 8 + len(strip)) + strip + ifd


@pytest.mark.parametrize("compression", [8, 32773])
def test_tiff_strip_past_end_of_file_refused_before_reading(tmp_path, compression):
    """A 130-byte TIFF whose compressed strip declares 0xFFFFFFF0 bytes: tifffile reads a strip whole at its
    declared size (4 GiB allocated); offsets and byte counts are now checked against the file size first."""
    from elsa_vision.data.readers import read_tiff

    p = tmp_path / f"strip{compression}.tif"
    p.write_bytes(_tiff_one_strip(compression, 0xFFFFFFF0))
    with pytest.MonkeyPatch.context() as m:
        m.setattr(tifffile.TiffPageSeries, "asarray", lambda *a, **k: pytest.fail("strips were read"))
        for read in (read_image, lambda q: read_tiff(q, memmap=False)):
            refused = rf"strip{compression}\.tif'.*4,294,967,280 bytes .*past the end of the 130-byte file"
            with pytest.raises(ValueError, match=refused):
                read(p)
    good = tmp_path / f"good{compression}.tif"  # a strip that lies in the file reads as before
    strip = zlib.compress(b"\x07") if compression == 8 else b"\x00\x07"  # PackBits: 1 literal byte
    good.write_bytes(_tiff_one_strip(compression, len(strip), strip))
    assert read_image(good).data.tolist() == [[[7.0]]]


def _dicom_meta(extra=b""):
    import struct

    def el(tag, vr, val):
        return struct.pack("<HH", *tag) + vr + struct.pack("<H", len(val)) + val

    meta = el((2, 0x10), b"UI", b"1.2.840.10008.1.2.1\0") + extra  # explicit VR little endian
    return b"\0" * 128 + b"DICM" + el((2, 0), b"UL", struct.pack("<I", len(meta))) + meta


@pytest.mark.parametrize("where", ["file meta", "data set", "sequence item"])
def test_dicom_value_past_end_of_file_refused(tmp_path, where):
    """A ~200-byte DICOM with an OB value declaring 256 MiB (in the file meta group, the data set, or an item
    of an undefined-length sequence, which pydicom reads whatever defer_size says): pydicom reads a value
    with read(declared length), allocated before it comes back short. Now refused before that read."""
    import struct

    big = struct.pack("<I", 2**28)
    ob = lambda g, e: struct.pack("<HH", g, e) + b"OB\0\0" + big + b"\0" * 16  # noqa: E731
    if where == "file meta":
        raw = _dicom_meta(ob(2, 0x102))
    elif where == "data set":
        raw = _dicom_meta() + ob(9, 0x1010)
    else:
        item = struct.pack("<HHI", 0xFFFE, 0xE000, 0xFFFFFFFF) + ob(9, 0x1010)
        raw = _dicom_meta() + struct.pack("<HH", 8, 0x1115) + b"SQ\0\0" + struct.pack("<I", 0xFFFFFFFF) + item
    p = tmp_path / "len.dcm"
    p.write_bytes(raw)
    raised, peak = _peak_bytes(lambda: read_image(p))
    assert isinstance(raised, ValueError), raised
    assert "len.dcm'" in str(raised) and "268,435,456 bytes" in str(raised) and "past the end" in str(raised)
    assert peak < 2**26, f"{peak:,} bytes allocated"


def _nifti_with_extension(path, esize, vox_offset, data=b""):
    import struct

    hdr = nib.Nifti1Header()
    hdr.set_data_shape((4, 4, 4))
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = vox_offset
    raw = hdr.binaryblock + b"\x01\0\0\0" + struct.pack("<ii", esize, 6) + b"\0" * 8 + data
    path.write_bytes(gzip.compress(raw) if str(path).endswith(".gz") else raw)


def test_nifti_extension_past_end_of_file_refused(tmp_path):
    """nibabel reads each header extension with read(esize): a 370-byte file with vox_offset 3e9 and an
    extension of 2**31-1 bytes allocated 2 GiB, and its HeaderDataError did not name the file. vox_offset and
    every extension are now checked against the file size (a .nii.gz: the size limit, and the extension must
    be in the stream) before nibabel reads the header."""
    from nibabel.nifti1 import Nifti1Extensions

    from elsa_vision.files import FileTooLargeError

    voxels = np.arange(64, dtype=np.int16).reshape(4, 4, 4, order="F")
    with pytest.MonkeyPatch.context() as m:
        m.setattr(Nifti1Extensions, "from_fileobj", lambda *a, **k: pytest.fail("extensions were read"))
        _nifti_with_extension(tmp_path / "far.nii", 2**31 - 1, 3e9)
        with pytest.raises(ValueError, match=r"far\.nii'.*vox_offset 3,000,000,000 lies past the end"):
            read_image(tmp_path / "far.nii")
        _nifti_with_extension(tmp_path / "ext.nii", 2**31 - 1, 368, voxels.tobytes("F"))
        refused = r"ext\.nii'.*at byte 352 declares 2,147,483,647 bytes, past the end of the 496-byte"
        with pytest.raises(ValueError, match=refused):
            read_image(tmp_path / "ext.nii")
        _nifti_with_extension(tmp_path / "neg.nii", -8, 368, voxels.tobytes("F"))
        with pytest.raises(ValueError, match=r"neg\.nii'.*less than its own 8-byte header"):
            read_image(tmp_path / "neg.nii")
        _nifti_with_extension(tmp_path / "ext.nii.gz", 2**31 - 1, 368, voxels.tobytes("F"))
        with pytest.raises(ValueError, match=r"ext\.nii\.gz'.*past the end of the decompressed data"):
            read_image(tmp_path / "ext.nii.gz")
        with pytest.raises(FileTooLargeError, match=r"ext\.nii\.gz'.*NIfTI header with its extensions"):
            read_image(tmp_path / "ext.nii.gz", max_bytes=2**30)
    # nibabel's own HeaderDataError (an extension header cut off at the end) now names the file
    _nifti_with_extension(tmp_path / "inf.nii", 16, np.inf)
    with pytest.raises(ValueError, match=r"inf\.nii' is not a readable NIfTI file"):
        read_image(tmp_path / "inf.nii")
    for name in ("ok.nii", "ok.nii.gz"):  # true extension sizes read as before
        _nifti_with_extension(tmp_path / name, 16, 368, voxels.tobytes("F"))
        np.testing.assert_array_equal(read_image(tmp_path / name, slice_index=1).data[0], voxels[:, :, 1])


def test_nifti_slice_span_is_checked(tmp_path, monkeypatch):
    """A slice across axis 0 (or 1) is strided over the whole volume, which nibabel reads in one read(): a
    352-byte header declaring (64, 4096, 4096) int16 allocated 2 GiB for slice_axis=0. An uncompressed file
    must now hold the data it declares, and a request spanning more than the limit is read in slabs."""
    from nibabel.arrayproxy import ArrayProxy

    real_getitem = ArrayProxy.__getitem__
    requests = []

    def getitem(self, idx):
        requests.append(idx)
        return real_getitem(self, idx)

    monkeypatch.setattr(ArrayProxy, "__getitem__", lambda *a: pytest.fail("data was read"))
    hdr = nib.Nifti1Header()
    hdr.set_data_shape((64, 512, 512))
    hdr.set_data_dtype(np.int16)
    hdr["vox_offset"] = 352
    (tmp_path / "hollow.nii").write_bytes(hdr.binaryblock + b"\0" * 4)
    for axis in (0, 1, 2):
        with pytest.raises(ValueError, match=r"hollow\.nii'.*33,554,432 bytes\) from byte 352, but the file "
                                             r"holds 352 bytes"):
            read_image(tmp_path / "hollow.nii", slice_axis=axis)
    monkeypatch.setattr(ArrayProxy, "__getitem__", getitem)
    vol = np.random.default_rng(14).integers(-999, 999, size=(64, 8, 32), dtype=np.int16)
    # one 8x32 slice across axis 0: 256 voxels, 3 KiB in float32 + float64 held beside the bytes read
    limit = 256 * 12 + 8192
    for name in ("slab.nii", "slab.nii.gz"):
        nib.save(nib.Nifti1Image(vol, np.eye(4)), tmp_path / name)
        requests.clear()
        im = read_image(tmp_path / name, slice_index=5, slice_axis=0, max_bytes=limit)
        np.testing.assert_array_equal(im.data[0], vol[5])
        # the slice spans 31 planes of 64x8 voxels (1 KiB each): read 8 planes (<= 8 KiB) at a time
        assert [r[2] for r in requests] == [slice(k, k + 8) for k in range(0, 32, 8)]
        requests.clear()
        np.testing.assert_array_equal(read_image(tmp_path / name, slice_index=3, max_bytes=limit).data[0],
                                      vol[:, :, 3])
        assert requests == [(slice(None), slice(None), 3)]  # contiguous: one read, as before


def test_nifti_sniffed_file_is_read_as_nifti_only(tmp_path, monkeypatch):
    """A file of unknown extension is sniffed as NIfTI by the magic at byte 344, but nib.load picks its reader
    by extension: a .mnc went to MINC2 through h5py (an AttributeError not naming the file). Only NIfTI-1 /
    NIfTI-2 headers are read now, whatever the name, and anything else is refused naming the file."""
    h5py = pytest.importorskip("h5py")

    mnc = tmp_path / "scan.mnc"  # the HDF5 signature (nibabel's MINC2 test) and "n+1\0" at byte 344
    mnc.write_bytes(b"\x89HDF\r\n\x1a\n" + b"\0" * 336 + b"n+1\0" + b"\0" * 200)
    assert detect_format(mnc) == "nifti"
    monkeypatch.setattr(h5py, "File", lambda *a, **k: pytest.fail("opened with h5py"))
    with pytest.raises(ValueError, match=r"scan\.mnc' is not a readable NIfTI file: no NIfTI-1 or NIfTI-2"):
        read_image(mnc)
    vol = np.arange(6 * 5 * 3, dtype=np.float32).reshape(6, 5, 3)
    for name in ("vol.mnc", "vol.dat", "vol"):  # a true NIfTI-1 file under another name
        nib.save(nib.Nifti1Image(vol, np.eye(4)), tmp_path / "v.nii")
        os.replace(tmp_path / "v.nii", tmp_path / name)
        assert detect_format(tmp_path / name) == "nifti"
        np.testing.assert_array_equal(read_image(tmp_path / name, slice_index=2).data[0], vol[:, :, 2])
