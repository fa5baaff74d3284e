"""scripts/rehearsal_8b.py: the 8B-width rehearsal on the CPU (LLaMA-3-8B's width, 4 blocks, random weights).

Fast here: a `fit` step of the rehearsal, its phases marked by the run's observers and measured. Slow: the whole
rehearsal on a hidden-64 model (every step: two fits, exports, reloads in fresh processes). At the real
width (`GHOSTDISTILL_REHEARSAL=1`, slow): the rehearsal in float32 and in bfloat16, every exported view
reloading with the run's perplexity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from tiny_run import tiny_run_args

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "rehearsal_8b.py"
REAL_WIDTH = pytest.mark.skipif(
    os.environ.get("GHOSTDISTILL_REHEARSAL") != "1",
    reason="8B-width rehearsal: needs ~14 GB of free RAM, ~45 GB of disk and tens of minutes on 2 cores; "
    "set GHOSTDISTILL_REHEARSAL=1 to run it",
)


def worker(kind: str, out: Path, *args: str) -> dict:
    """One step as the rehearsal runs it, `python scripts/rehearsal_8b.py worker <kind> <out> ...`: its summary."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, str(SCRIPT), "worker", kind, str(out), *args]
    done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return json.loads(out.read_text())


def test_phases_are_marked_by_the_runs_observers_and_measured(tiny_dir, text_files, tmp_path):
    """A `fit` step of the rehearsal marks its phases from the run's own phase reports (`pipeline.run.observe`,
    wrapping nothing in the package): each mapped phase is one the run reports (else it would be missing, merged
    into the one before), each optimizer step is timed with its tokens, each validation too, and every phase has
    its seconds and peak RSS above the loaded model."""
    run = tmp_path / "run"
    fit = tiny_run_args(
        tiny_dir, text_files, run,
        "--model.distill.methods", "[ghost]", "--model.distill.val_every", "1",
        "--data.validation.source", json.dumps({"source": str(text_files["jsonl_gz"]), "first_document": 150}),
        "--data.validation.num_windows", "1", "--data.validation.seq_len", "32", "--trainer.max_steps", "1",
        "--trainer.enable_progress_bar", "false",
        samples=4,
    )  # fmt: skip
    summary = worker("fit", tmp_path / "fit.json", *fit)
    assert summary["ok"]
    phases = summary["phases"]
    assert {"startup", "load", "calibration", "fit", "distillation", "evaluation", "report"} <= set(phases), phases
    for name, row in phases.items():
        assert row["seconds"] >= 0 and row["peak_rss_gib"] > 0 and row["peak_rss_anon"] > 0, name
    assert summary["loaded_rss_gib"] > 0
    assert [(s["step"], s["tokens"]) for s in summary["steps"]] == [(1, 4 * 32)] and summary["steps"][0]["seconds"] > 0
    assert len(summary["timings"]["validate_s"]) == 2  # at the start and the end
    assert set(json.loads((run / "results.json").read_text())["phases"]) >= {"load", "calibrate", "step", "evaluate"}


def test_unused_window_lengths_are_not_checked_against_the_position_limit(tiny_tokenizer, text_files, tmp_path):
    from ghostdistill.data import TextSource
    from ghostdistill.data.config import CalibrationData, DataConfig, EvaluationData, TrainData, ValidationData
    from ghostdistill.data.run import RunData

    cfg = DataConfig(
        calibration=CalibrationData(source=TextSource(str(text_files["jsonl_gz"])), num_samples=4, seq_len=32),
        evaluation=EvaluationData(sources=[TextSource(str(text_files["txt"]), name="held_out")], seq_len=32),
        train=TrainData(source=None, seq_len=2048),
        validation=ValidationData(source=None, seq_len=2048),
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunData(cfg, tiny_tokenizer).check_before_calibration(max_positions=512, distilling=True)
    assert not [str(w.message) for w in caught if "position limit" in str(w.message)]
    # A source that is set is still checked.
    val = tmp_path / "val.txt"
    val.write_text(" ".join(f"word{i % 97} other{i % 13}" for i in range(3000)))
    cfg.validation.source = TextSource(str(val), name="val")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        RunData(cfg, tiny_tokenizer).check_before_calibration(max_positions=512, distilling=True)
    assert [str(w.message) for w in caught if "data.validation.seq_len 2048" in str(w.message)]


def run_rehearsal(tmp_path: Path, *args: str, timeout: float) -> list[dict]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), "--dir", str(tmp_path / "work"), *args],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, (done.stdout + done.stderr)[-4000:]
    return lines


def check(result: dict) -> None:
    assert result["ok"], result["failures"]
    views = ["operators/ghost", "operators/ghost_ft", "operators/linearpatch", "operators/replaceme", "lora/ghost_ft"]
    for view in views:
        assert result["checks"][f"ppl {view}"] and result["checks"][f"generates {view}"], view
        if view.endswith("_ft"):
            assert result["checks"][f"trained {view}"], view  # the export carries the trained values
    assert len(result["distill_step_s"]["operators"]) == 2 and len(result["distill_step_s"]["lora"]) == 2
    for phase in ("load", "calibration", "fit", "distillation", "distillation_lora", "evaluation", "export", "reload"):
        assert result["peak_above_model_gib"][phase] is not None, phase


@pytest.mark.slow
def test_tiny_rehearsal_runs_every_step(tmp_path):
    (result,) = run_rehearsal(tmp_path, "--tiny", "--dtype", "float32", timeout=900)
    check(result)


@pytest.mark.slow
@REAL_WIDTH
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_8b_width_rehearsal(tmp_path, dtype):
    (result,) = run_rehearsal(tmp_path, "--dtype", dtype, timeout=4 * 3600)
    check(result)
    assert result["model"]["hidden_size"] == 4096 and result["model"]["vocab_size"] == 128_256


@pytest.mark.slow
def test_tiny_offload_rehearsal_runs_every_step(tmp_path):
    """`--offload disk` at a hidden-64 width: the model built a block at a time, `fit` with the weights on the
    disk, the ghost folder reloaded without ghostdistill to the run's perplexity, the folded rotation_anchored view
    as a Q8_0 GGUF file read back; per phase seconds and peak RssAnon."""
    out = tmp_path / "out.json"
    args = ["--tiny", "--blocks", "6", "--dtype", "float32", "--offload", "disk", "--json", str(out)]
    (result,) = run_rehearsal(tmp_path, *args, timeout=900)
    assert result == json.loads(out.read_text())
    assert result["ok"], {k: v for k, v in result["checks"].items() if not v["ok"]}
    assert result["removed"] == [3, 4] and result["model_bytes"] == 4 * result["model"]["params"]
    for check in ("reload ghost ppl", "reload ghost generates", "gguf weights Q8_0", "gguf block count"):
        assert result["checks"][check]["ok"], check
    for phase in ("build", "load", "calibration", "fit", "evaluation", "export_ghost", "reload_ghost", "export_gguf"):
        row = result["phases"][phase]
        assert row["seconds"] > 0 and row["peak_rss_anon"] > 0, phase
