"""A run's configuration: `RunConfig` groups the sections of a `fit` config file (model, plan, recovery,
evaluation, distill, data); `EvalConfig` and `ZeroShotConfig` are what the evaluation phases read."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from ..core.checks import check_unique
from ..core.model import ModelConfig
from ..core.settings import cost_only
from ..core.views import DENSE, PRUNED
from ..data.config import DataConfig
from ..distill.config import DistillConfig
from ..evaluation.zeroshot import PAPER_TASKS, check_offline_tasks, task_limits
from ..methods import RecoveryConfig, check_family, family_facts, validate_recovery
from ..planning import PlanConfig, check_selection, repair_config


@dataclass
class ZeroShotConfig:
    """Zero-shot accuracy with lm-evaluation-harness on the in-memory views (operators and all).

    Args:
        enabled: run zero-shot evaluation after the perplexities (needs the `ghostdistill[zeroshot]` extra).
        tasks: lm-eval task names; by default the paper's nine
            (arc_easy, arc_challenge, hellaswag, winogrande, boolq, openbookqa, rte, copa, race).
        data_dir: a folder with the tasks' published files (arc_easy/, piqa/, ...) to run offline with
            the task definitions shipped in `ghostdistill/evaluation/tasks`; null reads lm-eval's hub datasets.
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

    def validate(self) -> None:
        """Bad limits and missing offline files fail before the model loads, not after an hour of calibration."""
        check_unique("evaluation.zeroshot.tasks", self.tasks)
        task_limits(self.tasks, self.limit)
        if self.enabled:
            from ..evaluation.zeroshot import require_lm_eval

            require_lm_eval()
            if self.data_dir is not None:
                check_offline_tasks(self.tasks, self.data_dir)


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
    logit_chunk: int | None = cost_only(None)
    analysis: bool = True
    analysis_windows: int = 8
    zeroshot: ZeroShotConfig = field(default_factory=ZeroShotConfig)

    def validate(self) -> None:
        check_unique("evaluation.views", self.views)
        if self.logit_chunk is not None and self.logit_chunk < 1:
            raise ValueError(
                f"evaluation.logit_chunk must be a positive number of tokens, or null (sized by the vocabulary), "
                f"got {self.logit_chunk}"
            )
        if self.analysis_windows < 1:
            raise ValueError(f"evaluation.analysis_windows must be >= 1, got {self.analysis_windows}")
        self.zeroshot.validate()


NO_DISTILL_METHODS = (
    "trainer.max_steps > 0 trains the students of model.distill.methods and model.distill.students, which are "
    "empty: name the methods to fine-tune (e.g. --model.distill.methods [ghost]) or set trainer.max_steps: 0"
)

OFFLOAD_ONE_DEVICE = (
    "model.model.offload keeps the weights off one device and runs it block by block; with several devices "
    "shard the model instead: set model.model.offload none and trainer.strategy FSDP2 (docs/distillation.md)"
)


def students_offloaded(offload: str) -> str:
    """Why distillation does not run with offloaded weights, and what to do instead (one line)."""
    return (
        f"model.model.offload {offload} keeps the weights off the device, and the students train on a device that "
        "holds the model: shard it over several devices with trainer.strategy FSDP2 and model.model.offload none "
        "(docs/distillation.md), or set trainer.max_steps 0"
    )


def check_steps(max_steps: int | None) -> None:
    """`trainer.max_steps`: 0 (training-free) or the distillation steps."""
    if max_steps is not None and max_steps < 0:
        raise ValueError(f"trainer.max_steps {max_steps}: set 0 (training-free) or the number of distillation steps")


@dataclass
class RunConfig:
    """Everything one run is configured by (what `fit`'s config file holds, less the trainer's keys)."""

    model: ModelConfig = field(default_factory=ModelConfig)
    plan: PlanConfig = field(default_factory=lambda: PlanConfig(num_layers=7))
    recovery: list[RecoveryConfig] = field(default_factory=lambda: [RecoveryConfig()])
    evaluation: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    data: DataConfig = field(default_factory=DataConfig)

    def validate(self, data: bool = True) -> None:
        """Every check that needs no model, tokenizer or data: bad values fail before anything loads.
        `data=False` leaves out the data settings (the data module checks those)."""
        validate_recovery(self.recovery)
        self.distill.validate([r.name for r in self.recovery])
        self.evaluation.validate()
        unknown = [v for v in self.evaluation.views if v not in self.views()]
        if unknown:
            raise ValueError(f"evaluation.views {unknown} are not views of this run; its views are {self.views()}")
        self.plan.validate()
        if self.plan.repair_aware():
            repair_config(self.plan, self.recovery)
        if not data:
            return
        self.data.validate()
        if self.plan.repair_aware():
            check_selection(self.data, f"plan.criterion {self.plan.criterion!r}")

    def preflight(
        self, steps: int, *, world_size: int = 1, fsdp2: bool = False, views: dict[str, list[str]] | None = None
    ) -> None:
        """What this config decides with the execution, before the model loads, for every door (the Lightning
        callbacks; the Python API and `compare` run through them): the step count, the views a run of `steps`
        would not build (`evaluation.views` and `views`, by the key that names them), and offloaded weights
        with FSDP2, several devices or students to train."""
        check_steps(steps)
        if steps > 0 and not self.distill.views():
            raise RuntimeError(NO_DISTILL_METHODS)
        for key, names in {"evaluation.views": self.evaluation.views, **(views or {})}.items():
            unbuilt = [v for v in names if v in self.distill.views() and steps == 0]
            if unbuilt:
                raise ValueError(
                    f"{key} {unbuilt} are fine-tuned views, which trainer.max_steps 0 does not build: set "
                    "trainer.max_steps (and export them from a run that distils)"
                )
        offload = self.model.offload
        if offload != "none" and fsdp2:  # on one device too
            raise ValueError(
                f"model.model.offload {offload!r} with FSDP2 (trainer.strategy ModelParallelStrategy): the blocks are "
                "sharded over the ranks instead; set model.model.offload: none, or run without FSDP2"
            )
        if offload != "none" and world_size > 1:
            raise ValueError(OFFLOAD_ONE_DEVICE)
        if offload != "none" and steps > 0:
            raise ValueError(students_offloaded(offload))

    def check_family(self, model) -> None:
        """Every recovery entry (and the plan's repair entry) right on `model`'s family, or one line refusing those
        that cannot be (`methods.check_family`): the first check once the model is known, before any data."""
        repair = repair_config(self.plan, self.recovery) if self.plan.repair_aware() else None
        check_family(self.recovery, family_facts(model), repair)

    def at_depth(self, num_layers: int) -> RunConfig:
        """This run's config at another depth (its criterion removing `num_layers` blocks), as a run of that
        depth would have made it: what `plan.greedy_from` checks an earlier run's fingerprint against."""
        return replace(self, plan=replace(self.plan, num_layers=num_layers, greedy_from=None))

    def views(self) -> list[str]:
        """Every view a run has: the baselines, each recovery method and each fine-tuned method."""
        return [DENSE, PRUNED, *(r.name for r in self.recovery), *self.distill.views()]

    def methods(self) -> dict[str, str]:
        """Each recovery entry's name and its registered method (what students and evaluation are told)."""
        return {r.name: r.method for r in self.recovery}

    def method_of(self, view: str) -> str | None:
        """The registered method behind a view (``ghost`` for ``ghost`` and ``ghost_ft``); None for the baselines."""
        if view in (DENSE, PRUNED):
            return None
        base = self.distill.method_of(view) or view
        return next(r.method for r in self.recovery if r.name == base)
