"""FP32-accurate linear layers: ``ElsaLinear`` (an ``nn.Linear``) and ``ElsaPatchConv2d`` (a patchifying
``nn.Conv2d``), both computed by :func:`elsa_vision.ops.linear.elsa_linear`, and ``ElsaMlp`` (timm's GELU
``Mlp``, computed by :func:`elsa_vision.ops.linear.elsa_mlp`).

Each *is* the torch module it replaces (same parameters and state-dict keys, ``isinstance`` stays true) and
is made from one in place (:meth:`ElsaModule.convert`, or a model walk: :data:`LINEAR_SWAPS`) or built from
the torch constructor. On CUDA float32 outside autocast its products run on tensor cores at the layer's
``precision`` (``"auto"``: FP32-accurate); everything else -- half precisions, autocast, the CPU,
``precision="ieee"`` / ``"tf32"``, ``backend="torch"`` -- is the torch module's own computation.
:func:`set_linear` sets the options of every linear layer of a model.
"""

from __future__ import annotations

import torch.nn.functional as F
from timm.layers import Linear as TimmLinear
from timm.layers import Mlp
from timm.layers.activations import GELU as TimmGELU
from timm.models import register_notrace_module
from torch import Tensor, nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.modules.module import _global_forward_hooks, _global_forward_pre_hooks

from ..ops.checks import check_linear_inputs, check_mlp_inputs
from ..ops.linear import LINEAR_BACKENDS, elsa_linear, elsa_mlp, linear_on_route, linear_route, mlp_on_route
from .elsa_module import ElsaModule, set_elsa_options

__all__ = ["ElsaLinear", "ElsaLinearModule", "ElsaMlp", "ElsaPatchConv2d", "LINEAR_SWAPS", "linear_of",
           "set_linear"]


class ElsaLinearModule(ElsaModule):
    """Mixin of the ELSA linear layers: they accept ``elsa_linear``'s backends, and a model walk leaves alone,
    without a word, the modules of their class they do not compute (:meth:`unsupported`: a convolution that
    is no patch embedding, an MLP with another activation)."""

    backends = LINEAR_BACKENDS

    @classmethod
    def replaces(cls, module: nn.Module) -> bool:
        return cls.unsupported(module) is None


@register_notrace_module  # an FX leaf: its forward routes on dtype and device
class ElsaLinear(ElsaLinearModule, nn.Linear):
    """``nn.Linear`` computed by ``elsa_linear`` (``backend`` / ``precision`` attributes, see there).

    ``ElsaLinear(in_features, out_features, bias=True, device=None, dtype=None, *, backend="auto",
    precision="auto")``; ``ElsaLinear.convert(linear)`` turns an ``nn.Linear`` into one in place.
    """

    _converts = nn.Linear

    def __init__(self, in_features: int, out_features: int, bias: bool = True, device=None, dtype=None, *,
                 backend: str = "auto", precision: str = "auto") -> None:
        self.check_options(backend, precision)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self.backend, self.precision = backend, precision

    def forward(self, x: Tensor) -> Tensor:
        return _on_layer_route(self, x, (self.weight, self.bias), elsa_linear, check_linear_inputs,
                               linear_on_route)


def _on_layer_route(layer: ElsaLinearModule, x: Tensor, params: tuple, public, check, on_route) -> Tensor:
    """``public(x, *params)`` (``elsa_linear`` or ``elsa_mlp``) with ``layer``'s options, its inputs checked
    (``check``) only where the GEMM runs, then ``on_route`` (its body on the route): on the torch route (half
    precisions, autocast, the CPU) ``F.linear`` checks its operands itself, as in ``nn.Linear``'s forward,
    and the layer's options were checked when set (a layer call's host time: docs/kernel_notes.md, "Fewer
    Python frames and launches per layer")."""
    if not isinstance(x, Tensor):  # the public function's refusal
        return public(x, *params, precision=layer.precision, backend=layer.backend)
    route = linear_route(x, layer.precision, layer.backend)
    if route != "torch":
        check(x, *params, layer.precision, layer.backend)
    return on_route(x, *params, layer.precision, route)


@register_notrace_module
class ElsaPatchConv2d(ElsaLinearModule, nn.Conv2d):
    """A patchifying ``nn.Conv2d`` (kernel size equal to its stride, no padding, dilation or groups: the patch
    embedding of a ViT or Swin) computed as one ``elsa_linear`` over the flattened patches.

    The image is cut into ``stride``-sized patches (rows and columns past the last whole patch are dropped,
    as the convolution drops them), each patch flattened in the weight's (channel, row, column) order and
    multiplied by the weight viewed as ``[out_channels, in_channels * kh * kw]``. The output is
    ``[B, out_channels, H // kh, W // kw]``, stored channels-last (a view), which a patch embedding's
    ``flatten(2).transpose(1, 2)`` turns into tokens without a copy. Other convolutions are no patch
    embedding: a model walk leaves them alone (:meth:`ElsaLinearModule.replaces`).
    """

    _converts = nn.Conv2d

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        if tuple(module.kernel_size) != tuple(module.stride):
            return f"kernel_size {tuple(module.kernel_size)} != stride {tuple(module.stride)}"
        if module.padding not in ("valid", (0, 0)) or module.padding_mode != "zeros":
            return f"padding {module.padding!r}"
        if tuple(module.dilation) != (1, 1) or module.groups != 1:
            return f"dilation {tuple(module.dilation)}, groups {module.groups}"
        return None

    def forward(self, x: Tensor) -> Tensor:
        if x.dim() != 4 or linear_route(x, self.precision, self.backend) == "torch":
            return super().forward(x)
        B, C, H, W = x.shape
        kh, kw = self.kernel_size
        ho, wo = H // kh, W // kw
        patches = (x[:, :, :ho * kh, :wo * kw].reshape(B, C, ho, kh, wo, kw).permute(0, 2, 4, 1, 3, 5)
                   .reshape(B * ho * wo, C * kh * kw))
        out = elsa_linear(patches, self.weight.reshape(self.out_channels, -1), self.bias,
                          precision=self.precision, backend=self.backend)
        return out.view(B, ho, wo, self.out_channels).permute(0, 3, 1, 2)


@register_notrace_module
class ElsaMlp(ElsaLinearModule, Mlp):
    """timm's ``Mlp`` with exact GELU and no norm: ``fc2(drop1(gelu(fc1(x))))`` then ``drop2``, its two
    products as one :func:`elsa_mlp` call (fused on CUDA float32 where nothing needs a gradient: the hidden
    activation never written in float32) when ``fc1`` and ``fc2`` are :class:`ElsaLinear` layers with this
    layer's options, dropout is off and no forward hook waits on ``fc1``, ``act`` or ``fc2``; otherwise timm's
    forward, layer by layer. Made from an ``Mlp`` in place (same submodules and state-dict keys); a model walk
    converts its ``fc1`` / ``fc2`` too. MLPs with another activation (tanh GELU, QuickGELU, ...), a hidden
    norm or 1x1 convolutions are left alone (:meth:`ElsaLinearModule.replaces`)."""

    _converts = Mlp

    @classmethod
    def unsupported(cls, module: nn.Module) -> str | None:
        act = module.act
        if not (type(act) is TimmGELU or (type(act) is nn.GELU and act.approximate == "none")):
            return f"activation {act!r}"
        if not isinstance(module.norm, nn.Identity):
            return f"hidden norm {type(module.norm).__name__}"
        if not (isinstance(module.fc1, nn.Linear) and isinstance(module.fc2, nn.Linear)):
            return f"{type(module.fc1).__name__} layers"
        return None

    def forward(self, x: Tensor) -> Tensor:
        fc1, fc2 = self.fc1, self.fc2
        options = (self.backend, self.precision)
        if (type(fc1) is ElsaLinear and type(fc2) is ElsaLinear
                and (fc1.backend, fc1.precision) == options == (fc2.backend, fc2.precision)
                and (not self.training or (self.drop1.p == 0 and self.drop2.p == 0))
                and not _hooked(fc1, self.act, fc2)):
            return _on_layer_route(self, x, (fc1.weight, fc1.bias, fc2.weight, fc2.bias), elsa_mlp,
                                   check_mlp_inputs, mlp_on_route)
        return super().forward(x)


def _hooked(*modules: nn.Module) -> bool:
    """Whether calling any of ``modules`` would run a forward hook (their own or a global one): a layer that
    computes them in one operator must call them one by one then, as the hooks' owner expects."""
    return bool(_global_forward_hooks or _global_forward_pre_hooks) or any(
        m._forward_hooks or m._forward_pre_hooks for m in modules)


# The linear kind of a model walk (``layers.elsa_module.swap_layers``; ``patching.SWAPS``): the torch and timm
# classes matched exactly (``NonDynamicallyQuantizableLinear`` is ``nn.MultiheadAttention.out_proj``; timm's
# ``Linear`` differs from ``nn.Linear`` under TorchScript only). An ``Mlp`` comes before its ``fc1`` / ``fc2``
# in the walk: it becomes an ``ElsaMlp``, then they become ``ElsaLinear`` layers.
LINEAR_SWAPS: dict[type, type[ElsaModule]] = {
    nn.Linear: ElsaLinear,
    NonDynamicallyQuantizableLinear: ElsaLinear,
    TimmLinear: ElsaLinear,
    nn.Conv2d: ElsaPatchConv2d,
    Mlp: ElsaMlp,
}


def linear_of(layer: nn.Linear, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``x @ weight.T + bias`` computed as ``layer`` computes: with its options through ``elsa_linear`` when
    it is an :class:`ElsaLinear`, by ``F.linear`` otherwise. For the projections a module forms from its
    linear layer's parameters (Swin-v2's qkv with its own bias, ``nn.MultiheadAttention``'s ``in_proj``
    beside its ``out_proj``): they follow the layer, swapped or not."""
    if isinstance(layer, ElsaLinear):
        return _on_layer_route(layer, x, (weight, bias), elsa_linear, check_linear_inputs, linear_on_route)
    return F.linear(x, weight, bias)


def set_linear(model: nn.Module, backend: str | None = None, precision: str | None = None,
               who: str | None = None) -> int:
    """Set ``backend`` and/or ``precision`` (None: keep) on every ELSA linear layer of ``model``
    (:func:`set_elsa_options` for :class:`ElsaLinearModule`; errors naming ``who``, by default
    ``"<model class>.set_linear"``). ``backend="torch"`` gives PyTorch's own float32 GEMM back. Returns how
    many layers were set."""
    return set_elsa_options(model, backend, precision, who or f"{type(model).__name__}.set_linear",
                            layers=ElsaLinearModule)
