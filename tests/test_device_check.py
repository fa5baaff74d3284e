"""scripts/device_check.py, the prepared GPU check, cannot rot: its `--tiny` run (a hidden-64 model on the CPU,
the same code path: two `fit` runs in `bf16-true`, the config's three students then the fair pair resuming
the first run's statistics, exports) works
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
    """The sizing in the docstring (and docs/gpu.md), for plan 20–30 of 32 blocks at 2048 tokens: ≈ 6.25 GFLOP
    per token for an operators student, ≈ 24.4 for operators + LoRA, so ≈ 51 per step for llama3_11's three
    students (run A) and ≈ 27 for the fair pair (run B)."""
    shape, layers = device_check.LLAMA3_8B, list(range(20, 31))
    shipped = device_check.flops_per_token(shape, 32, layers, 2048)
    pair = device_check.flops_per_token(shape, 32, layers, 2048, device_check.FAIR_PAIR)
    assert shipped["block"] / 1e9 == pytest.approx(0.453, abs=0.002)
    assert shipped["head"] / 1e9 == pytest.approx(1.05, abs=0.01)
    assert shipped["teacher"] / 1e9 == pytest.approx(14.5, abs=0.1)
    assert shipped["per_student_operators"] / 1e9 == pytest.approx(6.25, abs=0.05)
    assert shipped["per_student_lora"] / 1e9 == pytest.approx(24.4, abs=0.1)
    assert shipped["total"] / 1e9 == pytest.approx(51, abs=0.5)
    assert pair["total"] / 1e9 == pytest.approx(27, abs=0.5)
    with pytest.raises(ValueError, match=r"student kinds \['tail'\]: each is one of \['lora', 'operators'\]"):
        device_check.flops_per_token(shape, 32, layers, 2048, ("operators", "tail"))
    steps = device_check.step_summary([{"seconds": 1.0, "tokens": 8192}] * 3, shipped)
    assert steps["mfu"] == pytest.approx(shipped["total"] * 8192 / 790e12, rel=1e-3)
    assert steps["tokens_per_s_per_student"] == 8192 and steps["students"] == 3


def test_the_sized_students_are_read_from_the_config(device_check, tmp_path):
    """The sizing prices configs/llama3_11.yaml's students as `fit` resolves them, so editing the config
    changes the check; a student the arithmetic cannot price is named, not priced as operators."""
    assert device_check.config_students() == {
        "ghost_ft": "operators",
        "linearpatch_ft": "operators",
        "ghost_lora_ft": "lora",
    }
    assert device_check.config_students(extra=False) == {"ghost_ft": "operators", "linearpatch_ft": "operators"}
    config = tmp_path / "tail.yaml"
    config.write_text(
        "model:\n  distill:\n    methods: [ghost]\n    train: [lora]\n"
        "    students:\n      - {name: ghost_tail_ft, method: ghost, train: [operators, tail]}\n"
    )
    with pytest.raises(ValueError, match=r"student ghost_tail_ft trains \['operators', 'tail'\]"):
        device_check.config_students(config)
    assert device_check.config_students(config, extra=False) == {"ghost_ft": "lora"}


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
    a, b = result["runs"]["llama3_11"], result["runs"]["fair_pair"]
    for run in (a, b):
        assert run["ok"], run.get("traceback")
        assert {"load", "fit", "distillation", "evaluation", "export"} <= set(run["phases"])
        assert run["throughput"]["steps"] == 2 and run["throughput"]["tokens_per_step"] == 2 * 64
        assert len(run["validate_s"]) == 2  # at the start and the end
    # Run A trains configs/llama3_11.yaml's students, run B the fair pair alone.
    assert (a["throughput"]["students"], b["throughput"]["students"]) == (3, 2)
    pair = {"ghost_ft", "linearpatch_ft"}
    for name, students in (("llama3_11", pair | {"ghost_lora_ft"}), ("fair_pair", pair)):
        views = json.loads((tmp_path / "work" / f"run_{name}" / "results.json").read_text())["views"]
        assert {v for v in views if v.endswith("_ft")} == students, (name, list(views))
    # Run B resumed run A's statistics: no calibration pass of its own.
    assert "calibration" in a["phases"]
    assert b["phases"].get("calibration", {}).get("seconds", 0.0) < 0.5
    assert result["llama3_11_implied"]["steps"] == 500 and result["llama3_11_implied"]["total_s"] > 0
    assert not (tmp_path / "work" / "model").exists()  # the model folder is removed (16 GB on the device)
