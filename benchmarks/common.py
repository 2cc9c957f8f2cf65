"""The harness every benchmark shares: timers, peers, the float64 reference and the results files.

Each script is a module of this package and runs from the repository root as ``python -m benchmarks.<name>``
(``torchrun --nproc-per-node N -m benchmarks.context_parallel`` for the distributed one). What a column of a
results file means is defined once, here:

* :func:`wall_ms` -- median wall time of a device-synchronised call (``time.perf_counter``, one
  synchronisation before and after each call): what an eager caller waits for, host work included.
  :func:`wall_ms_in_turns` times several peers so, in turns.
* :func:`bench_ms` -- median of ``triton.testing.do_bench`` (CUDA events, L2 cache flushed between calls):
  an eager call's time on the GPU, or the host's time where the host enqueues slower than the GPU runs.
  Off CUDA it falls back to :func:`wall_ms`.
* :func:`graph_ms` -- median of CUDA-graph replays of the call (``triton.testing.do_bench_cudagraph``):
  the GPU's time without the host's launch work.
* :func:`timings` -- the two side by side, ``{"ms": eager, "graph_ms": replay}``: what a script reports for
  a call unless it needs a wall clock (whole models, collectives) or a profile.
* :func:`host_us` -- host microseconds per call: many calls enqueued back to back, one synchronisation
  after them, several functions measured in turns so that every peer meets the same machine state.
* :func:`step_timer` -- a Lightning callback timing the training steps of a ``Trainer.fit`` (CUDA events,
  nothing synchronised between the steps: a training run's steps, the GPU's time for each).
* :func:`launches` and :func:`kernel_ms` -- GPU kernels one call launches, and their summed duration,
  from ``torch.profiler``; :func:`gpu_work` -- the GPU's own work among a profiler's events.
* :func:`peak_mb` -- peak allocated CUDA memory of one call (whole, or above what was allocated before).
* :func:`sdpa` / :func:`sdpa_context` -- PyTorch's attention forced to one backend (``sdpa_math``,
  ``sdpa_efficient``, ``sdpa_flash``, ``sdpa_cudnn``); :func:`flex` -- ``torch.compile(flex_attention)``.
* :func:`reference` -- float64 attention output and gradients in query chunks; :func:`relerr`,
  :func:`max_grad_relerr`.
* :func:`environment`, :func:`device_tag`, :class:`Results` -- every CSV row starts with
  ``device, torch, triton, date`` and ends with the ``command`` that wrote it; outputs default to
  ``logs/benchmarks/`` (ignored by git). ``benchmarks/results/`` holds one curated file per benchmark.
"""

from __future__ import annotations

import contextlib
import csv
import datetime as dt
import math
import re
import shlex
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
LOGS = ROOT / "logs" / "benchmarks"  # default output directory of every script (ignored by git)
META = ("device", "torch", "triton", "date")  # first columns of every results file; "command" is the last

# ------------------------------------------------------------------------------------------------ timers


def sync(device: torch.device | str | None = None) -> None:
    """Wait for the device's queued work (a no-op off CUDA)."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def _timed_calls(fn: Callable, device, reps: int, barrier: Callable | None = None) -> list[float]:
    """Wall-clock milliseconds of ``reps`` calls of ``fn()``, the device synchronised around each."""
    times = []
    for _ in range(reps):
        if barrier is not None:
            barrier()
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        if barrier is not None:
            barrier()
        times.append((time.perf_counter() - t0) * 1e3)
    return times


def wall_ms(fn: Callable, device: torch.device | str | None = None, *, warmup: int = 1, reps: int = 10,
            barrier: Callable | None = None) -> float:
    """Median wall-clock milliseconds of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones. The
    device is synchronised before and after every timed call. ``barrier`` (a process-group barrier) is
    called before the start and once more before the clock stops: a collective call is timed from the
    moment every rank starts until the last rank is done."""
    if reps < 1:
        raise ValueError(f"reps must be >= 1, got {reps}")
    for _ in range(warmup):
        fn()
    return statistics.median(_timed_calls(fn, device, reps, barrier))


def wall_ms_in_turns(fns: dict[str, Callable], device: torch.device | str | None = None, *, warmup: int = 1,
                     reps: int = 10, rounds: int = 5) -> dict[str, float]:
    """:func:`wall_ms` of each function, measured in turns: ``rounds`` rounds, each timing about
    ``reps / rounds`` calls of every function (A, B, A, B, ...); the median of each function's calls. A
    host-bound eager call moves with the machine's host speed over seconds; taking the peers in turns puts
    every peer under the same drift, which timing one peer after another does not."""
    if reps < 1 or rounds < 1:
        raise ValueError(f"reps and rounds must be >= 1, got {reps}, {rounds}")
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    rounds = min(rounds, reps)  # every round times each function at least once, reps calls in all
    per_round = math.ceil(reps / rounds)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            times[name] += _timed_calls(fn, device, per_round)
    return {name: statistics.median(t) for name, t in times.items()}


def bench_ms(fn: Callable, device: torch.device | str = "cuda", *, warmup: int = 25, rep: int = 100,
             cpu_reps: int = 3) -> float:
    """Median milliseconds of ``fn()`` by ``triton.testing.do_bench`` (``warmup`` and ``rep`` are its
    budgets in ms) on CUDA; elsewhere :func:`wall_ms` over ``cpu_reps`` calls after one warm-up (the Triton
    interpreter on CPU: such times check that a script runs, they say nothing about speed)."""
    if torch.device(device).type != "cuda":
        return wall_ms(fn, device, warmup=1, reps=cpu_reps)
    import triton

    return triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def graph_ms(fn: Callable, *, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` replayed from a CUDA graph (``triton.testing.do_bench_cudagraph``:
    warm-up on a side stream, then calls unrolled into one graph for about ``rep`` ms): the GPU's time alone.
    ``fn`` must be capturable (no host synchronisation; a training step without an optimiser's host state)."""
    import triton

    return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")


def timings(fn: Callable, device: torch.device | str = "cuda", *, warmup: int = 25, rep: int = 100,
            graph: bool = True, cpu_reps: int = 3) -> dict[str, float]:
    """The eager time and the CUDA-graph replay time of ``fn()``, side by side: ``{"ms": bench_ms(...),
    "graph_ms": graph_ms(...)}``. Their ratio says how much of the eager time is the host's. ``graph_ms`` is
    NaN off CUDA, with ``graph=False``, and where ``fn`` cannot be captured (a host synchronisation, a
    backend that refuses capture)."""
    out = {"ms": bench_ms(fn, device, warmup=warmup, rep=rep, cpu_reps=cpu_reps), "graph_ms": math.nan}
    if graph and torch.device(device).type == "cuda":
        try:
            out["graph_ms"] = graph_ms(fn, rep=rep)
        except Exception:  # noqa: BLE001 - not capturable: the eager time stands alone
            torch.cuda.synchronize()
    return out


def host_us(fns: dict[str, Callable], calls: int, repeats: int = 9, warmup: int = 20) -> dict[str, float]:
    """Host microseconds per call of each function: the time to enqueue ``calls`` calls back to back (one
    ``torch.cuda.synchronize`` after them, not inside), divided by ``calls``. The functions are measured in
    turns (A, B, C, A, B, C, ...) ``repeats`` times; median per function. At a shape whose GPU work is
    negligible this is what one call costs the CPU that enqueues it."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    sync()
    out: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(calls):
                fn()
            out[name].append((time.perf_counter() - t0) / calls * 1e6)
            sync()
    return {name: statistics.median(ts) for name, ts in out.items()}


def step_timer(warmup: int, count: int):
    """A Lightning callback timing the ``count`` training steps after ``warmup`` steps: ``steps`` (seconds per
    step) and ``first`` / ``last`` (the host's clock, the device synchronised, where the first timed step
    starts and the last ends: the timed span, waits for the data loader included).

    Between the two ends nothing waits for the device, as nothing does in training: the host may launch a
    step while the GPU still runs the one before it. On CUDA a step's time is therefore the GPU's, between two
    events recorded on the current stream where the step begins and ends: its kernels and the gaps in which
    the GPU waited for the host's launches inside the step (a host slower than the GPU still shows). Off
    CUDA it is the host's clock. (Synchronising around every step instead, as this timer once did, made
    each step start on an idle GPU and wait for the host to launch its first kernels: every step then
    timed the host's launch work ahead of the GPU's, not what a training run takes.)"""
    import lightning as L

    last_timed = warmup + count - 1

    class StepTimer(L.Callback):
        """The timed steps' times and their span (see ``step_timer``)."""

        def __init__(self) -> None:
            self.steps: list[float] = []
            self.first = self.last = None
            self._events: list[tuple] = []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if not warmup <= batch_idx <= last_timed:
                return
            if batch_idx == warmup:
                sync(pl_module.device)
                self.first = time.perf_counter()
            self._start = _step_mark(pl_module.device)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if not warmup <= batch_idx <= last_timed:
                return
            self._events.append((self._start, _step_mark(pl_module.device)))
            if batch_idx == last_timed:
                sync(pl_module.device)
                self.last = time.perf_counter()
                self.steps = [_between(a, b) for a, b in self._events]

    return StepTimer()


def _step_mark(device: torch.device):
    """Where a step begins or ends: a CUDA event recorded on the current stream, or the host's clock."""
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _between(a, b) -> float:
    """Seconds between two marks of ``_step_mark`` (the device synchronised past both)."""
    return b - a if isinstance(a, float) else a.elapsed_time(b) / 1e3


def _cuda_profile(fn: Callable, calls: int):
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        sync()
    return prof


def gpu_work(events) -> list[tuple[str, float, float]]:
    """``(name, start_us, end_us)`` of the GPU's own work (kernels, copies, memsets) among a profiler's
    ``events``. The profiler also gives every ``record_function`` range a GPU-side event (FSDP's
    ``FullyShardedDataParallel.forward``, the ``nccl:*`` ranges of collectives), spanning the kernels launched
    inside it: counting those as kernels would make the GPU look busy for whole regions."""
    cuda = torch.autograd.DeviceType.CUDA
    return [(e.name, e.time_range.start, e.time_range.end) for e in events
            if e.device_type == cuda and not getattr(e, "is_user_annotation", False)]


def launches(fn: Callable, calls: int = 10) -> float:
    """GPU kernels (memsets and copies included) that one ``fn()`` launches, from ``torch.profiler`` over
    ``calls`` calls after one warm-up call."""
    return len(gpu_work(_cuda_profile(fn, calls).events())) / calls


def kernel_ms(fn: Callable, device: torch.device | str = "cuda", calls: int = 3) -> float:
    """Summed duration (ms) of the GPU kernels one ``fn()`` launches (``torch.profiler``, mean of ``calls``
    calls): the GPU work alone, whatever the host's speed. NaN off CUDA."""
    if torch.device(device).type != "cuda":
        return math.nan
    prof = _cuda_profile(fn, calls)
    return sum(e.self_device_time_total for e in prof.key_averages()) / calls / 1e3


def wall_ms_peak(fn: Callable, device: torch.device | str, reps: int, warmup: bool = True):
    """``(ms, MiB, result)``: :func:`wall_ms` of ``reps`` calls (after one warm-up call unless the caller
    warmed up itself), the peak allocated CUDA memory of the timed calls (NaN off CUDA; the previous call's
    result stays alive during the next one, as in a loop) and the last call's result. For long calls (whole
    models, whole scenes)."""
    if warmup:
        fn()  # at full size (allocator, compilation), before the peak window
    reset_peak(device)
    last = []

    def call():
        last[:] = [fn()]

    ms = wall_ms(call, device, warmup=0, reps=reps)
    return ms, peak_since_reset_mb(device), last[0]


def reset_peak(device: torch.device | str) -> None:
    """Start a peak-memory window on CUDA: empty the allocator's cache, reset the peak counter."""
    if torch.device(device).type == "cuda":
        sync(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def peak_since_reset_mb(device: torch.device | str) -> float:
    """Peak allocated CUDA memory (MiB) since :func:`reset_peak`; NaN off CUDA."""
    if torch.device(device).type != "cuda":
        return math.nan
    sync(device)
    return torch.cuda.max_memory_allocated(device) / 2**20


def peak_mb(fn: Callable, device: torch.device | str = "cuda", *, extra: bool = False):
    """``(MiB, result)`` of one ``fn()``: the peak allocated CUDA memory during the call, or with ``extra``
    the peak above what was allocated before it (the call's outputs and workspace). NaN off CUDA."""
    reset_peak(device)
    base = torch.cuda.memory_allocated(device) if torch.device(device).type == "cuda" else 0
    result = fn()
    peak = peak_since_reset_mb(device)
    return (peak - base / 2**20 if extra else peak), result


# ------------------------------------------------------------------------------------------------- peers

SDPA_BACKENDS = {"sdpa_math": "MATH", "sdpa_efficient": "EFFICIENT_ATTENTION",
                 "sdpa_flash": "FLASH_ATTENTION", "sdpa_cudnn": "CUDNN_ATTENTION"}


def _backend(peer: str):
    from torch.nn.attention import SDPBackend

    if peer not in SDPA_BACKENDS:
        raise ValueError(f"unknown SDPA peer {peer!r}; expected one of {sorted(SDPA_BACKENDS)}")
    return getattr(SDPBackend, SDPA_BACKENDS[peer])


def sdpa(peer: str) -> Callable:
    """``F.scaled_dot_product_attention(q, k, v, **kwargs)`` forced to one backend with
    ``torch.nn.attention.sdpa_kernel`` (``peer`` is a key of ``SDPA_BACKENDS``). A backend that cannot run a
    case raises ``RuntimeError`` (flash and cuDNN take no float32)."""
    backend = _backend(peer)

    def call(q, k, v, **kwargs):
        from torch.nn.attention import sdpa_kernel

        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kwargs)

    return call


def sdpa_context(peer: str, device: torch.device | str):
    """A fresh context forcing SDPA's ``peer`` backend around a whole model call on CUDA; a no-op elsewhere
    (the CPU keeps PyTorch's default kernel)."""
    if torch.device(device).type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel([_backend(peer)])


@contextlib.contextmanager
def generic_kernels():
    """ELSA's generic Triton attention kernels on Hopper too (``fwd.HOPPER`` and ``bwd.HOPPER`` off) while
    the block runs: the A/B of the warp-specialised Hopper kernels (the benchmarks' ``elsa_generic`` peer)."""
    from elsa_vision.kernels import bwd, fwd

    old = fwd.HOPPER, bwd.HOPPER
    fwd.HOPPER = bwd.HOPPER = False
    try:
        yield
    finally:
        fwd.HOPPER, bwd.HOPPER = old


def flex() -> Callable:
    """``torch.compile(flex_attention, dynamic=False)`` as ``fn(q, k, v, is_causal=False)``; every new shape
    is a fresh compilation."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.cache_size_limit = max(64, torch._dynamo.config.cache_size_limit)
    compiled = torch.compile(flex_attention, dynamic=False)

    def call(q, k, v, is_causal=False):
        if not is_causal:
            return compiled(q, k, v)
        nq, nk = q.shape[-2], k.shape[-2]
        mask = create_block_mask(lambda b, h, i, j: j <= i + (nk - nq), None, None, nq, nk, device=q.device)
        return compiled(q, k, v, block_mask=mask)

    return call


# ---------------------------------------------------------------------------------------------- accuracy


def relerr(x: torch.Tensor, ref: torch.Tensor) -> float:
    """``||x - ref|| / ||ref||`` in float64."""
    ref = ref.double()
    return ((x.double() - ref).norm() / ref.norm()).item()


def max_grad_relerr(grads: Sequence[torch.Tensor], refs: Sequence[torch.Tensor]) -> float:
    """Largest :func:`relerr` of the gradients' batch 0, head 0 against ``refs`` (a :func:`reference` of
    that head)."""
    return max(relerr(g[:1, :1], r) for g, r in zip(grads, refs))


def _scores64(q64, k64, rows, causal, scale):
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:  # bottom-right aligned, as elsa_attention: query i sees key j iff j <= i + Nk - Nq
        nk = k64.shape[-2]
        s = s.masked_fill(torch.arange(nk, device=s.device)[None, :] > rows[:, None], -math.inf)
    return s


def reference(q, k, v, *, causal: bool = False, rows: torch.Tensor | None = None,
              dout: torch.Tensor | None = None, chunk: int = 1024):
    """Float64 softmax attention of ``[B, H, N, D]`` inputs, ``chunk`` query rows at a time
    (``O(chunk x Nk)`` memory): ``(out, None)``, or with ``dout`` ``(out, (dq, dk, dv))``. ``rows`` selects
    query rows of the output (gradients then are not available)."""
    q64, k64, v64 = q.double(), k.double(), v.double()
    scale = q.shape[-1] ** -0.5
    nq, nk = q.shape[-2], k.shape[-2]
    index = torch.arange(nq, device=q.device) if rows is None else rows.to(q.device)
    shifted = index + (nk - nq)
    outs, lses = [], []
    for r0 in range(0, index.numel(), chunk):
        sel = index[r0:r0 + chunk]
        s = _scores64(q64[..., sel, :], k64, shifted[r0:r0 + chunk], causal, scale)
        lse = torch.logsumexp(s, -1, keepdim=True)
        outs.append(torch.exp(s - lse) @ v64)
        lses.append(lse)
    out = torch.cat(outs, -2)
    if dout is None:
        return out, None
    if rows is not None:
        raise ValueError("reference(): gradients need every query row (rows=None)")
    lse = torch.cat(lses, -2)
    do64 = dout.double()
    delta = (out * do64).sum(-1, keepdim=True)
    dq, dk, dv = torch.empty_like(q64), torch.zeros_like(k64), torch.zeros_like(v64)
    for r0 in range(0, nq, chunk):
        sl = slice(r0, r0 + chunk)
        p = torch.exp(_scores64(q64[..., sl, :], k64, shifted[sl], causal, scale) - lse[..., sl, :])
        dv += p.transpose(-1, -2) @ do64[..., sl, :]
        ds = p * (do64[..., sl, :] @ v64.transpose(-1, -2) - delta[..., sl, :])
        dq[..., sl, :] = (ds @ k64) * scale
        dk += (ds.transpose(-1, -2) @ q64[..., sl, :]) * scale
    return out, (dq, dk, dv)


# --------------------------------------------------------------------------------------- results files


def device_name(device: torch.device | str) -> str:
    """The GPU's name (``torch.cuda.get_device_name``), or ``cpu``."""
    device = torch.device(device)
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def device_tag(device: torch.device | str, world: int = 1) -> str:
    """A short file-name tag of the machine: ``h100``, ``h200``, ``cpu``; ``2xh200`` for two ranks."""
    name = device_name(device).lower().replace("nvidia", "").strip()
    tag = re.split(r"[\s_-]+", name)[0] or "device"
    return f"{world}x{tag}" if world > 1 else tag


def environment(device: torch.device | str = "cpu") -> dict:
    """The first columns of every row: ``device``, ``torch``, ``triton`` (``none`` where it is not
    installed) and ``date`` (ISO, today)."""
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    return dict(device=device_name(device), torch=torch.__version__, triton=triton_version,
                date=dt.date.today().isoformat())


def run_info(device: torch.device | str, script: str, argv: Sequence[str]) -> dict:
    """The values every row of a run shares: :func:`environment` and the ``command``."""
    return dict(environment(device), command=command(script, argv))


def command(script: str, argv: Sequence[str]) -> str:
    """The command line that reproduces a run of the benchmark in file ``script`` (its ``__file__``):
    ``python -m benchmarks.<name> <argv>``."""
    return shlex.join(["python", "-m", f"benchmarks.{Path(script).stem}", *argv])


def add_out_dir(parser) -> None:
    """The ``--out DIR`` option of a script that writes its files into a directory."""
    parser.add_argument("--out", type=Path, default=LOGS,
                        help="output directory (default: logs/benchmarks, ignored by git)")


def columns(*names: str) -> list[str]:
    """A results file's header: ``META``, the benchmark's own ``names``, then ``command``."""
    return [*META, *names, "command"]


class Results:
    """A CSV results file whose rows are written (and flushed) as they are measured, so that a run cut off
    keeps what it measured. Every row gets the ``meta`` values (:func:`environment` and ``command``) for the
    columns it does not set itself.

    >>> with Results(path, columns("case", "ms"), meta) as out:
    ...     out.write(case="a", ms=1.0)
    """

    def __init__(self, path: Path | str, header: Sequence[str], meta: dict, append: bool = False):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fresh = not (append and self.path.exists())
        self._file = self.path.open("w" if fresh else "a", newline="")
        self._writer = csv.DictWriter(self._file, fieldnames=list(header), extrasaction="ignore")
        self.meta = dict(meta)
        self.rows: list[dict] = []
        if fresh:
            self._writer.writeheader()

    def write(self, row: dict | None = None, **values) -> dict:
        row = {**self.meta, **(row or {}), **values}
        self._writer.writerow(row)
        self._file.flush()
        self.rows.append(row)
        return row

    def write_all(self, rows: Iterable[dict]) -> None:
        for row in rows:
            self.write(row)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> Results:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
