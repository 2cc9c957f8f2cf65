"""ELSA kernels: the torch reference (the specification) and the Triton implementations."""

from __future__ import annotations

import functools

from .reference import (
    ElsaState,
    block_state,
    finalize,
    identity_state,
    log_sum_exp,
    merge_depth,
    merge_states,
    scan_attention,
    softmax_attention,
)

__all__ = [
    "ElsaState",
    "block_state",
    "finalize",
    "identity_state",
    "log_sum_exp",
    "merge_depth",
    "merge_states",
    "scan_attention",
    "softmax_attention",
    "triton_available",
    "FwdPlan",
    "plan",
    "elsa_fwd",
    "elsa_fwd_varlen",
]

_FWD_EXPORTS = ("FwdPlan", "plan", "elsa_fwd", "elsa_fwd_varlen")


def __getattr__(name: str):
    # The Triton kernels are imported on first use, so that the package imports without Triton.
    if name in _FWD_EXPORTS:
        from . import fwd

        return getattr(fwd, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (the kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
