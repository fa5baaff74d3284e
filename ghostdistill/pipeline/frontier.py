"""The depth–quality frontier: for n = 1 … N blocks removed, the pruned model and every recovery method on
streamline's plan and on its own repair-aware plan, evaluated as `fit` evaluates.

Per n (`frontier_point`), from one calibration pass of statistics:

    runs = planning.score_runs(...)    streamline's cosines (one dense pass); every contiguous candidate's
                                       statistics for every method (one dense pass), fitted and scored by
                                       KL(dense ‖ repaired) on the selection windows
    plans                              per criterion and view: streamline's run, or the view's own lowest
                                       selection KL (``pruned``: the lowest pruned KL)
    evaluate                           every chosen (plan, view) on the evaluation windows, with the fits
                                       from the candidate pass (no second calibration pass)

`run_frontier` writes each n to `<root>/points/n_<n>.json` as it finishes (atomically), with the settings it
was computed with, so an interrupted frontier resumes at the next n (a saved depth of other settings is
computed again, and the console says which differ), and gathers them into frontier.json/.csv/.md and
frontier.png (`reporting.frontier`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, replace
from pathlib import Path

from torch import nn

from ..calibration.fit import register_view
from ..core.io import atomic_write_json
from ..core.model import decoder_stack, text_config
from ..core.plan import PruningPlan
from ..core.views import DENSE, PRUNED, PrunedModel
from ..methods import ships_stock
from ..planning import check_plan, score_runs
from ..reporting.report import other_settings
from .config import RunConfig
from .data import RunData
from .evaluate import evaluate

FRONTIER_CRITERIA = ("streamline", "repair")


def frontier_point(
    cfg: RunConfig,
    llm: nn.Module,
    data: RunData,
    n: int,
    criteria: Iterable[str] = FRONTIER_CRITERIA,
    progress: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
) -> dict:
    """One depth of the frontier: rows of (criterion, view) with the plan, the selection KL and the
    evaluation metrics, the candidates' table and the costs."""
    criteria = list(criteria)
    bad = [c for c in criteria if c not in FRONTIER_CRITERIA]
    if bad:
        raise ValueError(f"frontier criteria {bad} are not known; choose among {', '.join(FRONTIER_CRITERIA)}")
    stack = decoder_stack(llm)
    num_layers = len(stack.layers)
    plan_cfg = replace(cfg.plan, layers=None, num_layers=n, criterion="repair", repair_method=None)
    start = time.perf_counter()
    runs = score_runs(
        plan_cfg,
        cfg.recovery,
        llm,
        stack,
        data.calibration_batches(),
        data.selection_batches(),
        progress,
        keep_fits=True,
    )
    planning_s = time.perf_counter() - start
    views = [PRUNED, *(r.name for r in cfg.recovery)]
    choice = {
        (criterion, view): runs.streamline()
        if criterion == "streamline"
        else runs.best(None if view == PRUNED else view)
        for criterion in criteria
        for view in views
    }
    windows = {src.label: data.eval_ids(src) for src in cfg.data.evaluation.sources}
    methods = cfg.methods()
    rows: list[dict] = []
    start = time.perf_counter()
    for first in sorted(set(choice.values())):
        plan = PruningPlan.from_layers(list(range(first, first + n)), num_layers, allow_edges=True)
        pruned = PrunedModel(llm, plan)
        here = sorted({v for (c, v), s in choice.items() if s == first}, key=views.index)
        try:
            for view in here:
                if view != PRUNED:
                    register_view(pruned, view, {plan.gaps[0].key: runs.fits[(view, first)]})
            wanted = ([DENSE] if not rows else []) + here
            results = evaluate(
                pruned, wanted, windows, cfg.data.batch_size, chunk=cfg.evaluation.logit_chunk, methods=methods
            )
        finally:
            pruned.remove_hooks()
        for view, result in results.items():
            picked = [c for (c, v), s in choice.items() if v == view and s == first] if view != DENSE else ["-"]
            for criterion in picked:
                rows.append(
                    {
                        "n": n if view != DENSE else 0,
                        "criterion": criterion,
                        "view": view,
                        "method": methods.get(view, view),
                        # Exports as the model's own architecture (`methods.ships_stock`): what a user can ship.
                        "stock": ships_stock(methods.get(view)),
                        "removed": list(plan.removed) if view != DENSE else [],
                        "selection_kl": None if view == DENSE else runs.rows[first][f"{view}_kl"],
                        "params": result.params,
                        "metrics": {s: vars(m) for s, m in result.metrics.items()},
                    }
                )
    return {
        "n": n,
        "rows": rows,
        "candidates": {str(i): r for i, r in runs.rows.items()},
        "costs": {
            **runs.costs,
            "planning_s": round(planning_s, 2),
            "evaluation_s": round(time.perf_counter() - start, 2),
        },
    }


def student_starts(point: dict, source: str) -> dict[str, dict]:
    """Where a depth's students start (`frontier` with `students`): ``stock``, the stock recovery view with the
    lowest perplexity on `source` (the pruned model has no closed form to start from), and ``operators``, the
    operator view with the lowest; each its frontier row (view, method, criterion, removed blocks). A kind the
    depth has no view of is absent."""
    starts: dict[str, dict] = {}
    for row in point["rows"]:
        if row["view"] in (DENSE, PRUNED) or source not in row["metrics"]:
            continue
        kind = "stock" if row["stock"] else "operators"
        if kind not in starts or row["metrics"][source]["ppl"] < starts[kind]["metrics"][source]["ppl"]:
            starts[kind] = row
    return starts


def check_depths(cfg: RunConfig, llm: nn.Module, depths: list[int]) -> None:
    """Every depth the model's blocks and the plan's protected edges allow, checked before any data is read
    (a depth at or beyond the number of blocks would otherwise fail after the first depths' passes)."""
    num_layers = len(decoder_stack(llm).layers)
    for n in depths:
        plan_cfg = replace(cfg.plan, layers=None, num_layers=n, criterion="repair", repair_method=None)
        try:
            check_plan(plan_cfg, num_layers)
        except ValueError as err:
            raise ValueError(f"frontier num_layers {n} (of {depths}): {err}") from None


def run_frontier(
    cfg: RunConfig,
    llm: nn.Module,
    data: RunData,
    root: Path,
    depths: list[int],
    criteria: Iterable[str] = FRONTIER_CRITERIA,
    progress: Callable[[Iterable, str], Iterable] = lambda it, desc: it,
    log: Callable[[str], None] = print,
) -> list[dict]:
    """Every depth of `depths`, each saved as it finishes and skipped when saved before with the same
    settings (`frontier_settings`); returns the points in order."""
    check_depths(cfg, llm, depths)
    # What needs only the tokenizer (every evaluation source yields its windows), before any pass.
    data.check_before_calibration(getattr(text_config(llm), "max_position_embeddings", None), distilling=False)
    criteria = list(criteria)
    settings = frontier_settings(cfg, criteria)
    points = []
    for n in depths:
        path = Path(root) / "points" / f"n_{n:02d}.json"
        if path.is_file():
            saved = json.loads(path.read_text())
            why = stale_point(saved, settings)
            if why is None:
                log(f"frontier n={n}: done before ({path})")
                points.append(saved)
                continue
            log(f"frontier n={n}: {path} {why}; computing it again")
        log(f"frontier n={n}: planning and evaluating")
        point = {"settings": settings, **frontier_point(cfg, llm, data, n, criteria, progress)}
        atomic_write_json(path, point)
        points.append(point)
    return points


# What a frontier point does not depend on: the students' and the evaluation's other settings (zero-shot,
# analysis, logit chunks), which only the `fit` of a run reads.
_NOT_FRONTIER = ("distill", "evaluation")


def frontier_settings(cfg: RunConfig, criteria: list[str]) -> dict:
    """The settings a frontier point depends on, as plain data: the model, plan, recovery and data sections
    and the criteria. A field added later with a None default compares equal to its absence
    (`reporting.report.settings_differences`), so new options do not invalidate saved depths."""
    config = {k: v for k, v in asdict(cfg).items() if k not in _NOT_FRONTIER}
    return json.loads(json.dumps({"config": config, "criteria": list(criteria)}, default=str))


def stale_point(saved: dict, settings: dict) -> str | None:
    """Why a saved point cannot be reused under `settings`, or None when it was computed with them."""
    if "settings" not in saved:
        return "records no settings (written by an older version)"
    other = other_settings(saved["settings"], settings)
    return None if other is None else f"was computed with {other}"
