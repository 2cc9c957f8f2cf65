"""benchmarks/attention.py's peers as the forward + backward rows run them (``train_runner``, and
``measure_fwdbwd``'s switch to the generic kernels), on CPU through the interpreter: a peer name the op does
not take fails here rather than in a GPU run."""

import pytest
import torch

from benchmarks import attention, common
from elsa_vision.kernels import bwd, fwd

ELSA_PEERS = [p for p in attention.RUNNERS if p.startswith("elsa")]


def test_generic_kernels_switch_both_hopper_passes_off_and_back():
    before = (fwd.HOPPER, bwd.HOPPER)
    assert before == (True, True)  # the library's defaults: the switch has something to turn off
    with pytest.raises(RuntimeError):
        with common.generic_kernels():
            assert (fwd.HOPPER, bwd.HOPPER) == (False, False)
            raise RuntimeError("restored even when the measured call fails")
    assert (fwd.HOPPER, bwd.HOPPER) == before


@pytest.mark.parametrize("peer", ELSA_PEERS)
def test_every_elsa_peer_trains_through_the_op(peer):
    # float32 inputs at 37 tokens: each peer's gradients within its precision's reach of float64 (tf32 keeps
    # 10 mantissa bits; every other precision is FP32-accurate)
    g = torch.Generator().manual_seed(5)
    q, k, v, do = (torch.randn(1, 2, 37, 16, generator=g) for _ in range(4))
    refs = attention.reference_grads(q, k, v, do, False)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    with common.generic_kernels() if peer == "elsa_generic" else torch.enable_grad():
        attention.train_runner(peer)(qg, kg, vg, False).backward(do)
    err = common.max_grad_relerr((qg.grad, kg.grad, vg.grad), refs)
    assert err <= (5e-3 if peer == "elsa_tf32" else 1e-5), f"{peer}: {err:.2e}"


def test_plot_skips_a_results_file_without_the_plotted_sweep(tmp_path, capsys):
    # a run of other shapes only (no B=1, H=8 forward rows) writes its CSV and no plot, without failing
    pytest.importorskip("matplotlib")
    csv_path, png = tmp_path / "a.csv", tmp_path / "a.png"
    csv_path.write_text("device,date,B,H,N,D,dtype,peer,ms,tflops,pass,note\n"
                        "H100,2026-11-27,8,12,1025,128,bfloat16,elsa,0.15,347.5,fwd,\n")
    attention.plot(csv_path, png)
    assert not png.exists() and "no plot" in capsys.readouterr().out
    csv_path.write_text("device,date,B,H,N,D,dtype,peer,ms,tflops,pass,note\n"
                        "H100,2026-11-27,1,8,4096,64,bfloat16,elsa,0.08,394.0,fwd,\n")
    attention.plot(csv_path, png)
    assert png.exists()
