"""Shared test helpers: seeded inputs on the test device and errors against a float64 reference."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_ACCURATE = 1e-6  # relerr of FP32-accurate forward paths against float64
TF32_BOUND = 5e-3  # relerr of one TF32 pass
LOW_ATOL = {torch.float16: 1e-4, torch.bfloat16: 1e-3}  # atol of the FlashAttention-style half check


def relerr(out: torch.Tensor, ref: torch.Tensor) -> float:
    """‖out − ref‖ / ‖ref‖ computed in float64 (0 when both are 0)."""
    out, ref = out.double(), ref.double()
    den = ref.norm().item()
    num = (out - ref).norm().item()
    return num / den if den > 0 else num


def assert_nonfinite_like(out: torch.Tensor, ref: torch.Tensor, tol: float, some_finite: bool = True) -> None:
    """``out`` is NaN, ``+inf`` and ``-inf`` exactly where ``ref`` is (entry by entry) and within relerr
    ``tol`` of ``ref`` on the entries where ``ref`` is finite (which must hold some, unless not
    ``some_finite``)."""
    out = out.double()
    for name, f in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        got, want = f(out), f(ref)
        assert torch.equal(got, want), (f"{name} at {int(got.sum())} entries, the reference at "
                                        f"{int(want.sum())}; first differing index "
                                        f"{(got != want).nonzero()[0].tolist()}")
    fin = torch.isfinite(ref)
    assert bool(fin.any()) or not some_finite, "the reference has no finite entry"
    if fin.any():
        assert relerr(out[fin], ref[fin]) <= tol


def cuda_graph(fn):
    """``(graph, out)``: ``fn()`` run once on a side stream (compiling its kernels, filling the caches), then
    captured in a CUDA graph whose replays rewrite ``out``."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def randn(*shape, seed=0, dtype=torch.float32, scale=1.0, device=DEVICE):
    """Normal samples drawn in float64 on the CPU from ``seed``, then cast and moved to ``device``."""
    return (torch.randn(*shape, generator=gen(seed), dtype=torch.float64) * scale).to(dtype).to(device)


def fused_qkv_views(B, N, H, D, seed=0, dtype=torch.float32, device=DEVICE):
    """``q, k, v [B, H, N, D]`` as ViT's views of one fused qkv projection ``[B, N, 3, H, D]`` (token stride
    ``3 * H * D``, no copies), from ``seed``."""
    return randn(B, N, 3, H, D, seed=seed, dtype=dtype, device=device).permute(2, 0, 3, 1, 4).unbind(0)


def qkv(B, H, Nq, Nk, D, Dv=None, seed=0, dtype=torch.float32, scale=1.0, device=DEVICE):
    """``q [B, H, Nq, D]``, ``k [B, H, Nk, D]``, ``v [B, H, Nk, Dv]`` from seeds ``seed``, ``+1``, ``+2``."""
    Dv = D if Dv is None else Dv
    return (
        randn(B, H, Nq, D, seed=seed, dtype=dtype, scale=scale, device=device),
        randn(B, H, Nk, D, seed=seed + 1, dtype=dtype, scale=scale, device=device),
        randn(B, H, Nk, Dv, seed=seed + 2, dtype=dtype, scale=scale, device=device),
    )


def ref64(q, k, v, attn_bias=None, **kw):
    """The textbook softmax attention of the inputs in float64 (``kernels.reference.softmax_attention``)."""
    from elsa_vision.kernels.reference import softmax_attention

    bias = attn_bias.double() if attn_bias is not None else None
    return softmax_attention(q.double(), k.double(), v.double(), attn_bias=bias, **kw)


def scan64(q, k, v, attn_bias=None, **kw):
    """``(out, lse)`` of the inputs in float64 by the reference scan (``kernels.reference``)."""
    from elsa_vision.kernels.reference import scan_attention

    bias = attn_bias.double() if attn_bias is not None else None
    return scan_attention(q.double(), k.double(), v.double(), attn_bias=bias, return_lse=True, **kw)


def randomize_(model: torch.nn.Module, seed: int = 1234) -> torch.nn.Module:
    """Give norms, layer scales, biases and tokens non-trivial values so that every path shapes the output.

    timm initialises layer scale at 1e-5 (DINOv2), some norms/tokens to constants, and Swin v2
    zero-initialises its res-post-norm weights; with those values an attention bug could hide below the
    tolerance (or the attention branch vanish from the output)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("gamma") or (p.dim() == 1 and name.endswith("weight")):  # norms, layer scale
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            elif p.dim() == 1 and name.endswith("bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
            elif name.endswith(("cls_token", "reg_token", "pos_embed", "latent", "class_embedding",
                                "positional_embedding")):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def elsa_ops_seen():
    """A dispatch mode (``with elsa_ops_seen() as mode:``) that runs every operator and records in
    ``mode.ops`` the names of the ``elsa_vision`` ones, in call order: which operators a call reaches."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.namespace == "elsa_vision":
                self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    return Seen()


def device_reads():
    """A dispatch mode (``with device_reads() as mode:``) that runs every operator and records in
    ``mode.seen`` those that make the host wait for a CUDA device's queued work: a value read back
    (``.item()``, ``bool(t)``, ``torch.equal``) or an output whose size depends on the values (``unique``,
    ``nonzero``, boolean-mask indexing, ``bincount``). On the CPU the same calls run without a wait; this
    finds them there."""
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reads = {aten._local_scalar_dense, aten.is_nonzero, aten.item, aten.equal, aten._unique, aten._unique2,
             aten.unique_dim, aten.unique_consecutive, aten.nonzero, aten.masked_select, aten.bincount,
             aten.repeat_interleave}
    indexing = {aten.index, aten.index_put, aten.index_put_}

    def masks(args):
        for a in args:
            items = a if isinstance(a, (list, tuple)) else (a,)
            if any(isinstance(t, torch.Tensor) and t.dtype == torch.bool for t in items):
                return True
        return False

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            packet = func.overloadpacket
            if packet in reads or (packet in indexing and masks(args[1:2])):
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    return Reads()


NONFINITE_KINDS = ("causal", "bias", "bands", "kpm")


def nonfinite_case(kind: str, B, H, Nq, Nk, D, Dv=None, seed=0, dtype=torch.float32):
    """``(q, k, v, kw)``: random inputs whose key and value rows hold NaN and infinities at keys that the
    masks ``kw`` hide from some rows (the other rows see them: they become NaN, or non-finite in those value
    columns) or from every row. ``kind``: ``"causal"`` (bottom-right; keys seen by the last rows only),
    ``"bias"`` (``-inf`` bias columns: one key hidden from every row, one from the first half of the rows),
    ``"bands"`` (``-inf`` bias bands hiding a block of keys from all rows but the last two) or ``"kpm"`` (the
    padding mask hides the poisoned keys; causal too). A key some row sees holds NaN (not an infinity) in its
    key row, so that its logits are NaN under every precision (but for the last of them, whose value alone is
    non-finite: the rows that see only it are non-finite in three columns); the keys no row sees hold
    infinities too."""
    q, k, v = qkv(B, H, Nq, Nk, D, Dv, seed=seed, dtype=dtype)
    kw = {}
    some, every = [], []  # keys hidden from some rows / from every row
    if kind in ("causal", "kpm"):
        kw["causal"] = True
        shift = Nk - Nq
        some = [Nk - 1, Nk - 4, max(0, shift + (2 * Nq) // 3)]
    if kind == "kpm":
        every = [1, Nk // 2 + 1]
        kpm = torch.ones(B, Nk, dtype=torch.bool, device=DEVICE)
        kpm[:, every] = False
        kw["key_padding_mask"] = kpm
    if kind in ("bias", "bands"):
        bias = randn(1, H, Nq, Nk, seed=seed + 7, dtype=dtype)
        if kind == "bias":
            every, some = [Nk // 3], [Nk - 2]
            bias[..., every] = -math.inf
            bias[..., : Nq // 2, some] = -math.inf
        else:
            lo, hi = Nk // 4, Nk // 4 + 9
            bias[..., : Nq - 2, lo:hi] = -math.inf
            # rows 5-8 see the band only
            bias[..., 5:9, :] = torch.where(bias[..., 5:9, :] == -math.inf, 0.0, -math.inf)
            some = [lo, lo + 4, hi - 1]
        kw["attn_bias"] = bias
    k[..., some[:-1], 0] = math.nan
    for j, key in enumerate(every):
        k[..., key, j % D] = math.inf
        k[..., key, (j + 1) % D] = -math.inf
        k[..., key, (j + 2) % D] = math.nan
    for key in some + every:
        v[..., key, 0] = math.nan
        v[..., key, 1 % v.shape[-1]] = math.inf
        v[..., key, 2 % v.shape[-1]] = -math.inf
    return q, k, v, kw


def assert_lse(lse: torch.Tensor, ref: torch.Tensor) -> None:
    """float32 lse, -inf exactly where no key is visible, else |lse − ref| <= 1e-5·max(1, |ref|)."""
    assert lse.dtype == torch.float32
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(lse), fin), "lse must be -inf exactly where no key is visible"
    assert bool((lse[~fin] == -math.inf).all())
    if fin.any():
        err = (lse.double()[fin] - ref[fin]).abs().max().item()
        assert err <= 1e-5 * max(1.0, ref[fin].abs().max().item()), f"lse error {err}"


def compile_for_sm90(script: str):
    """Run ``script`` (which compiles Triton kernels for an H100 target and prints a JSON report as its last
    line) in a fresh interpreter without ``TRITON_INTERPRET``; return the parsed report. Skips when this
    Triton build ships no ``ptxas`` (no cubin can be made)."""
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton build ships no ptxas")
    env = {key: val for key, val in os.environ.items() if key != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd()] + sys.path)
    res = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def spill_stores(compiled) -> int | None:
    """Spill stores (``STL``) in the machine code of a kernel ``triton.compile`` built, where this Triton
    ships ``cuobjdump`` (else None); for the sm90 compile scripts of ``compile_for_sm90``."""
    import re
    import tempfile

    import triton

    cuobjdump = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(cuobjdump):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as fh:
        fh.write(compiled.asm["cubin"])
    try:
        sass = subprocess.run([cuobjdump, "-sass", fh.name], capture_output=True, text=True).stdout
    finally:
        os.unlink(fh.name)
    return len(re.findall(r"\bSTL", sass))


def bomb_png(path, width: int = 100_000, height: int = 100_000):
    """A PNG of a few dozen bytes whose header declares ``width x height`` pixels (no pixel data follows)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)  # 8-bit greyscale
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))
    return path


def forged_tiff(path, width: int = 100_000, height: int = 100_000):
    """A TIFF of a few hundred bytes (one zlib strip of a 64 x 64 image) whose tags declare ``width x height``
    8-bit pixels: decoding it would allocate the declared size."""
    import numpy as np
    import tifffile

    tifffile.imwrite(path, np.zeros((64, 64), np.uint8), compression="zlib", rowsperstrip=64)
    with tifffile.TiffFile(path, mode="r+b") as tf:
        tags = tf.pages[0].tags
        tags["ImageWidth"].overwrite(width)
        tags["ImageLength"].overwrite(height)
        tags["RowsPerStrip"].overwrite(height)
    return path


def forged_npy(path, shape=(500_000, 500_000), dtype="<f4"):
    """A ``.npy`` header declaring ``shape`` (931 GiB by default) followed by no data."""
    import numpy as np

    with open(path, "wb") as f:
        np.lib.format.write_array_header_2_0(f, {"descr": dtype, "fortran_order": False, "shape": shape})
    return path


def spawn_ranks(work, world: int, backend: str, out_dir: str, *args, weights_only: bool = True) -> list:
    """Run ``work(rank, out_dir, *args) -> results`` in ``world`` spawned processes that share one
    ``backend`` process group (``"gloo"``, or ``"nccl"`` with rank ``r`` on ``cuda:r``); returns the
    results of every rank, passed back through ``torch.save`` files in ``out_dir`` (``weights_only``: how
    they are read). ``work`` must be a module-level function (the processes import it)."""
    import torch.multiprocessing as mp

    mp.spawn(_rank_main, args=(work, world, backend, out_dir, args), nprocs=world, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=weights_only) for r in range(world)]


def _rank_main(rank, work, world, backend, out_dir, args):
    import torch.distributed as dist

    kw = {}
    if backend == "nccl":
        torch.cuda.set_device(rank)
        kw["device_id"] = torch.device("cuda", rank)
    init = f"file://{os.path.join(out_dir, 'init')}"
    dist.init_process_group(backend, init_method=init, rank=rank, world_size=world, **kw)
    try:
        torch.save(work(rank, out_dir, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def emulate_cuda_autocast_layer_norm(monkeypatch) -> list:
    """Emulate on the CPU CUDA autocast's ``layer_norm`` policy (computed in float32, returned as float32; the
    CPU's keeps bfloat16) by a float32 ``F.layer_norm``, and record the dtypes of the q, k, v every
    ``elsa_attention`` call checks. Returns the list the ``(q, k, v)`` dtypes go to."""
    import torch.nn.functional as F

    from elsa_vision.ops import attention as ops_attention

    layer_norm = F.layer_norm
    check = ops_attention.check_attention_inputs
    seen = []

    def layer_norm_fp32(x, shape, weight=None, bias=None, eps=1e-5):
        weight, bias = (None if t is None else t.float() for t in (weight, bias))
        return layer_norm(x.float(), shape, weight, bias, eps)

    def record(q, k, v, *a):
        seen.append((q.dtype, k.dtype, v.dtype))
        return check(q, k, v, *a)

    monkeypatch.setattr(ops_attention, "check_attention_inputs", record)
    monkeypatch.setattr(F, "layer_norm", layer_norm_fp32)
    return seen
