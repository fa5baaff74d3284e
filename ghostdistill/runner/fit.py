"""`fit`: a LightningCLI (YAML configs, `--print_config`, dotted overrides) built without its own
subcommands: the run is `run_fit`, which calls `Trainer.fit` only when there are steps to take, then
`Trainer.test`. `build_fit` is the parser and what it instantiates; `runner.config` parses with it, nothing
instantiated, for `compare`, `frontier` and `export`. The command line's `fit` is `run_fit` of its arguments."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

from jsonargparse.typing import register_type
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.utilities.rank_zero import rank_zero_only

from ..core.run_folder import check_run_folder
from ..distill.parallel import tensor_parallel_refusal
from ..lit.callbacks import Calibration, Export
from ..lit.datamodule import GhostDataModule
from ..lit.interrupts import terminate_on_sigterm
from ..lit.module import GhostDistill
from ..lit.trainer import TRAINER_DEFAULTS, fit_and_test, run_callbacks
from ..methods import RecoveryConfig, recovery_entry
from ..pipeline.config import check_steps
from ..pipeline.settings import result_settings, stale_reason

# A recovery entry is one flat mapping whose keys are its method's (`methods.RecoveryConfig`): the parser reads
# it as that type, checking the keys of the method it names (registered at any time before the parse).
register_type(RecoveryConfig, serializer=RecoveryConfig.as_dict, deserializer=recovery_entry)


class GhostDistillCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(Calibration, "calibration")
        parser.add_lightning_class_args(Export, "export")
        # The run's config is complete when the module is built: the data module's settings become its `data`.
        parser.link_arguments("data", "model.data", compute_fn=lambda data: data.cfg, apply_on="instantiate")
        parser.add_argument(
            "--ckpt_path",
            type=Optional[str],
            default=None,
            help="resume distillation: `last` (<run>/checkpoints/last.ckpt) or a checkpoint path",
        )
        parser.add_argument(
            "--overwrite_run",
            type=bool,
            default=False,
            help="replace the results of a run of other settings in trainer.default_root_dir (config.yaml records false)",
        )
        trainer = {f"trainer.{key}": value for key, value in TRAINER_DEFAULTS.items()}
        parser.set_defaults({**trainer, "model.recovery": [{"name": "ghost", "method": "ghost"}]})

    def before_instantiate_classes(self) -> None:
        # Keep tokenizers' own thread pool from fighting the DataLoader and torch for the cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        trainer = self.config.get("trainer", {})
        check_accelerator(trainer.get("accelerator"), trainer.get("devices"))
        check_strategy_config(trainer.get("strategy"))
        root = trainer.get("default_root_dir")
        check_run_settings(trainer.get("max_steps"), root, self.config.get("ckpt_path"))

    def instantiate_trainer(self, **kwargs):
        trainer = self.config["trainer"]
        # After the model's and data's settings are made (a bad criterion is named first, not the folder), before
        # anything loads. `--ckpt_path` continues this folder's run on purpose (e.g. with more steps): not a copy
        # replacing it.
        if not self.config.get("overwrite_run") and not self.config.get("ckpt_path"):
            check_same_run(trainer.get("default_root_dir"), settings_of(self))
        callbacks = run_callbacks(
            kwargs.pop("callbacks", []) or [],
            Path(trainer["default_root_dir"]),
            trainer.get("max_steps", 0),
            self.config["model"]["distill"]["checkpoint_every"],
        )
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)


def check_accelerator(accelerator, devices) -> None:
    """GPUs asked for where there are none: one line before anything loads (Lightning's own check comes after the
    model's tokenizer, and is a traceback: "No supported gpu backend found!")."""
    import torch

    cuda, mps = torch.cuda.is_available(), torch.backends.mps.is_available()
    available = {"cuda": cuda, "mps": mps, "gpu": cuda or mps}
    if isinstance(accelerator, str) and not available.get(accelerator, True):
        raise RuntimeError(
            f"trainer.accelerator {accelerator!r} (trainer.devices {devices}) asks for GPUs, and this machine has none "
            "that torch can use: run on the CPU with --trainer.accelerator cpu --trainer.devices 1 --trainer.strategy "
            "auto (a config sized for several GPUs needs a smaller model there), or where the GPUs are"
        )


def check_strategy_config(strategy) -> None:
    """FSDP2 checkpoints must be whole: they hold only what trains, and a sharded one must hold every weight.
    FSDP2 shards over every process: Lightning's default splits them into tensor-parallel ranks instead."""
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("ModelParallelStrategy"):
        init_args = strategy.get("init_args") or {}
        if init_args.get("tensor_parallel_size", "auto") != 1:
            raise ValueError(tensor_parallel_refusal(init_args.get("data_parallel_size", "<devices>")))
        if init_args.get("save_distributed_checkpoint", True):
            raise ValueError(
                "ModelParallelStrategy: set init_args.save_distributed_checkpoint: false. Checkpoints hold only what "
                "trains, and a sharded checkpoint must hold every weight of the model to load"
            )


def check_run_settings(max_steps, root_dir, ckpt_path) -> None:
    """The trainer settings that would otherwise fail only after calibration (or as a traceback from the
    Trainer): the step count, the run folder, the checkpoint to resume from."""
    check_steps(max_steps)
    # Empty, a dangling link, a file, not writable (tried by rank 0 alone), a folder of the user's.
    check_run_folder(root_dir, write=rank_zero_only.rank == 0)
    if ckpt_path not in (None, "last") and not Path(ckpt_path).is_file():
        raise FileNotFoundError(
            f"--ckpt_path {ckpt_path} does not exist: give a checkpoint file, or `last` (<run>/checkpoints/last.ckpt)"
        )


def check_same_run(root_dir, settings: dict) -> None:
    """A run folder whose results.json records other settings than this run's (a copied and edited config.yaml
    names the run folder it was saved in) is refused, as `compare` refuses to reuse them (`stale_reason`):
    this run would replace them. A rerun of the same settings resumes; a results.json of no settings (an older
    version), unreadable or absent, is not compared."""
    try:
        saved = json.loads((Path(root_dir) / "results.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return
    if not isinstance(saved, dict) or saved.get("settings") is None:
        return
    why = stale_reason(saved, settings)
    if why:
        raise FileExistsError(
            f"trainer.default_root_dir {root_dir} holds a finished run, and {why}: this run would replace its "
            "results; give another trainer.default_root_dir (a new folder), add --overwrite_run true to replace them, "
            "or --ckpt_path last to continue that run"
        )


class SaveRunConfig(SaveConfigCallback):
    """config.yaml as LightningCLI saves it, with `overwrite_run: false`: replacing a run's results is this
    command's decision, never that of a copy of its config."""

    def __init__(self, parser, config, *args, **kwargs) -> None:
        if config.get("overwrite_run"):
            config = config.clone()
            config.overwrite_run = False
        super().__init__(parser, config, *args, **kwargs)


# jsonargparse's words for a type, as a user reads them.
_TYPE_WORDS = {
    "<class 'int'>": "an integer",
    "<class 'float'>": "a number",
    "<class 'str'>": "a string",
    "<class 'bool'>": "true or false",
    "<class 'NoneType'>": "null",
    "list[int]": "a list of integers",
}


def argument_line(err: BaseException) -> str:
    """A jsonargparse error in one line: a value of a plain type as the key, the value and what is valid
    (``model.plan.num_layers 2.5: expected an integer or null``), anything else flattened as it is."""
    text = str(err).strip()
    flat = " ".join(text.split())
    # A type of ours refused the value (its deserializer's message, e.g. a recovery entry's key): that message.
    own = re.match(r'Parser key "([^"]+)":.*?- Not of type \w+: ([^\n]*)', text, re.S)
    if own:
        return f"{own.group(1)}: {own.group(2).strip()}"
    union = re.fullmatch(
        r'Parser key "([^"]+)":\s+Does not validate against any of the Union subtypes\s+Subtypes: \[(.*?)\]\s+'
        r"Errors:(?:\s+- [^\n]*)+\s+Given value type: [^\n]*\s+Given value: (.*)",
        text,
    )
    if union:
        kinds = re.findall(r"<class '[^']+'>|[\w.]+\[[^\]]*\]", union.group(2))
        if kinds and all(k in _TYPE_WORDS for k in kinds):
            return f"{union.group(1)} {union.group(3)}: expected {' or '.join(_TYPE_WORDS[k] for k in kinds)}"
    single = re.fullmatch(r'Parser key "([^"]+)":\s+Expected a (.*?)\. Got value: (.*)', text, re.S)
    if single and "\n" not in single.group(3):
        kind = single.group(2)
        literal = re.fullmatch(r"typing\.Literal\[(.*)\]", kind)
        what = f"one of {literal.group(1)}" if literal else _TYPE_WORDS.get(kind, kind)
        return f"{single.group(1)} {single.group(3)}: expected {what}"
    return flat


def build_fit(
    args: list[str] | dict, cli_class: type = GhostDistillCLI, exit_on_error: bool = True, **kwargs
) -> GhostDistillCLI:
    """The `fit` parser and what it instantiates (module, data module, trainer); nothing runs yet.
    `exit_on_error=False`: a bad argument raises `jsonargparse.ArgumentError` instead of printing the usage."""
    return cli_class(
        GhostDistill,
        GhostDataModule,
        seed_everything_default=0,
        save_config_callback=SaveRunConfig,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=False,
        # allow_abbrev off: argparse would otherwise take a misspelt prefix (`--trainer.max_step`) for the key it
        # abbreviates, where an unknown key must be rejected by name.
        parser_kwargs=dict(
            allow_abbrev=False, default_config_files=[], prog="ghostdistill fit", exit_on_error=exit_on_error
        ),
        **kwargs,
    )


class _ParseOnly(GhostDistillCLI):
    """The `fit` parser without instantiating anything (no tokenizer, no trainer)."""

    def before_instantiate_classes(self) -> None:
        pass

    def instantiate_classes(self) -> None:
        pass


def settings_of(cli: GhostDistillCLI) -> dict:
    """The settings that decide a run's results (`pipeline.settings.result_settings`) of a parsed `fit`."""
    return result_settings(json.loads(cli.parser.dump(cli.config, format="json")))


def run_fit(args: list[str] | dict) -> GhostDistillCLI:
    """`fit` of command-line arguments or a config mapping (`runner.config.ParsedFit.config`): distil when there
    are steps to take (resuming from `ckpt_path`), then evaluate every view. SIGTERM stops it in every phase
    (`lit.interrupts`)."""
    from jsonargparse import ArgumentError

    with terminate_on_sigterm():
        try:
            cli = build_fit(args, exit_on_error=False)
        except ArgumentError as err:  # one line naming the key, not the usage of every key
            raise ValueError(argument_line(err)) from None
        trainer, model, data = cli.trainer, cli.model, cli.datamodule
        model.run.report.settings = settings_of(cli)  # results.json: what compare checks before reusing it
        model.run.seed = cli.config.get("seed_everything")  # what the exports record
        fit_and_test(trainer, model, data, cli.config.get("ckpt_path"))
        return cli
