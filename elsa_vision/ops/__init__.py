"""Public functional ops (operator registration and autograd live here).

The Swin-v2 window op is ``elsa_vision.ops.window_attention.window_attention``. What the ops share:
``_library`` (operator declaration, the eager bypass of the dispatcher), ``checks`` (every input check and
the options' vocabulary), ``numerics`` (the torch paths' accumulation dtype and CUDA matmul precision).
"""

from .attention import BACKENDS, PRECISIONS, elsa_attention, elsa_attention_varlen

__all__ = ["elsa_attention", "elsa_attention_varlen", "PRECISIONS", "BACKENDS"]
