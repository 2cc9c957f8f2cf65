"""Context-parallel ELSA over gloo with spawned CPU processes equals single-process attention."""

import math
import tempfile

import pytest
import torch
import torch.distributed as dist

from elsa_vision.distributed import context_parallel_attention, gather_sequence, shard_ranges, shard_sequence
from elsa_vision.kernels.reference import softmax_attention
from tests.helpers import spawn_ranks


def _run_case(rank, group, cfg):
    torch.manual_seed(1234)  # every rank draws the same global tensors
    B, H, N, D, Dv = cfg["B"], cfg["H"], cfg["N"], cfg["D"], cfg["Dv"]
    q = torch.randn(B, H, N, D, dtype=torch.float64)
    k = torch.randn(B, H, N, D, dtype=torch.float64)
    v = torch.randn(B, H, N, Dv, dtype=torch.float64)
    do = torch.randn(B, H, N, Dv, dtype=torch.float64)
    kpm = torch.rand(B, N) > 0.25 if cfg["mask"] else None
    # bias=True: a relative-position-like bias with a row per query (each rank passes its rows);
    # bias="row": one row for every query ([B, 1, 1, N], every rank passes it whole).
    bias = None
    if cfg["bias"] == "row":
        bias = torch.randn(B, 1, 1, N, dtype=torch.float64)
    elif cfg["bias"]:
        bias = torch.randn(1, H, N, N, dtype=torch.float64)
    if cfg.get("poison"):
        bias[..., 3] = -math.inf  # key 3 is hidden from every row
    dtype = getattr(torch, cfg.get("dtype", "float64"))
    q, k, v, do = (t.to(dtype).double() for t in (q, k, v, do))  # the reference sees the rounded inputs
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = softmax_attention(*leaves, causal=cfg["causal"], key_padding_mask=kpm, attn_bias=bias)
    ref.backward(do)
    if cfg.get("poison"):  # whatever the hidden key holds, the ring gives the clean result (its grads 0)
        k, v = k.clone(), v.clone()
        k[..., 3, :3] = torch.tensor([math.inf, -math.inf, math.nan])
        v[..., 3, :3] = torch.tensor([math.nan, math.inf, -math.inf])

    layout = cfg["layout"]
    shard = lambda t, dim=-2: shard_sequence(t, group, dim=dim, layout=layout)  # noqa: E731
    local = [shard(t).to(dtype).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(
        *local, seq_len=N, group=group, causal=cfg["causal"], layout=layout, backend="torch",
        key_padding_mask=None if kpm is None else shard(kpm, dim=-1),
        attn_bias=None if bias is None else (bias if cfg["bias"] == "row" else shard(bias)))
    out.backward(shard(do).to(dtype))
    assert out.dtype == dtype and all(t.grad.dtype == dtype for t in local)
    full = gather_sequence(out.detach(), N, group, layout=layout).double()
    errs = {"out": ((full - ref).norm() / ref.norm()).item()}
    for name, loc, leaf in zip("qkv", local, leaves):
        g = gather_sequence(loc.grad, N, group, layout=layout).double()
        errs["d" + name] = ((g - leaf.grad).norm() / leaf.grad.norm()).item()
    return errs


def _work(rank, out_dir, cases):
    import elsa_vision.distributed

    # the backward's dK/dV in pieces of 5 keys (whole blocks: test_context_parallel_models.py), and every
    # ring pass's transfers in 5-8 pieces of 2-3 rows (the shards hold 10-21)
    elsa_vision.distributed.KEY_PIECE = 5
    elsa_vision.distributed.RING_PIECE_ROWS = 2
    results = {}
    for i, case in enumerate(cases):
        w = case["world"]
        group = dist.new_group(list(range(w)))  # collective: every rank calls it
        if rank < w:
            cfg = dict(B=2, H=2, D=8, Dv=6, **{k: v for k, v in case.items() if k != "world"})
            results[i] = _run_case(rank, group, cfg)
    return results


CASES = [
    dict(world=2, N=37, causal=False, layout="contiguous", mask=False, bias=False),
    dict(world=3, N=37, causal=True, layout="contiguous", mask=True, bias=False),
    dict(world=2, N=41, causal=True, layout="zigzag", mask=False, bias=True),
    dict(world=4, N=53, causal=True, layout="zigzag", mask=True, bias=False),
    dict(world=3, N=29, causal=False, layout="zigzag", mask=True, bias=True),
    dict(world=3, N=31, causal=True, layout="zigzag", mask=True, bias="row"),
    dict(world=2, N=23, causal=False, layout="contiguous", mask=False, bias="row"),
    dict(world=3, N=29, causal=True, layout="zigzag", mask=True, bias=True, poison=True),
    # bf16 inputs: the ring accumulates in float32 and hands back bf16 outputs and gradients
    dict(world=2, N=37, causal=False, layout="contiguous", mask=False, bias=False, dtype="bfloat16"),
    dict(world=3, N=41, causal=True, layout="zigzag", mask=True, bias=True, dtype="bfloat16"),
]


def test_ring_attention_equals_single_process():
    """2-4 gloo ranks (one spawn, sub-groups per case); token counts not divisible by the world size."""
    world = max(c["world"] for c in CASES)
    with tempfile.TemporaryDirectory() as tmp:
        checked = 0
        for r, results in enumerate(spawn_ranks(_work, world, "gloo", tmp, CASES)):
            for i, case in enumerate(CASES):
                if r >= case["world"]:
                    continue
                # float64 throughout: the ring only reorders sums: ‖out − ref‖/‖ref‖ <= 1e-12, grads likewise;
                # bf16 inputs against float64 of the same rounded inputs: <= 3e-3, about two bf16 roundings
                # (one rounding of the bf16 outputs and grads measures 1.5e-3 to 1.8e-3).
                bound = 3e-3 if case.get("dtype") == "bfloat16" else 1e-12
                for name, err in results[i].items():
                    assert err <= bound, f"case {case}, rank {r}, {name}: {err:.3e}"
                    checked += 1
        assert checked == 4 * sum(c["world"] for c in CASES)


def test_shard_ranges_cover_the_sequence_once():
    for layout in ("contiguous", "zigzag"):
        for n, world in ((37, 3), (8, 4), (5, 2), (100, 7)):
            seen = []
            for r in range(world):
                for a, b in shard_ranges(n, world, r, layout):
                    seen.extend(range(a, b))
            assert sorted(seen) == list(range(n))
            sizes = [sum(b - a for a, b in shard_ranges(n, world, r, layout)) for r in range(world)]
            assert max(sizes) - min(sizes) <= (1 if layout == "contiguous" else 2)
    assert shard_ranges(10, 2, 0, "zigzag") == [(0, 3), (8, 10)]
    with pytest.raises(ValueError, match="layout"):
        shard_ranges(10, 2, 0, "striped")
    with pytest.raises(ValueError, match="rank"):
        shard_ranges(10, 2, 2)


def test_requires_process_group():
    q = torch.randn(1, 1, 4, 4)
    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    with pytest.raises(RuntimeError, match="process group"):
        context_parallel_attention(q, q, q, seq_len=4)
