"""Run plumbing of ``train.py`` / ``evaluate.py``: callbacks, strategies, instantiation, run directories.

The names below are imported on first use: ``train.py`` imports :mod:`.run_dirs` before Hydra configures
logging, and Lightning imported that early would keep its log records out of the run's log file.
"""

from __future__ import annotations

import importlib
from typing import Any

# public name -> the submodule defining it
_EXPORTS = {
    "EpochSeed": "callbacks",
    "RunCheckpoint": "callbacks",
    "progress_bar": "callbacks",
    "RunModelSummary": "callbacks",
    "StderrTQDMProgressBar": "callbacks",
    "CheckpointPathError": "run",
    "RunCSVLogger": "run",
    "SafeCheckpointIO": "run",
    "describe_net": "run",
    "extras": "run",
    "find_last_checkpoint": "run",
    "instantiate_callbacks": "run",
    "instantiate_loggers": "run",
    "plot_curves": "run",
    "print_json_line": "run",
    "quiet_logs": "run",
    "save_resolved_config": "run",
    "training_checkpoint_kind": "run",
    "ContextParallelStrategy": "strategies",
    "attach_context_parallel": "strategies",
    "build_context_parallel_mesh": "strategies",
    "fsdp_strategy": "strategies",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
