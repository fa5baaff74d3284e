"""The compare report's plan names, arguments and file checks (the end-to-end run is in tests/test_cli.py)."""

import pytest


def test_compare_plan_names_tell_every_plan_key_apart():
    from ghostdistill.planning import PlanConfig
    from ghostdistill.reporting.compare import greedy_source, plan_config, plan_name

    plans = [
        {"criterion": "taylor", "num_layers": 7},
        {"criterion": "taylor", "num_layers": 7, "keep_first": 4, "keep_last": 2},
        {"criterion": "taylor", "num_layers": 7, "keep_first": 4},
        {"criterion": "taylor", "num_layers": 7, "criterion_samples": 8},
        {"criterion": "taylor", "num_layers": 7, "allow_edges": True},
        {"layers": [3, 4]},
        {"layers": [3, 4], "allow_edges": True},
    ]
    names = [plan_name(p) for p in plans]
    assert len(set(names)) == len(plans), names
    assert names[1] == "taylor_7_kf4_kl2"
    # Writing a default out changes nothing: the same plan, the same folder.
    assert plan_name({"criterion": "taylor", "num_layers": 7, "keep_first": 1}) == names[0]
    # A plan is a fresh PlanConfig: every key it does not name takes the default, so nothing leaks in.
    assert plan_config({"layers": [3, 4]}) == PlanConfig(layers=[3, 4])
    assert plan_config({"criterion": "repair", "num_layers": 7}, greedy_from="x").greedy_from == "x"
    # The repair method is in the folder name (each method's own best plan); the chunk size is not (memory only).
    assert (
        plan_name({"criterion": "repair", "num_layers": 7, "repair_method": "linearpatch"}) == "repair_7_by_linearpatch"
    )
    assert plan_name({"criterion": "repair", "num_layers": 7, "repair_chunk": 4}) == "repair_7"
    assert plan_name({"criterion": "repair_greedy", "num_layers": 7, "greedy_from": "x"}) == "repair_greedy_7"
    # A greedy search's start decides its plan: in the name, and never taken from another depth's steps.
    started = {"criterion": "repair_greedy", "num_layers": 11, "greedy_start": [12, 13, 14]}
    assert plan_name(started) == "repair_greedy_11_from12_13_14"
    assert greedy_source(started, [{**started, "num_layers": 9}]) is None
    assert plan_config({"layers": [3, 4]}).num_layers is None


def test_a_greedy_plan_starts_from_the_finished_greedy_plan_of_its_settings_that_leaves_least_to_search():
    from ghostdistill.reporting.compare import greedy_source

    def greedy(n, **kw):
        return {"criterion": "repair_greedy", "num_layers": n, "repair_method": "ghost", **kw}

    finished = [
        greedy(3),
        greedy(5),
        greedy(9, criterion_samples=8),  # other settings
        {"criterion": "block_influence", "num_layers": 6},
        greedy(6, keep_first=1, repair_chunk=4),  # the defaults and what only costs do not matter
    ]
    assert greedy_source(greedy(7), finished) == finished[4]
    assert greedy_source(greedy(4), finished) == greedy(5)  # a deeper run's first steps: no search at all
    assert greedy_source(greedy(11, criterion_samples=8), finished) == finished[2]
    assert greedy_source(greedy(7, criterion_samples=4), finished) is None
    assert greedy_source(greedy(7, greedy_from="mine"), finished) is None  # the user's own choice stands
    assert greedy_source({"criterion": "repair", "num_layers": 3}, finished) is None


def test_compare_rejects_bad_files(tmp_path):
    from ghostdistill.reporting.compare import load_spec

    bad = tmp_path / "c.yaml"
    bad.write_text(
        "base: configs/studies/compare/smollm2_methods.yaml\nplans: [{criterion: streamline, layers_removed: 3}]\n"
    )
    with pytest.raises(ValueError, match="layers_removed"):
        load_spec(str(bad))
    bad.write_text("base: nowhere.yaml\nplans: [{num_layers: 3}]\n")
    with pytest.raises(FileNotFoundError, match="nowhere.yaml"):
        load_spec(str(bad))


def test_stale_reasons_name_the_settings_that_differ():
    from ghostdistill.pipeline.settings import result_settings, stale_reason

    config = {
        "seed_everything": 0,
        "trainer": {"max_steps": 0, "devices": 1, "default_root_dir": "a"},
        "model": {"recovery": [{"name": "ghost"}], "evaluation": {"logit_chunk": 64}},
        "data": {"evaluation": {"max_windows": 2}, "num_workers": 0},
    }
    wanted = result_settings(config)
    assert "devices" not in wanted["trainer"] and "logit_chunk" not in wanted["model"]["evaluation"]
    assert stale_reason({"settings": wanted}, wanted) is None
    # What only costs (the run folder, devices, chunking) does not make a result stale.
    cheaper = {
        **config,
        "trainer": {**config["trainer"], "devices": 2, "default_root_dir": "b"},
        "model": {**config["model"], "evaluation": {"logit_chunk": 8}},
    }
    assert stale_reason({"settings": result_settings(cheaper)}, wanted) is None
    other = {
        **config,
        "model": {"recovery": [{"name": "lp", "method": "linearpatch"}], "evaluation": {}},
        "data": {"evaluation": {"max_windows": 5}},
    }
    why = stale_reason({"settings": result_settings(other)}, wanted)
    assert why == "its results.json was computed with other model.recovery, data.evaluation.max_windows"
    assert "older version" in stale_reason({}, wanted)


def test_compare_reuses_only_results_of_the_same_settings(tiny_dir, text_files, tmp_path, capsys):
    """Changing the methods and the evaluation windows after a compare: the plan runs again, and the report
    shows the new rows only (it reported the old ghost rows on 2 windows and exited 0)."""
    import json

    import yaml
    from tiny_run import tiny_run_args

    from ghostdistill.cli import main

    spec = tmp_path / "compare.yaml"
    base = tiny_run_args(tiny_dir, text_files, tmp_path / "unused")
    spec.write_text(yaml.safe_dump({"base": base[2], "root": str(tmp_path / "cmp"), "plans": [{"layers": [2, 3]}]}))
    overrides = [*base[3:-2], "--model.evaluation.analysis", "false"]
    root = main(["compare", str(spec), *overrides])
    results = root / "layers_2_3" / "results.json"
    first = json.loads((root / "compare.json").read_text())
    assert {r["view"] for r in first["rows"]} == {"dense", "pruned", "ghost"}
    assert first["evaluation"]["sources"]["held_out"]["windows"] == 2

    stamp = results.stat().st_mtime_ns
    main(["compare", str(spec), *overrides])  # the same settings: reused
    assert results.stat().st_mtime_ns == stamp
    capsys.readouterr()

    changed = [
        *overrides,
        "--model.recovery",
        json.dumps([{"name": "lp", "method": "linearpatch", "variant": "diag"}]),
        "--data.evaluation.max_windows",
        "3",
    ]
    main(["compare", str(spec), *changed])
    said = capsys.readouterr().out
    assert (
        "plan layers_2_3: its results.json was computed with other model.recovery, data.evaluation.max_windows" in said
    )
    report = json.loads((root / "compare.json").read_text())
    assert {r["view"] for r in report["rows"]} == {"dense", "pruned", "lp"}, "stale ghost rows reported"
    assert report["evaluation"]["sources"]["held_out"]["windows"] == 3
    assert "| ghost |" not in (root / "compare.md").read_text()

    # A results.json of an older version (no settings) is not trusted either.
    saved = json.loads(results.read_text())
    del saved["settings"]
    results.write_text(json.dumps(saved))
    main(["compare", str(spec), *changed])
    assert "records no settings (written by an older version); running it again" in capsys.readouterr().out
    assert "settings" in json.loads(results.read_text())


def test_wrong_model_compare_flags_views_worse_than_no_repair_or_larger_than_dense():
    """Issue 39: compare recommends no view; it lists, per plan, the views worse than that plan's pruned model or
    larger than the dense model, under its tables (as each run's results.md does)."""
    from ghostdistill.reporting.compare import to_markdown
    from ghostdistill.reporting.flags import flagged

    def row(plan, view, ppl, kl, params):
        return {"plan": plan, "criterion": "streamline", "layers_removed": 2, "removed": [2, 3], "view": view,
                "method": view, "source": "wiki", "ppl": ppl, "kl": kl, "top1": None, "acc": None, "acc_norm": None,
                "items": None, "params": params, "fit_s": 1.0, "statistics_s": 2.0}  # fmt: skip

    rows = [row("s7", "dense", 30.0, None, 100), row("s7", "pruned", 60.0, 1.0, 80),
            row("s7", "ghost", 40.0, 0.5, 81), row("s7", "rotation_anchored", 90.0, 1.5, 120)]  # fmt: skip
    lines = flagged(rows)
    assert lines == [
        "plan s7: rotation_anchored is worse than no repair (wiki perplexity 90.00 against pruned's 60.00 and KL "
        "1.500 against pruned's 1.000)",
        "plan s7: rotation_anchored is larger than the dense model (0.0M parameters against 0.0M)",
    ]
    report = {"rows": rows, "model": {"source": "m", "dtype": "float32"},
              "calibration": {"source": {"source": "c", "first_document": 0, "max_documents": None}, "windows": 1,
                              "seq_len": 2, "seed": 0},
              "evaluation": {"seq_len": 2, "sources": {"wiki": {"windows": 1, "source": "w"}}}}  # fmt: skip
    assert all(f"- {line}" in to_markdown(report) for line in lines)


def test_duplicate_compare_plans_are_refused(tmp_path):
    from ghostdistill.reporting.compare import load_spec

    spec = tmp_path / "c.yaml"
    spec.write_text(
        "base: configs/studies/compare/smollm2_methods.yaml\nplans: [{num_layers: 3}, {num_layers: 3, keep_first: 1}]\n"
    )
    with pytest.raises(ValueError, match=r"plans \(by run folder\) \['streamline_3', 'streamline_3'\] names "):
        load_spec(str(spec))
