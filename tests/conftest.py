"""Test-session setup: CPU machines run the Triton kernels in the interpreter; `gpu` tests need CUDA."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must precede the first `import triton` (kernels then run interpreted on CPU tensors).
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
