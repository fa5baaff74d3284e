"""Export: views of a run written as Hugging Face folders and GGUF files, from memory or from a finished run folder.

    export_views(pruned, tokenizer, report, cfg, views, root)    an in-memory run (the end of `fit`)
    reload.export_run(run_dir, cfg, views)                         a run folder, without a Trainer
    run_view_model(pruned, report, cfg, view)                      one view in memory, as its folder loads

`formats` picks what is written per view: ``hf`` (the folder `<root>/<view>`, `export.writer`) and ``gguf``
(`<root>/<view>.<type>.gguf` per type of `gguf_types`, `export.gguf`; plain views only, operator views are
refused before anything is loaded or written) and ``compressed-tensors`` (`<root>/<view>.<scheme>` per scheme of
`schemes`, `export.compressed`: quantized by llm-compressor in its own environment, for vLLM). A llama-quantize
type (`export.quantize`) takes an importance matrix over the run's calibration windows (`imatrix`, on by
default); the tools it needs are checked before anything loads.

From a run folder (`pipeline.reload`, which rebuilds it as a `pipeline.run.Run`) nothing the run cached is recomputed: the calibration statistics come from
`calibration_state.pt` (only the closed-form solves run again, and the student passes of a sequential
fit with several gaps), and a fine-tuned `<name>_ft` view takes its trained values from
`checkpoints/last.ckpt` (loaded with `weights_only=True`: tensors and plain data, never code) at the
step the run's report shows (`distill.kept`: the best validation step, kept in the checkpoint, or the
last one).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import asdict
from pathlib import Path

import torch

from ..core.checks import check_names, check_unique
from ..core.io import check_writable
from ..core.lock import hold, lock_path
from ..core.model import resolve_source
from ..core.views import DENSE, PRUNED, PrunedModel
from ..distill.config import Student
from ..distill.interface import get_part
from ..export import compressed, export_view, view_model
from ..export.gguf import DEFAULT_GGUF_TYPES, check_gguf_types, check_gguf_views, export_gguf, gguf_path
from ..export.gguf import FORMATS as GGUF_FORMATS
from ..export.quantize import check_quantize
from ..export.writer import check_target
from .config import RunConfig

FORMATS = (*GGUF_FORMATS, compressed.FORMAT)


def check_formats(formats: Sequence[str]) -> list[str]:
    return check_names("export format", formats, FORMATS)


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


def source_gguf(cfg: RunConfig) -> Path | None:
    """The GGUF file the run's model was read from (SmolLM2's wheel, a `.gguf` source), or None."""
    folder, name = resolve_source(cfg.model)
    return Path(folder) / name if name else None


def check_views(
    cfg: RunConfig,
    views: list[str],
    where: str = "this run",
    formats: Sequence[str] = ("hf",),
    gguf_types: Sequence[str] = DEFAULT_GGUF_TYPES,
    imatrix: bool = True,
    schemes: Sequence[str] = compressed.DEFAULT_SCHEMES,
    quantize_python: str | None = None,
) -> None:
    """Everything an export can check before it loads or computes anything: the view names, the formats,
    GGUF types and quantization schemes, that no view asked for as GGUF keeps operators, that llama.cpp's
    tools are there for a k-quant and llm-compressor's environment for a quantized folder."""
    formats = check_formats(formats)
    check_unique("export views", views)
    available = cfg.views()
    bad = [v for v in views if v not in available]
    if bad:
        raise ValueError(f"cannot export {bad}: the views of {where} are {available}")
    if "gguf" in formats:
        check_gguf_types(gguf_types)
        check_gguf_views(views, cfg.method_of)
        check_quantize(gguf_types, imatrix)
    if compressed.FORMAT in formats:
        compressed.check_schemes(schemes)
        compressed.quantize_python(quantize_python)


def export_targets(
    root: Path,
    views: list[str],
    formats: Sequence[str] = ("hf",),
    gguf_types: Sequence[str] = DEFAULT_GGUF_TYPES,
    schemes: Sequence[str] = compressed.DEFAULT_SCHEMES,
) -> list[Path]:
    """The paths an export writes, in order: per view its folder (``hf``), its GGUF files (``gguf``), then its
    quantized folders (``compressed-tensors``)."""
    out: list[Path] = []
    for view in views:
        if "hf" in formats:
            out.append(root / view)
        if "gguf" in formats:
            out += [gguf_path(root, view, t) for t in gguf_types]
        if compressed.FORMAT in formats:
            out += compressed.targets(root, [view], schemes)
    return out


def check_targets(
    root: Path,
    views: list[str],
    overwrite: bool,
    flag: str = "--overwrite",
    formats: Sequence[str] = ("hf",),
    gguf_types: Sequence[str] = DEFAULT_GGUF_TYPES,
    schemes: Sequence[str] = compressed.DEFAULT_SCHEMES,
) -> None:
    """The folders and files `views` would be written to (`export_targets`), checked before any work: none
    exists unless `overwrite`, and `root` is (or can be made) a writable folder. `flag` names how the user
    asks to overwrite."""
    root = Path(root)
    targets = export_targets(root, views, formats, gguf_types, schemes)
    existing = [str(p) for p in targets if os.path.lexists(p)]
    if existing and not overwrite:
        raise FileExistsError(f"export targets {existing} exist; pass {flag} to replace them, or choose another dir")
    for path in targets:
        check_target(path, "file" if path.suffix == ".gguf" else "folder", overwrite, flag)
    check_writable(root, "export dir")


@contextmanager
def holding_targets(
    root: Path,
    views: list[str],
    formats: Sequence[str],
    gguf_types: Sequence[str],
    schemes: Sequence[str] = compressed.DEFAULT_SCHEMES,
) -> Iterator[None]:
    """Hold the lock of every target an export writes (`core.lock`), from before the model loads until the
    last file is written: a second export of the same folders is refused at once, naming this one."""
    with ExitStack() as stack:
        for path in export_targets(Path(root), views, formats, gguf_types, schemes):
            stack.enter_context(hold(lock_path(path), f"export to {path}", "wait for that export to finish"))
        yield


def export_views(
    pruned: PrunedModel,
    tokenizer,
    report: dict,
    cfg: RunConfig,
    views: list[str],
    root: Path,
    *,
    overwrite: bool = False,
    seed: int | None = None,
    formats: Sequence[str] = ("hf",),
    gguf_types: Sequence[str] = DEFAULT_GGUF_TYPES,
    write: bool = True,
    imatrix: bool = True,
    calibration: Callable[[], torch.Tensor] | None = None,
    schemes: Sequence[str] = compressed.DEFAULT_SCHEMES,
    quantize_python: str | None = None,
) -> list[Path]:
    """Write each of `views` of an in-memory run in `formats` under `root`; `report` is the run's results;
    `calibration` gives the run's calibration windows (the importance matrix of a k-quant, the calibration of
    ``compressed-tensors``). Returns `export_targets`' paths. `write` false: a rank of a sharded model other
    than rank 0, which joins every gather and writes nothing (`export.parts`)."""
    check_built(
        pruned,
        cfg,
        views,
        formats=formats,
        gguf_types=gguf_types,
        imatrix=imatrix,
        schemes=schemes,
        quantize_python=quantize_python,
    )
    if compressed.FORMAT in formats and calibration is None:
        raise ValueError(f"{compressed.FORMAT} calibrates on the run's windows: pass calibration (Run.export does)")
    # Each writer holds its target's lock while it writes (`export.writer`, `export.gguf`).
    if write:
        check_targets(
            root, views, overwrite, "overwrite (--overwrite / export.overwrite: true)", formats, gguf_types, schemes
        )
    paths: list[Path] = []
    for view in views:
        method, info = view_provenance(report, cfg, view, seed)
        if "hf" in formats:
            paths.append(
                export_view(
                    pruned,
                    view,
                    root / view,
                    method=method,
                    tokenizer=tokenizer,
                    info=info,
                    overwrite=overwrite,
                    write=write,
                )
            )
        if "gguf" in formats:
            paths += export_gguf(
                pruned,
                view,
                root,
                method=method,
                tokenizer=tokenizer,
                info=info,
                types=gguf_types,
                overwrite=overwrite,
                write=write,
                imatrix=imatrix,
                calibration=calibration,
                vocab_source=source_gguf(cfg),
            )
        if compressed.FORMAT in formats:
            paths += compressed.export_compressed(
                pruned,
                view,
                root,
                method=method,
                tokenizer=tokenizer,
                info=info,
                calibration_ids=calibration(),
                schemes=schemes,
                python=quantize_python,
                overwrite=overwrite,
            )
    return paths


def check_built(
    pruned: PrunedModel,
    cfg: RunConfig,
    views: list[str],
    formats: Sequence[str] = ("hf",),
    gguf_types: Sequence[str] = DEFAULT_GGUF_TYPES,
    **checks,
) -> None:
    """`check_views` (`checks`: its other settings), and that this in-memory run built every one of `views`."""
    check_views(cfg, views, formats=formats, gguf_types=gguf_types, **checks)
    missing = [v for v in views if v not in pruned.views]
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
    check_built(pruned, cfg, [view])
    method, info = view_provenance(report, cfg, view, seed)
    return view_model(pruned, view, method=method, info=info)
