"""The compare report's plan names, arguments and file checks (the end-to-end run is in tests/test_cli.py)."""

import pytest


def test_compare_plan_names_tell_every_plan_key_apart():
    from ghostdistill.reporting.compare import plan_args, plan_name

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
    # Every plan key is set on the command line, so nothing the plan does not name leaks in.
    args = plan_args({"layers": [3, 4]})
    keys = {args[i] for i in range(0, len(args), 2)}
    assert keys == {
        f"--model.plan.{k}"
        for k in (
            "layers",
            "criterion",
            "num_layers",
            "allow_edges",
            "keep_first",
            "keep_last",
            "criterion_samples",
            "repair_method",
            "repair_chunk",
            "greedy_from",
        )
    }
    # The repair method is in the folder name (each method's own best plan); the chunk size is not (memory only).
    assert (
        plan_name({"criterion": "repair", "num_layers": 7, "repair_method": "linearpatch"}) == "repair_7_by_linearpatch"
    )
    assert plan_name({"criterion": "repair", "num_layers": 7, "repair_chunk": 4}) == "repair_7"
    assert plan_name({"criterion": "repair_greedy", "num_layers": 7, "greedy_from": "x"}) == "repair_greedy_7"
    assert args[args.index("--model.plan.num_layers") + 1] == "null"


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
    bad.write_text("base: configs/smollm2_methods.yaml\nplans: [{criterion: streamline, layers_removed: 3}]\n")
    with pytest.raises(ValueError, match="layers_removed"):
        load_spec(str(bad))
    bad.write_text("base: nowhere.yaml\nplans: [{num_layers: 3}]\n")
    with pytest.raises(FileNotFoundError, match="nowhere.yaml"):
        load_spec(str(bad))
