"""What results.md and the console show about results that are not to be trusted: a rank-deficient fit is
flagged beside the table with what to do, and a run that scored nothing shows no table at all."""

from __future__ import annotations

import logging

import pytest
from tiny_run import tiny_run_args

from ghostdistill.cli import main
from ghostdistill.lit.module import GhostDistill
from ghostdistill.reporting.flags import view_warnings
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


def _views(**ppl_kl_params) -> dict:
    return {
        view: {"params": params, "metrics": {"wiki": {"ppl": ppl, "tokens": 10, **({"kl": kl} if kl else {})}}}
        for view, (ppl, kl, params) in ppl_kl_params.items()
    }


def test_wrong_model_worse_than_pruned_and_larger_than_dense_views_are_flagged_by_name():
    """Issue 39: a view that scores worse than the pruned model (no repair) on the first evaluation source, in
    perplexity or KL, or holds more parameters than the dense model, is flagged under the table with a line
    naming it; so is a fit whose method's assumption did not hold (its `notes`)."""
    report = {
        "views": _views(
            dense=(30.0, None, 268e6),
            pruned=(292.48, 2.0, 200e6),
            ghost=(141.75, 1.2, 201e6),
            rotation_anchored=(5143.98, 4.0, 200e6),
            linearpatch=(250.0, 2.1, 201e6),
            rotation_through=(150.0, 1.3, 419.1e6),
        ),
        "recovery": {
            "ghost": {"method": "ghost"},
            "rotation_anchored": {"method": "rotation_anchored", "notes": ["gap 2-3: the first position ..."]},
            "linearpatch": {"method": "linearpatch"},
            "rotation_through": {"method": "rotation_through"},
        },
    }
    lines = view_warnings(report)
    assert lines[0] == (
        "**Warning: rotation_anchored is worse than no repair.** On wiki its perplexity 5143.98 against pruned's "
        "292.48 and KL 4.000 against pruned's 2.000: removing the blocks and doing nothing does better, so "
        "rotation_anchored is not to be shipped."
    )
    assert lines[1].startswith("**Warning: linearpatch is worse than no repair.** On wiki its KL 2.100 against")
    assert lines[2] == (
        "**Warning: rotation_through is larger than the dense model.** 419.1M parameters against the dense model's "
        "268.0M (the folded rotation unties the tied embedding: the head becomes its own vocabulary × hidden "
        "matrix): removing blocks saves nothing here."
    )
    assert lines[3] == "**Note: rotation_anchored (rotation_anchored).** Gap 2-3: the first position ...."
    assert len(lines) == 4, "ghost is better than pruned and smaller than dense: not flagged"
    markdown = render_markdown({**report, "plan": {}, "calibration": {}, "evaluation": {}})
    assert all(line in markdown for line in lines)
    good = {"views": _views(dense=(30.0, None, 2), pruned=(60.0, 1.0, 1), ghost=(40.0, 0.5, 1)), "recovery": {}}
    assert view_warnings(good) == []


def test_wrong_model_a_worse_than_pruned_view_is_flagged_on_the_console_and_in_results_md(
    tiny_dir, text_files, tmp_path, caplog, monkeypatch
):
    """End to end: the flag reaches results.md and the console, naming the view. (The tiny model's repairs all beat
    pruning, so ghost's operator is made harmful here: a large random M.)"""
    from ghostdistill.pipeline import run as run_module

    real = run_module.Run.calibrate

    def calibrate(self, *args, **kwargs):
        real(self, *args, **kwargs)
        import torch

        with torch.no_grad():
            for op in self.pruned.operators["ghost"].values():
                op.delta.normal_(0, 3.0, generator=torch.Generator().manual_seed(0))

    monkeypatch.setattr(run_module.Run, "calibrate", calibrate)
    run = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        main(tiny_run_args(tiny_dir, text_files, run, "--model.evaluation.analysis", "false"))
    flag = "**Warning: ghost is worse than no repair.** On held_out its "
    assert flag in (run / "results.md").read_text() and flag in caplog.text
