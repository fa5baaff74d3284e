"""SIGINT and SIGTERM stop a run within seconds in every phase and leave only complete files; rerunning the
same command resumes and completes. Each case runs `ghostdistill fit` on the tiny model in a subprocess
with the phase slowed down (`slow_phases.py`), signals it once the phase has started, and measures the
seconds to exit. An interrupted export leaves no folder (not even its temporary one); the rerun is
`ghostdistill export <run>`, from what the run saved.

With `SIGNAL_REPORT=<file>` every case appends its figures there as a JSON line (the table in docs/reliability.md).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from tiny_run import tiny_run_args

ROOT = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("slow_phases.py")

PHASE_ARGS = {
    "calibration": [],
    "fitting": [],
    "evaluation": [],
    "zeroshot": [
        "--model.evaluation.zeroshot.enabled",
        "true",
        "--model.evaluation.zeroshot.tasks",
        "[piqa]",
    ],
    "distillation": [
        "--trainer.max_steps",
        "4",
        "--model.distill.methods",
        "[ghost]",
        "--model.distill.checkpoint_every",
        "1",
    ],
    "export": ["--export.views", "[ghost]"],
}


def _args(tiny_dir, text_files, run: Path, phase: str) -> list[str]:
    return tiny_run_args(
        tiny_dir,
        text_files,
        run,
        "--calibration.checkpoint_every",
        "1",
        *PHASE_ARGS[phase],
    )


def _start(
    phase: str, args: list[str], slow_seconds: int, harness_args: list[str] | None = None
) -> tuple[subprocess.Popen, list[str], threading.Event]:
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "SLOW_SECONDS": str(slow_seconds),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen(
        [sys.executable, str(HARNESS), *(harness_args or [phase]), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
        cwd=ROOT,
        # A process that starts with SIGINT ignored keeps ignoring it (Python installs its KeyboardInterrupt
        # handler only over the default), and pytest-xdist's workers run with SIGINT ignored: give the run
        # the default a terminal gives it.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    lines: list[str] = []
    started = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if line.strip() == f"PHASE {phase}":
                started.set()

    threading.Thread(target=read, daemon=True).start()
    return proc, lines, started


def _files(run: Path) -> list[str]:
    return sorted(str(p.relative_to(run)) for p in run.rglob("*") if p.is_file())


def _complete(run: Path) -> None:
    """Every file the run left loads whole."""
    for path in run.rglob("*"):
        if not path.is_file():
            continue
        assert not path.name.endswith(".tmp"), f"half-written file left: {path}"
        if path.suffix in (".pt", ".ckpt"):
            torch.load(path, map_location="cpu", weights_only=False)
        elif path.suffix == ".json":
            json.loads(path.read_text())


CASES = [
    ("calibration", signal.SIGTERM),
    ("calibration", signal.SIGINT),
    ("fitting", signal.SIGTERM),
    ("evaluation", signal.SIGTERM),
    ("evaluation", signal.SIGINT),
    ("zeroshot", signal.SIGTERM),
    ("zeroshot", signal.SIGINT),
    ("distillation", signal.SIGTERM),
    ("distillation", signal.SIGINT),
    ("export", signal.SIGTERM),
    ("export", signal.SIGINT),
]


@pytest.mark.slow  # two tiny runs per case, 15-30 s each on 2 cores
@pytest.mark.parametrize("phase, signum", CASES, ids=[f"{p}-{s.name}" for p, s in CASES])
def test_a_signal_stops_the_run_within_seconds_and_the_rerun_resumes(phase, signum, tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    args = _args(tiny_dir, text_files, run, phase)
    proc, lines, started = _start(phase, args, slow_seconds=120)
    try:
        assert started.wait(180), "the phase never started:\n" + "".join(lines[-40:])
        time.sleep(0.5)  # inside the phase's work
        sent = time.monotonic()
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
        seconds = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines)
    assert code != 0, f"an interrupted run must not exit 0:\n{output[-3000:]}"
    assert seconds < 10, f"{signum.name} in {phase}: {seconds:.1f} s to exit"
    left = _files(run)
    _complete(run)
    if phase == "export":
        # The report is written before the export starts; the export left nothing behind.
        assert "results.json" in left
        assert not [f for f in left if f.startswith("export")], left
        assert not list(run.glob(".*tmp*")) and not list(run.glob("export/.*")), left
        _rerun_export(run, phase, signum, seconds, code, left)
        return
    assert "results.json" not in left

    extra = ["--ckpt_path", "last"] if phase == "distillation" else []
    rerun = subprocess.run(
        [sys.executable, str(HARNESS), phase, *args, *extra],
        capture_output=True,
        text=True,
        env={
            **os.environ,
            "SLOW_SECONDS": "0",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
        cwd=ROOT,
        timeout=600,
        check=False,
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    rerun_output = rerun.stdout + rerun.stderr
    results = json.loads((run / "results.json").read_text())
    assert results["views"]["ghost"]["metrics"]["held_out"]["ppl"] > 1
    resumed = {
        "calibration": "resuming calibration after 2/4 batches",
        "fitting": "resuming calibration after 4/4 batches",
        "evaluation": "resuming calibration after 4/4 batches",
        "zeroshot": "resuming calibration after 4/4 batches",
        "distillation": "Restoring states from the checkpoint",
    }[phase]
    assert resumed in rerun_output, rerun_output[-3000:]
    if phase == "distillation":
        assert results["distill"]["steps"] == 4
    if phase == "zeroshot":
        assert results["views"]["ghost"]["zeroshot"]["piqa"]["acc"] == 0.5

    _report(phase, signum, seconds, code, left, resumed)


def _rerun_export(run: Path, phase, signum, seconds, code, left) -> None:
    rerun = subprocess.run(
        [sys.executable, "-m", "ghostdistill", "export", str(run), "--views", "ghost"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
        check=False,
        env={
            **os.environ,
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    folder = run / "export" / "ghost"
    assert (folder / "config.json").is_file() and list(folder.glob("*.safetensors")), _files(run)
    _report(phase, signum, seconds, code, left, "ghostdistill export <run> --views ghost: complete folder")


def _report(phase, signum, seconds, code, left, resumed) -> None:
    report = os.environ.get("SIGNAL_REPORT")
    if report:
        with open(report, "a") as f:
            f.write(
                json.dumps(
                    {
                        "phase": phase,
                        "signal": signum.name,
                        "seconds": round(seconds, 2),
                        "exit_code": code,
                        "files": left,
                        "rerun": resumed,
                    }
                )
                + "\n"
            )


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory, tiny_dir, text_files) -> Path:
    from ghostdistill.cli import main

    run = tmp_path_factory.mktemp("signals") / "run"
    main(tiny_run_args(tiny_dir, text_files, run, "--model.evaluation.analysis", "false"))
    return run


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_during_the_export_command_leaves_nothing_and_says_so_in_one_line(signum, finished_run):
    """`ghostdistill export <run>` runs under the SIGTERM handling `fit` has: either signal stops it with one
    line (no traceback), removes the half-written temporary folder, and the rerun writes the whole folder."""
    run = finished_run
    shutil.rmtree(run / "export", ignore_errors=True)
    proc, lines, started = _start(
        "export", [], slow_seconds=120, harness_args=["export_command", "export", str(run), "--views", "ghost"]
    )
    try:
        assert started.wait(180), "the export never started:\n" + "".join(lines[-40:])
        time.sleep(0.5)
        assert list((run / "export").glob(".ghost.tmp-*")), "the temporary folder exists while it is written"
        proc.send_signal(signum)
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    time.sleep(0.2)  # the reader thread has the last lines
    output = "".join(lines)
    assert code == {signal.SIGTERM: 143, signal.SIGINT: 130}[signum], output[-3000:]
    assert "Traceback" not in output and f"({signum.name})" in output, output[-3000:]
    assert not list((run / "export").iterdir()), "a half-written export folder was left"
    _rerun_export(run, "export command", signum, 0.0, code, [])
