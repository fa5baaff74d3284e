"""`compare` and `frontier`: several fits of one base config, gathered into one report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..core.lock import hold_folder
from ..pipeline.settings import stale_reason
from ..planning import check_selection
from ..reporting import compare
from .fit import build_fit, fit_settings, run_fit, settings_of


def run_compare(argv: list[str]) -> Path:
    """`compare <compare.yaml> [fit overrides]`: one `fit` per plan in `<root>/<plan name>/` (a finished
    plan is not run again when its results.json was computed with the same settings; one of other settings
    runs again, and the console says which differ), then compare.json/csv/md/png in the root. The user's
    overrides apply to every plan; each plan's own keys come last, so they win."""
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
    with hold_folder(root, f"ghostdistill compare {ns.spec}", "wait for it to finish, or choose another root"):
        _compare(spec, ns, root, wanted, fit_args)
    print(f"compare report written to {root}/compare.md")
    return root


def _compare(spec: dict, ns, root: Path, wanted: list[dict], fit_args) -> None:
    from ..core.io import read_mapping

    runs = []
    for plan, settings in zip(spec["plans"], wanted):
        name = compare.plan_name(plan)
        results = root / name / "results.json"
        # A greedy plan starts from the steps of a finished one of the same settings (fit checks them).
        source = compare.greedy_source(plan, [p for p, _ in runs])
        args = fit_args(plan, {"greedy_from": str(root / compare.plan_name(source))} if source else {})
        why = "not run yet"
        if results.is_file():
            why = stale_reason(read_mapping(results, "results file"), settings)
            if why:
                print(f"compare: plan {name}: {why}; running it again")
        if why:
            run_fit(args)
        runs.append((plan, read_mapping(results, "results file")))
    compare.write(root, compare.gather(runs, spec))


def run_frontier_command(argv: list[str]) -> Path:
    """`frontier <frontier.yaml> [fit overrides]`: per depth, the pruned model and every recovery entry of the
    base config on streamline's plan and on its own repair-aware plan, and with ``greedy`` among the criteria on
    the plan `repair_greedy` grows from the depth before (`pipeline.frontier`), resumable per depth; with
    `students` in the file, then per depth the stock and operator students (`frontier_students`);
    frontier.json/csv/md/png in the root. The training-free part runs no Trainer: the phases are called
    directly. The fit overrides apply to the student runs too (the same model)."""
    import gc

    from ..pipeline.frontier import check_greedy, run_frontier
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
    if "greedy" in spec["criteria"]:
        check_greedy(run.cfg, spec["greedy"])  # a view that is no recovery entry, before the model loads
    if "students" in spec:  # a bad student setting is refused before the first pass
        check_frontier_students(spec, run.cfg, settings_of(cli), ns.overrides)
    with hold_folder(root, f"ghostdistill frontier {ns.spec}", "wait for it to finish, or choose another root"):
        run.load().to(cli.trainer.strategy.root_device)
        run.setup(root, checks=False)  # `run_frontier` checks every depth instead of the base plan
        points = run_frontier(
            run.cfg, run.llm, run.data, root, spec["num_layers"], spec["criteria"], greedy=spec.get("greedy")
        )
        students = []
        if "students" in spec:
            run.llm = run.data = run.pruned = None  # each student's fit loads the model itself
            gc.collect()
            students = frontier_students(spec, points, run.cfg, root, ns.overrides)
        frontier.write(root, points, spec, students)
    print(f"frontier report written to {root}/frontier.md")
    return root


def _student_fit_args(spec: dict, cfg, overrides: list[str], start: dict, kind: str) -> list[str]:
    """The `fit` of one depth's `kind` student: `students.config`, the command line's and `students.overrides`,
    then the start view's plan (its removed blocks), its recovery entry (the frontier's, with its settings) and
    the student itself, starting from that view."""
    students = spec["students"]
    # The entry's resolved settings (`RecoveryConfig.settings`): what its fit sees, and nothing it would refuse.
    recovery = next(r for r in cfg.recovery if r.name == start["view"]).settings()
    student = {**students[kind], "method": start["view"]}
    return [
        "--config", students["config"], *overrides, *students["overrides"],
        "--model.plan.layers", json.dumps(start["removed"]), "--model.plan.num_layers", "null",
        "--model.recovery", json.dumps([recovery]), "--model.distill.students", json.dumps([student]),
    ]  # fmt: skip


def check_frontier_students(spec: dict, cfg, frontier_settings: dict, overrides: list[str]) -> None:
    """Every student fit parses (its config, the overrides, the student's keys) on a stand-in plan of the
    first depth, from each recovery entry of its kind, and trains the frontier's model: checked before the
    frontier's first pass, which may take hours."""
    from ..methods import ships_stock

    n = spec["num_layers"][0]
    for kind in ("stock", "operators"):
        if kind not in spec["students"]:
            continue
        mine = [r for r in cfg.recovery if ships_stock(r.method) == (kind == "stock")]
        if not mine:
            raise ValueError(
                f"frontier file: students.{kind} needs a {kind} recovery entry in {spec['base']} to start from; "
                f"its entries are {[f'{r.name} ({r.method})' for r in cfg.recovery]}"
            )
        for entry in mine:
            start = {"view": entry.name, "removed": list(range(1, 1 + n))}
            settings = fit_settings(_student_fit_args(spec, cfg, overrides, start, kind), f"frontier students.{kind}")
            theirs, ours = settings["model"]["model"], frontier_settings["model"]["model"]
            if theirs != ours:
                raise ValueError(
                    f"frontier file: students.config {spec['students']['config']} trains model {theirs}, not the "
                    f"frontier's {ours}; set students.config's model (or students.overrides) to the same"
                )


def frontier_students(spec: dict, points: list[dict], cfg, root: Path, overrides: list[str]) -> list[dict]:
    """Per depth and kind (`stock`, `operators`), one `fit` of the student from the depth's best view of that
    kind (lowest selection KL, `reporting.frontier.student_starts`), in `<root>/students/n_<n>_<kind>-<settings digest>`:
    a finished one is read back, an interrupted one resumes from its last checkpoint (the digest keeps another
    setting's checkpoint out). Returns a record per student: its metrics, its start view's in the same run, the
    parameters its export holds (the start view's: LoRA and norms merge)."""
    from ..core.io import json_digest, read_mapping
    from ..methods import ships_stock
    from ..reporting.frontier import student_starts

    records = []
    for point in points:
        starts = student_starts(point)
        for kind in ("stock", "operators"):
            if kind not in spec["students"]:
                continue
            start = starts.get(kind)
            if start is None:
                print(f"frontier students n={point['n']}: no {kind} view to start a student from; skipped")
                continue
            args = _student_fit_args(spec, cfg, overrides, start, kind)
            who = f"frontier students n={point['n']} {kind}"
            run_dir = root / "students" / f"n_{point['n']:02d}_{kind}-{json_digest(fit_settings(args, who))[:10]}"
            args += ["--trainer.default_root_dir", str(run_dir)]
            results = run_dir / "results.json"
            if results.is_file():
                print(f"{who}: done before ({run_dir})")
            else:
                print(f"{who}: {spec['students'][kind]['name']} from {start['view']} on {start['removed']}")
                run_fit([*args, "--ckpt_path", "last"])
            res = read_mapping(results, "results file")
            name = spec["students"][kind]["name"]
            records.append(
                {
                    "n": point["n"],
                    "kind": kind,
                    "view": name,
                    "from": start["view"],
                    "method": start["method"],
                    "criterion": start["criterion"],
                    "removed": res["plan"]["removed"],
                    "stock": ships_stock(start["method"]),
                    "params": res["views"][start["view"]]["params"],
                    "metrics": res["views"][name]["metrics"],
                    "start_metrics": res["views"][start["view"]]["metrics"],
                    "pruned_metrics": (res["views"].get("pruned") or {}).get("metrics"),
                    "steps": res["distill"]["steps"],
                    "run": str(run_dir),
                }
            )
    return records
