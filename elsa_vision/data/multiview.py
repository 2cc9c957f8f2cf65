"""Multi-view reconstruction data: an embedded ray-cast synthetic generator and real-capture loaders.

Every sample is one sequence of ``S`` frames, a dict of tensors:

* ``images [S, 3, H, W]`` float in [0, 1];
* ``depth [S, H, W]`` float (z along the optical axis; 0 where unknown) and ``valid [S, H, W]`` bool;
* ``extrinsics [S, 3, 4]`` camera-from-world (OpenCV axes), ``intrinsics [S, 3, 3]`` (pixel ``(u, v)`` is the
  integer column/row index).

Sources: (1) :class:`SyntheticMultiViewDataset` -- procedurally textured planes, boxes and spheres rendered by
exact ray casting from sampled look-at cameras, deterministic from a seed, no downloads (one sequence as PNG
frames for the inference CLI: ``python -m elsa_vision.data.multiview --out frames/``, :func:`main`); (2)
:func:`load_nerf_transforms` (NeRF/instant-ngp/nerfstudio ``transforms.json``) and :func:`load_colmap_text`
(COLMAP ``cameras.txt`` + ``images.txt``, optional depth maps) feeding :class:`MultiViewSequenceDataset`,
which samples frames per sequence and resizes keeping the intrinsics consistent.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import lightning as L
import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from ..files import check_regular_file, open_image, read_npy
from .geometry import quat_to_mat
from .readers.images import read_rgb
from .samplers import epoch_loader

__all__ = [
    "write_synthetic_frames",
    "render_scene",
    "sample_scene",
    "sample_cameras",
    "look_at",
    "SyntheticMultiViewDataset",
    "FrameRecord",
    "load_nerf_transforms",
    "load_colmap_text",
    "read_colmap_depth",
    "resize_frame",
    "MultiViewSequenceDataset",
    "MultiViewDataModule",
]

_logger = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------------------
# Synthetic scenes
# --------------------------------------------------------------------------------------------------------


@dataclass
class Scene:
    """Primitives in world coordinates (z up). Colours ``[K, 2, 3]`` (two texture colours per object),
    texture frequencies ``[K]``.

    planes: ``normal [Np, 3]`` (unit) and ``offset [Np]`` (points with ``n·x = offset``);
    boxes: axis-aligned ``lo [Nb, 3]``, ``hi [Nb, 3]``; spheres: ``center [Ns, 3]``, ``radius [Ns]``.
    """

    plane_normal: Tensor
    plane_offset: Tensor
    box_lo: Tensor
    box_hi: Tensor
    sphere_center: Tensor
    sphere_radius: Tensor
    colors: Tensor = field(default=None)  # [Np + Nb + Ns, 2, 3]
    freqs: Tensor = field(default=None)  # [Np + Nb + Ns]


def sample_scene(generator: torch.Generator, num_boxes: int = 2, num_spheres: int = 2) -> Scene:
    """A ground plane ``z = 0``, a back wall, ``num_boxes`` boxes and ``num_spheres`` spheres on it."""
    g = generator

    def u(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(tuple(shape), generator=g, dtype=torch.float64)

    plane_normal = torch.tensor([[0.0, 0.0, 1.0], [0.0, -1.0, 0.0]], dtype=torch.float64)
    plane_offset = torch.stack([torch.zeros((), dtype=torch.float64), -u(lo=3.0, hi=4.0)])  # wall at y = 3..4
    centers = u(num_boxes, 2, lo=-1.2, hi=1.2)
    half = u(num_boxes, 3, lo=0.2, hi=0.5)
    box_lo = torch.cat([centers - half[:, :2], torch.zeros(num_boxes, 1, dtype=torch.float64)], 1)
    box_hi = torch.cat([centers + half[:, :2], 2 * half[:, 2:]], 1)
    radius = u(num_spheres, lo=0.2, hi=0.5)
    sphere_center = torch.cat([u(num_spheres, 2, lo=-1.5, hi=1.5), radius[:, None]], 1)
    k = 2 + num_boxes + num_spheres
    colors = u(k, 2, 3, lo=0.05, hi=0.95)
    freqs = u(k, lo=1.0, hi=3.0)
    return Scene(plane_normal, plane_offset, box_lo, box_hi, sphere_center, radius, colors, freqs)


def look_at(center: Tensor, target: Tensor, up: Tensor | None = None) -> Tensor:
    """Camera-from-world ``[..., 3, 4]`` of cameras at ``center [..., 3]`` looking at ``target`` (OpenCV)."""
    up = torch.tensor([0.0, 0.0, 1.0], dtype=center.dtype) if up is None else up
    fwd = F.normalize(target - center, dim=-1)
    right = F.normalize(torch.linalg.cross(fwd, up.expand_as(fwd)), dim=-1)
    down = torch.linalg.cross(fwd, right)
    rot = torch.stack([right, down, fwd], dim=-2)
    t = -(rot @ center[..., None])
    return torch.cat([rot, t], dim=-1)


def sample_cameras(
    generator: torch.Generator,
    num_frames: int,
    image_size: tuple[int, int],
    fov_range: tuple[float, float] = (45.0, 70.0),
) -> tuple[Tensor, Tensor]:
    """One camera moving along an arc around the scene -> (extrinsics ``[S,3,4]``, intrinsics ``[S,3,3]``).

    What a capture circling an object gives: the sequence draws its elevation (15–40°), distance (3.5–5),
    look-at point (within 0.4 of the origin, at most 0.4 high) and vertical field of view (``fov_range``
    degrees) once, and the frames follow each other at evenly spaced azimuths over an arc of 0.3–1.2 rad
    (either direction) centred within ±0.9 rad of the view straight at the wall (cameras on the −y side, the
    wall at +y). Square pixels, principal point at the image centre.
    """
    g = generator
    h, w = image_size

    def u(*shape, lo=0.0, hi=1.0):
        return lo + (hi - lo) * torch.rand(tuple(shape), generator=g, dtype=torch.float64)

    centre, span = u(lo=-0.9, hi=0.9), u(lo=0.3, hi=1.2)
    if float(u()) < 0.5:
        span = -span
    steps = torch.linspace(-0.5, 0.5, num_frames, dtype=torch.float64) if num_frames > 1 else torch.zeros(1)
    az = centre + span * steps.double()
    el = torch.deg2rad(u(lo=15.0, hi=40.0))
    r = u(lo=3.5, hi=5.0)
    ground, height = r * torch.cos(el), r * torch.sin(el)
    eye = torch.stack([ground * torch.sin(az), -ground * torch.cos(az), height.expand_as(az)], -1)
    target = torch.cat([u(2, lo=-0.4, hi=0.4), u(1, lo=0.0, hi=0.4)]).expand(num_frames, 3)
    ext = look_at(eye, target)
    f = (h / 2) / torch.tan(torch.deg2rad(u(lo=fov_range[0], hi=fov_range[1])) / 2)
    intr = torch.zeros(num_frames, 3, 3, dtype=torch.float64)
    intr[:, 0, 0], intr[:, 1, 1], intr[:, 0, 2], intr[:, 1, 2], intr[:, 2, 2] = f, f, w / 2, h / 2, 1.0
    return ext, intr


def _texture(points: Tensor, obj: Tensor, scene: Scene) -> Tensor:
    """Solid (3D) procedural texture: a checkerboard of the object's two colours modulated by stripes; on the
    ground plane and the wall (objects 0 and 1) mostly a smooth colour field fixed in the world.

    The field (period ~7–10 units) gives a view's large-scale colours by where it looks, which a small
    model reads at 56 px; the checkerboards alone alias into moiré there, and carry no such cue.
    """
    freq = scene.freqs[obj][..., None]
    p = points * freq
    checker = (torch.floor(p[..., 0]) + torch.floor(p[..., 1]) + torch.floor(p[..., 2])).remainder(2)[
        ..., None
    ]
    cols = scene.colors[obj]  # [..., 2, 3]
    base = cols[..., 0, :] * (1 - checker) + cols[..., 1, :] * checker
    stripes = 0.85 + 0.15 * torch.sin(3.1 * p.sum(-1, keepdim=True) + 2.0 * obj[..., None].double())
    x, y = points[..., 0], points[..., 1]
    field = 0.5 + 0.45 * torch.stack([torch.sin(0.9 * x), torch.sin(0.9 * y + 1.0), torch.cos(0.6 * (x - y))],
                                     dim=-1)
    plane = (obj <= 1)[..., None]
    return torch.where(plane, 0.35 * base * stripes + 0.65 * field, base * stripes).clamp(0.0, 1.0)


def render_scene(
    scene: Scene, extrinsics: Tensor, intrinsics: Tensor, image_size: tuple[int, int], far: float = 100.0
) -> tuple[Tensor, Tensor, Tensor]:
    """Exact ray casting of ``scene`` from cameras ``[S, 3, 4]``/``[S, 3, 3]`` at pixel centres ``(u, v)``.

    Returns ``image [S, 3, H, W]`` (float64 in [0, 1]), ``depth [S, H, W]`` (z-depth, 0 on background) and
    ``object_id [S, H, W]`` (int64, −1 on background). Vectorised over all pixels and primitives.
    """
    h, w = image_size
    S = extrinsics.shape[0]
    ext, intr = extrinsics.double(), intrinsics.double()
    v, u = torch.meshgrid(
        torch.arange(h, dtype=torch.float64), torch.arange(w, dtype=torch.float64), indexing="ij"
    )
    d_cam = torch.stack(
        [
            (u[None] - intr[:, 0, 2, None, None]) / intr[:, 0, 0, None, None],
            (v[None] - intr[:, 1, 2, None, None]) / intr[:, 1, 1, None, None],
            torch.ones(S, h, w, dtype=torch.float64),
        ],
        dim=-1,
    )  # z = 1: ray parameter = depth
    rot_t = ext[:, :3, :3].transpose(1, 2)
    origin = -(rot_t @ ext[:, :3, 3:4]).squeeze(-1)  # [S, 3]
    d = torch.einsum("sij,shwj->shwi", rot_t, d_cam).reshape(S, h * w, 3)
    o = origin[:, None, :]
    ts = []
    # planes: n·(o + t d) = c
    nd = torch.einsum("sni,pi->snp", d, scene.plane_normal)
    no = torch.einsum("sni,pi->snp", o.expand_as(d), scene.plane_normal)
    tp = (scene.plane_offset - no) / nd
    ts.append(torch.where(nd.abs() > 1e-12, tp, torch.full_like(tp, math.inf)))
    # boxes: slab method
    inv = 1.0 / d[..., None, :]
    t1 = (scene.box_lo - o[..., None, :]) * inv
    t2 = (scene.box_hi - o[..., None, :]) * inv
    tmin = torch.minimum(t1, t2).nan_to_num(-math.inf).amax(-1)
    tmax = torch.maximum(t1, t2).nan_to_num(math.inf).amin(-1)
    hit = (tmax >= tmin) & (tmax > 0)
    ts.append(torch.where(hit, torch.where(tmin > 0, tmin, tmax), torch.full_like(tmin, math.inf)))
    # spheres: |o + t d − c|² = r², d not unit
    oc = o[..., None, :] - scene.sphere_center
    a = (d * d).sum(-1, keepdim=True)
    b = (d[..., None, :] * oc).sum(-1)
    c = (oc * oc).sum(-1) - scene.sphere_radius**2
    disc = b * b - a * c
    sq = disc.clamp_min(0).sqrt()
    # numerically stable roots: q = −(b + sign(b)·sqrt(disc)); t = q/a, c/q
    q = -(b + torch.where(b >= 0, sq, -sq))
    r1, r2 = q / a, c / q
    near, farr = torch.minimum(r1, r2), torch.maximum(r1, r2)
    tsph = torch.where(near > 0, near, farr)
    ts.append(torch.where((disc >= 0) & (tsph > 0), tsph, torch.full_like(tsph, math.inf)))
    t_all = torch.cat(ts, dim=-1)
    t_all = torch.where(t_all > 1e-9, t_all, torch.full_like(t_all, math.inf))
    t_hit, obj = t_all.min(-1)
    bg = ~torch.isfinite(t_hit) | (t_hit > far)
    t_hit = torch.where(bg, torch.zeros_like(t_hit), t_hit)
    points = o + t_hit[..., None] * d
    color = _texture(points, obj, scene)
    sky = torch.tensor([0.55, 0.7, 0.9], dtype=torch.float64) * (
        0.8 + 0.2 * v.reshape(1, h * w, 1) / max(h - 1, 1)
    )
    color = torch.where(bg[..., None], sky.expand_as(color), color)
    obj = torch.where(bg, torch.full_like(obj, -1), obj)
    return (
        color.reshape(S, h, w, 3).permute(0, 3, 1, 2).contiguous(),
        t_hit.reshape(S, h, w),
        obj.reshape(S, h, w),
    )


class SyntheticMultiViewDataset(Dataset):
    """Deterministic synthetic sequences: item ``i`` renders scene ``seed·1_000_003 + i`` (no downloads).

    Args:
        length: number of sequences; num_frames: frames per sequence; image_size: ``(H, W)``.
        seed: base seed (use different seeds for train/val/test); num_boxes, num_spheres: scene content.
        fresh: index ``e·length + i`` (what ``EpochShuffleSampler(per_epoch_indices=True)`` yields in epoch
            ``e``) renders a scene seeded by ``(seed, e, i)`` (numpy's ``SeedSequence``, mapped into
            ``[2**31, 2**32)``; torch's generator keeps 32 bits of a seed): new scenes every epoch, the same
            ones when an epoch is replayed, and never a scene of a fixed split (those seeds stay below
            ``2**31``). ``length`` is then the number of sequences per epoch.
    """

    def __init__(
        self,
        length: int,
        num_frames: int = 4,
        image_size: tuple[int, int] = (56, 56),
        seed: int = 0,
        num_boxes: int = 2,
        num_spheres: int = 2,
        fresh: bool = False,
    ) -> None:
        if length < 1:
            raise ValueError(f"SyntheticMultiViewDataset: `length` must be >= 1, got {length}")
        if num_frames < 1:
            raise ValueError(f"SyntheticMultiViewDataset: `num_frames` must be >= 1, got {num_frames}")
        self.length, self.num_frames, self.image_size = length, num_frames, tuple(int(s) for s in image_size)
        self.seed, self.num_boxes, self.num_spheres = seed, num_boxes, num_spheres
        self.fresh = fresh

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        if index < 0 or (index >= self.length and not self.fresh):
            raise IndexError(f"index {index} out of range for {self.length} sequences")
        if self.fresh:
            epoch, item = divmod(index, self.length)
            mixed = int(np.random.SeedSequence([self.seed, epoch, item]).generate_state(1)[0])
            scene_seed = 2**31 + mixed % 2**31
        else:
            scene_seed = self.seed * 1_000_003 + index
        g = torch.Generator().manual_seed(scene_seed)
        scene = sample_scene(g, self.num_boxes, self.num_spheres)
        ext, intr = sample_cameras(g, self.num_frames, self.image_size)
        img, depth, _ = render_scene(scene, ext, intr, self.image_size)
        return {
            "images": img.float(),
            "depth": depth.float(),
            "valid": depth > 0,
            "extrinsics": ext.float(),
            "intrinsics": intr.float(),
        }


# --------------------------------------------------------------------------------------------------------
# Real captures
# --------------------------------------------------------------------------------------------------------


@dataclass
class FrameRecord:
    """One captured frame: image path, camera-from-world ``[3, 4]``, intrinsics ``[3, 3]`` at the file's
    resolution ``(height, width)``, optional depth path (``depth_scale`` multiplies stored integers)."""

    image: Path
    extrinsics: np.ndarray
    intrinsics: np.ndarray
    size_hw: tuple[int, int]
    depth: Path | None = None
    depth_scale: float = 1.0


def _inside(root: Path, name: str, index: Path) -> Path:
    """``root / name`` for a file a dataset's index (``transforms.json``, ``images.txt``) names, which must
    lie inside ``root``: an index names the dataset's own files, never another path (an absolute name, or
    one whose ``..`` leaves the dataset folder, is refused; symbolic links inside it are followed)."""
    base = Path(os.path.abspath(root))
    if Path(name).is_absolute() or not Path(os.path.abspath(base / name)).is_relative_to(base):
        raise ValueError(f"{index} names {name!r}, outside the dataset folder {root}: not read")
    return root / name


@contextlib.contextmanager
def _parsing(what: str):
    """Any error of reading ``what`` (``"<loader>: <file>"``, or a record of it) as one ValueError that names
    it; the loaders' own errors (those starting with ``what``'s loader, missing files) pass through
    unchanged. A record of the wrong type or length, a number that is none, JSON nested past the
    interpreter's recursion limit: each is a malformed file, not a traceback from inside the parser."""
    loader = what.split(":", 1)[0] + ":"
    try:
        yield
    except FileNotFoundError:
        raise
    except ValueError as e:
        if str(e).startswith(loader):
            raise
        raise ValueError(f"{what}: {e}") from None
    except (TypeError, KeyError, IndexError, AttributeError, RecursionError) as e:
        raise ValueError(f"{what}: malformed ({type(e).__name__}: {e})") from None


def _image_size(path: Path) -> tuple[int, int]:
    with open_image(path) as im:
        return im.height, im.width


def load_nerf_transforms(root: str | Path, filename: str = "transforms.json") -> list[FrameRecord]:
    """Frames of a NeRF-style ``transforms.json``.

    Intrinsics from ``fl_x``/``fl_y``/``cx``/``cy`` (per frame or global; ``cx, cy`` default to the centre) or
    ``camera_angle_x`` (``camera_angle_y``); ``transform_matrix`` is camera-to-world in OpenGL axes (y up,
    z backwards) and is converted to OpenCV camera-from-world. ``file_path`` without extension gets ``.png``.
    Optional ``depth_file_path`` (``.npy`` in scene units, or 16-bit PNG × ``depth_unit_scale_factor``,
    default 1e-3).
    """
    root = Path(root)
    path = root / filename
    if not path.is_file():
        raise FileNotFoundError(f"load_nerf_transforms: {path} not found")
    with _parsing(f"load_nerf_transforms: {path}"):
        meta = json.loads(path.read_text())
        frames = meta.get("frames")
    if not frames or not isinstance(frames, list):
        raise ValueError(f"load_nerf_transforms: {path} has no 'frames' list")
    out = []
    for i, fr in enumerate(frames):
        with _parsing(f"load_nerf_transforms: {path} frame {i}"):
            out.append(_nerf_frame(root, path, meta, i, fr))
    return out


def _nerf_frame(root: Path, path: Path, meta: dict, i: int, fr: dict) -> FrameRecord:
    """Frame ``i`` (``fr``) of the NeRF ``transforms.json`` at ``path`` (its global keys: ``meta``)."""
    flip = np.diag([1.0, -1.0, -1.0, 1.0])

    def get(key):
        return fr.get(key, meta.get(key))

    img = _inside(root, fr["file_path"], path)
    if not img.suffix:
        img = img.with_suffix(".png")
    if not img.is_file():
        raise FileNotFoundError(f"load_nerf_transforms: frame {i} image {img} not found")
    h, w = get("h"), get("w")
    if h is None or w is None:
        h, w = _image_size(img)
    h, w = int(h), int(w)
    fx, fy = get("fl_x"), get("fl_y")
    if fx is None:
        angle_x = get("camera_angle_x")
        if angle_x is None:
            raise ValueError(
                f"load_nerf_transforms: {path} frame {i} has neither fl_x nor camera_angle_x"
            )
        fx = 0.5 * w / math.tan(0.5 * float(angle_x))
    if fy is None:
        angle_y = get("camera_angle_y")
        fy = 0.5 * h / math.tan(0.5 * float(angle_y)) if angle_y is not None else fx
    cx = float(get("cx")) if get("cx") is not None else w / 2
    cy = float(get("cy")) if get("cy") is not None else h / 2
    k = np.array([[fx, 0, cx], [0, fy, cy], [0, 0, 1]], dtype=np.float64)
    c2w = np.asarray(fr["transform_matrix"], dtype=np.float64)
    if c2w.shape == (3, 4):
        c2w = np.vstack([c2w, [0, 0, 0, 1]])
    if c2w.shape != (4, 4):
        raise ValueError(
            f"load_nerf_transforms: {path} frame {i} transform_matrix must be 4x4, got {c2w.shape}"
        )
    w2c = np.linalg.inv(c2w @ flip)
    depth = None
    if fr.get("depth_file_path"):
        depth = _inside(root, fr["depth_file_path"], path)
        if not depth.is_file():
            raise FileNotFoundError(f"load_nerf_transforms: frame {i} depth {depth} not found")
    scale = float(meta.get("depth_unit_scale_factor", 1e-3))
    return FrameRecord(img, w2c[:3], k, (h, w), depth, scale)


_COLMAP_PARAMS = {  # model -> (fx, fy, cx, cy) indices into params; the rest is distortion (ignored)
    "SIMPLE_PINHOLE": (0, 0, 1, 2),
    "PINHOLE": (0, 1, 2, 3),
    "SIMPLE_RADIAL": (0, 0, 1, 2),
    "RADIAL": (0, 0, 1, 2),
    "OPENCV": (0, 1, 2, 3),
    "FULL_OPENCV": (0, 1, 2, 3),
    "SIMPLE_RADIAL_FISHEYE": (0, 0, 1, 2),
    "RADIAL_FISHEYE": (0, 0, 1, 2),
    "OPENCV_FISHEYE": (0, 1, 2, 3),
}


def read_colmap_depth(path: str | Path) -> np.ndarray:
    """A COLMAP dense depth map (``*.geometric.bin``: header ``w&h&c&``, float32, column-major)."""
    data = Path(check_regular_file(path, "read_colmap_depth:")).read_bytes()
    amp = [i for i, b in enumerate(data[:64]) if b == ord("&")]
    if len(amp) < 3:
        raise ValueError(f"read_colmap_depth: {path} has no 'width&height&channels&' header")
    with _parsing(f"read_colmap_depth: {path}"):
        w, h, c = (int(x) for x in data[: amp[2]].decode("ascii").split("&"))
    if min(w, h, c) < 1:
        raise ValueError(f"read_colmap_depth: {path} header says {w}x{h}x{c}: sizes must be >= 1")
    arr = np.frombuffer(data[amp[2] + 1 :], dtype=np.float32)
    if arr.size != w * h * c:
        raise ValueError(f"read_colmap_depth: {path} has {arr.size} values, header says {w}x{h}x{c}")
    return arr.reshape((w, h, c), order="F").transpose(1, 0, 2).squeeze(-1)


def load_colmap_text(
    root: str | Path, sparse_dir: str | None = None, image_dir: str = "images", depth_dir: str | None = None
) -> list[FrameRecord]:
    """Frames of a COLMAP text model (``cameras.txt``, ``images.txt``), sorted by image name.

    ``sparse_dir`` defaults to the first of ``sparse/0``, ``sparse``, ``.`` holding ``cameras.txt``.
    Distortion parameters (SIMPLE_RADIAL, OPENCV, ...) are ignored: images are treated as pinhole (a warning
    names the model). Depth maps, when ``depth_dir`` is given (or ``stereo/depth_maps`` exists):
    ``<name>.npy``
    or COLMAP's ``<name>.geometric.bin``.
    """
    root = Path(root)
    if sparse_dir is None:
        cands = [root / "sparse" / "0", root / "sparse", root]
        sparse = next((c for c in cands if (c / "cameras.txt").is_file()), None)
        if sparse is None:
            raise FileNotFoundError(
                f"load_colmap_text: no cameras.txt under {root} (tried sparse/0, sparse, .)"
            )
    else:
        sparse = root / sparse_dir
    cams = {}
    warned = set()
    for name in ("cameras.txt", "images.txt"):
        check_regular_file(sparse / name, "load_colmap_text:")
    for line in (sparse / "cameras.txt").read_text().splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        with _parsing(f"load_colmap_text: {sparse / 'cameras.txt'}: camera line {line!r}"):
            tok = line.split()
            cam_id, model, w, h = int(tok[0]), tok[1], int(tok[2]), int(tok[3])
            params = [float(x) for x in tok[4:]]
        if model not in _COLMAP_PARAMS:
            raise ValueError(
                f"load_colmap_text: camera {cam_id} has unsupported model {model!r}; "
                f"expected one of {sorted(_COLMAP_PARAMS)}"
            )
        if model not in ("SIMPLE_PINHOLE", "PINHOLE") and model not in warned:
            warned.add(model)
            _logger.warning(
                "load_colmap_text: camera model %s: distortion ignored (treated as pinhole)", model
            )
        if len(params) <= max(_COLMAP_PARAMS[model]):
            raise ValueError(
                f"load_colmap_text: camera {cam_id} in {sparse / 'cameras.txt'}: {model} with "
                f"{len(params)} parameters"
            )
        fx, fy, cx, cy = (params[j] for j in _COLMAP_PARAMS[model])
        cams[cam_id] = (np.array([[fx, 0, cx], [0, fy, cy], [0, 0, 1]], dtype=np.float64), (h, w))
    lines = [ln for ln in (sparse / "images.txt").read_text().splitlines() if not ln.startswith("#")]
    if depth_dir is None and (root / "stereo" / "depth_maps").is_dir():
        depth_dir = "stereo/depth_maps"
    out = []
    # records are line pairs: the image line, then its 2D points (possibly empty)
    i = 0
    while i < len(lines):
        tok = lines[i].split()
        if not tok:
            i += 1
            continue
        if len(tok) < 10:
            raise ValueError(
                f"load_colmap_text: malformed image line in {sparse / 'images.txt'}: {lines[i]!r}"
            )
        with _parsing(f"load_colmap_text: {sparse / 'images.txt'}: image line {lines[i]!r}"):
            qw, qx, qy, qz, tx, ty, tz = (float(x) for x in tok[1:8])
            cam_id, name = int(tok[8]), " ".join(tok[9:])
        if cam_id not in cams:
            raise ValueError(f"load_colmap_text: image {name} references unknown camera {cam_id}")
        rot = quat_to_mat(torch.tensor([qx, qy, qz, qw], dtype=torch.float64)).numpy()
        ext = np.concatenate([rot, np.array([[tx], [ty], [tz]])], axis=1)
        img = _inside(root, f"{image_dir}/{name}", sparse / "images.txt")
        if not img.is_file():
            raise FileNotFoundError(f"load_colmap_text: image {img} not found")
        depth = None
        if depth_dir is not None:
            for cand in (
                _inside(root, f"{depth_dir}/{Path(name).stem}.npy", sparse / "images.txt"),
                _inside(root, f"{depth_dir}/{name}.geometric.bin", sparse / "images.txt"),
            ):
                if cand.is_file():
                    depth = cand
                    break
        k, hw = cams[cam_id]
        out.append(FrameRecord(img, ext, k.copy(), hw, depth, 1.0))
        i += 2
    if not out:
        raise ValueError(f"load_colmap_text: no images in {sparse / 'images.txt'}")
    return sorted(out, key=lambda f: f.image.name)


def resize_frame(
    image: Tensor, intrinsics: Tensor, size_hw: tuple[int, int], depth: Tensor | None = None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Centre-crop to the target aspect ratio, then resize; intrinsics follow exactly.

    ``image [3, h, w]``, ``intrinsics [3, 3]`` (integer pixel-centre convention), ``depth [h, w]`` (nearest).
    A crop by ``(x0, y0)`` shifts ``c -= (x0, y0)``; a scale ``s`` maps ``u -> (u + 0.5)·s − 0.5``.
    """
    _, h, w = image.shape
    th, tw = size_hw
    if th * w > tw * h:  # too wide: crop width
        cw, ch = round(h * tw / th), h
    else:
        cw, ch = w, round(w * th / tw)
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    image = image[:, y0 : y0 + ch, x0 : x0 + cw]
    k = intrinsics.clone().double()
    k[0, 2] -= x0
    k[1, 2] -= y0
    sx, sy = tw / cw, th / ch
    k[0, 0] *= sx
    k[1, 1] *= sy
    k[0, 2] = (k[0, 2] + 0.5) * sx - 0.5
    k[1, 2] = (k[1, 2] + 0.5) * sy - 0.5
    image = F.interpolate(image[None], size=(th, tw), mode="bilinear", antialias=True, align_corners=False)[0]
    if depth is not None:
        depth = depth[y0 : y0 + ch, x0 : x0 + cw]
        depth = F.interpolate(depth[None, None], size=(th, tw), mode="nearest")[0, 0]
    return image.clamp(0, 1), k.to(intrinsics.dtype), depth


def _load_depth(rec: FrameRecord) -> Tensor:
    p = rec.depth
    if p.suffix == ".npy":
        arr = read_npy(p).astype(np.float32)  # header checked: declared size, data present
    elif p.name.endswith(".bin"):
        arr = read_colmap_depth(p).astype(np.float32)
    else:
        with open_image(p) as im:
            arr = np.asarray(im, dtype=np.float32) * rec.depth_scale
    if arr.shape != rec.size_hw:
        raise ValueError(f"depth map {p} has shape {arr.shape}, image is {rec.size_hw}")
    return torch.from_numpy(np.ascontiguousarray(arr))


class MultiViewSequenceDataset(Dataset):
    """Sequences of ``num_frames`` frames sampled from captured scenes.

    Args:
        sequences: one list of :class:`FrameRecord` per scene.
        num_frames: frames per sample (sampled without replacement, frame 0 first, the rest sorted).
        image_size: ``(H, W)`` after centre-crop + resize.
        samples_per_sequence: items per scene; item ``i`` uses a generator seeded by ``(seed, i)``.
    """

    def __init__(
        self,
        sequences: list[list[FrameRecord]],
        num_frames: int = 4,
        image_size: tuple[int, int] = (56, 56),
        samples_per_sequence: int = 1,
        seed: int = 0,
    ) -> None:
        if not sequences:
            raise ValueError("MultiViewSequenceDataset: `sequences` is empty")
        for i, seq in enumerate(sequences):
            if len(seq) < num_frames:
                raise ValueError(
                    f"MultiViewSequenceDataset: sequence {i} has {len(seq)} frames, num_frames={num_frames}"
                )
        self.sequences, self.num_frames = sequences, num_frames
        self.image_size = tuple(int(s) for s in image_size)
        self.samples_per_sequence, self.seed = samples_per_sequence, seed

    def __len__(self) -> int:
        return len(self.sequences) * self.samples_per_sequence

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        seq = self.sequences[index // self.samples_per_sequence]
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        pick = torch.randperm(len(seq), generator=g)[: self.num_frames].tolist()
        pick = pick[:1] + sorted(pick[1:])
        imgs, depths, valids, exts, intrs = [], [], [], [], []
        for j in pick:
            rec = seq[j]
            img = read_rgb(rec.image)
            if tuple(img.shape[1:]) != tuple(rec.size_hw):
                raise ValueError(
                    f"image {rec.image} is {tuple(img.shape[1:])}, its camera says {rec.size_hw}"
                )
            depth = _load_depth(rec) if rec.depth is not None else None
            img, k, depth = resize_frame(img, torch.from_numpy(rec.intrinsics), self.image_size, depth)
            if depth is None:
                depth = torch.zeros(self.image_size)
            imgs.append(img)
            depths.append(depth)
            valids.append((depth > 0) & torch.isfinite(depth))
            exts.append(torch.from_numpy(rec.extrinsics).float())
            intrs.append(k.float())
        return {
            "images": torch.stack(imgs),
            "depth": torch.stack(depths).nan_to_num(0.0),
            "valid": torch.stack(valids),
            "extrinsics": torch.stack(exts),
            "intrinsics": torch.stack(intrs),
        }


def _scene_dirs(root: Path, marker: str) -> list[Path]:
    if (root / marker).is_file() or any((root / d / marker).is_file() for d in ("sparse/0", "sparse")):
        return [root]
    dirs = sorted(
        d
        for d in root.iterdir()
        if d.is_dir()
        and ((d / marker).is_file() or any((d / s / marker).is_file() for s in ("sparse/0", "sparse")))
    )
    if not dirs:
        raise FileNotFoundError(f"no scene with {marker} in {root} or its sub-directories")
    return dirs


class MultiViewDataModule(L.LightningDataModule):
    """Multi-view sequences for :class:`elsa_vision.tasks.multiview.MultiViewReconstructionModule`.

    Args:
        source: ``"synthetic"``, ``"nerf"`` (``transforms.json``) or ``"colmap"`` (text model).
        root: scene directory, or a directory of scene directories (real sources).
        num_frames, image_size: frames per sequence and ``(H, W)`` (multiples of the patch size).
        train_size, val_size, test_size: sequences per split (synthetic: rendered with seeds ``seed``,
            ``seed + 1``, ``seed + 2``; real: samples drawn per split from all scenes with different seeds --
            real captures carry no split, so hold scenes out by pointing ``root`` elsewhere).
        fresh_train_scenes: synthetic source: ``train_size`` new scenes every epoch (a function of ``seed``
            and the epoch: a resumed run replays them), instead of the same ``train_size`` scenes each epoch,
            which a model memorises (validation loss rose after a few epochs). Validation and test scenes
            stay fixed.
    """

    def __init__(
        self,
        source: str = "synthetic",
        root: str | None = None,
        num_frames: int = 4,
        image_size: tuple[int, int] | list[int] = (56, 56),
        batch_size: int = 2,
        num_workers: int = 0,
        train_size: int = 64,
        val_size: int = 8,
        test_size: int = 8,
        seed: int = 0,
        pin_memory: bool = False,
        fresh_train_scenes: bool = True,
    ) -> None:
        super().__init__()
        if source not in ("synthetic", "nerf", "colmap"):
            raise ValueError(f"MultiViewDataModule: `source` must be synthetic|nerf|colmap, got {source!r}")
        if source != "synthetic" and root is None:
            raise ValueError(f"MultiViewDataModule: source={source!r} needs `root`")
        self.save_hyperparameters(logger=False)
        self.datasets: dict[str, Dataset] = {}

    def setup(self, stage: str | None = None) -> None:
        hp = self.hparams
        size = tuple(int(s) for s in hp.image_size)
        sizes = {"train": hp.train_size, "val": hp.val_size, "test": hp.test_size}
        if hp.source == "synthetic":
            for i, (split, n) in enumerate(sizes.items()):
                fresh = split == "train" and hp.fresh_train_scenes
                self.datasets[split] = SyntheticMultiViewDataset(n, hp.num_frames, size, seed=hp.seed + i,
                                                                 fresh=fresh)
            return
        root = Path(hp.root)
        if hp.source == "nerf":
            seqs = [load_nerf_transforms(d) for d in _scene_dirs(root, "transforms.json")]
        else:
            seqs = [load_colmap_text(d) for d in _scene_dirs(root, "cameras.txt")]
        for i, (split, n) in enumerate(sizes.items()):
            per = max(1, math.ceil(n / len(seqs)))
            self.datasets[split] = MultiViewSequenceDataset(seqs, hp.num_frames, size, per, seed=hp.seed + i)

    def _loader(self, split: str, shuffle: bool) -> DataLoader:
        if split not in self.datasets:
            self.setup()
        # each epoch's order depends on (seed, epoch) only: a resumed run replays it
        fresh = bool(getattr(self.datasets[split], "fresh", False))
        return epoch_loader(self.datasets[split], shuffle, batch_size=self.hparams.batch_size,
                            seed=self.hparams.seed, num_workers=self.hparams.num_workers,
                            pin_memory=self.hparams.pin_memory, drop_last=False, per_epoch_indices=fresh)

    def train_dataloader(self) -> DataLoader:
        return self._loader("train", True)

    def val_dataloader(self) -> DataLoader:
        return self._loader("val", False)

    def test_dataloader(self) -> DataLoader:
        return self._loader("test", False)


# --------------------------------------------------------------------------------------------------------
# Frames of a synthetic sequence on disk
# --------------------------------------------------------------------------------------------------------

FRAME_OUTPUTS = ("frame_*", "ground_truth.json")  # files.prepare_output_dir: a trailing * is a prefix


def write_synthetic_frames(
    out: str | Path,
    num_frames: int = 8,
    image_size: tuple[int, int] = (56, 56),
    seed: int = 1,
    index: int = 0,
) -> list[Path]:
    """Write sequence ``index`` of ``SyntheticMultiViewDataset(seed=seed)`` as ``out/frame_NN.png`` (8-bit
    RGB, frame 0 the reference) and its ground truth as ``out/ground_truth.json`` (per frame:
    camera-from-world extrinsics, intrinsics; the depth maps are not written). Seed 1 is the validation
    split of ``data=multiview_synthetic``: scenes a model trained on it did not see. Returns the frame
    paths."""
    from PIL import Image

    seq = SyntheticMultiViewDataset(index + 1, num_frames, image_size, seed=seed)[index]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for i, img in enumerate(seq["images"]):
        path = out / f"frame_{i:02d}.png"
        Image.fromarray((img.permute(1, 2, 0).numpy() * 255).round().astype(np.uint8)).save(path)
        paths.append(path)
    truth = {
        "convention": "extrinsics: camera-from-world [R|t], OpenCV axes; intrinsics: pixel (u, v) = "
        "column/row index",
        "source": f"SyntheticMultiViewDataset(seed={seed})[{index}]",
        "image_size_hw": list(image_size),
        "frames": [{"name": p.stem, "extrinsics": seq["extrinsics"][i].tolist(),
                    "intrinsics": seq["intrinsics"][i].tolist()} for i, p in enumerate(paths)],
    }
    (out / "ground_truth.json").write_text(json.dumps(truth, indent=1))
    return paths


def main(argv: list[str] | None = None) -> list[Path]:
    """``python -m elsa_vision.data.multiview --out frames/``: one synthetic sequence as PNG frames (what
    ``python -m elsa_vision.inference.multiview --frames`` reads). Errors end the run with one line."""
    import argparse

    from ..files import add_output_arguments, prepare_output_dir, record_outputs, remove_outputs

    ap = argparse.ArgumentParser(prog="python -m elsa_vision.data.multiview",
                                 description=write_synthetic_frames.__doc__.split(".")[0])
    add_output_arguments(ap, "directory of the frames", required=True, type=Path)
    ap.add_argument("--num-frames", type=int, default=8, help="frames of the sequence (default 8)")
    ap.add_argument("--size", type=int, nargs=2, default=[56, 56], metavar=("H", "W"),
                    help="frame height and width (default 56 56, what elsa_vggt_small trains on)")
    ap.add_argument("--seed", type=int, default=1, help="dataset seed (default 1: the validation scenes)")
    ap.add_argument("--index", type=int, default=0, help="which sequence of that dataset (default 0)")
    args = ap.parse_args(argv)
    if args.num_frames < 1 or min(args.size) < 1 or args.index < 0:
        ap.error("--num-frames and --size must be >= 1, --index >= 0")
    try:
        out = prepare_output_dir(args.out, FRAME_OUTPUTS, overwrite=args.overwrite)
    except ValueError as e:
        ap.error(str(e))
    if args.overwrite:
        remove_outputs(out, FRAME_OUTPUTS)  # what an earlier run recorded (a longer sequence's frames too)
    record_outputs(out, [f"frame_{i:02d}.png" for i in range(args.num_frames)] + ["ground_truth.json"])
    paths = write_synthetic_frames(out, args.num_frames, tuple(args.size), args.seed, args.index)
    print(json.dumps({"frames": len(paths), "out": str(out), "size_hw": list(args.size)}), flush=True)
    return paths


if __name__ == "__main__":
    main()
