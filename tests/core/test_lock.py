"""Locks (issue 39): a second holder of a run folder or an export target is refused at once, with one line naming
the first (process, host, since when); a holder killed outright leaves no lock that counts (the kernel drops a
flock with its process), so the next one takes over; within one process a lock is reentrant."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ghostdistill.core import lock
from ghostdistill.core.lock import PlaceInUse, hold, lock_path, marked_tmpdir, marker_of

ROOT = Path(__file__).resolve().parents[2]


def _holder(path: Path) -> subprocess.Popen:
    """Another process that holds `path` until killed."""
    code = (
        "import sys, time\n"
        "from ghostdistill.core.lock import hold\n"
        f"with hold({str(path)!r}, 'a test holder'):\n"
        "    print('held', flush=True)\n"
        "    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_lock_a_second_holder_is_refused_naming_the_first_and_a_killed_one_is_taken_over(tmp_path):
    path = tmp_path / "run" / ".ghostdistill.lock"
    proc = _holder(path)
    try:
        with pytest.raises(PlaceInUse) as refused:
            with hold(path, "a second fit", "wait for it to finish"):
                pytest.fail("two holders")
        message = str(refused.value)
        assert "\n" not in message
        assert f"process {proc.pid} on {socket.gethostname()} since " in message and "(a test holder)" in message
        assert message.endswith("wait for it to finish")
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    # The killed holder's file is still there, naming it; its flock died with it: taken over.
    assert json.loads(path.read_text())["pid"] == proc.pid
    with hold(path, "the next fit"):
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert not path.exists(), "released: the lock file is removed"


def test_lock_is_reentrant_within_a_process_and_released_on_an_exception(tmp_path):
    path = lock_path(tmp_path / "ghost")
    assert path == tmp_path / ".ghost.lock"
    with pytest.raises(KeyboardInterrupt):
        with hold(path, "export"):
            with hold(path, "export again"):  # the writer under `export_run`'s early lock
                assert path.is_file()
            assert path.is_file(), "the outer holder still holds it"
            raise KeyboardInterrupt
    assert not path.exists()


def test_lock_without_flock_the_body_decides(tmp_path, monkeypatch):
    """Where the filesystem has no flock, a body naming a live process on this host holds the place, a dead
    process's does not."""
    monkeypatch.setattr(lock, "fcntl", None)
    path = tmp_path / ".x.lock"
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        path.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "since": "then"}))
        with pytest.raises(PlaceInUse, match=f"process {sleeper.pid} on"):
            with hold(path, "x"):
                pass
    finally:
        sleeper.kill()
        sleeper.wait()
    time.sleep(0.1)
    with hold(path, "x"):
        assert json.loads(path.read_text())["pid"] == os.getpid()


def test_data_loss_only_a_marked_folder_is_ours(tmp_path):
    tmp = marked_tmpdir(tmp_path, ".ghost.tmp-1-", "ghost")
    record = marker_of(tmp, "ghost")
    assert record["pid"] == os.getpid() and record["host"] == socket.gethostname()
    assert marker_of(tmp, "pruned") is None, "a marker names the target it was made for"
    mine = tmp_path / ".ghost.tmp-mybackup"
    mine.mkdir()
    (mine / ".ghostdistill-tmp").write_text("not json")
    assert marker_of(mine, "ghost") is None
    (tmp_path / ".ghost.tmp-link").symlink_to(tmp)
    assert marker_of(tmp_path / ".ghost.tmp-link", "ghost") is None, "a link is never ours"
