"""What results.md and the console show about results that are not to be trusted: a rank-deficient fit is
flagged beside the table with what to do, and a run that scored nothing shows no table at all."""

from __future__ import annotations

import logging

import pytest
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.lit.module import GhostDistill
from ghostdistill.reporting.results import check_scored, rank_warning, render_markdown


def _report(tokens: int, hidden: int = 64, scored: int = 10) -> dict:
    metrics = {"held_out": {"ppl": 1.0 if not scored else 5.0, "tokens": scored}}
    return {
        "calibration": {"tokens": tokens, "hidden_size": hidden},
        "recovery": {"ghost": {"method": "ghost"}, "none": {"method": "none"}},
        "views": {"dense": {"params": 1, "metrics": metrics}, "ghost": {"params": 1, "metrics": metrics}},
    }


def test_a_rank_deficient_fit_is_flagged_with_what_to_do():
    assert rank_warning(_report(tokens=64)) == ""
    warning = rank_warning(_report(tokens=32))
    assert "rank-deficient fit" in warning and "32 calibration tokens for hidden size 64" in warning
    assert "operators of ghost are" in warning and "at least 64 tokens" in warning
    assert warning in render_markdown(_report(tokens=32))
    assert "rank-deficient" not in render_markdown(_report(tokens=640))
    assert (
        rank_warning({"calibration": {"tokens": 3, "hidden_size": 64}, "recovery": {"none": {"method": "none"}}}) == ""
    )


def test_nothing_scored_is_an_error():
    check_scored(_report(tokens=64))
    with pytest.raises(ValueError, match=r"scored no tokens \(sources \['held_out'\]"):
        check_scored(_report(tokens=64, scored=0))
    with pytest.raises(ValueError, match="scored no tokens"):
        check_scored({"views": {}})


def test_a_fit_on_too_few_tokens_says_so_in_results_md_and_on_the_console(tiny_dir, text_files, tmp_path, caplog):
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        main(tiny_run_args(tiny_dir, text_files, run, "--model.evaluation.analysis", "false", samples=1))
    warning = "32 calibration tokens for hidden size 64"
    assert warning in (run / "results.md").read_text()
    assert warning in caplog.text and "| ghost |" in caplog.text


def test_a_run_that_scored_nothing_fails_and_writes_no_table(tiny_dir, text_files, tmp_path, monkeypatch):
    monkeypatch.setattr(GhostDistill, "test_step", lambda self, *a, **k: None)
    run = tmp_path / "run"
    with pytest.raises(ValueError, match="the evaluation scored no tokens"):
        main(tiny_run_args(tiny_dir, text_files, run, "--model.evaluation.analysis", "false"))
    assert not (run / "results.json").exists() and not (run / "results.md").exists()
