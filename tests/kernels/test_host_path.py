"""The steady-state host path of the Triton ops (GPU): a fixed number of kernel launches per call, no
re-entry into Triton's JIT binder after warm-up (each launch goes straight to the compiled kernel), no host
synchronisation anywhere on the forward or backward path."""

from __future__ import annotations

import contextlib

import pytest
import torch

from benchmarks.common import launches
from elsa_vision import elsa_attention, elsa_attention_varlen
from elsa_vision.ops.window_attention import window_attention

pytestmark = pytest.mark.gpu


def _workloads():
    """Every Triton path: dense forward (fused and split), forward + backward with a bias gradient, the
    decode path, varlen inference and training, the window op (Swin v1 and v2) forward and backward."""
    dev = "cuda"
    q, k, v = (torch.randn(2, 4, 197, 64, device=dev, requires_grad=True) for _ in range(3))
    bias = torch.randn(1, 4, 197, 197, device=dev, requires_grad=True)
    qs = torch.randn(1, 2, 1, 64, device=dev)
    ks, vs = (torch.randn(1, 2, 8192, 64, device=dev) for _ in range(2))
    cu = torch.tensor([0, 50, 197, 394], dtype=torch.int32, device=dev)
    xv = torch.randn(394, 4, 64, device=dev, requires_grad=True)
    wq, wk, wv = (torch.randn(32, 3, 49, 32, device=dev, requires_grad=True) for _ in range(3))
    wb = torch.randn(3, 49, 49, device=dev, requires_grad=True)
    ls = torch.zeros(3, device=dev, requires_grad=True)
    mask = torch.zeros(4, 49, 49, device=dev)

    def dense_fwd():
        with torch.no_grad():
            elsa_attention(q, k, v)
            elsa_attention(q[:1, :1, :32], k[:1, :1], v[:1, :1])  # few programs: the split path

    def dense_fwd_bwd():
        out = elsa_attention(q, k, v, attn_bias=bias, causal=True)
        torch.autograd.grad(out, (q, k, v, bias), torch.ones_like(out))

    def decode():
        with torch.no_grad():
            elsa_attention(qs, ks, vs)

    def varlen():
        with torch.no_grad():
            elsa_attention_varlen(xv, xv, xv, cu, cu, 197, 197, causal=True)
        out = elsa_attention_varlen(xv, xv, xv, cu, cu, 197, 197, causal=True)
        torch.autograd.grad(out, xv, torch.ones_like(out))

    def window():
        for scale in (ls, None):
            out = window_attention(wq, wk, wv, scale, wb, mask)
            torch.autograd.grad(out, (wq, wk, wv, wb), torch.ones_like(out))

    return dict(dense_fwd=dense_fwd, dense_fwd_bwd=dense_fwd_bwd, decode=decode, varlen=varlen, window=window)


def test_kernel_launches_per_call():
    """At ViT-B's 8 x 12 x 197 (the fused forward): forward one launch, forward + backward three (forward,
    dQ with Delta, dK/dV); the window op's forward one."""
    q, k, v = (torch.randn(8, 12, 197, 64, device="cuda", requires_grad=True) for _ in range(3))

    def fwd():
        with torch.no_grad():
            elsa_attention(q, k, v)

    def fwd_bwd():
        out = elsa_attention(q, k, v)
        torch.autograd.grad(out, (q, k, v), out)

    assert launches(fwd, calls=3) == 1
    assert launches(fwd_bwd, calls=3) == 3
    wq, wk, wv = (torch.randn(32, 3, 49, 32, device="cuda") for _ in range(3))
    wb = torch.randn(3, 49, 49, device="cuda")
    with torch.no_grad():
        assert launches(lambda: window_attention(wq, wk, wv, None, wb, None), calls=3) == 1


def test_steady_state_does_not_enter_the_jit_binder(monkeypatch):
    import triton

    work = _workloads()
    for fn in work.values():  # compile and keep every kernel
        fn()
    torch.cuda.synchronize()

    def refuse(*args, **kwargs):
        raise AssertionError("a steady-state call went through triton's JITFunction.run")

    monkeypatch.setattr(triton.runtime.JITFunction, "run", refuse)
    for fn in work.values():
        fn()
    torch.cuda.synchronize()


def test_no_host_synchronisation():
    work = _workloads()
    for fn in work.values():
        fn()
    torch.cuda.synchronize()
    with _sync_errors():
        for fn in work.values():
            fn()
    torch.cuda.synchronize()


@contextlib.contextmanager
def _sync_errors():
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(old)
