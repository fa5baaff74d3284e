"""A finished run folder rebuilt in memory as a `pipeline.run.Run`, without a Trainer: `load_run` and
`export_run` (`export <run>`). Nothing the run cached is recomputed but the closed-form solves (and a
sequential fit's student passes): the statistics come from `calibration_state.pt`, a `<name>_ft` view's trained
values from `checkpoints/last.ckpt` (`weights_only=True`: tensors and plain data, never code) at the step the
report shows (`distill.kept`: the best or the last). Apart from `pipeline.export` because the run module
exports through that one: together they would import each other."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..calibration.state import STATE_FILE
from ..core.io import read_mapping
from ..core.views import PrunedModel
from ..data.run import RunData
from ..distill.students import Students
from ..export.options import ExportOptions, holding_targets
from .config import RunConfig
from .export import check_export, check_view_names
from .run import Run

CHECKPOINT = Path("checkpoints") / "last.ckpt"


@torch.no_grad()
def load_students(students: Students, path: Path, report: dict) -> None:
    """Put each fine-tuned view at the step the run's report shows, from the run's checkpoint."""
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing: the fine-tuned views' weights are in the run's checkpoint")
    # weights_only: a checkpoint someone sent you must not run their code.
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    saved = (checkpoint.get("ghostdistill") or {}) if isinstance(checkpoint, dict) else {}
    if "students" not in saved:
        raise ValueError(f"{path} holds no students by name (written by an older version): run `fit` again")
    distill = report.get("distill") or {}
    last_step = int(checkpoint["global_step"])
    for view in students.views:
        wanted = (
            distill.get("steps") if distill.get("kept") != "best" else distill.get("best", {}).get(view, {}).get("step")
        )
        if wanted is None or int(wanted) == last_step:
            students.load_trainable_state(view, saved["students"][view])
            continue
        best = saved.get("best", {}).get(view)
        if best is None or int(best["step"]) != int(wanted):
            raise ValueError(
                f"{view}: the report shows step {wanted}, but {path} holds step {last_step} and best "
                f"step {None if best is None else best['step']}"
            )
        students.load_trainable_state(view, best["state"])


@dataclass
class LoadedRun:
    """A finished run rebuilt in memory: its views (students at the step the report shows), tokenizer,
    windows and report."""

    pruned: PrunedModel
    tokenizer: object
    data: RunData
    report: dict
    run: object = None  # the `pipeline.run.Run` it was rebuilt by


def load_run(run: Path, cfg: RunConfig, views: list[str] = (), log: Callable[[str], None] = print) -> LoadedRun:
    """The run in `run` (configured by `cfg`, its config.yaml) rebuilt: the model, the operators re-solved, and
    the students of any `_ft` view in `views`."""
    results, state_path = run / "results.json", run / STATE_FILE
    for path in (results, state_path):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing: export reads a finished run folder (run `fit` first)")
    check_view_names(cfg, list(views), str(run), "--views")
    report = read_mapping(results, "results file")
    loaded = Run(cfg, log=log)
    loaded.setup(run, checks=False)
    loaded.calibrate(saved_only=True)
    if set(views) & set(cfg.distill.views()):
        load_students(loaded.build_students(check=False), run / CHECKPOINT, report)
    return LoadedRun(loaded.pruned, loaded.tokenizer, loaded.data, report, loaded)


def export_run(run: Path, cfg: RunConfig, options: ExportOptions, *, seed: int | None = None) -> list[Path]:
    """Export `options.views` of the finished run in `run` (configured by `cfg`). Bad view names, formats,
    schemes and targets, and missing llama.cpp tools or llm-compressor's environment, fail before the model
    loads (`check_export`)."""
    root = options.root(run)
    check_export(cfg, options, root, where=str(run), key="--views")
    # Held from before the model loads: a second export of these targets is refused at once, not after its load.
    with holding_targets(root, options):
        loaded = load_run(run, cfg, options.views)
        loaded.run.seed = seed
        return loaded.run.export(options, root, report=loaded.report)
