"""Atomic writes (a run interrupted at any moment leaves either the old file or the new one), and the keys
that tell a resumable file from a stale one.

A file is written beside its target with `tempfile.mkstemp`, which creates it 0o600 whatever the umask;
it is given the permissions `open()` would have given (0o666 less the umask) before it is renamed into
place, so another user who reads a shared run folder can read its results, statistics and caches.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch


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


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, 0o666 & ~current_umask())
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


@contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside `path` for a writer that opens the file itself (e.g. `gguf.GGUFWriter`):
    renamed onto `path` when the block ends, removed if it raises, so `path` is never half-written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


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
    kind = "JSON" if p.suffix == ".json" else "YAML"
    if not text.strip():
        raise ValueError(f"{what} {p} is empty: it must hold a mapping of keys")
    try:
        if kind == "JSON":
            data = json.loads(text)
        else:
            import yaml

            data = yaml.safe_load(text)
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
