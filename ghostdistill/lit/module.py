"""The LightningModule: the dense teacher, the pruned student and its gap operators, and evaluation.

Training-free mode (`trainer.max_steps: 0`) never takes a step: the `Calibration` callback fits the
operators before anything runs and `test` evaluates every view. The training step is where
distillation will go; the teacher is the dense view of the same blocks, so it costs no memory.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities import rank_zero_info
from torchmetrics import MeanMetric, SumMetric

from ..core.io import json_digest, tensor_digest
from ..core.model import ModelConfig, load_model, load_tokenizer
from ..core.plan import PlanConfig, PruningPlan
from ..core.views import DENSE, PRUNED, PrunedModel, view_parameter_count
from ..evaluation.metrics import next_token_targets, score_tokens
from ..evaluation.scores import ScoreStore, score_key
from ..evaluation.zeroshot import PAPER_TASKS, average_scores, task_limits
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
        logit_chunk: tokens per chunk when turning logits into metrics (bounds memory for big vocabularies).
        zeroshot: zero-shot accuracy with lm-eval (off unless enabled).
    """

    views: list[str] = field(default_factory=list)
    logit_chunk: int = 1024
    zeroshot: ZeroShotConfig = field(default_factory=ZeroShotConfig)


class GhostDistill(LightningModule):
    """Holds the model, its pruning plan and one operator set per recovery method.

    Args:
        model: which model to load.
        plan: which layers go (explicit list or criterion).
        recovery: the recovery methods to fit and compare; each becomes a view (default: one `ghost`).
        evaluation: which views to evaluate.
    """

    def __init__(
        self,
        model: ModelConfig = ModelConfig(),
        plan: PlanConfig = PlanConfig(num_layers=7),
        recovery: list[RecoveryConfig] | None = None,
        evaluation: EvalConfig = EvalConfig(),
    ) -> None:
        super().__init__()
        recovery = [RecoveryConfig()] if recovery is None else recovery
        validate_recovery(recovery)
        task_limits(evaluation.zeroshot.tasks, evaluation.zeroshot.limit)  # bad limits fail before loading
        if plan.layers is None and plan.num_layers is None:
            raise ValueError("plan needs either layers (explicit list) or num_layers (for the criterion)")
        self.model_cfg = model
        self.plan_cfg = plan
        self.recovery_cfgs = list(recovery)
        self.eval_cfg = evaluation
        self.save_hyperparameters(
            {
                "model": asdict(model),
                "plan": asdict(plan),
                "recovery": [asdict(r) for r in recovery],
                "evaluation": asdict(evaluation),
            }
        )
        self.tokenizer = load_tokenizer(model)
        self.llm: torch.nn.Module | None = None
        self.pruned: PrunedModel | None = None
        # Filled by the callbacks and test loop; written to results.json by the Report callback.
        self.report: dict = {"timings": {}}
        self._metrics: torch.nn.ModuleDict | None = None
        self._test_sources: list[str] = []

    # ------------------------------------------------------------------ model
    def configure_model(self) -> None:
        if self.llm is not None:
            return
        start = time.perf_counter()
        self.llm = load_model(self.model_cfg)
        self.llm.requires_grad_(False)
        self.report["timings"]["load_model_s"] = round(time.perf_counter() - start, 2)

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
    def training_step(self, batch, batch_idx):
        raise RuntimeError(
            "ghostdistill runs training-free: set trainer.max_steps: 0. Distillation (KL against the dense "
            "teacher) is not available in this release."
        )

    def configure_optimizers(self):
        # Lightning sets up optimizers even for max_steps=0; the operators are what distillation trains first.
        params = [p for p in self.parameters() if p.requires_grad] or [torch.nn.Parameter(torch.zeros(1))]
        return torch.optim.AdamW(params, lr=1e-4)

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
        targets, valid = next_token_targets(ids, mask)
        views = self.views
        reference: list[torch.Tensor] | None = None  # dense log-probs, the reference for KL and top-1
        for view in [DENSE, *(v for v in views if v != DENSE)]:
            with self.pruned.use(view) as model:
                logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            scores = score_tokens(
                logits, targets, reference=reference, chunk=self.eval_cfg.logit_chunk, keep_logprobs=reference is None
            )
            del logits
            if reference is None:
                reference = scores.logprobs
            if view not in views:
                continue
            m = self._metrics[f"{views.index(view)}_{dataloader_idx}"]
            token_nll = scores.nll[valid]
            m["nll"].update(token_nll.double().sum())
            m["tokens"].update(torch.tensor(float(token_nll.numel()), device=token_nll.device))
            if view != DENSE:
                m["kl"].update(scores.kl[valid])
                m["top1"].update(scores.top1[valid])

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
