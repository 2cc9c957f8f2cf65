"""elsa_vision: a vision model zoo on ELSA, exact softmax attention as a parallel prefix scan."""

from . import models  # noqa: F401  (registers the elsa_* names with timm)
from .layers import ElsaAttention
from .ops import elsa_attention

__version__ = "0.1.0"

__all__ = ["elsa_attention", "ElsaAttention", "__version__"]
