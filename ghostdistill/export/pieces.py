"""A view's exported tensors in pieces: one per block and one per other module, each made when it is written.

`view_pieces` describes what a view's folder holds without computing any of it: per piece the tensor names and
shapes, and a `load()` that makes them (the block brought onto the device, `core.offload.onloaded`, copied
where the view changes it: LoRA merged, a scaled rotation folded). The Hugging Face writer writes one
safetensors shard per piece (`save_pieces`) and the GGUF writer quantises one piece at a time, so no more than a
piece (one block, or the embedding) is ever in memory beside the model: what export does with weights that live
off the device (`model.model.offload`). A model held in memory takes all pieces at once (`ViewExport.state`), the
same tensors, written as before.

Pieces follow the model's own state-dict order (the embedding, the blocks, the final norm, the head), so a file
written either way holds its tensors in the same order. A fold is per block: a gap's transform of a block
depends on that block alone (`export.fold`), so each block is folded on its own in plan order of the gaps.
"""

from __future__ import annotations

import contextlib
import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..core.modeling_ghostdistill import GhostPrunedConfig
from ..core.offload import onloaded
from ..core.sharded import gathered, is_sharded, plain_copy
from ..core.views import _ADAPTER_NAMES, DENSE, PRUNED, PrunedModel
from ..methods import GapFit, get_method
from . import fold as residual_fold

# AutoModel is what vLLM's Transformers backend builds (the base model; vLLM adds its own head).
WRAPPER_AUTO_MAP = {
    "AutoConfig": "modeling_ghostdistill.GhostPrunedConfig",
    "AutoModel": "modeling_ghostdistill.GhostPrunedModel",
    "AutoModelForCausalLM": "modeling_ghostdistill.GhostPrunedForCausalLM",
}


@contextlib.contextmanager
def exporting(pruned: PrunedModel, view: str):
    """`view` switched in, its operators and maps whole for the span (a student's trainable operators are
    sharded under FSDP2: gathered on every rank, collectively)."""
    with pruned.use(view) as model, contextlib.ExitStack() as stack:
        if view in pruned.operators:
            stack.enter_context(gathered(pruned.operators[view]))
            stack.enter_context(gathered(pruned.mlp_maps[view]))
        yield model


@dataclass
class Piece:
    """Some tensors of an exported view: their names and shapes in order, and `load()`, which makes them."""

    names: dict[str, tuple[int, ...]]
    load: Callable[[], dict[str, torch.Tensor]]


def view_pieces(pruned: PrunedModel, view: str, method: str | None, info: dict) -> tuple[list[Piece], object, str]:
    """(pieces, config, kind) of the current view (`pruned.use(view)`); nothing is computed until a piece loads."""
    model, plan = pruned.model, pruned.plan
    operators = dict(pruned.operators[view]) if view not in (DENSE, PRUNED) else {}
    mlp_maps = dict(pruned.mlp_maps[view]) if view not in (DENSE, PRUNED) else {}
    folds = bool(operators or mlp_maps) and method is not None and get_method(method).folds
    if (operators or mlp_maps) and method is None:
        raise ValueError(f"view {view!r} has operators: name its method to export it")
    if mlp_maps and not folds:
        raise ValueError(f"view {view!r} has MLP maps but method {method!r} cannot fold them into weights")
    layers = list(pruned.stack.layers)
    # Changed blocks are copies: the shared blocks serve every other view (and the teacher).
    changed = folds or any(view in getattr(m, "lora_A", {}) for b in layers for m in b.modules())
    kept = list(plan.kept) if view != DENSE else list(range(plan.num_layers))
    fits = [GapFit(operator=operators.get(g.key), mlp_map=mlp_maps.get(g.key)) for g in plan.gaps]

    def block(new: int) -> dict[str, torch.Tensor]:
        with onloaded(layers[new]):
            if not changed and not is_sharded(layers[new]):
                return dict(layers[new].state_dict())
            # A sharded block (FSDP2) is gathered into a whole copy (`plain_copy`: collective, every rank).
            own = plain_copy(layers[new])
        _merge_and_unwrap(own, view)
        if folds:
            by_dense: list[nn.Module | None] = [None] * plan.num_layers
            by_dense[kept[new]] = own
            for gap, fit in zip(plan.gaps, fits):
                get_method(method).fold(by_dense, gap, fit)
        return own.state_dict()

    text = copy.deepcopy(pruned.config)
    if hasattr(text, "quantization_config"):
        delattr(text, "quantization_config")
    text.architectures = [type(model).__name__]
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    own_head = view in pruned.modules_own and any(m is head for m in pruned.modules_own[view].values())
    fold_embedding = folds and get_method(method).folds_embedding
    if getattr(text, "tie_word_embeddings", False) and (own_head or fold_embedding):
        # Untied: the view has its own head (a student that trains the tail), or the embedding is E·Q₁⋯Qₙ and
        # the original E stays the head's (`export.fold`).
        text.tie_word_embeddings = False
    prefix = "pruned." if operators and not folds else ""
    names = {id(m): n for n, m in model.named_modules()}
    if id(pruned.stack.layers) not in names:
        raise ValueError(f"the decoder blocks are not a submodule of {type(model).__name__}")
    layers_path = names[id(pruned.stack.layers)]

    def module(path: str) -> dict[str, torch.Tensor]:
        owner = model.get_submodule(path) if path else model
        with onloaded(owner):
            state = {f"{path}.{k}" if path else k: v for k, v in owner.state_dict().items()}
        if fold_embedding and owner is embed:
            key = f"{names[id(embed)]}.weight"
            state[key] = residual_fold.folded_embedding(state[key], residual_fold.residual_product(plan, operators))
        return state

    pieces: dict[str, Piece] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if key.startswith(layers_path + "."):
            new = int(key[len(layers_path) + 1 :].split(".")[0])
            group, load = f"block {new}", _prefixed(lambda new=new: block(new), f"{prefix}{layers_path}.{new}.")
        else:
            path = key.rpartition(".")[0]
            group, load = path, _prefixed(lambda path=path: module(path), prefix)
        piece = pieces.setdefault(group, Piece({}, load))
        piece.names.update({prefix + k: tuple(t.shape) for k, t in _clean({key: tensor}).items()})
    out = list(pieces.values())
    if not (operators and not folds):
        text.ghostdistill = info
        return out, text, "plain"
    gaps, tensors = _gap_operators(plan, operators, kept)
    out.append(Piece({n: tuple(t.shape) for n, t in tensors.items()}, lambda: tensors))
    config = GhostPrunedConfig(
        text_config=text,
        gaps=gaps,
        layers_path=layers_path,
        ghostdistill=info,
        architectures=["GhostPrunedForCausalLM"],
        auto_map=dict(WRAPPER_AUTO_MAP),
    )
    return out, config, "operators"


def _prefixed(load: Callable[[], dict[str, torch.Tensor]], prefix: str) -> Callable[[], dict[str, torch.Tensor]]:
    return lambda: {prefix + k: v for k, v in _clean(load()).items()}


def _gap_operators(plan, operators: dict, kept: list[int]) -> tuple[list[dict], dict[str, torch.Tensor]]:
    """The exported config's gap entries and the operators' tensors (`gap_operators.<i>.delta`, `.first_shift`)."""
    gaps, tensors = [], {}
    for i, gap in enumerate(plan.gaps):
        op = operators[gap.key]
        if getattr(op, "bias", None) is not None:
            # The exported modelling file has no bias; dropping it would export another model.
            raise ValueError(
                f"gap {gap.key}: an affine operator (recovery `bias: true`) cannot be exported yet; "
                "export a view fitted without `bias`"
            )
        at_input = gap.stop < plan.num_layers
        layer = kept.index(gap.stop if at_input else gap.start - 1)
        where = "input" if at_input else "output"
        gaps.append({"key": gap.key, "layer": layer, "where": where, "separate_first": bool(op.separate_first)})
        tensors[f"gap_operators.{i}.delta"] = op.delta.detach().float()
        tensors[f"gap_operators.{i}.first_shift"] = op.first_shift.detach().float()
    return gaps, tensors


def _merge_and_unwrap(block: nn.Module, view: str) -> None:
    """In a copied block, merge `view`'s LoRA adapter into the weight it adapts and put every adapted linear's
    plain base layer back in its place (the other views' adapters go): a fold then sees the block's own
    `nn.Linear`s, as in a run without students."""
    for name, module in list(block.named_modules()):
        base = getattr(module, "base_layer", None)
        if base is None or not hasattr(module, "lora_A"):
            continue
        if view in module.lora_A:
            module.merge(adapter_names=[view])
        parent, _, attr = name.rpartition(".")
        setattr(block.get_submodule(parent) if parent else block, attr, base)


def _clean(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Plain parameter names: peft's wrapped `base_layer` renamed back, adapter tensors dropped (merged
    into their base where the view uses them)."""
    adapter = lambda name: any(f".{a}." in f".{name}." for a in _ADAPTER_NAMES)  # noqa: E731
    return {name.replace(".base_layer.", "."): t for name, t in state.items() if not adapter(name)}


def save_pieces(pieces: list[Piece], folder: Path, drop: set[str] = frozenset()) -> None:
    """One safetensors shard per piece, written as it is made (only that piece in memory), and the index
    `from_pretrained` reads (`model.safetensors.index.json`); `drop`: names left out (a tied head)."""
    from safetensors.torch import save_file

    kept = [p for p in pieces if set(p.names) - drop]
    weight_map, total = {}, 0
    for k, piece in enumerate(kept, start=1):
        file = "model.safetensors" if len(kept) == 1 else f"model-{k:05d}-of-{len(kept):05d}.safetensors"
        tensors = {n: t.detach().to("cpu").contiguous() for n, t in piece.load().items() if n not in drop}
        save_file(tensors, folder / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(kept) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
