"""Readers of every imaging format the package takes in, for the data modules and the inference CLIs.

* :mod:`.images`: PNG, JPEG and the other Pillow formats -> an RGB or grey ``PIL.Image``, or ``[3, H, W]`` in
  [0, 1] (image folders, multi-view frames);
* :mod:`.medical`: DICOM, NIfTI, TIFF / OME-TIFF, PNG / JPEG -> float32 ``[C, H, W]`` per 2-D image, 16-bit
  values kept, and the value pipeline of high-resolution inference (windowing, normalisation, channels);
* :mod:`.cubes`: hyperspectral ``.mat`` v5 / v7.3, ENVI, TIFF, ``.npy`` / ``.npz`` -> ``(H, W, bands)`` cubes
  and ``(H, W)`` label maps;
* :mod:`.tiff`: the one TIFF reader (series, pyramid levels, memory mapping) the other two use.

Nothing is decoded before its declared size is checked (:mod:`elsa_vision.files`): Pillow images against
``PIL.Image.MAX_IMAGE_PIXELS``, every array format against ``max_bytes`` (4 GiB by default), which bounds the
decoded data and the copies made from it (float32 images, the float32 cube) together; ``FileTooLargeError``
otherwise. Only regular files are read, and none opens a path its content names (``docs/files.md``). Every
error names the file.
"""

from .cubes import (
    CUBE_NAN_POLICIES,
    MAX_CLASSES,
    MAX_LABEL,
    HSIScene,
    list_arrays,
    load_cube,
    load_gt,
    load_scene,
)
from .images import load_rgb, read_rgb
from .medical import (
    FORMATS,
    NAN_POLICIES,
    NORMALIZATIONS,
    MedicalImage,
    apply_nan_policy,
    apply_window,
    detect_format,
    iter_images,
    load_image,
    map_channels,
    normalize,
    read_image,
)
from .tiff import TiffSeries, read_tiff

__all__ = [
    "CUBE_NAN_POLICIES",
    "FORMATS",
    "HSIScene",
    "MAX_CLASSES",
    "MAX_LABEL",
    "MedicalImage",
    "NAN_POLICIES",
    "NORMALIZATIONS",
    "TiffSeries",
    "apply_nan_policy",
    "apply_window",
    "detect_format",
    "iter_images",
    "list_arrays",
    "load_cube",
    "load_gt",
    "load_image",
    "load_rgb",
    "load_scene",
    "map_channels",
    "normalize",
    "read_image",
    "read_rgb",
    "read_tiff",
]
