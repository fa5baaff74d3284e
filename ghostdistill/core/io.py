"""Atomic writes (a run interrupted at any moment leaves either the old file or the new one), and the keys
that tell a resumable file from a stale one."""

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


def _atomic(path: Path, write) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
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
