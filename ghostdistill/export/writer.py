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
(README.md) come along. The folder is written beside the target, in a temporary folder marked as this
tool's (`core.lock.marked_tmpdir`), and renamed into place under the target's lock (`core.lock.hold`: a
second export of the same target is refused); an existing folder, or a link, is replaced only with
`overwrite` (a link itself, never what it points to); what an export killed outright (SIGKILL, a crash)
left beside the target is removed by the next export of it only when it holds the marker
(`clean_orphans`). A full disk is one line naming the folder and the space needed. It gets the permissions
`save_pretrained` would give under the user's umask (the temporary folder it is written in would leave it
readable by its owner only).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..core import modeling_ghostdistill
from ..core.executor import executor_of
from ..core.io import disk_space, publish_permissions
from ..core.lock import alive, hold, lock_path, marked_tmpdir, marker_of
from ..core.views import PrunedModel
from .card import model_card
from .pieces import Piece, exporting, save_pieces, view_pieces

# Inside a temporary folder: the view being written, and the folder it replaces, moved aside.
NEW, OLD = "new", "old"


def export_view(
    pruned: PrunedModel,
    view: str,
    folder: str | os.PathLike,
    *,
    method: str | None,
    tokenizer=None,
    info: dict | None = None,
    overwrite: bool = False,
    write: bool = True,
) -> Path:
    """Write `view` of `pruned` to `folder` and return its path. `method`: the registered method behind the view
    (``ghost`` for ``ghost`` and ``ghost_ft``; None for ``dense`` and ``pruned``); `tokenizer`: saved with the
    model when given; `info`: what produced the view (plan, calibration, seed, metrics), kept in `config.json`
    under ``ghostdistill`` and summarised in the model card; `overwrite`: replace an existing folder (otherwise
    it is an error); `write` false: a rank of a sharded model other than rank 0 (the same work, every block
    gathered in rank 0's order, nothing written)."""
    check_view(pruned, view)
    with exporting(pruned, view):  # `write_folder` refuses a taken target before any work
        return write_folder(prepare(pruned, view, method, tokenizer, info, write=write), folder, overwrite=overwrite)


def check_view(pruned: PrunedModel, view: str) -> None:
    if view not in pruned.views:
        raise ValueError(f"cannot export view {view!r}: the views are {pruned.views}")


@dataclass
class ViewExport:
    """One view as every export format writes it, described once (`prepare`, inside `pieces.exporting`): its
    pieces (`export.pieces`), config and kind (``operators``: the wrapper with the gap operators; ``plain``: the
    model's own architecture), the model switched to it, the tokenizer and what produced it (`info`, config.json's
    ``ghostdistill`` record). A model held in memory makes its state once, for every format (`state`); one off the
    device or sharded streams its pieces to each. `write` false: as `export_view`'s; `calibration` gives the
    run's calibration windows, `vocab_source` the GGUF file the model was read from."""

    view: str
    method: str | None
    model: nn.Module
    pieces: list[Piece]
    config: object
    kind: str
    tokenizer: object = None
    info: dict = field(default_factory=dict)
    write: bool = True
    calibration: Callable[[], torch.Tensor] | None = None
    vocab_source: Path | None = None
    _state: dict[str, torch.Tensor] | None = None

    @property
    def streamed(self) -> bool:
        return executor_of(self.model).streamed

    @property
    def state(self) -> dict[str, torch.Tensor]:
        """The view's whole state dict, made once (a format that needs it all at once)."""
        if self._state is None:
            self._state = {k: v for piece in self.pieces for k, v in piece.load().items()}
        return self._state

    def join(self) -> None:
        """What a rank that writes nothing does: every piece made (its gathers), in rank 0's order."""
        for piece in self.pieces:
            piece.load()


def prepare(pruned: PrunedModel, view: str, method: str | None, tokenizer=None, info: dict | None = None, **kw):
    """`view` of `pruned` ready to be written (inside `pieces.exporting(pruned, view)`); `info`, what config.json
    records under `ghostdistill`, gains the view, its method and the plan where it does not say; `kw`:
    `ViewExport`'s `write`, `calibration` and `vocab_source`."""
    info, plan = dict(info or {}), pruned.plan
    info.setdefault("view", view)
    info.setdefault("method", method)
    info.setdefault(
        "plan", {"num_layers": plan.num_layers, "removed": list(plan.removed), "gaps": [g.key for g in plan.gaps]}
    )
    pieces, config, kind = view_pieces(pruned, view, method, info)
    return ViewExport(view, method, pruned.model, pieces, config, kind, tokenizer, info, **kw)


def write_folder(view: ViewExport, folder: str | os.PathLike, *, overwrite: bool = False) -> Path:
    """Write a prepared view as a Hugging Face folder at `folder` (module docstring); returns its path."""
    target = Path(folder)
    if not view.write:
        view.join()
        return target
    check_target(target, "folder", overwrite, "overwrite (export.overwrite: true / --overwrite)")
    model = view.model
    with (
        staged_folder(target, f"export of view {view.view} to {target}") as tmp,
        disk_space(f"export folder {target}", target.parent) as needed,
    ):
        if view.streamed:
            # Off the device or sharded (FSDP2): one shard per piece, written as it is made (`save_pieces`), so no
            # process holds the whole view; a head tied to the embedding is left out (the loader ties it again).
            needed["bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
            tied = getattr(view.config, "tie_word_embeddings", False) and getattr(model, "all_tied_weights_keys", None)
            prefix = "pruned." if view.kind == "operators" else ""
            save_pieces(view.pieces, tmp, {prefix + target for target in tied or {}})
        else:
            state = dict(view.state)
            needed["bytes"] = sum(t.numel() * t.element_size() for t in state.values())
            _save_weights(model, state, tmp)
        view.config.save_pretrained(tmp)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(tmp)
        if view.kind == "operators":
            shutil.copyfile(modeling_ghostdistill.__file__, tmp / "modeling_ghostdistill.py")
        if view.tokenizer is not None:
            view.tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(view.info, view.kind))
    return target


@contextlib.contextmanager
def staged_folder(target: Path, what: str) -> Iterator[Path]:
    """A new folder to fill for `target`, put in its place when the block ends without an error, as this module's
    docstring says; on an error or a signal nothing new is left and an old folder stays."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with hold(lock_path(target), what, "wait for that export to finish"):
        clean_orphans(target)
        # The marker inside names this process: what lets a later export prove the folder is its to remove.
        work = marked_tmpdir(target.parent, f".{target.name}.tmp-{os.getpid()}-", target.name)
        try:
            (work / NEW).mkdir()
            yield work / NEW
            publish_permissions(work / NEW)  # what save_pretrained gives in place; a serving user must read it
            # What held the target name (a folder, or a link, moved itself and never followed) goes into `work`
            # first and with it: an interruption leaves either the old folder or the new one under the target
            # name, and nothing beside it but the marked folder.
            if os.path.lexists(target):
                os.replace(target, work / OLD)
            os.replace(work / NEW, target)
        finally:
            _discard(work, target)


def check_target(path: str | os.PathLike, kind: str, overwrite: bool, flag: str = "--overwrite") -> None:
    """What may stand where an export writes `path`, a ``folder`` (a view) or a ``file`` (GGUF): nothing; with
    `overwrite`, the same kind or a link (the link is replaced itself, never followed). A folder where a file
    goes, or a file where a folder goes, is refused whatever `overwrite` says: replacing it would delete
    something that is not an export of this kind."""
    path = Path(path)
    if not os.path.lexists(path):
        return
    if not overwrite:
        raise FileExistsError(f"export target {path} exists; pass {flag} to replace it, or choose another dir")
    if path.is_symlink():
        return
    if kind == "file" and path.is_dir():
        raise IsADirectoryError(
            f"export target {path} is a folder where a {path.suffix or 'file'} file goes; move or remove it, or "
            "choose another dir (overwrite replaces files, never folders)"
        )
    if kind == "folder" and not path.is_dir():
        raise NotADirectoryError(
            f"export target {path} is a file where a model folder goes; move or remove it, or choose another dir "
            "(overwrite replaces folders, never files)"
        )


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


def clean_orphans(target: Path) -> None:
    """Remove what an export of `target` killed by SIGKILL or a crash left beside it: its temporary folders
    (`.<name>.tmp-*`) that hold this tool's marker for `target` (`core.lock.marked_tmpdir`) and whose process
    no longer runs; an old folder it had moved aside (into the temporary folder) goes back when no new folder
    took its place. A folder without the marker is never touched, whatever its name. The caller holds the
    target's lock, so no live export of it is writing one."""
    prefix = f".{target.name}.tmp-"
    for path in target.parent.iterdir():
        if not path.name.startswith(prefix) or path.is_symlink() or not path.is_dir():
            continue
        record = marker_of(path, target.name)
        if record is not None and not (alive(record) and record.get("pid") != os.getpid()):
            _discard(path, target)


def _discard(work: Path, target: Path) -> None:
    """Remove a temporary folder of `target`, first putting back the old folder moved into it (`staged_folder`)
    when no new one took its place."""
    old = work / OLD
    if os.path.lexists(old) and not os.path.lexists(target):
        os.replace(old, target)
    shutil.rmtree(work, ignore_errors=True)
