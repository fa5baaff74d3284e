"""`compare` and `frontier`: several fits of one base config, gathered into one report."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..planning import check_selection
from ..reporting import compare
from .fit import build_fit, fit_settings, run_fit


def run_compare(argv: list[str]) -> Path:
    """`compare <compare.yaml> [fit overrides]`: one `fit` per plan in `<root>/<plan name>/` (a finished
    plan is not run again when its results.json was computed with the same settings; one of other settings
    runs again, and the console says which differ), then compare.json/csv/md/png in the root. The user's
    overrides apply to every plan; each plan's own keys come last, so they win."""
    from ..core.io import read_mapping

    parser = argparse.ArgumentParser(prog="ghostdistill compare", description=run_compare.__doc__)
    parser.add_argument("spec", help="the compare file (YAML: base config, root folder, plans)")
    parser.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="fit overrides for every plan, e.g. --data.batch_size 2"
    )
    ns = parser.parse_args(argv)
    spec = compare.load_spec(ns.spec)
    root = Path(spec["root"])

    def fit_args(plan: dict, given: dict) -> list[str]:
        run_dir = str(root / compare.plan_name(plan))
        plan_args = compare.plan_args({**plan, **given})
        return ["--config", spec["base"], *ns.overrides, *plan_args, "--trainer.default_root_dir", run_dir]

    # Every plan's arguments parse before the first one runs (a bad override or plan value is one line).
    wanted = [fit_settings(fit_args(p, {}), f"{ns.spec}: plan {compare.plan_name(p)}") for p in spec["plans"]]
    runs = []
    for plan, settings in zip(spec["plans"], wanted):
        name = compare.plan_name(plan)
        results = root / name / "results.json"
        # A greedy plan starts from the steps of a finished one of the same settings (fit checks them).
        source = compare.greedy_source(plan, [p for p, _ in runs])
        args = fit_args(plan, {"greedy_from": str(root / compare.plan_name(source))} if source else {})
        why = "not run yet"
        if results.is_file():
            why = compare.stale_reason(read_mapping(results, "results file"), settings)
            if why:
                print(f"compare: plan {name}: {why}; running it again")
        if why:
            run_fit(args)
        runs.append((plan, read_mapping(results, "results file")))
    compare.write(root, compare.gather(runs, spec))
    print(f"compare report written to {root}/compare.md")
    return root


def run_frontier_command(argv: list[str]) -> Path:
    """`frontier <frontier.yaml> [fit overrides]`: per depth, the pruned model and every recovery entry of the
    base config on streamline's plan and on its own repair-aware plan (`pipeline.frontier`), resumable per
    depth; frontier.json/csv/md/png in the root. No Trainer runs: the phases are called directly."""
    from ..pipeline.frontier import run_frontier
    from ..reporting import frontier

    parser = argparse.ArgumentParser(prog="ghostdistill frontier", description=run_frontier_command.__doc__)
    parser.add_argument("spec", help="the frontier file (YAML: base config, root, num_layers, criteria)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="fit overrides, e.g. --data.batch_size 2")
    ns = parser.parse_args(argv)
    spec = frontier.load_frontier_spec(ns.spec)
    root = Path(spec["root"])
    cli = build_fit(
        ["--config", spec["base"], *ns.overrides, "--trainer.default_root_dir", str(root)], save_config_callback=None
    )
    run = cli.model.run  # the same `pipeline.run.Run` as `fit`'s, its config complete and validated
    check_selection(run.cfg.data, "frontier")
    run.load().to(cli.trainer.strategy.root_device)
    run.setup(root, checks=False)  # `run_frontier` checks every depth instead of the base plan
    points = run_frontier(run.cfg, run.llm, run.data, root, spec["num_layers"], spec["criteria"])
    frontier.write(root, points, spec)
    print(f"frontier report written to {root}/frontier.md")
    return root
