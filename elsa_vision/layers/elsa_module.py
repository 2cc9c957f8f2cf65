"""What every ELSA layer shares: its two options, the in-place swap, the patching protocol and the setters.

Every ELSA layer computes with one ELSA op (:func:`elsa_vision.elsa_attention`, the W-ELSA window op, ...)
under two options fixed when it is built, timm's convention: ``backend``, one of the names its kind accepts
(the class attribute ``backends``; the attention layers accept ``"auto"``, ``"torch"``, ``"triton"``,
``"eca"``), and the float32 ``precision``, one of :data:`elsa_vision.kernels.precision.PRECISIONS` for every
kind. :class:`ElsaModule` is the mixin of every layer: it keeps the two options under those two names,
checks them against the layer's kind (:meth:`ElsaModule.check_options`), turns a timm / torch module into its
ELSA subclass in place (:meth:`ElsaModule.convert`: same object, parameters, buffers, hooks and name) and
tells a model walk what to put in a module's place (:meth:`ElsaModule.from_module`,
:meth:`ElsaModule.after_patching`; :mod:`elsa_vision.patching`). :class:`ElsaAttentionModule` is the
mixin of the attention layers.

Two model-wide setters: :func:`set_elsa_options` sets the precision of every ELSA layer of a model and a
backend on the layers whose kind accepts it; :func:`set_attention` does the same for the attention layers
only. :class:`ElsaModel` is the mixin of every ELSA model: its ``set_elsa_options`` and ``set_attention``
methods call them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from torch import nn

from ..kernels import triton_runs_on
from ..ops import checks
from ..ops.checks import BACKENDS, LINEAR_BACKENDS

__all__ = ["ElsaAttentionModule", "ElsaModel", "ElsaModule", "PatchReport", "check_attention_options",
           "check_layer_options", "check_linear_options", "refuse_torchscript", "set_attention",
           "set_elsa_options", "swap_layers"]


def refuse_torchscript(module: nn.Module):
    """``__prepare_scriptable__`` of every ELSA module: ``torch.jit.script`` calls it first and stops with one
    clear error (TorchScript is not a goal of elsa_vision) instead of failing deep in the compiler."""
    raise RuntimeError(
        f"torch.jit.script: {type(module).__name__} is not scriptable: elsa_vision does not support "
        f"TorchScript (deprecated since torch 2.14); use torch.export.export(model, (x,)) or "
        f"torch.compile(model)")


def check_layer_options(who: str, backend: str | None, precision: str | None, backends: tuple[str, ...],
                        prefix: str = "") -> None:
    """What a model checks when its layers are built or changed: ``precision`` is one of ``PRECISIONS``,
    ``backend`` one of ``backends``, and ``backend="triton"`` can run on this machine (None: not given,
    not checked). Raises one ``ValueError`` naming ``who`` and the argument (``prefix`` + ``backend``)."""
    if precision is not None:
        checks.check_precision(who, precision, prefix)
    if backend is None:
        return
    checks.check_backend(who, backend, backends, prefix)
    if backend == "triton" and not triton_runs_on():
        raise ValueError(
            f"{who}: {prefix}backend='triton' needs a CUDA GPU (with Triton installed) and this machine has "
            f"none; use {prefix}backend='auto' (Triton on CUDA, the torch scan elsewhere) or 'torch'")


def check_attention_options(who: str, backend: str, precision: str, prefix: str = "attn_") -> None:
    """:func:`check_layer_options` for the attention options of a model (``attn_backend`` /
    ``attn_precision``): ``backend`` one of ``elsa_attention``'s backends."""
    check_layer_options(who, backend, precision, BACKENDS, prefix)


def check_linear_options(who: str, backend: str, prefix: str = "linear_") -> None:
    """:func:`check_layer_options` for the ``linear_backend`` of a model: one of ``elsa_linear``'s backends
    (the linear layers take the model's float32 precision, checked with the attention's)."""
    check_layer_options(who, backend, None, LINEAR_BACKENDS, prefix)


class ElsaModule:
    """Mixin of every ELSA layer: the ``backend`` / ``precision`` options, their check, the in-place swap and
    the patching protocol.

    A layer kind names the backends it accepts in ``backends`` (checked by :meth:`check_options`). A layer
    that is a subclass of a timm / torch module names that class in ``_converts``; ``convert`` then turns an
    instance of it into the layer without copying anything. Layers built from their own constructor
    (``ElsaAttention``) leave ``_converts`` unset and override :meth:`from_module`.
    """

    backends: tuple[str, ...] = ()  # the backend names this layer kind accepts; every kind sets them
    backend: str = "auto"
    precision: str = "auto"
    _converts: type | None = None  # the timm / torch class ``convert`` swaps into this one
    __prepare_scriptable__ = refuse_torchscript

    @classmethod
    def check_options(cls, backend: str, precision: str, who: str | None = None) -> None:
        """Raise a ``ValueError`` naming ``who`` (default: the class) for a ``backend`` this layer kind does
        not accept or a ``precision`` that is not one of ``PRECISIONS``."""
        checks.check_options(who or cls.__name__, backend, precision, backends=cls.backends)

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        """Why ``module`` (an instance of the class this layer replaces) cannot compute with ELSA, or None
        when it can."""
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
        cls.check_options(backend, precision)
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

    @classmethod
    def from_module(cls, module: nn.Module, *, backend: str = "auto", precision: str = "auto") -> nn.Module:
        """The ELSA layer that takes ``module``'s place in a model (what a patch walk puts there), with its
        weights and the given options: ``module`` itself converted in place (:meth:`convert`) by default; a
        layer built from its own constructor returns a new module (``ElsaAttention.from_timm``)."""
        return cls.convert(module, backend=backend, precision=precision)

    @classmethod
    def replaces(cls, module: nn.Module) -> bool:
        """Whether this layer takes the place of ``module`` (an instance of the class the patch table maps
        to it) at all; a walk leaves the others alone without a word (a convolution that does not cut an
        image into patches is no patch embedding). Every module by default."""
        return True

    @classmethod
    def after_patching(cls, model: nn.Module) -> None:
        """What the layer adjusts elsewhere in ``model`` once a patch walk has put it in; nothing by
        default."""

    def _converted(self) -> None:
        """What a layer adjusts on the module it has just become (:meth:`convert`); nothing by default."""


class ElsaAttentionModule(ElsaModule):
    """Mixin of every ELSA attention layer: they accept ``elsa_attention``'s backends."""

    backends = BACKENDS


def set_elsa_options(model: nn.Module, backend: str | None = None, precision: str | None = None,
                     who: str | None = None, *, layers: type[ElsaModule] = ElsaModule) -> int:
    """Set the float32 ``precision`` of every ELSA layer of ``model`` (``model`` itself included; the
    instances of ``layers``) and ``backend`` on those of them whose kind accepts it (None: keep).

    Both are checked first, in one ``ValueError`` naming ``who`` (by default
    ``"<model class>.set_elsa_options"``): a precision that is not one of ``PRECISIONS``, a backend that no
    layer of the model accepts (with no such layer: that ``layers`` does not accept), ``backend="triton"``
    on a machine without a GPU. Returns how many layers took an option."""
    who = who or f"{type(model).__name__}.set_elsa_options"
    found = [m for m in model.modules() if isinstance(m, layers)]
    accepted = tuple(dict.fromkeys(b for m in found for b in m.backends)) or layers.backends
    check_layer_options(who, backend if accepted else None, precision, accepted)
    set_count = 0
    for m in found:
        took = precision is not None
        if precision is not None:
            m.precision = precision
        if backend is not None and backend in m.backends:
            m.backend, took = backend, True
        set_count += took
    return set_count


def set_attention(model: nn.Module, backend: str | None = None, precision: str | None = None,
                  who: str | None = None) -> int:
    """Set ``backend`` and/or ``precision`` (None: keep) on every ELSA attention layer of ``model``
    (:class:`ElsaAttentionModule`; ``model`` itself included): :func:`set_elsa_options` for the attention
    layers, errors naming ``who``, by default ``"<model class>.set_attention"``. Returns how many layers were
    set."""
    return set_elsa_options(model, backend, precision, who or f"{type(model).__name__}.set_attention",
                            layers=ElsaAttentionModule)


@dataclass
class PatchReport:
    """What a patch walk did: modules swapped per source type, and known modules it had to skip."""

    counts: Counter = field(default_factory=Counter)
    skipped: dict[str, str] = field(default_factory=dict)  # module name -> reason

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __str__(self) -> str:
        parts = [f"{n} x {t}" for t, n in sorted(self.counts.items())]
        s = f"patched {self.total} modules" + (f" ({', '.join(parts)})" if parts else "")
        if self.skipped:
            s += "; skipped " + ", ".join(f"{k} ({v})" for k, v in self.skipped.items())
        return s


def swap_layers(model: nn.Module, table: dict[type, type[ElsaModule]], *, backend: str = "auto",
                precision: str = "auto", who: str = "swap_layers") -> PatchReport:
    """The one walk that puts ELSA layers into a model, in place, weights kept: every module whose exact
    class is a key of ``table`` (subclasses with their own forward are left alone) and that the layer
    ``table[class]`` takes the place of (:meth:`ElsaModule.replaces`) is replaced by what the layer's
    :meth:`~ElsaModule.from_module` returns, with ``backend`` (one every layer of the table accepts) and
    ``precision``; ELSA layers the model already has keep their options. Each layer's
    :meth:`~ElsaModule.after_patching` runs once the walk is done. Used by :mod:`elsa_vision.patching`
    (any timm / torch model) and by the ELSA models for their own linear layers."""
    layers = tuple(dict.fromkeys(table.values()))
    accepted = tuple(b for b in layers[0].backends if all(b in layer.backends for layer in layers)) \
        if layers else ()
    check_layer_options(who, backend, precision, accepted)
    report = PatchReport()
    # Materialise the list first: replacing children while iterating named_modules would skip some. A module
    # put in place of another brings its own submodules: they take the place of the old one's in the list.
    pending = list(model.named_modules())
    i = 0
    while i < len(pending):
        name, module = pending[i]
        i += 1
        source = type(module)
        layer = table.get(source)
        if layer is None or not layer.replaces(module):
            continue
        reason = layer.unsupported(module)
        if reason is not None:
            report.skipped[name] = f"{source.__name__} with {reason}"
            continue
        new = layer.from_module(module, backend=backend, precision=precision)
        if new is not module:
            if not name:
                raise ValueError(f"{who}: the model itself is a {source.__name__}, which {layer.__name__} "
                                 f"replaces; wrap it or use {layer.__name__}.from_module(model)")
            parent_name, _, attr = name.rpartition(".")
            setattr(model.get_submodule(parent_name), attr, new)
            inside = name + "."
            rest = [entry for entry in pending[i:] if not entry[0].startswith(inside)]
            pending[i:] = [(inside + n, m) for n, m in new.named_modules() if n] + rest
        report.counts[source.__name__] += 1
    for layer in layers:
        layer.after_patching(model)
    return report


class ElsaModel:
    """Mixin of every ELSA model of :mod:`elsa_vision.models`: the ``set_attention``, ``set_linear`` and
    ``set_elsa_options`` methods, and the swap of the model's own linear layers. It holds no state and
    defines no ``__init__``; a model lists it before its ``nn.Module`` (or timm model) base class, whose
    ``__init__`` then runs unchanged."""

    def _elsa_linears(self, backend: str = "auto", precision: str = "auto") -> None:
        """Make every ``nn.Linear`` and patch-embedding convolution of the model an ELSA linear layer with
        these options, in place (:data:`elsa_vision.layers.LINEAR_SWAPS`, one :func:`swap_layers` walk):
        FP32-accurate tensor-core products wherever the attention has them. A model calls it once its
        modules are built (and again for a new head: ``reset_classifier``); layers that are ELSA layers
        already keep their options. The options are remembered for the layers a model adds later."""
        from .linear import LINEAR_SWAPS

        swap_layers(self, LINEAR_SWAPS, backend=backend, precision=precision, who=type(self).__name__)
        self.__dict__["_linear_options"] = (backend, precision)

    def reset_classifier(self, *args, **kwargs) -> None:
        """The model's own ``reset_classifier`` (timm's), then its new head made an ELSA linear layer with
        the model's linear options."""
        super().reset_classifier(*args, **kwargs)
        self._elsa_linears(*self.__dict__.get("_linear_options", ("auto", "auto")))

    def set_linear(self, backend: str | None = None, precision: str | None = None) -> None:
        """Choose the ``backend`` (``"torch"``: PyTorch's own float32 GEMM) and/or float32 ``precision``
        (None: keep) of every ELSA linear layer of the model (:func:`elsa_vision.layers.set_linear`)."""
        from .linear import set_linear

        set_linear(self, backend, precision)

    def set_attention(self, backend: str | None = None, precision: str | None = None) -> None:
        """Choose the ELSA ``backend`` and/or float32 ``precision`` (None: keep) of every ELSA attention layer
        of the model, its heads and poolers included (:func:`set_attention`). Both are checked first; errors
        name ``<model class>.set_attention``."""
        set_attention(self, backend, precision)

    def set_elsa_options(self, backend: str | None = None, precision: str | None = None) -> None:
        """Choose the float32 ``precision`` of every ELSA layer of the model and the ``backend`` of those
        whose kind accepts it (None: keep; :func:`set_elsa_options`). Both are checked first; errors name
        ``<model class>.set_elsa_options``."""
        set_elsa_options(self, backend, precision)
