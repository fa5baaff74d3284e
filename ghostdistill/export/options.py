"""What an export is asked to do, and what it can check with no run: `ExportOptions`, `check_options` (the
formats, their options and tools), `check_ignored` (an option the export would ignore, refused), `holding_targets`
(every target's lock for the whole export) and `provenance` (what config.json and the model card record of a
view). The run's side is `pipeline.export` and `pipeline.reload`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..core.lock import hold, lock_path
from ..core.views import DENSE, PRUNED
from ..distill.config import Student
from ..distill.interface import get_part
from .compressed import DEFAULT_SCHEMES
from .formats import export_targets, format_keys, get_formats
from .gguf import DEFAULT_GGUF_TYPES
from .quantize import QUANTIZE_TYPES, quantized


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


@contextmanager
def holding_targets(root: Path, options: ExportOptions) -> Iterator[None]:
    """Hold the lock of every target an export writes (`core.lock`), from before the model loads until the
    last file is written: a second export of the same folders is refused at once, naming this one."""
    with ExitStack() as stack:
        for path, _ in export_targets(Path(root), options.views, options):
            stack.enter_context(hold(lock_path(path), f"export to {path}", "wait for that export to finish"))
        yield
