"""benchmarks/vggt.py's scale sweep: its SDPA peer is the same model (outputs within float32 rounding of the
ELSA model's), the swap is undone, and the CPU smoke sweep writes one row per declared case."""

import csv

import pytest
import torch

from benchmarks import vggt as bench
from elsa_vision.layers import ElsaAttention
from elsa_vision.models import ElsaVGGT


def test_sdpa_peer_is_the_same_model(monkeypatch):
    calls = []
    sdpa = torch.nn.functional.scaled_dot_product_attention
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(a[0].shape) or sdpa(*a, **k))
    torch.manual_seed(0)
    model = ElsaVGGT.from_config("elsa_vggt_small").eval()
    model.set_attention(backend="torch")
    x = torch.rand(1, 3, 3, 56, 70, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(x)
        assert calls == []
        with bench.sdpa_attention(model):
            out = model(x)
    n_attn = sum(isinstance(m, ElsaAttention) for m in model.modules())
    assert len(calls) >= n_attn  # every attention layer went through SDPA (the camera trunk once a pass)
    for key in ("pose_enc", "depth", "depth_conf"):
        assert ((out[key] - ref[key]).norm() / ref[key].norm()).item() < 1e-5, key
    assert not any("_attend" in vars(m) for m in model.modules() if isinstance(m, ElsaAttention))


def test_quick_scale_sweep_writes_every_case(tmp_path):
    summary = bench.main(["--scale", "--quick", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(summary["csv"])))
    assert list(rows[0]) == bench.COLUMNS
    cases = bench.SCALE["scale_quick"]
    assert [(int(r["frames"]), r["dtype"], r["part"], r["provider"]) for r in rows] == [
        (c.frames, c.dtype, c.part, c.attention) for c in cases]
    assert summary["failed"] == [] and all(r["finite"] == "True" and float(r["ms"]) > 0 for r in rows)


def test_scale_sweep_declares_the_issue_sizes():
    full = bench.SCALE["scale"]
    assert sorted({c.frames for c in full}) == [1, 20, 100, 200, 500, 1000]
    assert {(c.height, c.width, c.config) for c in full} == {(336, 518, "elsa_vggt")}
    for frames in (500, 1000):  # both peers for each part, the whole model included, at the largest sizes
        for part in ("aggregator", "model"):
            assert {c.attention for c in full if (c.frames, c.part) == (frames, part)} == {"elsa", "sdpa"}
    assert {(c.part, c.attention) for c in full if c.dtype == "fp32"} == {
        ("aggregator", "elsa"), ("aggregator", "sdpa"), ("model", "elsa")}


@pytest.mark.parametrize("argv, message", [
    (["--scale", "--quick", "--frames", "2"], "expected some of"),
    (["--scale", "--quick", "--frames", "x"], "comma list of integers"),
    (["--quick", "--frames", "1"], "--frames goes with --scale"),
    (["--quick", "--providers", "elsa"], "--providers goes with --scale"),
    (["--scale", "--quick", "--providers", "flash"], "expected some of"),
    (["--scale", "--quick", "--parts", "heads"], "expected some of"),
    (["--scale", "--quick", "--dtypes", "fp16"], "expected some of"),
    (["--scale", "--quick", "--frames", "1", "--reps", "0"], "--reps must be >= 1"),
])
def test_frames_refusals(argv, message):
    with pytest.raises(SystemExit, match=message):
        bench.main(argv)


def test_scale_sweep_picks_parts_providers_and_dtypes(tmp_path):
    summary = bench.main(["--scale", "--quick", "--frames", "3", "--parts", "model", "--providers", "elsa",
                          "--dtypes", "bf16,fp32", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(summary["csv"])))
    assert [(r["frames"], r["dtype"], r["part"], r["provider"]) for r in rows] == [
        ("3", "bf16", "model", "elsa"), ("3", "fp32", "model", "elsa")]
    assert summary["failed"] == [] and all(r["finite"] == "True" for r in rows)


def test_scale_reps_sets_every_sizes_timed_runs(tmp_path, monkeypatch):
    # --reps with --scale: that many timed runs after one warm-up at every size (the sweep's default is one
    # cold run above 100 frames)
    seen = []

    def record(case, model, device):
        seen.append(case.repeats)
        return {"kind": "scale", "frames": case.frames}

    monkeypatch.setattr(bench, "bench_scale", record)
    bench.main(["--scale", "--quick", "--frames", "1,3", "--parts", "aggregator", "--providers", "elsa",
                "--dtypes", "bf16", "--reps", "3", "--out", str(tmp_path)])
    assert seen == [3, 3]
