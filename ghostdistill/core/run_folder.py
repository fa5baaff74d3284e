"""Run folders: which folder a run may write into, and what tells one of this tool's run folders from a folder
of the user's.

A run writes files of common names (config.yaml, results.md, checkpoints/, ...). Into a folder of the user's
that holds such a file, it would replace the user's file: a run folder is either new, or this tool's own, or
holds none of those names. This tool's own is what `RUN_MARKER` marks: `hold_run_folder` writes it when a run
first takes a folder. A run folder of a version before the marker is recognised by what it wrote there: a
results.json of a run's report, a config.yaml of a `fit` config (the sections LightningCLI saves with this
tool's callbacks), or a calibration_state.pt keyed by a fingerprint; it is marked when it is next run.

`check_run_folder` refuses, before any work, in one line naming the setting (`trainer.default_root_dir`): an
empty path (it would be the current folder), a dangling symbolic link, a file, a folder that cannot be
written, and a folder of the user's with files a run would replace. `hold_run_folder` holds the run folder's
lock (`core.lock`) and, when the run fails and the folder it made holds nothing a rerun would reuse, removes
it again: a refused run leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .io import atomic_write_text, check_writable, read_mapping
from .lock import hold_folder

RUN_MARKER = ".ghostdistill-run"
# What a run writes in its folder: a file of the user's of one of these names would be replaced.
RUN_FILES = (
    "config.yaml",
    "results.json",
    "results.md",
    "results.png",
    "plan.png",
    "analysis.png",
    "training.png",
    "curve.png",
    "calibration_state.pt",
    "checkpoints",
    "zeroshot",
)
# What a run that failed early leaves in a folder it made: nothing a rerun reuses.
_DISPOSABLE = {RUN_MARKER, "config.yaml"}


def _mapping(path: Path) -> dict:
    """The mapping a results.json or config.yaml holds; {} where it is missing or holds none."""
    try:
        return read_mapping(path, "run file")
    except (OSError, ValueError):
        return {}


def is_run_folder(folder: str | os.PathLike) -> bool:
    """Whether `folder` is this tool's run folder: marked (`RUN_MARKER`), or written by an earlier version (its
    results.json, config.yaml or calibration_state.pt; see the module docstring)."""
    folder = Path(folder)
    if (folder / RUN_MARKER).is_file():
        return True
    if {"plan", "views"} <= _mapping(folder / "results.json").keys():
        return True
    if {"model", "trainer", "calibration", "export"} <= _mapping(folder / "config.yaml").keys():
        return True
    import torch

    try:  # a calibration_state.pt this tool wrote, mapped, not read: a large state costs nothing to recognise
        state = torch.load(folder / "calibration_state.pt", map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - missing, empty, truncated, not a torch file: not recognisably ours
        return False
    return isinstance(state, dict) and "fingerprint" in state  # a mapping keyed by a fingerprint


def check_run_folder(
    folder: str | os.PathLike | None, key: str = "trainer.default_root_dir", write: bool = True
) -> None:
    """One line naming `key` when a run cannot write into `folder`, before any work (see the module docstring).
    `write`: try a write there (one process of several: ranks probing one new folder at once would race)."""
    if folder is None:
        return
    if not str(folder).strip():
        raise ValueError(
            f"{key} {str(folder)!r} is empty: give the run folder, e.g. runs/my_run (`.` for the current folder)"
        )
    path = Path(folder).expanduser()
    if path.is_symlink() and not path.exists():
        raise FileNotFoundError(
            f"{key} {folder} is a symbolic link to {os.readlink(path)}, which does not exist: create that folder, "
            "or give another run folder"
        )
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"{key} {folder}: {probe} is a file; the run folder must be a folder (or not exist)")
    if path.is_dir() and not is_run_folder(path):
        theirs = sorted(name for name in RUN_FILES if (path / name).exists())
        if theirs:
            raise FileExistsError(
                f"{key} {folder} is not a ghostdistill run folder, and a run there would replace its "
                f"{', '.join(theirs)}: choose another (new or empty) folder"
            )
    if write:
        check_writable(path, key, "choose a folder you can write")


@contextmanager
def hold_run_folder(folder: str | os.PathLike, what: str, advice: str, take: bool = True) -> Iterator[None]:
    """The run folder `folder`, checked (`check_run_folder`), locked (`core.lock.hold_folder`) and marked as this
    tool's for the block, and removed again when the block fails in a folder this call made, which then holds
    nothing but `_DISPOSABLE`; `take` false (ranks other than 0) only waits in it."""
    folder = Path(folder)
    if not take:
        yield
        return
    check_run_folder(folder)
    made, probe = None, folder  # the outermost folder of its path that does not exist yet (what making it creates)
    while not os.path.lexists(probe) and probe != probe.parent:
        made, probe = probe, probe.parent
    try:
        with hold_folder(folder, what, advice):
            if not (folder / RUN_MARKER).is_file():
                atomic_write_text(
                    folder / RUN_MARKER, json.dumps({"tool": "ghostdistill", "what": "run folder"}) + "\n"
                )
            yield
    except BaseException:
        if made is not None and folder.is_dir() and set(os.listdir(folder)) <= _DISPOSABLE:
            for name in _DISPOSABLE:
                (folder / name).unlink(missing_ok=True)
            chain = [folder, *folder.parents]
            with contextlib.suppress(OSError):  # the folder, then its parents up to `made` while each is empty
                for path in chain[: chain.index(made) + 1]:
                    path.rmdir()
        raise
