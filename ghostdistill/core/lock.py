"""Who holds a place on disk: locks that a crashed holder does not keep, and temporary folders this tool can
prove it made.

Locks. Two `fit`s into one run folder, or two exports of one target, would interleave their files. `hold(path,
what)` takes an exclusive `fcntl.flock` on the lock file `path` and writes who holds it (process id, host,
since when, what it does) into it; a second holder is refused at once with one line naming the first
(`PlaceInUse`). The kernel drops a flock when its process dies, however it dies (SIGKILL, a crash), so a lock
is never stale: a lock file left behind by a dead process is taken over by the next one. Where the filesystem
has no flock (some network mounts), the body decides: held while its process is alive on this host. A lock is
reentrant within a process (an export that locks its targets before loading the model, then writes them
through the writer, which locks each again), and the file is removed on release; a holder that finds the path
replaced under it (the previous holder removed the file between our open and our lock) opens it again.

Temporary folders. What an interrupted writer leaves beside its target may be removed by the next writer only
if it can prove this tool made it: `marked_tmpdir` writes a marker file inside the folder when it creates it
(tool, target, process id, host, time), and `marker_of` reads it back. A folder whose name merely looks like
a temporary one (``.ghost.tmp-mybackup``) has no marker and is never touched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: the body alone decides
    fcntl = None

MARKER = ".ghostdistill-tmp"
_HELD: set[str] = set()  # the lock paths this process holds (an inner `hold` of one of them is a no-op)


class PlaceInUse(RuntimeError):
    """Another live process holds the place (a run folder, an export target)."""


def who() -> dict:
    """This process, as a lock or a marker records it."""
    return {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}


def alive(record: dict) -> bool:
    """Whether the process a record names may still run: on this host, whether its pid exists; on another
    host nobody here can tell, so it counts as alive."""
    if record.get("host") != socket.gethostname():
        return True
    try:
        os.kill(int(record["pid"]), 0)
    except ProcessLookupError:
        return False
    except (PermissionError, KeyError, TypeError, ValueError, OverflowError):
        return True  # another user's process, or a record we cannot read: assume it runs
    return True


def _read(source: int | Path) -> dict:
    """The record in a lock file (from its open descriptor or its path) or a marker; {} where none reads."""
    try:
        if isinstance(source, int):
            os.lseek(source, 0, os.SEEK_SET)
            text = os.read(source, 65536).decode()
        else:
            text = source.read_text()
        data = json.loads(text or "{}")
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _acquire(path: Path) -> int | None:
    """An open descriptor of `path` locked by this process, or None when another holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        try:
            try:
                if fcntl is None:
                    raise OSError(errno.ENOSYS, "no fcntl")
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as err:
                if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                    os.close(fd)
                    return None
                if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                # No flock here: the body names the holder, who holds it while alive on this host.
                record = _read(fd)
                if record and alive(record) and record.get("pid") != os.getpid():
                    os.close(fd)
                    return None
            with suppress(FileNotFoundError):
                if os.fstat(fd).st_ino == os.stat(path).st_ino:
                    return fd
            os.close(fd)  # the file was removed by its last holder between our open and our lock: again
        except BaseException:
            os.close(fd)
            raise


@contextmanager
def hold(path: str | os.PathLike, what: str, advice: str = "") -> Iterator[None]:
    """Hold the lock file `path` for the block, or raise `PlaceInUse` naming its holder (module docstring);
    `what` says what this process does there (shown to a second one), `advice` what the refused one can do."""
    path = Path(path)
    key = str(path.resolve())
    if key in _HELD:  # reentrant: the outermost hold releases it
        yield
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = _acquire(path)
    except OSError as err:  # a read-only mount, a folder of another user: one line, not a traceback
        if err.errno not in (errno.EROFS, errno.EACCES, errno.EPERM):
            raise
        raise PermissionError(
            f"{path.parent} is not writable ({err.strerror}: {err.filename or path}): its lock file cannot be made; "
            "choose a folder you can write"
        ) from None
    if fd is None:
        record = _read(path)
        what = f" ({record['what']})" if record.get("what") else ""
        holder = f"process {record.get('pid')} on {record.get('host')} since {record.get('since')}{what}"
        raise PlaceInUse(
            f"{path.parent} is in use by {holder if record else 'another process'} (lock {path}); "
            + (advice or "wait for it to finish")
        )
    os.ftruncate(fd, 0)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, (json.dumps({**who(), "what": what}) + "\n").encode())
    _HELD.add(key)
    try:
        yield
    finally:
        _HELD.discard(key)
        with suppress(OSError):
            path.unlink()  # while still locked: a waiting opener sees a new file (`_acquire` checks)
        os.close(fd)


# The lock file of a run folder (`fit`, `frontier`, `compare`), inside it.
RUN_LOCK = ".ghostdistill.lock"


def hold_folder(folder: str | os.PathLike, what: str, advice: str):
    """`hold` the run folder `folder` (its `RUN_LOCK`) while `what` works in it."""
    return hold(Path(folder) / RUN_LOCK, what, advice)


def lock_path(target: str | os.PathLike) -> Path:
    """The lock file of an export target: ``.<name>.lock`` beside it."""
    target = Path(target)
    return target.with_name(f".{target.name}.lock")


def marked_tmpdir(parent: str | os.PathLike, prefix: str, target: str) -> Path:
    """A new temporary folder under `parent`, its name starting with `prefix`, holding the marker for `target`
    (module docstring) that lets a later clean-up prove this tool made it (`marker_of`)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    try:
        (tmp / MARKER).write_text(json.dumps({"tool": "ghostdistill", "target": target, **who()}) + "\n")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def marker_of(folder: str | os.PathLike, target: str) -> dict | None:
    """The marker `marked_tmpdir` wrote in `folder` for `target`, or None when the folder holds none (a
    folder this tool did not make, whatever its name)."""
    path = Path(folder) / MARKER
    if Path(folder).is_symlink() or not path.is_file() or path.is_symlink():
        return None
    record = _read(path)
    return record if record.get("tool") == "ghostdistill" and record.get("target") == target else None
