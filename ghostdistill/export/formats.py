"""Export formats, each one registered object: what `export.format` (and `export --format`) may name.

A format checks its options and the views it is asked for before any work (`check`; `check_view`: the kinds
of view it `takes`, known from their method: those that ship stock are ``plain``, the others keep
``operators``), names what it writes (`targets`, each a ``folder`` or a ``file``: `target`), says what a common reader would
make of a view's files other than the view (`notes`: GGUF read by transformers' `gguf_file=`, `gguf_header`) and
writes one view prepared once for every format (`write`, a `writer.ViewExport`). Shipped (what each writes:
`ExportOptions.format`): ``hf`` (`writer`; every kind), ``gguf`` (`gguf`, the k-quants by `quantize`; plain views)
and ``compressed-tensors`` (`compressed`; every kind). A format of one's own may declare `options` (a dataclass
of its keys, given as `export.format_options: {<name>: {...}}`, read by `options_of`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from ..core.checks import check_names
from ..core.options import make_options
from ..core.registry import Registry
from ..methods import ships_stock
from . import compressed
from .gguf import check_gguf_types, gguf_path, refusal, write_gguf_files
from .gguf_header import transformers_misreadings
from .quantize import check_quantize, quantized
from .writer import ViewExport, write_folder


def view_kind(method: str | None) -> str:
    """``plain`` (the model's own architecture) or ``operators`` (the wrapper keeping the gap operators)."""
    return "plain" if ships_stock(method) else "operators"


class ExportFormat:
    """One way of writing a view (module docstring); `options` is the export's `export.options.ExportOptions`."""

    name: str = ""
    takes: tuple[str, ...] = ("plain", "operators")
    target: str = "folder"
    options: type | None = None  # a dataclass of its own keys, set as `format_options: {<name>: {...}}`
    # The shipped formats' keys of `ExportOptions` (flat, as users have written them since before
    # `format_options`): given without the format, they are refused (`export.options.check_ignored`).
    keys: tuple[str, ...] = ()

    def options_of(self, options) -> Any:
        """The export's `format_options[name]` as this format's `options` class, checked (`core.options`)."""
        given = (options.format_options or {}).get(self.name)
        return make_options(self.options, given, f"export.format_options.{self.name}")

    def check(self, options) -> None:
        """Refuse bad options of this format, or a missing tool, before any work."""

    def check_view(self, view: str, method: str | None) -> None:
        if view_kind(method) not in self.takes:
            raise ValueError(
                f"export format {self.name!r} writes {' and '.join(self.takes)} views; {view!r} is not one"
            )

    def calibrates(self, options) -> bool:
        """Whether writing needs the run's calibration windows (`ViewExport.calibration`)."""
        return False

    def notes(self, view: ViewExport, root: Path, options) -> list[str]:
        """What a reader users actually use would make of this view's files other than the view, one line each
        (before anything is written: the export prints them and writes them into the model card)."""
        return []

    def targets(self, root: Path, view: str, options) -> list[Path]:
        raise NotImplementedError(f"export format {self.name!r} names no targets")

    def write(self, view: ViewExport, root: Path, options) -> list[Path]:
        raise NotImplementedError(f"export format {self.name!r} writes nothing")


class HuggingFace(ExportFormat):
    name = "hf"

    def targets(self, root: Path, view: str, options) -> list[Path]:
        return [Path(root) / view]

    def write(self, view: ViewExport, root: Path, options) -> list[Path]:
        return [write_folder(view, Path(root) / view.view, overwrite=options.overwrite)]


class GGUF(ExportFormat):
    name = "gguf"
    takes = ("plain",)
    target = "file"
    keys = ("gguf_types", "imatrix")

    def check(self, options) -> None:
        check_gguf_types(options.gguf_types)
        check_quantize(options.gguf_types, options.imatrix)

    def check_view(self, view: str, method: str | None) -> None:
        if view_kind(method) not in self.takes:
            raise ValueError(refusal(view, method))

    def calibrates(self, options) -> bool:
        return bool(quantized(options.gguf_types)) and options.imatrix

    def targets(self, root: Path, view: str, options) -> list[Path]:
        return [gguf_path(root, view, t) for t in options.gguf_types]

    def notes(self, view: ViewExport, root: Path, options) -> list[str]:
        if view.kind != "plain":  # refused when written (`write_gguf_files`)
            return []
        return transformers_misreadings(view, [p.name for p in self.targets(root, view.view, options)])

    def write(self, view: ViewExport, root: Path, options) -> list[Path]:
        return write_gguf_files(view, root, options.gguf_types, overwrite=options.overwrite, imatrix=options.imatrix)


class CompressedTensors(ExportFormat):
    name = compressed.FORMAT
    keys = ("schemes", "quantize_python")

    def check(self, options) -> None:
        compressed.check_schemes(options.schemes)
        compressed.quantize_python(options.quantize_python)

    def calibrates(self, options) -> bool:
        return True

    def targets(self, root: Path, view: str, options) -> list[Path]:
        return compressed.targets(root, [view], options.schemes)

    def write(self, view: ViewExport, root: Path, options) -> list[Path]:
        python = compressed.quantize_python(options.quantize_python)
        return compressed.write_compressed(view, Path(root), options.schemes, python, overwrite=options.overwrite)


# `register(fmt)` makes it `export.format: [<fmt.name>]`.
_FORMATS: Registry[ExportFormat] = Registry("export format", "export format", ExportFormat)
register, unregister, formats = _FORMATS.register, _FORMATS.unregister, _FORMATS.names


def format_keys() -> dict[str, str]:
    """Each format's own `ExportOptions` key, and the format that reads it (`ExportFormat.keys`)."""
    return {key: name for name in formats() for key in _FORMATS.get(name).keys}


def check_formats(names: Iterable[str]) -> list[str]:
    return check_names("export format", names, formats())


def get_formats(names: Iterable[str]) -> list[ExportFormat]:
    """The formats `names` asks for, in the order they were registered (what a view's files are written in)."""
    asked = check_formats(names)
    return [_FORMATS.get(n) for n in formats() if n in asked]


def export_targets(root: str | os.PathLike, views: Iterable[str], options) -> list[tuple[Path, str]]:
    """The paths an export writes, in order (per view, each format's), with what each is (`ExportFormat.target`)."""
    fmts = get_formats(options.format)
    return [(p, f.target) for view in views for f in fmts for p in f.targets(Path(root), view, options)]


register(HuggingFace())
register(GGUF())
register(CompressedTensors())
