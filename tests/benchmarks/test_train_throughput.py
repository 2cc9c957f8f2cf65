"""benchmarks/train_throughput.py: the CPU smoke mode trains both peers on a synthetic ImageFolder, on one
process and on two gloo processes of torchrun, and writes the declared CSV columns with the ratios."""

import csv
import json

import pytest
import torch

from benchmarks import train_throughput as bench


def test_synthetic_imagefolder_layout(tmp_path):
    root = bench.make_imagefolder(tmp_path / "f", classes=3, per_class=4, size=(40, 30))
    assert sorted(p.name for p in (root / "train").iterdir()) == ["class_0", "class_1", "class_2"]
    assert len(list((root / "train").rglob("*.jpg"))) == 12 and len(list((root / "val").rglob("*.jpg"))) == 6


def test_synthetic_imagefolder_links_beyond_the_unique_images(tmp_path, monkeypatch):
    monkeypatch.setattr(bench, "UNIQUE_IMAGES", 5)
    root = bench.make_imagefolder(tmp_path / "f", classes=2, per_class=6, size=(40, 30))
    files = sorted((root / "train").rglob("*.jpg"))
    assert len(files) == 12
    assert len({p.stat().st_ino for p in files}) == 5  # the other 7 are links to the 5 encoded ones
    from PIL import Image

    for p in files:
        assert Image.open(p).size == (40, 30)


def test_ratios_against_one_device_and_timm():
    rows = [
        {"world": 1, "precision": "32-true", "peer": "timm", "img_per_s_compute": 100.0},
        {"world": 1, "precision": "32-true", "peer": "elsa", "img_per_s_compute": 150.0},
        {"world": 2, "precision": "32-true", "peer": "timm", "img_per_s_compute": 190.0},
        {"world": 2, "precision": "32-true", "peer": "elsa", "img_per_s_compute": 270.0},
        {"world": 2, "precision": "bf16-mixed", "peer": "elsa", "img_per_s_compute": 500.0},
    ]
    bench._ratios(rows)
    assert [r.get("scaling") for r in rows] == [1.0, 1.0, 0.95, 0.9, None]
    assert [r.get("vs_timm") for r in rows] == [None, 1.5, None, round(270 / 190, 3), None]


def test_ratios_pair_repeated_precisions_by_turn():
    # --precisions bf16-mixed,bf16-mixed: each ELSA row against timm's row of its own turn, each world's
    # k-th row against the one-device row of the same turn (not the last row of the precision)
    img = {(1, "timm"): (100.0, 200.0), (1, "elsa"): (110.0, 150.0), (2, "timm"): (190.0, 300.0),
           (2, "elsa"): (180.0, 330.0)}
    rows = [{"world": w, "precision": "bf16-mixed", "peer": p, "img_per_s_compute": img[w, p][t]}
            for w in (1, 2) for t in (0, 1) for p in ("timm", "elsa")]
    bench._ratios(rows)
    assert [r.get("vs_timm") for r in rows] == [None, 1.1, None, 0.75, None, round(180 / 190, 3), None, 1.1]
    assert [r.get("scaling") for r in rows] == [1.0, 1.0, 1.0, 1.0, 0.95, round(180 / 220, 3), 0.75, 1.1]
    assert bench.turn_summary(rows) == [
        "1 x bf16-mixed: vs timm over 2 turns: median 0.925, 0.750 to 1.100",
        f"2 x bf16-mixed: vs timm over 2 turns: median {(180 / 190 + 1.1) / 2:.3f}, {180 / 190:.3f} to 1.100"]


@pytest.mark.parametrize("argv, message", [
    (["--devices", "0"], "world sizes must be >= 1"),
    (["--devices", "two"], "comma list of integers"),
    (["--precisions", "fp32"], "--precisions"),
    (["--devices", "1,2", "--strategy", "fsdp"], "--strategy fsdp runs on CUDA devices only"),
])
def test_bad_arguments_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--device", "cpu", *argv])
    assert message in str(e.value)


def test_turns_alternate_which_peer_runs_first(monkeypatch):
    # a process's first DDP run peaks lower than the runs after it whichever model it trains, so the turns
    # of a repeated precision alternate which peer goes first; the pairing by turn (above) is order-free
    calls = []
    monkeypatch.setattr(bench, "run_peer", lambda peer, precision, *a: calls.append((precision, peer)) or {})
    bench.run_world({}, ["bf16-mixed", "bf16-mixed", "32-true"], None, None)
    assert calls == [("bf16-mixed", "timm"), ("bf16-mixed", "elsa"), ("bf16-mixed", "elsa"),
                     ("bf16-mixed", "timm"), ("32-true", "timm"), ("32-true", "elsa")]


def test_quick_cpu_run_writes_csv(tmp_path):
    path = bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(path)))
    assert list(rows[0]) == bench.COLUMNS
    assert [r["peer"] for r in rows] == ["timm", "elsa"]
    assert [r["backbone"] for r in rows] == ["vit_tiny_patch16_224", "elsa_vit_tiny_patch16_224"]
    for r in rows:
        assert (r["world"], r["strategy"], r["precision"]) == ("1", "single", "32-true")
        assert int(r["steps"]) == bench.QUICK["steps"]
        assert float(r["img_per_s_compute"]) > 0 and float(r["img_per_s_end_to_end"]) > 0
        assert float(r["scaling"]) == 1.0
    assert float(rows[1]["vs_timm"]) > 0 and rows[0]["vs_timm"] == ""


def test_quick_cpu_run_on_two_gloo_processes(tmp_path):
    path = bench.main(["--quick", "--device", "cpu", "--devices", "1,2", "--out", str(tmp_path), "--profile"])
    rows = list(csv.DictReader(open(path)))
    assert list(rows[0]) == bench.COLUMNS
    assert [(r["world"], r["strategy"], r["peer"]) for r in rows] == [
        ("1", "single", "timm"), ("1", "single", "elsa"), ("2", "ddp", "timm"), ("2", "ddp", "elsa")]
    for r in rows[2:]:
        # two ranks of the per-device batch per step
        assert float(r["img_per_s_compute"]) == pytest.approx(2 * float(r["img_per_s_per_device"]), rel=1e-3)
        assert float(r["scaling"]) > 0 and int(r["steps"]) == bench.QUICK["steps"]
    # --profile: a summary per run and rank (no GPU kernels on the CPU), a Chrome trace per run and rank
    profiles = json.loads((tmp_path / "train_profile_cpu_quick.json").read_text())
    assert [(p["world"], p["peer"], p["rank"]) for p in profiles] == [
        (1, "timm", 0), (1, "elsa", 0), (2, "timm", 0), (2, "timm", 1), (2, "elsa", 0), (2, "elsa", 1)]
    assert all(p["kernels_per_step"] == 0 and p["busy_ms"] == 0 for p in profiles)
    # no GPU: every profiled step's wall time is idle GPU time
    assert all(p["wall_ms"] > 0 and p["idle_ms"] == p["wall_ms"] for p in profiles)
    traces = sorted(q.name for q in tmp_path.glob("trace_*.json"))
    assert traces == ["trace_elsa_32-true_w1_r0.json", "trace_elsa_32-true_w2_r0.json",
                      "trace_elsa_32-true_w2_r1.json", "trace_timm_32-true_w1_r0.json",
                      "trace_timm_32-true_w2_r0.json", "trace_timm_32-true_w2_r1.json"]
    assert all(json.loads((tmp_path / t).read_text())["traceEvents"] for t in traces)


def test_overrides_reach_the_recipe_and_bad_ones_are_refused(tmp_path):
    spec = dict(bench.QUICK, strategy="fsdp", overrides=["trainer.strategy.activation_checkpointing=true",
                                                         "+trainer.strategy.forward_prefetch=true"])
    cfg = bench.compose_recipe(spec, tmp_path, torch.device("cpu"))
    assert cfg.trainer.strategy.activation_checkpointing is True and cfg.trainer.strategy.forward_prefetch
    assert cfg.model.net.model_name == "elsa_vit_tiny_patch16_224" and cfg.data.root == str(tmp_path)
    plain = bench.compose_recipe(dict(bench.QUICK, strategy="fsdp"), tmp_path, torch.device("cpu"))
    assert plain.trainer.strategy.activation_checkpointing is False
    assert "forward_prefetch" not in plain.trainer.strategy
    with pytest.raises(Exception, match="no_such_key"):
        bench.compose_recipe(dict(spec, overrides=["trainer.strategy.no_such_key=1"]), tmp_path,
                             torch.device("cpu"))


def test_overlap_summary_splits_communication_into_hidden_and_exposed():
    # two steps (us): computation on [0, 10] and [12, 20] ms, a second stream's kernel inside the first,
    # NCCL on [5, 15] ms: 8 ms of it under computation, 2 ms exposed
    kernels = [("gemm", 0.0, 10_000.0), ("norm", 1_000.0, 3_000.0), ("gemm", 12_000.0, 20_000.0),
               ("ncclDevKernel_AllGather_RING_LL", 5_000.0, 15_000.0)]
    summary = bench.overlap_summary(kernels, steps=2)
    assert {k: summary[k] for k in ("busy_ms", "compute_ms", "comm_ms", "overlap_ms", "exposed_comm_ms")} == {
        "busy_ms": 10.0, "compute_ms": 9.0, "comm_ms": 5.0, "overlap_ms": 4.0, "exposed_comm_ms": 1.0}
    assert summary["kernels_per_step"] == 2.0
    assert summary["top"][:2] == [["gemm", 9.0], ["ncclDevKernel_AllGather_RING_LL", 5.0]]
    # communication alone is all exposed; no kernels at all is all zeros
    alone = bench.overlap_summary([("ncclKernel", 0.0, 4_000.0), ("ncclKernel", 2_000.0, 6_000.0)], steps=1)
    assert (alone["comm_ms"], alone["overlap_ms"], alone["exposed_comm_ms"]) == (6.0, 0.0, 6.0)
    assert bench.overlap_summary([], steps=2)["busy_ms"] == 0


def test_idle_by_phase_names_the_host_work_each_wait_ended_with():
    # one step (us): kernels on [0, 10], [30, 40], [45, 50], [70, 80], [100, 110]; the four waits (20, 5, 20,
    # 20 us) end with launches inside an autograd node (thread 2), under a forward op (thread 1), under the
    # optimiser's _foreach op (thread 1) and with no launch event at all
    def x(cat, name, ts, dur, tid=1, corr=None):
        e = {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "tid": tid}
        if corr is not None:
            e["args"] = {"correlation": corr}
        return e

    events = [x("kernel", "k", t, d, tid=7, corr=c) for t, d, c in
              ((0, 10, 1), (30, 10, 2), (45, 5, 3), (70, 10, 4), (100, 10, 99))]
    events += [x("cuda_runtime", "cudaLaunchKernel", 0, 1, corr=1),
               x("cuda_runtime", "cudaLaunchKernel", 29, 1, tid=2, corr=2),
               x("cuda_runtime", "cudaLaunchKernel", 44, 1, corr=3),
               x("cuda_runtime", "cudaLaunchKernel", 69, 1, corr=4),
               x("cpu_op", "autograd::engine::evaluate_function: AddmmBackward0", 20, 15, tid=2),
               x("cpu_op", "AddmmBackward0", 21, 12, tid=2), x("cpu_op", "aten::mm", 25, 6, tid=2),
               x("cpu_op", "Optimizer.step#AdamW.step", 0, 100), x("cpu_op", "aten::addmm", 40, 6),
               x("cpu_op", "aten::_foreach_lerp_", 60, 12), x("cpu_op", "aten::empty", 61, 2),
               x("cpu_op", "Memcpy HtoD", 0, 1, tid=3)]
    assert bench.idle_by_phase(events, steps=1) == {"forward": 0.025, "backward": 0.02, "optimizer": 0.02}
    assert bench.idle_by_phase(events, steps=2)["backward"] == 0.01
    assert bench.idle_by_phase([], steps=1) == {"forward": 0.0, "backward": 0.0, "optimizer": 0.0}


def test_a_run_cut_off_keeps_the_world_sizes_it_measured(tmp_path, monkeypatch):
    # Each world size's rows are written when it is done: a later world that fails (a torchrun error, a
    # time limit) leaves the one-device rows, with their ratios, in the CSV.
    def one_device(spec, precisions, root, device, profile_dir=None):
        return [dict(world=1, strategy="single", precision="32-true", peer=peer, backbone=peer, img_size=64,
                     batch_per_device=2, steps=3, step_ms=10.0, img_per_s_compute=speed,
                     img_per_s_per_device=speed, img_per_s_end_to_end=speed, peak_mb_per_rank=None)
                for peer, speed in (("timm", 100.0), ("elsa", 150.0))]

    def cut_off(world, argv, root, tmp, device):
        raise SystemExit(f"{world} processes: torchrun exited with 1")

    monkeypatch.setattr(bench, "run_world", one_device)
    monkeypatch.setattr(bench, "_launch", cut_off)
    with pytest.raises(SystemExit, match="2 processes"):
        bench.main(["--quick", "--device", "cpu", "--devices", "1,2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("train_throughput_*.csv")
    rows = list(csv.DictReader(open(path)))
    assert [(r["world"], r["peer"], r["scaling"], r["vs_timm"]) for r in rows] == [
        ("1", "timm", "1.0", ""), ("1", "elsa", "1.0", "1.5")]
