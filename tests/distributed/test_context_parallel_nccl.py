"""Context parallelism over NCCL on two GPUs: the ring with the Triton kernels and a context-parallel
ElsaViT equal one device.

Needs two CUDA devices (one process each, ``cuda:<rank>``). The CPU suite covers the same code over gloo
(``test_context_parallel.py``, ``test_context_parallel_models.py``); only this file sends CUDA tensors through
NCCL and runs the compiled kernels inside the ring.
"""

import tempfile

import pytest
import torch
import torch.distributed as dist

from tests.helpers import relerr, spawn_ranks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL)"),
]

# (seq_len, head dim, causal, layout, padding mask, bias): odd token counts, not divisible by 2
RING_CASES = [
    dict(N=197, D=64, causal=False, layout="contiguous", mask=False, bias=False),
    dict(N=785, D=72, causal=True, layout="zigzag", mask=True, bias=False),
    dict(N=1031, D=128, causal=False, layout="contiguous", mask=True, bias=True),
    dict(N=3137, D=32, causal=True, layout="zigzag", mask=False, bias=False),
]
# bf16 only: shards of 2,050 / 2,049 keys, so that on sm90 a rank's own shard takes the Hopper forward's
# partial results (``fwd.HOPPER_MIN_KEYS``) and the visiting pieces the generic kernel's, merged together
HOPPER_CASE = dict(N=4099, D=64, causal=False, layout="contiguous", mask=False, bias=False)


def _ring_case(group, case, dtype, precision):
    """Forward and backward of the ring vs a float64 reference on this device; relative errors."""
    from elsa_vision.distributed import context_parallel_attention, gather_sequence, shard_sequence
    from elsa_vision.kernels.reference import softmax_attention

    dev = torch.device("cuda", torch.cuda.current_device())
    g = torch.Generator(device="cpu").manual_seed(case["N"] * 7 + case["D"])  # same inputs on every rank
    B, H, N, D = 2, 3, case["N"], case["D"]
    q, k, v, do = (torch.randn(B, H, N, D, generator=g).to(dev) for _ in range(4))
    kpm = (torch.rand(B, N, generator=g) > 0.25).to(dev) if case["mask"] else None
    bias = torch.randn(1, H, N, N, generator=g).to(dev) if case["bias"] else None
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = softmax_attention(*leaves, causal=case["causal"], key_padding_mask=kpm,
                            attn_bias=None if bias is None else bias.double())
    ref.backward(do.double())
    layout = case["layout"]
    shard = lambda t, dim=-2: shard_sequence(t, group, dim=dim, layout=layout)  # noqa: E731
    local = [shard(t.to(dtype)).requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(
        *local, seq_len=N, group=group, causal=case["causal"], layout=layout, backend="triton",
        precision=precision, key_padding_mask=None if kpm is None else shard(kpm, dim=-1),
        attn_bias=None if bias is None else shard(bias.to(dtype)),
    )
    errs = {"out": relerr(gather_sequence(out.detach(), N, group, layout=layout), ref.detach())}
    if bias is None:  # the ring's bias is forward-only
        out.backward(shard(do.to(dtype)))
        for name, loc, leaf in zip("qkv", local, leaves):
            errs["d" + name] = relerr(gather_sequence(loc.grad, N, group, layout=layout), leaf.grad)
    return errs


def _vit_case(group):
    """ElsaViT (Triton backend, FP32 'ieee') split over the group vs the same model on one device."""
    from elsa_vision.models.vit import ElsaViT

    dev = torch.device("cuda", torch.cuda.current_device())
    kw = dict(img_size=(200, 152), patch_size=8, embed_dim=96, depth=2, num_heads=3, num_classes=7,
              attn_backend="triton", attn_precision="ieee")  # 25 x 19 patches + class token = 476 tokens
    torch.manual_seed(5)
    ref = ElsaViT(**kw).to(dev).eval()
    torch.manual_seed(5)
    model = ElsaViT(**kw, context_parallel_group=group, context_parallel_layout="zigzag").to(dev).eval()
    x = torch.randn(2, 3, 200, 152, generator=torch.Generator().manual_seed(9)).to(dev)
    with torch.no_grad():
        want_feats = ref.forward_features(x)
        want = ref.forward_head(want_feats)
        local = model.forward_features(x)
        got = model.forward_head(local)
        feats = model.gather_tokens(local)
    return {"logits": relerr(got, want), "features": relerr(feats, want_feats)}


def _hopper_routed() -> bool:
    """Whether a rank's own shard of ``HOPPER_CASE`` (bf16) takes the Hopper forward as a partial result."""
    from elsa_vision.kernels.fwd import fwd_program

    n, D = -(-HOPPER_CASE["N"] // 2), HOPPER_CASE["D"]
    dev = torch.device("cuda", torch.cuda.current_device())
    t = torch.zeros(2, 3, n, D, dtype=torch.bfloat16, device=dev)
    return fwd_program(t, t, t, None, None, False, D ** -0.5, "auto", partial=True).hopper is not None


def _work(rank, out_dir):
    import elsa_vision.distributed

    # the backward's dK/dV of blocks over 512 keys in pieces (1031 and 3137 tokens), smaller blocks whole
    elsa_vision.distributed.KEY_PIECE = 512
    elsa_vision.distributed.RING_PIECE_ROWS = 128  # the ring's transfers in pieces at 1031 and 3137 tokens
    group = dist.group.WORLD
    return {"ring_fp32": [_ring_case(group, c, torch.float32, "ieee") for c in RING_CASES],
            "ring_bf16": [_ring_case(group, c, torch.bfloat16, "auto") for c in RING_CASES + [HOPPER_CASE]],
            "hopper_routed": _hopper_routed(), "vit": _vit_case(group)}


@pytest.fixture(scope="module")
def spawned():
    with tempfile.TemporaryDirectory() as tmp:
        yield spawn_ranks(_work, 2, "nccl", tmp)


def test_ring_fp32_over_nccl_equals_float64(spawned):
    for r, res in enumerate(spawned):
        for case, errs in zip(RING_CASES, res["ring_fp32"]):
            for name, err in errs.items():  # FP32 'ieee' vs float64
                assert err <= 2e-6, (r, case, name, err)


def test_ring_bf16_over_nccl_equals_float64(spawned):
    for r, res in enumerate(spawned):
        if torch.cuda.get_device_capability() == (9, 0):  # HOPPER_CASE ran the Hopper forward's partials
            assert res["hopper_routed"], r
        for case, errs in zip(RING_CASES + [HOPPER_CASE], res["ring_bf16"]):
            for name, err in errs.items():  # bf16 inputs (8 mantissa bits) vs float64 of the fp32 inputs
                assert err <= 2e-2, (r, case, name, err)


def test_context_parallel_vit_over_nccl_equals_one_device(spawned):
    for r, res in enumerate(spawned):
        for name, err in res["vit"].items():  # same FP32 kernels, sums over the ring in another order
            assert err <= 1e-5, (r, name, err)
