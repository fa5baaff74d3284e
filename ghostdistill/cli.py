"""The command line: `python -m ghostdistill fit --config configs/<name>.yaml` (or the installed
`ghostdistill` script) and `... compare <compare.yaml> [fit overrides]`.

`fit` (LightningCLI: YAML configs, `--print_config`, overrides) runs the calibration (the `Calibration`
callback, before any step), the distillation steps if any are configured (none: training-free), then
`test` over every view, which writes the results. `compare` runs one `fit` per plan of a compare file,
each in its own folder, and gathers them into one report. `export <run> --views ...` writes views of a
finished run as Hugging Face model folders.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict
from pathlib import Path

from lightning.pytorch.cli import LightningCLI

from .lit.callbacks import Calibration, LastCheckpoint, Report
from .lit.datamodule import GhostDataModule
from .lit.export import Export
from .lit.interrupts import terminate_on_sigterm
from .lit.module import GhostDistill
from .methods import RecoveryConfig
from .reporting import compare


class GhostDistillCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(Calibration, "calibration")
        parser.add_lightning_class_args(Export, "export")
        parser.set_defaults(
            {
                "trainer.max_steps": 0,
                "trainer.logger": False,
                "trainer.enable_checkpointing": False,
                "trainer.num_sanity_val_steps": 0,
                "trainer.default_root_dir": "runs/default",
                "trainer.devices": 1,
                "model.recovery": [asdict(RecoveryConfig())],
            }
        )

    def before_instantiate_classes(self) -> None:
        # Keep tokenizers' own thread pool from fighting the DataLoader and torch for the cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    def instantiate_trainer(self, **kwargs):
        extra = kwargs.pop("callbacks", []) or []
        # Export writes after the report, so a failed export never costs the results.
        callbacks = [*(c for c in extra if not isinstance(c, Export)), Report(), *(c for c in extra if isinstance(c, Export))]
        config = self.config[self.subcommand] if self.subcommand else self.config
        steps = config.get("trainer", {}).get("max_steps", 0)
        if steps and steps > 0:
            # Resumable distillation: `<run>/checkpoints/last.ckpt` every distill.checkpoint_every steps and at
            # the end, holding only what trains (`--ckpt_path last` resumes).
            every = config["model"]["distill"]["checkpoint_every"] or steps
            callbacks.append(LastCheckpoint(dirpath=Path(config["trainer"]["default_root_dir"]) / "checkpoints",
                                            every_n_train_steps=every))
            kwargs["enable_checkpointing"] = True
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)

    def after_fit(self) -> None:
        self.trainer.test(self.model, datamodule=self.datamodule)


def fit(args: list[str] | None = None) -> GhostDistillCLI:
    """`fit` and LightningCLI's other subcommands; SIGTERM stops them in every phase (`lit.interrupts`)."""
    with terminate_on_sigterm():
        return _fit(args)


def _fit(args: list[str] | None) -> GhostDistillCLI:
    return GhostDistillCLI(
        GhostDistill,
        GhostDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
        # allow_abbrev off: argparse would otherwise take a misspelt prefix (`--trainer.max_step`) for the key it
        # abbreviates, where an unknown key must be rejected by name.
        parser_kwargs={"allow_abbrev": False, "fit": {"default_config_files": [], "allow_abbrev": False}},
    )


def run_compare(argv: list[str]) -> Path:
    """`compare <compare.yaml> [fit overrides]`: one `fit` per plan in `<root>/<plan name>/` (a finished
    plan is not run again), then compare.json/csv/md/png in the root. The user's overrides apply to
    every plan; each plan's own keys come last, so they win."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit("usage: python -m ghostdistill compare <compare.yaml> [fit overrides, e.g. --data.batch_size 2]")
    spec = compare.load_spec(argv[0])
    overrides = argv[1:]
    root = Path(spec["root"])
    runs = []
    for plan in spec["plans"]:
        run_dir = root / compare.plan_name(plan)
        results = run_dir / "results.json"
        if not results.is_file():
            fit(["fit", "--config", spec["base"], *overrides, *compare.plan_args(plan),
                 "--trainer.default_root_dir", str(run_dir)])
        runs.append((plan, json.loads(results.read_text())))
    compare.write(root, compare.gather(runs, spec))
    print(f"compare report written to {root}/compare.md")
    return root


def load_run(run: Path) -> tuple[GhostDistill, GhostDataModule]:
    """The module and datamodule of a run folder, from its `config.yaml` parsed as `fit` parsed it (less
    the `fit` subcommand's own keys: ckpt_path, ...). Nothing is loaded or computed yet."""
    import yaml

    config = run / "config.yaml"
    if not config.is_file():
        raise SystemExit(f"{config} is missing: export reads a finished run folder (run `fit` first)")
    saved = {k: v for k, v in yaml.safe_load(config.read_text()).items()
             if k in ("seed_everything", "trainer", "model", "data", "calibration", "export")}
    saved.setdefault("trainer", {})["default_root_dir"] = str(run)
    cli = GhostDistillCLI(GhostDistill, GhostDataModule, run=False, save_config_callback=None, args=saved)
    return cli.model, cli.datamodule


def export_run(argv: list[str]) -> list[Path]:
    """`export <run folder> [--views v ...] [--dir D] [--overwrite]`: write views of a finished run as
    Hugging Face folders (`lit.export`)."""
    import argparse

    from .lit.export import export_from_run

    parser = argparse.ArgumentParser(prog="ghostdistill export", description=export_run.__doc__)
    parser.add_argument("run", help="the run folder (trainer.default_root_dir of a finished fit)")
    parser.add_argument("--views", nargs="+", required=True, help="views to export, e.g. ghost ghost_ft")
    parser.add_argument("--dir", default=None, help="parent folder of the exported views (default <run>/export)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing folders")
    args = parser.parse_args(argv)
    run = Path(args.run)
    module, datamodule = load_run(run)
    paths = export_from_run(module, datamodule, run, args.views, Path(args.dir) if args.dir else None,
                            overwrite=args.overwrite)
    for path in paths:
        print(f"exported {path}")
    return paths


def main(args: list[str] | None = None):
    """Entry point of `python -m ghostdistill` and the `ghostdistill` script."""
    argv = sys.argv[1:] if args is None else list(args)
    if argv[:1] == ["compare"]:
        return run_compare(argv[1:])
    if argv[:1] == ["export"]:
        return export_run(argv[1:])
    return fit(argv)
