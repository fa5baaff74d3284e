"""The command line: `python -m ghostdistill <command>` (or the installed `ghostdistill` script).

    fit      --config <yaml> [overrides]       calibrate, fit the operators, distil (with max_steps > 0), evaluate
    compare  <compare.yaml> [fit overrides]    one `fit` per plan, gathered into one report
    export   <run> --views ... [--dir D]       write views of a finished run as Hugging Face folders / GGUF files
    frontier <frontier.yaml> [fit overrides]   per depth, streamline's and the repair-aware plans, evaluated

`fit` is a LightningCLI (YAML configs, `--print_config`, dotted overrides) built without its own
subcommands: the run is `run_fit`, which calls `Trainer.fit` only when there are steps to take, then
`Trainer.test`. Bad input ends in one line `error: ...` and exit status 2 (`GHOSTDISTILL_DEBUG=1` shows
the traceback).
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import Optional

from lightning.pytorch.cli import LightningCLI

from .lit.callbacks import Calibration, Export, Report
from .lit.checkpoint import LastCheckpoint, resolve_ckpt_path
from .lit.datamodule import GhostDataModule
from .lit.interrupts import terminate_on_sigterm
from .lit.module import GhostDistill
from .methods import RecoveryConfig
from .methods.base import drop_flat_defaults
from .reporting import compare

COMMANDS = {
    "fit": "calibrate, fit every method's operators, distil the students (trainer.max_steps > 0), evaluate",
    "compare": "run one fit per plan of a compare file and gather them into one report",
    "export": "write views of a finished run as Hugging Face model folders and GGUF files (llama.cpp)",
    "frontier": "for n = 1 … N blocks removed: every method on streamline's plan and on its repair-aware plan",
}


class _DropTips(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("💡 Tip")


def quiet_console() -> None:
    """A run's console shows the plan, progress, the result table and where files went, not library chatter:
    Lightning's advertising tip, a deprecation inside Lightning's own pytree helper, and LightningCLI's note on
    `args` (calls of `main` from Python pass their own arguments on purpose)."""
    # rank_zero_info logs through this logger (a filter on a logger sees only its own records).
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropTips())
    warnings.filterwarnings("ignore", message="LightningCLI's args parameter is intended")
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\).*")


quiet_console()


class GhostDistillCLI(LightningCLI):
    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(Calibration, "calibration")
        parser.add_lightning_class_args(Export, "export")
        parser.add_argument(
            "--ckpt_path",
            type=Optional[str],
            default=None,
            help="resume distillation: `last` (<run>/checkpoints/last.ckpt) or a checkpoint path",
        )
        parser.set_defaults(
            {
                "trainer.max_steps": 0,
                "trainer.logger": False,
                "trainer.enable_checkpointing": False,
                "trainer.enable_model_summary": False,
                "trainer.num_sanity_val_steps": 0,
                "trainer.default_root_dir": "runs/default",
                "trainer.devices": 1,
                "model.recovery": [{"name": "ghost", "method": "ghost"}],
            }
        )

    def parse_arguments(self, parser, args) -> None:
        """As LightningCLI parses, except that a `--model.recovery` list given on the command line replaces the
        config file's list: jsonargparse merges two lists of the same length entry by entry, which would give
        each entry keys of the file's entry at its position (keys its own method may not read)."""
        super().parse_arguments(parser, args)
        given = _last_value(list(args) if isinstance(args, list) else sys.argv[1:], "--model.recovery")
        if given is not None:
            from jsonargparse import ArgumentParser

            alone = ArgumentParser(exit_on_error=False)
            alone.add_argument("--recovery", type=list[RecoveryConfig])
            self.config.model.recovery = alone.parse_args(["--recovery", given]).recovery

    def before_instantiate_classes(self) -> None:
        # Keep tokenizers' own thread pool from fighting the DataLoader and torch for the cores.
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        check_strategy_config(self.config.get("trainer", {}).get("strategy"))

    def instantiate_trainer(self, **kwargs):
        extra = kwargs.pop("callbacks", []) or []
        # Export writes after the report, so a failed export never costs the results.
        callbacks = [
            *(c for c in extra if not isinstance(c, Export)),
            Report(),
            *(c for c in extra if isinstance(c, Export)),
        ]
        steps = self.config["trainer"].get("max_steps", 0)
        if steps and steps > 0:
            # `<run>/checkpoints/last.ckpt` every distill.checkpoint_every steps and at the end.
            every = self.config["model"]["distill"]["checkpoint_every"] or steps
            callbacks.append(LastCheckpoint(Path(self.config["trainer"]["default_root_dir"]) / "checkpoints", every))
        return super().instantiate_trainer(callbacks=callbacks, **kwargs)


def _last_value(args: list[str], key: str) -> str | None:
    value = None
    for i, arg in enumerate(args):
        if arg == key and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(key + "="):
            value = arg[len(key) + 1 :]
    return value


def check_strategy_config(strategy) -> None:
    """FSDP2 checkpoints must be whole: they hold only what trains, and a sharded one must hold every weight."""
    if isinstance(strategy, dict) and str(strategy.get("class_path", "")).endswith("ModelParallelStrategy"):
        if (strategy.get("init_args") or {}).get("save_distributed_checkpoint", True):
            raise ValueError(
                "ModelParallelStrategy: set init_args.save_distributed_checkpoint: false. Checkpoints hold only what "
                "trains, and a sharded checkpoint must hold every weight of the model to load"
            )


def build_fit(args: list[str] | dict, **kwargs) -> GhostDistillCLI:
    """The `fit` parser and what it instantiates (module, data module, trainer); nothing runs yet."""
    return GhostDistillCLI(
        GhostDistill,
        GhostDataModule,
        seed_everything_default=0,
        save_config_kwargs={"overwrite": True},
        args=args,
        run=False,
        # allow_abbrev off: argparse would otherwise take a misspelt prefix (`--trainer.max_step`) for the key it
        # abbreviates, where an unknown key must be rejected by name.
        parser_kwargs={"allow_abbrev": False, "default_config_files": [], "prog": "ghostdistill fit"},
        **kwargs,
    )


def run_fit(args: list[str]) -> GhostDistillCLI:
    """`fit`: distil when there are steps to take (resuming from `--ckpt_path`), then evaluate every view.
    SIGTERM stops it in every phase (`lit.interrupts`)."""
    with terminate_on_sigterm():
        cli = build_fit(args)
        trainer, model, data = cli.trainer, cli.model, cli.datamodule
        if trainer.max_steps != 0:
            ckpt = resolve_ckpt_path(
                cli.config.get("ckpt_path"), Path(trainer.default_root_dir), trainer.is_global_zero
            )
            # weights_only (Lightning >= 2.6): tensors and plain data only; `resolve_ckpt_path` has already
            # checked that `last` loads so, for older Lightning too.
            safe = {"weights_only": True} if "weights_only" in inspect.signature(trainer.fit).parameters else {}
            trainer.fit(model, datamodule=data, ckpt_path=ckpt, **safe)
        trainer.test(model, datamodule=data, verbose=False)
        return cli


def run_compare(argv: list[str]) -> Path:
    """`compare <compare.yaml> [fit overrides]`: one `fit` per plan in `<root>/<plan name>/` (a finished
    plan is not run again), then compare.json/csv/md/png in the root. The user's overrides apply to
    every plan; each plan's own keys come last, so they win."""
    parser = argparse.ArgumentParser(prog="ghostdistill compare", description=run_compare.__doc__)
    parser.add_argument("spec", help="the compare file (YAML: base config, root folder, plans)")
    parser.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="fit overrides for every plan, e.g. --data.batch_size 2"
    )
    ns = parser.parse_args(argv)
    spec = compare.load_spec(ns.spec)
    root = Path(spec["root"])
    runs = []
    for plan in spec["plans"]:
        run_dir = root / compare.plan_name(plan)
        results = run_dir / "results.json"
        if not results.is_file():
            # A greedy plan starts from the steps of a finished one of the same settings (fit checks them).
            source = compare.greedy_source(plan, [p for p, _ in runs])
            given = {"greedy_from": str(root / compare.plan_name(source))} if source else {}
            run_fit(
                [
                    "--config",
                    spec["base"],
                    *ns.overrides,
                    *compare.plan_args({**plan, **given}),
                    "--trainer.default_root_dir",
                    str(run_dir),
                ]
            )
        runs.append((plan, json.loads(results.read_text())))
    compare.write(root, compare.gather(runs, spec))
    print(f"compare report written to {root}/compare.md")
    return root


def run_frontier_command(argv: list[str]) -> Path:
    """`frontier <frontier.yaml> [fit overrides]`: per depth, the pruned model and every recovery entry of the
    base config on streamline's plan and on its own repair-aware plan (`pipeline.frontier`), resumable per
    depth; frontier.json/csv/md/png in the root. No Trainer runs: the phases are called directly."""
    from contextlib import nullcontext
    from dataclasses import asdict

    from .pipeline.frontier import run_frontier
    from .reporting import frontier

    parser = argparse.ArgumentParser(prog="ghostdistill frontier", description=run_frontier_command.__doc__)
    parser.add_argument("spec", help="the frontier file (YAML: base config, root, num_layers, criteria)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="fit overrides, e.g. --data.batch_size 2")
    ns = parser.parse_args(argv)
    spec = frontier.load_frontier_spec(ns.spec)
    root = Path(spec["root"])
    cli = build_fit(
        ["--config", spec["base"], *ns.overrides, "--trainer.default_root_dir", str(root)], save_config_callback=None
    )
    module, dm = cli.model, cli.datamodule
    cfg = module.cfg
    cfg.data = dm.cfg
    cfg.validate()
    cfg.check_selection("frontier")
    module.configure_model()
    llm = module.llm.to(cli.trainer.strategy.root_device)
    data = dm.bind(module.tokenizer, root, dense=lambda: nullcontext(llm), model_key=asdict(cfg.model))
    points = run_frontier(cfg, llm, data, root, spec["num_layers"], spec["criteria"])
    frontier.write(root, points, spec)
    print(f"frontier report written to {root}/frontier.md")
    return root


def load_run_config(run: Path):
    """The `RunConfig` and seed of a run folder, from its `config.yaml` parsed as `fit` parsed it. The
    model's tokenizer is loaded; nothing else is loaded or computed."""
    import yaml

    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} is missing: export reads a finished run folder (run `fit` first)")
    saved = {
        k: v
        for k, v in yaml.safe_load(config.read_text()).items()
        if k in ("seed_everything", "trainer", "model", "data", "calibration", "export")
    }
    model = saved.get("model") or {}
    if model.get("recovery"):
        # A run folder written before each method got its own keys lists every key of every entry.
        model["recovery"] = [drop_flat_defaults(entry) for entry in model["recovery"]]
    saved.setdefault("trainer", {})["default_root_dir"] = str(run)
    cli = build_fit(saved, save_config_callback=None)
    cfg = cli.model.cfg
    cfg.data = cli.datamodule.cfg
    return cfg, saved.get("seed_everything")


def run_export(argv: list[str]) -> list[Path]:
    """`export <run folder> --views v ... [--dir D] [--overwrite] [--format hf gguf] [--gguf-types F32 F16 Q8_0]`:
    write views of a finished run as Hugging Face folders (``<dir>/<view>/``) and GGUF files for llama.cpp
    (``<dir>/<view>.<type>.gguf``, plain views only) with `pipeline.export.export_run`, without a Trainer."""
    from .export.gguf import DEFAULT_GGUF_TYPES, FORMATS, check_formats, check_gguf_types
    from .pipeline.export import export_run

    parser = argparse.ArgumentParser(prog="ghostdistill export", description=run_export.__doc__)
    parser.add_argument("run", help="the run folder (trainer.default_root_dir of a finished fit)")
    parser.add_argument("--views", nargs="+", required=True, help="views to export, e.g. ghost ghost_ft")
    parser.add_argument("--dir", default=None, help="parent folder of the exported views (default <run>/export)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing folders and files")
    formats, types = ", ".join(FORMATS), " ".join(DEFAULT_GGUF_TYPES)
    parser.add_argument(
        "--format", nargs="+", default=["hf"], help=f"of {formats} (default hf); gguf: plain views only"
    )
    parser.add_argument("--gguf-types", nargs="+", default=list(DEFAULT_GGUF_TYPES), help=f"default {types}")
    args = parser.parse_args(argv)
    check_formats(args.format)
    check_gguf_types(args.gguf_types)
    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist (the trainer.default_root_dir of a finished fit)")
    cfg, seed = load_run_config(run)
    out = Path(args.dir) if args.dir else None
    paths = export_run(
        run, cfg, args.views, out, overwrite=args.overwrite, seed=seed, formats=args.format, gguf_types=args.gguf_types
    )
    for path in paths:
        print(f"exported {path}")
    return paths


def usage() -> str:
    lines = [
        "usage: python -m ghostdistill <command> [arguments]   (<command> --help for its arguments)",
        "",
        "commands:",
    ]
    lines += [f"  {name:<9} {text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(args: list[str] | None = None):
    """`python -m ghostdistill <command> ...` from Python: errors are raised as they are (see `entry`)."""
    argv = sys.argv[1:] if args is None else list(args)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        raise SystemExit(0 if argv else 2)
    command, rest = argv[0], argv[1:]
    if command == "fit":
        return run_fit(rest)
    if command == "compare":
        return run_compare(rest)
    if command == "export":
        return run_export(rest)
    if command == "frontier":
        return run_frontier_command(rest)
    print(f"error: unknown command {command!r}\n\n{usage()}", file=sys.stderr)
    raise SystemExit(2)


# What bad input raises; anything else is a bug and keeps its traceback.
USER_ERRORS = (ValueError, FileNotFoundError, FileExistsError, NotADirectoryError, ImportError, RuntimeError)


def entry() -> None:
    """The `ghostdistill` script and `python -m ghostdistill`: bad input ends in one line `error: ...` and exit
    status 2; `GHOSTDISTILL_DEBUG=1` shows the traceback instead."""
    try:
        main()
    except USER_ERRORS as err:
        if os.environ.get("GHOSTDISTILL_DEBUG"):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"error: {message}  (GHOSTDISTILL_DEBUG=1 shows the traceback)", file=sys.stderr)
        raise SystemExit(2) from None
