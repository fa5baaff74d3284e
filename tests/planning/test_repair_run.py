"""`criterion: repair` through `fit`: the plan's candidates in results.json, results.md and plan.png, the
selection windows checked like the other held-out windows."""

from __future__ import annotations

import json

import pytest
from tiny_run import repair_args

from ghostdistill.cli import main


def test_a_repair_plan_reports_every_candidate(tiny_dir, text_files, tmp_path):
    main(repair_args(tiny_dir, text_files, tmp_path / "run", "--model.plan.repair_method", "linearpatch"))
    report = json.loads((tmp_path / "run" / "results.json").read_text())
    plan = report["plan"]
    assert plan["chosen_by"] == "repair (linearpatch)"
    rows = plan["candidates"]
    assert len(rows) == 4  # 6 blocks, the first and last protected
    best = min(rows.values(), key=lambda r: (r["repaired_kl"], r["start"]))
    assert plan["removed"] == [best["start"]]
    for row in rows.values():
        assert {"cosine", "pruned_kl", "repaired_kl", "repaired_top1"} <= set(row)
    assert plan["costs"]["streamline_s"] > 0 and plan["costs"]["relative_to_streamline"] > 1
    assert report["evaluation"]["selection"]["windows"] == 4
    md = (tmp_path / "run" / "results.md").read_text()
    assert "## Plan candidates (repair (linearpatch))" in md and "**(chosen)**" in md
    assert (tmp_path / "run" / "plan.png").is_file()


def test_a_greedy_plan_reports_its_steps(tiny_dir, text_files, tmp_path):
    main(repair_args(tiny_dir, text_files, tmp_path / "run", criterion="repair_greedy"))
    report = json.loads((tmp_path / "run" / "results.json").read_text())
    assert report["plan"]["chosen_by"] == "repair_greedy (ghost)"
    assert list(report["plan"]["candidates"]) == ["step 1"]
    assert "| step | block kept |" in (tmp_path / "run" / "results.md").read_text()


def test_a_greedy_run_takes_its_first_steps_from_a_run_of_the_same_settings(tiny_dir, text_files, tmp_path):
    """`plan.greedy_from`: a deeper greedy run starts after a shallower one's steps and chooses what the
    search from scratch chooses; a run of other settings, or of another criterion, is refused by name."""
    main(repair_args(tiny_dir, text_files, tmp_path / "one", criterion="repair_greedy"))
    deeper = ["--model.plan.num_layers", "2"]
    main(repair_args(tiny_dir, text_files, tmp_path / "scratch", *deeper, criterion="repair_greedy"))
    from_one = [*deeper, "--model.plan.greedy_from", str(tmp_path / "one")]
    main(repair_args(tiny_dir, text_files, tmp_path / "taken", *from_one, criterion="repair_greedy"))
    scratch, taken, one = (
        json.loads((tmp_path / name / "results.json").read_text())["plan"] for name in ("scratch", "taken", "one")
    )
    assert taken["removed"] == scratch["removed"]
    assert taken["candidates"]["step 1"] == {**one["candidates"]["step 1"], "reused": True}
    assert taken["candidates"]["step 2"]["kept"] == scratch["candidates"]["step 2"]["kept"]
    assert taken["costs"]["reused_steps"] == 1 and taken["costs"]["selection_forwards"] == 3
    assert "| 1 (taken) |" in (tmp_path / "taken" / "results.md").read_text()
    other = [*from_one, "--model.plan.criterion_samples", "2"]
    with pytest.raises(ValueError, match="was run with other settings than this run"):
        main(repair_args(tiny_dir, text_files, tmp_path / "other", *other, criterion="repair_greedy"))
    main(repair_args(tiny_dir, text_files, tmp_path / "contiguous"))
    not_greedy = [*deeper, "--model.plan.greedy_from", str(tmp_path / "contiguous" / "results.json")]
    with pytest.raises(ValueError, match=r"its plan was chosen by 'repair \(ghost\)', not repair_greedy"):
        main(repair_args(tiny_dir, text_files, tmp_path / "bad", *not_greedy, criterion="repair_greedy"))
    with pytest.raises(FileNotFoundError, match="name the folder .* of a finished repair_greedy run"):
        main(
            repair_args(
                tiny_dir,
                text_files,
                tmp_path / "bad",
                *deeper,
                "--model.plan.greedy_from",
                str(tmp_path / "none"),
                criterion="repair_greedy",
            )
        )


def test_repair_without_selection_windows_fails_before_the_model_loads(tiny_dir, text_files, tmp_path):
    with pytest.raises(ValueError, match="set data.selection.source"):
        main(repair_args(tiny_dir, text_files, tmp_path / "run", selection=False))
    assert not (tmp_path / "run" / "calibration_state.pt").exists()


def test_selection_windows_overlapping_calibration_are_refused(tiny_dir, text_files, tmp_path):
    args = repair_args(tiny_dir, text_files, tmp_path / "run", selection=False)
    args += ["--data.selection.source", json.dumps({"source": str(text_files["jsonl_gz"])})]
    args += ["--data.selection.num_windows", "400", "--data.selection.seq_len", "32"]
    with pytest.raises(ValueError, match="selection windows .* overlap the calibration windows"):
        main(args)
