"""Resumable distillation: `<run>/checkpoints/last.ckpt`, written atomically with Lightning's public
`Trainer.save_checkpoint`, and `--ckpt_path last` resolved to it when it can be resumed from.

The module keeps only trainable tensors and plain data in it (`GhostDistill.state_dict`, `on_save_checkpoint`),
so it loads with `weights_only=True`: resuming from, or exporting, a run folder someone sent you runs none of
their code. The run's `config.yaml` is the other half of that promise: `pipeline.trust`.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..core.io import disk_space
from .interrupts import Terminated, hold_signals, release_signals

LAST = "last.ckpt"


class LastCheckpoint(Callback):
    """`dirpath/last.ckpt` every `every_n_train_steps` optimizer steps, after the final step, and when SIGTERM or
    SIGINT stops distillation (one process): the step reached, not the last periodic one. Written beside the
    target and renamed, so an interrupted save leaves the previous file.

    A stopped run's step is whole: signals wait (`lit.interrupts.hold_signals`) from `on_before_optimizer_step`
    to `on_train_batch_end` (where the periodic checkpoints are taken too), so the students, optimizer and
    scheduler are those of `trainer.global_step`, by which the training windows are indexed
    (`lit.datamodule.StepWindows`): `--ckpt_path last` continues with the batches the stopped run had not
    finished, as an uninterrupted run takes them."""

    def __init__(self, dirpath: Path, every_n_train_steps: int) -> None:
        # `every_n_train_steps` >= 1: `distill.checkpoint_every` (>= 0, `DistillConfig.validate`) or the step count.
        self.path = Path(dirpath) / LAST
        self.every = every_n_train_steps
        self._saved_step: int | None = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._saved_step = trainer.global_step  # a resumed run's step is already on disk (step 0 holds nothing)

    def on_before_optimizer_step(self, trainer: Trainer, pl_module: LightningModule, optimizer) -> None:
        hold_signals()

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        release_signals()  # the step's update is done: a signal that waited for it raises now
        step = trainer.global_step
        if step != self._saved_step and (step % self.every == 0 or step == trainer.max_steps):
            self.save(trainer)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        release_signals()

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """SIGTERM or Ctrl-C during distillation: save the step reached. Several processes keep the last
        periodic checkpoint: a save takes every process, which an exception on one cannot gather."""
        release_signals(raise_pending=False)
        step = trainer.global_step
        if not isinstance(exception, (Terminated, KeyboardInterrupt)) or self._saved_step in (None, step):
            return
        if trainer.world_size > 1:
            rank_zero_info(
                f"stopped at step {step}: with {trainer.world_size} processes {self.path} keeps the last periodic "
                f"checkpoint (step {self._saved_step}); --ckpt_path last resumes from it"
            )
            return
        self.save(trainer)
        rank_zero_info(f"stopped at step {step}: saved to {self.path}; add --ckpt_path last to the command to resume")

    def save(self, trainer: Trainer) -> None:
        tmp = self.path.with_name(self.path.name + ".tmp")
        if trainer.is_global_zero:
            self.path.parent.mkdir(parents=True, exist_ok=True)
        with disk_space(f"the distillation checkpoint {self.path}", self.path.parent):
            try:
                # optimizer too; every rank takes part, rank 0 writes
                trainer.save_checkpoint(tmp, weights_only=False)
                if trainer.is_global_zero:
                    os.replace(tmp, self.path)
            except BaseException:
                tmp.unlink(missing_ok=True)
                raise
        trainer.strategy.barrier()
        self._saved_step = trainer.global_step


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why the checkpoint at `path` cannot be resumed from (unreadable, holds more than tensors and plain
    data, or not written by ghostdistill), or None when it can."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # noqa: BLE001 - any failure to load means the same: not resumable
        return f"cannot be read with weights_only=True ({type(err).__name__}: {str(err)[:200]})"
    if not isinstance(ckpt, dict) or "state_dict" not in ckpt or "global_step" not in ckpt:
        return "is not a Lightning checkpoint"
    if "students" not in ckpt.get("ghostdistill", {}):
        return "was not written by this version of ghostdistill (no 'ghostdistill.students' entry)"
    return None


def resolve_ckpt_path(ckpt_path: str | None, run_dir: Path, is_zero: bool = True) -> str | None:
    """`--ckpt_path last` is `<run>/checkpoints/last.ckpt` when it exists and can be resumed from; a truncated,
    corrupt or foreign file is renamed `<name>.unusable` with a warning and distillation starts from step 0.
    Any other value is passed on as it is."""
    if ckpt_path != "last":
        return ckpt_path
    path = run_dir / "checkpoints" / LAST
    if not path.is_file():
        rank_zero_info(f"--ckpt_path last: {path} does not exist yet; distillation starts from step 0")
        return None
    why = checkpoint_problem(path)
    if why is None:
        return str(path)
    if is_zero:
        os.replace(path, f"{path}.unusable")
    rank_zero_warn(f"{path} {why}: moved to {path}.unusable; distillation starts from step 0")
    return None
