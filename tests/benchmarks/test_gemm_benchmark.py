"""``benchmarks.gemm``'s width sweep (``--tune-widths``) runs every width and leaves the limit as it was. Its
quick case has K = 70 (not a multiple of 8): the generic loop on any device, so no product splits its
transposed operand in registers or swaps."""

import pytest

pytest.importorskip("triton")

import benchmarks.gemm as bench  # noqa: E402
from elsa_vision.kernels import gemm  # noqa: E402
from tests.helpers import DEVICE  # noqa: E402


def test_tune_widths_times_each_width_and_restores_the_limit(capsys):
    before = gemm.A_T_MAX_N
    bench.main(["--device", DEVICE, "--quick", "--tune-widths", "16,64"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("quick_dw")]
    assert len(lines) == 1 and "| 16: " in lines[0] and "| 64: " in lines[0]
    assert "ta=0 sw=0" in lines[0]
    assert gemm.A_T_MAX_N == before


def test_tune_widths_refuses_other_than_integers():
    with pytest.raises(SystemExit):
        bench.main(["--device", DEVICE, "--quick", "--tune-widths", "wide"])
