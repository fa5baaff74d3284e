"""`compare` and `frontier` on the command line: their arguments parsed, the run left to `runner.compare` and
`runner.frontier` (as the Python API's), and where the report went printed."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..runner.compare import compare_plans
from ..runner.frontier import frontier_depths


def run_compare(argv: list[str]) -> Path:
    """`compare <compare.yaml> [fit overrides]`: one `fit` per plan in `<root>/<plan name>/` (a finished
    plan is not run again when its results.json was computed with the same settings; one of other settings
    runs again, and the console says which differ), then compare.json/csv/md/png in the root. The user's
    overrides apply to every plan; each plan's own keys come last, so they win (a key it does not set takes
    `PlanConfig`'s default, whatever the base config says)."""
    parser = argparse.ArgumentParser(prog="ghostdistill compare", description=run_compare.__doc__)
    parser.add_argument("spec", help="the compare file (YAML: base config, root folder, plans)")
    parser.add_argument(
        "overrides", nargs=argparse.REMAINDER, help="fit overrides for every plan, e.g. --data.batch_size 2"
    )
    ns = parser.parse_args(argv)
    root, _ = compare_plans(ns.spec, ns.overrides)
    print(f"compare report written to {root}/compare.md")
    return root


def run_frontier_command(argv: list[str]) -> Path:
    """`frontier <frontier.yaml> [fit overrides]`: per depth, the pruned model and every recovery entry of the
    base config on streamline's plan and on its own repair-aware plan, and with ``greedy`` among the criteria on
    the plan `repair_greedy` grows from the depth before (`pipeline.frontier`), resumable per depth; with
    `students` in the file, then per depth the stock and operator students (`runner.frontier.frontier_students`);
    frontier.json/csv/md/png in the root. The training-free part runs no Trainer: the phases are called
    directly. The fit overrides apply to the student runs too (the same model)."""
    parser = argparse.ArgumentParser(prog="ghostdistill frontier", description=run_frontier_command.__doc__)
    parser.add_argument("spec", help="the frontier file (YAML: base config, root, num_layers, criteria)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="fit overrides, e.g. --data.batch_size 2")
    ns = parser.parse_args(argv)
    root, _ = frontier_depths(ns.spec, ns.overrides)
    print(f"frontier report written to {root}/frontier.md")
    return root
