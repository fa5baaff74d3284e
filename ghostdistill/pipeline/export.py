"""Export: views of a run written in the registered formats (`export.formats`: Hugging Face folders, GGUF
files, compressed-tensors folders), from memory or from a finished run folder.

    check_export(cfg, options, root)                            every check, before anything loads
    export_views(pruned, tokenizer, report, cfg, root, options)  an in-memory run (the end of `fit`)
    reload.export_run(run_dir, cfg, options)                     a run folder, without a Trainer
    run_view_model(pruned, report, cfg, view)                    one view in memory, as its folder loads

What an export is asked (`export.options.ExportOptions`) is checked there without a run, and here with its config.
A llama-quantize type (`export.quantize`) takes an importance matrix over the run's calibration windows
(`imatrix`, on by default), and so does compressed-tensors' calibration; the tools each format needs are
checked before anything loads. A run folder is rebuilt as a `pipeline.run.Run` by `pipeline.reload`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..core.checks import check_unique
from ..core.io import check_writable
from ..core.model import resolve_source
from ..core.views import PrunedModel
from ..export import view_model
from ..export.formats import export_targets, get_formats
from ..export.options import ExportOptions, check_options, provenance
from ..export.pieces import exporting
from ..export.writer import check_target, prepare
from ..reporting.flags import view_flags
from .config import RunConfig


def check_view_names(cfg: RunConfig, views: Sequence[str], where: str = "this run", key: str = "views") -> None:
    check_unique("export views", views)
    bad = [v for v in views if v not in cfg.views()]
    if bad:
        raise ValueError(f"{key} {bad} are not views of {where}; its views are {cfg.views()}")


def check_export(
    cfg: RunConfig,
    options: ExportOptions,
    root: Path | None = None,
    *,
    where: str = "this run",
    flag: str = "--overwrite",
    key: str = "views",
) -> None:
    """Everything an export can check before it loads or computes anything, in one place: the view names, the
    formats and their options, that every format takes every view (a GGUF of an operator view is refused),
    and, given `root`, the targets: none exists unless `options.overwrite` (`flag` names how the user asks),
    nothing of another kind stands in one's place (`writer.check_target`), and `root` is (or can be made) a
    writable folder. `key` names how the user gives the views."""
    check_view_names(cfg, options.views, where, key)
    for fmt in check_options(options):
        for view in options.views:
            fmt.check_view(view, cfg.method_of(view))
    if root is None:
        return
    targets = export_targets(root, options.views, options)
    existing = [str(p) for p, _ in targets if os.path.lexists(p)]
    if existing and not options.overwrite:
        raise FileExistsError(f"export targets {existing} exist; pass {flag} to replace them, or choose another dir")
    for path, kind in targets:
        check_target(path, kind, options.overwrite, flag)
    check_writable(Path(root), "export dir")


def export_views(
    pruned: PrunedModel,
    tokenizer,
    report: dict,
    cfg: RunConfig,
    root: Path,
    options: ExportOptions,
    *,
    seed: int | None = None,
    write: bool = True,
    calibration: Callable[[], torch.Tensor] | None = None,
    warn: Callable[[str], None] = lambda message: print(f"warning: {message}"),
) -> list[Path]:
    """Write each of `options.views` of an in-memory run under `root` in every format of `options` (checked
    first, `check_export`); `report` is the run's results; `calibration` gives the run's calibration windows
    (the importance matrix of a k-quant, the calibration of ``compressed-tensors``). Each view is described
    once (`writer.prepare`) and handed to every format. Before a view is written, what the report flags about it
    (`reporting.flags.view_flags`: worse than no repair, larger than the dense model, a method's assumption
    that did not hold) and what a reader would make of its files otherwise (`ExportFormat.notes`) go to `warn`
    and into its provenance (`warnings`), which the model card shows. Returns `export_targets`' paths. `write`
    false: a rank of a sharded model other than rank 0, which joins every gather and writes nothing
    (`export.pieces`)."""
    # Each writer holds its target's lock while it writes (`export.writer`, `export.gguf`); rank 0 checks them.
    check_built(pruned, cfg, options, root if write else None, flag="overwrite (--overwrite / export.overwrite: true)")
    formats = get_formats(options.format)
    needs = [f.name for f in formats if f.calibrates(options)]
    if needs and calibration is None:
        raise ValueError(f"{', '.join(needs)} calibrate on the run's windows: pass calibration (Run.export does)")
    # What every view is prepared with; a `.gguf` source (SmolLM2's wheel) lends GGUF files its vocabulary.
    folder, name = resolve_source(cfg.model)
    kw = {"write": write, "calibration": calibration, "vocab_source": Path(folder) / name if name else None}
    paths: list[Path] = []
    for view in options.views:
        method, info = view_provenance(report, cfg, view, seed)
        with exporting(pruned, view):
            prepared = prepare(pruned, view, method, tokenizer, info, **kw)
            if write:  # rank 0 says it once
                notes = [f"exporting {view}, which this run flags: {line}" for line in view_flags(report, view)]
                notes += [note for fmt in formats for note in fmt.notes(prepared, root, options)]
                for note in notes:
                    warn(note)
                if notes:  # the provenance of a view exported without a warning is as before
                    prepared.info["warnings"] = notes
            for fmt in formats:
                paths += fmt.write(prepared, root, options)
    return paths


def check_built(pruned: PrunedModel, cfg: RunConfig, options: ExportOptions, root: Path | None = None, **how) -> None:
    """`check_export` (of the targets too, given `root`), and that this in-memory run built every one of the views."""
    check_export(cfg, options, root, **how)
    missing = [v for v in options.views if v not in pruned.views]
    if missing:
        raise ValueError(f"cannot export {missing}: they were not built in this run (views: {pruned.views})")


def view_provenance(report: dict, cfg: RunConfig, view: str, seed: int | None) -> tuple[str | None, dict]:
    """(the method behind `view`, what its export records: `provenance`)."""
    method = cfg.method_of(view)
    student = next((s for s in cfg.distill.specs() if s.name == view), None)
    return method, provenance(report, view, method, seed, student)


def run_view_model(pruned: PrunedModel, report: dict, cfg: RunConfig, view: str, seed: int | None = None):
    """`view` of an in-memory run as a `transformers` model: the model its `export_views` folder loads as
    (`export.model.view_model`), with the same provenance in its config."""
    check_built(pruned, cfg, ExportOptions([view]))
    method, info = view_provenance(report, cfg, view, seed)
    return view_model(pruned, view, method=method, info=info)
