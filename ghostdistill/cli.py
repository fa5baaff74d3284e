"""`python -m ghostdistill fit --config configs/<name>.yaml` (LightningCLI: `--print_config`, overrides).

`fit` runs the calibration (the `Calibration` callback, before any step), the distillation steps if
any are configured (none: training-free), then `test` over every view, which writes the results.
"""

from __future__ import annotations

import os
from dataclasses import asdict

from lightning.pytorch.cli import LightningCLI

from .callbacks import Calibration, Report
from .datamodule import GhostDataModule
from .module import GhostDistill
from .recovery import RecoveryConfig


class GhostDistillCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(Calibration, "calibration")
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
        return super().instantiate_trainer(callbacks=[*extra, Report()], **kwargs)

    def after_fit(self) -> None:
        self.trainer.test(self.model, datamodule=self.datamodule)


def main(args: list[str] | None = None) -> GhostDistillCLI:
    return GhostDistillCLI(
        GhostDistill,
        GhostDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
        parser_kwargs={"fit": {"default_config_files": []}},
    )
