"""benchmarks/common.py: the one harness of the benchmarks (timers, SDPA peers, float64 reference, results
files), on CPU."""

import csv
import math

import pytest
import torch
import torch.nn.functional as F

from benchmarks import common
from elsa_vision.kernels.reference import softmax_attention


class FakeClock:
    """``time.perf_counter`` that advances only when a timed function says so."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    fake = FakeClock()
    monkeypatch.setattr(common.time, "perf_counter", fake)
    return fake


def test_wall_ms_is_the_median_of_the_timed_calls(clock):
    costs = iter([9.0, 5e-3, 1e-3, 3e-3])  # the first call is the untimed warm-up
    calls = []

    def fn():
        calls.append(1)
        clock.advance(next(costs))

    assert common.wall_ms(fn, "cpu", warmup=1, reps=3) == pytest.approx(3.0)
    assert len(calls) == 4


def test_wall_ms_times_until_the_closing_barrier(clock):
    events = []

    def barrier():
        events.append("barrier")
        clock.advance(2e-3)  # waiting for the slowest rank counts after the call, not before it

    def fn():
        events.append("call")
        clock.advance(1e-3)

    # the opening barrier's wait happens before the clock starts: 1 ms call + 2 ms closing barrier
    assert common.wall_ms(fn, "cpu", warmup=0, reps=2, barrier=barrier) == pytest.approx(3.0)
    assert events == ["barrier", "call", "barrier"] * 2
    with pytest.raises(ValueError, match="reps"):
        common.wall_ms(fn, "cpu", reps=0)


def test_bench_ms_off_cuda_is_wall_time(clock):
    def fn():
        clock.advance(4e-3)

    assert common.bench_ms(fn, "cpu", cpu_reps=2) == pytest.approx(4.0)


def test_timings_give_the_eager_time_and_no_graph_time_off_cuda(clock):
    def fn():
        clock.advance(4e-3)

    t = common.timings(fn, "cpu", cpu_reps=2)
    assert set(t) == {"ms", "graph_ms"}
    assert t["ms"] == pytest.approx(4.0) and math.isnan(t["graph_ms"])


def test_timings_put_the_graph_replay_beside_the_eager_time(monkeypatch):
    monkeypatch.setattr(common, "bench_ms", lambda fn, device, **kw: 3.0)
    monkeypatch.setattr(common, "graph_ms", lambda fn, **kw: 1.0)
    assert common.timings(lambda: None, "cuda") == {"ms": 3.0, "graph_ms": 1.0}
    assert math.isnan(common.timings(lambda: None, "cuda", graph=False)["graph_ms"])

    def refuses(fn, **kw):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(common, "graph_ms", refuses)
    monkeypatch.setattr(common.torch.cuda, "synchronize", lambda *a: None)
    t = common.timings(lambda: None, "cuda")
    assert t["ms"] == 3.0 and math.isnan(t["graph_ms"])


def test_step_timer_stops_after_count_steps(clock):
    """Steps after the counted ones (profiled, say) are neither timed nor in the wall span."""
    pytest.importorskip("lightning")
    timer = common.step_timer(warmup=1, count=2)
    module = type("M", (), {"device": torch.device("cpu")})()
    for i, cost in enumerate((5.0, 2.0, 3.0, 7.0)):
        timer.on_train_batch_start(None, module, None, i)
        clock.advance(cost)
        timer.on_train_batch_end(None, module, None, None, i)
    assert timer.steps == [2.0, 3.0] and timer.last - timer.first == pytest.approx(5.0)


def test_step_timer_on_cuda_reads_events_and_synchronises_only_at_the_span_ends(clock, monkeypatch):
    """On CUDA each step is timed by events on the GPU's timeline; the device is synchronised where the timed
    span begins and ends, never between its steps (a step may be launched while the GPU runs the last)."""
    pytest.importorskip("lightning")
    gpu = {"now": 0.0}  # the GPU's clock: where its queue has got to
    syncs = []

    class Event:
        def __init__(self, enable_timing=False):
            assert enable_timing

        def record(self):
            self.at = gpu["now"]

        def elapsed_time(self, end):
            return (end.at - self.at) * 1e3

    monkeypatch.setattr(common.torch.cuda, "Event", Event)
    monkeypatch.setattr(common, "sync", lambda device=None: syncs.append(clock.now))
    timer = common.step_timer(warmup=1, count=3)
    module = type("M", (), {"device": torch.device("cuda", 0)})()
    for i, (host, work) in enumerate(((5.0, 6.0), (1.0, 2.0), (1.0, 4.0), (1.0, 3.0), (9.0, 9.0))):
        timer.on_train_batch_start(None, module, None, i)
        clock.advance(host)  # the host's launches ...
        gpu["now"] += work  # ... and the GPU's work of the step (queued behind the steps before it)
        timer.on_train_batch_end(None, module, None, None, i)
    assert timer.steps == pytest.approx([2.0, 4.0, 3.0])
    assert syncs == [5.0, 8.0] and timer.last - timer.first == pytest.approx(3.0)


def test_wall_ms_in_turns_times_the_peers_in_rounds(clock):
    """Each peer's median over its calls of every round; the rounds alternate the peers (a, a, b, b, a, a,
    b, b), so a drift of the machine's speed (here: every call 1 ms slower than the one before) falls on
    both peers alike, where one peer after the other would charge it all to the second."""
    order = []
    drift = {"ms": 0.0}

    def make(name, ms):
        def fn():
            order.append(name)
            clock.advance((ms + drift["ms"]) * 1e-3)
            drift["ms"] += 1.0
        return fn

    got = common.wall_ms_in_turns({"a": make("a", 10.0), "b": make("b", 10.0)}, "cpu", warmup=1, reps=4,
                                  rounds=2)
    assert order == ["a", "b"] + ["a", "a", "b", "b"] * 2
    # a's timed calls ran with drifts 2, 3, 6, 7 ms and b's with 4, 5, 8, 9: medians 14.5 and 16.5 ms
    assert got == pytest.approx({"a": 14.5, "b": 16.5})
    with pytest.raises(ValueError, match="rounds"):
        common.wall_ms_in_turns({"a": make("a", 1.0)}, "cpu", rounds=0)
    order.clear()
    common.wall_ms_in_turns({"a": make("a", 1.0), "b": make("b", 1.0)}, "cpu", warmup=0, reps=2, rounds=5)
    assert order == ["a", "b", "a", "b"]  # fewer reps than rounds: reps calls each, not one per round


def test_host_us_measures_in_turns_per_call(clock):
    order = []

    def make(name, us):
        def fn():
            order.append(name)
            clock.advance(us * 1e-6)
        return fn

    got = common.host_us({"a": make("a", 10.0), "b": make("b", 30.0)}, calls=4, repeats=3, warmup=1)
    assert got == pytest.approx({"a": 10.0, "b": 30.0})
    timed = order[2:]  # after one warm-up call each
    assert timed == (["a"] * 4 + ["b"] * 4) * 3


def test_wall_ms_peak_keeps_the_last_result(clock):
    results = iter(range(10))

    def fn():
        clock.advance(2e-3)
        return next(results)

    ms, peak, last = common.wall_ms_peak(fn, "cpu", reps=3)  # one warm-up call, then three timed
    assert ms == pytest.approx(2.0) and math.isnan(peak) and last == 3


def test_memory_and_kernel_counters_off_cuda():
    peak, result = common.peak_mb(lambda: 7, "cpu")
    assert math.isnan(peak) and result == 7
    assert math.isnan(common.kernel_ms(lambda: None, "cpu"))
    assert math.isnan(common.peak_since_reset_mb("cpu"))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("nq, nk", [(37, 37), (19, 53)])
def test_reference_matches_autograd_of_the_specification(causal, nq, nk):
    g = torch.Generator().manual_seed(nq + nk)
    q = torch.randn(2, 3, nq, 16, generator=g, dtype=torch.float64)
    k, v = (torch.randn(2, 3, nk, 16, generator=g, dtype=torch.float64) for _ in range(2))
    do = torch.randn(2, 3, nq, 16, generator=g, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    want = softmax_attention(*leaves, causal=causal)
    want.backward(do)
    out, grads = common.reference(q, k, v, causal=causal, dout=do, chunk=8)  # several query chunks
    torch.testing.assert_close(out, want.detach(), rtol=1e-12, atol=1e-12)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-12)
    rows = torch.tensor([0, 5, nq - 1])
    part, none = common.reference(q, k, v, causal=causal, rows=rows, chunk=2)
    assert none is None
    torch.testing.assert_close(part, want.detach()[..., rows, :], rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="rows"):
        common.reference(q, k, v, rows=rows, dout=do)


def test_relative_errors():
    ref = torch.tensor([3.0, 4.0])
    assert common.relerr(ref + torch.tensor([0.0, 0.5]), ref) == pytest.approx(0.1)
    refs = [torch.ones(1, 1, 2, 2), 2 * torch.ones(1, 1, 2, 2)]
    grads = [torch.ones(2, 3, 2, 2), 2 * torch.ones(2, 3, 2, 2)]
    grads[1][0, 0, 0, 0] = 3.0  # batch 0, head 0: the part that is compared
    grads[0][1, 2] = 100.0  # other heads are not
    assert common.max_grad_relerr(grads, refs) == pytest.approx(1 / 4)


def test_sdpa_peers_force_one_backend():
    q, k, v = (torch.randn(1, 2, 9, 8) for _ in range(3))
    math_peer = common.sdpa("sdpa_math")
    torch.testing.assert_close(math_peer(q, k, v, is_causal=True), F.scaled_dot_product_attention(
        q, k, v, is_causal=True))
    with pytest.raises(RuntimeError):  # no cuDNN kernel on the CPU: the backend really is forced
        common.sdpa("sdpa_cudnn")(q, k, v)
    with pytest.raises(ValueError, match="unknown SDPA peer"):
        common.sdpa("sdpa_fast")
    with common.sdpa_context("sdpa_efficient", "cpu"):  # a no-op off CUDA: PyTorch's default CPU kernel
        torch.testing.assert_close(F.scaled_dot_product_attention(q, k, v), math_peer(q, k, v))


def test_results_file_columns_meta_and_append(tmp_path):
    meta = common.run_info("cpu", "/x/benchmarks/demo.py", ["--quick", "a b"])
    assert meta["device"] == "cpu" and meta["torch"] == torch.__version__
    assert meta["command"] == "python -m benchmarks.demo --quick 'a b'"
    header = common.columns("case", "ms")
    assert header == ["device", "torch", "triton", "date", "case", "ms", "command"]
    path = tmp_path / "sub" / "demo_cpu.csv"
    with common.Results(path, header, meta) as out:
        row = out.write(case="x", ms=1.5)
        assert row["device"] == "cpu" and row["command"] == meta["command"]
        assert path.read_text().count("\n") == 2  # header and the row, flushed as written
    with common.Results(path, header, dict(meta, date="2000-01-01"), append=True) as out:
        out.write_all([{"case": "y", "ms": 2}, {"case": "z", "ms": 3, "date": "1999-12-31"}])
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == header
    assert [(r["case"], r["date"]) for r in rows] == [("x", meta["date"]), ("y", "2000-01-01"),
                                                       ("z", "1999-12-31")]
    with common.Results(path, header, meta) as out:  # without append: a fresh file
        pass
    assert path.read_text().splitlines() == [",".join(header)]


def test_device_tags():
    assert common.device_tag("cpu") == "cpu"
    assert common.device_tag("cpu", world=2) == "2xcpu"


def test_gpu_work_leaves_out_host_events_and_annotated_ranges():
    """Only GPU work counts: a record_function range's GPU-side event (here an FSDP forward spanning both
    kernels) would otherwise make the GPU busy for the whole range."""
    from types import SimpleNamespace

    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def event(name, lo, hi, device, annotation=False):
        return SimpleNamespace(name=name, time_range=SimpleNamespace(start=lo, end=hi), device_type=device,
                               is_user_annotation=annotation)

    events = [event("aten::mm", 0.0, 50.0, cpu),
              event("FullyShardedDataParallel.forward", 0.0, 900.0, cuda, True),
              event("gemm_kernel", 10.0, 20.0, cuda), event("ncclDevKernel_AllGather", 15.0, 40.0, cuda)]
    assert common.gpu_work(events) == [("gemm_kernel", 10.0, 20.0), ("ncclDevKernel_AllGather", 15.0, 40.0)]
