"""The probes of issue 39 that end in one line `error: ...` and exit status 2, through the script's entry point:
checks that came too late (after the model load, or after the work), lists that named a thing twice, full disks,
places held by another process, and a refused plan that first said it would calibrate from scratch. Each test's
name names its class: late_check, duplicate, disk_full, lock."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from tiny_run import cli_error_line, tiny_run_args

ROOT = Path(__file__).resolve().parents[1]
BASE = str(ROOT / "configs" / "smollm2_demo.yaml")


def _no_model_load(monkeypatch) -> None:
    from ghostdistill.pipeline import run

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(run, "load_model", never)


def _run_folder(tmp_path: Path, tiny_dir: Path) -> Path:
    """A run folder as far as `export` reads before it loads the model."""
    run = tmp_path / "run"
    run.mkdir()
    config = {"model": {"model": {"source": str(tiny_dir)}, "plan": {"layers": [2, 3], "num_layers": None}}}
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    (run / "results.json").write_text("{}")
    (run / "calibration_state.pt").write_bytes(b"")
    return run


def _frontier(tmp_path: Path, **spec) -> str:
    path = tmp_path / "frontier.yaml"
    path.write_text(yaml.safe_dump({"base": BASE, "root": str(tmp_path / "f"), **spec}))
    return str(path)


def _holder(path: Path) -> subprocess.Popen:
    """Another process holding the lock file `path` until killed."""
    code = (
        "import time\nfrom ghostdistill.core.lock import hold\n"
        f"with hold({str(path)!r}, 'another ghostdistill'):\n    print('held', flush=True)\n    time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---------------------------------------------------------------------------------------------- late checks
@pytest.mark.parametrize(
    "depths, message",
    [([True, 2], r"num_layers \[True, 2\] must name depths: integers >= 1"), ([2, 2], r"names \[2\] more than once")],
    ids=["bool", "twice"],
)
def test_late_check_frontier_depths_are_refused_before_any_work(depths, message, tmp_path, capsys, monkeypatch):
    _no_model_load(monkeypatch)
    line = cli_error_line(["frontier", _frontier(tmp_path, num_layers=depths)], capsys, monkeypatch)
    assert re.search(message, line), line
    assert not (tmp_path / "f").exists()


def test_late_check_an_export_dir_that_cannot_be_made_is_refused_before_the_model_loads(
    tmp_path, tiny_dir, capsys, monkeypatch
):
    """`/proc/x`: `os.access` says a root user may write /proc; only a try says it cannot be made."""
    _no_model_load(monkeypatch)
    run = _run_folder(tmp_path, tiny_dir)
    line = cli_error_line(["export", str(run), "--views", "pruned", "--dir", "/proc/x"], capsys, monkeypatch)
    assert line.startswith("error: export dir /proc/x cannot be written: /proc/x: "), line


def test_late_check_a_folder_where_a_gguf_file_goes_is_refused_before_the_model_loads(
    tmp_path, tiny_dir, capsys, monkeypatch
):
    _no_model_load(monkeypatch)
    run = _run_folder(tmp_path, tiny_dir)
    out = tmp_path / "out"
    (out / "pruned.F32.gguf").mkdir(parents=True)
    (out / "pruned.F32.gguf" / "mine.txt").write_text("mine")
    args = ["export", str(run), "--views", "pruned", "--format", "gguf", "--gguf-types", "F32", "--dir", str(out)]
    line = cli_error_line([*args, "--overwrite"], capsys, monkeypatch)
    assert f"export target {out / 'pruned.F32.gguf'} is a folder where a .gguf file goes" in line, line
    assert (out / "pruned.F32.gguf" / "mine.txt").is_file()


def test_late_check_ghostdistill_cache_that_is_a_file_names_the_variable(tmp_path, capsys, monkeypatch):
    _no_model_load(monkeypatch)
    cache = tmp_path / "cache_file"
    cache.write_text("x")
    monkeypatch.setenv("GHOSTDISTILL_CACHE", str(cache))
    args = ["fit", "--config", BASE, "--trainer.default_root_dir", str(tmp_path / "run")]
    line = cli_error_line(args, capsys, monkeypatch)
    assert line.startswith(f"error: GHOSTDISTILL_CACHE='{cache}' cannot hold the converted GGUF model: {cache} is a"), (
        line
    )
    assert "model.model.cache_gguf: false" in line


def test_late_check_a_refused_hand_edited_plan_does_not_first_say_it_calibrates_from_scratch(
    tmp_path, tiny_dir, text_files, capsys, monkeypatch, caplog
):
    """`plan.greedy_from` naming a run whose results.json was edited by hand: refused, and nothing before the
    error says the run's saved state is discarded (it is not: nothing ran)."""
    source = tmp_path / "greedy"
    source.mkdir()
    edited = {"plan": {"chosen_by": "repair_greedy (ghost)", "removed": [2], "candidates": {"step 1": {"removed": 2}}}}
    (source / "results.json").write_text(json.dumps({**edited, "calibration": {"fingerprint": "edited by hand"}}))
    run = tmp_path / "run"
    run.mkdir()
    torch.save({"format": 2, "fingerprint": "another run's"}, run / "calibration_state.pt")
    selection = {"source": str(text_files["jsonl_gz"]), "first_document": 150}
    args = tiny_run_args(
        tiny_dir, text_files, run, "--model.plan.criterion", "repair_greedy", "--model.plan.greedy_from", str(source),
        "--data.selection.source", json.dumps(selection), "--data.selection.num_windows", "4",
        "--data.selection.seq_len", "32", layers=None, num_layers=2,
    )  # fmt: skip
    line = cli_error_line(args, capsys, monkeypatch)
    assert "plan.greedy_from" in line and "was run with other settings than this run" in line, line
    assert "calibrating from scratch" not in caplog.text + capsys.readouterr().out


# ------------------------------------------------------------------------------------------------ duplicates
def _fit(tiny_dir, text_files, tmp_path, *extra):
    return tiny_run_args(tiny_dir, text_files, tmp_path / "fit", *extra, calibration_source=False)


@pytest.mark.parametrize(
    "case",
    [
        "export --gguf-types F32 F32",
        "export --views ghost ghost",
        "export --format hf hf",
        "fit export.views",
        "fit export.gguf_types",
        "fit evaluation.views",
        "fit zeroshot tasks",
        "fit lora target_modules",
        "frontier criteria",
        "frontier greedy.views",
    ],
)
def test_duplicate_list_arguments_are_refused_before_any_work(
    case, tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    _no_model_load(monkeypatch)
    if case.startswith("export"):
        run = _run_folder(tmp_path, tiny_dir)
        flag, value = case.split()[1], case.split()[2:]
        args = ["export", str(run), "--views", "pruned", "--format", "hf", "gguf", flag, *value]
        if flag == "--views":
            args = ["export", str(run), flag, *value]
        expected = {"--gguf-types": r"GGUF types \['F32', 'F32'\] names \['F32'\] more than once",
                    "--views": r"export views \['ghost', 'ghost'\] names \['ghost'\] more than once",
                    "--format": r"export formats \['hf', 'hf'\] names \['hf'\] more than once"}[flag]  # fmt: skip
    elif case.startswith("fit"):
        extra, expected = {
            "fit export.views": (["--export.views", "[ghost, ghost]"], r"export views \['ghost', 'ghost'\] names"),
            "fit export.gguf_types": (
                ["--export.views", "[pruned]", "--export.format", "[gguf]", "--export.gguf_types", "[Q8_0, Q8_0]"],
                r"GGUF types \['Q8_0', 'Q8_0'\] names \['Q8_0'\] more than once",
            ),
            "fit evaluation.views": (["--model.evaluation.views", "[ghost, ghost]"], r"evaluation.views \['ghost', "),
            "fit zeroshot tasks": (["--model.evaluation.zeroshot.tasks", "[piqa, piqa]"], r"tasks \['piqa', 'piqa'\]"),
            "fit lora target_modules": (
                ["--trainer.max_steps", "1", "--model.distill.methods", "[ghost]", "--model.distill.train", "[lora]",
                 "--model.distill.lora.target_modules", "[q_proj, q_proj]"],
                r"lora.target_modules \['q_proj', 'q_proj'\] names \['q_proj'\] more than once",
            ),
        }[case]  # fmt: skip
        args = _fit(tiny_dir, text_files, tmp_path, *extra)
    else:
        spec = {"frontier criteria": {"num_layers": [1, 2], "criteria": ["repair", "repair"]},
                "frontier greedy.views": {"num_layers": [1, 2], "criteria": ["greedy"],
                                          "greedy": {"views": ["ghost", "ghost"]}}}[case]  # fmt: skip
        args = ["frontier", _frontier(tmp_path, **spec)]
        expected = r"(criteria|greedy.views) \[.*\] names \['(repair|ghost)'\] more than once"
    line = cli_error_line(args, capsys, monkeypatch)
    assert re.search(expected, line), line
    assert not (tmp_path / "fit" / "calibration_state.pt").exists()


# ------------------------------------------------------------------------------------------------ disk full
def test_disk_full_during_fit_names_the_disk_and_the_file(tmp_path, tiny_dir, text_files, capsys, monkeypatch):
    """torch.save's zip writer on a nearly full disk says only `[enforce fail at inline_container.cc:672] .
    unexpected pos 2048 vs 1942`: the one line names the disk and the file that could not be written."""
    import shutil

    from ghostdistill.core import io

    def full(obj, f):
        f.write(b"x" * 100)
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 2048 vs 1942")

    monkeypatch.setattr(io.torch, "save", full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(io.shutil, "disk_usage", lambda path: usage._replace(free=4096))
    run = tmp_path / "fit"
    args = tiny_run_args(tiny_dir, text_files, run, "--calibration.checkpoint_every", "1")
    line = cli_error_line(args, capsys, monkeypatch)
    assert line.startswith(f"error: no space left on the disk of {run} (mounted at "), line
    assert f"4.0 KiB free) to write {run / 'calibration_state.pt'}: free space there or write elsewhere" in line
    assert "unexpected pos 2048 vs 1942" in line
    left = list(run.iterdir()) if run.exists() else []  # a run folder this run made, left empty, goes again
    assert not [p for p in left if p.name.endswith(".tmp")], "no half-written file is left"


# ------------------------------------------------------------------------------------------------------ locks
def test_lock_a_second_fit_into_a_run_folder_in_use_is_refused_naming_the_first(
    tmp_path, tiny_dir, text_files, capsys, monkeypatch
):
    from ghostdistill.core.lock import RUN_LOCK

    run = tmp_path / "fit"
    holder = _holder(run / RUN_LOCK)
    try:
        line = cli_error_line(_fit(tiny_dir, text_files, tmp_path), capsys, monkeypatch)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"{run} is in use by process {holder.pid} on " in line and "(another ghostdistill)" in line, line
    assert line.endswith(
        "wait for it to finish, or choose another trainer.default_root_dir  (GHOSTDISTILL_DEBUG=1 shows the traceback)"
    )
    assert sorted(p.name for p in run.iterdir()) == [RUN_LOCK], "the second fit wrote nothing"


def test_lock_a_second_export_of_a_target_in_use_is_refused_before_the_model_loads(
    tmp_path, tiny_dir, capsys, monkeypatch
):
    from ghostdistill.core.lock import lock_path

    _no_model_load(monkeypatch)
    run = _run_folder(tmp_path, tiny_dir)
    out = tmp_path / "out"
    (out / "pruned").mkdir(parents=True)
    holder = _holder(lock_path(out / "pruned"))
    try:
        args = ["export", str(run), "--views", "pruned", "--dir", str(out), "--overwrite"]
        line = cli_error_line(args, capsys, monkeypatch)
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    assert f"{out} is in use by process {holder.pid} on " in line and "wait for that export to finish" in line, line
