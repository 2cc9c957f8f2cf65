"""Building the model zoo: local checkpoint files, timm filter functions, clear key reports, the one
``from_timm`` of the models that are a timm model with ELSA attention (:class:`FromTimm`), and
``check_attention_options``, the build-time check of the attention options, from :mod:`elsa_vision.layers`.

Checkpoints are read without unpickling arbitrary objects (:func:`elsa_vision.files.read_checkpoint`):
``.safetensors`` through ``safetensors``, every other file (``.pth``, ``.pt``, ``.bin``, ``.ckpt``) through
``torch.load(weights_only=True)``, TorchScript archives without running their code.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from torch import Tensor, nn

from ..layers.elsa_module import check_attention_options, check_linear_options

__all__ = ["FromTimm", "LoadReport", "check_attention_options", "read_state_dict", "check_shapes",
           "load_checkpoint"]


# Prefixes of a training module's attribute (Lightning's ``net.``, ``model.``), removed by
# files.strip_prefixes, which also removes the wrappers' own (DDP, torch.compile) in files.unwrap_weights.
_MODULE_PREFIXES = ("net.", "model.")


@dataclass
class LoadReport:
    """What a checkpoint load did: keys the model wanted but the file lacked, and keys nobody used."""

    path: str
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.missing and not self.unexpected

    def __str__(self) -> str:
        if self.ok:
            return f"{self.path}: all keys matched"
        lines = [f"{self.path}:"]
        if self.missing:
            lines.append(f"  missing keys ({len(self.missing)}): {', '.join(self.missing)}")
        if self.unexpected:
            lines.append(f"  unexpected keys ({len(self.unexpected)}): {', '.join(self.unexpected)}")
        return "\n".join(lines)


def _strip_prefixes(state_dict: dict[str, Tensor], model_keys: set[str]) -> dict[str, Tensor]:
    """Remove a training module's ``net.`` / ``model.`` prefix that every key carries, where that matches
    more of ``model_keys``.

    Unlike ``submodule=`` of :func:`elsa_vision.files.read_weights` (the caller knows which attribute of
    which training module wrote the file, and takes those keys), a ``checkpoint_path`` may come from any
    training script: the prefix is guessed from the two usual names and checked against the model, which
    may have a top-level ``model.`` submodule of its own.
    """
    from ..files import strip_prefixes

    def helps(stripped: dict[str, Tensor], state: dict[str, Tensor]) -> bool:
        # Only strip when it helps: a model may itself have a top-level `model.` submodule.
        return not model_keys or len(model_keys & stripped.keys()) >= len(model_keys & state.keys())

    return strip_prefixes(state_dict, _MODULE_PREFIXES, keep=helps)


def read_state_dict(path: str | os.PathLike, model_keys: set[str] | None = None) -> dict[str, Tensor]:
    """Read a flat ``{name: tensor}`` dict from a local checkpoint file.

    Args:
        path: ``.safetensors`` file, a torch checkpoint (``.pth``/``.pt``/``.bin``/``.ckpt``) loaded with
            ``weights_only=True``, or a TorchScript archive (its tensors; its code is never run), read by
            :func:`elsa_vision.files.read_weights` (nested dicts such as ``state_dict`` / ``model`` and the
            wrapper prefixes ``module.`` / ``_orig_mod.`` unwrapped); a training module's ``net.`` /
            ``model.`` prefix is removed where that matches more of ``model_keys`` (``_strip_prefixes``).
        model_keys: the target model's keys, used to decide whether stripping a prefix helps.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: the file is not a readable checkpoint (``NotACheckpointError``, ``UnsafeCheckpointError``)
            or holds no tensors. Every message starts with ``checkpoint_path:`` and names the file.
    """
    from ..files import read_weights

    state_dict = read_weights(path, arg="checkpoint_path", torchscript=True)
    return _strip_prefixes(state_dict, model_keys or set())


def check_shapes(model: nn.Module, state_dict: Mapping[str, Tensor], path: str = "checkpoint") -> None:
    """Raise ``ValueError`` naming the first key whose tensor shape differs from the model's."""
    own = model.state_dict()
    for k, v in state_dict.items():
        if k in own and own[k].shape != v.shape:
            raise ValueError(
                f"{path}: shape mismatch for key {k!r}: checkpoint has {tuple(v.shape)}, "
                f"model expects {tuple(own[k].shape)}"
            )


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike,
    filter_fn: Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]] | None = None,
    strict: bool = True,
) -> LoadReport:
    """Load a local checkpoint into ``model``.

    Args:
        model: the target module.
        path: see :func:`read_state_dict`.
        filter_fn: ``(state_dict, model) -> state_dict`` conversion, e.g. timm's ``checkpoint_filter_fn``
            (OpenAI-CLIP / DINOv2 layouts, position-embedding resampling).
        strict: raise ``ValueError`` listing missing/unexpected keys; if False they are only reported.

    Returns:
        The :class:`LoadReport`. Shape mismatches always raise ``ValueError`` naming the key.
    """
    own_keys = set(model.state_dict().keys())
    state_dict = read_state_dict(path, own_keys)
    if filter_fn is not None:
        state_dict = filter_fn(state_dict, model)
    check_shapes(model, state_dict, os.fspath(path))
    missing, unexpected = model.load_state_dict(state_dict, strict=False)
    report = LoadReport(os.fspath(path), sorted(missing), sorted(unexpected))
    if strict and not report.ok:
        raise ValueError(f"checkpoint does not match the model (strict=True):\n{report}")
    return report


def _timm_source(
    owner: str,
    src: nn.Module | str,
    base_cls: type[nn.Module],
    elsa_cls: type[nn.Module],
    checkpoint_path: str | os.PathLike | None,
    filter_fn: Callable,
    strict: bool,
    kwargs: dict,
) -> tuple[nn.Module, LoadReport | None]:
    """The timm model an ELSA ``from_timm`` converts: built from a name (plus a local checkpoint), or a deep
    copy of an instance of exactly ``base_cls`` (or ``elsa_cls``). Returns ``(model, load report or None)``.
    """
    import timm

    base = base_cls.__name__
    if isinstance(src, str):
        model = timm.create_model(src, pretrained=False, **kwargs)
        if not isinstance(model, base_cls):
            raise TypeError(f"{owner}: {src!r} builds a {type(model).__name__}, not a {base}")
        report = None
        if checkpoint_path is not None:
            report = load_checkpoint(model, checkpoint_path, filter_fn, strict=strict)
        return model.eval(), report
    if isinstance(src, nn.Module):
        if kwargs:
            raise TypeError(f"{owner}: model kwargs {sorted(kwargs)} only apply when src is a model name; "
                            f"a model instance keeps its own configuration")
        if checkpoint_path is not None:
            raise TypeError(f"{owner}: checkpoint_path only applies when src is a model name")
        if type(src) not in (base_cls, elsa_cls):
            raise TypeError(f"{owner}: src must be a timm {base} (exact class), got {type(src).__name__}; "
                            f"use elsa_vision.patch_attention for other models")
        return copy.deepcopy(src), None
    raise TypeError(f"{owner}: src must be a timm model name or {base}, got {type(src)}")


_Model = TypeVar("_Model", bound="FromTimm")


class FromTimm:
    """Mixin of the ELSA models that are a timm model with ELSA attention: the ``from_timm`` classmethod.

    A model lists it among its bases (before the timm class) and names

    * ``_timm_class``: the timm class it subclasses (adding no parameters), the class ``from_timm`` converts;
    * ``_timm_filter_fn``: ``(state_dict, model) -> state_dict``, the conversion of a checkpoint of that
      class (as a ``staticmethod``): its class docstring says which checkpoint layouts it handles;

    and defines ``_elsa_convert(backend, precision)``, which makes every attention of the timm model ELSA.
    """

    _timm_class: ClassVar[type[nn.Module]]
    _timm_filter_fn: ClassVar[Callable[[dict[str, Tensor], nn.Module], dict[str, Tensor]]]
    load_report: LoadReport | None = None  # set by from_timm when a checkpoint was loaded

    @classmethod
    def from_timm(
        cls: type[_Model],
        src: nn.Module | str,
        checkpoint_path: str | os.PathLike | None = None,
        *,
        attn_backend: str = "auto",
        attn_precision: str = "auto",
        linear_backend: str = "auto",
        strict: bool = True,
        **kwargs: Any,
    ) -> _Model:
        """A model of this class with the configuration and weights of a timm model of its ``_timm_class``.

        Args:
            src: an instance of exactly ``_timm_class`` (deep-copied: same config, same weights, ``src`` is
                left untouched), or a timm model name that builds one (``"vit_base_patch16_224"`` for
                ``ElsaViT``, ``"swinv2_tiny_window8_256"`` for ``ElsaSwinV2``), built with ``**kwargs``:
                that timm class's arguments (``img_size``, ``in_chans``, ``num_classes``,
                ``dynamic_img_size`` for a ViT, ``window_size`` or ``strict_img_size`` for a Swin v2, ...).
            checkpoint_path: only with a name: a local ``.safetensors`` / ``.pth`` / ``.bin`` file, read with
                ``weights_only=True`` and converted by the class's ``_timm_filter_fn`` (the layouts it
                handles: see the class).
            attn_backend, attn_precision, linear_backend: the ELSA backend of every attention layer, the
                float32 precision of the attention and linear layers and the backend of the linear layers,
                as the class's constructor takes them.
            strict: missing or unexpected checkpoint keys raise ``ValueError``; with ``strict=False`` they are
                kept in ``model.load_report``. Shape mismatches always raise ``ValueError`` naming the key.

        Returns:
            The model in the train/eval mode of the source (eval for a name); ``model.load_report`` is the
            checkpoint's key report (None without a checkpoint).

        Raises:
            TypeError: ``src`` is not (or does not build) a ``_timm_class``, or ``kwargs`` /
                ``checkpoint_path`` come with an instance.
            ValueError: bad attention options, or a checkpoint that does not match the model.
        """
        owner = f"{cls.__name__}.from_timm"
        check_attention_options(owner, attn_backend, attn_precision)
        check_linear_options(owner, linear_backend)
        model, report = _timm_source(owner, src, cls._timm_class, cls, checkpoint_path, cls._timm_filter_fn,
                                     strict, kwargs)
        model.__class__ = cls  # a subclass of the timm class that adds no parameters
        model._elsa_convert(attn_backend, attn_precision)
        model._elsa_linears(linear_backend, attn_precision)
        model.load_report = report
        return model
