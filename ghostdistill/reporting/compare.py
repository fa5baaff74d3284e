"""The compare report: every method, several plans, one report (`python -m ghostdistill compare`, run
by `ghostdistill.cli`).

A compare file names a base fit config, the plans to run and the run root:

    base: configs/studies/compare/smollm2_methods.yaml
    root: runs/smollm2_compare
    plans:
      - {criterion: streamline, num_layers: 7}
      - {criterion: block_influence, num_layers: 7}
      - {layers: [12, 13, 14]}

Each plan runs as an ordinary `fit` in `<root>/<plan>/` (so each is resumable), and the rows are gathered
into compare.json, compare.csv, compare.md and compare.png. A finished plan is not run again when its
results.json records the settings the fit would now run with (`settings`: methods, data, evaluation,
seed, ...); otherwise it runs again, and the console says which settings differ (`stale_reason`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import get_args, get_origin, get_type_hints

from ..core.checks import check_unique
from ..core.io import atomic_write_json, atomic_write_text, read_spec, spec_name
from ..core.settings import is_cost
from ..planning import PlanConfig
from . import csv_text
from .compare_tables import plot
from .compare_tables import to_markdown as to_markdown

# A plan of a compare file sets `PlanConfig`'s keys; the ones with a folder-name tag (`tag`, marked where the
# key is defined) name its folder when they differ from the default; the cost-only ones never do.
PLAN_FIELDS = {f.name: f for f in fields(PlanConfig)}
_NAMED = {name: f for name, f in PLAN_FIELDS.items() if "tag" in f.metadata}
# A row's scores: a source's metrics or a zero-shot task's accuracy, the others None.
SCORE_COLUMNS = ("ppl", "kl", "top1", "prefix", "acc", "acc_norm", "items")


def load_spec(path: str | Mapping) -> dict:
    """The compare file at `path`, or a mapping of its keys, checked: every plan's keys and values, no two plans
    of one folder, `root` defaulted."""
    spec = read_spec(path, "compare file", ("base", "root", "plans"), ("base", "plans"))
    path = spec_name(path)
    if not isinstance(spec["plans"], list) or not spec["plans"]:
        raise ValueError(f"compare file {path}: plans must be a non-empty list")
    for plan in spec["plans"]:
        bad = set(plan) - PLAN_FIELDS.keys() if isinstance(plan, dict) else {"(not a mapping)"}
        if bad:
            raise ValueError(
                f"compare file {path}: plan {plan!r} has unknown keys {sorted(bad)}; valid: {sorted(PLAN_FIELDS)}"
            )
        check_plan_values(plan, path)
    # Two plans of one folder name would run into one folder: the second would reuse or overwrite the first.
    check_unique(f"compare file {path}: plans (by run folder)", [plan_name(p) for p in spec["plans"]])
    spec.setdefault("root", "runs/compare")
    return spec


def check_plan_values(plan: dict, path: str) -> None:
    """Each plan names its layers or their number, and every value has its key's type (`PlanConfig`'s), before
    any fit runs."""
    if plan.get("layers") is None and plan.get("num_layers") is None:
        raise ValueError(f"compare file {path}: plan {plan!r} names neither num_layers nor layers; give one")
    hints = get_type_hints(PlanConfig)
    for key, value in plan.items():
        if value is None:
            continue
        base = next((a for a in get_args(hints[key]) if a is not type(None)), hints[key])  # X of `X | None`
        kind = get_origin(base) or base
        if kind is list:
            ok = isinstance(value, list) and all(isinstance(i, int) and not isinstance(i, bool) for i in value)
            what = "a list of layer indices"
        elif kind is int:
            ok, what = isinstance(value, int) and not isinstance(value, bool) and value >= 0, "an integer >= 0"
        elif kind is bool:
            ok, what = isinstance(value, bool), "true or false"
        else:
            ok, what = isinstance(value, str), "a string"
        if not ok:
            raise ValueError(f"compare file {path}: plan {plan!r}: {key} {value!r} must be {what}")


def plan_name(plan: dict) -> str:
    """The run folder of a plan: every key that differs from the default is in the name
    (e.g. ``taylor_7_kf4_kl2`` for Taylor+ beside ``taylor_7``)."""
    if plan.get("layers") is not None:
        name = "layers_" + "_".join(str(i) for i in plan["layers"])
    else:
        name = f"{plan.get('criterion', 'streamline')}_{plan['num_layers']}"
    for key, f in _NAMED.items():
        value = plan.get(key, f.default)
        if value != f.default:
            text = (
                "_".join(map(str, value)) if isinstance(value, list) else "" if isinstance(value, bool) else str(value)
            )
            name += f"_{f.metadata['tag']}{text}"
    return name


def greedy_source(plan: dict, finished: list[dict]) -> dict | None:
    """The finished plan whose ``repair_greedy`` steps `plan` can start from (`plan.greedy_from`): the
    same keys but `num_layers` (and what only costs); of several, the one that leaves the fewest steps to
    search, and of those the shortest. None when `plan` is no greedy plan or sets `greedy_from` itself."""
    if plan.get("criterion") != "repair_greedy" or plan.get("greedy_from") is not None:
        return None
    if plan.get("greedy_start") is not None:
        return None  # its search starts from its own blocks (`plan.greedy_start`), not from other steps

    def settings(p: dict) -> dict:
        full = {**{k: f.default for k, f in _NAMED.items()}, **p}
        return {k: v for k, v in full.items() if k != "num_layers" and not is_cost(PLAN_FIELDS[k])}

    n = plan["num_layers"]
    same = [p for p in finished if settings(p) == settings(plan) and p["num_layers"] != n]
    return min(same, key=lambda p: (-min(p["num_layers"], n), p["num_layers"]), default=None)


def plan_config(plan: dict, **given) -> PlanConfig:
    """A plan of the file (and `given` keys) as a `PlanConfig`: every key it does not set takes the default, so
    neither the base config nor a user override leaks a key the plan did not name into its folder."""
    return PlanConfig(**{**plan, **given})


def gather(runs: list[tuple[dict, dict]], spec: dict) -> dict:
    rows = []
    for plan, res in runs:
        recovery = res.get("recovery", {})
        for view, entry in res["views"].items():
            common = {
                "plan": plan_name(plan),
                "criterion": res["plan"]["chosen_by"],
                "layers_removed": len(res["plan"]["removed"]),
                "removed": res["plan"]["removed"],
                "view": view,
                "method": recovery.get(view, {}).get("method", view),
            }
            cost = {
                "params": entry["params"],
                "fit_s": recovery.get(view, {}).get("fit_s"),
                "statistics_s": res["timings"].get("statistics_s"),
            }
            # items: how many zero-shot items were scored (the average row has none of its own).
            scores = [*entry["metrics"].items()] + [
                (f"zeroshot/{task}", {"acc": m["acc"], "acc_norm": m.get("acc_norm"), "items": m.get("n")})
                for task, m in entry.get("zeroshot", {}).items()
            ]
            for source, m in scores:
                rows.append({**common, "source": source, **{k: m.get(k) for k in SCORE_COLUMNS}, **cost})
    first = runs[0][1]
    return {
        "base": spec["base"],
        "model": first["model"],
        "calibration": {k: v for k, v in first["calibration"].items() if k != "token_groups"},
        "evaluation": first["evaluation"],
        "seed": first["calibration"].get("seed"),
        "rows": rows,
    }


def write(root: Path, report: dict) -> None:
    atomic_write_json(root / "compare.json", report)
    rows = [{**r, "removed": " ".join(map(str, r["removed"]))} for r in report["rows"]]
    atomic_write_text(root / "compare.csv", csv_text(rows))
    atomic_write_text(root / "compare.md", to_markdown(report))
    plot(report, root / "compare.png")
