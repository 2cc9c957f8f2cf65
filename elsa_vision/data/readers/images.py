"""Pillow images (PNG, JPEG, BMP, WebP, GIF ...) as RGB or grey: image folders and multi-view frames.

Every image is opened with :func:`elsa_vision.files.open_image`, which checks the pixel count its header
declares against ``PIL.Image.MAX_IMAGE_PIXELS`` before anything is decoded (``FileTooLargeError``), and is
decoded at once, so truncated data fails here and not later inside a transform.
"""

from __future__ import annotations

import os

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from ...files import FileTooLargeError, open_image

__all__ = ["load_rgb", "read_rgb"]


def load_rgb(path: str | os.PathLike, mode: str = "RGB") -> Image.Image:
    """Decode ``path`` fully; return an RGB (or ``mode="L"`` grey) image. RGBA, LA and transparent palette
    images are composited on white; 16-bit, integer and float grey images are stretched to 8 bits (min to
    max). Unreadable data raises ``OSError``/``ValueError``/``SyntaxError`` (Pillow's three ways of reporting
    a corrupt file), an image over the pixel limit ``FileTooLargeError`` (a ``ValueError``)."""
    if mode not in ("RGB", "L"):
        raise ValueError(f"load_rgb: mode must be 'RGB' or 'L', got {mode!r}")
    return _load(path).convert(mode) if mode == "L" else _load(path)


def _load(path: str | os.PathLike) -> Image.Image:
    with open_image(path) as im:
        im.load()  # decode now: truncated data raises here, not later inside a transform
        if im.mode in ("RGBA", "LA") or (im.mode == "P" and "transparency" in im.info):
            rgba = im.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        if im.mode.startswith("I;16") or im.mode in ("I", "F"):
            # 16-bit / integer / float grey: rescale to 8 bit before the RGB conversion (in place: one
            # float32 copy of the image)
            arr = np.asarray(im, dtype=np.float32)
            lo, hi = float(arr.min()), float(arr.max())
            if hi > lo:
                np.subtract(arr, lo, out=arr)
                np.divide(arr, hi - lo, out=arr)
                np.multiply(arr, 255.0, out=arr)
                np.round(arr, out=arr)
            else:
                arr[...] = 0
            return Image.fromarray(arr.astype(np.uint8)).convert("RGB")
        return im.convert("RGB")


def read_rgb(path: str | os.PathLike) -> Tensor:
    """:func:`load_rgb` as a float32 tensor ``[3, H, W]`` in ``[0, 1]``; an unreadable image is a
    ``ValueError`` naming it. Besides the decoded image, one uint8 copy and the float32 result are
    allocated (12 bytes per pixel)."""
    try:
        pixels = torch.from_numpy(np.asarray(load_rgb(path))).permute(2, 0, 1)  # uint8 [3, H, W], a view
    except FileTooLargeError:
        raise
    except (OSError, ValueError, SyntaxError) as exc:
        raise ValueError(f"cannot read image {os.fspath(path)}: {exc}") from exc
    return torch.empty(pixels.shape, dtype=torch.float32).copy_(pixels).div_(255.0)
