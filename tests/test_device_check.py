"""scripts/device_check.py, the prepared GPU check, cannot rot: its `--tiny` run (a hidden-64 model on the CPU,
the same code path: two `fit` runs in `bf16-true`, the config's three students then the fair pair resuming
the first run's statistics, exports) works
end to end, and its sizing arithmetic is the docstring's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "device_check.py"


def sizing(*config: str) -> subprocess.CompletedProcess:
    """`python scripts/device_check.py --sizing [CONFIG]`: the full check's arithmetic, as JSON."""
    command = [sys.executable, str(SCRIPT), "--sizing", *config]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def shipped() -> dict:
    done = sizing()
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


def test_the_llama3_8b_shape_has_its_parameter_count(shipped):
    shape, counts = shipped["shape"], shipped["params"]
    assert counts["total"] == 8_030_261_248  # Meta-Llama-3-8B
    assert counts["block"] == 218_112_000
    assert counts["embed"] == counts["head"] == 128_256 * 4096  # untied: the head is a matrix of its own
    assert counts["total"] == 32 * counts["block"] + counts["embed"] + counts["head"] + 4096
    assert (shape["hidden_size"], shape["num_attention_heads"], shape["num_key_value_heads"]) == (4096, 32, 8)
    assert not shape["tie_word_embeddings"] and shape["vocab_size"] == 128_256


def test_flops_per_token_are_the_docstrings(shipped):
    """The sizing in the docstring (and docs/gpu.md), for plan 20–30 of 32 blocks at 2048 tokens: ≈ 6.25 GFLOP
    per token for an operators student, ≈ 24.4 for operators + LoRA, so ≈ 51 per step for llama3_11's three
    students (run A) and ≈ 27 for the fair pair (run B)."""
    a, pair = shipped["flops_per_token"]["llama3_11"], shipped["flops_per_token"]["fair_pair"]
    assert a["block"] / 1e9 == pytest.approx(0.453, abs=0.002)
    assert a["head"] / 1e9 == pytest.approx(1.05, abs=0.01)
    assert a["teacher"] / 1e9 == pytest.approx(14.5, abs=0.1)
    assert a["per_student_operators"] / 1e9 == pytest.approx(6.25, abs=0.05)
    assert a["per_student_lora"] / 1e9 == pytest.approx(24.4, abs=0.1)
    assert a["total"] / 1e9 == pytest.approx(51, abs=0.5)
    assert pair["total"] / 1e9 == pytest.approx(27, abs=0.5)
    steps = shipped["one_second_step"]["llama3_11"]
    assert steps["mfu"] == pytest.approx(a["total"] * 8192 / 790e12, rel=1e-3)
    assert steps["tokens_per_s_per_student"] == 8192 and steps["students"] == 3


def test_the_sized_students_are_read_from_the_config(shipped, tmp_path):
    """The sizing prices configs/llama3_11.yaml's students as `fit` resolves them, so editing the config
    changes the check; a student the arithmetic cannot price is named, not priced as operators."""
    assert shipped["students"] == {
        "llama3_11": {"ghost_ft": "operators", "linearpatch_ft": "operators", "ghost_lora_ft": "lora"},
        "fair_pair": {"ghost_ft": "operators", "linearpatch_ft": "operators"},
    }
    config = tmp_path / "tail.yaml"
    config.write_text(
        "model:\n  distill:\n    methods: [ghost]\n    train: [lora]\n"
        "    students:\n      - {name: ghost_tail_ft, method: ghost, train: [operators, tail]}\n"
    )
    done = sizing(str(config))
    assert done.returncode != 0
    assert "student ghost_tail_ft trains ['operators', 'tail']" in done.stderr, done.stderr[-3000:]
    config.write_text("model:\n  distill:\n    methods: [ghost]\n    train: [lora]\n")
    done = sizing(str(config))
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["students"] == {"llama3_11": {"ghost_ft": "lora"}, "fair_pair": {"ghost_ft": "lora"}}


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
