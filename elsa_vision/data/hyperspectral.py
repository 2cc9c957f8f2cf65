"""Hyperspectral scenes: label encoding, spectral transforms, splits, patch sampling, ``HSIDataModule``.

A scene is a cube ``(H, W, bands)`` and a ground-truth map ``(H, W)`` of integer labels where 0 means
"unlabelled" (read by :mod:`elsa_vision.data.readers`: ``.mat`` v5/v7.3, ENVI, TIFF, NumPy). Labelled classes
are renumbered to ``0..K-1`` in increasing order of their original value (``class_values`` keeps the original
values).

Standard protocols: SSFTT-style (PCA to 30 components, 13x13 patches, stratified ratio split) and
HSIMAE-style (group-wise PCA, few labelled samples per class). Normalisation statistics and PCA are fitted on
training pixels only.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping, Sequence

import lightning as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from .readers._common import row_slices
from .readers.cubes import CUBE_NAN_POLICIES, load_scene
from .samplers import epoch_loader

__all__ = [
    "HSIDataModule",
    "HSIPatchDataset",
    "SpectralTransform",
    "encode_labels",
    "split_indices",
    "pad_cube",
    "extract_patches",
    "synthetic_scene",
    "SPLIT_PROTOCOLS",
]

SPLIT_PROTOCOLS = ("ratio", "per_class")


# ----------------------------------------------------------------------------------------------------------
# Labels
# ----------------------------------------------------------------------------------------------------------


def encode_labels(gt: np.ndarray, class_values: Sequence[int] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Map labels to ``0..K-1`` (``-1`` for unlabelled 0).

    Returns ``(encoded (H, W) int64, class_values (K,))``.

    With ``class_values`` given (e.g. from a checkpoint), labels outside it raise ``ValueError``.
    """
    values = np.unique(gt[gt > 0]) if class_values is None else np.asarray(class_values, dtype=np.int64)
    if values.size == 0:
        raise ValueError("ground truth has no labelled pixel (all labels are 0)")
    # a sorted lookup: memory follows the number of pixels, not the largest label value
    order = np.argsort(values, kind="stable")
    pos = np.clip(np.searchsorted(values[order], gt), 0, values.size - 1)
    enc = np.where((values[order][pos] == gt) & (gt > 0), order[pos], -1).astype(np.int64)
    unknown = (gt > 0) & (enc < 0)
    if unknown.any():
        raise ValueError(
            f"ground truth has labels {np.unique(gt[unknown]).tolist()} outside the known classes "
            f"{values.tolist()}"
        )
    return enc, values


# ----------------------------------------------------------------------------------------------------------
# Splits
# ----------------------------------------------------------------------------------------------------------


def split_indices(
    labels: np.ndarray,
    protocol: str = "ratio",
    ratio: float = 0.1,
    val_ratio: float = 0.1,
    samples_per_class: int = 10,
    val_samples_per_class: int | None = None,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Split labelled pixels into train / val / test index arrays (indices into ``labels``).

    Args:
        labels: ``(N,)`` class ids ``0..K-1`` of the labelled pixels.
        protocol: ``"ratio"``: per class ``max(1, round(ratio * n_c))`` training pixels (stratified), then
            ``round(val_ratio * n_c)`` validation pixels from the rest. ``"per_class"``: ``samples_per_class``
            training pixels per class (a class with ``n_c <= samples_per_class`` gives ``max(1, n_c // 2)``)
            and ``val_samples_per_class`` (default ``samples_per_class``) validation pixels from the rest, at
            most half of what remains.
        seed: the permutation seed; the same seed gives the same split.

    Returns:
        ``(train, val, test)`` sorted int64 arrays; test is every labelled pixel in neither train nor val.
    """
    if protocol not in SPLIT_PROTOCOLS:
        raise ValueError(f"split protocol must be one of {SPLIT_PROTOCOLS}, got {protocol!r}")
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0:
        raise ValueError(f"labels must be a non-empty 1-D array, got shape {labels.shape}")
    if protocol == "ratio":
        if not (0.0 < ratio < 1.0):
            raise ValueError(f"split ratio must be in (0, 1), got {ratio}")
        if not (0.0 <= val_ratio < 1.0) or ratio + val_ratio >= 1.0:
            raise ValueError(
                f"split val_ratio must be in [0, 1 - ratio), got val_ratio={val_ratio}, ratio={ratio}"
            )
    else:
        if int(samples_per_class) < 1:
            raise ValueError(f"split samples_per_class must be >= 1, got {samples_per_class}")
        if val_samples_per_class is not None and int(val_samples_per_class) < 0:
            raise ValueError(f"split val_samples_per_class must be >= 0, got {val_samples_per_class}")
    rng = np.random.default_rng(seed)
    train, val, test = [], [], []
    for c in np.unique(labels):
        idx = rng.permutation(np.flatnonzero(labels == c))
        n = idx.size
        if protocol == "ratio":
            n_tr = max(1, int(round(ratio * n)))
            n_va = int(round(val_ratio * n))
        else:
            n_tr = int(samples_per_class) if n > samples_per_class else max(1, n // 2)
            n_va_req = int(samples_per_class if val_samples_per_class is None else val_samples_per_class)
            n_va = min(n_va_req, (n - n_tr) // 2)
        n_tr = min(n_tr, n)
        n_va = max(0, min(n_va, n - n_tr))
        train.append(idx[:n_tr])
        val.append(idx[n_tr : n_tr + n_va])
        test.append(idx[n_tr + n_va :])
    return tuple(np.sort(np.concatenate(a)).astype(np.int64) for a in (train, val, test))


# ----------------------------------------------------------------------------------------------------------
# Spectral transform: per-band standardisation and (group-wise) PCA, fitted on training pixels
# ----------------------------------------------------------------------------------------------------------


class SpectralTransform:
    """Per-band standardisation, then optional (group-wise) PCA; fitted on training pixels only.

    ``groups == 1`` is ordinary PCA to ``n_components``; ``groups > 1`` splits the bands into that many
    contiguous groups and runs one PCA per group (HSIMAE), the components split as evenly as possible.
    The fitted state is a dict of tensors/ints (``state_dict``) so it travels inside a checkpoint.
    """

    def __init__(self, normalize: bool = True, n_components: int | None = None, groups: int = 1):
        if n_components is not None and int(n_components) < 1:
            raise ValueError(f"pca n_components must be >= 1 or None, got {n_components}")
        if int(groups) < 1:
            raise ValueError(f"pca groups must be >= 1, got {groups}")
        self.normalize = bool(normalize)
        self.n_components = None if n_components is None else int(n_components)
        self.groups = int(groups)
        self.num_bands_in: int | None = None
        self.mean: np.ndarray | None = None
        self.std: np.ndarray | None = None
        self.pca: list[dict] = []  # each: {"start", "stop", "mean" (b,), "components" (k, b)}

    @property
    def fitted(self) -> bool:
        return self.num_bands_in is not None

    @property
    def num_bands_out(self) -> int:
        if not self.fitted:
            raise RuntimeError("SpectralTransform is not fitted")
        return sum(g["components"].shape[0] for g in self.pca) if self.pca else self.num_bands_in

    def fit(self, pixels: np.ndarray, seed: int = 0) -> SpectralTransform:
        """Fit on training pixels ``(N, bands)``."""
        from sklearn.decomposition import PCA

        if pixels.ndim != 2 or pixels.shape[0] == 0:
            raise ValueError(f"training pixels must be a non-empty (N, bands) array, got {pixels.shape}")
        x = pixels.astype(np.float64)
        n, bands = x.shape
        self.num_bands_in = bands
        if self.normalize:
            self.mean = x.mean(0)
            std = x.std(0)
            self.std = np.where(std > 1e-12 * max(1.0, float(np.abs(x).max())), std, 1.0)
        else:
            self.mean, self.std = np.zeros(bands), np.ones(bands)
        x = (x - self.mean) / self.std
        self.pca = []
        if self.n_components is not None:
            if self.groups > bands:
                raise ValueError(f"pca groups ({self.groups}) must be <= the number of bands ({bands})")
            if self.n_components > bands:
                raise ValueError(
                    f"pca n_components ({self.n_components}) must be <= the number of bands ({bands})"
                )
            if self.n_components < self.groups:
                raise ValueError(f"pca n_components ({self.n_components}) must be >= groups ({self.groups})")
            edges = np.linspace(0, bands, self.groups + 1).round().astype(int)
            comps = [
                self.n_components // self.groups + (g < self.n_components % self.groups)
                for g in range(self.groups)
            ]
            for g in range(self.groups):
                lo, hi, k = int(edges[g]), int(edges[g + 1]), comps[g]
                if k > min(hi - lo, n):
                    raise ValueError(
                        f"pca: group {g} (bands {lo}..{hi - 1}) cannot give {k} components from "
                        f"{hi - lo} bands and {n} training pixels"
                    )
                p = PCA(n_components=k, svd_solver="full", random_state=seed).fit(x[:, lo:hi])
                self.pca.append(
                    {"start": lo, "stop": hi, "mean": p.mean_.copy(), "components": p.components_.copy()}
                )
        return self

    def apply(self, cube: np.ndarray) -> np.ndarray:
        """Transform ``(..., bands)`` -> float32 ``(..., num_bands_out)``. The float64 work is done a slice of
        the first axis at a time: the result is the only full-size allocation."""
        if not self.fitted:
            raise RuntimeError("SpectralTransform is not fitted")
        if cube.shape[-1] != self.num_bands_in:
            raise ValueError(
                f"cube has {cube.shape[-1]} bands, the transform was fitted on {self.num_bands_in} bands"
            )
        if cube.ndim == 1:
            return self.apply(cube[None])[0]
        out = np.empty(cube.shape[:-1] + (self.num_bands_out,), np.float32)
        for s in row_slices(cube, 8 * max(cube.shape[-1], self.num_bands_out) // cube.shape[-1]):
            x = (cube[s].astype(np.float64) - self.mean) / self.std
            if self.pca:
                x = np.concatenate(
                    [(x[..., g["start"] : g["stop"]] - g["mean"]) @ g["components"].T for g in self.pca], -1
                )
            out[s] = x
        return out

    def state_dict(self) -> dict:
        """Fitted state as tensors and ints (loadable with ``torch.load(weights_only=True)``)."""
        if not self.fitted:
            raise RuntimeError("SpectralTransform is not fitted")
        return {
            "normalize": self.normalize,
            "n_components": self.n_components,
            "groups": self.groups,
            "num_bands_in": self.num_bands_in,
            "mean": torch.from_numpy(self.mean),
            "std": torch.from_numpy(self.std),
            "pca": [
                {
                    "start": g["start"],
                    "stop": g["stop"],
                    "mean": torch.from_numpy(g["mean"]),
                    "components": torch.from_numpy(g["components"]),
                }
                for g in self.pca
            ],
        }

    @classmethod
    def from_state_dict(cls, state: Mapping) -> SpectralTransform:
        t = cls(normalize=state["normalize"], n_components=state["n_components"], groups=state["groups"])
        t.num_bands_in = int(state["num_bands_in"])
        t.mean = np.asarray(state["mean"], dtype=np.float64)
        t.std = np.asarray(state["std"], dtype=np.float64)
        t.pca = [
            {
                "start": int(g["start"]),
                "stop": int(g["stop"]),
                "mean": np.asarray(g["mean"], dtype=np.float64),
                "components": np.asarray(g["components"], dtype=np.float64),
            }
            for g in state["pca"]
        ]
        return t


# ----------------------------------------------------------------------------------------------------------
# Patches
# ----------------------------------------------------------------------------------------------------------


def _check_patch_size(patch_size: int, h: int, w: int) -> int:
    if isinstance(patch_size, bool) or not isinstance(patch_size, (int, np.integer)):
        raise TypeError(f"patch_size must be an odd int, got {patch_size!r}")
    if patch_size < 1 or patch_size % 2 == 0:
        raise ValueError(f"patch_size must be odd and >= 1, got {patch_size}")
    r = patch_size // 2
    if r >= min(h, w):
        raise ValueError(
            f"patch_size {patch_size} is too large for a {h}x{w} scene (reflect padding needs "
            f"patch_size // 2 < min(H, W))"
        )
    return r


def pad_cube(cube: np.ndarray, patch_size: int) -> Tensor:
    """Reflect-pad ``(H, W, C)`` by ``r = patch_size // 2``: a float32 tensor ``(C, H + 2r, W + 2r)``."""
    h, w, _ = cube.shape
    r = _check_patch_size(patch_size, h, w)
    bands_first = cube.transpose(2, 0, 1)  # a view; np.pad writes the padded (C, H', W') array once
    padded = np.pad(bands_first, ((0, 0), (r, r), (r, r)), mode="reflect") if r else bands_first
    return torch.from_numpy(np.ascontiguousarray(padded, dtype=np.float32))


def extract_patches(padded: Tensor, rows: Tensor, cols: Tensor, patch_size: int) -> Tensor:
    """Patches ``(N, C, p, p)`` centred at ``(rows, cols)`` (unpadded coordinates) of a ``pad_cube``."""
    off = torch.arange(patch_size, device=padded.device)
    r = rows.to(padded.device)[:, None] + off  # (N, p)
    c = cols.to(padded.device)[:, None] + off
    return padded[:, r[:, :, None], c[:, None, :]].permute(1, 0, 2, 3)


class HSIPatchDataset(Dataset):
    """Patches around pixels: items ``(patch (C, p, p) float32, label int64)`` (label -1 when unknown).

    ``augment`` applies a random flip and 90-degree rotation (the label is the centre pixel's, unchanged),
    drawn from torch's global generator (seeded per worker by ``lightning.seed_everything(workers=True)``).
    """

    def __init__(
        self,
        padded: Tensor,
        coords: np.ndarray,
        labels: np.ndarray | None,
        patch_size: int,
        augment: bool = False,
    ):
        self.padded = padded
        self.coords = torch.as_tensor(np.asarray(coords, dtype=np.int64).reshape(-1, 2))
        self.labels = (
            torch.full((len(self.coords),), -1, dtype=torch.long)
            if labels is None
            else torch.as_tensor(np.asarray(labels, dtype=np.int64))
        )
        if len(self.labels) != len(self.coords):
            raise ValueError(f"labels ({len(self.labels)}) and coords ({len(self.coords)}) differ in length")
        self.patch_size = int(patch_size)
        self.augment = augment

    def __len__(self) -> int:
        return len(self.coords)

    def __getitem__(self, i: int) -> tuple[Tensor, Tensor]:
        r, c = int(self.coords[i, 0]), int(self.coords[i, 1])
        p = self.patch_size
        x = self.padded[:, r : r + p, c : c + p]
        if self.augment:
            k, flip = torch.randint(0, 4, (2,)).tolist()
            x = torch.rot90(x, k, dims=(1, 2))
            if flip % 2:
                x = torch.flip(x, dims=(2,))
            x = x.contiguous()
        return x, self.labels[i]


# ----------------------------------------------------------------------------------------------------------
# DataModule
# ----------------------------------------------------------------------------------------------------------

_SPLIT_DEFAULTS = {
    "protocol": "ratio",
    "ratio": 0.1,
    "val_ratio": 0.1,
    "samples_per_class": 10,
    "val_samples_per_class": None,
}


class HSIDataModule(L.LightningDataModule):
    """Patch classification on one hyperspectral scene.

    Args:
        path: cube file (``.mat``, ENVI ``.hdr``, ``.tif``, ``.npy``/``.npz``).
        gt_path: ground-truth file; None reads ``gt_key`` from ``path``.
        key, gt_key: array names; auto-detected when None.
        patch_size: odd patch side; patches are reflect-padded at the borders.
        pca: None, or ``{n_components: int, groups: int (1 = plain PCA)}``; fitted on training pixels.
        split: mapping with ``protocol`` (``"ratio"`` | ``"per_class"``), ``ratio``, ``val_ratio``,
            ``samples_per_class``, ``val_samples_per_class`` (see :func:`split_indices`).
        seed: split, PCA, pretraining-subset and shuffling seed.
        normalize: per-band standardisation with training-pixel statistics.
        nan_policy: ``"raise"`` or ``"fill"`` (see :func:`elsa_vision.data.readers.load_cube`).
        augment: random flips / rotations of training patches.
        pretrain: the training set is every pixel of the scene (labels -1): unlabelled patches for MAE
            pretraining; validation stays the labelled validation split. ``max_pretrain_samples`` caps it
            (random subset, fixed by ``seed``).
        class_names: optional names of the classes in increasing label order.
        max_input_gib: files declaring more data than this many GiB are refused before they are read
            (default: :data:`elsa_vision.files.DEFAULT_MAX_ARRAY_BYTES`, 4 GiB).

    After ``setup()``: ``num_bands`` (bands after the transform), ``num_classes``, ``class_values``,
    ``hsi_meta`` (what inference needs, stored in checkpoints by the task modules).
    """

    def __init__(
        self,
        path: str,
        gt_path: str | None = None,
        key: str | None = None,
        gt_key: str | None = None,
        patch_size: int = 9,
        pca: Mapping | None = None,
        split: Mapping | None = None,
        seed: int = 0,
        batch_size: int = 64,
        num_workers: int = 0,
        normalize: bool = True,
        nan_policy: str = "raise",
        augment: bool = True,
        pretrain: bool = False,
        max_pretrain_samples: int | None = None,
        class_names: Sequence[str] | None = None,
        pin_memory: bool = False,
        max_input_gib: float | None = None,
    ):
        super().__init__()
        if int(batch_size) < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if int(num_workers) < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if nan_policy not in CUBE_NAN_POLICIES:
            raise ValueError(f"nan_policy must be one of {CUBE_NAN_POLICIES}, got {nan_policy!r}")
        if patch_size % 2 == 0 or patch_size < 1:
            raise ValueError(f"patch_size must be odd and >= 1, got {patch_size}")
        split = dict(split or {})
        unknown = set(split) - set(_SPLIT_DEFAULTS)
        if unknown:
            raise ValueError(f"split: unknown keys {sorted(unknown)}; expected {sorted(_SPLIT_DEFAULTS)}")
        self.split = {**_SPLIT_DEFAULTS, **split}
        pca = None if pca is None else dict(pca)
        if pca is not None:
            unknown = set(pca) - {"n_components", "groups"}
            if unknown or "n_components" not in pca:
                raise ValueError(f"pca must be None or {{n_components, groups}}, got keys {sorted(pca)}")
        self.pca = pca
        for name, file in (("path", path), ("gt_path", gt_path)):
            if file is not None and not os.path.isfile(file):  # named now, before a model is built for it
                raise FileNotFoundError(f"data.{name}: {os.fspath(file)!r} does not exist or is not a file")
        self.path, self.gt_path, self.key, self.gt_key = path, gt_path, key, gt_key
        self.patch_size = int(patch_size)
        self.seed = int(seed)
        self.batch_size = int(batch_size)
        self.num_workers = int(num_workers)
        self.normalize = normalize
        self.nan_policy = nan_policy
        self.augment = augment
        self.pretrain = pretrain
        self.max_pretrain_samples = max_pretrain_samples
        self.class_names = None if class_names is None else [str(c) for c in class_names]
        self.pin_memory = pin_memory
        if max_input_gib is not None and not max_input_gib > 0:
            raise ValueError(f"max_input_gib must be > 0 or None, got {max_input_gib}")
        self.max_bytes = None if max_input_gib is None else int(max_input_gib * 2**30)
        self.transform: SpectralTransform | None = None
        self._ready = False

    # -- setup -------------------------------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        if self._ready:
            return
        # Without a separate ground-truth file, the cube's own file must hold the ground truth.
        scene = load_scene(
            self.path,
            self.gt_path or self.path,
            key=self.key,
            gt_key=self.gt_key,
            nan_policy=self.nan_policy,
            max_bytes=self.max_bytes,
        )
        h, w, _ = scene.cube.shape
        _check_patch_size(self.patch_size, h, w)
        enc, values = encode_labels(scene.gt)
        if self.class_names is not None and len(self.class_names) != values.size:
            raise ValueError(
                f"class_names has {len(self.class_names)} names, the ground truth {values.size} classes"
            )
        rows, cols = np.nonzero(enc >= 0)
        labels = enc[rows, cols]
        s = self.split
        tr, va, te = split_indices(
            labels,
            s["protocol"],
            s["ratio"],
            s["val_ratio"],
            s["samples_per_class"],
            s["val_samples_per_class"],
            seed=self.seed,
        )
        self.transform = SpectralTransform(
            normalize=self.normalize,
            n_components=None if self.pca is None else self.pca["n_components"],
            groups=1 if self.pca is None else int(self.pca.get("groups", 1)),
        ).fit(scene.cube[rows[tr], cols[tr]], seed=self.seed)
        padded = pad_cube(self.transform.apply(scene.cube), self.patch_size)
        coords = np.stack([rows, cols], 1)
        self.scene_shape = (h, w)
        self.class_values = values
        self.num_classes = int(values.size)
        self.num_bands = self.transform.num_bands_out
        self.split_sizes = {"train": int(tr.size), "val": int(va.size), "test": int(te.size)}
        self.split_coords = {"train": coords[tr], "val": coords[va], "test": coords[te]}
        p = self.patch_size
        if self.pretrain:
            allr, allc = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
            all_coords = np.stack([allr.ravel(), allc.ravel()], 1)
            if self.max_pretrain_samples is not None and self.max_pretrain_samples < len(all_coords):
                pick = np.random.default_rng(self.seed).choice(
                    len(all_coords), self.max_pretrain_samples, False
                )
                all_coords = all_coords[np.sort(pick)]
            self.train_set = HSIPatchDataset(padded, all_coords, None, p, self.augment)
        else:
            self.train_set = HSIPatchDataset(padded, coords[tr], labels[tr], p, self.augment)
        self.val_set = HSIPatchDataset(padded, coords[va], labels[va], p)
        self.test_set = HSIPatchDataset(padded, coords[te], labels[te], p)
        self._ready = True

    @property
    def hsi_meta(self) -> dict:
        """What inference needs, as tensors / ints / strings (``torch.load(weights_only=True)``-safe)."""
        if not self._ready:
            raise RuntimeError("HSIDataModule.hsi_meta is available after setup()")
        return {
            "patch_size": self.patch_size,
            "num_classes": self.num_classes,
            "num_bands": self.num_bands,
            "class_values": torch.from_numpy(self.class_values.astype(np.int64)),
            "class_names": list(self.class_names) if self.class_names else None,
            "transform": self.transform.state_dict(),
            "key": self.key,
            "gt_key": self.gt_key,
            "nan_policy": self.nan_policy,
        }

    # -- loaders -----------------------------------------------------------------------------------------
    def _loader(self, ds: Dataset, shuffle: bool) -> DataLoader:
        # each epoch's order depends on (seed, epoch) only: a resumed run replays it; every labelled pixel
        # is seen each epoch (few-shot splits hold a few per class)
        return epoch_loader(ds, shuffle, batch_size=self.batch_size, seed=self.seed,
                            num_workers=self.num_workers, pin_memory=self.pin_memory, drop_last=False)

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_set, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        if len(self.val_set) == 0:
            warnings.warn(
                "HSIDataModule: the validation split is empty; validating on the test split", stacklevel=2
            )
            return self._loader(self.test_set, shuffle=False)
        return self._loader(self.val_set, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_set, shuffle=False)


def synthetic_scene(
    height: int = 40,
    width: int = 36,
    bands: int = 24,
    num_classes: int = 4,
    block: int = 4,
    noise: float = 0.3,
    unlabelled: float = 0.2,
    seed: int = 0,
) -> tuple[np.ndarray, np.ndarray]:
    """A scene with learnable class structure, for tests and benchmarks.

    Labels are constant on ``block x block`` tiles (a fraction ``unlabelled`` of tiles is 0); every class has
    a smooth random spectrum (a sum of Gaussian bumps), each pixel is its class's spectrum times a random
    brightness ``1 + 0.1 N(0, 1)`` plus white noise of std ``noise``. Unlabelled tiles get a random class's
    spectrum. Returns ``(cube float32 (H, W, bands), gt uint8 (H, W))`` with labels ``1..num_classes``.
    """
    if num_classes < 1 or num_classes > 255:
        raise ValueError(f"num_classes must be in [1, 255], got {num_classes}")
    rng = np.random.default_rng(seed)
    th, tw = -(-height // block), -(-width // block)
    tiles = rng.integers(1, num_classes + 1, size=(th, tw))
    # Every class appears on at least one tile.
    tiles.flat[rng.permutation(tiles.size)[:num_classes]] = np.arange(1, num_classes + 1)
    shown = tiles.copy()
    empty = rng.random((th, tw)) < unlabelled
    empty &= np.array([[np.sum(tiles == tiles[i, j]) > 1 for j in range(tw)] for i in range(th)])
    tiles[empty] = 0
    gt = np.kron(tiles, np.ones((block, block), dtype=np.int64))[:height, :width].astype(np.uint8)
    cls = np.kron(shown, np.ones((block, block), dtype=np.int64))[:height, :width]
    grid = np.linspace(0.0, 1.0, bands)
    spectra = np.zeros((num_classes + 1, bands))
    for c in range(1, num_classes + 1):
        for _ in range(3):
            mu, sig, amp = rng.random(), 0.05 + 0.2 * rng.random(), 0.5 + rng.random()
            spectra[c] += amp * np.exp(-0.5 * ((grid - mu) / sig) ** 2)
    bright = 1.0 + 0.1 * rng.standard_normal((height, width, 1))
    cube = spectra[cls] * bright + noise * rng.standard_normal((height, width, bands))
    return cube.astype(np.float32), gt
