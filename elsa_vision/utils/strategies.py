"""Strategies: factories whose arguments Hydra cannot express directly (sets of classes), and context
parallelism over DDP (a data x context 2-D mesh of the ranks)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from hydra.utils import get_class
from lightning.fabric.utilities.apply_func import apply_to_collection
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn

__all__ = [
    "ContextParallelMesh",
    "ContextParallelStrategy",
    "attach_context_parallel",
    "build_context_parallel_mesh",
    "fsdp_strategy",
]


class ContextParallelMesh:
    """The ranks as a ``dp_size x cp_size`` grid: global rank ``r = dp_rank * cp_size + cp_rank``.

    The ``cp_size`` ranks of one row share every image (its tokens split among them, so consecutive ranks --
    the GPUs of one node -- do the ring traffic); the ``dp_size`` rows see different images.
    ``cp_group`` is this rank's row; ``cp_root`` the global rank of the row's first member.
    """

    def __init__(self, cp_size: int, cp_group: Any, world_size: int, rank: int) -> None:
        self.cp_size = cp_size
        self.cp_group = cp_group
        self.world_size = world_size
        self.dp_size = world_size // cp_size
        self.dp_rank, self.cp_rank = divmod(rank, cp_size)
        self.cp_root = self.dp_rank * cp_size

    def __repr__(self) -> str:
        return (f"ContextParallelMesh(dp={self.dp_size} x cp={self.cp_size}, dp_rank={self.dp_rank}, "
                f"cp_rank={self.cp_rank})")


def build_context_parallel_mesh(cp_size: int) -> ContextParallelMesh:
    """Create the context-parallel groups of the initialised default process group (a collective: every
    rank calls it). ``cp_size`` must divide the world size."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("build_context_parallel_mesh needs an initialised torch.distributed process group")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(cp_size, int) or cp_size < 1 or world % cp_size:
        raise ValueError(f"cp_size must be a positive divisor of the world size {world}, got {cp_size!r}")
    mine = None
    for row in range(world // cp_size):
        group = dist.new_group(list(range(row * cp_size, (row + 1) * cp_size)))
        if row == rank // cp_size:
            mine = group
    return ContextParallelMesh(cp_size, mine, world, rank)


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


class ContextParallelStrategy(DDPStrategy):
    """DDP over all ranks, with every image's tokens split over groups of ``cp_size`` consecutive ranks.

    After the process group is up it builds the mesh (:func:`build_context_parallel_mesh`) and calls
    ``set_context_parallel(cp_group, layout=layout)`` on every module of the LightningModule that has it
    (``ElsaViT``). The distributed sampler splits the data over the ``dp_size`` rows only, and every batch is
    broadcast from the row's first rank, so the ranks of a row see identical images whatever their random
    augmentation. DDP averages gradients over all ``dp_size * cp_size`` ranks, which for the context-parallel
    model (see ``ElsaViT.set_context_parallel``) is the gradient of the mean loss over the rows.

    Args:
        cp_size: ranks per image (divides ``devices * num_nodes``); 1 is plain DDP.
        layout: ``"contiguous"`` or ``"zigzag"`` token shards.
        **kwargs: ``DDPStrategy`` arguments.
    """

    strategy_name = "ddp_context_parallel"

    def __init__(self, cp_size: int = 2, layout: str = "contiguous", **kwargs: Any) -> None:
        from ..distributed import LAYOUTS

        if not isinstance(cp_size, int) or cp_size < 1:
            raise ValueError(f"ContextParallelStrategy: cp_size must be a positive integer, got {cp_size!r}")
        if layout not in LAYOUTS:
            raise ValueError(f"ContextParallelStrategy: unknown layout {layout!r}; expected one of {LAYOUTS}")
        super().__init__(**kwargs)
        self.cp_size = cp_size
        self.layout = layout
        self.mesh: ContextParallelMesh | None = None

    def setup_distributed(self) -> None:
        super().setup_distributed()
        world = self.num_nodes * self.num_processes
        if world % self.cp_size:
            raise ValueError(f"ContextParallelStrategy: cp_size={self.cp_size} must divide the number of "
                             f"processes (devices x num_nodes = {world})")
        self.mesh = build_context_parallel_mesh(self.cp_size)

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        world = self.num_nodes * self.num_processes
        return {"num_replicas": world // self.cp_size, "rank": self.global_rank // self.cp_size}

    def setup(self, trainer) -> None:
        count = attach_context_parallel(self.lightning_module, self.mesh.cp_group, self.layout)
        rank_zero_info(
            f"context parallel: {self.mesh}, {self.layout} layout, {count} module(s) split their tokens")
        super().setup(trainer)

    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        batch = super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)
        if self.cp_size == 1:
            return batch
        mesh = self.mesh

        def bcast(t: Tensor) -> Tensor:
            t = t.contiguous()
            dist.broadcast(t, mesh.cp_root, group=mesh.cp_group)
            return t

        return apply_to_collection(batch, Tensor, bcast)


def attach_context_parallel(module: nn.Module, group: Any, layout: str = "contiguous") -> int:
    """Call ``set_context_parallel(group, layout=layout)`` on every submodule that has it; returns how many.

    Raises ``ValueError`` when none has it (the model cannot split its tokens)."""
    count = 0
    for m in module.modules():
        setter = getattr(m, "set_context_parallel", None)
        if callable(setter):
            setter(group, layout=layout)
            count += 1
    if count == 0:
        raise ValueError(f"context parallelism: {type(module).__name__} has no submodule with "
                         f"set_context_parallel (e.g. an ElsaViT backbone)")
    return count
