"""Public functional ops (custom-op registration and autograd live here)."""

from .attention import BACKENDS, PRECISIONS, elsa_attention, elsa_attention_varlen

__all__ = ["elsa_attention", "elsa_attention_varlen", "PRECISIONS", "BACKENDS"]
