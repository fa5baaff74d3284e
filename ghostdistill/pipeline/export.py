"""Export: views of a run written in the registered formats (`export.formats`: Hugging Face folders, GGUF
files, compressed-tensors folders), from memory or from a finished run folder.

    check_export(cfg, options, root)                            every check, before anything loads
    export_views(pruned, tokenizer, report, cfg, root, options)  an in-memory run (the end of `fit`)
    reload.export_run(run_dir, cfg, options)                     a run folder, without a Trainer
    run_view_model(pruned, report, cfg, view)                    one view in memory, as its folder loads

`ExportOptions` are the views, the folder, `overwrite`, the formats and their options (`gguf_types`,
`imatrix`, `schemes`, `quantize_python`), the same keys for the `Export` callback and the `export` command.
A llama-quantize type (`export.quantize`) takes an importance matrix over the run's calibration windows
(`imatrix`, on by default), and so does compressed-tensors' calibration; the tools each format needs are
checked before anything loads.

From a run folder (`pipeline.reload`, which rebuilds it as a `pipeline.run.Run`) nothing the run cached is recomputed: the calibration statistics come from
`calibration_state.pt` (only the closed-form solves run again, and the student passes of a sequential
fit with several gaps), and a fine-tuned `<name>_ft` view takes its trained values from
`checkpoints/last.ckpt` (loaded with `weights_only=True`: tensors and plain data, never code) at the
step the run's report shows (`distill.kept`: the best validation step, kept in the checkpoint, or the
last one).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..core.checks import check_unique
from ..core.io import check_writable
from ..core.lock import hold, lock_path
from ..core.model import resolve_source
from ..core.views import DENSE, PRUNED, PrunedModel
from ..distill.config import Student
from ..distill.interface import get_part
from ..export import view_model
from ..export.compressed import DEFAULT_SCHEMES
from ..export.formats import export_targets, format_keys, get_formats
from ..export.gguf import DEFAULT_GGUF_TYPES
from ..export.parts import exporting
from ..export.quantize import QUANTIZE_TYPES, quantized
from ..export.writer import check_target, prepare
from ..reporting.flags import view_flags
from .config import RunConfig


def provenance(report: dict, view: str, method: str | None, seed: int | None, student: Student | None = None) -> dict:
    """What config.json records under `ghostdistill` (and the model card shows): the plan, the method
    and its settings, the calibration data and size, the seed, the view's metrics beside the dense and
    pruned ones, and for a fine-tuned view the training budget and the step kept."""
    views = report.get("views", {})
    info: dict = {
        "base_model": report.get("model", {}).get("source"),
        "dtype": report.get("model", {}).get("dtype"),
        "view": view,
        "method": method,
        "recovery": (report.get("recovery") or {}).get(student.method if student is not None else view),
        "plan": dict(report.get("plan", {})),
        "calibration": {k: v for k, v in report.get("calibration", {}).items() if k != "token_groups"},
        "seed": seed,
        "metrics": views.get(view, {}).get("metrics"),
        "reference_metrics": {v: views[v]["metrics"] for v in (DENSE, PRUNED) if v in views and v != view},
        "evaluation": {
            k: v for k, v in report.get("evaluation", {}).items() if k in ("seq_len", "max_windows", "sources")
        },
    }
    distill = report.get("distill")
    if distill and student is not None:
        best = (distill.get("best") or {}).get(view, {})
        info["distill"] = {
            "steps": distill.get("steps"),
            "kept": distill.get("kept"),
            "step": best.get("step") if distill.get("kept") == "best" else distill.get("steps"),
            "student": student.name,
            "method": student.method,
            "train": list(student.train),
            "lr": {kind: get_part(kind).lr(student) for kind in student.train},
            "loss": asdict(student.loss),
        }
        for kind in student.train:
            info["distill"].update(get_part(kind).settings(student))
    return info


@dataclass
class ExportOptions:
    """What an export writes: the `export` section of a `fit` config (the `Export` callback, after the report)
    and the options of the `export <run>` command, one set of keys, defaults and checks for both.

    Args:
        views: views to export (e.g. ``[ghost, ghost_ft]``); empty exports nothing.
        dir: parent folder of the exported views (one sub-folder per view); default ``<run>/export``.
        overwrite: replace existing folders and files.
        format: what to write per view, one or more registered formats (`export.formats`): ``hf`` (the folder
            ``<dir>/<view>``), ``gguf`` (``<dir>/<view>.<type>.gguf`` for llama.cpp; plain views only) and
            ``compressed-tensors`` (``<dir>/<view>.<scheme>`` for vLLM, quantized by llm-compressor in its own
            environment).
        gguf_types: the GGUF files' types: ``F32``, ``F16``, ``Q8_0`` (written by ghostdistill) and llama.cpp's
            llama-quantize types (``Q6_K``, ``Q5_K_M``, ``Q4_K_M``, …; `export.quantize`).
        imatrix: k-quants with an importance matrix over the run's calibration windows (false: without).
        schemes: the compressed-tensors schemes, of ``W8A8``, ``W4A16``, ``W4A16-AWQ``, ``W8A16``.
        quantize_python: the Python of the environment with llm-compressor (default .venv-quantize/bin/python).
        format_options: the options of a format that declares them (`ExportFormat.options`, a dataclass a
            format of your own declares), by format name: ``{torch_file: {dtype: float16}}``.
    """

    views: list[str] = field(default_factory=list)
    dir: str | None = None
    overwrite: bool = False
    format: list[str] = field(default_factory=lambda: ["hf"])
    gguf_types: list[str] = field(default_factory=lambda: list(DEFAULT_GGUF_TYPES))
    imatrix: bool = True
    schemes: list[str] = field(default_factory=lambda: list(DEFAULT_SCHEMES))
    quantize_python: str | None = None
    format_options: dict | None = None

    def root(self, run_dir: str | os.PathLike) -> Path:
        return Path(self.dir) if self.dir else Path(run_dir) / "export"


def check_view_names(cfg: RunConfig, views: Sequence[str], where: str = "this run", key: str = "views") -> None:
    check_unique("export views", views)
    bad = [v for v in views if v not in cfg.views()]
    if bad:
        raise ValueError(f"{key} {bad} are not views of {where}; its views are {cfg.views()}")


# How each format's own key (`export.formats.format_keys`) is named where it is given.
CLI_NAMES = {"format": "--format", "gguf_types": "--gguf-types", "imatrix": "--no-imatrix", "schemes": "--schemes",
             "quantize_python": "--quantize-python"}  # fmt: skip
CONFIG_NAMES = {"format": "export.format", "gguf_types": "export.gguf_types", "imatrix": "export.imatrix: false",
                "schemes": "export.schemes", "quantize_python": "export.quantize_python"}  # fmt: skip


def check_ignored(options: ExportOptions, given: Iterable[str], names: dict[str, str] = CLI_NAMES) -> None:
    """Refuse, in one line, an option the user gave (`given`, of `format_keys()`) that this export would
    ignore: a format's option without that format, and the importance matrix's switch without a type that uses
    it (F32, F16 and Q8_0 are written without one). `names`: how the user wrote each key."""
    formats, owners = list(options.format), format_keys()
    for key in given:
        owner = owners.get(key)
        if owner is not None and owner not in formats:
            raise ValueError(
                f"{names[key]} applies to {names['format']} {owner} only, and the formats are {formats}: add {owner} "
                f"to {names['format']}, or drop {names[key]}"
            )
    if "imatrix" in given and not quantized(options.gguf_types):
        raise ValueError(
            f"{names['imatrix']} applies to llama-quantize's GGUF types (Q4_K_M, Q6_K, ...) only, and "
            f"{names['gguf_types']} {list(options.gguf_types)} has none: drop {names['imatrix']}, or add one of "
            f"{list(QUANTIZE_TYPES)} to {names['gguf_types']}"
        )


def check_options(options: ExportOptions) -> list:
    """The formats and their options, and the tools they need (what needs no run); returns the formats."""
    formats = get_formats(options.format)
    other = [name for name in options.format_options or {} if name not in options.format]
    if other:
        raise ValueError(
            f"export.format_options names {other}, which are not among the formats {list(options.format)}: add "
            "them to the formats, or drop their options"
        )
    for fmt in formats:
        fmt.options_of(options)
        fmt.check(options)
    return formats


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


@contextmanager
def holding_targets(root: Path, options: ExportOptions) -> Iterator[None]:
    """Hold the lock of every target an export writes (`core.lock`), from before the model loads until the
    last file is written: a second export of the same folders is refused at once, naming this one."""
    with ExitStack() as stack:
        for path, _ in export_targets(Path(root), options.views, options):
            stack.enter_context(hold(lock_path(path), f"export to {path}", "wait for that export to finish"))
        yield


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
    (`export.parts`)."""
    check_built(pruned, cfg, options)
    formats = get_formats(options.format)
    needs = [f.name for f in formats if f.calibrates(options)]
    if needs and calibration is None:
        raise ValueError(f"{', '.join(needs)} calibrate on the run's windows: pass calibration (Run.export does)")
    # Each writer holds its target's lock while it writes (`export.writer`, `export.gguf`).
    if write:
        check_export(cfg, options, root, flag="overwrite (--overwrite / export.overwrite: true)")
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


def check_built(pruned: PrunedModel, cfg: RunConfig, options: ExportOptions) -> None:
    """`check_export` without the targets, and that this in-memory run built every one of the views."""
    check_export(cfg, options)
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
