"""Atomic writes (a run interrupted at any moment leaves either the old file or the new one), and the keys
that tell a resumable file from a stale one.

A file is written beside its target with `tempfile.mkstemp`, which creates it 0o600 whatever the umask;
it is given the permissions `open()` would have given (0o666 less the umask) before it is renamed into
place, so another user who reads a shared run folder can read its results, statistics and caches.
"""

from __future__ import annotations

import copy
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

import torch

from .errors import NoSpaceError


def current_umask() -> int:
    """The process's umask (reading it means setting it; it is put straight back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def publish_permissions(folder: str | os.PathLike) -> None:
    """What a folder written in place gets: directories 0o777 and files 0o666 less the umask
    (`tempfile.mkdtemp` creates 0o700 and `mkstemp` 0o600, which another user cannot read)."""
    mask = current_umask()
    for root, _dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


# What a full disk looks like when the writer hides errno: safetensors (Rust) and torch.save's zip writer.
_NO_SPACE_TEXT = ("No space left on device", "os error 28", "StorageFull", "Disk quota exceeded", "os error 122")
_TORCH_WRITE_FAILED = ("inline_container", "unexpected pos", "file write failed")
# Below this much free space a failed write is put down to a full disk.
_NEARLY_FULL = 1 << 30


def human_bytes(n: int | float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024


def _mount_of(path: Path) -> Path:
    path = path.resolve()
    while not os.path.ismount(path) and path != path.parent:  # a path that does not exist is no mount either
        path = path.parent
    return path


def no_space(err: BaseException, folder: Path) -> bool:
    """Whether `err` (raised writing into `folder`) is a full disk: errno ENOSPC / EDQUOT, the same in a
    library's message, or torch's zip writer failing while the disk is (nearly) full."""
    text = str(err)
    if isinstance(err, OSError) and err.errno in (errno.ENOSPC, errno.EDQUOT) or any(t in text for t in _NO_SPACE_TEXT):
        return True
    if isinstance(err, RuntimeError) and any(t in text for t in _TORCH_WRITE_FAILED):
        with suppress(OSError):
            return shutil.disk_usage(_mount_of(folder)).free < _NEARLY_FULL
    return False


@contextmanager
def disk_space(what: str, folder: str | os.PathLike, needed: dict | None = None) -> Iterator[dict]:
    """Within the block, a write that fails on a full disk becomes one `NoSpaceError` naming the disk, `what`
    could not be written and the space it needed (`needed["bytes"]`, which the block may fill in as it learns
    it; the dict is what the block gets)."""
    needed = {} if needed is None else needed
    folder = Path(folder)
    try:
        yield needed
    except Exception as err:
        if isinstance(err, NoSpaceError) or not no_space(err, folder):  # an inner block's own: as it is
            raise
        mount = _mount_of(folder)
        free = "unknown"
        with suppress(OSError):
            free = human_bytes(shutil.disk_usage(mount).free)
        size = needed.get("bytes")
        need = f"; it needs about {human_bytes(size)}" if size else ""
        full = NoSpaceError(
            f"no space left on the disk of {folder} (mounted at {mount}, {free} free) to write {what}{need}: free "
            f"space there or write elsewhere ({type(err).__name__}: {' '.join(str(err).split())[:160]})"
        )
        full.errno = errno.ENOSPC
        raise full from None


@contextmanager
def atomic_path(path: str | os.PathLike, needed: int | None = None) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that opens the file itself (e.g. `gguf.GGUFWriter`): renamed
    onto `path` when the block ends (a link at `path` is replaced, never followed), removed if it raises, so
    `path` is never half-written (module docstring). `needed`: the bytes it will hold, named if the disk is full."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with disk_space(str(path), path.parent, {"bytes": needed}):
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        os.fchmod(fd, 0o666 & ~current_umask())  # a plain file's permissions (mkstemp gives the owner only)
        os.close(fd)
        try:
            yield Path(tmp)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _atomic(path: Path, write) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:  # closed (flushed) before it is synced and renamed
        write(f)


def check_writable(folder: str | os.PathLike, what: str, fix: str = "choose another dir") -> None:
    """That `folder` can be made (where missing) and written, tried for real before any work: permissions alone
    mislead (root passes `os.access` on /proc and on read-only mounts, where the first write fails). What the
    try creates is removed again. One-line errors name `what` and the folder."""
    folder = Path(folder)
    missing, probe = [], folder
    while not os.path.lexists(probe) and probe != probe.parent:
        missing.append(probe)
        probe = probe.parent
    if not probe.is_dir():
        raise NotADirectoryError(f"{what} {folder} cannot be made: {probe} is a file, not a folder")
    made: list[Path] = []
    try:
        for path in reversed(missing):
            path.mkdir()
            made.append(path)
        fd, name = tempfile.mkstemp(dir=folder, prefix=".ghostdistill-probe-")
        os.close(fd)
        os.unlink(name)
    except OSError as err:
        where = err.filename or probe
        raise PermissionError(f"{what} {folder} cannot be written: {where}: {err.strerror or err}; {fix}") from None
    finally:
        for path in reversed(made):
            with suppress(OSError):
                path.rmdir()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    _atomic(Path(path), lambda f: f.write(text.encode("utf-8")))


def atomic_write_json(path: str | os.PathLike, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=False) + "\n")


def atomic_torch_save(obj: Any, path: str | os.PathLike) -> None:
    _atomic(Path(path), lambda f: torch.save(obj, f))


def atomic_savefig(fig, path: str | os.PathLike) -> None:
    _atomic(Path(path), lambda f: fig.savefig(f, format=Path(path).suffix.lstrip("."), dpi=120, bbox_inches="tight"))


def json_digest(obj: Any) -> str:
    """The one key maker: a short stable digest of JSON-able settings, which names every resumable
    artefact (calibration state, generated-text cache, GGUF conversion, zero-shot score). Tensors are
    first turned into `tensor_digest` strings by the caller."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


def tensor_digest(state: dict[str, torch.Tensor]) -> str:
    """Digest of tensor values (as float64 bytes, in key order), for keys that depend on weights."""
    h = hashlib.sha256()
    for name, tensor in sorted(state.items()):
        h.update(name.encode())
        h.update(tensor.detach().to("cpu", torch.float64).contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def read_mapping(path: str | os.PathLike, what: str) -> dict:
    """The mapping a YAML or JSON file holds (JSON is YAML; a `.json` file is read as JSON), or a one-line
    ValueError naming the file and what is wrong: missing, empty, not valid YAML/JSON, or a list or a
    scalar where a mapping of keys is expected. `what` says what the file is (``compare file``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"{what} {str(path)!r} does not exist" + (" (it is a folder)" if p.is_dir() else ""))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{what} {p} is not text (byte {err.start} is not UTF-8)") from None
    if not text.strip():
        raise ValueError(f"{what} {p} is empty: it must hold a mapping of keys")
    import yaml

    try:
        data = json.loads(text) if p.suffix == ".json" else yaml.safe_load(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"{what} {p} is not valid JSON (line {err.lineno}, column {err.colno}: {err.msg})") from None
    except Exception as err:  # noqa: BLE001 - yaml.YAMLError and its kin: any parse failure reads the same
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = getattr(err, "problem", None) or type(err).__name__
        raise ValueError(f"{what} {p} is not valid YAML ({where}{problem})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{what} {p} holds a {type(data).__name__}, not a mapping of keys")
    return data


def spec_name(spec: str | os.PathLike | Mapping) -> str:
    """How a study's messages name its spec: the file's path, or ``(given as a mapping)`` for a mapping given
    from Python (`ghostdistill.compare`, `ghostdistill.frontier`)."""
    return "(given as a mapping)" if isinstance(spec, Mapping) else str(spec)


def read_spec(spec: str | os.PathLike | Mapping, what: str, valid: Sequence[str], required: Sequence[str]) -> dict:
    """A study's file (`read_mapping`; ``compare file``, ``frontier file``) or a mapping of its keys (copied):
    no key but the `valid` ones, every `required` one, and a `base` fit config that exists."""
    path = spec_name(spec)
    spec = copy.deepcopy(dict(spec)) if isinstance(spec, Mapping) else read_mapping(spec, what)
    unknown = set(spec) - set(valid)
    if unknown:
        raise ValueError(f"{what} {path}: unknown keys {sorted(unknown)}; valid: {', '.join(valid)}")
    for key in required:
        if key not in spec:
            raise ValueError(f"{what} {path}: missing {key!r}")
    if not isinstance(spec["base"], str) or not Path(spec["base"]).is_file():
        raise FileNotFoundError(f"{what} {path}: base config {spec['base']!r} does not exist")
    return spec


class Resumable:
    """The finished items of a long pass made item by item (a batch of generated text, of the dense model's
    answers), kept in `path` as they come, atomically, with `state` (what the next item needs: the sampler's
    RNG state), so that a pass cut short (SIGINT, SIGTERM, a crash) resumes with its next item and ends as an
    uninterrupted one does, to the bit. `path` is keyed by the caller as the pass's own cache is; None keeps
    nothing, `write` False (a process that does not write) only reads. A file that does not read is started
    again; `finish` removes the file once the caller has kept the whole result."""

    def __init__(self, path: str | os.PathLike | None, write: bool = True) -> None:
        self.path, self.write = (Path(path) if path is not None else None), write
        self.items: list = []
        self.state: Any = None
        if self.path is not None and self.path.is_file():
            with suppress(Exception):  # unreadable or from another version: made again
                saved = torch.load(self.path, weights_only=True)
                self.items, self.state = list(saved["items"]), saved["state"]

    def add(self, item: Any, state: Any = None) -> None:
        self.items.append(item)
        self.state = state
        if self.path is not None and self.write:
            atomic_torch_save({"items": self.items, "state": state}, self.path)

    def finish(self) -> None:
        if self.path is not None and self.write:
            self.path.unlink(missing_ok=True)


def partial_path(cache: Path | None) -> Path | None:
    """Where the unfinished pass behind `cache` keeps its items (`Resumable`): beside it, ``<name>.partial.pt``."""
    return None if cache is None else cache.with_name(f"{cache.stem}.partial.pt")
