"""benchmarks/context_parallel.py: the one-device extrapolation of the long cases, and the smoke sweep on a
one-process gloo group (every column the CSV declares, errors against one device)."""

import csv

import pytest
import torch.distributed as dist

from benchmarks import context_parallel as bench


def test_scale_to_grows_work_as_h_n2_and_memory_as_h_n():
    small = bench.AttentionCase(1, 16, 262144, 64)
    big = bench.AttentionCase(1, 8, 1048576, 64)
    work, memory = small.scale_to(big)
    assert work == pytest.approx(0.5 * 16) and memory == pytest.approx(0.5 * 4)


def test_extrapolate_uses_the_largest_measured_case_of_the_same_kind():
    a = bench.AttentionCase(1, 8, 1000, 64)
    b = bench.AttentionCase(1, 8, 2000, 64)
    other = bench.AttentionCase(1, 8, 4000, 64, dtype="bfloat16")
    measured = {
        a: {"fwd_s_1dev": 1.0, "fwdbwd_s_1dev": 3.0, "peak_mb_1dev": 100.0},
        b: {"fwd_s_1dev": 5.0, "fwdbwd_s_1dev": 13.0, "peak_mb_1dev": 210.0},
        other: {"fwd_s_1dev": 0.1},
    }
    row: dict = {}
    bench.extrapolate(row, bench.AttentionCase(1, 16, 8000, 64), measured)
    # from b: 2x the heads, 4x the tokens
    assert row["fwd_s_1dev"] == pytest.approx(5.0 * 32) and row["fwdbwd_s_1dev"] == pytest.approx(13.0 * 32)
    assert row["peak_mb_1dev"] == pytest.approx(210.0 * 8)
    assert row["one_device"] == "extrapolated from N2000 H8"
    causal: dict = {}
    bench.extrapolate(causal, bench.AttentionCase(1, 8, 8000, 64, causal=True, layout="zigzag"), measured)
    assert causal == {"one_device": "not run"}


@pytest.fixture
def one_process_group(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_quick_long_sweep_on_one_process(one_process_group, tmp_path):
    out = tmp_path / "cp.csv"
    bench.main(["--device", "cpu", "--quick", "--cases", "long", "--dtypes", "float32", "--repeats", "1",
                "--out", str(out)])
    rows = list(csv.DictReader(open(out)))
    assert list(rows[0]) == bench.COLUMNS
    assert [(r["tokens"], r["dtype"], r["one_device"]) for r in rows] == [
        ("1031", "float32", "measured"), ("2062", "float32", "extrapolated from N1031 H2")]
    measured, extrapolated = rows
    assert float(measured["relerr_vs_1dev"]) < 1e-6  # one rank: the same kernels on the same data
    assert extrapolated["relerr_vs_1dev"] == ""
    assert float(extrapolated["fwd_s_1dev"]) == pytest.approx(4 * float(measured["fwd_s_1dev"]))
    for r in rows:
        assert float(r["fwd_speed_up"]) > 0 and float(r["fwdbwd_speed_up"]) > 0


def test_unknown_dtype_is_refused():
    with pytest.raises(SystemExit, match="--dtypes"):
        bench.main(["--device", "cpu", "--quick", "--dtypes", "float16"])
