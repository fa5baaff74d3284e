"""`compare` and `frontier`: several runs of one base config, gathered into one report. Each run is a typed
`RunConfig` of the base (`dataclasses.replace` of its sections: a plan, a student) run directly
(`cli.config.fit_parsed`); a finished run whose results.json records the same settings is read back instead."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from ..core.errors import one_line
from ..core.io import json_digest, read_mapping
from ..core.lock import hold_folder
from ..core.run_folder import check_run_folder
from ..distill.config import StudentConfig
from ..methods import RecoveryConfig, ships_stock
from ..pipeline.settings import stale_reason
from ..planning import check_plan_depth, check_selection
from ..reporting import compare
from .config import ParsedFit, fit_parsed, parse_fit, typed


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
    spec = compare.load_spec(ns.spec)
    root = Path(spec["root"])
    base = parse_fit(["--config", spec["base"], *ns.overrides], ns.spec)

    def plan_run(plan: dict, **given) -> ParsedFit:
        return base.replace(root / compare.plan_name(plan), plan=compare.plan_config(plan, **given))

    # Every plan's run config is checked before the first one runs (a bad plan value, a plan the model's depth
    # does not allow, a plan folder that is not a run folder: one line naming the plan).
    for plan in spec["plans"]:
        try:
            cfg = plan_run(plan).cfg
            cfg.validate(data=False)
            check_plan_depth(cfg.plan, cfg.model)
            check_run_folder(root / compare.plan_name(plan), "its run folder")
        except (ValueError, OSError) as err:
            raise type(err)(f"{ns.spec}: plan {compare.plan_name(plan)}: {one_line(err)}") from None
    with hold_folder(root, f"ghostdistill compare {ns.spec}", "wait for it to finish, or choose another root"):
        runs = []
        for plan in spec["plans"]:
            name = compare.plan_name(plan)
            results = root / name / "results.json"
            # A greedy plan starts from the steps of a finished one of the same settings (fit checks them).
            source = compare.greedy_source(plan, [p for p, _ in runs])
            run = plan_run(plan, **({"greedy_from": str(root / compare.plan_name(source))} if source else {}))
            why = "not run yet"
            if results.is_file():
                why = stale_reason(read_mapping(results, "results file"), plan_run(plan).settings())
                if why:
                    print(f"compare: plan {name}: {why}; running it again")
            # A plan of other settings is run again on purpose: its results are replaced (`overwrite`).
            done = fit_parsed(run, overwrite=True).report.to_dict() if why else read_mapping(results, "results file")
            runs.append((plan, done))
        compare.write(root, compare.gather(runs, spec))
    print(f"compare report written to {root}/compare.md")
    return root


def run_frontier_command(argv: list[str]) -> Path:
    """`frontier <frontier.yaml> [fit overrides]`: per depth, the pruned model and every recovery entry of the
    base config on streamline's plan and on its own repair-aware plan, and with ``greedy`` among the criteria on
    the plan `repair_greedy` grows from the depth before (`pipeline.frontier`), resumable per depth; with
    `students` in the file, then per depth the stock and operator students (`frontier_students`);
    frontier.json/csv/md/png in the root. The training-free part runs no Trainer: the phases are called
    directly. The fit overrides apply to the student runs too (the same model)."""
    import gc

    import torch
    from lightning.pytorch import seed_everything

    from ..pipeline.frontier import check_greedy, run_frontier
    from ..pipeline.run import Run
    from ..reporting import frontier

    parser = argparse.ArgumentParser(prog="ghostdistill frontier", description=run_frontier_command.__doc__)
    parser.add_argument("spec", help="the frontier file (YAML: base config, root, num_layers, criteria)")
    parser.add_argument("overrides", nargs=argparse.REMAINDER, help="fit overrides, e.g. --data.batch_size 2")
    ns = parser.parse_args(argv)
    spec = frontier.load_frontier_spec(ns.spec)
    root = Path(spec["root"])
    base = parse_fit(["--config", spec["base"], *ns.overrides], ns.spec)
    run = Run(base.cfg)  # the same `pipeline.run.Run` as `fit`'s, its config complete and validated
    check_selection(run.cfg.data, "frontier")
    if "greedy" in spec["criteria"]:
        check_greedy(run.cfg, spec["greedy"])  # a view that is no recovery entry, before the model loads
    students = None
    if "students" in spec:  # a bad student setting is refused before the first pass
        students = parse_fit(
            ["--config", spec["students"]["config"], *ns.overrides, *spec["students"]["overrides"]], "frontier students"
        )
        check_frontier_students(spec, base, students)
    with hold_folder(root, f"ghostdistill frontier {ns.spec}", "wait for it to finish, or choose another root"):
        seed_everything(base.rest.get("seed_everything"))  # as a `fit` of the base config seeds itself
        # The device a `fit` of the base config runs its single process on (its `trainer.accelerator`).
        accelerator = str((base.rest.get("trainer") or {}).get("accelerator") or "auto")
        run.load().to("cuda" if accelerator in ("auto", "gpu", "cuda") and torch.cuda.is_available() else "cpu")
        run.setup(root, checks=False)  # `run_frontier` checks every depth instead of the base plan
        points = run_frontier(
            run.cfg, run.llm, run.data, root, spec["num_layers"], spec["criteria"], greedy=spec.get("greedy")
        )
        records = []
        if students is not None:
            run.llm = run.data = run.pruned = None  # each student's fit loads the model itself
            gc.collect()
            records = frontier_students(spec, points, base.cfg, students, root)
        frontier.write(root, points, spec, records)
    print(f"frontier report written to {root}/frontier.md")
    return root


def student_run(spec: dict, cfg, students: ParsedFit, start: dict, kind: str) -> ParsedFit:
    """The `fit` of one depth's `kind` student: `students.config` with the command line's and `students.overrides`,
    on the start view's plan (its removed blocks), with its recovery entry (the frontier's, with its resolved
    settings: what its fit sees) and the student itself, starting from that view."""
    entry = next(r for r in cfg.recovery if r.name == start["view"])
    student = typed(StudentConfig, {**spec["students"][kind], "method": start["view"]}, f"frontier students.{kind}")
    plan = replace(students.cfg.plan, layers=list(start["removed"]), num_layers=None)
    distill = replace(students.cfg.distill, students=[student])
    return students.replace(plan=plan, recovery=[RecoveryConfig(**entry.settings())], distill=distill)


def check_frontier_students(spec: dict, base: ParsedFit, students: ParsedFit) -> None:
    """Every student run is valid (its config, the overrides, the student's keys) on a stand-in plan of the
    first depth, from each recovery entry of its kind, and trains the frontier's model: checked before the
    frontier's first pass, which may take hours."""
    n = spec["num_layers"][0]
    cfg = base.cfg
    for kind in [k for k in ("stock", "operators") if k in spec["students"]]:
        mine = [r for r in cfg.recovery if ships_stock(r.method) == (kind == "stock")]
        if not mine:
            raise ValueError(
                f"frontier file: students.{kind} needs a {kind} recovery entry in {spec['base']} to start from; "
                f"its entries are {[f'{r.name} ({r.method})' for r in cfg.recovery]}"
            )
        for entry in mine:
            run = student_run(spec, cfg, students, {"view": entry.name, "removed": list(range(1, 1 + n))}, kind)
            try:
                run.cfg.validate(data=False)
            except ValueError as err:
                raise ValueError(f"frontier students.{kind}: {err}") from None
            if run.cfg.model != cfg.model:
                raise ValueError(
                    f"frontier file: students.config {spec['students']['config']} trains model {run.settings()['model']['model']}, "
                    f"not the frontier's {base.settings()['model']['model']}; set students.config's model (or students.overrides) to the same"
                )


def frontier_students(spec: dict, points: list[dict], cfg, students: ParsedFit, root: Path) -> list[dict]:
    """Per depth and kind (`stock`, `operators`), one `fit` of the student from the depth's best view of that
    kind (lowest selection KL, `reporting.frontier.student_starts`), in `<root>/students/n_<n>_<kind>-<settings digest>`:
    a finished one is read back, an interrupted one resumes from its last checkpoint (the digest keeps another
    setting's checkpoint out). Returns a record per student: its metrics, its start view's in the same run, the
    parameters its export holds (the start view's: LoRA and norms merge)."""
    from ..reporting.frontier import student_starts

    records = []
    for point in points:
        starts = student_starts(point)
        for kind in [k for k in ("stock", "operators") if k in spec["students"]]:
            start = starts.get(kind)
            if start is None:
                print(f"frontier students n={point['n']}: no {kind} view to start a student from; skipped")
                continue
            run = student_run(spec, cfg, students, start, kind)
            who = f"frontier students n={point['n']} {kind}"
            run_dir = root / "students" / f"n_{point['n']:02d}_{kind}-{json_digest(run.settings())[:10]}"
            results = run_dir / "results.json"
            if results.is_file():
                print(f"{who}: done before ({run_dir})")
                res = read_mapping(results, "results file")
            else:
                print(f"{who}: {spec['students'][kind]['name']} from {start['view']} on {start['removed']}")
                res = fit_parsed(run.replace(run_dir), ckpt_path="last").report.to_dict()
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
