"""benchmarks/train_throughput.py: the CPU smoke mode trains both peers on a synthetic ImageFolder and writes
the declared CSV columns."""

import csv

from benchmarks import train_throughput as bench


def test_synthetic_imagefolder_layout(tmp_path):
    root = bench.make_imagefolder(tmp_path / "f", classes=3, per_class=4, size=(40, 30))
    assert sorted(p.name for p in (root / "train").iterdir()) == ["class_0", "class_1", "class_2"]
    assert len(list((root / "train").rglob("*.jpg"))) == 12 and len(list((root / "val").rglob("*.jpg"))) == 6


def test_quick_cpu_run_writes_csv(tmp_path):
    path = bench.main(["--quick", "--device", "cpu", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(path)))
    assert list(rows[0]) == bench.COLUMNS
    assert [r["peer"] for r in rows] == ["timm", "elsa"]
    assert [r["backbone"] for r in rows] == ["vit_tiny_patch16_224", "elsa_vit_tiny_patch16_224"]
    for r in rows:
        assert int(r["steps"]) == bench.QUICK["steps"]
        assert float(r["img_per_s_compute"]) > 0 and float(r["img_per_s_end_to_end"]) > 0
