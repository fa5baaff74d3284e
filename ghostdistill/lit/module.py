"""The LightningModule: the dense teacher, the pruned students and their gap operators, distillation
and evaluation.

Training-free (`trainer.max_steps: 0`) never takes a step: the `Calibration` callback fits every
method's operators before anything runs and `test` evaluates every view. Fine-tuned recovery
(`max_steps` > 0, `distill.methods` set): the callback also builds a `<method>_ft` student per method
from its closed-form fit (`distill.students`); each training step runs the teacher once and every
student on the same batch, with the chunked KL loss (`distill.loss`); validation every
`distill.val_every` steps keeps each student's best step; `test` then evaluates the training-free and
the fine-tuned views side by side. The teacher is the dense view of the same blocks: no extra memory.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric, SumMetric

from ..core.head import final_hidden, output_head, tokens_per_chunk
from ..core.io import json_digest, tensor_digest
from ..core.model import ModelConfig, load_model, load_tokenizer
from ..core.plan import PlanConfig, PruningPlan
from ..core.views import DENSE, PRUNED, PrunedModel, view_parameter_count
from ..distill.config import DistillConfig
from ..distill.loss import chunked_distillation_loss
from ..distill.optim import make_optimizer
from ..distill.students import Students
from ..evaluation.metrics import TokenScores, next_token_targets, score_hidden
from ..evaluation.scores import ScoreStore, score_key
from ..evaluation.zeroshot import PAPER_TASKS, average_scores, check_offline_tasks, task_limits
from ..methods import RecoveryConfig, validate_recovery


@dataclass
class ZeroShotConfig:
    """Zero-shot accuracy with lm-evaluation-harness on the in-memory views (operators and all).

    Args:
        enabled: run zero-shot evaluation after the perplexities.
        tasks: lm-eval task names; by default the paper's nine
            (arc_easy, arc_challenge, hellaswag, winogrande, boolq, openbookqa, rte, copa, race).
        data_dir: a folder with the tasks' published files (arc_easy/, piqa/, ...) to run offline with
            the task definitions shipped in `ghostdistill/tasks`; null reads lm-eval's hub datasets.
        limit: score only the first `limit` items of each task (quick runs; results say so), or a map
            `{task: limit}` for some tasks (the others: all items); null scores every item.
        batch_size: lm-eval batch size.

    Each (view, task) score is saved under `<run>/zeroshot/` as soon as it is known, keyed by the view's
    weights and the task settings, so an interrupted run resumes with the next task.
    """

    enabled: bool = False
    tasks: list[str] = field(default_factory=lambda: list(PAPER_TASKS))
    data_dir: str | None = None
    limit: int | dict[str, int | None] | None = None
    batch_size: int = 8


@dataclass
class EvalConfig:
    """Which views `test` evaluates, and how.

    Args:
        views: subset of ``dense``, ``pruned`` and the recovery names; empty means all of them.
        logit_chunk: tokens per chunk when turning final hidden states into logits and metrics; null (the
            default) sizes it by the vocabulary, 2^25 logits per chunk (1,024 tokens at 32k, 128 at 262k),
            so evaluation memory does not grow with the vocabulary or the batch.
        zeroshot: zero-shot accuracy with lm-eval (off unless enabled).
        analysis: per gap and method, the operator anatomy and the alignment error on held-out windows
            (`ghostdistill.analysis`), in results.json/md and analysis.png.
        analysis_windows: how many of the first evaluation source's windows the alignment error reads.
    """

    views: list[str] = field(default_factory=list)
    logit_chunk: int | None = None
    analysis: bool = True
    analysis_windows: int = 8
    zeroshot: ZeroShotConfig = field(default_factory=ZeroShotConfig)


NO_DISTILL_METHODS = (
    "trainer.max_steps > 0 trains the students of model.distill.methods, which is empty: name the methods to "
    "fine-tune (e.g. --model.distill.methods [ghost]) or set trainer.max_steps: 0"
)

# The model stays in eval mode while the students train (see `GhostDistill.train`): intended.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode at the start of training")


class GhostDistill(LightningModule):
    """Holds the model, its pruning plan and one operator set per recovery method.

    Args:
        model: which model to load.
        plan: which layers go (explicit list or criterion).
        recovery: the recovery methods to fit and compare; each becomes a view (default: one `ghost`).
        evaluation: which views to evaluate.
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
        recovery = [RecoveryConfig()] if recovery is None else recovery
        validate_recovery(recovery)
        distill.validate([r.name for r in recovery])
        task_limits(evaluation.zeroshot.tasks, evaluation.zeroshot.limit)  # bad limits fail before loading
        if evaluation.zeroshot.enabled and evaluation.zeroshot.data_dir is not None:
            # Before an hour of calibration, not after: tasks without offline files, or missing files.
            check_offline_tasks(evaluation.zeroshot.tasks, evaluation.zeroshot.data_dir)
        if evaluation.logit_chunk is not None and evaluation.logit_chunk < 1:
            raise ValueError(
                f"evaluation.logit_chunk must be a positive number of tokens, or null (sized by the vocabulary), "
                f"got {evaluation.logit_chunk}"
            )
        plan.validate()  # what the values alone decide, before the model is loaded
        self.model_cfg = model
        self.plan_cfg = plan
        self.recovery_cfgs = list(recovery)
        self.eval_cfg = evaluation
        self.distill_cfg = distill
        self.save_hyperparameters(
            {
                "model": asdict(model),
                "plan": asdict(plan),
                "recovery": [asdict(r) for r in recovery],
                "evaluation": asdict(evaluation),
                "distill": asdict(distill),
            }
        )
        self.tokenizer = load_tokenizer(model)
        self.llm: torch.nn.Module | None = None
        self.pruned: PrunedModel | None = None
        # Filled by the callbacks and test loop; written to results.json by the Report callback.
        self.report: dict = {"timings": {}}
        self._metrics: torch.nn.ModuleDict | None = None
        self._test_sources: list[str] = []
        # Distillation: the students, validation history and each student's best step.
        self.students: Students | None = None
        self.history: list[dict] = []
        self.best: dict[str, dict] = {}
        self._last_validated: int | None = None
        self._sharded = False
        # FSDP2 leaves the LoRA adapters whole on every rank; their gradients are averaged here.
        self._replicated: tuple[list, object] | None = None
        # Checkpoints hold only what trains; the frozen base comes from `model.source` on resume.
        self.strict_loading = False

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        """Load the model (once). Lightning calls this hook again after the `Calibration` callback has
        calibrated and built the students; under `ModelParallelStrategy` (FSDP2) the students are then
        sharded (`distill.parallel`)."""
        if self.llm is None:
            start = time.perf_counter()
            self.llm = load_model(self.model_cfg)
            self.llm.requires_grad_(False)
            self.report["timings"]["load_model_s"] = round(time.perf_counter() - start, 2)
            return
        if self.students is not None and not self._sharded and self._trainer is not None:
            from lightning.pytorch.strategies import ModelParallelStrategy

            if isinstance(self.trainer.strategy, ModelParallelStrategy):
                from ..distill.parallel import shard_students

                mesh = self.device_mesh["data_parallel"] if "data_parallel" in (self.device_mesh.mesh_dim_names or ()) else self.device_mesh
                lora = [p for view in self.students.views for p in self.students.params[view].lora]
                units = shard_students(self.pruned, self.students.views, mesh, replicated=lora)
                self._replicated = (lora, mesh.get_group())
                self.students.refresh_params()  # sharding replaced the parameter objects
                rank_zero_info(f"FSDP2: {units} units sharded over {mesh.size()} ranks")
                self._sharded = True

    def set_plan(self, plan: PruningPlan) -> PrunedModel:
        if self.llm is None:
            raise RuntimeError("configure_model() must run before set_plan()")
        if self.pruned is not None:
            self.pruned.remove_hooks()
            self.pruned.set_view(DENSE)
        self.pruned = PrunedModel(self.llm, plan)
        # Registered as children so that every method's maps (gap operators and ReplaceMe's MLP maps) move
        # with the module and reach the optimizer and the checkpoints.
        self.operators = self.pruned.operators
        self.mlp_maps = self.pruned.mlp_maps
        return self.pruned

    @property
    def views(self) -> list[str]:
        if self.pruned is None:
            return []
        available = self.pruned.views
        wanted = self.eval_cfg.views or available
        unknown = [v for v in wanted if v not in available]
        if unknown:
            raise ValueError(f"evaluation.views {unknown} are not views of this run; available: {available}")
        return [v for v in available if v in wanted]

    # --------------------------------------------------------------- training
    @property
    def distilling(self) -> bool:
        return self._trainer is not None and self.trainer.max_steps != 0 and bool(self.distill_cfg.methods)

    def setup_students(self) -> Students:
        """Build the `<method>_ft` views from the fitted ones (called by `Calibration` after the fit)."""
        assert self.pruned is not None
        self.students = Students(self.pruned, self.distill_cfg)
        self.students.build()
        # Registered, so the copied blocks move with the module and reach the checkpoints.
        self.student_blocks = self.pruned.blocks
        return self.students

    def train(self, mode: bool = True):
        """The model stays in eval mode (the teacher, and the students' frozen blocks, never drop
        anything out); only the adapters' dropout follows `mode`."""
        super().train(mode)
        if self.llm is not None:
            self.llm.eval()
            if mode:
                for name, module in self.llm.named_modules():
                    if ".lora_dropout" in f".{name}":
                        module.train(True)
        return self

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        if not self.distilling or self.students is None:
            raise RuntimeError(NO_DISTILL_METHODS)
        students = self.students
        start = time.perf_counter()
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        targets, valid = next_token_targets(ids, mask)
        head = output_head(self.llm)
        teacher_hidden, prefix = students.teacher(batch)
        total = teacher_hidden.new_zeros((), dtype=torch.float32)
        for view in students.views:
            hidden = students.student(view, batch, prefix)
            loss = chunked_distillation_loss(
                hidden[:, :-1], teacher_hidden[:, :-1], head, valid, targets, self.distill_cfg.loss
            )
            self.log(f"train/{view}/loss", loss.detach(), on_step=True, prog_bar=len(students.views) <= 2)
            # Students share no parameter: the gradient of the sum is each student's own gradient.
            total = total + loss
        tokens = float(valid.sum()) * self.trainer.world_size
        self.log("tok/s", tokens / max(time.perf_counter() - start, 1e-9), on_step=True, prog_bar=True)
        return total

    def configure_optimizers(self):
        if not self.distilling or self.students is None:
            # Lightning sets up optimizers even for max_steps=0; nothing trains then.
            return torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
        optimizer, scheduler = make_optimizer(self.students.params, self.distill_cfg, self.trainer.max_steps)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

    def on_before_optimizer_step(self, optimizer) -> None:
        if self._replicated is not None:
            from ..distill.parallel import average_replicated_grads

            average_replicated_grads(*self._replicated)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None) -> None:
        """Clip each student on its own: one global norm over all students would let one student's
        gradients shrink another's, and the comparison would not be the same recipe for each."""
        if not gradient_clip_val:
            return
        by_student: dict[str, list] = {}
        for group in optimizer.param_groups:
            by_student.setdefault(group.get("student", ""), []).extend(group["params"])
        for params in by_student.values():
            if gradient_clip_algorithm in (None, "norm"):
                torch.nn.utils.clip_grad_norm_(params, gradient_clip_val)
            else:
                torch.nn.utils.clip_grad_value_(params, gradient_clip_val)

    # ------------------------------------------------------------- validation
    def on_train_start(self) -> None:
        if self.distilling:
            self.validate_students()

    def on_train_batch_end(self, outputs, batch, batch_idx: int) -> None:
        every = self.distill_cfg.val_every
        if self.distilling and every and self.global_step % every == 0:
            self.validate_students()

    def on_train_end(self) -> None:
        if not self.distilling or self.students is None:
            return
        self.validate_students()
        keep = self.distill_cfg.keep
        for view in self.students.views:
            best = self.best.get(view)
            if keep == "best" and best is not None and best["step"] != self.global_step:
                self.students.load_trainable_state(view, best["state"])
        self.report["distill"] = {
            **asdict(self.distill_cfg),
            "steps": self.global_step,
            "kept": keep,
            "prefix_shared": self.students.share_prefix,
            "best": {v: {"step": b["step"], "val_kl": b["kl"]} for v, b in self.best.items()},
            "history": self.history,
        }

    @torch.no_grad()
    def validate_students(self) -> None:
        """KL to the teacher and perplexity of every fine-tuned view on the validation windows (each
        rank scores its share, sums are reduced), logged, kept in the history, and each student's best
        step by KL remembered."""
        step = self.global_step
        if self._last_validated == step or self.students is None:
            return
        self._last_validated = step
        ids = self.trainer.datamodule.val_ids()
        if ids is None:
            return
        rank, world = self.trainer.global_rank, self.trainer.world_size
        views = self.students.views
        # The same number of batches on every rank (sharded models run collectives in every forward).
        ids = ids[: len(ids) // world * world] if world > 1 else ids
        sums = torch.zeros(len(views), 3, dtype=torch.float64, device=self.device)  # nll, kl, tokens
        was_training = self.training
        self.eval()
        try:
            mine = ids[rank::world]
            for lo in range(0, len(mine), self.trainer.datamodule.batch_size):
                chunk = mine[lo : lo + self.trainer.datamodule.batch_size].to(self.device)
                scores = self.score_views(chunk, torch.ones_like(chunk), views)
                for k, view in enumerate(views):
                    sums[k, 0] += scores[view].nll.double().sum()
                    sums[k, 1] += scores[view].kl.double().sum()
                    sums[k, 2] += scores[view].nll.numel()
        finally:
            self.train(was_training)
        sums = self.trainer.strategy.reduce(sums.clone(), reduce_op="sum") if world > 1 else sums
        entry: dict = {"step": step}
        if world > 1:
            # Every rank must hold the same students (DDP averages gradients; a desync is a bug, not noise).
            check = torch.stack([_full(p).detach().double().sum() for v in views for p in self.students.params[v].all()])
            reduce = self.trainer.strategy.reduce
            spread = reduce(check.clone(), reduce_op="max") - reduce(check.clone(), reduce_op="min")
            entry["ranks_in_sync"] = bool((spread.abs() == 0).all())
            if not entry["ranks_in_sync"]:
                raise RuntimeError(f"the students differ between ranks at step {step}: distributed training went out of sync")
        for k, view in enumerate(views):
            nll, kl, tokens = (float(x) for x in sums[k])
            entry[view] = {"kl": kl / tokens, "ppl": float(torch.exp(torch.tensor(nll / tokens)))}
            if view not in self.best or entry[view]["kl"] < self.best[view]["kl"]:
                self.best[view] = {"step": step, "kl": entry[view]["kl"], "state": self.students.trainable_state(view)}
        self.history.append(entry)
        line = ", ".join(f"{v} KL {entry[v]['kl']:.4f} PPL {entry[v]['ppl']:.2f}" for v in views)
        rank_zero_info(f"validation at step {step}: {line}")

    # ------------------------------------------------------------ checkpoints
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        """Only what trains (the students' parameters) goes into the state dict, never the frozen base;
        the validation history and each student's best step come along so a resumed run continues them."""
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in trainable}
        best = {v: {**b, "state": {k: _full(t) for k, t in b["state"].items()}} for v, b in self.best.items()}
        checkpoint["ghostdistill"] = {"history": self.history, "best": best, "last_validated": self._last_validated}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        trainable = {name for name, p in self.named_parameters() if p.requires_grad}
        # FSDP2 (ModelParallelStrategy) has loaded the weights itself by now and passes no state dict.
        saved = set(checkpoint["state_dict"]) if "state_dict" in checkpoint else trainable
        if saved != trainable:
            raise ValueError(
                f"the checkpoint does not hold this run's students: {len(saved - trainable)} tensors it has are "
                f"not trainable here and {len(trainable - saved)} trainable tensors are missing from it (e.g. "
                f"{sorted(saved ^ trainable)[:3]}); resume with the same model.distill and plan"
            )
        extra = checkpoint.get("ghostdistill", {})
        self.history = list(extra.get("history", []))
        self.best = dict(extra.get("best", {}))
        self._last_validated = extra.get("last_validated")

    # ------------------------------------------------------------- evaluation
    def setup_test_metrics(self, sources: list[str]) -> None:
        self._test_sources = list(sources)
        metrics = {}
        for vi, _ in enumerate(self.views):
            for si, _ in enumerate(sources):
                metrics[f"{vi}_{si}"] = torch.nn.ModuleDict(
                    {"nll": SumMetric(), "tokens": SumMetric(), "kl": MeanMetric(), "top1": MeanMetric()}
                )
        self._metrics = torch.nn.ModuleDict(metrics).to(self.device)

    @torch.no_grad()
    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int, dataloader_idx: int = 0) -> None:
        assert self.pruned is not None and self._metrics is not None
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        mask = torch.ones_like(ids) if mask is None else mask
        views = self.views
        # Windows added only to even out the ranks' shares are run but not counted (`EvenShares`).
        counted = batch.get("counted")
        scores = self.score_views(ids, mask, views, counted=counted)
        for vi, view in enumerate(views):
            m = self._metrics[f"{vi}_{dataloader_idx}"]
            token_nll = scores[view].nll
            m["nll"].update(token_nll.double().sum())
            m["tokens"].update(torch.tensor(float(token_nll.numel()), device=token_nll.device))
            if view != DENSE:
                m["kl"].update(scores[view].kl)
                m["top1"].update(scores[view].top1)

    def score_views(
        self, ids: torch.Tensor, mask: torch.Tensor, views: list[str], counted: torch.Tensor | None = None
    ) -> dict[str, TokenScores]:
        """NLL of every view in `views`, and KL and top-1 against the dense view, on one batch (1-D over the
        real next-token positions). Each view's decoder runs once and yields final hidden states; logits
        exist only a chunk of `evaluation.logit_chunk` tokens at a time (`evaluation.metrics.score_hidden`),
        so memory does not grow with batch × vocabulary. `counted` [batch]: rows to score (default all)."""
        assert self.pruned is not None
        targets, valid = next_token_targets(ids, mask)
        if counted is not None:
            valid = valid & counted.bool()[:, None]
        hidden = {}
        for view in [DENSE, *(v for v in views if v != DENSE)]:
            with self.pruned.use(view) as model:
                hidden[view] = final_hidden(model, ids, mask)[:, :-1]
        vocab = self.llm.get_output_embeddings().weight.shape[0]
        chunk = tokens_per_chunk(vocab, self.eval_cfg.logit_chunk)
        return score_hidden(hidden, output_head(self.llm), targets, valid, reference=DENSE, chunk=chunk)

    def on_test_epoch_end(self) -> None:
        assert self._metrics is not None and self.pruned is not None
        results = {}
        for vi, view in enumerate(self.views):
            per_source = {}
            for si, source in enumerate(self._test_sources):
                m = self._metrics[f"{vi}_{si}"]
                tokens = float(m["tokens"].compute())
                nll = float(m["nll"].compute())
                entry = {"ppl": float(torch.exp(torch.tensor(nll / max(tokens, 1.0)))), "tokens": int(tokens)}
                if view != DENSE:
                    entry["kl"] = float(m["kl"].compute())
                    entry["top1"] = float(m["top1"].compute())
                per_source[source] = entry
                self.log(f"{view}/{source}/ppl", entry["ppl"], add_dataloader_idx=False)
            results[view] = {"params": view_parameter_count(self.pruned, view), "metrics": per_source}
        self.report["views"] = results

    def evaluate_zeroshot(self, cache_dir: Path | None = None) -> None:
        """lm-eval on every view, one task at a time; accuracies land in the report next to the perplexities.

        With `cache_dir`, each (view, task) score is written there when done and reused when the key
        (model, removed layers, what the view's operators were solved from, training step, task, limit,
        data) matches.
        """
        zs = self.eval_cfg.zeroshot
        if not zs.enabled:
            return
        from ..evaluation.zeroshot import evaluate_zeroshot

        limits = task_limits(zs.tasks, zs.limit)
        data_dir = str(Path(zs.data_dir).resolve()) if zs.data_dir is not None else None
        store = ScoreStore(cache_dir, write=self.trainer.is_global_zero)
        for view in self.views:
            weights = self._view_digest(view) if cache_dir is not None else None
            scores: dict[str, dict[str, float]] = {}
            for task, limit in limits.items():
                key = score_key(weights, task, limit, data_dir)
                cached = store.get(view, task, key)
                if cached is not None:
                    rows, seconds, how = cached["scores"], cached["seconds"], f"saved in {store.path(view, task)}"
                else:
                    start = time.perf_counter()
                    with self.pruned.use(view) as model:
                        result = evaluate_zeroshot(
                            model, self.tokenizer, [task], data_dir=zs.data_dir, limit=limit, batch_size=zs.batch_size
                        )
                    seconds, how = round(time.perf_counter() - start, 2), "scored"
                    # A group or tag (online) yields one row per subtask; a plain task, its own row.
                    rows = {name: dict(row) for name, row in result.items() if name != "average"}
                    store.put(view, task, key, {"limit": limit, "seconds": seconds, "scores": rows})
                for name, row in rows.items():
                    rank_zero_info(f"zero-shot {view}/{name}: acc {row['acc']:.3f} on {row['n']} items ({how}, {seconds:.0f} s)")
                scores.update(rows)
            scores["average"] = average_scores(scores)
            self.report["views"][view]["zeroshot"] = scores
        self.report["zeroshot"] = {"tasks": list(zs.tasks), "data_dir": zs.data_dir, "limit": zs.limit}

    def _view_digest(self, view: str) -> str:
        """What a view computes: the model and removed blocks; for a method, what its operators were solved
        from (calibration fingerprint and recovery settings) or, without one, the operators' values; and
        the training step.

        Settings rather than values where possible: the same solve on another thread count differs in the
        last bits, which must not void hours of saved scores.
        """
        removed = [] if view == DENSE else list(self.pruned.plan.removed)
        base = [asdict(self.model_cfg), removed, self.global_step]
        if view in (DENSE, PRUNED):
            return json_digest(base)
        fingerprint = self.report.get("calibration", {}).get("fingerprint")
        recovery = next((asdict(r) for r in self.recovery_cfgs if r.name == view), None)
        if fingerprint is not None and recovery is not None:
            return json_digest([*base, fingerprint, recovery])
        state = {}
        for prefix, group in (("operators", self.pruned.operators), ("mlp_maps", self.pruned.mlp_maps)):
            if view in group:
                state.update({f"{prefix}.{k}": v for k, v in group[view].state_dict().items()})
        return json_digest([*base, tensor_digest(state)])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a sharded (DTensor) parameter; a plain tensor as it is."""
    full = getattr(tensor, "full_tensor", None)
    return full() if callable(full) else tensor
