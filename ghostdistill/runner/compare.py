"""`compare`: several runs of one base config, one per plan, gathered into one report. Each run is a typed
`RunConfig` of the base (`dataclasses.replace` of its plan) run directly (`runner.config.ParsedFit.fit`); a
finished run whose results.json records the same settings is read back instead."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from ..core.errors import one_line
from ..core.io import read_mapping, spec_name
from ..core.lock import hold_folder
from ..core.run_folder import check_run_folder
from ..pipeline.settings import stale_reason
from ..planning import check_plan_depth
from ..reporting import compare
from .config import ParsedFit, parse_fit


def compare_plans(spec: str | os.PathLike | Mapping, overrides: Sequence[str] = ()) -> tuple[Path, dict]:
    """`compare` of `spec` (a compare file, or a mapping of its keys) as `cli.runs.run_compare` says, `overrides`
    (``["--data.batch_size", "2"]``) for every plan. Returns the root and the report compare.json holds."""
    name = spec_name(spec)
    spec = compare.load_spec(spec if isinstance(spec, Mapping) else name)
    root = Path(spec["root"])
    base = parse_fit(["--config", spec["base"], *overrides], name)

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
            raise type(err)(f"{name}: plan {compare.plan_name(plan)}: {one_line(err)}") from None
    with hold_folder(root, f"ghostdistill compare {name}", "wait for it to finish, or choose another root"):
        runs = []
        for plan in spec["plans"]:
            plan_dir = compare.plan_name(plan)
            results = root / plan_dir / "results.json"
            # A greedy plan starts from the steps of a finished one of the same settings (fit checks them).
            source = compare.greedy_source(plan, [p for p, _ in runs])
            run = plan_run(plan, **({"greedy_from": str(root / compare.plan_name(source))} if source else {}))
            why = "not run yet"
            if results.is_file():
                why = stale_reason(read_mapping(results, "results file"), plan_run(plan).settings())
                if why:
                    print(f"compare: plan {plan_dir}: {why}; running it again")
            # A plan of other settings is run again on purpose: its results are replaced (`overwrite`).
            done = run.fit(overwrite=True).report.to_dict() if why else read_mapping(results, "results file")
            runs.append((plan, done))
        report = compare.gather(runs, spec)
        compare.write(root, report)
    return root, report
