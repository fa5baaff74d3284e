"""Atomic writes leave files with the umask's permissions (as `open()` would), not mkstemp's 0o600, so
another user who reads a shared run folder can read its results, statistics and caches."""

from __future__ import annotations

import os
import stat

import pytest
import torch

from ghostdistill.core.io import atomic_torch_save, atomic_write_json, atomic_write_text


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_atomic_files_get_the_permissions_of_the_umask(tmp_path, umask, mode):
    previous = os.umask(umask)
    try:
        atomic_write_json(tmp_path / "results.json", {"a": 1})
        atomic_write_text(tmp_path / "results.md", "# r\n")
        atomic_torch_save({"x": torch.zeros(2)}, tmp_path / "calibration_state.pt")
        atomic_write_text(tmp_path / "results.md", "# again\n")  # a replaced file too
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert modes == {"results.json": mode, "results.md": mode, "calibration_state.pt": mode}, modes
