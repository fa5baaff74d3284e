"""The Trainer a run gets: `fit`'s defaults, its callbacks in their order, and fit-then-test.

`fit` (LightningCLI, `runner.fit`) builds its Trainer from the config file with these defaults and callbacks;
`fit_run` builds the same Trainer from keywords around a `pipeline.run.Run` made from a typed `RunConfig`
(the Python API's `distill_student`, and any code that runs a config without `fit`'s arguments), so both
distil through one loop: `GhostDistill`'s hooks, the data module's windows, the checkpoints.
"""

from __future__ import annotations

import inspect
import logging
import warnings
from pathlib import Path

from lightning.pytorch import Callback, Trainer, seed_everything

from ..core.run_folder import hold_run_folder
from ..pipeline.run import Run
from ..planning import check_plan_depth
from .callbacks import Calibration, Export, Report
from .checkpoint import LastCheckpoint, resolve_ckpt_path
from .datamodule import GhostDataModule
from .module import GhostDistill

# A run's console shows the plan, progress, the result table and where files went, not library chatter:
# Lightning's advertising tip, a deprecation inside Lightning's own pytree helper, and LightningCLI's note on
# `args` (calls of `main` from Python pass their own arguments on purpose). rank_zero_info logs through the
# logger filtered here (a filter on a logger sees only its own records).
logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(
    lambda record: not str(record.msg).startswith("💡 Tip")
)
warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")

# `fit`'s trainer defaults (what the config file does not set): no logger, Lightning's own checkpoints and
# summary off (`LastCheckpoint` writes ours), no sanity validation, one device.
TRAINER_DEFAULTS = {
    "max_steps": 0,
    "logger": False,
    "enable_checkpointing": False,
    "enable_model_summary": False,
    "num_sanity_val_steps": 0,
    "default_root_dir": "runs/default",
    "devices": 1,
}


def run_callbacks(extra: list[Callback], root: Path, max_steps: int | None, checkpoint_every: int) -> list[Callback]:
    """`extra` (the calibration, an export) with the report: the export after it, so that a failed export never
    costs the results; and with steps to take, `<root>/checkpoints/last.ckpt` every `checkpoint_every` steps
    (0: at the end only)."""
    callbacks = sorted([*extra, Report()], key=lambda c: isinstance(c, Export))  # stable: the rest keep their order
    if max_steps and max_steps > 0:
        callbacks.append(LastCheckpoint(Path(root) / "checkpoints", checkpoint_every or max_steps))
    return callbacks


# What `fit_run` sets itself, and the argument of the caller's that sets it.
OWNED = {"max_steps": "max_steps (the API's steps)", "default_root_dir": "the run folder (the API's workdir)"}


def check_trainer_options(options: dict) -> None:
    """`options` are Trainer keywords that `fit_run` leaves to its caller: a one-line error before any work
    otherwise (a misspelt key would be a TypeError from deep inside Lightning)."""
    known = set(inspect.signature(Trainer.__init__).parameters) - {"self", "callbacks", *OWNED}
    owned = [f"{k}: set by {OWNED[k]}" for k in options if k in OWNED]
    unknown = sorted(k for k in options if k not in known and k not in OWNED)
    if owned or unknown:
        problem = "; ".join([*owned, *([f"{unknown} are not Trainer arguments"] if unknown else [])])
        raise ValueError(f"trainer settings {sorted(options)}: {problem}; the others are {sorted(known)}")


def fit_and_test(trainer: Trainer, module: GhostDistill, data: GhostDataModule, ckpt_path: str | None = None) -> None:
    """Distil when there are steps to take (resuming from `ckpt_path`), then evaluate every view (on the
    evaluation sources: a run without any, the Python API's `distill_student` of no `texts`, ends after training)."""
    if module.run.llm is None:  # the plan against the model's depth from its config, before the folder is made
        check_plan_depth(module.run.cfg.plan, module.run.cfg.model)
    # One run per run folder at a time (rank 0 of several holds it); the lock goes with the process. A folder of
    # the user's is refused (`core.run_folder`); one this run made goes again when it fails before writing any.
    root = Path(trainer.default_root_dir)
    advice = "wait for it to finish, or choose another trainer.default_root_dir"
    with hold_run_folder(root, f"ghostdistill fit into {root}", advice, trainer.is_global_zero):
        if trainer.max_steps != 0:
            # `resolve_ckpt_path` checks that `last` loads with weights_only, for older Lightning too; Lightning
            # >= 2.6 loads it so: tensors and plain data only.
            ckpt_path = resolve_ckpt_path(ckpt_path, root, trainer.is_global_zero)
            safe = {"weights_only": True} if "weights_only" in inspect.signature(trainer.fit).parameters else {}
            trainer.fit(module, datamodule=data, ckpt_path=ckpt_path, **safe)
        if data.cfg.evaluation.sources:
            trainer.test(module, datamodule=data, verbose=False)


def fit_run(
    run: Run,
    root: Path,
    *,
    max_steps: int = 0,
    progress: bool = True,
    seed: int | None = 0,
    ckpt_path: str | None = None,
    **trainer_options,
) -> Run:
    """`run` through `fit`'s Trainer, in the run folder `root`: calibration, distillation of the students with
    `max_steps` > 0, evaluation, the report. `seed`: `seed_everything` first, as `fit`'s (None: not seeded).
    `ckpt_path`: resume as `fit --ckpt_path` does (``last``: `<root>/checkpoints/last.ckpt`, when there is one).
    `trainer_options`: further Trainer keywords (e.g. `gradient_clip_val`, `precision`, `accelerator`), as a
    config file's `trainer` section."""
    check_trainer_options(trainer_options)
    if seed is not None:
        seed_everything(seed, verbose=False)
    module = GhostDistill.from_run(run)
    data = GhostDataModule(**vars(run.cfg.data))
    options = {**TRAINER_DEFAULTS, "enable_progress_bar": progress, **trainer_options}
    options.update(default_root_dir=str(root), max_steps=max_steps)
    callbacks = run_callbacks([Calibration(progress=progress)], root, max_steps, run.cfg.distill.checkpoint_every)
    fit_and_test(Trainer(callbacks=callbacks, **options), module, data, ckpt_path)
    return run
