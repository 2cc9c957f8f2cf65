"""Checkpoints and run directories: last.ckpt is the latest epoch and shares its file with an equal best
checkpoint, a resume continues the same run exactly, writes survive a kill or a full disk, every run gets its
own directory, a wrong ckpt_path is named, and every task's checkpoints reload weights-only."""

from __future__ import annotations

import csv
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time

import pytest
import scipy.io
import torch
from PIL import Image

import elsa_vision.tasks.train as train_mod
from elsa_vision.files import NotACheckpointError, read_checkpoint
from elsa_vision.tasks.train import CheckpointPathError, train
from elsa_vision.utils import run_dirs as run_mod
from tests.train_helpers import QUIET, ROOT, TINY_NET, StopAfterEpoch, compose_cfg

QUIET_CSV = [q for q in QUIET if q != "logger=none"] + ["logger=csv"]
SMALL = ["trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]


def _ckpts(run):
    return sorted(p.name for p in (run / "checkpoints").iterdir())


def _epoch(path) -> int:
    return int(torch.load(path, weights_only=True, map_location="cpu")["epoch"])


def _rows(metrics_csv):
    with open(metrics_csv, newline="") as f:
        return [{k: v for k, v in row.items() if v != ""} for row in csv.DictReader(f)]


# ----------------------------------------------------------------------------------- last.ckpt, best


def test_last_ckpt_is_the_latest_epoch_when_accuracy_plateaus(tmp_path):
    """lr=0: the weights and val/acc never change, so only epoch 0 is ever 'best'; last.ckpt must still move
    to epoch 2 (Lightning's save_last advances it only when a top-k checkpoint is written)."""
    run = tmp_path / "run"
    overrides = ["model.optimizer.lr=0.0", "trainer.max_epochs=3", "test=false"]
    _, obj = train(compose_cfg("train", TINY_NET + QUIET + SMALL + overrides, run))
    assert _ckpts(run) == ["epoch_000.ckpt", "last.ckpt"]
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True, map_location="cpu")
    assert last["epoch"] == 2 and last["global_step"] == 6
    assert obj["last_checkpoint"] == str(run / "checkpoints" / "last.ckpt")
    assert obj["best_checkpoint"] == str(run / "checkpoints" / "epoch_000.ckpt")
    assert not os.path.samefile(run / "checkpoints" / "last.ckpt", run / "checkpoints" / "epoch_000.ckpt")


def test_best_and_last_of_the_same_epoch_are_one_file(tmp_path):
    run = tmp_path / "run"
    base = TINY_NET + QUIET + SMALL + ["test=false"]
    train(compose_cfg("train", base + ["trainer.max_epochs=1"], run))
    last, best = run / "checkpoints" / "last.ckpt", run / "checkpoints" / "epoch_000.ckpt"
    assert os.path.samefile(last, best) and os.stat(last).st_nlink == 2  # one file, two names
    ckpt = torch.load(last, weights_only=True, map_location="cpu")
    state = next(v for k, v in ckpt["callbacks"].items() if k.startswith("ModelCheckpoint"))
    assert state["last_model_path"] == str(last) and state["best_model_path"] == str(best)
    best.unlink()  # the best file going away (top-k rotation) leaves last.ckpt whole
    assert _epoch(last) == 0
    # resuming from it continues in the same files: the next epoch writes last.ckpt anew
    train(compose_cfg("train", base + ["trainer.max_epochs=2", "ckpt_path=last"], run))
    assert _epoch(run / "checkpoints" / "last.ckpt") == 1


# ------------------------------------------------------------------------------------------ resume


def test_resume_continues_the_same_run(tmp_path, monkeypatch):
    """Interrupted after epoch 2 of 3 and resumed with ckpt_path=last from a new job (a new Hydra directory
    before the fix): the run continues in its own directory with one metrics.csv equal to the
    uninterrupted run's, the same checkpoints, best record and final test."""
    runs = tmp_path / "logs" / "train" / "runs"
    logs = tmp_path / "logs"
    base = TINY_NET + QUIET_CSV + SMALL + ["trainer.max_epochs=3", "model.net.drop_path_rate=0.1"]
    full_metrics, full = train(compose_cfg("train", base, runs / "full", log_dir=logs))

    orig = train_mod.instantiate_callbacks
    monkeypatch.setattr(train_mod, "instantiate_callbacks", lambda c: orig(c) + [StopAfterEpoch(2)])
    _, part = train(compose_cfg("train", base + ["test=false"], runs / "part", log_dir=logs))
    monkeypatch.undo()
    assert part["trainer"].current_epoch == 2
    time.sleep(0.05)

    metrics, resumed = train(compose_cfg("train", base + ["ckpt_path=last"], runs / "new", log_dir=logs))
    assert resumed["run_dir"] == str(runs / "part") and not (runs / "new").exists()
    assert resumed["trainer"].current_epoch == 3
    assert _ckpts(runs / "part") == _ckpts(runs / "full")
    cb_full, cb_res = full["trainer"].checkpoint_callback, resumed["trainer"].checkpoint_callback
    assert os.path.basename(cb_res.best_model_path) == os.path.basename(cb_full.best_model_path)
    assert float(cb_res.best_model_score) == float(cb_full.best_model_score)
    full_rows, res_rows = _rows(runs / "full" / "metrics.csv"), _rows(runs / "part" / "metrics.csv")
    assert [r.keys() for r in res_rows] == [r.keys() for r in full_rows]
    for a, b in zip(full_rows, res_rows):
        for k in a:
            assert abs(float(a[k]) - float(b[k])) <= 1e-6, (k, a, b)
    for k in ("test/acc", "test/loss", "val/acc_best", "val/acc", "train/loss"):
        assert abs(metrics[k] - full_metrics[k]) <= 1e-6, k


def test_resume_keeps_the_best_record(tmp_path):
    """The best epoch lies before the interruption (lr=0: epoch 0 stays best): after the resume the best
    checkpoint, its score and val/acc_best are still epoch 0's, and the final test uses epoch_000.ckpt."""
    runs = tmp_path / "logs" / "train" / "runs"
    base = TINY_NET + QUIET + SMALL + ["model.optimizer.lr=0.0"]
    logs = tmp_path / "logs"
    _, first = train(compose_cfg("train", base + ["trainer.max_epochs=2", "test=false"], runs / "a", logs))
    score = float(first["trainer"].checkpoint_callback.best_model_score)
    resume = ["trainer.max_epochs=3", "ckpt_path=last"]
    metrics, obj = train(compose_cfg("train", base + resume, runs / "b", logs))
    cb = obj["trainer"].checkpoint_callback
    assert obj["run_dir"] == str(runs / "a")
    assert cb.best_model_path == str(runs / "a" / "checkpoints" / "epoch_000.ckpt")
    assert float(cb.best_model_score) == score and metrics["val/acc_best"] == score
    assert _ckpts(runs / "a") == ["epoch_000.ckpt", "last.ckpt"]
    assert _epoch(runs / "a" / "checkpoints" / "last.ckpt") == 2


# --------------------------------------------------------------------------- interrupted checkpoint writes

_INTERRUPTED_SAVE = textwrap.dedent(
    """
    import builtins, errno, os, shutil, signal, sys
    from pathlib import Path

    out, tmpdir, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    import tempfile
    tempfile.tempdir = tmpdir
    from tests.train_helpers import compose_cfg
    from elsa_vision.tasks.train import train

    # $TMPDIR on another filesystem: a rename between two directories fails as it does across mounts,
    # so a write-to-$TMPDIR-then-move becomes a copy into the checkpoints directory.
    real_rename = os.rename
    def rename(src, dst, *args, **kwargs):
        if os.path.dirname(os.path.abspath(src)) != os.path.dirname(os.path.abspath(dst)):
            raise OSError(errno.EXDEV, "Invalid cross-device link", src)
        return real_rename(src, dst, *args, **kwargs)
    os.rename = os.replace = rename
    shutil._USE_CP_SENDFILE = False  # copies go through file objects, like the writes of torch.save

    # The second file opened for writing in checkpoints/ gets half of its first write, then the process
    # dies (SIGKILL: no handler runs) or the disk is full.
    ckpt_dir = os.path.abspath(out / "checkpoints")
    real_open, opened = builtins.open, []
    class Interrupted:
        def __init__(self, f):
            self._f = f
        def write(self, data):
            data = bytes(data)
            self._f.write(data[: max(1, len(data) // 2)])
            self._f.flush()
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            raise OSError(errno.ENOSPC, "No space left on device")
        def __getattr__(self, name):
            return getattr(self._f, name)
        def __enter__(self):
            return self
        def __exit__(self, *exc):
            return self._f.__exit__(*exc)
    def patched_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if isinstance(file, (str, os.PathLike)) and ("w" in mode or "x" in mode):
            if os.path.dirname(os.path.abspath(file)) == ckpt_dir:
                opened.append(str(file))
                if len(opened) == 2:
                    return Interrupted(f)
        return f
    builtins.open = patched_open

    overrides = sys.argv[4:]
    train(compose_cfg("train", overrides, out))
    """
)


@pytest.mark.parametrize("mode", ["kill", "disk_full"])
def test_interrupted_checkpoint_write_leaves_no_truncated_file(tmp_path, mode):
    """A save interrupted half-way (SIGKILL, or ENOSPC) while $TMPDIR is on another filesystem: every .ckpt
    on disk is complete, last.ckpt holds the previous epoch, a resume finishes the run and removes the
    partial temporary file."""
    run, tmpdir = tmp_path / "run", tmp_path / "tmpdir"
    tmpdir.mkdir()
    script = tmp_path / "interrupted_save.py"
    script.write_text(_INTERRUPTED_SAVE)
    overrides = TINY_NET + QUIET + SMALL + ["trainer.max_epochs=2", "test=false"]
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", TMPDIR=str(tmpdir))
    how = "kill" if mode == "kill" else "enospc"
    proc = subprocess.run(
        [sys.executable, str(script), str(run), str(tmpdir), how, *overrides],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    if mode == "kill":
        assert proc.returncode == -9, proc.stderr[-3000:]
    else:
        assert proc.returncode == 1 and "No space left on device" in proc.stderr, proc.stderr[-3000:]
    names = _ckpts(run)
    assert "last.ckpt" in names
    for name in names:
        if name.endswith(".ckpt"):
            read_checkpoint(run / "checkpoints" / name)  # complete: raises on a truncated file
    assert _epoch(run / "checkpoints" / "last.ckpt") == 0
    partial = [n for n in names if not n.endswith(".ckpt")]
    assert len(partial) == (1 if mode == "kill" else 0), names  # a failed write cleans up after itself

    _, obj = train(compose_cfg("train", overrides + ["ckpt_path=last"], run))
    assert obj["trainer"].current_epoch == 2 and _epoch(run / "checkpoints" / "last.ckpt") == 1
    assert all(n.endswith(".ckpt") for n in _ckpts(run))


# -------------------------------------------------------------------------------------- run directories


def _new_run_dir(root, barrier, queue):
    barrier.wait()  # all four ask at once
    queue.put(run_mod.run_dir_for(root, None))


def test_concurrent_runs_get_distinct_directories(tmp_path, monkeypatch):
    """Four processes asking for a run directory at the same moment (the clock is frozen) get four."""
    monkeypatch.setattr(run_mod.time, "strftime", lambda fmt, *a: "2026-11-23_12-00-00")
    ctx = multiprocessing.get_context("fork")
    barrier, queue = ctx.Barrier(4), ctx.Queue()
    root = str(tmp_path / "runs")
    procs = [ctx.Process(target=_new_run_dir, args=(root, barrier, queue)) for _ in range(4)]
    for p in procs:
        p.start()
    dirs = [queue.get(timeout=60) for _ in procs]
    for p in procs:
        p.join(timeout=60)
    assert len(set(dirs)) == 4 and all(os.path.isdir(d) for d in dirs)
    assert sorted(os.path.basename(d) for d in dirs) == [
        "2026-11-23_12-00-00", "2026-11-23_12-00-00_1", "2026-11-23_12-00-00_2", "2026-11-23_12-00-00_3"
    ]


def test_run_dir_for_resumes_only_a_runs_own_last_checkpoint(tmp_path):
    runs = tmp_path / "train" / "runs"
    for name in ("old", "new"):
        (runs / name / "checkpoints").mkdir(parents=True)
        torch.save({}, runs / name / "checkpoints" / "last.ckpt")
        torch.save({}, runs / name / "checkpoints" / "epoch_000.ckpt")
        time.sleep(0.02)
    old_last = str(runs / "old" / "checkpoints" / "last.ckpt")
    run_mod._RUN_DIRS.clear()
    assert run_mod.run_dir_for(str(runs), "last") == str(runs / "new")
    assert run_mod.run_dir_for(str(runs), old_last) == str(runs / "old")
    fresh = run_mod.run_dir_for(str(runs), str(runs / "old" / "checkpoints" / "epoch_000.ckpt"))
    assert os.path.dirname(fresh) == str(runs) and os.path.basename(fresh) not in ("old", "new")
    # evaluating a training checkpoint never writes into the training run
    other = run_mod.run_dir_for(str(tmp_path / "eval" / "runs"), old_last)
    assert os.path.dirname(other) == str(tmp_path / "eval" / "runs")
    assert run_mod.run_dir_for(str(runs), "last") == str(runs / "new")  # fixed for the process


def test_cli_runs_get_their_own_directories_without_warnings(tmp_path):
    """Two `python train.py` started together: two run directories, no 'exists and is not empty' warning."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    args = TINY_NET + SMALL + [
        "trainer.max_epochs=1", "test=false", "logger=csv", "callbacks.progress_bar.refresh_rate=0",
        f"paths.log_dir={tmp_path}",
    ]
    procs = [
        subprocess.Popen([sys.executable, "train.py", *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
        assert "exists and is not empty" not in err and "will be deleted" not in err, err[-3000:]
    dirs = {os.path.basename(d) for d in (tmp_path / "train" / "runs").iterdir()}
    assert len(dirs) == 2, dirs
    for d in (tmp_path / "train" / "runs").iterdir():
        assert (d / "checkpoints" / "last.ckpt").is_file() and (d / "metrics.csv").is_file()
        assert (d / ".hydra" / "config.yaml").is_file()
        log = (d / "train.log").read_text()  # Lightning's records reach the run's log, with the command line
        assert "Seed set to 12345" in log and "command: train.py" in log


# ---------------------------------------------------------------------------------------- bad ckpt_path


def test_ckpt_path_that_is_not_a_checkpoint_says_so(tmp_path):
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.jpg")
    with pytest.raises(NotACheckpointError, match=r"photo\.jpg' is not a checkpoint: it is a JPEG image"):
        train(compose_cfg("train", TINY_NET + [f"ckpt_path={tmp_path / 'photo.jpg'}"], tmp_path / "r1"))
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointPathError, match="safetensors file of weights, not a training checkpoint"):
        train(compose_cfg("train", TINY_NET + [f"ckpt_path={tmp_path / 'w.safetensors'}"], tmp_path / "r2"))
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cli = subprocess.run(
        [sys.executable, "train.py", f"ckpt_path={tmp_path / 'photo.jpg'}", f"paths.log_dir={tmp_path}"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert cli.returncode != 0 and "Traceback" not in cli.stderr and "weights_only" not in cli.stderr
    assert cli.stderr.strip().splitlines()[-1].startswith("error: ")
    assert "photo.jpg' is not a checkpoint: it is a JPEG image" in cli.stderr.strip().splitlines()[-1]


def test_lightnings_checkpoint_io_refuses_what_ckpt_path_refuses(tmp_path):
    """SafeCheckpointIO (Lightning's loads) applies the same check as ckpt_path, without the argument name."""
    from safetensors.torch import save_file

    from elsa_vision.utils.run import SafeCheckpointIO

    io = SafeCheckpointIO()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "w.safetensors"))
    with pytest.raises(CheckpointPathError, match=r"^'.*w\.safetensors' is a safetensors file of weights"):
        io.load_checkpoint(tmp_path / "w.safetensors")
    with pytest.raises(FileNotFoundError, match=r"^'.*nope\.ckpt' does not exist"):
        io.load_checkpoint(tmp_path / "nope.ckpt")
    Image.new("RGB", (8, 8)).save(tmp_path / "photo.jpg")
    with pytest.raises(NotACheckpointError, match=r"^'.*photo\.jpg' is not a checkpoint: it is a JPEG image"):
        io.load_checkpoint(tmp_path / "photo.jpg")
    torch.save({"epoch": 2, "state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
    assert io.load_checkpoint(tmp_path / "last.ckpt")["epoch"] == 2


# ----------------------------------------------------------------------------- every task: fit, test, resume


def _hsi_files(tmp_path):
    from elsa_vision.data.hyperspectral import synthetic_scene

    cube, gt = synthetic_scene(height=20, width=16, bands=12, num_classes=3, block=4, noise=0.3, seed=7)
    scipy.io.savemat(tmp_path / "scene.mat", {"scene": cube})
    scipy.io.savemat(tmp_path / "scene_gt.mat", {"scene_gt": gt})
    return [f"data.path={tmp_path / 'scene.mat'}", f"data.gt_path={tmp_path / 'scene_gt.mat'}"]


_HSI_NET = [
    "data.patch_size=3", "model.net.spatial_patch=1", "model.net.embed_dim=16", "model.net.num_heads=2",
    "model.net.branch_depth=1", "model.net.fusion_depth=1", "data.batch_size=16",
]
TASKS = {
    "digits": TINY_NET,
    "hsi": ["model=elsa_hsi", "data=hsi", *_HSI_NET],
    "hsi_mae": ["experiment=hsi_mae", *_HSI_NET, "model.decoder_dim=16", "model.decoder_depth=1",
                "model.decoder_heads=2", "data.max_pretrain_samples=64"],
    "vggt_synthetic": [
        "experiment=vggt_synthetic", "data.train_size=4", "data.val_size=2", "data.test_size=2",
        "data.batch_size=2", "data.num_frames=2",
    ],
}


@pytest.mark.parametrize("task", sorted(TASKS))
def test_every_task_fits_tests_and_resumes_from_weights_only_checkpoints(tmp_path, task):
    extra = TASKS[task] + (_hsi_files(tmp_path) if task.startswith("hsi") else [])
    base = extra + QUIET + SMALL + ["trainer.min_epochs=1"]
    run = tmp_path / "run"
    first, _ = train(compose_cfg("train", base + ["trainer.max_epochs=1"], run))
    assert any(k.startswith("test/") for k in first), first
    for name in _ckpts(run):
        ckpt = torch.load(run / "checkpoints" / name, weights_only=True, map_location="cpu")
        assert ckpt["epoch"] == 0 and "optimizer_states" in ckpt
    second, obj = train(compose_cfg("train", base + ["trainer.max_epochs=2", "ckpt_path=last"], run))
    assert obj["run_dir"] == str(run) and obj["trainer"].current_epoch == 2
    assert any(k.startswith("test/") for k in second), second
    assert _epoch(run / "checkpoints" / "last.ckpt") == 1


def test_checkpoint_of_an_older_run_resumes_with_its_best_record(tmp_path):
    """A checkpoint from before val_acc_best was kept in the state_dict, written under ModelCheckpoint's state
    key (which RunCheckpoint keeps), still resumes strictly in its run with its best record (lr=0: epoch 0
    stays the best, so a lost record would make epoch 1 the best)."""
    logs = tmp_path / "logs"
    run = logs / "train" / "runs" / "old"
    base = TINY_NET + QUIET + SMALL + ["test=false", "model.optimizer.lr=0.0"]
    train(compose_cfg("train", base + ["trainer.max_epochs=1"], run, logs))
    last = run / "checkpoints" / "last.ckpt"
    ckpt = torch.load(last, weights_only=True, map_location="cpu")
    assert [k for k in ckpt["callbacks"] if k.startswith("ModelCheckpoint{")]
    del ckpt["state_dict"]["val_acc_best.max_value"]
    last.unlink()
    torch.save(ckpt, last)
    _, obj = train(compose_cfg("train", base + ["trainer.max_epochs=2", "ckpt_path=last"], run, logs))
    cb = obj["trainer"].checkpoint_callback
    assert obj["trainer"].current_epoch == 2
    assert cb.best_model_path == str(run / "checkpoints" / "epoch_000.ckpt")


# ------------------------------------------------------------------------------------ resume edge cases


def test_resume_after_a_torn_metrics_row(tmp_path):
    """A kill during a write of metrics.csv leaves a torn last row (no newline, fields missing): the resume
    drops it, the resumed epochs start on a line of their own, and the final test writes its row."""
    run = tmp_path / "run"
    base = TINY_NET + QUIET_CSV + SMALL
    train(compose_cfg("train", base + ["trainer.max_epochs=1", "test=false"], run))
    metrics_csv = run / "metrics.csv"
    with open(metrics_csv, "a", newline="") as f:
        f.write("1,3,,,,0.10")  # half of a row of the next epoch
    metrics, _ = train(compose_cfg("train", base + ["trainer.max_epochs=2", "ckpt_path=last"], run))
    assert "test/acc" in metrics and "train/loss" in metrics
    text = metrics_csv.read_text()
    assert text.endswith("\n") and "0.10\r" not in text and ",0.10," not in text
    rows = list(csv.reader(text.splitlines()))
    assert all(len(r) == len(rows[0]) for r in rows), rows
    epochs = sorted({int(float(r[rows[0].index("epoch")])) for r in rows[1:]})
    assert epochs == [0, 1, 2]  # epoch 0, the resumed epoch 1, the test logged at epoch 2


def test_resume_from_the_last_epochs_checkpoint_reports_the_runs_metrics(tmp_path):
    """Killed during the final test: the resume from the last epoch's checkpoint trains nothing more, tests,
    and reports the run's last train/val metrics and its best val/acc, as the uninterrupted run did."""
    run = tmp_path / "run"
    base = TINY_NET + QUIET_CSV + SMALL + ["trainer.max_epochs=2"]
    first, _ = train(compose_cfg("train", base + ["test=false"], run))
    metrics, obj = train(compose_cfg("train", base + ["ckpt_path=last"], run))
    assert obj["trainer"].current_epoch == 2 and "test/acc" in metrics
    for key in ("train/loss", "train/acc", "val/loss", "val/acc", "val/acc_best"):
        assert metrics[key] == pytest.approx(first[key], abs=1e-6), key


def test_ckpt_path_last_resumes_only_a_run_of_this_configuration(tmp_path):
    """`ckpt_path=last` after a run of another configuration (here: another network width, as the VGGT
    experiment's run is for the digits model) resumes the newest run of this configuration, or refuses in
    one line naming the run it found; the run-directory resolver picks the same run."""
    logs = tmp_path / "logs"
    runs = logs / "train" / "runs"
    base = QUIET + SMALL + ["test=false", "trainer.max_epochs=1", "model.net.depth=1",
                            "model.net.num_heads=2"]
    narrow, wide, other = ["model.net.embed_dim=16"], ["model.net.embed_dim=32"], ["model.net.embed_dim=24"]
    train(compose_cfg("train", base + narrow, runs / "narrow", logs))
    time.sleep(0.05)
    train(compose_cfg("train", base + wide, runs / "wide", logs))  # the newest run
    resume = base + ["ckpt_path=last", "trainer.max_epochs=2"]
    with pytest.raises(CheckpointPathError, match=r"^ckpt_path=last: the newest run with a last\.ckpt, "
                                                  r"'.*wide', was trained with another configuration "
                                                  r"\(model\.net\.embed_dim: 32 there, 24 here\)"):
        train(compose_cfg("train", resume + other, runs / "new", logs))
    _, obj = train(compose_cfg("train", resume + narrow, runs / "new", logs))
    assert obj["run_dir"] == str(runs / "narrow") and not (runs / "new").exists()
    assert _epoch(runs / "narrow" / "checkpoints" / "last.ckpt") == 1
    assert _epoch(runs / "wide" / "checkpoints" / "last.ckpt") == 0
    run_mod._RUN_DIRS.clear()
    cfg = compose_cfg("train", resume + narrow, runs / "new", logs)
    assert run_mod.run_dir_for(str(runs), "last", _root_=cfg) == str(runs / "narrow")
    cfg = compose_cfg("train", resume + other, runs / "x", logs)
    fresh = run_mod.run_dir_for(str(runs), "last", _root_=cfg)
    assert os.path.dirname(fresh) == str(runs) and os.path.basename(fresh) not in ("narrow", "wide")
    assert run_mod.discard_new_run_dir(fresh) and not os.path.exists(fresh)
    assert not run_mod.discard_new_run_dir(runs / "narrow") and (runs / "narrow").is_dir()
