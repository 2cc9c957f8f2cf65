"""Benchmark outputs land in the repository's ``logs/benchmarks/`` (ignored by git) unless ``--out`` says
otherwise: a run never adds files to the tracked tree (``benchmarks/results/`` holds the published ones)."""

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def test_default_output_directory_is_ignored_by_git():
    eca = _load("eca")
    logs = ROOT / "logs" / "benchmarks"
    before = set(logs.glob("*")) if logs.is_dir() else set()
    written = eca.main(["--devices", "cpu", "--lengths", "1", "--depths", "1", "--reps", "1"])
    try:
        assert written and all(p.resolve().parent == logs.resolve() for p in written), written
    finally:
        for p in written:
            if p not in before:
                p.unlink()
    assert "logs/" in (ROOT / ".gitignore").read_text().splitlines()
