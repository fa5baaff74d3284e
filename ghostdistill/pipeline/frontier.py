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

Contiguous plans cannot keep a block inside a run of removed ones: on SmolLM2-135M every 11-block run
either contains block 11, which writes the first position's massive activation (a stock repair cannot make
it: `rotation_anchored` 186.98 at 8-18), or removes later blocks. The criterion ``greedy`` (`greedy_rows`)
adds plans of any shape: per view of the frontier file's `greedy.views`, ``repair_greedy`` starts from the
plan of that view at the previous depth with the lowest selection KL (any criterion, so greedy plans chain
from depth to depth) and removes one block at a time, each step keeping the removal whose repaired model is
closest to the dense one on the selection windows. Its candidates are fitted on `greedy.criterion_samples`
calibration windows, the chosen plan on all of them (as `fit` would: sequential gaps from the repaired student),
then scored on the selection windows and evaluated like the other rows. Nothing in the choice reads the
evaluation windows.

`run_frontier` writes each n to `<root>/points/n_<n>.json` as it finishes (atomically), with the settings it
was computed with, so an interrupted frontier resumes at the next n (a saved depth of other settings, or a file
unreadable or edited into another shape, is computed again, and the console says why); `reporting.frontier`
gathers them into frontier.json/.csv/.md and frontier.png. A view's greedy row of depth n goes to
`points/n_<n>_greedy_<view>.json`, keyed by the same settings plus `greedy.criterion_samples` and the plan it
starts from: adding ``greedy`` to a frontier reuses its contiguous depths, and adding a view to `greedy.views`
reuses the other views' searches.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace
from pathlib import Path

from torch import nn

from ..calibration.fit import register_view
from ..core.io import atomic_write_json
from ..core.model import decoder_stack, text_config
from ..core.plan import PruningPlan
from ..core.views import DENSE, PRUNED, PrunedModel
from ..data.run import RunData
from ..methods import ships_stock
from ..planning import PlanInputs, check_plan, score_runs
from ..planning.candidates import first_windows
from ..planning.fitting import RepairFitter
from ..planning.greedy import repair_greedy_plan
from ..planning.scoring import SelectionScorer
from ..reporting.frontier_spec import read_point
from .config import RunConfig
from .evaluate import evaluate
from .settings import frontier_settings, stale_point

GREEDY = "greedy"


def frontier_point(cfg: RunConfig, llm: nn.Module, data: RunData, n: int, criteria: Iterable[str]) -> dict:
    """One depth of the frontier: rows of (criterion, view) with the plan, the selection KL and the
    evaluation metrics, the candidates' table and the costs (the criteria are the frontier file's, checked
    when it is read: `reporting.frontier_spec`)."""
    stack = decoder_stack(llm)
    num_layers = len(stack.layers)
    plan_cfg = replace(cfg.plan, layers=None, num_layers=n, criterion="repair", repair_method=None)
    start = time.perf_counter()
    runs = score_runs(
        plan_cfg, cfg.recovery, llm, stack, data.calibration_batches(), data.selection_batches(), keep_fits=True
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
    windows = {src.label: data.eval_windows(src) for src in cfg.data.evaluation.sources}
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
                dense = view == DENSE
                removed, kl = ([], None) if dense else (plan.removed, runs.rows[first][f"{view}_kl"])
                rows.append(frontier_row(0 if dense else n, criterion, view, methods, removed, kl, result))
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


def frontier_row(
    n: int, criterion: str, view: str, methods: dict, removed, selection_kl: float | None, result, **extra
) -> dict:
    """One (criterion, view) of a depth as frontier.json holds it: the plan, the selection KL, the evaluation
    (`result`: a `reporting.report.ViewResult`) and whether the view exports stock (`methods.ships_stock`: the
    model's own architecture, what a user can ship); `extra` (a greedy row's start) after the plan."""
    method = methods.get(view)
    return {
        "n": n,
        "criterion": criterion,
        "view": view,
        "method": method or view,
        "stock": ships_stock(method),
        "removed": list(removed),
        **extra,
        "selection_kl": selection_kl,
        "params": result.params,
        "metrics": {s: vars(m) for s, m in result.metrics.items()},
    }


def greedy_starts(rows: list[dict], views: Iterable[str]) -> dict[str, list[int]]:
    """Per view, the removed blocks of its row with the lowest selection KL among `rows` (a depth's rows, any
    criterion); a view without rows is absent."""
    starts: dict[str, dict] = {}
    for row in rows:
        if row["view"] in views and row.get("selection_kl") is not None:
            starts[row["view"]] = min(starts.get(row["view"], row), row, key=lambda r: r["selection_kl"])
    return {view: list(row["removed"]) for view, row in starts.items()}


def greedy_rows(
    cfg: RunConfig, llm: nn.Module, data: RunData, n: int, starts: dict[str, list[int]], criterion_samples: int | None
) -> dict:
    """Depth n's ``greedy`` rows (the module docstring's search), per view of `starts` (its previous depth's
    plan) with its recovery entry; `criterion_samples` None: the base config's `plan.criterion_samples` (all
    windows when that is unset). Returns the rows, each search's steps and the costs."""
    stack = decoder_stack(llm)
    entries = {r.name: r for r in cfg.recovery}
    batches, selection = data.calibration_batches(), data.selection_batches()
    windows = {src.label: data.eval_windows(src) for src in cfg.data.evaluation.sources}
    methods = cfg.methods()
    rows, searches, costs = [], {}, {}
    for view, start_blocks in starts.items():
        if len(start_blocks) >= n:
            continue
        entry = entries[view]
        samples = cfg.plan.criterion_samples if criterion_samples is None else criterion_samples
        plan_cfg = replace(
            cfg.plan, layers=None, num_layers=n, criterion="repair_greedy", repair_method=view,
            greedy_start=sorted(start_blocks), greedy_from=None, criterion_samples=samples,
        )  # fmt: skip
        t0 = time.perf_counter()
        inputs = PlanInputs(llm, stack, list(first_windows(batches, samples)), selection=selection)
        plan = repair_greedy_plan(plan_cfg, entry, inputs)
        t1 = time.perf_counter()
        fitter = RepairFitter(llm, [entry], batches)
        fitter.collect_dense(fitter.needed(plan), f"greedy n={n} ({view}): the chosen plan's statistics")
        pruned = fitter.repaired(plan)
        try:
            start = plan.gaps[0].start
            kl = SelectionScorer(llm, selection, starts=[start]).score(pruned, [view], start=start)[view]["kl"]
            result = evaluate(
                pruned, [view], windows, cfg.data.batch_size, chunk=cfg.evaluation.logit_chunk, methods=methods
            )[view]
        finally:
            pruned.remove_hooks()
        start = sorted(start_blocks)
        rows.append(frontier_row(n, GREEDY, view, methods, plan.removed, kl, result, greedy_start=start))
        searches[view] = plan.candidates
        costs[view] = {
            "search_s": round(t1 - t0, 2),
            "fit_and_evaluation_s": round(time.perf_counter() - t1, 2),
            **{k: v for k, v in plan.costs.items() if k != "total_s"},
        }
    return {"rows": rows, "searches": searches, "costs": costs}


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


def check_greedy(cfg: RunConfig, greedy: dict | None) -> list[str]:
    """The views the ``greedy`` criterion extends (every recovery entry when `greedy.views` is unset),
    checked against the recovery entries before any pass."""
    names = [r.name for r in cfg.recovery]
    views = (greedy or {}).get("views") or names
    unknown = [v for v in views if v not in names]
    if unknown:
        raise ValueError(f"frontier greedy.views {unknown} are not recovery entries; choose among {names}")
    return list(views)


def run_frontier(
    cfg: RunConfig,
    llm: nn.Module,
    data: RunData,
    root: Path,
    depths: list[int],
    criteria: Iterable[str],
    greedy: dict | None = None,
) -> list[dict]:
    """Every depth of `depths`, saved and resumed as the module docstring says (`frontier_settings`); returns
    the points in order. With ``greedy`` among `criteria`, each depth after the first gets its greedy rows."""
    criteria = list(criteria)
    greedy = {"views": None, "criterion_samples": None, **(greedy or {})}
    views = check_greedy(cfg, greedy) if GREEDY in criteria else []
    cfg.check_family(llm)
    check_depths(cfg, llm, depths)
    # What needs only the tokenizer (every evaluation source yields its windows), before any pass.
    data.check_before_calibration(getattr(text_config(llm), "max_position_embeddings", None), distilling=False)
    contiguous = [c for c in criteria if c != GREEDY]
    settings = frontier_settings(cfg, contiguous)
    points: list[dict] = []
    for n in depths:
        path = Path(root) / "points" / f"n_{n:02d}.json"
        point = _saved(path, settings, f"frontier n={n}", n)
        if point is None:
            print(f"frontier n={n}: planning and evaluating")
            point = {"settings": settings, **frontier_point(cfg, llm, data, n, contiguous)}
            atomic_write_json(path, point)
        if views and points:
            starts = greedy_starts(points[-1]["rows"], views)
            found: dict[str, dict] = {}
            for view, start in starts.items():
                # One file per view: adding a view to `greedy.views` reuses the others' searches.
                extra = {**settings, "greedy_criterion_samples": greedy["criterion_samples"], "start": start}
                gpath = Path(root) / "points" / f"n_{n:02d}_greedy_{view}.json"
                found[view] = _saved(gpath, extra, f"frontier n={n} greedy {view}", n)
                if found[view] is None:
                    print(f"frontier n={n}: greedy {view} from its plan of n={points[-1]['n']}, {start}")
                    rows = greedy_rows(cfg, llm, data, n, {view: start}, greedy["criterion_samples"])
                    found[view] = {"settings": extra, **rows}
                    atomic_write_json(gpath, found[view])
            point = {
                **point,
                "rows": [*point["rows"], *(r for f in found.values() for r in f["rows"])],
                "greedy": {v: {"search": f["searches"].get(v), "costs": f["costs"].get(v)} for v, f in found.items()},
            }
        points.append(point)
    return points


def _saved(path: Path, settings: dict, what: str, n: int) -> dict | None:
    """The point of depth `n` saved at `path` when it is whole (`read_point`) and of `settings`, else None,
    saying why (it is then computed again and replaced)."""
    if not path.is_file():
        return None
    saved, why = read_point(path, n)
    why = why or stale_point(saved, settings)
    if why is None:
        print(f"{what}: done before ({path})")
        return saved
    print(f"{what}: {path} {why}; computing it again")
    return None
