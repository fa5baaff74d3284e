"""The Lightning callbacks that call the run's phases (`pipeline.run.Run`, which owns their order) around the
loop: `Calibration` (`Run.prepare`: setup, plan, calibrate, fit and the students, before any step), `Report`
(`Run.finish`: zero-shot, analyses, results files, after `test`) and `Export` (the chosen views in their
formats, after the report)."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from ..distill.config import DistillConfig
from ..distill.interface import get_part
from ..export.formats import format_keys
from ..export.options import CONFIG_NAMES, ExportOptions, check_ignored
from ..pipeline.config import RunConfig
from ..pipeline.export import check_export
from .module import GhostDistill


class Calibration(Callback):
    """plan → statistics → operators (→ students), once, before the first step or test batch.

    Statistics are checkpointed to `<run>/calibration_state.pt` every `checkpoint_every` batches, keyed
    by a fingerprint of everything they depend on, so an interrupted run resumes where it stopped. With
    several processes only rank 0 writes the file.

    Args:
        checkpoint_every: batches between statistics checkpoints (0: only at the end).
        progress: show progress bars.
    """

    def __init__(self, checkpoint_every: int = 8, progress: bool = True) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"calibration.checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.progress = progress
        self.done = False

    def setup(self, trainer: Trainer, pl_module: GhostDistill, stage: str) -> None:
        if self.done:
            return
        run = pl_module.run
        check_before_run(trainer, pl_module)
        check_strategy(trainer, run.cfg.distill)
        run.progress, run.write = partial(tqdm, disable=not self.progress), trainer.is_global_zero
        run.device = trainer.strategy.root_device  # where an offloaded model's blocks are brought

        def place() -> None:
            pl_module.configure_model()  # registers the run's model
            # The strategy moves the module only after setup; calibrating an 8B model on the CPU would crawl.
            pl_module.to(trainer.strategy.root_device)

        run.prepare(
            trainer.default_root_dir,
            distilling=pl_module.distilling,
            dist=pl_module.dist(),
            checkpoint_every=self.checkpoint_every,
            place=place,
        )
        pl_module.attach()
        self.done = True


def check_before_run(trainer: Trainer, pl_module: GhostDistill) -> None:
    """What the settings alone decide about the end of the run, before the model loads (`RunConfig.preflight`:
    the step count, unbuilt views, offload with this execution), and the export's formats and folders (the
    export runs last, after hours of work)."""
    exports = [callback for callback in trainer.callbacks if isinstance(callback, Export)]
    pl_module.run.cfg.preflight(
        trainer.max_steps,
        world_size=trainer.world_size,
        fsdp2=isinstance(trainer.strategy, ModelParallelStrategy),
        views={"export.views": [v for callback in exports for v in callback.options.views]},
    )
    for callback in exports:
        callback.check(trainer, pl_module.run.cfg)


def check_strategy(trainer: Trainer, distill: DistillConfig | None = None) -> None:
    """Strategies the views work with: single device, DDP, FSDP2 (`ModelParallelStrategy`; not for students
    that train a part FSDP2 does not shard, `Part.fsdp`: their own head or norms)."""
    strategy = trainer.strategy
    if isinstance(strategy, FSDPStrategy):
        raise ValueError(
            "FSDPStrategy (FSDP1) wraps the decoder blocks in new modules, which the views' block references "
            "would bypass, and it costs gradient memory for frozen parameters that share a unit with trainable "
            "ones: use FSDP2, `trainer.strategy: {class_path: lightning.pytorch.strategies.ModelParallelStrategy, "
            "init_args: {save_distributed_checkpoint: false}}`, or ddp"
        )
    if "deepspeed" in type(strategy).__name__.lower() and getattr(strategy, "zero_stage_3", False):
        raise ValueError(
            "DeepSpeed ZeRO-3 with the teacher inside the module crashes in Lightning; use ZeRO-2, ddp or FSDP2"
        )
    specs = distill.specs() if distill else []
    own = {s.name: kinds for s in specs if (kinds := [k for k in s.train if get_part(k).fsdp == "refuse"])}
    if isinstance(strategy, ModelParallelStrategy) and own and trainer.max_steps != 0:
        raise ValueError(
            f"students {list(own)} train their own output head, final norm or norm gains (distill.train "
            f"{', '.join(sorted({k for kinds in own.values() for k in kinds}))}), which FSDP2 (ModelParallelStrategy) "
            "does not shard here yet: train them with ddp or on one device"
        )
    if isinstance(strategy, ModelParallelStrategy) and distill and distill.teacher_topk and trainer.max_steps != 0:
        # A rank whose windows are cached would skip a teacher pass that the others run, and every sharded
        # forward is a collective of all ranks.
        raise ValueError(
            f"distill.teacher_topk {distill.teacher_topk} with FSDP2 (ModelParallelStrategy) is not supported yet: "
            "the ranks would disagree on when the sharded teacher runs; set distill.teacher_topk: null, or use ddp"
        )


class Report(Callback):
    """After `test`: zero-shot (when enabled), the analyses, then results.json, results.md and the plots."""

    def on_test_end(self, trainer: Trainer, pl_module: GhostDistill) -> None:
        pl_module.run.finish(pl_module.global_step)


class Export(Callback):
    """Write views of the run in the registered export formats after the report (rank 0 writes); its
    arguments are `export.options.ExportOptions`' keys (the `export` command's options too)."""

    __doc__ += "\n" + ExportOptions.__doc__.split("\n\n", 1)[1]  # its Args, for the config's help

    def __init__(
        self,
        views: list[str] | None = None,
        dir: str | None = None,
        overwrite: bool = False,
        format: list[str] | None = None,
        gguf_types: list[str] | None = None,
        imatrix: bool = True,
        schemes: list[str] | None = None,
        quantize_python: str | None = None,
        format_options: dict | None = None,
    ) -> None:
        given = {"format": format, "gguf_types": gguf_types, "schemes": schemes}
        lists = {k: list(v) for k, v in given.items() if v is not None}
        self.options = ExportOptions(
            list(views or []), dir, overwrite, imatrix=imatrix, quantize_python=quantize_python,
            format_options=format_options, **lists,
        )  # fmt: skip
        # What the config sets of the options only one format reads (`check_ignored`: refused without it).
        given.update(imatrix=None if imatrix else False, quantize_python=quantize_python)
        self.given = [k for k in format_keys() if given.get(k) is not None]

    def root(self, trainer: Trainer) -> Path:
        return self.options.root(trainer.default_root_dir)

    def check(self, trainer: Trainer, cfg: RunConfig) -> None:
        """Bad view names, formats and folders that would not be replaced or cannot be written fail before the
        run (`check_before_run`, before any data is read), not after it."""
        if not self.options.views:
            return
        check_ignored(self.options, self.given, CONFIG_NAMES)
        # Rank 0 writes, and alone tries the folders (ranks probing one new folder at once race).
        root = self.root(trainer) if trainer.is_global_zero else None
        check_export(cfg, self.options, root, flag="export.overwrite: true", key="export.views")

    def on_test_end(self, trainer: Trainer, pl_module: GhostDistill) -> None:
        # A sharded model's blocks are gathered from every rank: all of them export, rank 0 writes.
        if not self.options.views or not (trainer.is_global_zero or pl_module.run.sharded):
            return
        for path in pl_module.run.export(self.options, self.root(trainer)):
            rank_zero_info(f"exported {path}")
