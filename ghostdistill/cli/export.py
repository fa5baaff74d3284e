"""`export <run>`: views of a finished run folder written as Hugging Face folders and GGUF files, without a
Trainer."""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

import yaml

from ..lit.interrupts import terminate_on_sigterm
from ..methods import drop_flat_defaults
from ..runner.config import run_config_of


def load_run_config(run: Path, trust_remote_code: bool = False):
    """The `RunConfig` and seed of a run folder, from its `config.yaml` parsed as `fit` parsed it; nothing is
    loaded or computed, and no Trainer is built. The file is someone else's: settings
    that would run code it names are refused unless `trust_remote_code` (the user's `--trust-remote-code`),
    and of the trainer section only the run folder is read (`pipeline.trust`)."""
    from ..core.io import read_mapping
    from ..pipeline.trust import check_trust, export_sections

    config = run / "config.yaml"
    if not config.is_file():
        raise FileNotFoundError(f"{config} is missing: export reads a finished run folder (run `fit` first)")
    raw = read_mapping(config, "run config")
    check_trust(raw, config, trust_remote_code)
    saved = export_sections(raw, run)
    model = saved.get("model") or {}
    if not isinstance(model, dict):
        raise ValueError(f"{config}: model is a {type(model).__name__}, not a mapping of keys")
    if model.get("recovery"):
        # A run folder written before each method got its own keys lists every key of every entry, and one
        # written beside a plug-in method holds its unset (null) keys too.
        model["recovery"] = [
            drop_flat_defaults({k: v for k, v in e.items() if v is not None}) for e in model["recovery"]
        ]
    return run_config_of(saved, str(config)), saved.get("seed_everything")


def run_export(argv: list[str]) -> list[Path]:
    """`export <run folder> --views v ... [--dir D] [--overwrite] [--format hf gguf compressed-tensors]
    [--gguf-types F32 F16 Q8_0 Q4_K_M ...] [--no-imatrix] [--schemes W8A8 W4A16] [--quantize-python P]
    [--trust-remote-code]`: write views of a finished run as Hugging Face folders (``<dir>/<view>/``), GGUF files
    for llama.cpp (``<dir>/<view>.<type>.gguf``, plain views only; k-quants by llama.cpp's llama-quantize, with
    an importance matrix over the run's calibration windows unless --no-imatrix) and quantized folders for vLLM
    (``<dir>/<view>.<scheme>/``, llm-compressor in its own environment) with `pipeline.reload.export_run`,
    without a Trainer. A run folder's config runs none of its author's code unless you pass
    --trust-remote-code. SIGTERM and SIGINT stop it with one line and leave no folder behind (each view is
    written in a temporary folder and renamed)."""
    from ..export.compressed import SETUP
    from ..export.formats import format_keys
    from ..export.options import ExportOptions, check_ignored, check_options
    from ..pipeline.reload import export_run
    from ..pipeline.trust import FLAG

    parser = argparse.ArgumentParser(prog="ghostdistill export", description=run_export.__doc__)
    parser.add_argument("run", help="the run folder (trainer.default_root_dir of a finished fit)")
    # The options are the `export` section's of a fit config (`ExportOptions`): its defaults and its help.
    default, helps = ExportOptions(), _option_help(ExportOptions)
    parser.add_argument("--views", nargs="+", required=True, help=helps["views"])
    parser.add_argument("--dir", default=default.dir, help=helps["dir"])
    parser.add_argument("--overwrite", action="store_true", help=helps["overwrite"])
    parser.add_argument("--format", nargs="+", default=default.format, help=helps["format"])
    parser.add_argument(
        "--gguf-types",
        nargs="+",
        default=None,  # None: not given (`check_ignored`), then the default
        help=helps["gguf_types"] + " (llama-quantize from .serve/llama.cpp or $GHOSTDISTILL_LLAMA_CPP)",
    )
    parser.add_argument(
        "--no-imatrix",
        dest="imatrix",
        action="store_false",
        help="k-quants without the importance matrix over the run's calibration windows (llama-quantize's "
        "round-to-nearest)",
    )
    parser.add_argument("--schemes", nargs="+", default=None, help=helps["schemes"])
    parser.add_argument("--quantize-python", default=None, help=helps["quantize_python"] + f": `{SETUP}`")
    parser.add_argument("--format-options", type=_mapping, default=None, help=helps["format_options"])
    parser.add_argument(
        FLAG,
        action="store_true",
        help="honour the run config's model.model.trust_remote_code: true (runs the Python files its model "
        "source ships); only for run folders whose author you trust",
    )
    args = parser.parse_args(argv)
    keys = [f.name for f in fields(ExportOptions)]
    given = [k for k in format_keys() if getattr(args, k) not in (None, True)]  # imatrix: given as --no-imatrix
    options = ExportOptions(**{k: getattr(args, k) for k in keys if getattr(args, k) is not None})
    check_options(options)  # formats, types, schemes and the tools they need, before the run is read
    check_ignored(options, given)  # an option of a format not asked for is refused, never ignored
    run = Path(args.run)
    if not run.is_dir():
        raise FileNotFoundError(f"run folder {run} does not exist (the trainer.default_root_dir of a finished fit)")
    with terminate_on_sigterm():
        cfg, seed = load_run_config(run, trust_remote_code=args.trust_remote_code)
        paths = export_run(run, cfg, options, seed=seed)
    for path in paths:
        print(f"exported {path}")
    return paths


def _mapping(text: str) -> dict:
    """A YAML (or JSON) mapping given on the command line: ``'{torch_file: {dtype: float16}}'``."""
    value = yaml.safe_load(text)
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a mapping such as '{{format: {{key: value}}}}', got {text!r}")
    return value


def _option_help(cls: type) -> dict[str, str]:
    """The `Args:` of a config class's docstring, by key (one line each), as jsonargparse reads them."""
    from jsonargparse import ArgumentParser

    parser = ArgumentParser()
    parser.add_class_arguments(cls)
    return {a.dest: " ".join(a.help.split()).replace("%", "%%") for a in parser._actions if a.help}
