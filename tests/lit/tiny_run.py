"""`fit` arguments for a quick run of the tiny LLaMA (layers 2-3 removed, seq_len 32), shared by the run-level
tests of this folder; `extra` overrides any of them (later arguments win)."""

from __future__ import annotations

import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def tiny_run_args(
    tiny_dir,
    text_files,
    run: Path,
    *extra: str,
    recovery: list[dict] | None = None,
    samples: int = 16,
    eval_windows: int = 2,
) -> list[str]:
    return [
        "fit",
        "--config",
        str(ROOT / "configs" / "smollm2_demo.yaml"),
        "--model.model.source",
        str(tiny_dir),
        "--model.plan.layers",
        "[2, 3]",
        "--model.plan.num_layers",
        "null",
        "--model.recovery",
        json.dumps(recovery or [{"name": "ghost"}]),
        "--data.calibration.source.source",
        str(text_files["jsonl_gz"]),
        "--data.calibration.num_samples",
        str(samples),
        "--data.calibration.seq_len",
        "32",
        "--data.evaluation.seq_len",
        "32",
        "--data.evaluation.max_windows",
        str(eval_windows),
        "--data.evaluation.sources",
        json.dumps([{"name": "held_out", "source": str(text_files["txt"])}]),
        "--data.batch_size",
        "4",
        "--calibration.progress",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(run),
        *extra,
    ]
