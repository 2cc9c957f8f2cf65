"""benchmarks/models.py: the CPU smoke mode runs and writes the declared CSV columns."""

import csv
import math
from pathlib import Path

from benchmarks import models as bench


def test_quick_cpu_run_writes_csv(tmp_path):
    assert len(bench.CASES) == 15 and {c.dtype for c in bench.CASES} == {"fp32", "bf16"}
    # the eager-speed issue's cases are declared: ViT-B bf16 at 224 px, timm Swin v1 patched in place
    assert any(c.model == "vit_base_patch16_224" and c.img == 224 and c.dtype == "bf16" for c in bench.CASES)
    assert {c.dtype for c in bench.CASES if c.model.startswith("swin_tiny")} == {"fp32", "bf16"}
    # the backward issue's training-step target is declared
    assert any(c.model == "vit_base_patch16_224" and c.img == 448 and c.train and c.goal == 1.2
               for c in bench.CASES)
    path = bench.main(["--device", "cpu", "--quick", "--cases", "vit_tiny.*fp32", "--out", str(tmp_path),
                       "--warmup", "0", "--reps", "1"])
    rows = list(csv.DictReader(open(path)))
    assert Path(path).name == "models_cpu.csv"
    assert list(rows[0]) == bench.COLUMNS
    assert rows[0]["command"].startswith("python -m benchmarks.models --device cpu --quick")
    assert [r["peer"] for r in rows] == ["timm_sdpa", "timm_math", "timm_noattn", "elsa"]
    for r in rows:
        assert float(r["img_per_s"]) > 0 and math.isnan(float(r["peak_mb"]))
        if r["peer"] == "timm_noattn":
            # the stand-in really removes the attention (a speed ceiling, not the same function)
            assert float(r["max_dev"]) > 1e-3
            continue
        # Same weights, FP32-accurate attention on both sides: logits agree to float32 rounding.
        assert float(r["max_dev"]) < 1e-4


def test_quick_cpu_swinv2_rows(tmp_path):
    swin = [c for c in bench.CASES if c.model.startswith("swinv2")]
    assert {c.model for c in swin} == {"swinv2_tiny_window8_256", "swinv2_small_window16_256"}
    assert any(c.train for c in swin)
    path = bench.main(["--device", "cpu", "--quick", "--cases", "swinv2", "--out", str(tmp_path),
                       "--warmup", "0", "--reps", "1"])
    rows = list(csv.DictReader(open(path)))
    assert [(r["peer"], r["mode"]) for r in rows] == [
        ("timm_sdpa", "fwd"), ("timm_noattn", "fwd"), ("elsa", "fwd"),
        ("timm_sdpa", "train"), ("timm_noattn", "train"), ("elsa", "train")]
    for r in rows:
        assert float(r["img_per_s"]) > 0
        if r["peer"] == "timm_noattn":
            assert float(r["max_dev"]) > 1e-3  # the window attention really is gone
            continue
        assert float(r["max_dev"]) < 1e-4
    # The attention reaches the logits (res-post-norm weights set to one): ELSA and timm differ by rounding.
    assert 0 < float(rows[2]["max_dev"])


def test_peers_that_fit_only_alone_are_timed_one_after_another(tmp_path, monkeypatch, capsys):
    """When the peers do not fit on the device together, their eager times are taken one peer at a time
    instead of the case failing."""
    import torch

    real = bench.wall_ms_in_turns

    def only_alone(fns, *args, **kwargs):
        if len(fns) > 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return real(fns, *args, **kwargs)

    monkeypatch.setattr(bench, "wall_ms_in_turns", only_alone)
    path = bench.main(["--device", "cpu", "--quick", "--cases", "vit_tiny.*fp32", "--out", str(tmp_path),
                       "--warmup", "0", "--reps", "1"])
    assert "one peer after another" in capsys.readouterr().out
    assert all(float(r["ms"]) > 0 for r in csv.DictReader(open(path)))
