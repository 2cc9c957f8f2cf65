"""What every ELSA attention layer shares: its two options, the in-place swap, and ``set_attention``.

Every layer computes with :func:`elsa_vision.elsa_attention` (or the W-ELSA window op) under two options fixed
when it is built, timm's convention: ``backend`` (``"auto"``, ``"torch"``, ``"triton"``, ``"eca"``) and the
float32 ``precision`` (one of :data:`elsa_vision.kernels.precision.PRECISIONS`). :class:`ElsaModule` keeps
them under those two names on every layer; :meth:`ElsaModule.convert` turns a timm / torch module into its
ELSA subclass in place (same object, parameters, buffers, hooks and name); :func:`set_attention` changes the
options of every ELSA layer of a model. :class:`ElsaModel` is the mixin of every ELSA model: its one
``set_attention`` method calls that function.
"""

from __future__ import annotations

from torch import nn

from ..kernels import triton_runs_on
from ..ops.attention import check_options

__all__ = ["ElsaModel", "ElsaModule", "check_attention_options", "refuse_torchscript", "set_attention"]


def refuse_torchscript(module: nn.Module):
    """``__prepare_scriptable__`` of every ELSA module: ``torch.jit.script`` calls it first and stops with one
    clear error (TorchScript is not a goal of elsa_vision) instead of failing deep in the compiler."""
    raise RuntimeError(
        f"torch.jit.script: {type(module).__name__} is not scriptable: elsa_vision does not support "
        f"TorchScript (deprecated since torch 2.14); use torch.export.export(model, (x,)) or "
        f"torch.compile(model)")


def check_attention_options(who: str, backend: str, precision: str, prefix: str = "attn_") -> None:
    """What every model checks when it is built (or its attention is changed): ``backend`` / ``precision``
    are names ``elsa_attention`` knows (``check_options``), and ``backend="triton"`` can run on this machine.
    Raises one ``ValueError`` naming ``who`` and the argument (``prefix`` + ``backend``)."""
    check_options(who, backend, precision, prefix)
    if backend == "triton" and not triton_runs_on():
        raise ValueError(
            f"{who}: {prefix}backend='triton' needs a CUDA GPU (with Triton installed) and this machine has "
            f"none; use {prefix}backend='auto' (Triton on CUDA, the torch scan elsewhere) or 'torch'")


class ElsaModule:
    """Mixin of every ELSA attention layer: the ``backend`` / ``precision`` options and the in-place swap.

    A layer that is a subclass of a timm / torch module names that class in ``_converts``; ``convert`` then
    turns an instance of it into the layer without copying anything. Layers built from their own constructor
    (``ElsaAttention``) leave ``_converts`` unset.
    """

    backend: str = "auto"
    precision: str = "auto"
    _converts: type | None = None  # the timm / torch class ``convert`` swaps into this one
    __prepare_scriptable__ = refuse_torchscript

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        """Why ``module`` (an instance of ``_converts``) cannot compute with ELSA, or None when it can."""
        return None

    @classmethod
    def convert(cls, module: nn.Module, *, backend: str = "auto", precision: str = "auto") -> nn.Module:
        """Make ``module`` an instance of ``cls`` in place: same object, parameters, buffers, hooks and name;
        only its class (and so its ``forward``) changes. Returns ``module``.

        Raises:
            TypeError: ``module`` is not an instance of the class this layer converts.
            ValueError: bad options, or a configuration of the module ELSA does not compute
                (:meth:`unsupported`).
        """
        check_options(cls.__name__, backend, precision)
        base = cls._converts
        if base is None:
            raise TypeError(f"{cls.__name__} is built from its constructor, not converted in place")
        if not isinstance(module, (base, cls)):
            raise TypeError(f"{cls.__name__}.convert: expected {base.__module__}.{base.__qualname__}, "
                            f"got {type(module).__name__}")
        reason = cls.unsupported(module)
        if reason is not None:
            raise ValueError(f"{cls.__name__}.convert: {reason} is not supported")
        module.__class__ = cls
        module.backend, module.precision = backend, precision
        module._converted()
        return module

    def _converted(self) -> None:
        """What a layer adjusts on the module it has just become (:meth:`convert`); nothing by default."""

    # The attribute names converted layers had before (``elsa_backend``, ``elsa_precision``): aliases.
    @property
    def elsa_backend(self) -> str:
        return self.backend

    @elsa_backend.setter
    def elsa_backend(self, value: str) -> None:
        self.backend = value

    @property
    def elsa_precision(self) -> str:
        return self.precision

    @elsa_precision.setter
    def elsa_precision(self, value: str) -> None:
        self.precision = value


def set_attention(model: nn.Module, backend: str | None = None, precision: str | None = None,
                  who: str | None = None) -> int:
    """Set ``backend`` and/or ``precision`` (None: keep) on every ELSA layer of ``model`` (``model`` itself
    included). Both are checked first (:func:`check_attention_options`, errors naming ``who``, by default
    ``"<model class>.set_attention"``). Returns how many layers were set."""
    who = who or f"{type(model).__name__}.set_attention"
    check_attention_options(who, "auto" if backend is None else backend,
                            "auto" if precision is None else precision, prefix="")
    layers = [m for m in model.modules() if isinstance(m, ElsaModule)]
    for m in layers:
        if backend is not None:
            m.backend = backend
        if precision is not None:
            m.precision = precision
    return len(layers)


class ElsaModel:
    """Mixin of every ELSA model of :mod:`elsa_vision.models`: the ``set_attention`` method. It holds no
    state and defines no ``__init__``; a model lists it before its ``nn.Module`` (or timm model) base class,
    whose ``__init__`` then runs unchanged."""

    def set_attention(self, backend: str | None = None, precision: str | None = None) -> None:
        """Choose the ELSA ``backend`` and/or float32 ``precision`` (None: keep) of every ELSA attention layer
        of the model, its heads and poolers included (:func:`set_attention`). Both are checked first; errors
        name ``<model class>.set_attention``."""
        set_attention(self, backend, precision)
