"""`frontier`: per depth, the training-free frontier of the base config (`pipeline.frontier`: every recovery
entry on streamline's plan, on its repair-aware plan and, with ``greedy``, on the plan grown from the depth
before), then with `students` the stock and operator students trained per depth (one `fit` each,
`frontier_students`), gathered into one report (`frontier_depths`)."""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from ..core.io import json_digest, read_mapping, spec_name
from ..core.lock import hold_folder
from ..distill.config import StudentConfig
from ..methods import RecoveryConfig, ships_stock
from ..pipeline.frontier import check_greedy, run_frontier
from ..pipeline.run import Run, fit_device
from ..planning import check_selection
from ..reporting import frontier
from ..reporting.frontier import student_starts
from .config import ParsedFit, parse_fit, typed


def frontier_depths(spec: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> tuple[Path, dict]:
    """The frontier of `spec` (a frontier file, or a mapping of its keys), as `cli.runs.run_frontier_command`
    says; `overrides` (``["--data.batch_size", "2"]``) apply to the student runs too. Returns the root and the
    report frontier.json holds."""
    from lightning.pytorch import seed_everything

    name = spec_name(spec)
    spec = frontier.load_frontier_spec(spec if isinstance(spec, Mapping) else name)
    root = Path(spec["root"])
    base = parse_fit(["--config", spec["base"], *overrides], name)
    run = Run(base.cfg)  # the same `pipeline.run.Run` as `fit`'s, its config complete and validated
    check_selection(run.cfg.data, "frontier")
    if "greedy" in spec["criteria"]:
        check_greedy(run.cfg, spec["greedy"])  # a view that is no recovery entry, before the model loads
    students = None
    if "students" in spec:  # a bad student setting is refused before the first pass
        students = parse_fit(
            ["--config", spec["students"]["config"], *overrides, *spec["students"]["overrides"]], "frontier students"
        )
        check_frontier_students(spec, base, students)
    with hold_folder(root, f"ghostdistill frontier {name}", "wait for it to finish, or choose another root"):
        seed_everything(base.rest.get("seed_everything"))  # as a `fit` of the base config seeds itself
        # The device a `fit` of the base config runs its single process on (its `trainer.accelerator`).
        run.load().to(fit_device((base.rest.get("trainer") or {}).get("accelerator")))
        run.setup(root, checks=False)  # `run_frontier` checks every depth instead of the base plan
        points = run_frontier(
            run.cfg, run.llm, run.data, root, spec["num_layers"], spec["criteria"], greedy=spec.get("greedy")
        )
        records = []
        if students is not None:
            run.llm = run.data = run.pruned = None  # each student's fit loads the model itself
            gc.collect()
            records = frontier_students(spec, points, base.cfg, students, root)
        report = frontier.write(root, points, spec, records)
    return root, report


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
                res = run.replace(run_dir).fit(ckpt_path="last").report.to_dict()
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
