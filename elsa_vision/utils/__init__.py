"""Run plumbing for train.py / evaluate.py: callbacks, strategies, instantiation and run-directory helpers."""

from .callbacks import EpochSeed, RunCheckpoint, progress_bar
from .run import (
    RunCSVLogger,
    SafeCheckpointIO,
    extras,
    find_last_checkpoint,
    instantiate_callbacks,
    instantiate_loggers,
    plot_curves,
    print_json_line,
    save_resolved_config,
)
from .strategies import (
    ContextParallelStrategy,
    attach_context_parallel,
    build_context_parallel_mesh,
    fsdp_strategy,
)

__all__ = [
    "ContextParallelStrategy",
    "EpochSeed",
    "RunCSVLogger",
    "RunCheckpoint",
    "SafeCheckpointIO",
    "attach_context_parallel",
    "build_context_parallel_mesh",
    "extras",
    "find_last_checkpoint",
    "fsdp_strategy",
    "instantiate_callbacks",
    "instantiate_loggers",
    "plot_curves",
    "print_json_line",
    "progress_bar",
    "save_resolved_config",
]
