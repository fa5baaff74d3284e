"""ruff: the lint rules and the formatting of pyproject.toml's [tool.ruff] hold over the code, the tests
and the scripts."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATHS = ["ghostdistill", "tests", "scripts"]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    if importlib.util.find_spec("ruff") is None:
        message = "ruff is not installed (pip install -e '.[dev]')"
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(message)
        pytest.skip(message)
    return subprocess.run(
        [sys.executable, "-m", "ruff", *args, *PATHS],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def test_ruff_check():
    done = _ruff("check", "--no-cache", "--output-format", "concise")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]


def test_ruff_format():
    done = _ruff("format", "--check", "--no-cache")
    assert done.returncode == 0, (done.stdout + done.stderr)[-6000:]
