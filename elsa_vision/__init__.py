"""elsa_vision: a vision model zoo on ELSA, exact softmax attention as a parallel prefix scan."""

from .layers import ElsaAttention
from .ops import elsa_attention, elsa_attention_varlen

__version__ = "0.1.0"

__all__ = ["elsa_attention", "elsa_attention_varlen", "ElsaAttention", "__version__"]
