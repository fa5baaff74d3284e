"""What is not to be shipped, and why (issue 39): a view worse than no repair (the pruned model: perplexity or KL
on the first evaluation source), a view with more parameters than the dense model (pruning that saves nothing:
a folded rotation unties a large vocabulary's head), and a fit whose method's assumption did not hold (its
`notes`). The same judgement in every report: under the table of a run (results.md and the console,
`view_warnings`), per plan in compare.md (`flagged`), and per row of the frontier, which never recommends such a
row (`flag`, read by `frontier_best`).
"""

from __future__ import annotations

from ..methods import get_method


def worse_than_pruned(entry: dict, pruned: dict | None, source: str) -> list[str]:
    """What makes a view's `source` metrics worse than the pruned model's (no repair at all): its perplexity
    and/or its KL to the dense model, each as "<what> <view's> against pruned's <pruned's>"; empty when none."""
    if pruned is None or source not in entry.get("metrics", {}) or source not in pruned.get("metrics", {}):
        return []
    mine, theirs = entry["metrics"][source], pruned["metrics"][source]
    worse = []
    if mine["ppl"] > theirs["ppl"]:
        worse.append(f"perplexity {mine['ppl']:.2f} against pruned's {theirs['ppl']:.2f}")
    if mine.get("kl") is not None and theirs.get("kl") is not None and mine["kl"] > theirs["kl"]:
        worse.append(f"KL {mine['kl']:.3f} against pruned's {theirs['kl']:.3f}")
    return worse


def view_warnings(report: dict) -> list[str]:
    """Lines that flag views not to ship for the module docstring's reasons, each naming the view."""
    views = report.get("views") or {}
    if not views:
        return []
    lines = [line for view in views for line in _view_lines(report, view)]
    for name, fit in (report.get("recovery") or {}).items():
        lines += _notes(name, fit)
    return lines


def view_flags(report: dict, view: str) -> list[str]:
    """`view_warnings`' lines about `view` (its own, and the notes of the recovery entry it comes from), as
    plain sentences: what an export of `view` says on the console and in its model card."""
    recovery = report.get("recovery") or {}
    entry = ((report.get("distill") or {}).get("resolved") or {}).get(view, {}).get("method", view)
    lines = _view_lines(report, view) + (_notes(entry, recovery[entry]) if entry in recovery else [])
    return [line.replace("**", "") for line in lines]


def _view_lines(report: dict, view: str) -> list[str]:
    views = report.get("views") or {}
    entry = views.get(view)
    if entry is None or view in ("dense", "pruned"):
        return []
    source = next(iter(next(iter(views.values()))["metrics"]), None)
    pruned, dense = views.get("pruned"), views.get("dense")
    lines = []
    worse = worse_than_pruned(entry, pruned, source)
    if worse:
        lines.append(
            f"**Warning: {view} is worse than no repair.** On {source} its {' and '.join(worse)}: removing the "
            f"blocks and doing nothing does better, so {view} is not to be shipped."
        )
    if dense is not None and entry["params"] > dense["params"]:
        why = (
            " (the folded rotation unties the tied embedding: the head becomes its own vocabulary × hidden matrix)"
            if _folds_embedding(report, view)
            else ""
        )
        lines.append(
            f"**Warning: {view} is larger than the dense model.** {entry['params'] / 1e6:.1f}M parameters against "
            f"the dense model's {dense['params'] / 1e6:.1f}M{why}: removing blocks saves nothing here."
        )
    return lines


def _notes(name: str, fit: dict) -> list[str]:
    return [f"**Note: {name} ({fit.get('method', name)}).** {n[0].upper()}{n[1:]}." for n in fit.get("notes", [])]


def _folds_embedding(report: dict, view: str) -> bool:
    """Whether `view`'s method folds a rotation into the embedding (a fine-tuned view: its recovery entry's)."""
    recovery = report.get("recovery") or {}
    name = ((report.get("distill") or {}).get("resolved") or {}).get(view, {}).get("method", view)
    try:
        return get_method(recovery.get(name, {}).get("method", name)).folds_embedding
    except ValueError:  # not a registered method (dense, pruned, a method this version no longer has)
        return False


def flagged(rows: list[dict]) -> list[str]:
    """Per plan, each view worse than that plan's pruned model (no repair) on the first evaluation source, in
    perplexity or KL, or with more parameters than the dense model: a line naming the plan and the view."""
    sources = [r["source"] for r in rows if r["ppl"] is not None]
    if not sources:
        return []
    first, lines = sources[0], []
    for plan in dict.fromkeys(r["plan"] for r in rows):
        here = {r["view"]: r for r in rows if r["plan"] == plan and r["source"] == first}
        pruned, dense = here.get("pruned"), here.get("dense")
        for view, r in here.items():
            if view in ("dense", "pruned"):
                continue
            as_entry = lambda x: {"metrics": {first: {"ppl": x["ppl"], "kl": x["kl"]}}}  # noqa: E731
            worse = worse_than_pruned(as_entry(r), as_entry(pruned) if pruned else None, first)
            if worse:
                lines.append(f"plan {plan}: {view} is worse than no repair ({first} {' and '.join(worse)})")
            if dense is not None and r["params"] > dense["params"]:
                lines.append(
                    f"plan {plan}: {view} is larger than the dense model ({r['params'] / 1e6:.1f}M parameters against "
                    f"{dense['params'] / 1e6:.1f}M)"
                )
    return lines


def flag(row: dict, rows: list[dict]) -> str | None:
    """Why a row is not to be recommended, or None: worse than no repair (its perplexity above the pruned
    model's at its depth, on its best plan; a student's: its own run's pruned model), or more parameters than
    the dense model. `best_by_depth` and the bold of `pivot` pass such rows over; frontier.md lists them."""
    if row["view"] in ("dense", "pruned"):
        return None
    if row.get("pruned_ppl") is not None and row["ppl"] > row["pruned_ppl"]:
        return f"worse than no repair (PPL {row['ppl']:.2f} against pruned's {row['pruned_ppl']:.2f})"
    dense = next((r["params"] for r in rows if r["view"] == "dense"), None)
    if dense is not None and row["params"] > dense:
        return f"larger than the dense model ({row['params'] / 1e6:.1f}M parameters against {dense / 1e6:.1f}M)"
    return None
