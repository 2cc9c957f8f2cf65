"""benchmarks/models.py: the CPU smoke mode runs and writes the declared CSV columns."""

import csv
import importlib.util
import math
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "models.py"


def _load():
    spec = importlib.util.spec_from_file_location("bench_models", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up there
    spec.loader.exec_module(mod)
    return mod


def test_quick_cpu_run_writes_csv(tmp_path):
    bench = _load()
    assert len(bench.CASES) == 6 and {c.dtype for c in bench.CASES} == {"fp32", "bf16"}
    path = bench.main(["--device", "cpu", "--quick", "--cases", "tiny.*fp32", "--out", str(tmp_path),
                       "--warmup", "0", "--reps", "1"])
    rows = list(csv.DictReader(open(path)))
    assert Path(path).name.startswith("models_cpu_")
    assert list(rows[0]) == bench.COLUMNS
    assert [r["peer"] for r in rows] == ["timm_sdpa", "timm_math", "elsa"]
    for r in rows:
        assert float(r["img_per_s"]) > 0 and math.isnan(float(r["peak_mb"]))
        # Same weights, FP32-accurate attention on both sides: logits agree to float32 rounding.
        assert float(r["max_dev"]) < 1e-4
