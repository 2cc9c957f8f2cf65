"""Geometry: quaternion/rotation and pose-encoding round trips (incl. near-180° rotations), unprojection vs
projection, relative pose errors, AUC, depth metrics with median alignment, PLY round trips."""

import math
import os

import numpy as np
import pytest
import torch

from elsa_vision.data.geometry import (
    camera_metrics,
    closed_form_inverse_se3,
    depth_metrics,
    depth_to_world_points,
    extri_intri_to_pose_encoding,
    mat_to_quat,
    pose_auc,
    pose_encoding_to_extri_intri,
    quat_to_mat,
    read_ply,
    relative_pose_errors,
    rotation_angle_deg,
    translation_angle_deg,
    write_ply,
)


def _axis_angle(axis: torch.Tensor, angle: torch.Tensor) -> torch.Tensor:
    """Float64 Rodrigues formula: rotation matrices [..., 3, 3]."""
    a = axis / axis.norm(dim=-1, keepdim=True)
    K = torch.zeros(*a.shape[:-1], 3, 3, dtype=torch.float64)
    K[..., 0, 1], K[..., 0, 2], K[..., 1, 2] = -a[..., 2], a[..., 1], -a[..., 0]
    K = K - K.transpose(-1, -2)
    s, c = angle.sin()[..., None, None], angle.cos()[..., None, None]
    return torch.eye(3, dtype=torch.float64) + s * K + (1 - c) * (K @ K)


def _canon(q):
    return torch.where(q[..., 3:] < 0, -q, q)


def test_quaternion_round_trip_random_and_near_180():
    g = torch.Generator().manual_seed(0)
    axis = torch.randn(400, 3, generator=g, dtype=torch.float64)
    angle = torch.cat(
        [
            torch.rand(300, generator=g, dtype=torch.float64) * math.pi,
            math.pi - torch.logspace(-12, -1, 50, dtype=torch.float64),  # approaching 180°
            torch.full((25,), math.pi, dtype=torch.float64),
            torch.logspace(-12, -1, 25, dtype=torch.float64),  # approaching identity
        ]
    )
    R = _axis_angle(axis, angle)
    q = mat_to_quat(R)
    assert torch.allclose(q.norm(dim=-1), torch.ones(400, dtype=torch.float64), atol=1e-14)
    assert bool((q[..., 3] >= 0).all())
    R2 = quat_to_mat(q)
    assert (R2 - R).norm() / R.norm() <= 1e-13
    # analytic quaternion (axis·sin(θ/2), cos(θ/2)) up to sign
    a = axis / axis.norm(dim=-1, keepdim=True)
    q_ref = torch.cat([a * (angle / 2).sin()[:, None], (angle / 2).cos()[:, None]], -1)
    sign = torch.where((q * q_ref).sum(-1, keepdim=True) < 0, -1.0, 1.0)
    assert (q - sign * q_ref).abs().max() <= 1e-12
    # quaternion -> matrix -> quaternion on random unit quaternions (float32 too)
    qr = torch.nn.functional.normalize(torch.randn(500, 4, generator=g, dtype=torch.float64), dim=-1)
    assert (mat_to_quat(quat_to_mat(qr)) - _canon(qr)).abs().max() <= 1e-12
    q32 = mat_to_quat(quat_to_mat(qr.float()))
    assert (q32.double() - _canon(qr)).norm() / qr.norm() <= 1e-6


def test_rotation_matrices_are_orthonormal():
    q = torch.randn(100, 4, dtype=torch.float64) * 3.0  # unnormalised input is normalised
    R = quat_to_mat(q)
    eye = torch.eye(3, dtype=torch.float64).expand(100, 3, 3)
    assert (R @ R.transpose(-1, -2) - eye).abs().max() <= 1e-14
    assert torch.allclose(torch.linalg.det(R), torch.ones(100, dtype=torch.float64), atol=1e-14)


def _random_cameras(n, h=48, w=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.nn.functional.normalize(torch.randn(n, 4, generator=g, dtype=torch.float64), dim=-1)
    t = torch.randn(n, 3, 1, generator=g, dtype=torch.float64)
    ext = torch.cat([quat_to_mat(q), t], -1)
    fov_h = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    fov_w = 0.5 + torch.rand(n, generator=g, dtype=torch.float64)
    K = torch.zeros(n, 3, 3, dtype=torch.float64)
    K[:, 0, 0] = (w / 2) / torch.tan(fov_w / 2)
    K[:, 1, 1] = (h / 2) / torch.tan(fov_h / 2)
    K[:, 0, 2], K[:, 1, 2], K[:, 2, 2] = w / 2, h / 2, 1
    return ext, K


def test_pose_encoding_round_trip():
    ext, K = _random_cameras(64)
    enc = extri_intri_to_pose_encoding(ext.reshape(8, 8, 3, 4), K.reshape(8, 8, 3, 3), (48, 64))
    assert enc.shape == (8, 8, 9)
    ext2, K2 = pose_encoding_to_extri_intri(enc, (48, 64))
    assert (ext2.reshape(64, 3, 4) - ext).norm() / ext.norm() <= 1e-12
    assert (K2.reshape(64, 3, 3) - K).norm() / K.norm() <= 1e-12
    enc2 = extri_intri_to_pose_encoding(ext2, K2, (48, 64))
    assert (enc2 - enc).abs().max() <= 1e-12
    with pytest.raises(ValueError, match="pose_enc"):
        pose_encoding_to_extri_intri(torch.zeros(2, 8), (4, 4))
    with pytest.raises(TypeError, match="extrinsics"):
        extri_intri_to_pose_encoding(np.zeros((3, 4)), K[0], (4, 4))


def test_unprojection_inverts_projection():
    ext, K = _random_cameras(3, h=20, w=30, seed=1)
    depth = 1.0 + torch.rand(3, 20, 30, dtype=torch.float64) * 4
    pts = depth_to_world_points(depth, ext, K)
    cam = (ext[:, None, None, :3, :3] @ pts[..., None]).squeeze(-1) + ext[:, None, None, :3, 3]
    assert (cam[..., 2] - depth).abs().max() <= 1e-12
    uv = (K[:, None, None] @ (cam / cam[..., 2:])[..., None]).squeeze(-1)[..., :2]
    v, u = torch.meshgrid(
        torch.arange(20.0, dtype=torch.float64), torch.arange(30.0, dtype=torch.float64), indexing="ij"
    )
    assert (uv[..., 0] - u).abs().max() <= 1e-10 and (uv[..., 1] - v).abs().max() <= 1e-10
    inv = closed_form_inverse_se3(ext)
    comp = inv[:, :3, :3] @ ext[:, :3, :3]
    assert (comp - torch.eye(3, dtype=torch.float64)).abs().max() <= 1e-14


def test_relative_pose_errors_and_auc():
    ext, _ = _random_cameras(5, seed=2)
    r, t = relative_pose_errors(ext, ext)
    assert r.shape == (10,) and r.abs().max() <= 1e-5 and t.abs().max() <= 1e-5
    # a global similarity (rotation, translation, scale) of the world changes no relative angle
    G = _axis_angle(
        torch.tensor([0.3, -1.0, 0.2], dtype=torch.float64), torch.tensor(1.1, dtype=torch.float64)
    )
    shift = torch.tensor([0.5, -2.0, 1.0], dtype=torch.float64)
    ext_sim = torch.cat(
        [ext[:, :, :3] @ G.T, 3.0 * (ext[:, :, 3] - (ext[:, :, :3] @ G.T) @ shift)[..., None]], -1
    )
    r, t = relative_pose_errors(ext_sim, ext)
    assert r.max() <= 1e-5 and t.max() <= 1e-4
    # rotating camera 4 about its own optical axis by 10°: pairs with camera 4 have a 10° rotation error
    Rz = _axis_angle(
        torch.tensor([0.0, 0.0, 1.0], dtype=torch.float64),
        torch.tensor(math.radians(10.0), dtype=torch.float64),
    )
    pert = ext.clone()
    pert[4] = Rz @ ext[4]
    r, _ = relative_pose_errors(pert, ext)
    pairs = [(i, j) for i in range(5) for j in range(i + 1, 5)]
    for k, (i, j) in enumerate(pairs):
        assert abs(float(r[k]) - (10.0 if 4 in (i, j) else 0.0)) <= 1e-6
    flip_x = torch.diag(torch.tensor([1.0, -1.0, -1.0], dtype=torch.float64))  # 180° about x
    assert float(rotation_angle_deg(torch.eye(3, dtype=torch.float64), flip_x)) == pytest.approx(
        180.0, abs=1e-9
    )
    assert float(
        translation_angle_deg(torch.tensor([1.0, 0, 0]), torch.tensor([-1.0, 0, 0]))
    ) == pytest.approx(0.0)
    assert float(
        translation_angle_deg(torch.tensor([1.0, 0, 0]), torch.tensor([0.0, 1, 0]))
    ) == pytest.approx(90.0)
    with pytest.raises(ValueError, match=">= 2 frames"):
        relative_pose_errors(ext[:1], ext[:1])


def test_zero_translation_is_no_correct_direction():
    """A zero translation has no direction: the largest error (VGGT's 90° sign-ambiguous), never 0°. Cameras
    predicted at one point (identity extrinsics, no motion) used to score a perfect translation and an AUC@30
    of a third on the synthetic scenes."""
    zero, x = torch.zeros(3, dtype=torch.float64), torch.tensor([1.0, 0, 0], dtype=torch.float64)
    assert float(translation_angle_deg(zero, x)) == 90.0 and float(translation_angle_deg(x, zero)) == 90.0
    assert float(translation_angle_deg(zero, x, sign_ambiguous=False)) == 180.0
    ext, _ = _random_cameras(4, seed=4)
    still = torch.zeros_like(ext)
    still[:, :3, :3] = ext[:, :3, :3]  # exact rotations, every camera at the origin
    r, t = relative_pose_errors(still, ext)
    assert r.max() <= 1e-5 and torch.equal(t, torch.full_like(t, 90.0))
    assert camera_metrics(still[None], ext[None])["auc30"] == 0.0


def test_pose_auc_values():
    zeros = torch.zeros(10)
    assert pose_auc(zeros, zeros, 30) == pytest.approx(1.0)
    ten = torch.full((10,), 10.0)
    assert pose_auc(ten, zeros, 30) == pytest.approx(20 / 30)  # below thresholds 11..30
    assert pose_auc(zeros, ten, 5) == pytest.approx(0.0)
    mixed = torch.tensor([0.5, 2.5, 100.0, float("nan")])
    # thresholds 1..5: fractions 1/4, 1/4, 2/4, 2/4, 2/4
    assert pose_auc(mixed, torch.zeros(4), 5) == pytest.approx((0.25 + 0.25 + 0.5 + 0.5 + 0.5) / 5)
    ext, _ = _random_cameras(4, seed=3)
    m = camera_metrics(ext[None].float(), ext[None].float())
    assert m["auc30"] == pytest.approx(1.0) and m["auc5"] == pytest.approx(1.0)


def test_depth_metrics_median_alignment():
    gt = 1 + torch.rand(2, 3, 8, 9, dtype=torch.float64)
    pred = gt * torch.tensor([2.0, 0.25], dtype=torch.float64)[:, None, None, None]
    m = depth_metrics(pred, gt)
    assert m["abs_rel"] <= 1e-12 and m["delta1"] == 1.0
    gt_flat = torch.tensor([2.0, 5.0], dtype=torch.float64)[:, None, None, None].expand(2, 3, 8, 9)
    noise = torch.ones_like(gt_flat)
    noise[..., :3] = 1.5  # a third of the pixels 50% too far
    m = depth_metrics(gt_flat * noise * 3.0, gt_flat)
    # scale = median(gt)/median(pred) = 1/3 undoes the factor 3 -> abs_rel = (1/3)·0.5;
    # δ<1.25 fails on a third
    assert m["abs_rel"] == pytest.approx(3 * 0.5 / 9, abs=1e-12)
    assert m["delta1"] == pytest.approx(6 / 9)
    valid = torch.zeros_like(gt, dtype=torch.bool)
    with pytest.raises(ValueError, match="no valid depth"):
        depth_metrics(pred, gt, valid)
    with pytest.raises(ValueError, match="same shape"):
        depth_metrics(pred[:, :2], gt)


@pytest.mark.parametrize("binary", [True, False])
def test_ply_round_trip(tmp_path, binary):
    pts = np.random.default_rng(0).normal(size=(257, 3)).astype(np.float32)
    cols = np.random.default_rng(1).integers(0, 256, size=(257, 3)).astype(np.uint8)
    write_ply(tmp_path / "a.ply", pts, cols, binary=binary)
    p2, c2 = read_ply(tmp_path / "a.ply")
    assert np.array_equal(c2, cols)
    assert np.abs(p2 - pts).max() <= (0 if binary else 1e-6)
    write_ply(tmp_path / "b.ply", torch.from_numpy(pts), None, binary=binary)
    p3, c3 = read_ply(tmp_path / "b.ply")
    assert c3 is None and np.abs(p3 - pts).max() <= (0 if binary else 1e-6)
    head = (tmp_path / "a.ply").read_bytes()[:200].decode("ascii", "replace")
    assert "element vertex 257" in head and "property uchar red" in head
    with pytest.raises(ValueError, match="points"):
        write_ply(tmp_path / "c.ply", pts[:, :2])


def test_read_ply_refuses_what_it_cannot_read_naming_the_file(tmp_path):
    # not a regular file (a FIFO would block the read for ever), and headers or bodies that are not
    # write_ply's: one ValueError naming the file each, not a bare parse error
    fifo = tmp_path / "points.ply"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"points\.ply.*is a FIFO"):
        read_ply(fifo)
    cases = {
        "no_end.ply": b"ply\nformat binary_little_endian 1.0\nend_header",
        "no_vertex.ply": b"ply\nformat ascii 1.0\nproperty float x\nend_header\n1 2 3\n",
        "short.ply": b"ply\nformat binary_little_endian 1.0\nelement vertex 1000\nproperty float x\n"
                     b"property float y\nproperty float z\nend_header\n" + b"\0" * 24,
        "short_ascii.ply": b"ply\nformat ascii 1.0\nelement vertex 3\nproperty float x\nproperty float y\n"
                           b"property float z\nend_header\n1 2 3\n",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ValueError, match=rf"{name.replace('.', '[.]')}: "):
            read_ply(tmp_path / name)
