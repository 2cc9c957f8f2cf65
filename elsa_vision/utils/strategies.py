"""Strategy factories whose arguments Hydra cannot express directly (sets of classes)."""

from __future__ import annotations

from collections.abc import Sequence

from hydra.utils import get_class
from lightning.pytorch.strategies import FSDPStrategy

__all__ = ["fsdp_strategy"]


def fsdp_strategy(
    wrap_modules: Sequence[str] = ("timm.models.vision_transformer.Block",),
    activation_checkpointing: bool = False,
    sharding_strategy: str = "FULL_SHARD",
    **kwargs,
) -> FSDPStrategy:
    """``FSDPStrategy`` that wraps every instance of ``wrap_modules`` (dotted class paths) in its own unit.

    Args:
        wrap_modules: transformer block classes (timm's ``Block`` for ViTs) wrapped as FSDP units.
        activation_checkpointing: recompute the activations of those blocks in backward.
        sharding_strategy: ``FULL_SHARD``, ``SHARD_GRAD_OP``, ``HYBRID_SHARD`` or ``NO_SHARD``.
        **kwargs: other ``FSDPStrategy`` arguments (``state_dict_type``, ``cpu_offload``, ...).
    """
    if not wrap_modules:
        raise ValueError("fsdp_strategy: wrap_modules must name at least one module class")
    classes = {get_class(path) for path in wrap_modules}
    kwargs.setdefault("use_orig_params", True)  # timm's per-parameter weight-decay groups need the originals
    return FSDPStrategy(
        auto_wrap_policy=classes,
        activation_checkpointing_policy=classes if activation_checkpointing else None,
        sharding_strategy=sharding_strategy,
        **kwargs,
    )
