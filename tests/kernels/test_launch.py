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


def _sm90() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.gpu
@pytest.mark.skipif(not _sm90(), reason="the Hopper GEMM's TMA launches need an sm90 GPU")
def test_gpu_tma_launch_matches_tritons_own_launcher_at_new_and_reused_addresses():
    """The Hopper GEMM's launch passes its TMA descriptors to the compiled launcher itself (Triton 3.6),
    encoding each address once: calls at new addresses and at one seen before give what Triton's own
    wrapper gives, bit for bit, and the product is FP32-accurate (relerr against float64 < 1e-6)."""
    from elsa_vision.kernels import gemm

    gemm._PROGRAMS.clear()
    torch.manual_seed(0)
    w = torch.randn(200, 264, device="cuda")
    xs = [torch.randn(300, 264, device="cuda") for _ in range(3)]
    fast = [gemm.gemm(x, w) for x in (*xs, xs[0])]
    (program,) = gemm._PROGRAMS._programs.values()
    tma = program.main._direct
    if triton.__version__.startswith("3.6."):
        assert tma is not None and tma.positions is not None, "Triton 3.6's wrapper was not recognised"
    if tma is None:
        pytest.skip(f"Triton {triton.__version__}: its own launcher wrapper runs the TMA launches")
    assert 3 + 1 <= len(tma.maps) <= 3 + 4  # x's three addresses, one to four of w's parts (new per call)
    program.main._direct = None  # Triton's wrapper from here on
    try:
        slow = [gemm.gemm(x, w) for x in (*xs, xs[0])]
    finally:
        program.main._direct = tma
    for f, s, x in zip(fast, slow, (*xs, xs[0])):
        assert torch.equal(f, s)
        ref = x.double() @ w.double().T
        assert ((f.double() - ref).norm() / ref.norm()).item() < 1e-6


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled launches need CUDA")
def test_gpu_plain_launch_calls_the_compiled_launcher_as_triton_does():
    """A kernel without descriptors is launched through its compiled launcher itself (Triton 3.6), past
    Triton's Python wrapper: the same results as through the wrapper, on the current stream."""
    torch.manual_seed(0)
    x = torch.randn(1000, device="cuda")
    launch = Launch(_scale_kernel, (8,), (1000, 3.0), dict(BLOCK=128), num_warps=4)  # 8 x 128 >= 1000
    y0 = torch.empty_like(x)
    launch(x, y0)  # the first call compiles through Triton
    direct = launch._direct
    if triton.__version__.startswith("3.6."):
        assert direct is not None and direct.positions is None, "Triton 3.6's launcher was not recognised"
    if direct is None:
        pytest.skip(f"Triton {triton.__version__}: its own launcher wrapper runs the launches")
    side = torch.cuda.Stream()
    ys = []
    with torch.cuda.stream(side):
        for _ in range(3):  # direct launches on a side stream, each into a fresh output
            ys.append(torch.empty_like(x))
            torch.cuda._sleep(1000)
            launch(x, ys[-1])
    launch._direct = None
    try:
        slow = torch.empty_like(x)
        launch(x, slow)  # Triton's wrapper
    finally:
        launch._direct = direct
    torch.cuda.synchronize()
    for y in (y0, *ys):
        assert torch.equal(y, slow) and torch.equal(y, 3.0 * x)
