"""Public functional ops (custom-op registration and autograd live here)."""

from .attention import BACKENDS, PRECISIONS, elsa_attention

__all__ = ["elsa_attention", "PRECISIONS", "BACKENDS"]
