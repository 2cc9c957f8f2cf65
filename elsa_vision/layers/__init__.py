"""Every ELSA layer, with timm's (or torch's) parameter names, and what they share.

:class:`ElsaModule` is the mixin of all of them (the ``backend`` / ``precision`` options checked against the
backends the layer's kind accepts, the in-place swap ``convert``, the patching protocol ``from_module``);
:class:`ElsaAttentionModule` the mixin of the attention layers, :class:`ElsaLinearModule` of the
FP32-accurate linear layers. :func:`swap_layers` is the one walk that puts ELSA layers into a model.
:func:`set_elsa_options` changes the options of every ELSA layer of a model (a backend only where the layer
accepts it), :func:`set_attention` those of its attention layers, :func:`set_linear` those of its linear
layers; :class:`ElsaModel`, the mixin of every ELSA model, holds them as methods.
"""

from .attention import ElsaAttention, mask_to_bias
from .attention_pool import ElsaAttentionPoolLatent
from .elsa_module import (
    ElsaAttentionModule,
    ElsaModel,
    ElsaModule,
    PatchReport,
    check_attention_options,
    check_layer_options,
    set_attention,
    set_elsa_options,
    swap_layers,
)
from .linear import (
    LINEAR_SWAPS,
    ElsaLinear,
    ElsaLinearModule,
    ElsaMlp,
    ElsaPatchConv2d,
    linear_of,
    set_linear,
)
from .multihead_attention import ElsaMultiheadAttention
from .rope import RotaryPositionEmbedding2D
from .sdpa import ElsaAttentionRope, ElsaEvaAttention, sdpa_override
from .window_attention import ElsaSwinV2WindowAttention, ElsaSwinWindowAttention

__all__ = [
    "LINEAR_SWAPS", "ElsaAttention", "ElsaAttentionModule", "ElsaAttentionPoolLatent", "ElsaAttentionRope",
    "ElsaEvaAttention", "ElsaLinear", "ElsaLinearModule", "ElsaMlp", "ElsaModel", "ElsaModule",
    "ElsaMultiheadAttention",
    "ElsaPatchConv2d", "ElsaSwinWindowAttention", "ElsaSwinV2WindowAttention", "PatchReport",
    "RotaryPositionEmbedding2D", "check_attention_options", "check_layer_options", "linear_of",
    "mask_to_bias", "sdpa_override", "set_attention", "set_elsa_options", "set_linear", "swap_layers",
]
