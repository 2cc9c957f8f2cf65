"""Shared helpers of the training/evaluation tests: compose the Hydra configs the way train.py does."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from hydra import compose, initialize_config_dir
from hydra.core.global_hydra import GlobalHydra
from hydra.core.hydra_config import HydraConfig
from lightning import Callback
from omegaconf import DictConfig, open_dict
from PIL import Image

from elsa_vision.utils.run_dirs import register_resolvers

ROOT = Path(__file__).resolve().parents[1]
CONFIG_DIR = str(ROOT / "configs")
os.environ.setdefault("PROJECT_ROOT", str(ROOT))
register_resolvers()  # as train.py / evaluate.py do (hydra.run.dir)

# A 1-block, 32-wide ElsaViT: every CPU test run stays in seconds.
TINY_NET = ["model.net.embed_dim=32", "model.net.depth=1", "model.net.num_heads=2", "model.net.mlp_ratio=2.0"]
QUIET = ["logger=none", "callbacks.model_summary=null", "callbacks.progress_bar.refresh_rate=0"]


def compose_cfg(
    config_name: str, overrides: list[str], out_dir: Path, log_dir: Path | None = None
) -> DictConfig:
    """Compose ``configs/<config_name>.yaml`` with ``overrides``; the run directory is ``out_dir`` and the
    log directory ``log_dir`` (default: ``out_dir``'s parent)."""
    GlobalHydra.instance().clear()
    with initialize_config_dir(version_base="1.3", config_dir=CONFIG_DIR):
        cfg = compose(config_name=config_name, return_hydra_config=True, overrides=overrides)
    HydraConfig().set_config(cfg)
    with open_dict(cfg):
        cfg.paths.output_dir = str(out_dir)
        cfg.paths.log_dir = str(out_dir.parent if log_dir is None else log_dir)
        cfg.paths.work_dir = str(ROOT)
        if cfg.get("extras") is not None and "num_threads=" not in " ".join(overrides):
            cfg.extras.num_threads = None  # leave this test process's thread count alone
        del cfg.hydra
    return cfg


def write_image(path: Path, mode: str = "RGB", size: tuple[int, int] = (20, 24), seed: int = 0) -> Path:
    """A random image of Pillow ``mode`` (RGB, RGBA, L, LA, CMYK, I;16) at ``path`` (format: suffix)."""
    rng = np.random.default_rng(seed)
    w, h = size
    if mode == "I;16":
        img = Image.fromarray(rng.integers(0, 65535, (h, w), dtype=np.uint16))
    else:
        bands = len(Image.new(mode, (1, 1)).getbands())
        img = Image.frombytes(mode, (w, h), rng.integers(0, 255, (h, w, bands), dtype=np.uint8).tobytes())
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path


def make_image_tree(
    root: Path, classes=("cat", "dog"), n_train: int = 6, n_val: int = 2, size=(20, 24)
) -> Path:
    """``root/{train,val}/<class>/<i>.png`` of clean RGB images."""
    for split, n in (("train", n_train), ("val", n_val)):
        for ci, c in enumerate(classes):
            for i in range(n):
                write_image(
                    root / split / c / f"{i}.png", size=size, seed=1000 * ci + 10 * i + (split == "val")
                )
    return root


class StopAfterEpoch(Callback):
    """Ends fitting after ``epoch`` epochs, like a job killed right after its end-of-epoch checkpoint."""

    def __init__(self, epoch: int):
        self.epoch = epoch

    def on_train_epoch_end(self, trainer, pl_module):
        if trainer.current_epoch + 1 >= self.epoch:
            trainer.should_stop = True
