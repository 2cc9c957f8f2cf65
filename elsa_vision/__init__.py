"""elsa_vision: a vision model zoo on ELSA, exact softmax attention as a parallel prefix scan."""

from . import models  # noqa: F401  (registers the elsa_* names with timm)
from .layers import ElsaAttention, ElsaLinear
from .models import ElsaCLIPVision, ElsaHSIViT, ElsaSwinV2, ElsaVGGT, ElsaViT
from .ops import elsa_attention, elsa_attention_qkvpacked, elsa_attention_varlen, elsa_linear
from .patching import (
    PatchReport,
    patch_attention,
    patch_model,
    patch_swin_attention,
    patch_vit_attention,
    sdpa_override,
)

__version__ = "0.1.0"

__all__ = [
    # operators
    "elsa_attention", "elsa_attention_qkvpacked", "elsa_attention_varlen", "elsa_linear",
    # layers and models
    "ElsaAttention", "ElsaLinear", "ElsaViT", "ElsaSwinV2", "ElsaHSIViT", "ElsaCLIPVision", "ElsaVGGT",
    # swapping ELSA layers into other models
    "PatchReport", "patch_attention", "patch_model", "patch_vit_attention", "patch_swin_attention",
    "sdpa_override",
    "__version__",
]
