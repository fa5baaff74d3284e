"""GGUF files of a plain-architecture view, for llama.cpp: F32, F16 and Q8_0 written with the `gguf` package, the
k-quants (Q6_K, Q5_K_M, Q4_K_M, …) by llama.cpp's own `llama-quantize` from the F32 file (`quantize`).

Which views: those whose exported folder is the plain architecture (`pieces.view_pieces` kind ``plain``): the
pruned model, the views whose maps fold into the weights (magnitude, ReplaceMe, `rotation_through`), and the
fine-tuned students of those with their LoRA adapters merged. A view that keeps operators (ghost,
LinearPatch and their `_ft` students) computes `h + h·Δ` at each gap, a module llama.cpp's graphs do not
have, so it is refused before anything is written: fold the repair (`rotation_through` is ghost's foldable
form), or serve the Hugging Face folder with vLLM (its Transformers backend runs the operators).

Which families: LLaMA, Mistral, Qwen2, Qwen3 and Gemma 3 (`gguf_arch`: what llama.cpp's `convert_hf_to_gguf.py`
writes for each). What a file holds, as the converter writes it:

- tensors renamed by `gguf.get_tensor_name_map` of the family's architecture (``model.layers.3.self_attn.q_proj
  .weight`` -> ``blk.3.attn_q.weight``) over the *surviving* blocks, renumbered 0 … n-1; the head is left out
  when it is tied to the embedding (llama.cpp reuses ``token_embd``); LLaMA's Q and K rows permuted to GGML's
  rotary layout, Gemma's norms as 1 + γ (`gguf_arch`);
- the storage type per tensor: 1-D tensors, norms and biases F32; every other weight F32, F16 or Q8_0
  (`gguf.quants.quantize`: blocks of 32 values, one F16 scale max|x|/127 each); a row whose length is not
  a multiple of 32 falls back to F16, as in the converter;
- hyper-parameters: ``<arch>.block_count`` is the pruned count, and the only per-layer array is one of the
  surviving blocks (Gemma 3's sliding-window pattern), so no array keeps the dense model's length (llama.cpp
  issue #27976: pruning with `llama-quantize --prune-layers` left such arrays behind); ``ghostdistill.*`` keys
  record the view, the dense block count, the removed blocks, and the provenance JSON that `config.json` holds
  (llama-quantize copies them into its files, beside its own ``quantize.imatrix.*`` keys);
- the tokenizer (`gguf_vocab`).

Each file is written to a temporary file beside it and renamed into place (`core.io.atomic_path`). Tensors are
streamed: every tensor's name, shape and storage go into the header first, then the view's pieces are made,
converted and written one at a time (`export.pieces`: why, and why a file is the same bytes either way).
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path

import gguf
import numpy as np
import torch

from ..core.checks import check_names
from ..core.io import atomic_path
from ..core.lock import hold, lock_path
from ..core.views import PrunedModel
from .gguf_arch import TensorStream, gguf_tensors
from .gguf_header import header, transformers_misreadings
from .pieces import exporting
from .quantize import QUANTIZE_TYPES, check_quantize, quantize_view, quantized
from .writer import ViewExport, check_target, check_view, prepare

# name -> (tensor storage type of the weights, llama.cpp's file type)
GGUF_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
DEFAULT_GGUF_TYPES = ("F32", "F16", "Q8_0")
ALL_GGUF_TYPES = tuple(GGUF_TYPES) + QUANTIZE_TYPES  # the rest: llama.cpp's llama-quantize (`export.quantize`)


def check_gguf_types(types: Iterable[str]) -> list[str]:
    return check_names("GGUF type", types, ALL_GGUF_TYPES)


def gguf_path(root: str | os.PathLike, view: str, gguf_type: str) -> Path:
    return Path(root) / f"{view}.{gguf_type}.gguf"


def refusal(view: str, method: str | None) -> str:
    return (
        f"cannot write GGUF for view {view!r}: method {method!r} keeps an operator at each gap, which llama.cpp's "
        "LLaMA graph has no place for; fold the repair instead (method rotation_through, ghost's foldable form) "
        "or serve the Hugging Face folder with vLLM"
    )


def _stored(name: str, shape: tuple[int, ...], gguf_type: str) -> tuple[gguf.GGMLQuantizationType, tuple]:
    """(storage type, stored shape in bytes) of a tensor, by the converter's rule (module docstring)."""
    storage = GGUF_TYPES[gguf_type][0]
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        storage = gguf.GGMLQuantizationType.F32
    elif shape[-1] % gguf.GGML_QUANT_SIZES[storage][0]:
        storage = gguf.GGMLQuantizationType.F16
    return storage, gguf.quants.quant_shape_to_byte_shape(shape, storage)


# Values quantised at a time: numpy's Q8_0 holds temporaries the size of its input (gigabytes for a 128k × 4096
# embedding); rows are independent blocks, so the bytes are the same.
QUANT_ELEMENTS = 2**24


def _quantize(data: np.ndarray, storage: gguf.GGMLQuantizationType) -> np.ndarray:
    rows = max(1, QUANT_ELEMENTS // max(1, data.shape[-1]))
    if data.ndim < 2 or data.shape[0] <= rows:
        return gguf.quants.quantize(data, storage)
    return np.concatenate([gguf.quants.quantize(data[lo : lo + rows], storage) for lo in range(0, len(data), rows)])


def write_gguf(path: Path, tensors: TensorStream, view: ViewExport, gguf_type: str) -> None:
    """Write one GGUF file of `gguf_type` (F32, F16 or Q8_0): the header (`gguf_header.header`) with every
    tensor's name, shape and storage, then each tensor as it is made. `view.write` false: every tensor is made (a
    sharded model's gathers, in rank 0's order), nothing written."""
    if not view.write:
        for _ in tensors.arrays():
            pass
        return
    writer = header(view, GGUF_TYPES[gguf_type][1])
    plan = {n: _stored(n, shape, gguf_type) for n, shape in tensors.shapes.items()}
    for tensor_name, (storage, stored) in plan.items():  # uint8: `stored` is in bytes, the header in elements
        writer.add_tensor_info(tensor_name, stored, np.dtype(np.uint8), math.prod(stored), raw_dtype=storage)
    needed = sum(math.prod(stored) for _, stored in plan.values())
    lock = hold(lock_path(path), f"export of {path.name}", "wait for that export to finish")
    with lock, atomic_path(path, needed) as tmp:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor_name, data in tensors.arrays():
            writer.write_tensor_data(_quantize(data, plan[tensor_name][0]))
        writer.close()


def export_gguf(
    pruned: PrunedModel,
    view: str,
    root: str | os.PathLike,
    *,
    method: str | None,
    tokenizer,
    info: dict | None = None,
    types: Iterable[str] = DEFAULT_GGUF_TYPES,
    overwrite: bool = False,
    imatrix: bool = True,
    calibration: Callable[[], torch.Tensor] | None = None,
    log: Callable[[str], None] = print,
    vocab_source: Path | None = None,
    write: bool = True,
) -> list[Path]:
    """Write `view` of `pruned` as one GGUF file per type (`gguf_path(root, view, type)`); returns the paths.

    The llama-quantize types come from the view's F32 file (written for them when F32 is not asked for, then
    removed), with an importance matrix over `calibration()`, the run's calibration windows, unless `imatrix` is
    false. `vocab_source`: the GGUF file the model came from, whose vocabulary serves a tokenizer `gguf_vocab`
    does not read. Refuses operator views (`refusal`), missing tools and existing files without `overwrite`,
    before writing anything. What transformers' `gguf_file=` reader would read other than the view
    (`gguf_header.transformers_misreadings`) goes to `log` as a warning, and into the files' provenance. `write`
    false: a rank of a sharded model other than rank 0 (the same work, nothing written)."""
    types = check_gguf_types(types)
    check_quantize(types, imatrix)
    check_view(pruned, view)
    with exporting(pruned, view):  # `write_gguf_files` refuses operator views and taken targets before any work
        prepared = prepare(pruned, view, method, tokenizer, info, write=write, calibration=calibration)
        prepared.vocab_source = vocab_source
        if write and prepared.kind == "plain":  # what transformers' gguf_file= would read otherwise (`gguf_header`)
            paths = [gguf_path(root, view, t) for t in types]
            for path in paths:  # refused before a warning about files that will not be written
                check_target(path, "file", overwrite, "overwrite (export.overwrite / --overwrite)")
            notes = transformers_misreadings(prepared, [p.name for p in paths])
            for note in notes:
                log(f"warning: {note}")
            prepared.info["warnings"] = [*prepared.info.get("warnings", []), *notes]
        return write_gguf_files(prepared, root, types, overwrite=overwrite, imatrix=imatrix, log=log)


def write_gguf_files(
    view: ViewExport,
    root: str | os.PathLike,
    types: Iterable[str],
    *,
    overwrite: bool = False,
    imatrix: bool = True,
    log: Callable[[str], None] = print,
) -> list[Path]:
    """A prepared plain view (`writer.prepare`) as one GGUF file per type under `root` (`export_gguf`)."""
    types = list(types)
    if view.kind != "plain":
        raise ValueError(refusal(view.view, view.method))
    if quantized(types) and imatrix and view.calibration is None:
        raise ValueError("an importance matrix needs the run's calibration windows: pass calibration, or imatrix=False")
    paths = [gguf_path(root, view.view, t) for t in types]
    for path in paths if view.write else ():  # what may stand where the files go
        check_target(path, "file", overwrite, "overwrite (export.overwrite / --overwrite)")
    written = dict(zip(types, paths))
    quants = {t: written[t] for t in quantized(types)}
    with contextlib.ExitStack() as stack:
        ours = [(t, written[t]) for t in types if t in GGUF_TYPES]
        source = written.get("F32")
        if quants and source is None:  # llama-quantize reads an F32 file: one for it alone, removed after
            folder = Path(root)
            if view.write:  # else never written: the passes match rank 0's
                folder.mkdir(parents=True, exist_ok=True)
                folder = Path(stack.enter_context(tempfile.TemporaryDirectory(dir=root, prefix=f".{view.view}.F32-")))
            source = folder / f"{view.view}.F32.gguf"
            ours.insert(0, ("F32", source))
        tensors = gguf_tensors(view.pieces if view.streamed else view.state, view.config)
        for gguf_type, path in ours:
            write_gguf(path, tensors, view, gguf_type)
        del tensors
        if quants and view.write:
            quantize_view(
                source, quants, tokenizer=view.tokenizer, calibration=view.calibration, imatrix=imatrix, log=log
            )
    return paths


def read_gguf(path: str | os.PathLike) -> dict:
    """What the checks and tests read back: the architecture, block count, every array-valued key with its
    length, and each tensor's shape (Hugging Face order) and storage type."""
    reader = gguf.GGUFReader(str(path))
    fields = reader.fields
    arch = fields["general.architecture"].contents()
    arrays = {
        key: len(field.data)
        for key, field in fields.items()
        if field.types and field.types[0] == gguf.GGUFValueType.ARRAY and not key.startswith("GGUF.")
    }
    return {
        "architecture": arch,
        "block_count": int(fields[f"{arch}.block_count"].contents()),
        "file_type": int(fields["general.file_type"].contents()),
        "arrays": arrays,
        "tensors": {
            t.name: {"shape": [int(n) for n in reversed(t.shape.tolist())], "type": t.tensor_type.name}
            for t in reader.tensors
        },
        "fields": {k: f.contents() for k, f in fields.items() if k.startswith(("ghostdistill.", "tokenizer.ggml.pre"))},
    }
