"""One view of a pruned model written as a Hugging Face model folder.

What the folder holds, by what the view computes:

- operators that stay modules (ghost, LinearPatch): the base architecture with the surviving blocks
  and one `GapOperator` per gap, loaded through `modeling_ghostdistill.py` (copied into the folder,
  registered by `auto_map`; ghostdistill itself loads it without remote code);
- maps a method folds into weights (ReplaceMe, magnitude), the pruned model, a fine-tuned view without
  operators: the plain architecture with fewer blocks, which a plain `from_pretrained` loads.

LoRA adapters of a fine-tuned view are merged into the weights they adapt; the other views' adapters
are dropped. Blocks that change (merged or folded) are copies, so the in-memory views are untouched;
every other tensor is written from the live model without a copy. `config.json` records the plan and
what produced the view (`ghostdistill` key); the tokenizer, the generation config and a model card
(README.md) come along. The folder is written beside the target and renamed into place; an existing
folder is replaced only with `overwrite`; what an export killed outright (SIGKILL, a crash) left beside
the target is removed by the next export of it (`clean_orphans`). It gets the permissions
`save_pretrained` would give under the user's umask (the temporary folder it is written in would leave it
readable by its owner only).
"""

from __future__ import annotations

import copy
import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..core import modeling_ghostdistill
from ..core.io import publish_permissions
from ..core.modeling_ghostdistill import GhostPrunedConfig
from ..core.views import _ADAPTER_PARTS, DENSE, PRUNED, PrunedModel, copy_block
from ..methods import GapFit, get_method
from . import fold as residual_fold
from .card import model_card

# AutoModel is what vLLM's Transformers backend builds (the base model; vLLM adds its own head).
WRAPPER_AUTO_MAP = {
    "AutoConfig": "modeling_ghostdistill.GhostPrunedConfig",
    "AutoModel": "modeling_ghostdistill.GhostPrunedModel",
    "AutoModelForCausalLM": "modeling_ghostdistill.GhostPrunedForCausalLM",
}


def export_view(
    pruned: PrunedModel,
    view: str,
    folder: str | os.PathLike,
    *,
    method: str | None,
    tokenizer=None,
    info: dict | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `view` of `pruned` to `folder` and return its path.

    Args:
        method: the registered method behind the view (``ghost`` for ``ghost`` and ``ghost_ft``); None
            for ``dense`` and ``pruned``.
        tokenizer: saved with the model when given.
        info: what produced the view (plan, calibration, seed, metrics), kept in `config.json` under
            ``ghostdistill`` and summarised in the model card.
        overwrite: replace an existing folder (otherwise an existing folder is an error).
    """
    target = Path(folder)
    if view not in pruned.views:
        raise ValueError(f"cannot export view {view!r}: the views are {pruned.views}")
    if target.exists() and not overwrite:
        raise FileExistsError(
            f"export folder {target} exists; pass overwrite (export.overwrite: true / --overwrite) to replace it"
        )
    info = view_info(pruned, view, method, info)
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_orphans(target)
    # The process id in the name tells a later export whether the folder is still being written.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-{os.getpid()}-"))
    try:
        with pruned.use(view) as model:
            state, config, kind = view_state(pruned, view, method, info)
            _save_weights(model, state, tmp)
            config.save_pretrained(tmp)
            generation = getattr(model, "generation_config", None)
            if generation is not None:
                generation.save_pretrained(tmp)
        if kind == "operators":
            shutil.copyfile(modeling_ghostdistill.__file__, tmp / "modeling_ghostdistill.py")
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(info, kind))
        publish_permissions(tmp)  # what save_pretrained gives in place; a serving user must read it
        _replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def view_info(pruned: PrunedModel, view: str, method: str | None, info: dict | None) -> dict:
    """What config.json records under `ghostdistill`: `info`, with the view, its method and the plan where it
    does not say."""
    info = dict(info or {})
    info.setdefault("view", view)
    info.setdefault("method", method)
    plan = pruned.plan
    info.setdefault(
        "plan", {"num_layers": plan.num_layers, "removed": list(plan.removed), "gaps": [g.key for g in plan.gaps]}
    )
    return info


def view_state(pruned: PrunedModel, view: str, method: str | None, info: dict):
    """(state dict, config, kind) of the current view; kind is ``operators`` or ``plain``."""
    model, plan = pruned.model, pruned.plan
    operators = dict(pruned.operators[view]) if view not in (DENSE, PRUNED) else {}
    mlp_maps = dict(pruned.mlp_maps[view]) if view not in (DENSE, PRUNED) else {}
    folds = bool(operators or mlp_maps) and method is not None and get_method(method).folds
    if (operators or mlp_maps) and method is None:
        raise ValueError(f"view {view!r} has operators: name its method to export it")
    if mlp_maps and not folds:
        raise ValueError(f"view {view!r} has MLP maps but method {method!r} cannot fold them into weights")
    layers = list(pruned.stack.layers)
    adapted = any(view in getattr(m, "lora_A", {}) for b in layers for m in b.modules())
    changed = adapted or folds
    if changed:
        # Changed blocks are copies: the shared blocks serve every other view (and the teacher).
        layers = [copy_block(b) for b in layers]
    if changed:
        for block in layers:
            _merge_and_unwrap(block, view)
    kept = list(plan.kept) if view != DENSE else list(range(plan.num_layers))
    if folds:
        by_dense: list[nn.Module | None] = [None] * plan.num_layers
        for new, dense in enumerate(kept):
            by_dense[dense] = layers[new]
        for gap in plan.gaps:
            fit = GapFit(operator=operators.get(gap.key), mlp_map=mlp_maps.get(gap.key))
            get_method(method).fold(by_dense, gap, fit)
    if changed:
        pruned.stack.set_layers(layers)  # undone when the caller's `use` restores the view
    state = _clean(model.state_dict())
    text = copy.deepcopy(pruned.config)
    for attr in ("quantization_config",):
        if hasattr(text, attr):
            delattr(text, attr)
    text.architectures = [type(model).__name__]
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    if head is not None and getattr(text, "tie_word_embeddings", False) and head.weight is not embed.weight:
        text.tie_word_embeddings = False  # the view has its own head (a student that trains the tail)
    if folds and getattr(get_method(method), "folds_embedding", False):
        residual_fold.fold_embedding(model, plan, operators, state, text)  # E·Q₁⋯Qₙ; a tied head is untied
    if operators and not folds:
        prefix = "pruned."
        state = {prefix + k: v for k, v in state.items()}
        gaps = []
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
            gaps.append(
                {
                    "key": gap.key,
                    "layer": layer,
                    "where": "input" if at_input else "output",
                    "separate_first": bool(op.separate_first),
                }
            )
            state[f"gap_operators.{i}.delta"] = op.delta.detach().float()
            state[f"gap_operators.{i}.first_shift"] = op.first_shift.detach().float()
        config = GhostPrunedConfig(
            text_config=text,
            gaps=gaps,
            layers_path=_path_of(model, pruned.stack.layers),
            ghostdistill=info,
            architectures=["GhostPrunedForCausalLM"],
            auto_map=dict(WRAPPER_AUTO_MAP),
        )
        return state, config, "operators"
    text.ghostdistill = info
    return state, text, "plain"


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
    out = {}
    for name, tensor in state.items():
        if any(f".{part}." in f".{name}." for part in _ADAPTER_PARTS):
            continue
        out[name.replace(".base_layer.", ".")] = tensor
    return out


def _path_of(model: nn.Module, target: nn.Module) -> str:
    for name, module in model.named_modules():
        if module is target:
            return name
    raise ValueError(f"the decoder blocks are not a submodule of {type(model).__name__}")


def _save_weights(model: nn.Module, state: dict[str, torch.Tensor], folder: Path) -> None:
    """safetensors shards; a tied output head is left to the loader, which ties it again."""
    from huggingface_hub import save_torch_state_dict

    prefix = "pruned." if any(k.startswith("pruned.") for k in state) else ""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in tied.items():
        t, s = prefix + target, prefix + source
        if t in state and s in state and state[t].data_ptr() == state[s].data_ptr():
            del state[t]
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    save_torch_state_dict(tensors, folder, max_shard_size="5GB")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def clean_orphans(target: Path) -> None:
    """Remove what an export of `target` killed by SIGKILL or a crash left beside it: temporary folders of
    processes that no longer run (`.<name>.tmp-<pid>-*`, and the pid-less ones of older versions), and an
    old folder renamed away by `_replace` (put back when the new one never arrived)."""
    prefix = f".{target.name}."
    for path in target.parent.iterdir():
        if not path.name.startswith(prefix) or path.is_symlink() or not path.is_dir():
            continue
        rest = path.name[len(prefix) :]
        tmp, old = re.fullmatch(r"tmp-(?:(\d+)-)?.+", rest), re.fullmatch(r"old-(\d+)", rest)
        if tmp and (tmp.group(1) is None or not _alive(int(tmp.group(1)))):
            shutil.rmtree(path, ignore_errors=True)
        elif old and not _alive(int(old.group(1))):
            if target.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.replace(path, target)


def _replace(tmp: Path, target: Path) -> None:
    """Move the finished folder into place; an old folder is renamed away first and removed last, so
    an interruption leaves either the old folder or the new one under the target name."""
    old = None
    if target.exists():
        old = target.with_name(f".{target.name}.old-{os.getpid()}")
        os.replace(target, old)
    os.replace(tmp, target)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
