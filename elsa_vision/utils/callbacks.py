"""Callbacks used by the default training configs."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Any

from lightning.fabric.utilities.cloud_io import _is_local_file_protocol
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint, RichModelSummary, RichProgressBar, TQDMProgressBar
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_summary import get_formatted_model_size, get_human_readable_count

from ..files import link_atomically, remove_stale_temp_files

__all__ = ["EpochSeed", "RunCheckpoint", "RunModelSummary", "StderrTQDMProgressBar", "progress_bar"]


class RunCheckpoint(ModelCheckpoint):
    """Lightning's ``ModelCheckpoint`` whose ``last.ckpt`` is always the latest epoch, stored once.

    * ``save_last=True`` in Lightning writes ``last.ckpt`` only in steps where a top-k checkpoint was
      written, so with a monitored metric that stops improving ``last.ckpt`` falls behind. Here ``last.ckpt``
      is written at the end of every epoch (every validation, or every training epoch without one), whether
      or not the monitored metric improved.
    * When the newest epoch is also a top-k checkpoint, ``last.ckpt`` becomes a hard link to that file (one
      copy on disk, two names; deleting either name keeps the other) instead of a second write of the same
      state. Where hard links are unavailable (remote filesystems, sharded checkpoint directories) it is
      written as a file, as Lightning does.
    * Temporary files left by a process killed in the middle of a save (see
      :func:`elsa_vision.files.atomic_torch_save`) are removed when fitting starts.

    Every other argument and behaviour is ``ModelCheckpoint``'s; ``ckpt_path="last"`` resumes as usual.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._last_written_step = -1

    @property
    def state_key(self) -> str:
        # ModelCheckpoint's key: runs checkpointed by a plain ModelCheckpoint resume with their best record
        return super().state_key.replace(type(self).__qualname__, ModelCheckpoint.__qualname__, 1)

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        local = self.dirpath is not None and _is_local_file_protocol(self.dirpath)
        if trainer.is_global_zero and stage == "fit" and local:
            remove_stale_temp_files(self.dirpath)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._keep_last_current(trainer)

    def _keep_last_current(self, trainer: Trainer) -> None:
        if (
            not self.save_last
            or trainer.fast_dev_run
            or trainer.state.fn != TrainerFn.FITTING
            or trainer.sanity_checking
            or self._last_written_step == trainer.global_step
            or trainer.global_step == 0
        ):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    def _save_topk_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
        if self.save_last and not self.last_model_path:
            # the name last.ckpt will get, so that a top-k file and last.ckpt hold the same callback state
            self.last_model_path = self.format_checkpoint_name(monitor_candidates, self.CHECKPOINT_NAME_LAST)
        super()._save_topk_checkpoint(trainer, monitor_candidates)

    def _save_last_checkpoint(self, trainer: Trainer, monitor_candidates: dict) -> None:
        super()._save_last_checkpoint(trainer, monitor_candidates)
        self._last_written_step = trainer.global_step

    def _save_checkpoint(self, trainer: Trainer, filepath: str) -> None:
        source = self._last_checkpoint_saved
        same_state = (
            filepath == self.last_model_path
            and source
            and os.path.abspath(source) != os.path.abspath(filepath)
            and self._last_global_step_saved == trainer.global_step
            and _is_local_file_protocol(filepath)
        )
        if same_state:
            linked = False
            if trainer.is_global_zero and os.path.isfile(source):
                linked = link_atomically(source, filepath)
            linked = trainer.strategy.broadcast(linked)
            if linked:
                self._last_checkpoint_saved = filepath
                if trainer.is_global_zero:
                    for logger in trainer.loggers:
                        logger.after_save_checkpoint(self)
                trainer.strategy.barrier()
                return
        super()._save_checkpoint(trainer, filepath)


class EpochSeed(Callback):
    """Reseed Python, NumPy and torch at the start of every training epoch from ``(seed, epoch, rank)``.

    Everything random inside epoch ``e`` (shuffling, augmentation, dropout, mixup) then depends only on the
    seed, the epoch and the process rank, not on how many random numbers earlier epochs, validation or a
    restart consumed: a run resumed from an end-of-epoch checkpoint replays exactly the epochs an
    uninterrupted run would have. (DataLoader workers derive their seeds from the reseeded torch generator.)
    """

    def __init__(self, seed: int = 12345) -> None:
        self.seed = int(seed)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        epoch_seed = (self.seed + 1_000_003 * trainer.current_epoch + 7919 * trainer.global_rank) % (2**32)
        seed_everything(epoch_seed, workers=True, verbose=False)


def _on_stderr(init):
    def init_on_stderr(self):
        with contextlib.redirect_stdout(sys.stderr):  # Lightning passes file=sys.stdout to every bar
            return init(self)

    init_on_stderr.__doc__ = f"{init.__doc__} (On stderr.)"
    return init_on_stderr


class StderrTQDMProgressBar(TQDMProgressBar):
    """Lightning's ``TQDMProgressBar`` writing its bars to stderr instead of stdout: progress is not a result.
    With stdout redirected, the bar's carriage-return updates (half a megabyte for the digits default) no
    longer fill the file, whose last line stays the run's JSON line."""

    init_sanity_tqdm = _on_stderr(TQDMProgressBar.init_sanity_tqdm)
    init_train_tqdm = _on_stderr(TQDMProgressBar.init_train_tqdm)
    init_predict_tqdm = _on_stderr(TQDMProgressBar.init_predict_tqdm)
    init_validation_tqdm = _on_stderr(TQDMProgressBar.init_validation_tqdm)
    init_test_tqdm = _on_stderr(TQDMProgressBar.init_test_tqdm)


def progress_bar(refresh_rate: int = 1, leave: bool = False):
    """``RichProgressBar`` on an interactive terminal, otherwise (stdout a file or a pipe) the TQDM bar on
    stderr (:class:`StderrTQDMProgressBar`)."""
    if sys.stdout.isatty():
        return RichProgressBar(refresh_rate=refresh_rate, leave=leave)
    return StderrTQDMProgressBar(refresh_rate=refresh_rate, leave=leave)


class RunModelSummary(RichModelSummary):
    """Lightning's ``RichModelSummary`` without a FLOPs column and total when no FLOPs were counted.

    Lightning counts FLOPs on a forward of the module's ``example_input_array``; without one (none of the
    task modules sets it: ELSA's attention operator has no FLOP formula, so a count would leave attention
    out) every count is 0 and the summary printed ``Total FLOPs: 0``, which reads as a measurement. With
    counted FLOPs the summary is Lightning's.
    """

    @staticmethod
    def summarize(
        summary_data: list[tuple[str, list[str]]],
        total_parameters: int,
        trainable_parameters: int,
        model_size: float,
        total_training_modes: dict[str, int],
        total_flops: int,
        **summarize_kwargs: Any,
    ) -> None:
        if total_flops:
            RichModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                       total_training_modes, total_flops, **summarize_kwargs)
            return
        from rich import get_console
        from rich.table import Table

        columns = [(name, values) for name, values in summary_data if name != "FLOPs"]
        table = Table(header_style=summarize_kwargs.get("header_style", "bold magenta"))
        for name, _ in columns:
            table.add_column(name, style="dim" if name == " " else None,
                             justify="left" if name in (" ", "Name", "Type", "Mode") else "right")
        for row in zip(*(values for _, values in columns)):
            table.add_row(*row)
        grid = Table.grid(expand=True)
        grid.add_column()
        for label, value in (
            ("Trainable params", get_human_readable_count(int(trainable_parameters))),
            ("Non-trainable params", get_human_readable_count(int(total_parameters - trainable_parameters))),
            ("Total params", get_human_readable_count(int(total_parameters))),
            ("Total estimated model params size (MB)", get_formatted_model_size(model_size)),
            ("Modules in train mode", total_training_modes["train"]),
            ("Modules in eval mode", total_training_modes["eval"]),
        ):
            grid.add_row(f"[bold]{label}[/]: {value}")
        console = get_console()
        console.print(table)
        console.print(grid)
