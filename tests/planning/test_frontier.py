"""The frontier (`python -m ghostdistill frontier`): per depth, every view on streamline's plan and on its
own repair-aware plan; resumable per depth; several methods scored from one pass as each alone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import random_batches, tiny_model
from tiny_run import frontier_file

from ghostdistill.cli import main
from ghostdistill.methods import RecoveryConfig
from ghostdistill.planning import PlanConfig, score_runs
from ghostdistill.reporting.frontier import best_by_depth, flat_rows, shipping


def test_the_frontier_reports_every_view_and_criterion_per_depth_and_resumes(
    tmp_path, tiny_dir, text_files, monkeypatch, capsys
):
    path, overrides = frontier_file(tmp_path, tiny_dir, text_files, {"first": 1, "last": 2})
    root = main(["frontier", str(path), *overrides])
    report = json.loads((root / "frontier.json").read_text())
    assert [p["n"] for p in report["points"]] == [1, 2]
    for point in report["points"]:
        rows = {(r["criterion"], r["view"]): r for r in point["rows"] if r["view"] != "dense"}
        assert set(rows) == {(c, v) for c in ("streamline", "repair") for v in ("pruned", "ghost", "linearpatch")}
        cands = point["candidates"]
        best_cos = max(cands.values(), key=lambda r: r["cosine"])["start"]
        for view in ("pruned", "ghost", "linearpatch"):
            assert rows[("streamline", view)]["removed"][0] == best_cos
            # The repair-aware plan is the view's lowest selection KL, so never above streamline's.
            assert rows[("repair", view)]["selection_kl"] <= rows[("streamline", view)]["selection_kl"]
            assert len(rows[("repair", view)]["removed"]) == point["n"]
    for point in report["points"]:
        assert len([r for r in point["rows"] if r["view"] == "dense"]) == 1
    md = (root / "frontier.md").read_text()
    assert "| blocks removed | criterion | view |" in md and (root / "frontier.png").is_file()
    # The summary: a line per depth, a column per view and criterion, each cell the perplexity and the blocks.
    flat = [r for r in report["rows"] if r["view"] != "dense"]
    header = "| blocks removed | pruned (streamline) | pruned (repair) | ghost (streamline) | ghost (repair) | "
    assert header + "linearpatch (streamline) | linearpatch (repair) |" in md
    for n in (1, 2):
        line = next(x for x in md.splitlines() if x.startswith(f"| {n} | ") and x.count("|") == 8)
        mine = [r for r in flat if r["blocks_removed"] == n]
        best = min(mine, key=lambda r: r["ppl"])
        assert f"**{best['ppl']:.2f} ({best['removed']})**" in line, line
        assert all(f"{r['ppl']:.2f} ({r['removed']})" in line for r in mine), line
    assert len((root / "frontier.csv").read_text().splitlines()) == 1 + 1 + 2 * 6
    # What can be shipped: here only the pruned model is stock (ghost and linearpatch keep operators).
    assert {r["view"] for r in flat if r["stock"]} == {"pruned"}
    for n in (1, 2):
        pruned = min((r for r in flat if r["blocks_removed"] == n and r["stock"]), key=lambda r: r["ppl"])
        line = next(x for x in md.splitlines() if x.startswith(f"| {n} | pruned ("))
        assert f"| {pruned['ppl']:.2f} | " in line and line.count("|") == 8, line

    # Resumed: every depth is read back, none computed again.
    import ghostdistill.pipeline.frontier as frontier

    def fail(*args, **kwargs):
        raise AssertionError("a finished depth was computed again")

    monkeypatch.setattr(frontier, "frontier_point", fail)
    main(["frontier", str(path), *overrides])
    # A saved depth without a setting whose value is None (a field added after it was written) is still reused;
    # one computed with another value of a setting is computed again.
    saved_path = root / "points" / "n_01.json"
    saved = json.loads(saved_path.read_text())
    assert saved["settings"]["config"]["plan"]["greedy_start"] is None
    del saved["settings"]["config"]["plan"]["greedy_start"]
    saved_path.write_text(json.dumps(saved))
    main(["frontier", str(path), *overrides])
    saved["settings"]["config"]["data"]["calibration"]["num_samples"] += 1
    saved_path.write_text(json.dumps(saved))
    with pytest.raises(AssertionError, match="computed again"):
        main(["frontier", str(path), *overrides])
    # Edited by hand (issue 39): rows that are not rows, or a depth that is not its file's, are not read back.
    saved["settings"]["config"]["data"]["calibration"]["num_samples"] -= 1
    for edit, why in ((("rows", "oops"), "its rows are str 'oops', not a list"), (("n", 5), "says n = 5")):
        saved_path.write_text(json.dumps({**saved, edit[0]: edit[1]}))
        capsys.readouterr()
        with pytest.raises(AssertionError, match="computed again"):
            main(["frontier", str(path), *overrides])
        out = capsys.readouterr().out
        assert f"frontier n=1: {saved_path} " in out and why in out and "computing it again" in out, out[-2000:]


def test_late_check_a_saved_point_is_checked_when_read_back(tmp_path):
    """A hand-edited point file (issue 39) is computed again, saying why, never read as it is: rows that are
    not a list, a row of another depth, metrics without a perplexity, an `n` that is not its file's, or not
    JSON at all."""
    from ghostdistill.reporting.frontier_spec import read_point

    row = {"n": 1, "criterion": "repair", "view": "ghost", "method": "ghost", "removed": [2], "selection_kl": 0.1,
           "params": 10, "metrics": {"wiki": {"ppl": 5.0}}}  # fmt: skip
    dense = {**row, "n": 0, "view": "dense", "removed": [], "selection_kl": None}
    path = tmp_path / "n_01.json"
    cases = [
        ({"n": 1, "rows": [dense, row]}, None),
        ({"n": 1, "rows": "oops"}, "its rows are str 'oops', not a list"),
        ({"n": 5, "rows": [dense, row]}, "says n = 5, but it is the file of depth 1"),
        ({"n": True, "rows": [dense, row]}, "says n = True"),
        ({"n": 1, "rows": [{**row, "n": 3}]}, "row 0, ghost, is of depth 3, not 1"),
        ({"n": 1, "rows": [{**row, "metrics": {"wiki": {"ppl": "x"}}}]}, "row 0, ghost: metrics"),
        ({"n": 1, "rows": [{"view": "ghost"}]}, "row 0 lacks ['criterion'"),
    ]
    for saved, why in cases:
        path.write_text(json.dumps(saved))
        point, problem = read_point(path, 1)
        assert (point is None) == (why is not None) and (why is None or why in problem), (saved, problem)
    path.write_text('{"n": 1, "rows": [')
    assert "cannot be read back" in read_point(path, 1)[1] and "is not valid JSON" in read_point(path, 1)[1]


def test_wrong_model_frontier_never_recommends_a_view_worse_than_no_repair_or_larger_than_dense():
    """Issue 39: the shipping table, the bold of the summary and the students' starts pass over a view worse than
    the pruned model at its depth (on the evaluation source; for the starts, the selection KL) or with more
    parameters than the dense model; frontier.md names each such row and why."""
    from ghostdistill.reporting.frontier import markdown, pivot, student_starts

    def row(n, view, method, ppl, params=100e6, kl=0.3):
        return {"n": n, "criterion": "repair", "view": view, "method": method, "removed": list(range(3, 3 + n)),
                "selection_kl": kl, "params": params, "metrics": {"wiki": {"ppl": ppl}}, "stock": view != "ghost"}  # fmt: skip

    point = {"n": 2, "rows": [row(0, "dense", "dense", 30.0, 200e6, None), row(2, "pruned", "pruned", 60.0, kl=0.5),
                              row(2, "rotation_anchored", "rotation_anchored", 70.0, kl=0.6),
                              row(2, "rotation_through", "rotation_through", 40.0, 250e6, kl=0.2),
                              row(2, "ghost", "ghost", 90.0, kl=0.7), row(2, "magnitude", "magnitude", 55.0, kl=0.4)],
             "costs": {"planning_s": 1.0, "evaluation_s": 1.0}}  # fmt: skip
    rows = flat_rows([point])
    best = best_by_depth(rows, "wiki")
    # rotation_through is the lowest perplexity but larger than the dense model; ghost is worse than pruned.
    assert best[2][True]["view"] == "magnitude" and False not in best[2]
    line = next(x for x in pivot(rows, "wiki") if x.startswith("| 2 |"))
    assert "**55.00" in line and "**40.00" not in line
    md = markdown([point], {"base": "b", "num_layers": [2], "criteria": ["repair"]})
    assert "- n=2, repair: ghost is worse than no repair (PPL 90.00 against pruned's 60.00)" in md
    assert "- n=2, repair: rotation_anchored is worse than no repair (PPL 70.00 against pruned's 60.00)" in md
    assert "- n=2, repair: rotation_through is larger than the dense model (250.0M parameters against 200.0M)" in md
    # Students start from the best stock and operator views by selection KL, never from those.
    assert {k: r["view"] for k, r in student_starts(point).items()} == {"stock": "magnitude"}


def test_the_shipping_table_sets_the_best_stock_point_beside_the_best_with_operators():
    def row(n, view, method, ppl, params=100e6, criterion="repair"):
        return {"n": n, "criterion": criterion, "view": view, "method": method, "removed": list(range(3, 3 + n)),
                "selection_kl": 0.1, "params": params, "metrics": {"wiki": {"ppl": ppl}}}  # fmt: skip

    points = [
        {"n": 2, "rows": [row(0, "dense", "dense", 30.0, 200e6), row(2, "pruned", "pruned", 60.0),
                          row(2, "rotation_anchored", "rotation_anchored", 45.0, 130e6), row(2, "ghost", "ghost", 40.0),
                          row(2, "magnitude", "magnitude", 50.0, criterion="streamline")]},
        {"n": 3, "rows": [row(3, "pruned", "pruned", 90.0), row(3, "ghost", "ghost", 70.0)]},
    ]  # fmt: skip
    rows = flat_rows(points)  # rows without a `stock` flag (as points written before it): from the method
    assert {r["view"]: r["stock"] for r in rows} == {
        "dense": True, "pruned": True, "rotation_anchored": True, "ghost": False, "magnitude": True
    }  # fmt: skip
    best = best_by_depth(rows, "wiki")
    assert best[2][True]["view"] == "rotation_anchored" and best[2][False]["view"] == "ghost"
    assert best[3][True]["view"] == "pruned" and best[3][False]["ppl"] == 70.0
    lines = shipping(rows, "wiki")
    assert lines[2] == "| 2 | rotation_anchored (repair, 3-4) | 130.0M | 45.00 | ghost (repair, 3-4) | 100.0M | 40.00 |"
    assert lines[3] == "| 3 | pruned (repair, 3-5) | 100.0M | 90.00 | ghost (repair, 3-5) | 100.0M | 70.00 |"


def test_bad_frontier_files_are_refused(tmp_path):
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump({"base": "configs/smollm2_demo.yaml", "num_layers": [0, 2]}))
    with pytest.raises(ValueError, match="must name depths: integers >= 1"):
        main(["frontier", str(path)])
    path.write_text(yaml.safe_dump({"base": "configs/smollm2_demo.yaml", "num_layers": [2], "criteria": ["cosine"]}))
    with pytest.raises(ValueError, match="choose among streamline, repair"):
        main(["frontier", str(path)])
    path.write_text(yaml.safe_dump({"base": "configs/smollm2_demo.yaml", "num_layer": [2]}))
    with pytest.raises(ValueError, match="unknown keys"):
        main(["frontier", str(path)])


def test_several_methods_from_one_pass_score_as_each_alone():
    model = tiny_model("llama", num_layers=6)
    batches, selection = random_batches(n=2), random_batches(n=1, seed=7)
    cfgs = [RecoveryConfig(), RecoveryConfig(name="lp", method="linearpatch")]
    plan = PlanConfig(criterion="repair", num_layers=2)
    both = score_runs(plan, cfgs, model, model.model, batches, selection)
    for cfg in cfgs:
        alone = score_runs(plan, [cfg], model, model.model, batches, selection)
        for i, row in alone.rows.items():
            assert both.rows[i][f"{cfg.name}_kl"] == pytest.approx(row[f"{cfg.name}_kl"], rel=1e-5, abs=1e-9)
    assert both.costs["dense_passes"] == 1


def _students_file(tmp_path, tiny_dir, text_files, **students):
    path, overrides = frontier_file(tmp_path, tiny_dir, text_files, [2])
    spec = yaml.safe_load(path.read_text())
    spec["students"] = {
        "config": "configs/smollm2_demo.yaml",
        "stock": {"name": "stock_ft", "train": ["operators", "lora"]},
        "operators": {"name": "ops_ft", "train": ["operators"]},
        "overrides": ["--trainer.max_steps", "2", "--model.distill.lr", "1e-2", "--model.distill.keep", "last"],
        **students,
    }
    path.write_text(yaml.safe_dump(spec))
    # A stock repair beside the operator one: rotation_anchored folds, ghost keeps its operators.
    recovery = [{"name": "ghost"}, {"name": "ra", "method": "rotation_anchored"}]
    return path, [*overrides, "--model.recovery", json.dumps(recovery)]


def test_the_frontier_fine_tunes_the_best_stock_and_operator_views_per_depth_and_resumes(
    tmp_path, tiny_dir, text_files, monkeypatch
):
    """With `students`, each depth's best stock repair and best operator view (lowest selection KL) start
    a student each on their own plan; frontier.md's shipping table gains the fine-tuned columns; a second call
    reads every student back (none trained again)."""
    path, overrides = _students_file(tmp_path, tiny_dir, text_files)
    root = main(["frontier", str(path), *overrides])
    report = json.loads((root / "frontier.json").read_text())
    (point,) = report["points"]
    rows = [r for r in point["rows"] if r["view"] not in ("dense", "pruned")]
    kl = lambda r: r["selection_kl"]  # noqa: E731
    best = {
        "stock": min((r for r in rows if r["stock"]), key=kl),
        "operators": min((r for r in rows if not r["stock"]), key=kl),
    }
    assert best["stock"]["view"] == "ra" and best["operators"]["view"] == "ghost"
    students = {s["kind"]: s for s in report["students"]}
    assert set(students) == {"stock", "operators"}
    for kind, name in (("stock", "stock_ft"), ("operators", "ops_ft")):
        s = students[kind]
        assert (s["view"], s["from"], s["stock"], s["steps"]) == (name, best[kind]["view"], kind == "stock", 2)
        assert s["removed"] == best[kind]["removed"], "the student trains on its start view's own plan"
        run = json.loads((Path(s["run"]) / "results.json").read_text())
        assert run["distill"]["students"][0]["method"] == best[kind]["view"]
        assert s["metrics"]["held_out"]["ppl"] != s["start_metrics"]["held_out"]["ppl"], "it trained"
        assert Path(s["run"]).parent == root / "students" and Path(s["run"]).name.startswith(f"n_02_{kind}-")
    # The shipping table: each training-free best beside its fine-tuned answer.
    md = (root / "frontier.md").read_text()
    line = next(x for x in md.splitlines() if x.startswith("| 2 | ") and "stock_ft" in x)
    for s in students.values():
        start = s["start_metrics"]["held_out"]["ppl"]
        assert f"{s['view']} (from {s['from']} at {start:.2f}, " in line, line
        assert f") | {s['metrics']['held_out']['ppl']:.2f} |" in line, line
    csv_rows = (root / "frontier.csv").read_text().splitlines()
    assert sum(",fine-tuned," in x for x in csv_rows) == 2

    from ghostdistill.runner.config import ParsedFit

    def fail(*args, **kwargs):
        raise AssertionError("a finished student was trained again")

    monkeypatch.setattr(ParsedFit, "fit", fail)
    main(["frontier", str(path), *overrides])
    assert json.loads((root / "frontier.json").read_text())["students"] == report["students"]


def test_bad_frontier_students_are_refused_before_the_first_pass(tmp_path, tiny_dir, text_files, monkeypatch):
    import ghostdistill.pipeline.frontier as frontier

    def fail(*args, **kwargs):
        raise AssertionError("the frontier ran before its students were checked")

    monkeypatch.setattr(frontier, "frontier_point", fail)
    cases = [
        ({"stock": {"name": "stock_ft", "method": "ra"}}, ValueError, "leave it out"),
        ({"stock": {"name": "stock"}}, ValueError, "name ends in _ft"),
        ({"config": "configs/nope.yaml"}, FileNotFoundError, "does not exist"),
        ({"stock": {"name": "stock_ft", "train": ["wings"]}}, ValueError, "frontier students.stock"),
        ({"overrides": ["--model.model.source", "other-model"]}, ValueError, "not the frontier's"),
    ]
    for students, error, match in cases:
        path, overrides = _students_file(tmp_path, tiny_dir, text_files, **students)
        with pytest.raises(error, match=match):
            main(["frontier", str(path), *overrides])
    # No stock recovery entry to start the stock student from: named, with the entries there are.
    path, overrides = _students_file(tmp_path, tiny_dir, text_files)
    with pytest.raises(ValueError, match="needs a stock recovery entry"):
        main(["frontier", str(path), *overrides, "--model.recovery", '[{"name": "ghost"}]'])


def test_greedy_extends_each_views_best_plan_of_the_depth_before_and_reuses_the_contiguous_depths(
    tmp_path, tiny_dir, text_files, monkeypatch
):
    """`greedy` in criteria: from depth 2 on, each view's plan of the depth before with the lowest selection KL
    (any criterion) grows by repair_greedy; the chosen plan, fitted on every window, scores on the selection
    windows what the search's last step scored (here the search also reads every window). Adding it to a
    frontier keeps the contiguous depths; a second call computes nothing."""
    import ghostdistill.pipeline.frontier as frontier

    path, overrides = frontier_file(tmp_path, tiny_dir, text_files, [1, 2])
    root = main(["frontier", str(path), *overrides])
    before = json.loads((root / "frontier.json").read_text())
    spec = yaml.safe_load(path.read_text())
    spec["criteria"] = ["streamline", "repair", "greedy"]
    path.write_text(yaml.safe_dump(spec))

    def fail(*args, **kwargs):
        raise AssertionError("computed again")

    monkeypatch.setattr(frontier, "frontier_point", fail)  # the contiguous depths are read back
    main(["frontier", str(path), *overrides])
    report = json.loads((root / "frontier.json").read_text())
    first, second = report["points"]
    assert first["rows"] == before["points"][0]["rows"], "no greedy rows at the first depth"
    assert second["rows"][: len(before["points"][1]["rows"])] == before["points"][1]["rows"]
    greedy = {r["view"]: r for r in second["rows"] if r["criterion"] == "greedy"}
    assert set(greedy) == {"ghost", "linearpatch"}
    for view, row in greedy.items():
        mine = [r for r in first["rows"] if r["view"] == view]
        start = min(mine, key=lambda r: r["selection_kl"])["removed"]
        assert row["greedy_start"] == start and set(start) < set(row["removed"]) and len(row["removed"]) == 2
        step = second["greedy"][view]["search"]["step 2"]
        assert step["kl"] == min(step["tried"].values())
        assert sorted([*start, int(step["kept"])]) == row["removed"]
        assert row["selection_kl"] == pytest.approx(step["kl"], rel=1e-4)
        assert row["metrics"]["held_out"]["ppl"] > 0 and row["stock"] is False
    saved = sorted(p.name for p in (root / "points").glob("*greedy*"))
    assert saved == ["n_02_greedy_ghost.json", "n_02_greedy_linearpatch.json"]
    md = (root / "frontier.md").read_text()
    assert "ghost (greedy)" in md and "`greedy` starts from" in md

    monkeypatch.setattr(frontier, "greedy_rows", fail)
    main(["frontier", str(path), *overrides])
    assert json.loads((root / "frontier.json").read_text())["points"] == report["points"]
    # Only the views whose search is not saved are searched: one view dropped and added back costs nothing.
    (root / "points" / "n_02_greedy_ghost.json").unlink()
    monkeypatch.undo()
    monkeypatch.setattr(frontier, "frontier_point", fail)
    calls = []
    real = frontier.greedy_rows
    monkeypatch.setattr(frontier, "greedy_rows", lambda *a, **k: calls.append(list(a[4])) or real(*a, **k))
    main(["frontier", str(path), *overrides])
    assert calls == [["ghost"]]
    again = json.loads((root / "frontier.json").read_text())["points"]
    assert [p["rows"] for p in again] == [p["rows"] for p in report["points"]], "the same search, the same rows"


def test_spans_name_the_runs_of_a_plan():
    from ghostdistill.reporting.frontier import spans

    assert spans([12, 13, 14, 15, 16, 17, 18]) == "12-18"
    assert spans([18, 4, 5, 6, 7, 12, 13, 14, 15, 16, 17]) == "4-7+12-18"
    assert spans([3, 9, 10]) == "3+9-10" and spans([]) == ""


def test_bad_greedy_settings_are_refused_before_the_first_pass(tmp_path, tiny_dir, text_files, monkeypatch):
    import ghostdistill.pipeline.frontier as frontier

    def fail(*args, **kwargs):
        raise AssertionError("the frontier ran before its greedy settings were checked")

    monkeypatch.setattr(frontier, "frontier_point", fail)
    path, overrides = frontier_file(tmp_path, tiny_dir, text_files, [1, 2])
    base = yaml.safe_load(path.read_text())
    cases = [
        ({"greedy": {"views": ["ghost"]}}, "has no greedy"),
        ({"criteria": ["repair", "greedy"], "num_layers": [2]}, "name at least two"),
        ({"criteria": ["repair", "greedy"], "greedy": {"views": "ghost"}}, "must be a list"),
        ({"criteria": ["repair", "greedy"], "greedy": {"criterion_samples": 0}}, "integer >= 1"),
        ({"criteria": ["repair", "greedy"], "greedy": {"depth": 3}}, "valid keys"),
        ({"criteria": ["repair", "greedy"], "greedy": {"views": ["wings"]}}, r"\['wings'\] are not recovery entries"),
    ]
    for change, match in cases:
        path.write_text(yaml.safe_dump({**base, **change}))
        with pytest.raises(ValueError, match=match):
            main(["frontier", str(path), *overrides])


def test_students_start_from_the_lowest_selection_kl_not_the_lowest_evaluation_perplexity():
    from ghostdistill.reporting.frontier import student_starts

    def row(view, stock, kl, ppl):
        return {
            "view": view,
            "stock": stock,
            "selection_kl": kl,
            "removed": [3],
            "params": 10,
            "metrics": {"wiki": {"ppl": ppl}},
        }

    point = {"rows": [row("dense", True, None, 30.0), row("pruned", True, 0.9, 40.0), row("ra", True, 0.5, 60.0),
                      row("rt", True, 0.6, 55.0), row("ghost", False, 0.3, 50.0), row("lp", False, 0.2, 52.0)]}  # fmt: skip
    starts = student_starts(point)
    assert (starts["stock"]["view"], starts["operators"]["view"]) == ("ra", "lp")
    assert student_starts({"rows": [row("ghost", False, 0.3, 50.0)]}).keys() == {"operators"}
