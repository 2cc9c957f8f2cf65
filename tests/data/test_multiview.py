"""Multi-view data: renderer vs analytic depth (plane, sphere, box), synthetic determinism and multi-view
consistency, NeRF transforms.json and COLMAP text loaders on generated captures, resize intrinsics."""

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from elsa_vision.data.geometry import depth_to_world_points, mat_to_quat
from elsa_vision.data.multiview import (
    MultiViewDataModule,
    MultiViewSequenceDataset,
    Scene,
    SyntheticMultiViewDataset,
    load_colmap_text,
    load_nerf_transforms,
    look_at,
    read_colmap_depth,
    render_scene,
    resize_frame,
)

f64 = torch.float64


def _scene(planes=((0, 0, 1, 0),), boxes=(), spheres=()):
    pl = torch.tensor(planes, dtype=f64).reshape(-1, 4)
    bx = torch.tensor(boxes, dtype=f64).reshape(-1, 6)
    sp = torch.tensor(spheres, dtype=f64).reshape(-1, 4)
    k = len(pl) + len(bx) + len(sp)
    return Scene(
        pl[:, :3],
        pl[:, 3],
        bx[:, :3],
        bx[:, 3:],
        sp[:, :3],
        sp[:, 3],
        torch.rand(k, 2, 3, dtype=f64),
        torch.full((k,), 2.0, dtype=f64),
    )


def _K(f, h, w):
    return torch.tensor([[[f, 0, w / 2], [0, f, h / 2], [0, 0, 1]]], dtype=f64)


def test_plane_at_known_distance_and_tilted_plane():
    h, w = 31, 45
    ext = look_at(
        torch.tensor([[0.3, -0.2, 2.5]], dtype=f64),
        torch.tensor([[0.3, -0.2, 0.0]], dtype=f64),
        up=torch.tensor([0.0, 1.0, 0.0], dtype=f64),
    )
    _, depth, obj = render_scene(_scene(), ext, _K(30.0, h, w), (h, w))
    assert bool((obj == 0).all())
    assert (depth - 2.5).abs().max() <= 1e-12  # fronto-parallel plane: constant z-depth
    # tilted plane n·x = c seen from the origin looking along +y: depth(u,v) = c / (n·d(u,v)), d_cam z = 1
    n = torch.nn.functional.normalize(torch.tensor([0.2, -1.0, 0.3], dtype=f64), dim=0)
    c = -4.0
    ext = look_at(torch.zeros(1, 3, dtype=f64), torch.tensor([[0.0, 1.0, 0.0]], dtype=f64))
    _, depth, _ = render_scene(_scene(planes=(tuple(n.tolist()) + (c,),)), ext, _K(40.0, h, w), (h, w))
    v, u = torch.meshgrid(torch.arange(h, dtype=f64), torch.arange(w, dtype=f64), indexing="ij")
    d_cam = torch.stack([(u - w / 2) / 40.0, (v - h / 2) / 40.0, torch.ones_like(u)], -1)
    d_world = d_cam @ ext[0, :, :3]  # R^T d
    ref = c / (d_world @ n)
    assert (depth - ref).abs().max() / ref.abs().max() <= 1e-12


def test_sphere_depth_and_silhouette_analytic():
    h, w, f, L, r = 41, 41, 50.0, 5.0, 1.2
    ext = look_at(torch.tensor([[0.0, -L, 0.0]], dtype=f64), torch.zeros(1, 3, dtype=f64))
    _, depth, obj = render_scene(_scene(planes=(), spheres=((0, 0, 0, r),)), ext, _K(f, h, w), (h, w))
    depth, obj = depth[0], obj[0]
    v, u = torch.meshgrid(torch.arange(h, dtype=f64), torch.arange(w, dtype=f64), indexing="ij")
    dn = torch.sqrt(((u - w / 2) / f) ** 2 + ((v - h / 2) / f) ** 2 + 1)
    cos = 1 / dn
    sin = torch.sqrt(1 - cos**2)
    hit = L * sin <= r
    clear = (L * sin - r).abs() > 1e-6
    assert torch.equal((obj == 0)[clear], hit[clear])
    t = L * cos - torch.sqrt((r**2 - (L * sin) ** 2).clamp_min(0))
    ref = t * cos
    m = hit & clear
    assert int(m.sum()) > 100
    assert (depth[m] - ref[m]).abs().max() / ref[m].abs().max() <= 1e-12
    assert bool((depth[~hit & clear] == 0).all())  # background: no depth


def test_box_top_face_depth():
    ext = look_at(
        torch.tensor([[0.0, 0.0, 5.0]], dtype=f64),
        torch.zeros(1, 3, dtype=f64),
        up=torch.tensor([0.0, 1.0, 0.0], dtype=f64),
    )
    _, depth, obj = render_scene(_scene(boxes=((-1, -1, 0, 1, 1, 1.5),)), ext, _K(20.0, 21, 21), (21, 21))
    # pixel rays through the top face (|x|,|y| <= 1 at z = 1.5: |u - 10.5| <= 20/3.5, u = 5..16) see depth 3.5
    assert (depth[obj == 1] - 3.5).abs().max() <= 1e-12
    assert int((obj == 1).sum()) == 12 * 12
    assert (depth[obj == 0] - 5.0).abs().max() <= 1e-12


def test_synthetic_is_deterministic_and_multiview_consistent():
    ds = SyntheticMultiViewDataset(3, num_frames=3, image_size=(42, 56), seed=7)
    a, b = ds[1], SyntheticMultiViewDataset(3, num_frames=3, image_size=(42, 56), seed=7)[1]
    for k in a:
        assert torch.equal(a[k], b[k]), k
    c = SyntheticMultiViewDataset(3, num_frames=3, image_size=(42, 56), seed=8)[1]
    assert not torch.equal(a["images"], c["images"])
    assert (
        a["images"].shape == (3, 3, 42, 56)
        and 0 <= float(a["images"].min())
        and float(a["images"].max()) <= 1
    )
    assert float(a["valid"].float().mean()) > 0.5
    # frame 0's points, seen from frame 1, have frame 1's depth where not occluded (checks all conventions)
    ext, K, depth = a["extrinsics"].double(), a["intrinsics"].double(), a["depth"].double()
    pts = depth_to_world_points(depth[0], ext[0], K[0])[a["valid"][0]]
    cam = pts @ ext[1, :, :3].T + ext[1, :, 3]
    uv = (cam / cam[:, 2:]) @ K[1].T
    ui, vi = uv[:, 0].round().long(), uv[:, 1].round().long()
    inside = (ui >= 0) & (ui < 56) & (vi >= 0) & (vi < 42) & (cam[:, 2] > 0)
    d1 = depth[1][vi[inside], ui[inside]]
    rel = (d1 - cam[inside, 2]).abs() / cam[inside, 2]
    assert int(inside.sum()) > 500
    assert float((rel < 0.05).double().mean()) > 0.85
    with pytest.raises(IndexError):
        ds[3]


def _write_capture(tmp_path, n=4, h=42, w=56):
    seq = SyntheticMultiViewDataset(1, num_frames=n, image_size=(h, w), seed=3)[0]
    (tmp_path / "images").mkdir()
    (tmp_path / "depths").mkdir()
    names = []
    for i in range(n):
        name = f"frame_{i:03d}.png"
        arr = (seq["images"][i].permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)
        Image.fromarray(arr).save(tmp_path / "images" / name)
        np.save(tmp_path / "depths" / f"frame_{i:03d}.npy", seq["depth"][i].numpy())
        names.append(name)
    return seq, names


@pytest.mark.parametrize("intrinsics_style", ["fl", "angle"])
def test_nerf_transforms_loader(tmp_path, intrinsics_style):
    seq, names = _write_capture(tmp_path)
    h, w = 42, 56
    flip = np.diag([1.0, -1.0, -1.0, 1.0])
    frames = []
    for i, name in enumerate(names):
        e4 = np.vstack([seq["extrinsics"][i].double().numpy(), [0, 0, 0, 1]])
        c2w_gl = np.linalg.inv(e4) @ flip  # OpenCV camera-from-world -> OpenGL camera-to-world
        frames.append(
            {
                "file_path": f"images/{name[:-4]}",
                "transform_matrix": c2w_gl.tolist(),
                "depth_file_path": f"depths/{name[:-4]}.npy",
            }
        )
    f = float(seq["intrinsics"][0, 0, 0])
    meta = {"frames": frames}
    if intrinsics_style == "fl":
        meta.update({"fl_x": f, "fl_y": f, "cx": w / 2, "cy": h / 2, "w": w, "h": h})
        frames[1].update(
            {"fl_x": float(seq["intrinsics"][1, 0, 0]), "fl_y": float(seq["intrinsics"][1, 1, 1])}
        )
    else:
        meta["camera_angle_x"] = 2 * math.atan(0.5 * w / f)
    (tmp_path / "transforms.json").write_text(json.dumps(meta))
    recs = load_nerf_transforms(tmp_path)
    assert len(recs) == 4
    for i, r in enumerate(recs):
        assert np.abs(r.extrinsics - seq["extrinsics"][i].double().numpy()).max() <= 1e-6
        fx_ref = float(seq["intrinsics"][i if intrinsics_style == "fl" and i == 1 else 0, 0, 0])
        assert r.intrinsics[0, 0] == pytest.approx(fx_ref, rel=1e-6) and r.intrinsics[0, 2] == w / 2
        assert r.size_hw == (h, w)
    ds = MultiViewSequenceDataset([recs], num_frames=3, image_size=(h, w), samples_per_sequence=2, seed=0)
    item = ds[0]
    assert item["images"].shape == (3, 3, h, w)
    for s in range(3):  # each sampled frame equals one of the captured frames (depth, pose, image)
        j = int(
            np.argmin([float((item["extrinsics"][s] - seq["extrinsics"][i]).abs().max()) for i in range(4)])
        )
        assert float((item["extrinsics"][s] - seq["extrinsics"][j]).abs().max()) <= 1e-5
        assert torch.equal(item["depth"][s], seq["depth"][j])
        assert float((item["images"][s] - seq["images"][j]).abs().max()) <= 1 / 255 + 1e-6
    assert torch.equal(ds[1]["images"], MultiViewSequenceDataset([recs], 3, (h, w), 2, seed=0)[1]["images"])


def test_nerf_loader_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="transforms.json"):
        load_nerf_transforms(tmp_path)
    (tmp_path / "transforms.json").write_text(
        json.dumps({"frames": [{"file_path": "x.png", "transform_matrix": np.eye(4).tolist()}]})
    )
    with pytest.raises(FileNotFoundError, match="x.png"):
        load_nerf_transforms(tmp_path)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "x.png")
    with pytest.raises(ValueError, match="camera_angle_x"):
        load_nerf_transforms(tmp_path)


def test_malformed_index_files_are_one_error_naming_the_file(tmp_path):
    # every way a transforms.json, cameras.txt, images.txt or depth map can be malformed is one ValueError
    # that names the file, not a KeyError / TypeError / IndexError / RecursionError from inside the parser
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "x.png")
    eye = np.eye(4).tolist()
    bad_json = {
        "frames as a dict": json.dumps({"frames": {"a": 1}}),
        "a list at the top": json.dumps([1, 2]),
        "no file_path": json.dumps({"frames": [{"transform_matrix": eye, "camera_angle_x": 1.0}]}),
        "a numeric file_path": json.dumps({"frames": [{"file_path": 3, "transform_matrix": eye}]}),
        "a frame that is a number": json.dumps({"frames": [7]}),
        "a string angle": json.dumps({"frames": [{"file_path": "x.png", "transform_matrix": eye,
                                                  "camera_angle_x": "wide"}]}),
        "deep nesting": '{"frames": ' + "[" * 100_000 + "]" * 100_000 + "}",
        "not JSON": "{frames",
    }
    for case, text in bad_json.items():
        (tmp_path / "transforms.json").write_text(text)
        with pytest.raises(ValueError, match=r"^load_nerf_transforms: .*transforms\.json"):
            load_nerf_transforms(tmp_path)
            pytest.fail(f"{case}: read")
    (tmp_path / "images").mkdir()
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "images" / "a.png")
    good_camera, good_image = "1 PINHOLE 4 4 1 1 2 2\n", "1 1 0 0 0 0 0 0 1 a.png\n\n"
    for cameras, images in (("1 PINHOLE 4\n", good_image), ("1 PINHOLE 4 4 1 1\n", good_image),
                            ("one PINHOLE 4 4 1 1 2 2\n", good_image),
                            (good_camera, "1 1 0 0 0 zero 0 0 1 a.png\n\n"),
                            (good_camera, "1 1 0 0 0 0 0 0 one a.png\n\n")):
        (tmp_path / "cameras.txt").write_text(cameras)
        (tmp_path / "images.txt").write_text(images)
        with pytest.raises(ValueError, match=r"^load_colmap_text: .*(cameras|images)\.txt"):
            load_colmap_text(tmp_path)
    (tmp_path / "cameras.txt").write_text(good_camera)
    (tmp_path / "images.txt").write_text(good_image)
    assert len(load_colmap_text(tmp_path)) == 1
    for name, blob in (("neg.geometric.bin", b"-1&-1&4&" + b"\0" * 16), ("nan.geometric.bin", b"w&h&1&\0\0")):
        (tmp_path / name).write_bytes(blob)
        with pytest.raises(ValueError, match=rf"^read_colmap_depth: .*{name.split('.')[0]}\.geometric"):
            read_colmap_depth(tmp_path / name)


def test_dataset_indexes_name_only_files_inside_the_dataset(tmp_path):
    """A transforms.json or images.txt names the frames of its dataset: a name that leads elsewhere (an
    absolute path, ../ out of the folder) is refused before anything is opened."""
    root = tmp_path / "scene"
    (root / "images").mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "outside.png")
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(root / "images" / "a.png")
    eye = np.eye(4).tolist()
    for name in (str(tmp_path / "outside.png"), "../outside.png", "images/../../outside.png"):
        frames = [{"file_path": name, "transform_matrix": eye, "camera_angle_x": 1.0}]
        (root / "transforms.json").write_text(json.dumps({"frames": frames}))
        with pytest.raises(ValueError, match=r"transforms\.json names .*outside\.png', outside the dataset"):
            load_nerf_transforms(root)
    frames = [{"file_path": "./images/../images/a.png", "transform_matrix": eye, "camera_angle_x": 1.0,
               "depth_file_path": "/etc/passwd"}]
    (root / "transforms.json").write_text(json.dumps({"frames": frames}))
    with pytest.raises(ValueError, match=r"names '/etc/passwd', outside the dataset"):
        load_nerf_transforms(root)
    del frames[0]["depth_file_path"]
    (root / "transforms.json").write_text(json.dumps({"frames": frames}))
    assert load_nerf_transforms(root)[0].size_hw == (4, 4)  # inside the folder: read
    (root / "cameras.txt").write_text("1 PINHOLE 4 4 1 1 2 2\n")
    (root / "images.txt").write_text("1 1 0 0 0 0 0 0 1 ../../outside.png\n\n")
    with pytest.raises(ValueError, match=r"images\.txt names 'images/\.\./\.\./outside\.png', outside"):
        load_colmap_text(root)


def test_colmap_text_loader_and_depth_bin(tmp_path):
    seq, names = _write_capture(tmp_path)
    h, w = 42, 56
    sparse = tmp_path / "sparse" / "0"
    sparse.mkdir(parents=True)
    K0 = seq["intrinsics"][0].double()
    f1 = float(seq["intrinsics"][1, 0, 0])
    (sparse / "cameras.txt").write_text(
        "# Camera list\n"
        f"1 PINHOLE {w} {h} {float(K0[0, 0])} {float(K0[1, 1])} {w / 2} {h / 2}\n"
        f"2 SIMPLE_RADIAL {w} {h} {f1} {w / 2} {h / 2} 0.0\n"
    )
    lines = ["# Image list", "#   IMAGE_ID, QW, QX, QY, QZ, TX, TY, TZ, CAMERA_ID, NAME"]
    for i, name in reversed(list(enumerate(names))):  # out of order on purpose: the loader sorts by name
        q = mat_to_quat(seq["extrinsics"][i, :, :3].double())
        t = seq["extrinsics"][i, :, 3].double()
        cam = 2 if i == 1 else 1
        lines.append(
            f"{i + 1} {float(q[3])} {float(q[0])} {float(q[1])} {float(q[2])} "
            f"{float(t[0])} {float(t[1])} {float(t[2])} {cam} {name}"
        )
        lines.append(
            "10.5 20.5 -1 11.0 12.0 3 1.0 2.0 -1 4.0 5.0 7" if i % 2 else ""
        )  # 2D points (12 tokens / empty)
    (sparse / "images.txt").write_text("\n".join(lines) + "\n")
    recs = load_colmap_text(tmp_path, depth_dir="depths")
    assert [r.image.name for r in recs] == names
    for i, r in enumerate(recs):
        assert np.abs(r.extrinsics - seq["extrinsics"][i].double().numpy()).max() <= 1e-6
        assert r.intrinsics[0, 0] == pytest.approx(f1 if i == 1 else float(K0[0, 0]), rel=1e-6)
        assert r.depth is not None and r.depth.suffix == ".npy"
    item = MultiViewSequenceDataset([recs], num_frames=4, image_size=(h, w))[0]
    assert bool(item["valid"].any())
    # COLMAP's dense depth format: "w&h&c&" then float32 column-major
    d = seq["depth"][0].numpy().astype(np.float32)
    blob = f"{w}&{h}&1&".encode() + d.T[..., None].flatten(order="F").tobytes()
    (tmp_path / "d.geometric.bin").write_bytes(blob)
    assert np.array_equal(read_colmap_depth(tmp_path / "d.geometric.bin"), d)
    (sparse / "cameras.txt").write_text(f"1 THIN_PRISM_FISHEYE {w} {h} 1 2 3 4\n")
    with pytest.raises(ValueError, match="THIN_PRISM_FISHEYE"):
        load_colmap_text(tmp_path)


def test_resize_keeps_intrinsics_consistent():
    h, w = 90, 120
    u0, v0 = 70.3, 40.7
    v, u = torch.meshgrid(torch.arange(h, dtype=f64), torch.arange(w, dtype=f64), indexing="ij")
    blob = torch.exp(-((u - u0) ** 2 + (v - v0) ** 2) / (2 * 6.0**2)).float()
    img = blob.expand(3, h, w).clone()
    K = torch.tensor([[100.0, 0, u0], [0, 90.0, v0], [0, 0, 1]])  # principal point marks the blob centre
    for size in ((42, 42), (28, 56), (45, 60)):
        small, K2, _ = resize_frame(img, K, size)
        assert small.shape == (3, *size)
        vv, uu = torch.meshgrid(
            torch.arange(size[0], dtype=f64), torch.arange(size[1], dtype=f64), indexing="ij"
        )
        m = small[0].double()
        cu, cv = float((m * uu).sum() / m.sum()), float((m * vv).sum() / m.sum())
        assert abs(cu - float(K2[0, 2])) <= 0.05 and abs(cv - float(K2[1, 2])) <= 0.05, (size, cu, cv, K2)
        # focal lengths scale with the resize factor of the cropped region
        crop_w = w if size[0] * w <= size[1] * h else round(h * size[1] / size[0])
        assert float(K2[0, 0]) == pytest.approx(100.0 * size[1] / crop_w, rel=1e-6)


def test_datamodule_synthetic_and_nerf(tmp_path):
    dm = MultiViewDataModule(
        train_size=4, val_size=2, test_size=2, batch_size=2, num_frames=3, image_size=(28, 42)
    )
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch["images"].shape == (2, 3, 3, 28, 42) and batch["extrinsics"].shape == (2, 3, 3, 4)
    val = next(iter(dm.val_dataloader()))
    assert not torch.equal(val["images"], dm.datasets["train"][0]["images"][None].expand_as(val["images"]))
    # the training order is a function of (seed, epoch) alone: a resumed run replays the epoch
    sampler = dm.train_dataloader().sampler
    sampler.set_epoch(5)
    again = MultiViewDataModule(train_size=4, val_size=2, test_size=2, batch_size=2, num_frames=3,
                                image_size=(28, 42))
    again.setup("fit")
    replay = again.train_dataloader().sampler
    replay.set_epoch(5)
    # fresh scenes every epoch (the default): epoch 5 draws the indices 5 * 4 + 0..3
    assert list(sampler) == list(replay) and sorted(sampler) == [20, 21, 22, 23]
    seq, names = _write_capture(tmp_path)
    frames = [{"file_path": f"images/{n}", "transform_matrix": np.eye(4).tolist()} for n in names]
    (tmp_path / "transforms.json").write_text(json.dumps({"frames": frames, "camera_angle_x": 1.0}))
    dm = MultiViewDataModule(
        source="nerf",
        root=str(tmp_path),
        num_frames=2,
        image_size=(28, 28),
        batch_size=1,
        train_size=2,
        val_size=1,
        test_size=1,
    )
    dm.setup("fit")
    b = next(iter(dm.train_dataloader()))
    assert b["images"].shape == (1, 2, 3, 28, 28) and not bool(b["valid"].any())
    with pytest.raises(ValueError, match="source"):
        MultiViewDataModule(source="scannet")
    with pytest.raises(ValueError, match="root"):
        MultiViewDataModule(source="colmap")


def test_synthetic_training_scenes_are_new_every_epoch_and_replay():
    """The synthetic training split draws new scenes every epoch (a model memorised the same 256: validation
    loss rose after epoch 3), a function of (seed, epoch) only, so that a resumed run replays them; validation
    and test scenes stay the same; fresh_train_scenes=False keeps the old fixed set."""
    dm = MultiViewDataModule(train_size=3, val_size=2, test_size=2, batch_size=3, num_frames=2,
                             image_size=(28, 28))
    dm.setup("fit")
    loader = dm.train_dataloader()
    seen = []
    for epoch in (0, 1, 1):
        loader.sampler.set_epoch(epoch)
        seen.append(next(iter(loader))["images"])
    assert not torch.equal(seen[0], seen[1]) and torch.equal(seen[1], seen[2])  # new, then replayed
    ds = dm.datasets["train"]
    assert ds.fresh and len(ds) == 3 and sorted(loader.sampler) == [3, 4, 5]
    # epoch 1's scenes are none of epoch 0's, nor of the validation seed's
    first = {float(ds[i]["images"].sum()) for i in range(3)}
    assert not first & {float(ds[3 + i]["images"].sum()) for i in range(3)}
    val = dm.datasets["val"]
    assert not val.fresh
    assert torch.equal(val[0]["images"], SyntheticMultiViewDataset(2, 2, (28, 28), seed=1)[0]["images"])
    fixed = MultiViewDataModule(train_size=3, val_size=2, test_size=2, batch_size=3, num_frames=2,
                                image_size=(28, 28), fresh_train_scenes=False)
    fixed.setup("fit")
    sampler = fixed.train_dataloader().sampler
    sampler.set_epoch(4)
    assert sorted(sampler) == [0, 1, 2]
    with pytest.raises(IndexError):
        fixed.datasets["train"][3]


def test_forged_depth_and_frame_bombs_are_refused(tmp_path):
    """A depth .npy whose header declares 931 GiB and a frame PNG declaring 10^10 pixels: errors naming the
    file before anything is allocated or decoded."""
    from elsa_vision.data.multiview import _load_depth
    from elsa_vision.data.readers import read_rgb
    from elsa_vision.files import FileTooLargeError
    from tests.helpers import bomb_png, forged_npy

    _, names = _write_capture(tmp_path)
    depth = forged_npy(tmp_path / "depths" / "frame_000.npy")
    from elsa_vision.data.multiview import FrameRecord

    record = FrameRecord(tmp_path / "images" / names[0], np.eye(4)[:3], np.eye(3), (42, 56), depth)
    with pytest.raises(FileTooLargeError, match=r"frame_000\.npy'.*931\.3 GiB"):
        _load_depth(record)
    with pytest.raises(FileTooLargeError, match=r"bomb\.png' declares 10,000,000,000 pixels"):
        read_rgb(bomb_png(tmp_path / "bomb.png"))
