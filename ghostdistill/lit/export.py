"""Exporting the views of a run: at the end of `fit` (the `Export` callback, `export:` in the config) or
later from the finished run folder (`python -m ghostdistill export <run>`).

From a run folder nothing the run cached is recomputed: the run's own config rebuilds the module, the
calibration statistics come from `calibration_state.pt` (only the closed-form solves run again, and the
student passes of a sequential fit with several gaps), and a fine-tuned `<name>_ft` view takes its
trained values from `checkpoints/last.ckpt`: the step the run's report shows (`distill.kept`: the best
validation step, kept in the checkpoint, or the last one).
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info

from ..core.views import DENSE, PRUNED
from ..distill.config import ft_view
from ..export import export_view
from .callbacks import Calibration
from .module import GhostDistill


class Export(Callback):
    """Write views of the run as Hugging Face folders after `test` (rank 0 only).

    Args:
        views: views to export (e.g. ``[ghost, ghost_ft]``); empty exports nothing.
        dir: parent folder of the exported views (one sub-folder per view); default ``<run>/export``.
        overwrite: replace existing folders.
    """

    def __init__(
        self,
        views: list[str] | None = None,
        dir: str | None = None,
        overwrite: bool = False,
    ) -> None:
        self.views = list(views or [])
        self.dir = dir
        self.overwrite = overwrite

    def root(self, trainer: Trainer) -> Path:
        return Path(self.dir) if self.dir else Path(trainer.default_root_dir) / "export"

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Bad view names and folders that would not be replaced fail before the run, not after it."""
        if not self.views:
            return
        available = run_views(pl_module)
        bad = [v for v in self.views if v not in available]
        if bad:
            raise ValueError(
                f"export.views {bad} are not views of this run; its views are {available}"
            )
        existing = [
            str(self.root(trainer) / v)
            for v in self.views
            if (self.root(trainer) / v).exists()
        ]
        if existing and not self.overwrite:
            raise FileExistsError(
                f"export folders {existing} exist; set export.overwrite: true to replace them"
            )

    def on_test_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not self.views or not trainer.is_global_zero:
            return
        report = {
            "model": asdict(pl_module.model_cfg),
            **pl_module.report,
            "evaluation": trainer.datamodule.eval_summary(),
        }
        seed = _seed(Path(trainer.default_root_dir))
        for path in export_views(
            pl_module,
            report,
            self.views,
            self.root(trainer),
            overwrite=self.overwrite,
            seed=seed,
        ):
            rank_zero_info(f"exported {path}")


def run_views(module: GhostDistill) -> list[str]:
    """Every view a run has: the baselines, each recovery method and each fine-tuned method."""
    return [
        DENSE,
        PRUNED,
        *(r.name for r in module.recovery_cfgs),
        *(ft_view(m) for m in module.distill_cfg.methods),
    ]


def export_views(
    module: GhostDistill,
    report: dict,
    views: list[str],
    root: Path,
    *,
    overwrite: bool = False,
    seed: int | None = None,
) -> list[Path]:
    """Write each of `views` of an in-memory run to `root/<view>`; `report` is the run's results."""
    available = run_views(module)
    bad = [
        v
        for v in views
        if v not in available
        or (module.pruned is not None and v not in module.pruned.views)
    ]
    if bad:
        raise ValueError(f"cannot export {bad}: this run's views are {available}")
    paths = []
    for view in views:
        paths.append(
            export_view(
                module.pruned,
                view,
                root / view,
                method=_method(module, view),
                tokenizer=module.tokenizer,
                info=provenance(report, view, _method(module, view), seed),
                overwrite=overwrite,
            )
        )
    return paths


def _method(module: GhostDistill, view: str) -> str | None:
    if view in (DENSE, PRUNED):
        return None
    base = next((m for m in module.distill_cfg.methods if ft_view(m) == view), view)
    return next(r.method for r in module.recovery_cfgs if r.name == base)


def provenance(report: dict, view: str, method: str | None, seed: int | None) -> dict:
    """What config.json records under `ghostdistill` (and the model card shows): the plan, the method
    and its settings, the calibration data and size, the seed, the view's metrics beside the dense and
    pruned ones, and for a fine-tuned view the training budget and the step kept."""
    views = report.get("views", {})
    base = view.removesuffix("_ft")
    info: dict = {
        "base_model": report.get("model", {}).get("source"),
        "dtype": report.get("model", {}).get("dtype"),
        "view": view,
        "method": method,
        "recovery": (report.get("recovery") or {}).get(base),
        "plan": {k: v for k, v in report.get("plan", {}).items()},
        "calibration": {
            k: v
            for k, v in report.get("calibration", {}).items()
            if k != "token_groups"
        },
        "seed": seed,
        "metrics": views.get(view, {}).get("metrics"),
        "reference_metrics": {
            v: views[v]["metrics"] for v in (DENSE, PRUNED) if v in views and v != view
        },
        "evaluation": {
            k: v
            for k, v in report.get("evaluation", {}).items()
            if k in ("seq_len", "max_windows", "sources")
        },
    }
    distill = report.get("distill")
    if distill and view.endswith("_ft"):
        best = (distill.get("best") or {}).get(view, {})
        info["distill"] = {
            "steps": distill.get("steps"),
            "kept": distill.get("kept"),
            "step": best.get("step")
            if distill.get("kept") == "best"
            else distill.get("steps"),
            "train": distill.get("train"),
            "lr": distill.get("lr"),
            "loss": distill.get("loss"),
        }
    return info


def _seed(run_dir: Path) -> int | None:
    import yaml

    config = run_dir / "config.yaml"
    if not config.is_file():
        return None
    return (yaml.safe_load(config.read_text()) or {}).get("seed_everything")


def export_from_run(
    module: GhostDistill,
    datamodule,
    run: Path,
    views: list[str],
    out: Path | None = None,
    *,
    overwrite: bool = False,
) -> list[Path]:
    """Export views of the finished run in `run`, given the module and datamodule its `config.yaml`
    builds (`cli.export_run` builds them)."""
    results_path = run / "results.json"
    for path in (results_path, run / Calibration.STATE_FILE):
        if not path.is_file():
            raise FileNotFoundError(
                f"{path} is missing: export reads a finished run folder (run `fit` first)"
            )
    report = json.loads(results_path.read_text())
    available = run_views(module)
    bad = [v for v in views if v not in available]
    if bad:
        raise ValueError(f"cannot export {bad}: the views of {run} are {available}")
    fine_tuned = [
        v for v in views if v in {ft_view(m) for m in module.distill_cfg.methods}
    ]
    steps = int((report.get("distill") or {}).get("steps", 0)) if fine_tuned else 0
    # The statistics come from calibration_state.pt; `test` with no batches runs only the setup hooks
    # (the Calibration callback: plan, statistics, solves, students).
    trainer = Trainer(
        accelerator="auto",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_test_batches=0,
        default_root_dir=str(run),
        callbacks=[Calibration(checkpoint_every=0, progress=False)],
    )
    trainer.test(module, datamodule=datamodule, verbose=False)
    if fine_tuned:
        _load_students(module, run, report)
    return export_views(
        module,
        report,
        views,
        out or run / "export",
        overwrite=overwrite,
        seed=_seed(run),
    )


@torch.no_grad()
def _load_students(module: GhostDistill, run: Path, report: dict) -> None:
    """Put each fine-tuned view at the step the run's report shows, from `checkpoints/last.ckpt`."""
    path = run / "checkpoints" / "last.ckpt"
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} is missing: the fine-tuned views' weights are in the run's checkpoint"
        )
    checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    module.on_load_checkpoint(
        checkpoint
    )  # checks the checkpoint holds exactly this run's students
    missing, unexpected = module.load_state_dict(checkpoint["state_dict"], strict=False)
    trainable = {name for name, p in module.named_parameters() if p.requires_grad}
    if unexpected or trainable & set(missing):
        raise ValueError(
            f"{path} does not match the run's students (unexpected {unexpected[:3]}, missing "
            f"{sorted(trainable & set(missing))[:3]})"
        )
    distill = report.get("distill") or {}
    last_step = int(checkpoint["global_step"])
    for view in module.students.views:
        wanted = (
            distill.get("steps")
            if distill.get("kept") != "best"
            else distill.get("best", {}).get(view, {}).get("step")
        )
        if wanted is None or int(wanted) == last_step:
            continue
        best = module.best.get(view)
        if best is None or int(best["step"]) != int(wanted):
            raise ValueError(
                f"{view}: the report shows step {wanted}, but {path} holds step {last_step} and best "
                f"step {None if best is None else best['step']}"
            )
        module.students.load_trainable_state(view, best["state"])
