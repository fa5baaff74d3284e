"""The LightningModule: a thin shell that wires the phases of `ghostdistill.pipeline` to Lightning's hooks.

It holds the model (the dense teacher and every view over the same blocks), the run's configuration and
its report. What each hook does is one phase call: calibration and the students are built by the
`Calibration` callback (`pipeline.calibrate`, `pipeline.train.build_students`) before any step;
`training_step` is `pipeline.train.distill_step`; validation is `pipeline.train.validate`; `test_step`
scores every view (`pipeline.evaluate`). Training-free runs (`trainer.max_steps: 0`) never reach
`fit`: no optimizer exists for them.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info

from ..core.model import ModelConfig, load_model, load_tokenizer
from ..core.views import DENSE, PrunedModel
from ..distill.config import DistillConfig
from ..distill.optim import clip_per_student, make_optimizer
from ..distill.parallel import ranks_agree
from ..distill.students import Students
from ..evaluation.tally import ViewTally
from ..methods import RecoveryConfig
from ..pipeline.calibrate import Dist
from ..pipeline.config import EvalConfig, RunConfig
from ..pipeline.evaluate import score_views, view_results, views_to_evaluate
from ..pipeline.train import BestSteps, check_checkpoint_keys, checkpoint_extras, distill_step, validate
from ..planning import PlanConfig
from ..reporting.report import RunReport

NO_DISTILL_METHODS = (
    "trainer.max_steps > 0 trains the students of model.distill.methods and model.distill.students, which are "
    "empty: name the methods to fine-tune (e.g. --model.distill.methods [ghost]) or set trainer.max_steps: 0"
)

# The model stays in eval mode while the students train (see `GhostDistill.train`): intended.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


class GhostDistill(LightningModule):
    """The model, its pruning plan, one view per recovery method and, when distilling, the students.

    Args:
        model: which model to load.
        plan: which layers go (explicit list or criterion).
        recovery: the recovery methods to fit and compare; each becomes a view (default: one `ghost`).
        evaluation: which views to evaluate, and how.
        distill: fine-tuned recovery (with `trainer.max_steps` > 0): which methods, what trains, how.
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        plan: PlanConfig = PlanConfig(num_layers=7),
        recovery: list[RecoveryConfig] | None = None,
        evaluation: EvalConfig = EvalConfig(),
        distill: DistillConfig = DistillConfig(),
    ) -> None:
        super().__init__()
        recovery = [RecoveryConfig()] if recovery is None else list(recovery)
        self.cfg = RunConfig(model=model, plan=plan, recovery=recovery, evaluation=evaluation, distill=distill)
        # Everything the values alone decide, before the model loads (with the data settings: `Calibration`).
        self.cfg.validate(data=False)
        self.save_hyperparameters(
            {
                k: asdict(v) if k != "recovery" else [asdict(r) for r in v]
                for k, v in vars(self.cfg).items()
                if k != "data"
            }
        )
        self.tokenizer = load_tokenizer(model)
        self.llm: torch.nn.Module | None = None
        self.pruned: PrunedModel | None = None
        self.students: Students | None = None
        self.report = RunReport(model=asdict(model))
        self.tracker = BestSteps()
        self.tally: ViewTally | None = None
        self._last_validated: int | None = None
        # FSDP2 leaves the LoRA adapters whole on every rank; their gradients are averaged here.
        self._replicated: tuple[list, object] | None = None
        # Checkpoints hold only what trains; the frozen base comes from `model.source` on resume.
        self.strict_loading = False

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Load the model once; under FSDP2 (`ModelParallelStrategy`) shard the students once they exist."""
        if self.llm is None:
            with self.report.timed("load_model"):
                self.llm = load_model(self.cfg.model)
                self.llm.requires_grad_(False)
            return
        from lightning.pytorch.strategies import ModelParallelStrategy

        if (
            self.students is not None
            and self._replicated is None
            and isinstance(self.trainer.strategy, ModelParallelStrategy)
        ):
            from ..distill.parallel import shard_for_fsdp2

            lora, group, units = shard_for_fsdp2(self.students, self.device_mesh)
            self._replicated = (lora, group)
            rank_zero_info(f"FSDP2: {units} units sharded over {self.trainer.world_size} ranks")

    def attach(self, pruned: PrunedModel, students: Students | None = None) -> None:
        """Take the calibrated views (and the students). Registered as children, so that every method's maps
        and the students' block copies move with the module and reach the optimizer and the checkpoints."""
        self.pruned, self.students = pruned, students
        self.operators, self.mlp_maps, self.student_blocks = pruned.operators, pruned.mlp_maps, pruned.blocks
        self.student_modules = pruned.modules_own

    @property
    def distilling(self) -> bool:
        try:
            trainer = self.trainer
        except RuntimeError:  # not attached to a Trainer
            return False
        return trainer is not None and trainer.max_steps != 0 and bool(self.cfg.distill.views())

    def dist(self) -> Dist:
        t = self.trainer
        return Dist(t.global_rank, t.world_size, lambda x: t.strategy.reduce(x, reduce_op="sum"), t.is_global_zero)

    def train(self, mode: bool = True):
        """The model stays in eval mode (the teacher and the students' frozen blocks never drop anything
        out); only the adapters' dropout follows `mode`."""
        super().train(mode)
        if self.llm is not None:
            self.llm.eval()
            for name, module in self.llm.named_modules():
                if mode and ".lora_dropout" in f".{name}":
                    module.train(True)
        return self

    # --------------------------------------------------------------- training
    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if not self.distilling or self.students is None:
            raise RuntimeError(NO_DISTILL_METHODS)
        start = time.perf_counter()
        losses = distill_step(self.students, batch)
        for view, loss in losses.items():
            self.log(f"train/{view}/loss", loss.detach(), on_step=True, prog_bar=len(losses) <= 2)
        tokens = float(batch["input_ids"][:, 1:].numel()) * self.trainer.world_size
        self.log("tok/s", tokens / max(time.perf_counter() - start, 1e-9), on_step=True, prog_bar=True)
        return torch.stack(list(losses.values())).sum()

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.students.params, self.cfg.distill, self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._replicated is not None:
            from ..distill.parallel import average_replicated_grads

            average_replicated_grads(*self._replicated)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_per_student(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # ------------------------------------------------------------- validation
    # Validation is `pipeline.train.validate`, called here rather than by Lightning's validation loop: that
    # loop cannot validate before the first step (its sanity check is not part of the history and reruns on
    # resume), does not validate after a last step that `val_check_interval` does not divide, and counts
    # batches, not optimizer steps, under gradient accumulation.
    def on_train_start(self) -> None:
        self.validate_students()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        every = self.cfg.distill.val_every
        if every and self.global_step % every == 0:
            self.validate_students()

    def on_train_end(self) -> None:
        self.validate_students()
        self.tracker.restore(self.students, self.cfg.distill.keep, self.global_step)
        self.report.distill = self.tracker.summary(
            self.cfg.distill, self.global_step, self.students.share_prefix, self.students
        )

    def validate_students(self) -> None:
        windows = self.trainer.datamodule.data.val_ids()
        if self._last_validated == self.global_step or windows is None:
            return
        self._last_validated = self.global_step
        dist = self.dist()
        was_training = self.training
        self.eval()
        try:
            entry = validate(
                self.students,
                windows,
                self.trainer.datamodule.batch_size,
                self.global_step,
                chunk=self.cfg.evaluation.logit_chunk,
                dist=dist,
                sync_check=(lambda ps: ranks_agree(ps, self.trainer.strategy.reduce)) if dist.world > 1 else None,
            )
        finally:
            self.train(was_training)
        self.tracker.record(entry, self.students)
        line = ", ".join(f"{v} KL {entry[v]['kl']:.4f} PPL {entry[v]['ppl']:.2f}" for v in self.students.views)
        rank_zero_info(f"validation at step {self.global_step}: {line}")

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Only what trains goes into the state dict, never the frozen base; the students by name, the
        validation history and each student's best step come along (`pipeline.train.checkpoint_extras`)."""
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        checkpoint["ghostdistill"] = checkpoint_extras(self.tracker, self.students, self._last_validated)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        # FSDP2 (ModelParallelStrategy) has loaded the weights itself by now and passes no state dict.
        check_checkpoint_keys(set(checkpoint["state_dict"]) if "state_dict" in checkpoint else trainable, trainable)
        extra = checkpoint.get("ghostdistill", {})
        self.tracker = BestSteps(list(extra.get("history", [])), dict(extra.get("best", {})))
        self._last_validated = extra.get("last_validated")

    # ------------------------------------------------------------- evaluation
    @property
    def views(self) -> list[str]:
        """The views `test` evaluates: `evaluation.views`, or all of them."""
        return views_to_evaluate(self.pruned.views if self.pruned is not None else [], self.cfg.evaluation.views)

    def on_test_start(self) -> None:
        sources = [s.label for s in self.trainer.datamodule.cfg.evaluation.sources]
        self.tally = ViewTally(self.views, sources, reference=DENSE).to(self.device)

    @torch.no_grad()
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        ids = batch["input_ids"]
        mask = batch.get("attention_mask", torch.ones_like(ids))
        # Windows added only to even out the ranks' shares are run but not counted (`EvenShares`).
        chunk, counted = self.cfg.evaluation.logit_chunk, batch.get("counted")
        scores = score_views(self.pruned, ids, mask, self.tally.views, chunk=chunk, counted=counted)
        for view in self.tally.views:
            self.tally.update(view, dataloader_idx, scores[view])

    def on_test_epoch_end(self) -> None:
        # `compute` adds the ranks' sums (torchmetrics' all-reduce, `dist_reduce_fx="sum"`) before the means.
        methods = {view: self.cfg.method_of(view) for view in self.tally.views}
        self.report.views = view_results(self.tally, self.pruned, methods)
