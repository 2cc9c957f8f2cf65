"""The forward's autotuner: time candidate tile configurations on given inputs and install the fastest.

The package plans every launch from fixed tables of measured winners (``elsa_vision.kernels.fwd``'s
``_default_config``; how they were measured: ``docs/kernel_notes.md``, "Tiles"). This module is what the
benchmarks use to measure such tables again: ``python -m benchmarks.attention --tune`` ranks the candidates of
each case, ``--autotune dtype:D:precision`` tunes one key before timing. A config is installed with the
package's override hook ``fwd.set_config(fwd.tuning_key(...), config)``, which ``plan`` reads first.
"""

from __future__ import annotations

import math

import torch

from benchmarks.common import bench_ms
from elsa_vision.kernels import fwd
from elsa_vision.kernels.host import device_info
from elsa_vision.kernels.launch import interpreting

# Candidate (BLOCK_M, BLOCK_N, warps, stages) per family: the neighbourhood of the defaults that tuning on
# an H100 explored; pruned per call by shared memory and register footprint.
CANDIDATES = {
    "tc32": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 32, 4, 3), (64, 64, 4, 2), (128, 128, 8, 2),
             (64, 64, 4, 3)],
    "ieee": [(64, 64, 4, 1), (64, 64, 4, 2), (128, 32, 4, 1), (128, 64, 8, 1), (64, 128, 8, 1),
             (64, 32, 4, 2)],
    "fp16x3": [(128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 2), (128, 128, 8, 3), (128, 64, 4, 3),
               (64, 64, 4, 3), (128, 32, 4, 3), (64, 128, 4, 3)],
    "half": [(128, 64, 4, 3), (128, 128, 8, 3), (128, 64, 8, 3), (128, 128, 4, 3), (64, 64, 4, 3),
             (128, 64, 4, 4)],
}


def candidates(dtype, prec: str, bd: int, bdv: int, smem: int) -> list[tuple[int, int, int, int]]:
    """The candidates of ``dtype`` at precision ``prec`` and padded head dims ``bd`` / ``bdv`` that fit in
    ``smem`` bytes of shared memory, keep the accumulator in registers, and (``fp16x3``) avoid the value-tile
    widths Triton miscompiles (``fwd._fp16x3_safe``)."""
    elem = 4 if dtype == torch.float32 else 2
    family = "half" if dtype != torch.float32 else ("ieee" if prec == "ieee" else
                                                    "fp16x3" if prec == "fp16x3" else "tc32")
    out = []
    for bm, bn, w, st in CANDIDATES[family]:
        if fwd._smem_bytes(bm, bn, bd, bdv, st, elem) > smem:
            continue  # prune: does not fit in shared memory
        if bm * max(bd, bdv) > 128 * 128 or bm * bn > 128 * 128:
            continue  # prune: register tiles too large to keep the accumulator resident
        if prec == "fp16x3" and not fwd._fp16x3_safe(bn, bdv):
            continue
        out.append((bm, bn, w, st))
    return out


def autotune_fwd(q, k, v, attn_bias=None, key_padding_mask=None, causal=False, scale=None, precision="auto",
                 max_configs: int | None = None) -> tuple[int, int, int, int]:
    """Time the pruned candidate configs of the fused path on these inputs; install and return the winner.

    The winner is installed under ``fwd.tuning_key`` (dtype, padded head dims, causal, bias, arch,
    precision): later ``plan`` calls with the same key use it, until ``fwd.set_config(key, None)``. Under the
    CPU interpreter nothing is timed and the package's default is returned.
    """
    B, H, Nq, D = q.shape
    Dv = v.shape[3]
    key = fwd.tuning_key(q.dtype, D, Dv, causal, attn_bias is not None, q.device, precision)
    _, cc, smem = device_info(q.device)
    prec, bd, bdv = key[-1], key[1], key[2]
    default = fwd._default_config(q.dtype, prec, bd, bdv, Nq, cc, smem, k.shape[2],
                                  fwd.presplits(prec, k.shape[2], Nq), attn_bias is not None)
    if interpreting(fwd._fwd_kernel) or q.device.type != "cuda":
        return default
    cands = candidates(q.dtype, prec, bd, bdv, smem)
    if default not in cands:
        cands.insert(0, default)
    if max_configs is not None:
        cands = [default] + [c for c in cands if c != default][: max(0, max_configs - 1)]
    best, best_ms = default, math.inf
    for cfg in cands:
        fwd.set_config(key, cfg)
        try:
            ms = bench_ms(lambda: fwd.elsa_fwd(q, k, v, attn_bias, key_padding_mask, causal, scale, precision,
                                               partitions=1), warmup=5, rep=20)
        except Exception:  # noqa: BLE001 - a config the compiler rejects (out of resources) is skipped
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    fwd.set_config(key, best)
    return best
