"""benchmarks/train_throughput.py: the CPU smoke mode trains both peers on a synthetic ImageFolder, on one
process and on two gloo processes of torchrun, and writes the declared CSV columns with the ratios."""

import csv

import pytest

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
    path = bench.main(["--quick", "--device", "cpu", "--devices", "1,2", "--out", str(tmp_path)])
    rows = list(csv.DictReader(open(path)))
    assert [(r["world"], r["strategy"], r["peer"]) for r in rows] == [
        ("1", "single", "timm"), ("1", "single", "elsa"), ("2", "ddp", "timm"), ("2", "ddp", "elsa")]
    for r in rows[2:]:
        # two ranks of the per-device batch per step
        assert float(r["img_per_s_compute"]) == pytest.approx(2 * float(r["img_per_s_per_device"]), rel=1e-3)
        assert float(r["scaling"]) > 0 and int(r["steps"]) == bench.QUICK["steps"]


def test_a_run_cut_off_keeps_the_world_sizes_it_measured(tmp_path, monkeypatch):
    # Each world size's rows are written when it is done: a later world that fails (a torchrun error, a
    # time limit) leaves the one-device rows, with their ratios, in the CSV.
    def one_device(spec, precisions, root, device):
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
