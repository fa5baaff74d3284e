"""The frontier file (`python -m ghostdistill frontier <file>`), checked before anything loads, and the saved
points of a frontier, checked when read back (`point_problem`).

A frontier file names a base fit config (model, recovery entries, calibration, selection and evaluation
data), the run root, the depths and the criteria:

    base: configs/studies/repair-planning/smollm2_frontier.yaml
    root: runs/smollm2_frontier
    num_layers: {first: 1, last: 14}      # or a list: [7, 11]
    criteria: [streamline, repair]       # and `greedy`: extend the previous depth's plans (below)
    greedy: {views: [rotation_anchored], criterion_samples: 8}   # optional, with `greedy` in criteria
    students:                             # optional: fine-tune per depth (one `fit` each, see below)
      config: configs/studies/stock/smollm2_stock_students.yaml      # the fit config they train with (data, steps, rates)
      stock: {name: stock_ft, train: [operators, lora, norms]}   # from the depth's best stock repair
      operators: {name: operators_ft, train: [operators, lora]}  # from the depth's best operator view
      overrides: []                       # fit arguments for the student runs only
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ..core.checks import check_unique
from ..core.io import read_mapping, read_spec, spec_name

SPEC_KEYS = {"base", "root", "num_layers", "criteria", "greedy", "students"}
CRITERIA = ("streamline", "repair", "greedy")
# `greedy` runs a search per view and depth (minutes to an hour each on SmolLM2-135M): asked for, not default.
DEFAULT_CRITERIA = ("streamline", "repair")
GREEDY_KEYS = {"views", "criterion_samples"}
STUDENT_KEYS = {"config", "stock", "operators", "overrides"}


def load_frontier_spec(path: str | Mapping) -> dict:
    """The frontier file at `path`, or a mapping of its keys, checked and completed (depths listed, criteria,
    root, greedy and students defaulted)."""
    spec = read_spec(path, "frontier file", sorted(SPEC_KEYS), ("base", "num_layers"))
    path = spec_name(path)
    depths = spec["num_layers"]
    if isinstance(depths, dict):
        ends = [depths.get("first"), depths.get("last")]
        if set(depths) != {"first", "last"} or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
            raise ValueError(
                f"frontier file {path}: num_layers {depths!r} must be a list of depths or {{first: a, last: b}} "
                "with integers a <= b"
            )
        depths = list(range(ends[0], ends[1] + 1))
    # A bool is an int to Python (`true` would run as n = 1): refused like any other non-integer.
    integers = isinstance(depths, list) and all(isinstance(d, int) and not isinstance(d, bool) for d in depths)
    if not integers or not depths or min(depths) < 1:
        raise ValueError(
            f"frontier file {path}: num_layers {spec['num_layers']!r} must name depths: integers >= 1 (or "
            "{first: a, last: b})"
        )
    spec["num_layers"] = sorted(check_unique(f"frontier file {path}: num_layers", depths))
    spec.setdefault("criteria", list(DEFAULT_CRITERIA))
    if not isinstance(spec["criteria"], list):
        raise ValueError(f"frontier file {path}: criteria {spec['criteria']!r} must be a list; choose among {CRITERIA}")
    bad = [c for c in spec["criteria"] if c not in CRITERIA]
    if bad or not spec["criteria"]:
        raise ValueError(f"frontier file {path}: criteria {spec['criteria']!r}; choose among {', '.join(CRITERIA)}")
    check_unique(f"frontier file {path}: criteria", spec["criteria"])
    spec.setdefault("root", "runs/frontier")
    spec["greedy"] = _check_greedy(path, spec)
    if "students" in spec:
        spec["students"] = _check_students(path, spec["students"])
    return spec


def _check_greedy(path: str, spec: dict) -> dict | None:
    """The `greedy` block: which recovery views extend their plans (`views`, default every entry; checked
    against the base config's entries when it is read) and how many calibration windows the search's
    candidates are fitted on (`criterion_samples`, default the base's `plan.criterion_samples`)."""
    greedy = spec.get("greedy")
    if "greedy" not in spec["criteria"]:
        if greedy is not None:
            raise ValueError(
                f"frontier file {path}: greedy {greedy!r} is set but criteria {spec['criteria']} has no greedy; "
                "add greedy to criteria or remove the greedy block"
            )
        return None
    greedy = {} if greedy is None else greedy
    if not isinstance(greedy, dict) or set(greedy) - GREEDY_KEYS:
        raise ValueError(
            f"frontier file {path}: greedy {greedy!r} must be a mapping with views and/or criterion_samples "
            f"(valid keys: {', '.join(sorted(GREEDY_KEYS))})"
        )
    views = greedy.get("views")
    if views is not None and (not isinstance(views, list) or not views or not all(isinstance(v, str) for v in views)):
        raise ValueError(f"frontier file {path}: greedy.views {views!r} must be a list of recovery entry names")
    check_unique(f"frontier file {path}: greedy.views", views or [])
    samples = greedy.get("criterion_samples")
    if samples is not None and (not isinstance(samples, int) or isinstance(samples, bool) or samples < 1):
        raise ValueError(f"frontier file {path}: greedy.criterion_samples {samples!r} must be an integer >= 1")
    if len(spec["num_layers"]) < 2:
        raise ValueError(
            f"frontier file {path}: criterion greedy extends each depth's plans from the depth before it, and "
            f"num_layers {spec['num_layers']} has one depth; name at least two"
        )
    return {"views": views, "criterion_samples": samples}


def _check_students(path: str, students) -> dict:
    """The `students` block: a fit config that exists, and a `stock` and/or `operators` student (a name ending
    in ``_ft`` and what a `distill.students` entry may hold, but no `method`: the depth's best view is it)."""
    if not isinstance(students, dict) or set(students) - STUDENT_KEYS or "config" not in students:
        raise ValueError(
            f"frontier file {path}: students {students!r} must be a mapping with config and stock and/or operators "
            f"(valid keys: {', '.join(sorted(STUDENT_KEYS))})"
        )
    if not isinstance(students["config"], str) or not Path(students["config"]).is_file():
        raise FileNotFoundError(f"frontier file {path}: students.config {students['config']!r} does not exist")
    kinds = [k for k in ("stock", "operators") if k in students]
    if not kinds:
        raise ValueError(f"frontier file {path}: students names neither a stock nor an operators student")
    for kind in kinds:
        entry = students[kind]
        if not isinstance(entry, dict) or not str(entry.get("name", "")).endswith("_ft"):
            raise ValueError(
                f"frontier file {path}: students.{kind} {entry!r} must be a mapping whose name ends in _ft, e.g. "
                "{name: stock_ft, train: [operators, lora, norms]}"
            )
        if "method" in entry:
            raise ValueError(
                f"frontier file {path}: students.{kind} sets method {entry['method']!r}; leave it out: each depth's "
                f"student starts from that depth's best {kind} view"
            )
    if len({students[k]["name"] for k in kinds}) < len(kinds):
        raise ValueError(f"frontier file {path}: students.stock and students.operators need different names")
    overrides = students.setdefault("overrides", [])
    if not isinstance(overrides, list) or not all(isinstance(a, str) for a in overrides):
        raise ValueError(f"frontier file {path}: students.overrides {overrides!r} must be a list of fit arguments")
    return students


def read_point(path: Path, n: int) -> tuple[dict | None, str | None]:
    """(the point saved at `path`, None) when it is readable and whole for depth `n` (`point_problem`), else
    (None, why)."""
    try:
        saved = read_mapping(path, "saved frontier point")
    except (ValueError, FileNotFoundError) as err:
        return None, f"cannot be read back ({err})"
    why = point_problem(saved, n)
    return (None, why) if why else (saved, None)


def point_problem(saved: dict, n: int) -> str | None:
    """What makes a saved point (a depth's, or a view's greedy rows) unusable for depth `n`, or None: its rows
    must be a list of rows of this depth (the dense one at 0), each with its view, plan, parameters and
    metrics, as `frontier_point` and `greedy_rows` write them."""
    if "n" in saved and (not isinstance(saved["n"], int) or isinstance(saved["n"], bool) or saved["n"] != n):
        return f"says n = {saved['n']!r}, but it is the file of depth {n} (edited or misnamed)"
    rows = saved.get("rows")
    if not isinstance(rows, list):
        return f"is not a saved frontier point (its rows are {type(rows).__name__} {str(rows)[:40]!r}, not a list)"
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not _ROW_KEYS <= set(row):
            missing = sorted(_ROW_KEYS - set(row)) if isinstance(row, dict) else "all"
            return f"is not a saved frontier point (row {i} lacks {missing})"
        if row["n"] not in (n, 0) or (row["n"] == 0) != (row["view"] == "dense"):
            return f"is not a saved frontier point (row {i}, {row['view']}, is of depth {row['n']!r}, not {n})"
        metrics = row["metrics"]
        if not isinstance(metrics, dict) or not all(
            isinstance(m, dict) and isinstance(m.get("ppl"), (int, float)) for m in metrics.values()
        ):
            return f"is not a saved frontier point (row {i}, {row['view']}: metrics {str(metrics)[:60]!r})"
        if not isinstance(row["params"], int) or not isinstance(row["removed"], list):
            return f"is not a saved frontier point (row {i}, {row['view']}: params or removed blocks of the wrong type)"
    return None


_ROW_KEYS = {"n", "criterion", "view", "method", "removed", "selection_kl", "params", "metrics"}
