"""`fit` arguments for a quick run of the tiny LLaMA (the `tiny_dir` fixture), shared by every run-level test.

The defaults: configs/smollm2_demo.yaml with layers 2-3 removed, ghost recovery, 16 calibration windows of 32
tokens from the corpus' jsonl file, 2 evaluation windows of 32 tokens of its text file, batches of 4, no
progress output. A keyword set to None leaves the config's value; `extra` arguments come last and override
any of them (later arguments win). Imported as `from tiny_run import tiny_run_args`: tests/ is on sys.path
(pytest inserts the folder of tests/conftest.py), from any test folder. `exported_perplexity` scores an exported
folder on a run's evaluation windows (a folder with operators is not a `fit` source: issue 39). `repair_args`
and `frontier_file`: a repair-aware run and a frontier of it (the planning tests, the Python API's tests).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tiny_run_args(
    model_dir,
    text_files,
    run: Path,
    *extra: str,
    config: str = "smollm2_demo.yaml",
    layers: Sequence[int] | None = (2, 3),
    num_layers: int | None = None,
    recovery: Sequence[dict] | None = ({"name": "ghost"},),
    calibration_source: bool = True,
    samples: int = 16,
    seq_len: int = 32,
    eval_seq_len: int = 32,
    eval_windows: int = 2,
    batch_size: int | None = 4,
) -> list[str]:
    """Args:
    model_dir: the model folder (`model.model.source`).
    text_files: the `text_files` fixture (calibration from its jsonl, evaluation from its text file).
    run: the run folder (`trainer.default_root_dir`).
    config: a file of configs/.
    layers: the removed layers (`model.plan.layers`); None: the config's plan criterion chooses.
    num_layers: `model.plan.num_layers` (None: null, as explicit layers need).
    recovery: `model.recovery`; None: the config's.
    calibration_source: calibrate on the jsonl file; False: the config's source (the demo's `generate`).
    samples, seq_len: calibration windows and their length.
    eval_seq_len, eval_windows: evaluation window length and count (`data.evaluation`).
    batch_size: `data.batch_size`; None: the config's.
    """
    args = ["fit", "--config", str(ROOT / "configs" / config), "--model.model.source", str(model_dir)]
    if layers is not None:
        args += ["--model.plan.layers", json.dumps(list(layers))]
    args += ["--model.plan.num_layers", "null" if num_layers is None else str(num_layers)]
    if recovery is not None:
        args += ["--model.recovery", json.dumps(list(recovery))]
    if calibration_source:
        args += ["--data.calibration.source.source", str(text_files["jsonl_gz"])]
    args += [
        "--data.calibration.num_samples",
        str(samples),
        "--data.calibration.seq_len",
        str(seq_len),
        "--data.evaluation.seq_len",
        str(eval_seq_len),
        "--data.evaluation.max_windows",
        str(eval_windows),
        "--data.evaluation.sources",
        json.dumps([{"name": "held_out", "source": str(text_files["txt"])}]),
    ]
    if batch_size is not None:
        args += ["--data.batch_size", str(batch_size)]
    args += [
        "--calibration.progress",
        "false",
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.default_root_dir",
        str(run),
        *extra,
    ]
    return args


def repair_args(tiny_dir, text_files, run, *extra, criterion="repair", selection=True):
    """A repair-aware run of the tiny LLaMA (`criterion`, one block, ghost and linearpatch), calibrated on the
    jsonl file's first 150 documents; `selection`: 4 held-out windows of the documents after them."""
    args = tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--model.plan.criterion",
        criterion,
        "--data.calibration.source.max_documents",
        "150",
        *extra,
        layers=None,
        num_layers=1,
        recovery=[{"name": "ghost"}, {"name": "linearpatch", "method": "linearpatch"}],
    )
    if selection:
        source = {"source": str(text_files["jsonl_gz"]), "first_document": 150}
        args += ["--data.selection.source", json.dumps(source), "--data.selection.num_windows", "4"]
        args += ["--data.selection.seq_len", "32"]
    return args


def frontier_file(tmp_path, tiny_dir, text_files, depths):
    """A frontier file of `repair_args`' base at `depths` (root `<tmp_path>/frontier`) and the fit overrides
    that go with it: (its path, the overrides)."""
    import yaml

    args = repair_args(tiny_dir, text_files, tmp_path / "unused")
    assert args[:3] == ["fit", "--config", args[2]]
    spec = {"base": args[2], "root": str(tmp_path / "frontier"), "num_layers": depths}
    path = tmp_path / "frontier.yaml"
    path.write_text(yaml.safe_dump(spec))
    return path, args[3:]  # the plan's criterion and depth are set per depth


def exported_perplexity(folder, run) -> tuple[float, int]:
    """(perplexity, tokens scored) of the exported `folder`, loaded as a user loads it (`load_exported`), on the
    first evaluation source's windows of `run` (a `pipeline.run.Run`), as the run scores a view: the mean
    next-token NLL over every window's tokens."""
    import math

    import torch

    from ghostdistill.export import load_exported

    model = load_exported(folder)
    ids = run.data.eval_ids(run.cfg.data.evaluation.sources[0])
    nll, tokens = 0.0, 0
    with torch.no_grad():
        for windows in ids.split(4):
            logits = model(input_ids=windows).logits[:, :-1].double()
            targets = windows[:, 1:]
            nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum"))
            tokens += targets.numel()
    return math.exp(nll / tokens), tokens


def cli_error_line(args: list[str], capsys, monkeypatch) -> str:
    """Run `ghostdistill <args>` (pytest's `capsys` and `monkeypatch`); the last line of stderr, after checking that
    the command failed with exit 2 and one `error:` line: no traceback, no usage text."""
    import sys

    import pytest

    from ghostdistill.cli import entry

    monkeypatch.setattr(sys, "argv", ["ghostdistill", *args])
    monkeypatch.delenv("GHOSTDISTILL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        entry()
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, err[-3000:]
    assert "Traceback" not in err and lines and lines[-1].startswith("error: "), err[-3000:]
    assert not any(line.startswith("usage:") for line in lines), err[-3000:]
    return lines[-1]
