"""scripts/device_check.py, the prepared GPU check, cannot rot: its `--tiny` run (a hidden-64 model on the CPU,
the same code path: two `fit` runs in `bf16-true`, the second resuming the first's statistics, exports) works
end to end, and its sizing arithmetic is the docstring's."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.py"


@pytest.fixture(scope="module")
def device_check():
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        yield importlib.import_module("device_check")
    finally:
        sys.path.remove(str(ROOT / "scripts"))


def test_the_llama3_8b_shape_has_its_parameter_count(device_check):
    counts = device_check.parameter_count(device_check.LLAMA3_8B, 32)
    assert counts["total"] == 8_030_261_248  # Meta-Llama-3-8B
    assert counts["block"] == 218_112_000


def test_flops_per_token_are_the_docstrings(device_check):
    """The sizing in the docstring (and docs/gpu.md): ≈ 27 GFLOP per token per step with operators, ≈ 63 with
    operators + LoRA, for plan 20–30 of 32 blocks at 2048 tokens."""
    shape, layers = device_check.LLAMA3_8B, list(range(20, 31))
    ops = device_check.flops_per_token(shape, 32, layers, 2048, lora=False)
    lora = device_check.flops_per_token(shape, 32, layers, 2048, lora=True)
    assert ops["block"] / 1e9 == pytest.approx(0.453, abs=0.002)
    assert ops["head"] / 1e9 == pytest.approx(1.05, abs=0.01)
    assert ops["teacher"] / 1e9 == pytest.approx(14.5, abs=0.1)
    assert ops["total"] / 1e9 == pytest.approx(27, abs=0.5)
    assert lora["total"] / 1e9 == pytest.approx(63, abs=1)
    steps = device_check.step_summary([{"seconds": 1.0, "tokens": 8192}] * 3, ops)
    assert steps["mfu"] == pytest.approx(ops["total"] * 8192 / 790e12, rel=1e-3)
    assert steps["tokens_per_s_per_student"] == 8192


def test_tiny_device_check_runs_every_phase(tmp_path):
    out = tmp_path / "device_check.json"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--tiny", "--out", str(out), "--dir", str(tmp_path / "work")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads(out.read_text())
    assert result["ok"] and result["preflight"]["problems"] == []
    a, b = result["runs"]["operators"], result["runs"]["operators+lora"]
    for run in (a, b):
        assert run["ok"], run.get("traceback")
        assert {"load", "fit", "distillation", "evaluation", "export"} <= set(run["phases"])
        assert run["throughput"]["steps"] == 2 and run["throughput"]["tokens_per_step"] == 2 * 64
        assert len(run["validate_s"]) == 2  # at the start and the end
    # Run B resumed run A's statistics: no calibration pass of its own.
    assert "calibration" in a["phases"]
    assert b["phases"].get("calibration", {}).get("seconds", 0.0) < 0.5
    assert result["llama3_11_implied"]["steps"] == 500 and result["llama3_11_implied"]["total_s"] > 0
    assert not (tmp_path / "work" / "model").exists()  # the model folder is removed (16 GB on the device)
