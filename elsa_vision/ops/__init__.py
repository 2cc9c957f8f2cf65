"""Public functional ops (operator registration and autograd live here).

The Swin-v2 window op is ``elsa_vision.ops.window_attention.window_attention``.
"""

from .attention import BACKENDS, PRECISIONS, elsa_attention, elsa_attention_varlen

__all__ = ["elsa_attention", "elsa_attention_varlen", "PRECISIONS", "BACKENDS"]
