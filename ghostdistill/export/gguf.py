"""GGUF files of a plain-architecture view, for llama.cpp: F32, F16 and Q8_0, written with the `gguf` package.

Which views: those whose exported folder is the plain architecture (`parts.view_parts` kind ``plain``): the
pruned model, the views whose maps fold into the weights (magnitude, ReplaceMe, `rotation_through`), and the
fine-tuned students of those with their LoRA adapters merged. A view that keeps operators (ghost,
LinearPatch and their `_ft` students) computes `h + h·Δ` at each gap, a module llama.cpp's LLaMA graph does not
have, so it is refused before anything is written: fold the repair (`rotation_through` is ghost's foldable
form), or serve the Hugging Face folder with vLLM (its Transformers backend runs the operators).

What a file holds, as llama.cpp's `convert_hf_to_gguf.py` (`LlamaModel`, `TextModel`) writes a LLaMA folder:

- tensors renamed by `gguf.get_tensor_name_map` (``model.layers.3.self_attn.q_proj.weight`` ->
  ``blk.3.attn_q.weight``) over the *surviving* blocks, renumbered 0 … n-1; the head is left out when it is
  tied to the embedding (llama.cpp reuses ``token_embd``);
- Q and K rows permuted from Hugging Face's rotary layout (the two halves of each head: x₀…x_{d/2-1} |
  x_{d/2}…) to GGML's interleaved pairs (x₀, x_{d/2}, x₁, …): for W of shape [h·d, C] viewed as
  [h, 2, d/2, C], swap the two middle axes (`LlamaModel.permute`; K uses the key-value head count). The
  attention logits q·k are unchanged, because both sides get the same permutation of each head's rotary
  pairs;
- the storage type per tensor: 1-D tensors, norms and biases F32; every other weight F32, F16 or Q8_0
  (`gguf.quants.quantize`: blocks of 32 values, one F16 scale max|x|/127 each); a row whose length is not
  a multiple of 32 falls back to F16, as in the converter;
- hyper-parameters: ``llama.block_count`` is the pruned count, and no per-layer array is written, so no
  array keeps the dense model's length (llama.cpp issue #27976: pruning with `llama-quantize
  --prune-layers` left such arrays behind); ``ghostdistill.*`` keys record the view, the dense block count,
  the removed and kept blocks, and the provenance JSON that `config.json` holds;
- the tokenizer (`gguf_vocab`).

Each file is written to a temporary file beside it and renamed into place (`core.io.atomic_path`). Tensors are
streamed: every tensor's name, shape and storage go into the header first, then the view's parts
(`export.parts`: the embedding, one block, ...) are made, converted and written one at a time, so a view whose
weights live off the device (`model.model.offload`) is never whole in memory; a file is the same bytes either way.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from ..core.checks import check_unique
from ..core.io import atomic_path
from ..core.lock import hold, lock_path
from ..core.views import PrunedModel
from ..methods import ships_stock
from .gguf_vocab import add_vocab
from .parts import Part, exporting, view_parts
from .writer import check_target

FORMATS = ("hf", "gguf")
# name -> (tensor storage type of the weights, llama.cpp's file type)
GGUF_TYPES = {
    "F32": (gguf.GGMLQuantizationType.F32, gguf.LlamaFileType.ALL_F32),
    "F16": (gguf.GGMLQuantizationType.F16, gguf.LlamaFileType.MOSTLY_F16),
    "Q8_0": (gguf.GGMLQuantizationType.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
}
DEFAULT_GGUF_TYPES = ("F32", "F16", "Q8_0")
ARCHITECTURES = {"llama": gguf.MODEL_ARCH.LLAMA}


def _names(what: str, given: Iterable[str], valid) -> list[str]:
    """`given` as a list when it is a non-empty list of `valid` names, else a one-line error naming both."""
    given = list(given)
    bad = [g for g in given if g not in valid]
    if bad or not given:
        raise ValueError(f"{what} {bad or given} is not one of {list(valid)}")
    return check_unique(f"{what}s", given)


def check_formats(formats: Iterable[str]) -> list[str]:
    return _names("export format", formats, FORMATS)


def check_gguf_types(types: Iterable[str]) -> list[str]:
    return _names("GGUF type", types, GGUF_TYPES)


def gguf_path(root: str | os.PathLike, view: str, gguf_type: str) -> Path:
    """Where a view's GGUF file goes: ``<root>/<view>.<type>.gguf``, beside the view's folder ``<root>/<view>``."""
    return Path(root) / f"{view}.{gguf_type}.gguf"


def inserts_operators(method: str | None) -> bool:
    """Whether a view of `method` keeps modules llama.cpp cannot run (the pruned model's ``none`` keeps none)."""
    return not ships_stock(method)


def refusal(view: str, method: str | None) -> str:
    return (
        f"cannot write GGUF for view {view!r}: method {method!r} keeps an operator at each gap, which llama.cpp's "
        "LLaMA graph has no place for; fold the repair instead (method rotation_through, ghost's foldable form) "
        "or serve the Hugging Face folder with vLLM"
    )


def check_gguf_views(views: Iterable[str], method_of) -> None:
    """Refuse, before anything runs, views whose method keeps operators (`method_of`: view -> method)."""
    for view in views:
        if inserts_operators(method_of(view)):
            raise ValueError(refusal(view, method_of(view)))


def _permute(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Hugging Face's rotary layout to GGML's, per head (`LlamaModel.permute` of the converter)."""
    return (
        weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


@dataclass
class TensorStream:
    """Tensors known by GGUF name and shape before any is made (`shapes`, in file order); `arrays()` makes them,
    float32, in that order."""

    shapes: dict[str, tuple[int, ...]]
    arrays: Callable[[], Iterator[tuple[str, np.ndarray]]]


def gguf_stream(parts: list[Part], config) -> TensorStream:
    """The view's tensors under their GGUF names, float32, Q and K permuted (see the module docstring), a part
    at a time."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"GGUF export writes {sorted(ARCHITECTURES)} models; this view is {model_type!r}: convert its Hugging "
            "Face folder with llama.cpp's convert_hf_to_gguf.py"
        )
    n_blocks = config.num_hidden_layers
    names = gguf.get_tensor_name_map(ARCHITECTURES[model_type], n_blocks)
    n_head = config.num_attention_heads
    n_kv = getattr(config, "num_key_value_heads", None) or n_head
    tied = bool(getattr(config, "tie_word_embeddings", False))
    renamed: dict[str, str] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    for part in parts:
        for name, shape in part.names.items():
            if name.endswith("rotary_emb.inv_freq") or (tied and name == "lm_head.weight"):
                continue
            new = names.get_name(name, try_suffixes=(".weight", ".bias"))
            if new is None:
                raise ValueError(f"tensor {name!r} has no GGUF name for {model_type}: it cannot be written")
            renamed[name], shapes[new] = new, shape
    blocks = {int(n.split(".")[1]) for n in shapes if n.startswith("blk.")}
    if blocks != set(range(n_blocks)):
        raise ValueError(f"the state has blocks {sorted(blocks)} but the config says {n_blocks}")

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        for part in parts:
            if not set(part.names) & set(renamed):
                continue
            for name, tensor in part.load().items():
                if name not in renamed:
                    continue
                data = tensor.detach().to("cpu", torch.float32)
                if name.endswith(("q_proj.weight", "q_proj.bias")):
                    data = _permute(data, n_head)
                elif name.endswith(("k_proj.weight", "k_proj.bias")):
                    data = _permute(data, n_kv)
                yield renamed[name], data.contiguous().numpy()

    return TensorStream(shapes, arrays)


def _storage(name: str, shape: tuple[int, ...], gguf_type: str) -> gguf.GGMLQuantizationType:
    """The converter's rule: 1-D tensors, norms and anything but a weight stay F32; the rest take the type."""
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return gguf.GGMLQuantizationType.F32
    return GGUF_TYPES[gguf_type][0]


def _stored(name: str, shape: tuple[int, ...], gguf_type: str) -> tuple[gguf.GGMLQuantizationType, tuple, type, int]:
    """(storage type, stored shape, stored dtype, bytes) of a tensor: what `gguf.quants.quantize` will give it; a
    row length Q8_0 cannot block falls back to F16, as in the converter."""
    storage = _storage(name, shape, gguf_type)
    if storage == gguf.GGMLQuantizationType.F32:
        return storage, shape, np.float32, 4 * math.prod(shape)
    if storage != gguf.GGMLQuantizationType.F16:
        try:
            stored = tuple(gguf.quants.quant_shape_to_byte_shape(shape, storage))
            return storage, stored, np.uint8, math.prod(stored)
        except gguf.QuantError:
            storage = gguf.GGMLQuantizationType.F16
    return storage, shape, np.float16, 2 * math.prod(shape)


# Values quantised at a time: numpy's Q8_0 holds temporaries the size of its input (gigabytes for a 128k × 4096
# embedding); rows are independent blocks, so the bytes are the same.
QUANT_ELEMENTS = 2**24


def _quantize(data: np.ndarray, storage: gguf.GGMLQuantizationType) -> np.ndarray:
    rows = max(1, QUANT_ELEMENTS // max(1, data.shape[-1]))
    if data.ndim < 2 or data.shape[0] <= rows:
        return gguf.quants.quantize(data, storage)
    return np.concatenate([gguf.quants.quantize(data[lo : lo + rows], storage) for lo in range(0, len(data), rows)])


def _rope(config) -> tuple[float | None, dict]:
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    kind = params.get("rope_type", params.get("type")) or "default"
    if kind not in ("default", "linear"):
        raise ValueError(
            f"rope_type {kind!r} is not written by ghostdistill's GGUF writer (valid: default, linear): convert "
            "the Hugging Face folder with llama.cpp's convert_hf_to_gguf.py"
        )
    return theta, params if kind == "linear" else {}


def write_gguf(
    path: str | os.PathLike,
    tensors: Mapping[str, np.ndarray] | TensorStream,
    config,
    tokenizer,
    gguf_type: str,
    *,
    name: str,
    info: dict | None = None,
    write: bool = True,
) -> Path:
    """Write one GGUF file of `gguf_type` from `gguf_stream`'s output (or GGUF-named float32 arrays), the view's
    config and tokenizer: the header with every tensor's name, shape and storage, then each tensor as it is made.
    `write` false: every tensor is made (a sharded model's gathers, in rank 0's order), nothing written."""
    check_gguf_types([gguf_type])
    if not write:
        if isinstance(tensors, TensorStream):
            for _ in tensors.arrays():
                pass
        return Path(path)
    if tokenizer is None:
        raise ValueError("GGUF export needs the tokenizer: llama.cpp reads the vocabulary from the file")
    path = Path(path)
    arch = gguf.MODEL_ARCH_NAMES[ARCHITECTURES[config.model_type]]
    writer = gguf.GGUFWriter(path=None, arch=arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    hidden, n_head = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // n_head
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or n_head)
    theta, scaling = _rope(config)
    if theta is not None:
        writer.add_rope_freq_base(float(theta))
    if scaling:
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(scaling["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_file_type(GGUF_TYPES[gguf_type][1])
    writer.add_vocab_size(config.vocab_size)
    writer.add_rope_dimension_count(head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    info = dict(info or {})
    plan = info.get("plan") or {}
    writer.add_string("ghostdistill.view", str(info.get("view", name)))
    if plan.get("num_layers") is not None:
        writer.add_uint32("ghostdistill.dense_block_count", int(plan["num_layers"]))
    if plan.get("removed"):
        writer.add_array("ghostdistill.removed_blocks", [int(i) for i in plan["removed"]])
    if info:
        writer.add_string("ghostdistill.provenance", json.dumps(info, default=str, sort_keys=True))
    add_vocab(writer, tokenizer, config.vocab_size)
    if not isinstance(tensors, TensorStream):
        tensors = TensorStream({n: tuple(a.shape) for n, a in tensors.items()}, lambda held=tensors: iter(held.items()))
    plan = {n: _stored(n, shape, gguf_type) for n, shape in tensors.shapes.items()}
    for tensor_name, (storage, shape, dtype, nbytes) in plan.items():
        writer.add_tensor_info(tensor_name, shape, np.dtype(dtype), nbytes, raw_dtype=storage)
    needed = sum(nbytes for _, _, _, nbytes in plan.values())
    lock = hold(lock_path(path), f"export of {path.name}", "wait for that export to finish")
    with lock, atomic_path(path, needed) as tmp:
        writer.write_header_to_file(path=tmp)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor_name, data in tensors.arrays():
            writer.write_tensor_data(_quantize(data, plan[tensor_name][0]))
        writer.close()
        os.chmod(tmp, 0o666 & ~_umask())
    return path


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    write: bool = True,
) -> list[Path]:
    """Write `view` of `pruned` as one GGUF file per type (`gguf_path(root, view, type)`); returns the paths.

    Refuses operator views (`refusal`) and existing files without `overwrite`, before writing anything.
    `write` false: the same work, nothing written (`write_gguf`)."""
    types = check_gguf_types(types)
    if view not in pruned.views:
        raise ValueError(f"cannot export view {view!r}: the views are {pruned.views}")
    if inserts_operators(method):
        raise ValueError(refusal(view, method))
    paths = [gguf_path(root, view, t) for t in types]
    for path in paths if write else ():
        check_target(path, "file", overwrite, "overwrite (export.overwrite / --overwrite)")
    info = dict(info or {})
    info.setdefault("view", view)
    info.setdefault("method", method)
    info.setdefault(
        "plan",
        {"num_layers": pruned.plan.num_layers, "removed": list(pruned.plan.removed)},
    )
    with exporting(pruned, view):
        parts, config, kind = view_parts(pruned, view, method, info)
        if kind != "plain":
            raise ValueError(refusal(view, method))
        tensors = gguf_stream(parts, config)
        for gguf_type, path in zip(types, paths):
            write_gguf(path, tensors, config, tokenizer, gguf_type, name=view, info=info, write=write)
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
