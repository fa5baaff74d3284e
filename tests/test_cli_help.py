"""What a user sees of the command line: the commands and their help, one-line errors with exit status 2,
and checks that need only the tokenizer made before any calibration work."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_run import tiny_run_args

from ghostdistill.cli import COMMANDS, main

ROOT = Path(__file__).resolve().parents[1]


def _exit_code(args, capsys) -> tuple[int, str]:
    with pytest.raises(SystemExit) as exit_info:
        main(args)
    out = capsys.readouterr()
    return exit_info.value.code or 0, out.out + out.err


def test_top_level_help_lists_the_commands_a_user_has(capsys):
    code, text = _exit_code(["--help"], capsys)
    assert code == 0
    for command in ("fit", "compare", "export", "frontier"):
        assert f"  {command} " in text
    for hidden in ("validate", "predict"):
        assert hidden not in text
    assert set(COMMANDS) == {"fit", "compare", "export", "frontier"}


@pytest.mark.parametrize("command", ["fit", "compare", "export", "frontier"])
def test_every_help_exits_0(command, capsys):
    code, text = _exit_code([command, "--help"], capsys)
    assert code == 0 and "usage:" in text.lower()


def test_an_unknown_command_is_named(capsys):
    code, text = _exit_code(["fitt"], capsys)
    assert code == 2 and "unknown command 'fitt'" in text


def _cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ghostdistill", *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def test_bad_input_is_one_line_and_exit_2_and_the_traceback_is_behind_a_variable(tmp_path):
    missing = tmp_path / "no_such_run"
    result = _cli("export", str(missing), "--views", "ghost", env={"GHOSTDISTILL_DEBUG": ""})
    assert result.returncode == 2, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and str(missing) in lines[0], result.stderr
    assert "Traceback" not in result.stderr
    debug = _cli("export", str(missing), "--views", "ghost", env={"GHOSTDISTILL_DEBUG": "1"})
    assert debug.returncode != 0 and "Traceback" in debug.stderr and "FileNotFoundError" in debug.stderr


@pytest.mark.slow  # one process start with the tiny model, about 15 s
def test_a_window_longer_than_the_text_fails_before_any_calibration_text_is_generated(tiny_dir, text_files, tmp_path):
    """The demo calibrates on text the model writes itself (minutes at real size): a bad evaluation window length
    must fail before that, from the tokenizer alone."""
    run = tmp_path / "run"
    args = tiny_run_args(tiny_dir, text_files, run, "--data.evaluation.seq_len", "100000", calibration_source=False)
    result = _cli(*args)
    assert result.returncode == 2, result.stderr[-2000:]
    error = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert error and "seq_len=100000" in error[0], result.stderr[-2000:]
    assert not list(run.glob("generated_calibration_*.pt")), "calibration text was generated before the check"


def test_a_window_longer_than_the_position_limit_is_warned_about(tiny_dir, text_files, tmp_path):
    # The tiny model's max_position_embeddings is 512; its evaluation text holds windows of 600 tokens.
    with pytest.warns(UserWarning, match=r"evaluation.seq_len 600 is longer than the model's position limit"):
        main(
            tiny_run_args(
                tiny_dir,
                text_files,
                tmp_path / "run",
                "--data.evaluation.seq_len",
                "600",
                "--model.evaluation.analysis",
                "false",
                eval_windows=1,
            )
        )
