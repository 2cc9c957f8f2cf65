"""Every ELSA attention module, with timm's (or torch's) parameter names, and what they share.

:class:`ElsaModule` is the mixin of all of them (the ``backend`` / ``precision`` options, the in-place swap
``convert``); :func:`set_attention` changes the options of every ELSA layer of a model, and
:class:`ElsaModel`, the mixin of every ELSA model, is where its ``set_attention`` method lives.
"""

from .attention import ElsaAttention, mask_to_bias
from .attention_pool import ElsaAttentionPoolLatent
from .elsa_module import ElsaModel, ElsaModule, check_attention_options, set_attention
from .multihead_attention import ElsaMultiheadAttention
from .rope import RotaryPositionEmbedding2D
from .sdpa import ElsaAttentionRope, ElsaEvaAttention, sdpa_override
from .window_attention import ElsaSwinV2WindowAttention, ElsaSwinWindowAttention

__all__ = ["ElsaAttention", "ElsaAttentionPoolLatent", "ElsaAttentionRope", "ElsaEvaAttention", "ElsaModel",
           "ElsaModule", "ElsaMultiheadAttention", "ElsaSwinWindowAttention", "ElsaSwinV2WindowAttention",
           "RotaryPositionEmbedding2D", "check_attention_options", "mask_to_bias", "sdpa_override",
           "set_attention"]
