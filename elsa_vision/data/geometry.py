"""Multi-view geometry: VGGT pose encodings, quaternions, unprojection, pose/depth metrics and PLY export.

Conventions (those of VGGT, https://arxiv.org/abs/2503.11651):

* extrinsics are camera-from-world ``[R | t]`` (``x_cam = R x_world + t``), OpenCV axes (x right, y down,
  z forward), shape ``[..., 3, 4]``;
* intrinsics ``[..., 3, 3]`` with the principal point at the image centre ``(W/2, H/2)``; pixel ``(u, v)``
  is the integer column/row index;
* quaternions are scalar-last ``(x, y, z, w)`` and canonicalised to ``w >= 0``;
* the pose encoding ``[..., 9]`` is ``t (3) | quaternion (4) | FoV_h, FoV_w (2, radians)``.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "quat_to_mat",
    "mat_to_quat",
    "extri_intri_to_pose_encoding",
    "pose_encoding_to_extri_intri",
    "closed_form_inverse_se3",
    "depth_to_cam_points",
    "depth_to_world_points",
    "rotation_angle_deg",
    "translation_angle_deg",
    "relative_pose_errors",
    "pose_auc",
    "camera_metrics",
    "median_scale_align",
    "depth_metrics",
    "write_ply",
    "read_ply",
]


def _check_last(t: Tensor, name: str, shape: tuple[int, ...]) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"`{name}` must be a torch.Tensor, got {type(t).__name__}")
    if tuple(t.shape[t.dim() - len(shape) :]) != shape or t.dim() < len(shape):
        raise ValueError(f"`{name}` must have trailing shape {list(shape)}, got {list(t.shape)}")


def quat_to_mat(quat: Tensor) -> Tensor:
    """Unit quaternions ``[..., 4]`` (x, y, z, w; normalised here) -> rotation matrices ``[..., 3, 3]``."""
    _check_last(quat, "quat", (4,))
    q = quat / quat.norm(dim=-1, keepdim=True).clamp_min(torch.finfo(quat.dtype).tiny)
    x, y, z, w = q.unbind(-1)
    xx, yy, zz = x * x, y * y, z * z
    xy, xz, yz, wx, wy, wz = x * y, x * z, y * z, w * x, w * y, w * z
    rows = (
        1 - 2 * (yy + zz),
        2 * (xy - wz),
        2 * (xz + wy),
        2 * (xy + wz),
        1 - 2 * (xx + zz),
        2 * (yz - wx),
        2 * (xz - wy),
        2 * (yz + wx),
        1 - 2 * (xx + yy),
    )
    return torch.stack(rows, dim=-1).reshape(*q.shape[:-1], 3, 3)


def mat_to_quat(rot: Tensor) -> Tensor:
    """Rotation matrices ``[..., 3, 3]`` -> unit quaternions ``[..., 4]`` (x, y, z, w) with ``w >= 0``.

    Shepperd's method: each of the four candidate formulas divides by ``4·|component|``; the one with the
    largest component is used, so the result is accurate also near 180° rotations (where ``w -> 0``).
    """
    _check_last(rot, "rot", (3, 3))
    m = rot
    m00, m01, m02 = m[..., 0, 0], m[..., 0, 1], m[..., 0, 2]
    m10, m11, m12 = m[..., 1, 0], m[..., 1, 1], m[..., 1, 2]
    m20, m21, m22 = m[..., 2, 0], m[..., 2, 1], m[..., 2, 2]
    # 4·q_i² for i = w, x, y, z (clamped: rounding can make them slightly negative)
    four_sq = torch.stack(
        [1 + m00 + m11 + m22, 1 + m00 - m11 - m22, 1 - m00 + m11 - m22, 1 - m00 - m11 + m22], dim=-1
    ).clamp_min(0.0)
    big = torch.sqrt(four_sq)  # 2·|q_i|
    # candidate quaternions (w, x, y, z), each scaled by 2|q_i| * 2 = 4|q_i|
    cand = torch.stack(
        [
            torch.stack([big[..., 0] ** 2, m21 - m12, m02 - m20, m10 - m01], dim=-1),
            torch.stack([m21 - m12, big[..., 1] ** 2, m10 + m01, m02 + m20], dim=-1),
            torch.stack([m02 - m20, m10 + m01, big[..., 2] ** 2, m12 + m21], dim=-1),
            torch.stack([m10 - m01, m20 + m02, m21 + m12, big[..., 3] ** 2], dim=-1),
        ],
        dim=-2,
    )
    cand = cand / (2.0 * big[..., None]).clamp_min(0.1)
    idx = four_sq.argmax(dim=-1)
    wxyz = torch.gather(cand, -2, idx[..., None, None].expand(*idx.shape, 1, 4)).squeeze(-2)
    wxyz = wxyz / wxyz.norm(dim=-1, keepdim=True)
    wxyz = torch.where(wxyz[..., :1] < 0, -wxyz, wxyz)
    return torch.cat([wxyz[..., 1:], wxyz[..., :1]], dim=-1)


def extri_intri_to_pose_encoding(
    extrinsics: Tensor, intrinsics: Tensor, image_size_hw: tuple[int, int]
) -> Tensor:
    """Camera-from-world extrinsics ``[..., 3, 4]``, intrinsics ``[..., 3, 3]`` -> encoding ``[..., 9]``."""
    _check_last(extrinsics, "extrinsics", (3, 4))
    _check_last(intrinsics, "intrinsics", (3, 3))
    h, w = image_size_hw
    t = extrinsics[..., :3, 3]
    quat = mat_to_quat(extrinsics[..., :3, :3])
    fov_h = 2 * torch.atan((h / 2) / intrinsics[..., 1, 1])
    fov_w = 2 * torch.atan((w / 2) / intrinsics[..., 0, 0])
    return torch.cat([t, quat, fov_h[..., None], fov_w[..., None]], dim=-1)


def pose_encoding_to_extri_intri(pose_enc: Tensor, image_size_hw: tuple[int, int]) -> tuple[Tensor, Tensor]:
    """Pose encoding ``[..., 9]`` -> (extrinsics ``[..., 3, 4]``, intrinsics ``[..., 3, 3]``, centred)."""
    _check_last(pose_enc, "pose_enc", (9,))
    h, w = image_size_hw
    rot = quat_to_mat(pose_enc[..., 3:7])
    extrinsics = torch.cat([rot, pose_enc[..., :3, None]], dim=-1)
    fy = (h / 2) / torch.tan(pose_enc[..., 7] / 2)
    fx = (w / 2) / torch.tan(pose_enc[..., 8] / 2)
    intrinsics = torch.zeros(*pose_enc.shape[:-1], 3, 3, dtype=pose_enc.dtype, device=pose_enc.device)
    intrinsics[..., 0, 0] = fx
    intrinsics[..., 1, 1] = fy
    intrinsics[..., 0, 2] = w / 2
    intrinsics[..., 1, 2] = h / 2
    intrinsics[..., 2, 2] = 1.0
    return extrinsics, intrinsics


def closed_form_inverse_se3(se3: Tensor) -> Tensor:
    """Inverse of rigid transforms ``[..., 3, 4]`` or ``[..., 4, 4]`` (returned in the same shape)."""
    if se3.shape[-2:] not in ((3, 4), (4, 4)):
        raise ValueError(f"`se3` must have trailing shape [3, 4] or [4, 4], got {list(se3.shape)}")
    rot_t = se3[..., :3, :3].transpose(-1, -2)
    t = -(rot_t @ se3[..., :3, 3:4])
    out = torch.cat([rot_t, t], dim=-1)
    if se3.shape[-2] == 4:
        out = torch.cat([out, se3[..., 3:4, :]], dim=-2)
    return out


def depth_to_cam_points(depth: Tensor, intrinsics: Tensor) -> Tensor:
    """Depth ``[..., H, W]`` (z along the optical axis) -> camera-frame points ``[..., H, W, 3]``."""
    _check_last(intrinsics, "intrinsics", (3, 3))
    h, w = depth.shape[-2:]
    v, u = torch.meshgrid(
        torch.arange(h, dtype=depth.dtype, device=depth.device),
        torch.arange(w, dtype=depth.dtype, device=depth.device),
        indexing="ij",
    )
    k = intrinsics[..., None, None, :, :]
    x = (u - k[..., 0, 2]) / k[..., 0, 0] * depth
    y = (v - k[..., 1, 2]) / k[..., 1, 1] * depth
    return torch.stack([x, y, depth], dim=-1)


def depth_to_world_points(depth: Tensor, extrinsics: Tensor, intrinsics: Tensor) -> Tensor:
    """Depth ``[..., H, W]`` -> world points ``[..., H, W, 3]`` with camera-from-world ``extrinsics``."""
    _check_last(extrinsics, "extrinsics", (3, 4))
    cam = depth_to_cam_points(depth, intrinsics)
    world_from_cam = closed_form_inverse_se3(extrinsics)[..., None, None, :, :]
    return (world_from_cam[..., :3, :3] @ cam[..., None]).squeeze(-1) + world_from_cam[..., :3, 3]


def rotation_angle_deg(rot_a: Tensor, rot_b: Tensor) -> Tensor:
    """Geodesic angle (degrees) between rotations ``[..., 3, 3]`` via the quaternion of ``A^T B``."""
    rel = rot_a.transpose(-1, -2) @ rot_b
    q = mat_to_quat(rel)
    return torch.rad2deg(2 * torch.atan2(q[..., :3].norm(dim=-1), q[..., 3].abs()))


def translation_angle_deg(t_a: Tensor, t_b: Tensor, sign_ambiguous: bool = True) -> Tensor:
    """Angle (degrees) between translation directions ``[..., 3]``; with ``sign_ambiguous`` min(θ, 180−θ).

    A zero translation has no direction: its error is the largest there is (90° sign-ambiguous, else 180°),
    as in VGGT's evaluation (``t / (|t| + eps)`` then ``acos``), never 0° -- a prediction of no motion is not
    a correct direction.
    """
    na, nb = t_a.norm(dim=-1, keepdim=True), t_b.norm(dim=-1, keepdim=True)
    a, b = t_a / na.clamp_min(1e-12), t_b / nb.clamp_min(1e-12)
    ang = torch.rad2deg(torch.atan2(torch.linalg.cross(a, b).norm(dim=-1), (a * b).sum(-1)))
    ang = torch.minimum(ang, 180.0 - ang) if sign_ambiguous else ang
    undefined = (na[..., 0] <= 1e-12) | (nb[..., 0] <= 1e-12)
    return torch.where(undefined, torch.full_like(ang, 90.0 if sign_ambiguous else 180.0), ang)


def relative_pose_errors(pred_extrinsics: Tensor, gt_extrinsics: Tensor) -> tuple[Tensor, Tensor]:
    """Relative rotation/translation angle errors (degrees) over all frame pairs ``i < j``.

    Args:
        pred_extrinsics, gt_extrinsics: camera-from-world ``[S, 3, 4]`` of one sequence.
    Returns:
        ``(rot_err, trans_err)``, each ``[S·(S−1)/2]``.
    """
    _check_last(pred_extrinsics, "pred_extrinsics", (3, 4))
    if pred_extrinsics.shape != gt_extrinsics.shape or pred_extrinsics.dim() != 3:
        raise ValueError(
            f"`pred_extrinsics` and `gt_extrinsics` must both be [S, 3, 4], got "
            f"{list(pred_extrinsics.shape)} "
            f"and {list(gt_extrinsics.shape)}"
        )
    s = pred_extrinsics.shape[0]
    if s < 2:
        raise ValueError(f"relative_pose_errors needs >= 2 frames, got S={s}")
    i, j = (torch.tensor(x, device=pred_extrinsics.device) for x in zip(*itertools.combinations(range(s), 2)))

    def rel(e: Tensor) -> Tensor:  # pose of frame j relative to frame i: cam_j <- cam_i
        e4 = torch.cat([e, torch.tensor([0, 0, 0, 1.0], dtype=e.dtype, device=e.device).expand(s, 1, 4)], 1)
        return e4[j] @ closed_form_inverse_se3(e4[i])

    rp, rg = rel(pred_extrinsics), rel(gt_extrinsics)
    return rotation_angle_deg(rp[:, :3, :3], rg[:, :3, :3]), translation_angle_deg(rp[:, :3, 3], rg[:, :3, 3])


def pose_auc(rot_err: Tensor, trans_err: Tensor, max_threshold: int) -> float:
    """AUC of ``max(rot_err, trans_err)`` up to ``max_threshold`` degrees, 1° bins (the VGGT protocol).

    Mean over thresholds ``t = 1 .. max_threshold`` of the fraction of pairs with error < ``t``.
    """
    if max_threshold < 1:
        raise ValueError(f"`max_threshold` must be >= 1, got {max_threshold}")
    err = torch.maximum(rot_err, trans_err).double().reshape(-1)
    if err.numel() == 0:
        raise ValueError("pose_auc: no errors given")
    err = torch.nan_to_num(err, nan=float("inf"))
    thresholds = torch.arange(1, max_threshold + 1, dtype=torch.float64, device=err.device)
    return float((err[None, :] < thresholds[:, None]).double().mean(dim=1).mean())


def camera_metrics(pred_extrinsics: Tensor, gt_extrinsics: Tensor) -> dict[str, float]:
    """AUC@30/15/5 and mean errors for a batch of sequences ``[B, S, 3, 4]`` (pairs pooled over the batch)."""
    rs, ts = [], []
    for b in range(pred_extrinsics.shape[0]):
        r, t = relative_pose_errors(pred_extrinsics[b], gt_extrinsics[b])
        rs.append(r)
        ts.append(t)
    r, t = torch.cat(rs), torch.cat(ts)
    return {
        "auc30": pose_auc(r, t, 30),
        "auc15": pose_auc(r, t, 15),
        "auc5": pose_auc(r, t, 5),
        "rot_err": float(r.mean()),
        "trans_err": float(t.mean()),
    }


def median_scale_align(pred: Tensor, gt: Tensor, valid: Tensor) -> Tensor:
    """Scale ``pred`` so its median over ``valid`` equals ``gt``'s (one scale per leading index).

    ``pred``, ``gt``, ``valid``: ``[B, ...]``; returns the aligned ``pred``.
    """
    b = pred.shape[0]
    scales = []
    for i in range(b):
        m = valid[i]
        if not bool(m.any()):
            raise ValueError(f"median_scale_align: sequence {i} has no valid depth")
        scales.append(gt[i][m].median() / pred[i][m].median().clamp_min(1e-12))
    scale = torch.stack(scales).reshape(b, *([1] * (pred.dim() - 1)))
    return pred * scale


def depth_metrics(pred: Tensor, gt: Tensor, valid: Tensor | None = None) -> dict[str, float]:
    """AbsRel and δ<1.25 after per-sequence median scale alignment.

    Args:
        pred, gt: depth ``[B, S, H, W]`` (one scale per sequence ``b``).
        valid: bool mask ``[B, S, H, W]``; default ``gt > 0`` and finite.
    """
    if pred.shape != gt.shape:
        raise ValueError(
            f"`pred` and `gt` must have the same shape, got {list(pred.shape)} and {list(gt.shape)}"
        )
    if valid is None:
        valid = (gt > 0) & torch.isfinite(gt)
    valid = valid & torch.isfinite(pred) & (pred > 0)
    aligned = median_scale_align(pred.double(), gt.double(), valid)
    p, g = aligned[valid], gt.double()[valid]
    absrel = ((p - g).abs() / g).mean()
    delta = (torch.maximum(p / g, g / p) < 1.25).double().mean()
    return {"abs_rel": float(absrel), "delta1": float(delta)}


def write_ply(path: str | Path, points, colors=None, binary: bool = True) -> Path:
    """Write a point cloud as PLY (binary little-endian by default, or ASCII).

    Args:
        points: ``[N, 3]`` float array/tensor.
        colors: optional ``[N, 3]`` uint8 (or floats in [0, 1], converted).
    """
    pts = points.detach().cpu().numpy() if isinstance(points, Tensor) else np.asarray(points)
    if pts.ndim != 2 or pts.shape[1] != 3:
        raise ValueError(f"`points` must be [N, 3], got {list(pts.shape)}")
    pts = pts.astype(np.float32)
    col = None
    if colors is not None:
        col = colors.detach().cpu().numpy() if isinstance(colors, Tensor) else np.asarray(colors)
        if col.shape != pts.shape:
            raise ValueError(f"`colors` must be [N, 3] like points {list(pts.shape)}, got {list(col.shape)}")
        if col.dtype != np.uint8:
            col = np.clip(np.rint(col.astype(np.float64) * 255.0), 0, 255).astype(np.uint8)
    path = Path(path)
    header = [
        "ply",
        f"format {'binary_little_endian' if binary else 'ascii'} 1.0",
        f"element vertex {len(pts)}",
        "property float x",
        "property float y",
        "property float z",
    ]
    if col is not None:
        header += ["property uchar red", "property uchar green", "property uchar blue"]
    header.append("end_header")
    fields = [("x", "<f4"), ("y", "<f4"), ("z", "<f4")] + (
        [("red", "u1"), ("green", "u1"), ("blue", "u1")] if col is not None else []
    )
    rec = np.empty(len(pts), dtype=fields)
    rec["x"], rec["y"], rec["z"] = pts[:, 0], pts[:, 1], pts[:, 2]
    if col is not None:
        rec["red"], rec["green"], rec["blue"] = col[:, 0], col[:, 1], col[:, 2]
    with open(path, "wb") as f:
        f.write(("\n".join(header) + "\n").encode("ascii"))
        if binary:
            f.write(rec.tobytes())
        else:
            for r in rec:
                vals = [repr(float(r[n])) if n in "xyz" else str(int(r[n])) for n, _ in fields]
                f.write((" ".join(vals) + "\n").encode("ascii"))
    return path


def read_ply(path: str | Path) -> tuple[np.ndarray, np.ndarray | None]:
    """Read a PLY written by :func:`write_ply` (float xyz, optional uchar rgb) -> ``(points, colors)``.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: not a regular file (a FIFO would block the read, a device never end), or not such a PLY
            (a header without ``end_header`` or ``element vertex``, fewer vertices than it declares); the
            message names the file.
    """
    from ..files import check_regular_file

    data = Path(check_regular_file(path, "PLY file")).read_bytes()
    try:
        return _parse_ply(data, path)
    except (ValueError, IndexError, StopIteration, UnicodeDecodeError) as e:
        if str(e).startswith(f"{path}:"):
            raise
        why = str(e) or type(e).__name__
        raise ValueError(f"{path}: not a PLY file of float xyz (and uchar rgb) vertices: {why}") from None


def _parse_ply(data: bytes, path) -> tuple[np.ndarray, np.ndarray | None]:
    end = data.index(b"end_header\n") + len(b"end_header\n")
    header = data[:end].decode("ascii").splitlines()
    if header[0] != "ply":
        raise ValueError(f"{path}: not a PLY file")
    fmt = header[1].split()[1]
    n = int(next(h for h in header if h.startswith("element vertex")).split()[-1])
    props = [h.split()[2] for h in header if h.startswith("property")]
    has_rgb = "red" in props
    fields = [("x", "<f4"), ("y", "<f4"), ("z", "<f4")] + (
        [("red", "u1"), ("green", "u1"), ("blue", "u1")] if has_rgb else []
    )
    if fmt == "binary_little_endian":
        rec = np.frombuffer(data[end:], dtype=fields, count=n)
        pts = np.stack([rec["x"], rec["y"], rec["z"]], 1)
        col = np.stack([rec["red"], rec["green"], rec["blue"]], 1) if has_rgb else None
    elif fmt == "ascii":
        arr = np.array(
            [line.split() for line in data[end:].decode("ascii").splitlines()[:n]], dtype=np.float64
        )
        if arr.shape[0] != n or arr.ndim != 2 or arr.shape[1] < (6 if has_rgb else 3):
            raise ValueError(f"{path}: {arr.shape[0]} vertex rows of {n} declared, or too few columns")
        pts = arr[:, :3].astype(np.float32)
        col = arr[:, 3:6].astype(np.uint8) if has_rgb else None
    else:
        raise ValueError(f"{path}: unsupported PLY format {fmt!r}")
    return pts, col
