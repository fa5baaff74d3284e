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

import os
import re
import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from ..core import modeling_ghostdistill
from ..core.io import publish_permissions
from ..core.offload import is_offloaded
from ..core.views import PrunedModel
from .card import model_card
from .parts import WRAPPER_AUTO_MAP, save_parts, view_parts, view_state

__all__ = ["WRAPPER_AUTO_MAP", "clean_orphans", "export_view", "view_state"]


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
    info = dict(info or {})
    info.setdefault("view", view)
    info.setdefault("method", method)
    info.setdefault(
        "plan",
        {
            "num_layers": pruned.plan.num_layers,
            "removed": list(pruned.plan.removed),
            "gaps": [g.key for g in pruned.plan.gaps],
        },
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    clean_orphans(target)
    # The process id in the name tells a later export whether the folder is still being written.
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-{os.getpid()}-"))
    try:
        with pruned.use(view) as model:
            if is_offloaded(model):
                # Weights off the device: one shard per block, each written as it is made (`export.parts`).
                parts, config, kind = view_parts(pruned, view, method, info)
                save_parts(parts, tmp, _tied_names(model, config, kind))
            else:
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


def _tied_names(model: nn.Module, config, kind: str) -> set[str]:
    """The output head's names when the exported config ties it to the embedding (the loader ties it again)."""
    if not getattr(config, "tie_word_embeddings", False):
        return set()
    prefix = "pruned." if kind == "operators" else ""
    return {prefix + target for target in (getattr(model, "all_tied_weights_keys", None) or {})}


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
