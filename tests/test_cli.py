"""The command line: every shipped config parses, and `fit` runs end to end on a tiny model."""

import csv
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from shipped_configs import SHIPPED, raw
from tiny_run import tiny_run_args

from ghostdistill.calibration.state import STATE_FILE
from ghostdistill.cli import main

ROOT = Path(__file__).resolve().parents[1]
ALL_CONFIGS = SHIPPED
COMPARE_CONFIGS = [p for p in ALL_CONFIGS if "plans" in yaml.safe_load(p.read_text())]
FRONTIER_CONFIGS = [
    p for p in ALL_CONFIGS if "num_layers" in yaml.safe_load(p.read_text()) and p not in COMPARE_CONFIGS
]
CONFIGS = [p for p in ALL_CONFIGS if p not in COMPARE_CONFIGS and p not in FRONTIER_CONFIGS]


@pytest.mark.parametrize("config", FRONTIER_CONFIGS, ids=lambda p: p.name)
def test_every_frontier_config_parses(config, monkeypatch):
    from ghostdistill.reporting.frontier import load_frontier_spec

    monkeypatch.chdir(ROOT)
    spec = load_frontier_spec(str(config))
    assert spec["base"] in {str(p.relative_to(ROOT)) for p in CONFIGS} and spec["num_layers"]


@pytest.mark.parametrize("config", COMPARE_CONFIGS, ids=lambda p: p.name)
def test_every_compare_config_parses(config, monkeypatch):
    from ghostdistill.reporting.compare import load_spec

    monkeypatch.chdir(ROOT)
    spec = load_spec(str(config))
    assert spec["base"] in {str(p.relative_to(ROOT)) for p in CONFIGS}


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_every_shipped_config_parses(config, monkeypatch, capsys):
    """In-process (`main`, as the command runs it): one interpreter for all configs, not one each."""
    monkeypatch.chdir(ROOT)
    try:
        main(["fit", "--config", str(config), "--print_config"])
    except SystemExit as exit_:
        assert exit_.code in (0, None), capsys.readouterr().err[-2000:]
    parsed = yaml.safe_load(capsys.readouterr().out)
    written = raw(config)
    assert parsed["model"]["model"]["source"] == written["model"]["model"]["source"]
    assert parsed["trainer"]["max_steps"] == written["trainer"]["max_steps"]
    assert [r["name"] for r in parsed["model"]["recovery"]] == [r["name"] for r in written["model"]["recovery"]]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda p: p.name)
def test_a_typed_run_of_a_config_has_the_settings_a_fit_of_it_records(config, monkeypatch):
    """`compare` and `frontier` run typed configs (`runner.config.ParsedFit`, sections replaced): their settings
    are the ones a `fit` of the same arguments records, so the results saved before are reused; a frontier
    student's settings, which name its run folder, have the digest the arguments that ran it before had."""
    from dataclasses import replace

    from ghostdistill.core.io import json_digest
    from ghostdistill.distill.config import StudentConfig
    from ghostdistill.methods import RecoveryConfig
    from ghostdistill.pipeline.settings import stale
    from ghostdistill.runner.config import parse_fit
    from ghostdistill.runner.fit import _ParseOnly, build_fit, settings_of

    monkeypatch.chdir(ROOT)

    def recorded(args):
        return settings_of(build_fit(args, cli_class=_ParseOnly, exit_on_error=False))

    args = ["--config", str(config)]
    parsed = parse_fit(args, "test")
    assert stale(recorded(args), parsed.settings()) is None
    entry = parsed.cfg.recovery[-1].settings()
    student = {"name": "s_ft", "method": entry["name"], "train": ["operators", "lora"]}
    argv = [*args, "--model.plan.layers", "[2, 3]", "--model.plan.num_layers", "null"]
    argv += ["--model.recovery", json.dumps([entry]), "--model.distill.students", json.dumps([student])]
    typed = parsed.replace(
        plan=replace(parsed.cfg.plan, layers=[2, 3], num_layers=None),
        recovery=[RecoveryConfig(**entry)],
        distill=replace(parsed.cfg.distill, students=[StudentConfig(**student)]),
    )
    assert json_digest(typed.settings()) == json_digest(recorded(argv))


def _args(tiny_dir, text_files, run_dir, *extra, config="smollm2_demo.yaml"):
    # The config's criterion chooses 2 layers; calibration and evaluation windows of 64 tokens.
    return tiny_run_args(
        tiny_dir,
        text_files,
        run_dir,
        *extra,
        config=config,
        layers=None,
        num_layers=2,
        recovery=None,
        seq_len=64,
        eval_seq_len=64,
        eval_windows=4,
        batch_size=None,
    )


def test_fit_writes_results(tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    main(_args(tiny_dir, text_files, run))
    results = json.loads((run / "results.json").read_text())
    assert results["plan"]["chosen_by"] == "streamline" and len(results["plan"]["removed"]) == 2
    assert set(results["views"]) == {"dense", "pruned", "ghost", "ghost_paper"}
    for view, entry in results["views"].items():
        metrics = entry["metrics"]["held_out"]
        assert metrics["ppl"] > 1 and metrics["tokens"] == 4 * 63
        assert ("kl" in metrics) == (view != "dense")
    assert results["views"]["dense"]["params"] > results["views"]["pruned"]["params"]
    assert results["calibration"]["token_groups"][results["plan"]["gaps"][0]]["first"] == 16
    assert results["calibration"]["tokens"] == 16 * 64
    md = (run / "results.md").read_text()
    assert "| ghost |" in md and "held_out PPL" in md
    assert (run / "results.png").stat().st_size > 1000
    assert not list(run.glob(".*.tmp")), "no half-written files are left behind"


def test_explicit_layers_and_view_selection(tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    main(
        _args(
            tiny_dir,
            text_files,
            run,
            "--model.plan.layers",
            "[1, 4]",
            "--model.plan.num_layers",
            "null",
            "--model.evaluation.views",
            "[pruned, ghost]",
        )
    )
    results = json.loads((run / "results.json").read_text())
    assert results["plan"]["removed"] == [1, 4] and results["plan"]["gaps"] == ["1-1", "4-4"]
    assert list(results["views"]) == ["pruned", "ghost"]


def test_bad_values_are_named(tiny_dir, text_files, tmp_path):
    with pytest.raises(ValueError, match="recovery names must be unique"):
        main(_args(tiny_dir, text_files, tmp_path / "r", "--model.recovery", "[{name: a}, {name: a}]"))
    with pytest.raises(ValueError, match="out of range"):
        main(
            _args(
                tiny_dir, text_files, tmp_path / "r", "--model.plan.layers", "[3, 9]", "--model.plan.num_layers", "null"
            )
        )
    with pytest.raises(ValueError, match="calibration.num_samples"):
        main(_args(tiny_dir, text_files, tmp_path / "r", "--data.calibration.num_samples", "0"))
    with pytest.raises(ValueError) as info:  # a value outside its key's Literal is named with the valid ones
        main(_args(tiny_dir, text_files, tmp_path / "r", "--model.recovery", "[{name: a, fit: best}]"))
    err = str(info.value)
    assert "\n" not in err, err  # one line, not the usage of every key
    # The message names the key, the bad value and the valid ones (those of the method's config class).
    import typing

    from ghostdistill.methods import GhostConfig

    assert err.startswith("model.recovery: entry 'a' (ghost): fit 'best' is not known; choose one of"), err
    literal = typing.get_type_hints(GhostConfig)["fit"]
    assert all(f"'{valid}'" in err for valid in typing.get_args(literal)), err


def test_interrupted_calibration_resumes(tiny_dir, text_files, tmp_path, monkeypatch):
    """Kill the statistics pass half-way; the rerun picks up the checkpoint and ends with the same operators."""
    import ghostdistill.pipeline.calibrate as callbacks

    full = tmp_path / "full"
    main(
        _args(
            tiny_dir,
            text_files,
            full,
            "--calibration.checkpoint_every",
            "1",
            "--model.plan.layers",
            "[2, 3]",
            "--model.plan.num_layers",
            "null",
        )
    )
    reference = torch.load(full / STATE_FILE, weights_only=False)

    real = callbacks.accumulate
    calls = {"n": 0}

    def dying(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    run = tmp_path / "run"
    args = _args(
        tiny_dir,
        text_files,
        run,
        "--calibration.checkpoint_every",
        "1",
        "--model.plan.layers",
        "[2, 3]",
        "--model.plan.num_layers",
        "null",
    )
    monkeypatch.setattr(callbacks, "accumulate", dying)
    with pytest.raises((KeyboardInterrupt, SystemExit)):  # Lightning turns Ctrl-C into exit(1)
        main(args)
    partial = torch.load(run / STATE_FILE, weights_only=False)
    assert partial["batches_done"] == 2
    assert not (run / "results.json").exists()

    seen = []
    monkeypatch.setattr(callbacks, "accumulate", lambda *a, **k: seen.append(1) or real(*a, **k))
    main(args)
    assert len(seen) == 2  # 4 batches in all, 2 of them done before the interruption
    resumed = torch.load(run / STATE_FILE, weights_only=False)
    for group, ref in reference["stats"]["2-3"]["ghost"]["xtx"].items():
        torch.testing.assert_close(resumed["stats"]["2-3"]["ghost"]["xtx"][group], ref)
    assert json.loads((run / "results.json").read_text())["views"]["ghost"]


def test_statistics_of_an_older_version_are_collected_again(tiny_dir, text_files, tmp_path):
    """A complete state whose ghost sums lack this version's groups is not resumed: the pass runs again."""
    run = tmp_path / "run"
    args = _args(
        tiny_dir,
        text_files,
        run,
        "--model.plan.layers",
        "[2, 3]",
        "--model.plan.num_layers",
        "null",
        "--model.evaluation.views",
        "[ghost]",
    )
    main(args)
    state = torch.load(run / STATE_FILE, weights_only=False)
    fresh = state["stats"]["2-3"]["ghost"]["xtx"]["plain_rest"].clone()
    old = state["stats"]["2-3"]["ghost"]
    for key in ("xsum", "dsum", "scalars"):
        old.pop(key)
    old["xtx"] = {k: v * 0 for k, v in old["xtx"].items() if not k.startswith("normed")}
    torch.save(state, run / STATE_FILE)
    main(args)
    again = torch.load(run / STATE_FILE, weights_only=False)["stats"]["2-3"]["ghost"]
    torch.testing.assert_close(again["xtx"]["plain_rest"], fresh)
    assert set(again["xsum"]) == set(again["xtx"])


def test_all_methods_and_sequential_fit_through_the_cli(tiny_dir, text_files, tmp_path):
    run = tmp_path / "run"
    main(
        _args(
            tiny_dir,
            text_files,
            run,
            "--model.plan.layers",
            "[1, 4]",
            "--model.plan.num_layers",
            "null",
            config="studies/compare/smollm2_methods.yaml",
        )
    )
    results = json.loads((run / "results.json").read_text())
    names = ["magnitude", "linearpatch_diag", "linearpatch", "replaceme", "ghost_paper", "ghost"]
    assert list(results["views"]) == ["dense", "pruned", *names]
    assert [results["recovery"][n]["order"] for n in names] == ["sequential"] * 6
    pruned = results["views"]["pruned"]
    for n in names:
        assert results["views"][n]["metrics"]["held_out"]["ppl"] != pruned["metrics"]["held_out"]["ppl"]
    # Maps that fold into existing weights add no parameters; inserted C×C operators do (2 gaps here).
    c = 64
    assert results["views"]["replaceme"]["params"] == pruned["params"]
    assert results["views"]["magnitude"]["params"] == pruned["params"]
    assert results["views"]["linearpatch"]["params"] == pruned["params"] + 2 * c * c
    assert results["views"]["ghost"]["params"] == pruned["params"] + 2 * (c * c + c)
    # The analysis: every method at both gaps, on held-out windows (the evaluation ones, 4 here).
    analysis = results["analysis"]
    assert analysis["held_out_windows"] == 4 and analysis["overlapping_windows"] == 0
    for gap in results["plan"]["gaps"]:
        rows = analysis["gaps"][gap]
        assert set(rows) == set(names)
        assert 0 < rows["ghost"]["anatomy"]["antisym_share_M"] < 1
        assert rows["linearpatch"]["anatomy"]["antisym_share_M"] < 1e-10
        assert rows["ghost"]["held_out_tokens"] == {"other": 4 * 63, "first": 4}
    assert "antisym M" in (run / "results.md").read_text()
    assert (run / "analysis.png").stat().st_size > 1000


def test_compare_gathers_every_plan_and_method(tiny_dir, text_files, tmp_path, monkeypatch):
    from ghostdistill.cli import run_compare

    monkeypatch.chdir(ROOT)
    spec = tmp_path / "compare.yaml"
    spec.write_text(
        yaml.safe_dump(
            {
                "base": "configs/studies/compare/smollm2_methods.yaml",
                "root": str(tmp_path / "cmp"),
                "plans": [
                    {"criterion": "streamline", "num_layers": 1},
                    {"criterion": "streamline", "num_layers": 2},
                    {"layers": [1, 4]},
                ],
            }
        )
    )
    # Model and data overrides, and a plan override (--model.plan.num_layers 2) that each plan's own
    # keys must win over.
    overrides = _args(tiny_dir, text_files, tmp_path / "unused")[3:-6]
    assert "--model.plan.num_layers" in overrides
    root = run_compare([str(spec), *overrides])
    report = json.loads((root / "compare.json").read_text())
    removed = {r["plan"]: r["removed"] for r in report["rows"]}
    assert set(removed) == {"streamline_1", "streamline_2", "layers_1_4"}
    assert len(removed["streamline_1"]) == 1 and len(removed["streamline_2"]) == 2
    assert removed["layers_1_4"] == [1, 4]
    for plan, layers in removed.items():
        saved = json.loads((root / plan / "results.json").read_text())
        assert saved["plan"]["removed"] == layers
    views = {r["view"] for r in report["rows"]}
    assert {"dense", "pruned", "ghost", "linearpatch", "replaceme", "magnitude"} <= views
    assert report["calibration"]["windows"] == 16 and report["evaluation"]["seq_len"] == 64
    md = (root / "compare.md").read_text()
    assert "| ghost |" in md and "streamline_2" in md and "seed 0" in md
    rows = list(csv.DictReader(open(root / "compare.csv")))
    assert len(rows) == len(report["rows"])
    assert (root / "compare.png").stat().st_size > 1000
    # A finished plan is not run again.
    stamp = (root / "streamline_1" / "results.json").stat().st_mtime_ns
    run_compare([str(spec), *overrides])
    assert (root / "streamline_1" / "results.json").stat().st_mtime_ns == stamp


def test_installed_script_has_compare(tmp_path):
    script = Path(sys.executable).parent / "ghostdistill"
    assert script.is_file(), "pip install -e . installs the ghostdistill script"
    out = subprocess.run(
        [str(script), "compare", str(tmp_path / "missing.yaml")], capture_output=True, text=True, cwd=ROOT, timeout=300
    )
    assert out.returncode != 0 and "missing.yaml" in out.stderr and "does not exist" in out.stderr


def test_zeroshot_accuracy_lands_in_results(tiny_dir, text_files, tmp_path, shared_data):
    # The published files, with ARC-Easy cut to its first ARC items: "no limit" still means every item of the
    # folder, and the test scores 2 × 12 items instead of 2 × 570 (about two minutes on 2 cores).
    DATA, ARC = tmp_path / "data", 12
    (DATA / "arc_easy").mkdir(parents=True)
    lines = (shared_data / "arc_easy" / "ARC-Easy-Dev.jsonl").read_text().splitlines(keepends=True)
    (DATA / "arc_easy" / "ARC-Easy-Dev.jsonl").write_text("".join(lines[:ARC]))
    shutil.copytree(shared_data / "piqa", DATA / "piqa")
    run = tmp_path / "run"
    zs = {"enabled": True, "tasks": ["arc_easy", "piqa"], "data_dir": str(DATA), "limit": {"piqa": 3}, "batch_size": 4}
    args = _args(
        tiny_dir,
        text_files,
        run,
        "--model.plan.layers",
        "[2, 3]",
        "--model.plan.num_layers",
        "null",
        "--model.evaluation.views",
        "[dense, ghost]",
        "--overwrite_run",  # the reruns below change settings in the same folder on purpose
        "true",
        "--model.evaluation.zeroshot",
        json.dumps(zs),
    )
    main(args)
    results = json.loads((run / "results.json").read_text())
    for view in ("dense", "ghost"):
        scores = results["views"][view]["zeroshot"]
        assert scores["arc_easy"]["n"] == ARC and scores["piqa"]["n"] == 3  # no limit for arc_easy: every item
        assert scores["average"]["acc"] == pytest.approx((scores["arc_easy"]["acc"] + scores["piqa"]["acc"]) / 2)
    assert results["zeroshot"]["limit"] == {"piqa": 3}
    md = (run / "results.md").read_text()
    assert "Zero-shot accuracy" in md and "n = items scored: the first 3 of piqa; every item of the others" in md
    assert f"arc_easy (n={ARC})" in md

    # Resume: saved scores are reused while their key matches, missing ones are computed again.
    saved = run / "zeroshot" / "ghost" / "arc_easy.json"
    entry = json.loads(saved.read_text())
    entry["scores"]["arc_easy"]["acc"] = 0.123  # a value no model here produces, to see it come back
    saved.write_text(json.dumps(entry))
    (run / "zeroshot" / "ghost" / "piqa.json").write_text('{"key": ')  # unreadable: scored again
    dense_piqa = json.loads((run / "zeroshot" / "dense" / "piqa.json").read_text())
    (run / "zeroshot" / "dense" / "piqa.json").unlink()
    main(args)
    again = json.loads((run / "results.json").read_text())["views"]
    assert again["ghost"]["zeroshot"]["arc_easy"]["acc"] == 0.123
    assert again["dense"]["zeroshot"]["piqa"] == dense_piqa["scores"]["piqa"]
    assert again["ghost"]["zeroshot"]["piqa"] == results["views"]["ghost"]["zeroshot"]["piqa"]
    assert json.loads((run / "zeroshot" / "dense" / "piqa.json").read_text())["key"] == dense_piqa["key"]

    # Another limit is another key: the tampered score is not reused.
    main([*args[:-1], json.dumps({**zs, "limit": {"arc_easy": 5, "piqa": 3}})])
    scores = json.loads((run / "results.json").read_text())["views"]["ghost"]["zeroshot"]
    assert scores["arc_easy"]["n"] == 5 and scores["arc_easy"]["acc"] != 0.123

    # Other removed layers: the dense scores still hold (they do not depend on the plan), the others not.
    for view in ("dense", "ghost"):
        saved = run / "zeroshot" / view / "piqa.json"
        entry = json.loads(saved.read_text())
        entry["scores"]["piqa"]["acc"] = 0.321
        saved.write_text(json.dumps(entry))
    args[args.index("[2, 3]")] = "[3, 4]"
    main([*args[:-1], json.dumps({**zs, "limit": {"arc_easy": 5, "piqa": 3}})])
    views = json.loads((run / "results.json").read_text())["views"]
    assert views["dense"]["zeroshot"]["piqa"]["acc"] == 0.321
    assert views["ghost"]["zeroshot"]["piqa"]["acc"] != 0.321

    # The compare report carries the accuracies, with the items scored per task.
    from ghostdistill.reporting import compare

    final = json.loads((run / "results.json").read_text())
    report = compare.gather([({"layers": [3, 4]}, final)], {"base": "b.yaml"})
    rows = {(r["view"], r["source"]): r for r in report["rows"]}
    assert rows[("ghost", "zeroshot/arc_easy")]["items"] == 5 and rows[("ghost", "zeroshot/piqa")]["items"] == 3
    assert rows[("dense", "zeroshot/average")]["acc"] == final["views"]["dense"]["zeroshot"]["average"]["acc"]
    assert rows[("ghost", "zeroshot/average")]["items"] is None
    assert "Zero-shot average accuracy" in compare.to_markdown(report)


def test_bad_zeroshot_limit_is_named(tiny_dir, text_files, tmp_path):
    for limit, match in (
        ({"hellaswag": 10}, "'hellaswag'.*arc_easy"),
        (0, "positive integer.*0"),
        ({"arc_easy": -3}, "'arc_easy'.*-3"),
    ):
        zs = json.dumps({"enabled": True, "tasks": ["arc_easy"], "limit": limit})
        with pytest.raises(ValueError, match=match):
            main(_args(tiny_dir, text_files, tmp_path / "run", "--model.evaluation.zeroshot", zs))
    assert not (tmp_path / "run").exists()


def test_offline_zeroshot_with_the_default_tasks_fails_before_loading(tiny_dir, text_files, tmp_path):
    """The default tasks include rte, copa and race, which have no offline files: said at once, with
    the tasks that have them."""
    zs = json.dumps({"enabled": True, "data_dir": str(tmp_path)})
    with pytest.raises(ValueError, match="'rte', 'copa', 'race'.*valid offline tasks: arc_easy"):
        main(_args(tiny_dir, text_files, tmp_path / "run", "--model.evaluation.zeroshot", zs))
    assert not (tmp_path / "run").exists()
