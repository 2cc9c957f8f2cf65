"""Context-parallel ElsaViT, training step, mesh and high-resolution inference over gloo equal one process.

One spawn of 4 CPU ranks runs every check (spawning is the slow part); 2- and 3-rank cases use sub-groups.
"""

import json
import os
import subprocess
import sys
import tempfile

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from elsa_vision.distributed import ContextParallel
from elsa_vision.models.vit import ElsaViT
from tests.helpers import relerr, spawn_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Odd token counts, not divisible by the group size: 40x24 image, 8x8 patches = 15 patch tokens.
VIT_CASES = [
    dict(world=2, layout="contiguous", class_token=True, reg_tokens=2, global_pool="token"),  # 17 tokens
    dict(world=3, layout="zigzag", class_token=False, reg_tokens=0, global_pool="avg"),  # 15
    dict(world=3, layout="contiguous", class_token=True, reg_tokens=1, global_pool="avgmax"),  # 17
    dict(world=2, layout="zigzag", class_token=False, reg_tokens=0, global_pool="map"),  # 15
    dict(
        world=3, layout="contiguous", class_token=True, reg_tokens=0, global_pool="avg", no_embed_class=True
    ),
    # gradient checkpointing: every block's forward, ring included, runs again in the backward pass
    dict(world=2, layout="zigzag", class_token=True, reg_tokens=0, global_pool="token",
         grad_checkpointing=True),
]


# The ring with the Triton kernels runs here on CPU machines, where the suite runs Triton in its interpreter
# (tests/conftest.py). A machine with CUDA compiles Triton for the GPU instead: CPU tensors cannot go through
# the kernels and gloo cannot send CUDA ones.
TRITON_RING_ON_GLOO = not torch.cuda.is_available()


def _tiny_vit(case, **kw):
    torch.manual_seed(7)  # same weights on every rank and in the reference
    kw = dict(
        img_size=(40, 24),
        patch_size=8,
        in_chans=3,
        embed_dim=32,
        depth=2,
        num_heads=4,
        num_classes=5,
        class_token=case["class_token"],
        reg_tokens=case["reg_tokens"],
        global_pool=case["global_pool"],
        no_embed_class=case.get("no_embed_class", False),
        attn_backend="torch",
        **kw,
    )
    return ElsaViT(**kw).double()


def _vit_case(group, case):
    torch.manual_seed(11)
    x = torch.randn(3, 3, 40, 24, dtype=torch.float64)
    target = torch.randn(3, 5, dtype=torch.float64)
    ref = _tiny_vit(case)
    ref_feats = ref.forward_features(x)
    ref_logits = ref.forward_head(ref_feats)
    F.mse_loss(ref_logits, target).backward()

    model = _tiny_vit(case, context_parallel_group=group, context_parallel_layout=case["layout"])
    model.set_grad_checkpointing(case.get("grad_checkpointing", False))
    local = model.forward_features(x)
    logits = model.forward_head(local)
    F.mse_loss(logits, target).backward()
    world = dist.get_world_size(group)
    errs = {
        "logits": relerr(logits.detach(), ref_logits.detach()),
        "features": relerr(model.gather_tokens(local).detach(), ref_feats.detach()),
        "local_len": float(local.shape[1] != model.context_parallel.local_len()),
    }
    grads, ref_grads = [], []
    for p, rp in zip(model.parameters(), ref.parameters()):
        g = p.grad.clone()
        dist.all_reduce(g, group=group)
        grads.append(g / world)
        ref_grads.append(rp.grad)
    errs["grads"] = relerr(torch.cat([g.flatten() for g in grads]),
                           torch.cat([g.flatten() for g in ref_grads]))
    errs["grad_worst_param"] = max(relerr(g, r) for g, r in zip(grads, ref_grads) if r.norm() > 0)
    return errs


def _train_step_case(rank):
    """DDP x CP mesh (dp=2, cp=2): one step of the digits classifier equals the single-process step."""
    from elsa_vision.tasks import create_backbone
    from elsa_vision.utils import attach_context_parallel, build_context_parallel_mesh

    mesh = build_context_parallel_mesh(2)
    out = {
        "mesh": (
            mesh.dp_size,
            mesh.dp_rank,
            mesh.cp_rank,
            mesh.cp_root,
            dist.get_world_size(mesh.cp_group),
            dist.get_rank(mesh.cp_group),
        )
    }
    net_kw = dict(
        model_name="elsa_vit_tiny_patch16_224",
        num_classes=10,
        img_size=32,
        patch_size=8,
        in_chans=1,
        embed_dim=48,
        depth=2,
        num_heads=4,
        mlp_ratio=2.0,
        class_token=False,
        global_pool="avg",
        attn_backend="torch",
    )
    torch.manual_seed(3)
    net = create_backbone(**net_kw).double()
    torch.manual_seed(5)
    images = torch.randn(2, 4, 1, 32, 32, dtype=torch.float64)  # one batch of 4 per data-parallel row
    labels = torch.randint(0, 10, (2, 4))
    attach_context_parallel(net, mesh.cp_group, "zigzag")
    loss = F.cross_entropy(net(images[mesh.dp_rank]), labels[mesh.dp_rank], label_smoothing=0.1)
    loss.backward()
    for p in net.parameters():  # what DDP does: average over all dp x cp ranks
        dist.all_reduce(p.grad)
        p.grad /= dist.get_world_size()
    torch.manual_seed(3)
    ref = create_backbone(**net_kw).double()
    losses = [F.cross_entropy(ref(images[d]), labels[d], label_smoothing=0.1) for d in range(2)]
    (sum(losses) / 2).backward()
    out["loss"] = abs(loss.item() - losses[mesh.dp_rank].item()) / abs(losses[mesh.dp_rank].item())
    g = torch.cat([p.grad.flatten() for p in net.parameters()])
    gr = torch.cat([p.grad.flatten() for p in ref.parameters()])
    out["grads"] = relerr(g, gr)
    return out


def _inference_case(group):
    from elsa_vision.inference.highres import Plan, run_context_parallel, run_plan

    case = dict(class_token=True, reg_tokens=0, global_pool="token")
    model = _tiny_vit(case).eval()
    torch.manual_seed(13)
    img = torch.randn(3, 40, 24, dtype=torch.float64)
    single = run_plan(model, img, Plan("whole", 0.0, None))
    res = run_context_parallel(model, img, group, layout="zigzag")
    assert model.context_parallel is None  # restored
    return {
        "features": relerr(res.features, single.features),
        "prefix": relerr(res.prefix, single.prefix),
        "logits": relerr(res.logits, single.logits),
        "mode": res.plan.mode,
    }


def _load_benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "cp_bench", os.path.join(ROOT, "benchmarks", "context_parallel.py")
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve annotations through sys.modules
    spec.loader.exec_module(mod)
    return mod


def _triton_ring_case(group):
    """The ring with the Triton kernels (interpreted on CPU): FP32 'ieee' vs a float64 reference."""
    import elsa_vision.distributed
    from elsa_vision.distributed import context_parallel_attention, gather_sequence, shard_sequence
    from elsa_vision.kernels.reference import softmax_attention

    torch.manual_seed(21)
    N = 37
    q, k, v, do = (torch.randn(1, 2, N, 16) for _ in range(4))
    kpm = torch.rand(1, N) > 0.2
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = softmax_attention(*leaves, causal=True, key_padding_mask=kpm)
    ref.backward(do.double())
    shard = lambda t, dim=-2: shard_sequence(t, group, dim=dim, layout="zigzag")  # noqa: E731
    local = [shard(t).requires_grad_() for t in (q, k, v)]
    rows, elsa_vision.distributed.RING_PIECE_ROWS = elsa_vision.distributed.RING_PIECE_ROWS, 4
    try:  # the transfers in pieces of 4-5 rows (18-19 rows per rank)
        out = context_parallel_attention(*local, seq_len=N, group=group, causal=True, layout="zigzag",
                                         backend="triton", precision="ieee",
                                         key_padding_mask=shard(kpm, dim=-1))
        out.backward(shard(do))
    finally:
        elsa_vision.distributed.RING_PIECE_ROWS = rows
    errs = {"out": relerr(gather_sequence(out.detach(), N, group, layout="zigzag").double(), ref.detach())}
    for name, loc, leaf in zip("qkv", local, leaves):
        errs["d" + name] = relerr(gather_sequence(loc.grad, N, group, layout="zigzag").double(), leaf.grad)
    return errs


def _work(rank, tmp, cli_args):
    results = {"vit": {}}
    for i, case in enumerate(VIT_CASES):
        group = dist.new_group(list(range(case["world"])))  # collective: every rank calls it
        if rank < case["world"]:
            results["vit"][i] = _vit_case(group, case)
    results["train"] = _train_step_case(rank)
    pair = dist.new_group([0, 1])
    if rank < 2:
        results["inference"] = _inference_case(pair)
        if TRITON_RING_ON_GLOO:
            results["triton"] = _triton_ring_case(pair)
    from elsa_vision.inference.image import main

    results["cli"] = main(cli_args)  # all 4 ranks, the default group; rank 0 writes
    bench = _load_benchmark()
    results["bench"] = bench.main(
        [
            "--device",
            "cpu",
            "--quick",
            "--cases",
            "attention",
            "--repeats",
            "1",
            "--out",
            os.path.join(tmp, "bench.csv"),
        ]
    )
    return results


@pytest.fixture(scope="module")
def spawned():
    from PIL import Image

    from elsa_vision.inference.image import main

    with tempfile.TemporaryDirectory() as tmp:
        rng = np.random.default_rng(0)
        Image.fromarray(rng.integers(0, 255, (48, 80), dtype=np.uint8)).save(os.path.join(tmp, "im.png"))
        weights = os.path.join(tmp, "w.safetensors")
        main(["--model", "elsa_vit_tiny_patch16_224", "--save-random-weights", weights, "--num-classes", "7"])
        common = [
            "--model",
            "elsa_vit_tiny_patch16_224",
            "--weights",
            weights,
            "--input",
            os.path.join(tmp, "im.png"),
            "--img-size",
            "48",
            "80",
            "--device",
            "cpu",
        ]
        single = main(common + ["--out", os.path.join(tmp, "single")])
        cp_args = common + ["--out", os.path.join(tmp, "cp"), "--context-parallel", "--cp-layout", "zigzag"]
        results = spawn_ranks(_work, 4, "gloo", tmp, cp_args, weights_only=False)
        from safetensors.torch import load_file

        files = {k: load_file(os.path.join(tmp, k, "features.safetensors")) for k in ("single", "cp")}
        reports = {k: json.load(open(os.path.join(tmp, k, "report.json"))) for k in ("single", "cp")}
        preds = {k: json.load(open(os.path.join(tmp, k, "prediction.json"))) for k in ("single", "cp")}
        yield dict(results=results, files=files, reports=reports, preds=preds, single=single)


def test_vit_logits_features_and_grads_equal_single_process(spawned):
    checked = 0
    for r, res in enumerate(spawned["results"]):
        for i, case in enumerate(VIT_CASES):
            if r >= case["world"]:
                continue
            errs = res["vit"][i]
            assert errs.pop("local_len") == 0.0
            # float64: the ring and the pooled all-reduce only reorder sums: <= 1e-10 relative.
            for name, err in errs.items():
                assert err <= 1e-10, f"case {case}, rank {r}, {name}: {err:.3e}"
                checked += 1
    assert checked == 4 * sum(c["world"] for c in VIT_CASES)


def test_mesh_and_training_step_equal_single_process(spawned):
    for r, res in enumerate(spawned["results"]):
        t = res["train"]
        dp_rank, cp_rank = divmod(r, 2)
        assert t["mesh"] == (2, dp_rank, cp_rank, 2 * dp_rank, 2, cp_rank)
        # float64 loss and DDP-averaged gradients of a dp=2 x cp=2 step vs the mean loss on one process
        assert t["loss"] <= 1e-10, (r, t["loss"])
        assert t["grads"] <= 1e-10, (r, t["grads"])


@pytest.mark.skipif(not TRITON_RING_ON_GLOO, reason="a CUDA machine: gloo cannot send CUDA tensors, and the "
                    "ring's Triton path on CUDA needs NCCL and two GPUs")
def test_ring_with_triton_kernels(spawned):
    for r in range(2):
        for name, err in spawned["results"][r]["triton"].items():  # FP32 'ieee' vs float64: <= 1e-6
            assert err <= 1e-6, (r, name, err)


def test_inference_engine_equals_single_process(spawned):
    for r in range(2):
        res = spawned["results"][r]["inference"]
        assert res.pop("mode") == "context_parallel"
        for name, err in res.items():  # float64 model, features returned as float32: <= 1e-6
            assert err <= 1e-6, (r, name, err)


def test_inference_cli_context_parallel_writes_rank0_outputs_equal_single(spawned):
    results = spawned["results"]
    assert results[0]["cli"]["mode"] == "context_parallel" and results[0]["cli"]["tokens"] == 3 * 5 + 1
    assert all(res["cli"] == {"rank": r, "written": False} for r, res in enumerate(results) if r)
    a, b = spawned["files"]["cp"], spawned["files"]["single"]
    for key in b:  # float32 model over 4 gloo ranks vs one process: <= 2e-6 relative
        assert relerr(a[key], b[key]) <= 2e-6, key
    pa = torch.tensor(spawned["preds"]["cp"]["probabilities"])
    pb = torch.tensor(spawned["preds"]["single"]["probabilities"])
    assert relerr(pa, pb) <= 2e-6
    cp_report = spawned["reports"]["cp"]
    assert cp_report["context_parallel"]["world_size"] == 4
    assert len(cp_report["context_parallel"]["peak_memory_mb_per_rank"]) == 4


def test_benchmark_quick_mode_runs_and_agrees(spawned):
    rows = spawned["results"][0]["bench"]
    assert [r["case"] for r in rows] == [c.name for c in _load_benchmark().QUICK["attention"]]
    for r in rows:  # float32 ring over 4 ranks vs one device: <= 1e-6 relative
        assert r["world"] == 4 and r["relerr_vs_1dev"] <= 1e-6, r
        assert r["fwd_s_cp"] > 0 and r["fwdbwd_s_cp"] > 0 and r["fwd_speed_up"] > 0
    assert all(res["bench"] == [] for res in spawned["results"][1:])


def test_bad_arguments():
    with pytest.raises(ValueError, match="context_parallel_layout"):
        ElsaViT(img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2, context_parallel_layout="ring")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="process group"):
            ElsaViT(
                img_size=16, patch_size=8, embed_dim=8, depth=1, num_heads=2, context_parallel_group=object()
            )
        with pytest.raises(ValueError, match="group"):
            ContextParallel(None)


def test_train_cli_context_parallel_equals_single_process(tmp_path):
    """`python train.py trainer=cp` on 2 CPU processes: one step's train/val loss equal one process."""
    env = dict(
        os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""), OMP_NUM_THREADS="1"
    )
    # Both runs draw the same first batch: the epoch-seeded sampler is used as is (no distributed
    # re-shuffle) and the strategy broadcasts every batch from the group's first rank.
    runs = {
        "cp": [
            "trainer=cp",
            "trainer.accelerator=cpu",
            "trainer.devices=2",
            "trainer.use_distributed_sampler=false",
        ],
        "single": [],
    }
    metrics = {}
    for name, extra in runs.items():
        out = tmp_path / name
        cmd = [
            sys.executable,
            "train.py",
            "debug=fdr",
            "logger=none",
            "test=false",
            f"paths.output_dir={out}",
            f"hydra.run.dir={out}",
            *extra,
        ]
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        metrics[name] = json.loads(proc.stdout.strip().splitlines()[-1])["metrics"]
        if name == "cp":
            assert "context parallel: ContextParallelMesh(dp=1 x cp=2" in proc.stdout + proc.stderr
    for key in ("train/loss", "val/loss"):  # float32 model: <= 1e-6 relative
        a, b = metrics["cp"][key], metrics["single"][key]
        assert abs(a - b) <= 1e-6 * abs(b), (key, a, b)
