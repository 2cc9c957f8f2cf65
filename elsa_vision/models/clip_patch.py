"""Turn the image tower of a whole open_clip model into ELSA, in place, keeping the text tower.

``elsa_clip(model)`` replaces every ``nn.MultiheadAttention`` inside ``model.visual`` (the blocks'
self-attention and the CoCa attentional poolers' cross-attention) by
:class:`elsa_vision.layers.ElsaMultiheadAttention` and its linear layers and patch embedding by the
FP32-accurate ELSA linear layers (:data:`elsa_vision.layers.LINEAR_SWAPS`), in place (same module objects and
parameters), so the state dict, optimiser references and ``encode_image`` / ``encode_text`` / ``forward``
keep working unchanged.
"""

from __future__ import annotations

from torch import nn

from ..layers.elsa_module import swap_layers
from ..layers.linear import LINEAR_SWAPS
from ..layers.multihead_attention import ElsaMultiheadAttention
from ..ops.attention import check_options

__all__ = ["elsa_clip"]


def elsa_clip(model: nn.Module, *, backend: str = "auto", precision: str = "auto") -> dict:
    """Replace the attention of ``model.visual`` with ELSA (in place, weight preserving).

    Args:
        model: an open_clip ``CLIP`` / ``CustomTextCLIP`` / ``CoCa`` (anything with a ``visual`` module whose
            attention is ``nn.MultiheadAttention``), or an image tower itself.
        backend, precision: ``elsa_attention`` settings of the new modules (``precision`` is the linear
            layers' too).

    Returns:
        ``{"replaced": n, "modules": [qualified names under visual], "skipped": [(name, type)], "linear": m,
        "text_tower": "unchanged"}``. ``skipped`` lists attention modules that are not
        ``nn.MultiheadAttention`` (open_clip's custom ``Attention`` of qk-norm / scaled-cosine towers), left
        as they are; ``linear``: the linear layers and patch embeddings made ELSA linear layers.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"elsa_clip: model must be an nn.Module, got {type(model).__name__}")
    check_options("elsa_clip", backend, precision)
    visual = getattr(model, "visual", model)
    replaced, skipped = [], []
    for name, parent in list(visual.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if isinstance(child, ElsaMultiheadAttention):
                continue
            if isinstance(child, nn.MultiheadAttention):
                ElsaMultiheadAttention.convert(child, backend=backend, precision=precision)
                replaced.append(full)
            elif type(child).__name__ == "Attention" and hasattr(child, "in_proj_weight"):
                skipped.append((full, type(child).__name__))
    if (
        not replaced
        and not skipped
        and not any(isinstance(m, ElsaMultiheadAttention) for m in visual.modules())
    ):
        raise ValueError(
            f"elsa_clip: found no nn.MultiheadAttention in the image tower "
            f"({type(visual).__name__}); expected an open_clip ViT tower"
        )
    linear = swap_layers(visual, LINEAR_SWAPS, precision=precision, who="elsa_clip").total
    return {"replaced": len(replaced), "modules": replaced, "skipped": skipped, "linear": linear,
            "text_tower": "unchanged"}
