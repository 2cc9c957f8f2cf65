"""Public functional ops (custom-op registration and autograd live here)."""

from .attention import BACKENDS, PRECISIONS, elsa_attention, elsa_attention_varlen
from .window_attention import window_attention

__all__ = ["elsa_attention", "elsa_attention_varlen", "window_attention", "PRECISIONS", "BACKENDS"]
