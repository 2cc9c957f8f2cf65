"""ELSA kernels: the torch reference (the specification) and the Triton implementations."""

from __future__ import annotations

import functools
import os

import torch

from .eca import eca_masked_matmul, eca_tril_matmul
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
    "eca_masked_matmul",
    "eca_tril_matmul",
    "finalize",
    "identity_state",
    "log_sum_exp",
    "merge_depth",
    "merge_states",
    "scan_attention",
    "softmax_attention",
    "triton_available",
    "triton_runs_on",
    "FwdPlan",
    "plan",
    "elsa_fwd",
    "elsa_fwd_varlen",
    "BwdConfig",
    "elsa_bwd",
    "DecodePlan",
    "decode_plan",
    "elsa_decode",
    "choose_forward",
]

_FWD_EXPORTS = ("FwdPlan", "plan", "elsa_fwd", "elsa_fwd_varlen")
_BWD_EXPORTS = ("BwdConfig", "elsa_bwd")
_DECODE_EXPORTS = ("DecodePlan", "decode_plan", "elsa_decode", "choose_forward")


def __getattr__(name: str):
    # The Triton kernels are imported on first use, so that the package imports without Triton.
    if name in _FWD_EXPORTS:
        from . import fwd

        return getattr(fwd, name)
    if name in _BWD_EXPORTS:
        from . import bwd

        return getattr(bwd, name)
    if name in _DECODE_EXPORTS:
        from . import decode

        return getattr(decode, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (the kernels then run on CUDA, or on CPU under TRITON_INTERPRET=1)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def triton_runs_on(device: torch.device | str | None = None) -> bool:
    """True when the Triton kernels can run on tensors of ``device``: CUDA tensors (with a GPU), or CPU
    tensors under Triton's interpreter (``TRITON_INTERPRET=1``, Triton's own switch, which the test suite
    sets on CPU machines). ``None``: where this machine would put them (a GPU if it has one)."""
    if not triton_available():
        return False
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.is_available()
    if device.type != "cpu":
        return False
    import triton

    interpret = getattr(getattr(getattr(triton, "knobs", None), "runtime", None), "interpret", None)  # >= 3.4
    if interpret is not None:
        return bool(interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"
