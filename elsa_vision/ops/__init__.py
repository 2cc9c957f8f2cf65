"""Public functional ops (operator registration and autograd live here).

The Swin-v2 window op is ``elsa_vision.ops.window_attention.window_attention``; the FP32-accurate linear map
``elsa_linear`` and ``elsa_mlp`` (timm's GELU MLP, fused where nothing needs a gradient) are in
``ops.linear``. What the ops share: ``_library`` (operator declaration, the eager bypass of the dispatcher),
``checks`` (every input check and the options' vocabulary), ``numerics`` (the torch paths' CUDA matmul
precision).
"""

from .attention import BACKENDS, PRECISIONS, elsa_attention, elsa_attention_qkvpacked, elsa_attention_varlen
from .linear import LINEAR_BACKENDS, elsa_linear, elsa_mlp

__all__ = ["elsa_attention", "elsa_attention_qkvpacked", "elsa_attention_varlen", "elsa_linear", "elsa_mlp",
           "PRECISIONS", "BACKENDS", "LINEAR_BACKENDS"]
