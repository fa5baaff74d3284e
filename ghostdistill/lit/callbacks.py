"""The Lightning callbacks that call the run's phases (`pipeline.run.Run`) around the loop: `Calibration`
(setup, plan, calibrate, fit and the students, before any step), `Report` (zero-shot, analyses, results
files, after `test`) and `Export` (Hugging Face folders of chosen views, after the report)."""

from __future__ import annotations

from pathlib import Path

from lightning.pytorch import Callback, Trainer
from lightning.pytorch.utilities import rank_zero_info
from tqdm.auto import tqdm

from ..distill.config import DistillConfig
from ..distill.interface import get_part
from ..export.compressed import DEFAULT_SCHEMES
from ..export.gguf import DEFAULT_GGUF_TYPES
from ..pipeline.calibrate import OFFLOAD_ONE_DEVICE
from ..pipeline.config import RunConfig
from ..pipeline.export import check_targets, check_views
from ..pipeline.state import STATE_FILE
from ..pipeline.train import students_offloaded
from .module import NO_DISTILL_METHODS, GhostDistill


class Calibration(Callback):
    """plan → statistics → operators (→ students), once, before the first step or test batch.

    Statistics are checkpointed to `<run>/calibration_state.pt` every `checkpoint_every` batches, keyed
    by a fingerprint of everything they depend on, so an interrupted run resumes where it stopped. With
    several processes only rank 0 writes the file.

    Args:
        checkpoint_every: batches between statistics checkpoints (0: only at the end).
        progress: show progress bars.
    """

    STATE_FILE = STATE_FILE

    def __init__(self, checkpoint_every: int = 8, progress: bool = True) -> None:
        if checkpoint_every < 0:
            raise ValueError(f"calibration.checkpoint_every must be >= 0, got {checkpoint_every}")
        self.checkpoint_every = checkpoint_every
        self.progress = progress
        self.done = False

    def _bar(self, items, desc: str):
        return tqdm(items, desc=desc, disable=not self.progress)

    def setup(self, trainer: Trainer, pl_module: GhostDistill, stage: str) -> None:
        if self.done:
            return
        run = pl_module.run
        check_before_run(trainer, pl_module)
        check_strategy(trainer, run.cfg.distill)
        run.progress, run.write = self._bar, trainer.is_global_zero
        run.device = trainer.strategy.root_device  # where an offloaded model's blocks are brought
        run.setup(trainer.default_root_dir, distilling=pl_module.distilling)
        pl_module.configure_model()  # registers the run's model
        # The strategy moves the module only after setup; calibrating an 8B model on the CPU would crawl.
        pl_module.to(trainer.strategy.root_device)
        run.calibrate(dist=pl_module.dist(), checkpoint_every=self.checkpoint_every)
        if pl_module.distilling:
            run.build_students()  # students start from their method's closed form, before the optimizer exists
        pl_module.attach()
        self.done = True


def check_before_run(trainer: Trainer, pl_module: GhostDistill) -> None:
    """What the settings alone decide about the end of the run, before the model loads: the step count,
    and the export's views and folders (the export runs last, after hours of work)."""
    if trainer.max_steps < 0:
        raise ValueError(
            f"trainer.max_steps {trainer.max_steps}: set 0 (training-free) or the number of distillation steps"
        )
    cfg = pl_module.run.cfg
    if trainer.max_steps > 0 and not cfg.distill.views():
        raise RuntimeError(NO_DISTILL_METHODS)
    unbuilt = [v for v in cfg.evaluation.views if v in cfg.distill.views() and trainer.max_steps == 0]
    if unbuilt:
        raise ValueError(f"evaluation.views {unbuilt} are fine-tuned views, which trainer.max_steps 0 does not build")
    offload = cfg.model.offload
    if offload != "none" and trainer.world_size > 1:
        raise ValueError(OFFLOAD_ONE_DEVICE)
    if offload != "none" and trainer.max_steps > 0:
        raise ValueError(students_offloaded(offload))
    for callback in trainer.callbacks:
        if isinstance(callback, Export):
            callback.check(trainer, pl_module.run.cfg)


def check_strategy(trainer: Trainer, distill: DistillConfig | None = None) -> None:
    """Strategies the views work with: single device, DDP, FSDP2 (`ModelParallelStrategy`; not for students
    that train a part FSDP2 does not shard, `Part.fsdp`: their own head or norms)."""
    from lightning.pytorch.strategies import FSDPStrategy, ModelParallelStrategy

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
    refused = {
        s.name: [k for k in s.train if get_part(k).fsdp == "refuse"] for s in (distill.specs() if distill else [])
    }
    own = {name: kinds for name, kinds in refused.items() if kinds}
    if isinstance(strategy, ModelParallelStrategy) and own and trainer.max_steps != 0:
        raise ValueError(
            f"students {list(own)} train their own output head, final norm or norm gains (distill.train "
            f"{', '.join(sorted({k for kinds in own.values() for k in kinds}))}), which FSDP2 (ModelParallelStrategy) "
            "does not shard here yet: train them with ddp or on one device"
        )


class Report(Callback):
    """After `test`: zero-shot (when enabled), the analyses, then results.json, results.md and the plots."""

    def on_test_end(self, trainer: Trainer, pl_module: GhostDistill) -> None:
        run = pl_module.run
        run.zeroshot(pl_module.global_step)
        run.analyse()
        run.write_report()


class Export(Callback):
    """Write views of the run as Hugging Face folders and GGUF files after the report (rank 0 writes).

    Args:
        views: views to export (e.g. ``[ghost, ghost_ft]``); empty exports nothing.
        dir: parent folder of the exported views (one sub-folder per view); default ``<run>/export``.
        overwrite: replace existing folders and files.
        format: what to write per view, one or more of ``hf`` (the folder ``<dir>/<view>``), ``gguf``
            (``<dir>/<view>.<type>.gguf`` for llama.cpp; plain views only) and ``compressed-tensors``
            (``<dir>/<view>.<scheme>`` for vLLM, quantized by llm-compressor in its own environment).
        gguf_types: the GGUF files' types: ``F32``, ``F16``, ``Q8_0`` (written by ghostdistill) and llama.cpp's
            llama-quantize types (``Q6_K``, ``Q5_K_M``, ``Q4_K_M``, …; `export.quantize`).
        imatrix: k-quants with an importance matrix over the run's calibration windows (false: without).
        schemes: the compressed-tensors schemes, of ``W8A8``, ``W4A16``, ``W4A16-AWQ``, ``W8A16``.
    """

    def __init__(
        self,
        views: list[str] | None = None,
        dir: str | None = None,
        overwrite: bool = False,
        format: list[str] | None = None,
        gguf_types: list[str] | None = None,
        imatrix: bool = True,
        schemes: list[str] | None = None,
    ) -> None:
        self.views = list(views or [])
        self.dir = dir
        self.overwrite = overwrite
        self.format = list(format) if format is not None else ["hf"]
        self.gguf_types = list(gguf_types) if gguf_types is not None else list(DEFAULT_GGUF_TYPES)
        self.imatrix = imatrix
        self.schemes = list(schemes) if schemes is not None else list(DEFAULT_SCHEMES)

    def root(self, trainer: Trainer) -> Path:
        return Path(self.dir) if self.dir else Path(trainer.default_root_dir) / "export"

    def check(self, trainer: Trainer, cfg: RunConfig) -> None:
        """Bad view names and folders that would not be replaced or cannot be written fail before the run
        (`cli.run_fit` calls this before any data is read), not after it."""
        if not self.views:
            return
        bad = [v for v in self.views if v not in cfg.views()]
        if bad:
            raise ValueError(f"export.views {bad} are not views of this run; its views are {cfg.views()}")
        unbuilt = [v for v in self.views if v in cfg.distill.views() and trainer.max_steps == 0]
        if unbuilt:
            raise ValueError(
                f"export.views {unbuilt} are fine-tuned views, which trainer.max_steps 0 does not build: set "
                "trainer.max_steps, or export them later from the run folder of a run that distils"
            )
        check_views(
            cfg, self.views, formats=self.format, gguf_types=self.gguf_types, imatrix=self.imatrix, schemes=self.schemes
        )
        if not trainer.is_global_zero:
            return  # rank 0 writes, and alone tries the folders (ranks probing one new folder at once race)
        check_targets(
            self.root(trainer),
            self.views,
            self.overwrite,
            "export.overwrite: true",
            self.format,
            self.gguf_types,
            self.schemes,
        )

    def setup(self, trainer: Trainer, pl_module: GhostDistill, stage: str) -> None:
        self.check(trainer, pl_module.run.cfg)  # `check_before_run` has done so already when `Calibration` runs

    def on_test_end(self, trainer: Trainer, pl_module: GhostDistill) -> None:
        # A sharded model's blocks are gathered from every rank: all of them export, rank 0 writes.
        if not self.views or not (trainer.is_global_zero or pl_module.run.sharded):
            return
        for path in pl_module.run.export(
            self.views,
            self.root(trainer),
            overwrite=self.overwrite,
            seed=_seed(trainer),
            formats=self.format,
            gguf_types=self.gguf_types,
            imatrix=self.imatrix,
            schemes=self.schemes,
        ):
            rank_zero_info(f"exported {path}")


def _seed(trainer: Trainer) -> int | None:
    import yaml

    config = Path(trainer.default_root_dir) / "config.yaml"
    return (yaml.safe_load(config.read_text()) or {}).get("seed_everything") if config.is_file() else None
