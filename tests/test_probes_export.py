"""The export probes of issue 53: a view the run flags "not to be shipped" exports with a warning (console and
model card), an `export` after `config.yaml` was edited says one consistent line, `--no-imatrix` needs only
llama-quantize, and an option of a format the export does not write is refused instead of ignored. Each test's
name says what it guards. (GGUF files a reader would misread: tests/export/test_gguf_readers.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from tiny_run import tiny_run_args

from ghostdistill.cli import entry, main
from ghostdistill.reporting.flags import view_flags

# A student trained two steps at a learning rate no one would use: worse than no repair (the run flags it).
BAD_STUDENT = ("--trainer.max_steps", "2", "--model.distill.methods", "[ghost]", "--model.distill.train",
               "[operators]", "--model.distill.lr", "50", "--model.distill.keep", "last")  # fmt: skip


def _one_line(args: list[str], capsys, monkeypatch) -> tuple[str, str]:
    """Run `ghostdistill <args>`: (the one `error:` line, last on stderr with exit status 2; all it printed)."""
    monkeypatch.setattr(sys, "argv", ["ghostdistill", *args])
    monkeypatch.delenv("GHOSTDISTILL_DEBUG", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        entry()
    captured = capsys.readouterr()
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert exit_info.value.code == 2, captured.err[-3000:]
    assert "Traceback" not in captured.err and lines and lines[-1].startswith("error: "), captured.err[-3000:]
    return lines[-1], captured.out + captured.err


def _no_run_read(monkeypatch) -> None:
    from ghostdistill.cli import export

    def never(*args, **kwargs):
        raise AssertionError("the run folder was read before the check")

    monkeypatch.setattr(export, "load_run_config", never)


# ------------------------------------------------------------------------------------------ flagged views
def test_flagged_view_exports_with_a_warning_on_the_console_and_in_the_card_from_fit_and_from_the_run(
    tiny_dir, text_files, tmp_path, recwarn, capsys
):
    run = tmp_path / "run"
    main(tiny_run_args(tiny_dir, text_files, run, *BAD_STUDENT, "--export.views", "[ghost_ft]"))
    flags = view_flags(json.loads((run / "results.json").read_text()), "ghost_ft")
    assert flags and flags[0].startswith("Warning: ghost_ft is worse than no repair."), flags  # the premise
    expected = f"exporting ghost_ft, which this run flags: {flags[0]}"
    # fit's export: a warning (Lightning's rank_zero_warn), and the card's Warnings section
    assert expected in [str(w.message) for w in recwarn], [str(w.message) for w in recwarn]
    assert f"## Warnings\n\n- {expected}\n" in (run / "export" / "ghost_ft" / "README.md").read_text()
    # `export <run>`: the same line on the console, and in the card
    capsys.readouterr()
    main(["export", str(run), "--views", "ghost_ft", "--dir", str(tmp_path / "again")])
    assert f"warning: {expected}" in capsys.readouterr().out
    assert f"## Warnings\n\n- {expected}\n" in (tmp_path / "again" / "ghost_ft" / "README.md").read_text()


def test_a_view_the_run_does_not_flag_exports_without_warnings(tiny_dir, text_files, tmp_path, capsys):
    run = tmp_path / "run"
    main(tiny_run_args(tiny_dir, text_files, run))
    assert view_flags(json.loads((run / "results.json").read_text()), "ghost") == []
    capsys.readouterr()
    main(["export", str(run), "--views", "ghost", "--dir", str(tmp_path / "out")])
    assert "warning:" not in capsys.readouterr().out
    assert "## Warnings" not in (tmp_path / "out" / "ghost" / "README.md").read_text()


# --------------------------------------------------------------------------------------- an edited config
def test_export_after_config_yaml_was_edited_says_one_line_and_never_calibrating_from_scratch(
    tiny_dir, text_files, tmp_path, capsys, monkeypatch, caplog
):
    run = tmp_path / "run"
    main(tiny_run_args(tiny_dir, text_files, run))
    config = run / "config.yaml"
    text = config.read_text()
    assert text.count("num_samples: 16") == 1
    config.write_text(text.replace("num_samples: 16", "num_samples: 12"))
    capsys.readouterr()
    line, printed = _one_line(
        ["export", str(run), "--views", "ghost", "--dir", str(tmp_path / "out")], capsys, monkeypatch
    )
    assert line.startswith(
        f"error: {run / 'calibration_state.pt'} does not hold this run's complete statistics: it belongs to other "
        f"settings (model, plan, calibration data or methods) than {config} gives now (was config.yaml edited after "
        "the fit?): restore config.yaml, or run `fit` with it again"
    ), line
    assert "calibrating from scratch" not in printed + caplog.text
    assert not (tmp_path / "out" / "ghost").exists()


# ------------------------------------------------------------------------------------------- --no-imatrix
def _llama_cpp(tmp_path: Path, tools: list[str]) -> Path:
    """A llama.cpp build folder holding only `tools` (stubs: only their presence is checked before work)."""
    root = tmp_path / "llama.cpp"
    (root / "bin").mkdir(parents=True)
    for tool in tools:
        path = root / "bin" / tool
        path.write_text("#!/bin/sh\nexit 1\n")
        path.chmod(0o755)
    return root


def test_no_imatrix_needs_only_llama_quantize(tmp_path, monkeypatch):
    from ghostdistill.export.quantize import ENV, check_quantize

    monkeypatch.setenv(ENV, str(_llama_cpp(tmp_path, ["llama-quantize"])))
    check_quantize(["Q4_K_M"], imatrix=False)  # llama-imatrix and llama-tokenize are not asked for
    with pytest.raises(FileNotFoundError, match=r"and llama-imatrix, llama-tokenize are not built in "):
        check_quantize(["Q4_K_M"], imatrix=True)


def test_no_imatrix_export_gets_past_the_tool_check_with_llama_quantize_alone(tmp_path, capsys, monkeypatch):
    """The command reaches the run folder (which does not exist): no tool was demanded on the way."""
    from ghostdistill.export.quantize import ENV

    monkeypatch.setenv(ENV, str(_llama_cpp(tmp_path, ["llama-quantize"])))
    args = ["export", str(tmp_path / "no_run"), "--views", "pruned", "--format", "gguf", "--gguf-types", "Q4_K_M"]
    line, _ = _one_line([*args, "--no-imatrix"], capsys, monkeypatch)
    assert line.startswith(f"error: run folder {tmp_path / 'no_run'} does not exist"), line
    line, _ = _one_line(args, capsys, monkeypatch)
    assert "llama-imatrix, llama-tokenize are not built" in line, line


# ------------------------------------------------------------------------------------------ ignored options
@pytest.mark.parametrize(
    "options, message",
    [
        (["--format", "hf", "--gguf-types", "Q8_0"],
         "--gguf-types applies to --format gguf only, and the formats are ['hf']: add gguf to --format, or drop "
         "--gguf-types"),
        (["--gguf-types", "Q8_0"], "--gguf-types applies to --format gguf only, and the formats are ['hf']"),
        (["--format", "hf", "--no-imatrix"], "--no-imatrix applies to --format gguf only"),
        (["--format", "gguf", "--gguf-types", "F16", "Q8_0", "--no-imatrix"],
         "--no-imatrix applies to llama-quantize's GGUF types (Q4_K_M, Q6_K, ...) only, and --gguf-types ['F16', "
         "'Q8_0'] has none: drop --no-imatrix, or add one of"),
        (["--format", "gguf", "--schemes", "W8A8"], "--schemes applies to --format compressed-tensors only"),
        (["--quantize-python", "/usr/bin/python3"], "--quantize-python applies to --format compressed-tensors only"),
    ],
)  # fmt: skip
def test_ignored_option_of_a_format_not_asked_for_is_refused_before_the_run_is_read(
    options, message, tmp_path, capsys, monkeypatch
):
    _no_run_read(monkeypatch)
    monkeypatch.setenv("GHOSTDISTILL_LLAMA_CPP", str(tmp_path / "none"))
    line, _ = _one_line(["export", str(tmp_path), "--views", "pruned", *options], capsys, monkeypatch)
    assert line.startswith(f"error: {message}"), line


def test_ignored_option_in_a_fit_config_is_refused_before_any_work(tiny_dir, text_files, tmp_path, capsys, monkeypatch):
    from ghostdistill.pipeline import run as run_module

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the check")

    monkeypatch.setattr(run_module, "load_model", never)
    args = tiny_run_args(tiny_dir, text_files, tmp_path / "fit", "--export.views", "[pruned]",
                         "--export.gguf_types", "[Q8_0]")  # fmt: skip
    line, _ = _one_line(args, capsys, monkeypatch)
    assert line.startswith(
        "error: export.gguf_types applies to export.format gguf only, and the formats are ['hf']: add gguf to "
        "export.format, or drop export.gguf_types"
    ), line
    assert not (tmp_path / "fit" / "calibration_state.pt").exists()
