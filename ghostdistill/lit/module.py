"""The LightningModule: a thin shell around the run (`self.run`, a `pipeline.run.Run`) for Lightning's hooks.

The run holds the state (the model, every view, the students, the report) and the phases; each hook here
is one phase call: `training_step` is `Run.distill_step`; validation is `Run.validate`; `test_step` is
`Run.score_batch`. The module registers the run's model and views as children, so that they move with it
and reach the optimizer and the checkpoints. Calibration and the students are built by the `Calibration`
callback before any step. Training-free runs (`trainer.max_steps: 0`) never reach `fit`: no optimizer
exists for them.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from ..core.model import ModelConfig, decoder_stack
from ..core.offload import is_offloaded
from ..core.views import PrunedModel
from ..data.config import DataConfig
from ..distill.config import DistillConfig
from ..distill.optim import clip_per_student, make_optimizer
from ..distill.parallel import average_replicated_grads, ranks_agree, shard_for_fsdp2, shard_mesh
from ..methods import RecoveryConfig
from ..pipeline.calibrate import Dist
from ..pipeline.config import EvalConfig, RunConfig
from ..pipeline.run import Run
from ..pipeline.train import BestSteps, check_checkpoint_keys, checkpoint_extras
from ..planning import PlanConfig

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
        data: DataConfig | None = None,
    ) -> None:
        super().__init__()
        recovery = [RecoveryConfig()] if recovery is None else list(recovery)
        # `data` is the data module's settings, linked in by `runner.fit` when it is built: the run's config
        # is complete (and validated, by `Run`) before anything loads.
        cfg = RunConfig(model, plan, recovery, evaluation, distill, data if data is not None else DataConfig())
        self._hold(Run(cfg, log=rank_zero_info, warn=rank_zero_warn))

    @classmethod
    def from_run(cls, run: Run) -> GhostDistill:
        """The module around a run built elsewhere (`lit.trainer.fit_run`: a typed config, perhaps a model
        object already loaded), instead of one it builds from its arguments."""
        module = cls.__new__(cls)
        LightningModule.__init__(module)
        module._hold(run)
        return module

    def _hold(self, run: Run) -> None:
        self.run, cfg = run, run.cfg
        self.save_hyperparameters(
            {k: asdict(v) if k != "recovery" else [r.as_dict() for r in v] for k, v in vars(cfg).items() if k != "data"}
        )
        self.llm: torch.nn.Module | None = None
        # FSDP2 leaves the LoRA adapters whole on every rank; their gradients are averaged here.
        self._replicated: tuple[list, object] | None = None
        # Checkpoints hold only what trains; the frozen base comes from `model.source` on resume.
        self.strict_loading = False

    @property
    def cfg(self) -> RunConfig:
        return self.run.cfg

    def configure_model(self) -> None:
        """Load the model once (registered here, so it moves with the module); under FSDP2
        (`ModelParallelStrategy`) its blocks are sharded as it loads, and the students once they exist."""
        strategy = self._trainer.strategy if self._trainer is not None else None
        fsdp2 = isinstance(strategy, ModelParallelStrategy)
        if self.llm is None:
            llm = self.run.load(shard_mesh(self.device_mesh), strategy.root_device) if fsdp2 else self.run.load()
            if is_offloaded(llm):
                # Not a child: its weights stay off the device (`core.offload`); moving the module moves its views.
                self.__dict__["llm"] = llm
            else:
                self.llm = llm
            if fsdp2:
                blocks = len(decoder_stack(self.llm).layers)
                rank_zero_info(
                    f"FSDP2: the model's {blocks} blocks sharded over {strategy.world_size} ranks as it loads"
                )
            return
        students = self.run.students
        if students is not None and self._replicated is None and fsdp2:
            lora, group, units = shard_for_fsdp2(students, shard_mesh(self.device_mesh))
            self._replicated = (lora, group)
            rank_zero_info(f"FSDP2: {units} units sharded over {self.trainer.world_size} ranks")

    def attach(self, pruned: PrunedModel | None = None) -> None:
        """Register the run's calibrated views (every method's maps, the students' block copies) as children,
        so that they move with the module and reach the optimizer and the checkpoints."""
        pruned = pruned if pruned is not None else self.run.pruned
        self.operators, self.mlp_maps, self.student_blocks = pruned.operators, pruned.mlp_maps, pruned.blocks
        self.student_modules = pruned.modules_own

    @property
    def distilling(self) -> bool:
        trainer = self._trainer  # None: not attached to a Trainer
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

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        start = time.perf_counter()
        losses = self.run.distill_step(batch)
        for view, loss in losses.items():
            self.log(f"train/{view}/loss", loss.detach(), on_step=True, prog_bar=len(losses) <= 2)
        tokens = float(batch["input_ids"][:, 1:].numel()) * self.trainer.world_size
        self.log("tok/s", tokens / max(time.perf_counter() - start, 1e-9), on_step=True, prog_bar=True)
        return torch.stack(list(losses.values())).sum()

    def configure_optimizers(self):
        optimizer, scheduler = make_optimizer(self.run.students.params, self.cfg.distill, self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._replicated is not None:
            average_replicated_grads(*self._replicated)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        clip_per_student(optimizer, gradient_clip_val, gradient_clip_algorithm)

    # Validation is `pipeline.train.validate`, called here rather than by Lightning's validation loop: that
    # loop cannot validate before the first step (its sanity check is not part of the history and reruns on
    # resume), does not validate after a last step that `val_check_interval` does not divide, and counts
    # batches, not optimizer steps, under gradient accumulation.
    def on_train_start(self) -> None:
        # At step 0, and where a resumed run stands at a step an uninterrupted one validates (`val_every`).
        step, every = self.global_step, self.cfg.distill.val_every
        if step == 0 or (every and step % every == 0):
            self.validate_students()
        self.budget_curve()

    def on_train_batch_start(self, batch, batch_idx: int) -> None:
        self.run.begin("step")  # an optimizer step: forward, backward, update

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        self.run.end("step", step=self.global_step, tokens=batch["input_ids"].numel())
        every = self.cfg.distill.val_every
        if every and self.global_step % every == 0:
            self.validate_students()
        self.budget_curve()

    def budget_curve(self) -> None:
        """The budget curve's points due at this step (`Run.curve`); also at the start, where a resumed run
        stands at a step whose point its checkpoint (saved before `on_train_batch_end`) does not hold."""
        if self.cfg.distill.curve_tokens:
            was_training, trainer = self.training, self.trainer
            self.eval()
            try:
                self.run.curve(self.global_step, trainer.world_size * trainer.accumulate_grad_batches, self.dist())
            finally:
                self.train(was_training)

    def on_train_end(self) -> None:
        self.validate_students()
        self.run.end_distillation(self.global_step)

    def validate_students(self) -> None:
        dist = self.dist()
        was_training = self.training
        self.eval()
        try:
            sync = (lambda ps: ranks_agree(ps, self.trainer.strategy.reduce)) if dist.world > 1 else None
            self.run.validate(self.global_step, dist=dist, sync_check=sync)
        finally:
            self.train(was_training)

    def state_dict(self, *args, **kwargs):
        """Only what trains: checkpoints never hold the frozen base (it comes from `model.source` on resume), and
        under FSDP2 the full-state gather of a checkpoint (`get_model_state_dict`) then never assembles the
        frozen blocks whole on rank 0."""
        state = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", "")
        trainable = {prefix + name for name, p in self.named_parameters() if p.requires_grad}
        for key in [k for k in state if k not in trainable]:
            del state[key]
        return state

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Beside what trains (`state_dict`), the students by name, the validation history and each student's
        best step (`pipeline.train.checkpoint_extras`)."""
        checkpoint["ghostdistill"] = checkpoint_extras(self.run.tracker, self.run.students, self.run.last_validated)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        # FSDP2 (ModelParallelStrategy) has loaded the weights itself by now and passes no state dict.
        check_checkpoint_keys(set(checkpoint["state_dict"]) if "state_dict" in checkpoint else trainable, trainable)
        extra = checkpoint.get("ghostdistill", {})
        history, best, curve = (extra.get(k, default) for k, default in (("history", []), ("best", {}), ("curve", [])))
        self.run.tracker = BestSteps(list(history), dict(best), list(curve))
        self.run.last_validated = extra.get("last_validated")

    def on_test_start(self) -> None:
        self.run.start_evaluation(self.device)

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        self.run.score_batch(batch, dataloader_idx)

    def on_test_epoch_end(self) -> None:
        self.run.finish_evaluation()
