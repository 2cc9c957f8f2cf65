"""Every benchmark is a module of the ``benchmarks`` package, built on ``benchmarks.common``: it imports
without path tricks, its command line parses (``python -m benchmarks.<name> --help``) with the flags the
docs use, and it writes into ``logs/benchmarks/`` by default."""

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.stem for p in (ROOT / "benchmarks").glob("*.py")
                 if p.stem not in ("__init__", "common", "ceiling", "autotune"))
# Flags that docs/benchmarks/*.md and the other docs show, per script.
FLAGS = {
    "accuracy": ["--quick", "--sizes", "--rows", "--out"],
    "attention": ["--quick", "--shapes", "--dtype", "--peers", "--flex-shapes", "--autotune", "--causal",
                  "--backward", "--no-graph", "--out", "--png", "--tune", "--tune-hopper",
                  "--tune-precisions", "--configs", "--plot-only"],
    "attention_bwd": ["--shapes", "--dtypes", "--peers", "--tiles", "--save-best", "--config-json",
                      "--append", "--tune-hopper", "--configs", "--out"],
    "clip": ["--device", "--quick", "--warmup", "--reps", "--backend", "--precision", "--tf32", "--out"],
    "context_parallel": ["--device", "--quick", "--cases", "--dtypes", "--one-device-max-tokens",
                         "--precision", "--repeats", "--out"],
    "decode": ["--device", "--quick", "--nk", "--dtype", "--heads", "--dim", "--nq", "--reps", "--out"],
    "gemm": ["--device", "--quick", "--cases", "--precision", "--goal", "--tune-widths", "--out"],
    "eca": ["--devices", "--depths", "--lengths", "--dims", "--reps", "--out"],
    "highres": ["--quick", "--device", "--repeats", "--attn-backend", "--out"],
    "host": ["--calls", "--dtypes", "--breakdown", "--label", "--profile", "--out"],
    "hsi": ["--quick", "--device", "--mode", "--reps", "--json", "--part", "--scene-reps", "--out"],
    "models": ["--device", "--quick", "--cases", "--precision", "--fp32", "--warmup", "--reps", "--out"],
    "train_throughput": ["--device", "--quick", "--devices", "--precisions", "--strategy", "--model",
                         "--root", "--batch-size", "--steps", "--workers", "--override", "--profile",
                         "--out"],
    "vggt": ["--quick", "--full", "--scale", "--frames", "--device", "--reps", "--out"],
}


def test_every_script_is_listed():
    assert SCRIPTS == sorted(FLAGS)


@pytest.mark.parametrize("name", SCRIPTS)
def test_script_is_a_module_of_the_harness(name, capsys):
    source = (ROOT / "benchmarks" / f"{name}.py").read_text()
    assert "sys.path" not in source, "benchmarks run as modules (python -m benchmarks.<name>)"
    assert "from benchmarks.common import" in source
    mod = importlib.import_module(f"benchmarks.{name}")
    with pytest.raises(SystemExit) as done:
        mod.main(["--help"])
    assert done.value.code == 0
    usage = capsys.readouterr().out
    for flag in FLAGS[name]:
        assert re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", usage), f"{name}: {flag} missing"
    assert f"-m benchmarks.{name}" in mod.__doc__, f"{name}: its docstring shows how to run it"
