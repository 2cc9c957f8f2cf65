"""benchmarks/autotune.py: the forward's tile autotuner, kept next to the benchmarks that use it (the package
plans from fixed tables). On CPU: the candidate pruning, and that nothing is timed or installed there."""

import torch

from benchmarks import autotune
from elsa_vision.kernels import fwd
from elsa_vision.kernels.host import device_info

H100_SMEM = 232448  # bytes of shared memory per block on sm90


def test_fp16x3_candidates_avoid_narrow_value_tiles():
    # value tiles narrower than 64 take 32-key tiles (Triton 3.6 miscompiles wider ones with fp16x3)
    assert all(bn <= 32 for _, bn, _, _ in autotune.candidates(torch.float32, "fp16x3", 64, 32, H100_SMEM))
    assert any(bn == 64 for _, bn, _, _ in autotune.candidates(torch.float32, "fp16x3", 64, 64, H100_SMEM))


def test_candidates_fit_shared_memory_and_registers():
    for dtype, prec in ((torch.float32, "tf32x3"), (torch.float32, "ieee"), (torch.float32, "fp16x3"),
                        (torch.bfloat16, "none")):
        for bd in (32, 64, 128):
            elem = 4 if dtype == torch.float32 else 2
            cands = autotune.candidates(dtype, prec, bd, bd, H100_SMEM)
            for bm, bn, _w, st in cands:
                assert fwd._smem_bytes(bm, bn, bd, bd, st, elem) <= H100_SMEM
                assert bm * bd <= 128 * 128 and bm * bn <= 128 * 128
    assert autotune.candidates(torch.float32, "tf32x3", 64, 64, H100_SMEM)  # something to time
    assert not autotune.candidates(torch.float32, "tf32x3", 64, 64, 1024)  # nothing fits in 1 KiB


def test_autotune_off_cuda_returns_the_default_and_installs_nothing():
    q, k, v = (torch.randn(1, 2, 40, 32) for _ in range(3))
    key = fwd.tuning_key(q.dtype, 32, 32, False, False, q.device, "auto")
    _, cc, smem = device_info(q.device)
    default = fwd._default_config(q.dtype, key[-1], key[1], key[2], 40, cc, smem, 40,
                                  fwd.presplits(key[-1], 40, 40))
    assert autotune.autotune_fwd(q, k, v) == default
    assert key not in fwd._TUNED


def test_the_package_keeps_no_autotuner():
    assert not hasattr(fwd, "autotune_fwd") and not hasattr(fwd, "_candidates")
    assert "autotune_fwd" not in fwd.__all__
