"""The launch plumbing every kernel family shares: the per-signature program cache and ``Launch``'s refusal
of a kernel whose arguments it cannot launch directly."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from elsa_vision.kernels.launch import Launch, ProgramCache  # noqa: E402


@triton.jit
def _scale_kernel(X, Y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


@triton.jit
def _constexpr_first_kernel(X, BLOCK: tl.constexpr, Y, n):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n), mask=offs < n)


def test_program_cache_builds_once_per_signature_and_evicts_the_oldest():
    built = []

    def build(x, y, tag):
        built.append((tuple(x.shape), tag))
        return object()

    cache = ProgramCache(maxsize=2)
    a, b = torch.zeros(3), torch.zeros(5)
    first = cache(build, (a, None), ("t",))
    assert cache(build, (torch.ones(3), None), ("t",)) is first  # same shape, strides, dtype, options
    assert cache(build, (a, None), ("u",)) is not first  # other options: another program
    cache(build, (b, None), ("t",))  # a third signature evicts the least recently built
    assert len(cache) == 2 and built == [((3,), "t"), ((3,), "u"), ((5,), "t")]
    cache(build, (a, None), ("t",))
    assert built[-1] == ((3,), "t")  # rebuilt after eviction


def test_launch_runs_a_kernel_laid_out_as_it_expects():
    x = torch.randn(37, device="cuda" if torch.cuda.is_available() else "cpu")
    y = torch.empty_like(x)
    Launch(_scale_kernel, (3,), (37, 2.0), dict(BLOCK=16), num_warps=1)(x, y)
    torch.testing.assert_close(y, 2 * x)


def test_launch_refuses_a_kernel_whose_constexprs_are_not_last():
    with pytest.raises(TypeError, match="must list its tensors, then its 2 scalars, then every constexpr"):
        Launch(_constexpr_first_kernel, (3,), (37, 2.0), dict(BLOCK=16), num_warps=1)
    with pytest.raises(TypeError, match=r"then every constexpr \['BLOCK', 'EXTRA'\]"):
        Launch(_scale_kernel, (3,), (37,), dict(BLOCK=16, EXTRA=1), num_warps=1)
