"""Benchmark outputs land in the repository's ``logs/benchmarks/`` (ignored by git) unless ``--out`` says
otherwise: a run never adds files to the tracked tree (``benchmarks/results/`` holds the published ones).
The scripts run as modules from the repository root, as the docs show (``python -m benchmarks.<name>``)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_default_output_directory_is_ignored_by_git():
    logs = ROOT / "logs" / "benchmarks"
    before = set(logs.glob("*")) if logs.is_dir() else set()
    args = ["--devices", "cpu", "--lengths", "512", "--dims", "64", "--depths", "1", "--reps", "1"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "benchmarks.eca", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    written = [Path(line.split(" ", 1)[1]) for line in done.stdout.splitlines() if line.startswith("wrote ")]
    try:
        assert written and all(p.resolve().parent == logs.resolve() for p in written), written
        rows = list(csv.DictReader(written[0].open()))[-2:]  # the sweep's two points at L = 512, d = 64
        assert [(r["device"], r["op"], r["L"], r["d"]) for r in rows] == [("cpu", "masked", "512", "64"),
                                                                          ("cpu", "tril", "512", "64")]
        assert all(r["command"] == "python -m benchmarks.eca " + " ".join(args) for r in rows)
    finally:
        for p in written:
            if p not in before:
                p.unlink()
    assert "logs/" in (ROOT / ".gitignore").read_text().splitlines()
