"""The frontier report (`python -m ghostdistill frontier`): how deep can one cut, and with which repair.

The frontier file: `reporting.frontier_spec`. `pipeline.frontier.run_frontier` computes the points; this module
writes frontier.json (every row), frontier.csv (one row per depth, criterion, view and source), frontier.md (a
table per evaluation source) and frontier.png (perplexity against blocks removed, log scale, one line per
view and criterion). A plan is written as its runs of removed blocks, first-last each (`spans`: ``12-18``;
a greedy plan ``4-7+12-18``).

What a user can ship: per depth, the best *stock* point (a view that exports as the model's own
architecture, `methods.ships_stock`: the pruned model and the folding methods, e.g. ``rotation_anchored``)
beside the best point that needs the operator module (remote code in transformers, vLLM's Transformers
backend, no GGUF): `shipping` in frontier.md, two envelope lines in frontier.png. The parameter column
counts what the export holds: a folded rotation unties a tied embedding (+ vocab × hidden).

With `students`, each depth also gets the fine-tuned answer: the stock student starts from the depth's best stock
repair on that view's plan, the operator student from the best operator view on its plan (`student_starts`).
Each is one `fit` of `students.config` (`runner.frontier.frontier_students`), so the fine-tuned columns use that
config's data and evaluation, which may differ from the base config's: frontier.md says which.
"""

from __future__ import annotations

from pathlib import Path

from ..core.io import atomic_write_json, atomic_write_text
from ..core.plan import gaps_of
from ..methods import ships_stock
from . import csv_text, figure
from .frontier_best import best_by_depth, flag
from .frontier_best import student_starts as student_starts
from .frontier_spec import CRITERIA
from .frontier_spec import load_frontier_spec as load_frontier_spec

# A student row's criterion: the plan it trained on came from the training-free rows (its `from` view's).
FINE_TUNED = "fine-tuned"


def flat_rows(points: list[dict], students: list[dict] = ()) -> list[dict]:
    """One row per depth, criterion, view and evaluation source (the dense model once, at depth 0), then one
    per student (`runner.frontier.frontier_students`) and source, criterion ``fine-tuned``."""
    rows, dense_seen = [], False
    for point in points:
        for row in point["rows"]:
            if row["view"] == "dense" and dense_seen:
                continue
            dense_seen |= row["view"] == "dense"
            for source, m in row["metrics"].items():
                rows.append(
                    _flat(row, row["criterion"], source, m, selection_kl=row["selection_kl"])
                    | {
                        # Points written before the flag existed: from the method, as the run decides it.
                        "stock": row.get("stock", _stock_method(row["method"])),
                        "fine_tuned": False,
                        "from": None,
                        "start_ppl": None,
                        # No repair at this depth: the pruned model on its best plan (`flag`).
                        "pruned_ppl": _pruned_ppl(point, source),
                    }
                )
    for student in students:
        for source, m in student["metrics"].items():
            rows.append(
                _flat(student, FINE_TUNED, source, m, selection_kl=None)
                | {
                    "stock": student["stock"],
                    "fine_tuned": True,
                    "from": student["from"],
                    # The view it started from, training-free, in the student's own run (its data and windows).
                    "start_ppl": student["start_metrics"][source]["ppl"],
                    "pruned_ppl": ((student.get("pruned_metrics") or {}).get(source) or {}).get("ppl"),
                }
            )
    return rows


def _flat(row: dict, criterion: str, source: str, m: dict, **rest) -> dict:
    """A row's (or a student's) columns up to `top1` on one source, then `rest`."""
    return {
        "blocks_removed": row["n"],
        "criterion": criterion,
        "view": row["view"],
        "method": row["method"],
        "removed": spans(row["removed"]),
        "params": row["params"],
        "source": source,
        "ppl": m["ppl"],
        "kl": m.get("kl"),
        "top1": m.get("top1"),
        **rest,
    }


def _pruned_ppl(point: dict, source: str) -> float | None:
    """The lowest perplexity of the pruned model (no repair) on `source` among a depth's plans."""
    found = [r["metrics"][source]["ppl"] for r in point["rows"] if r["view"] == "pruned" and source in r["metrics"]]
    return min(found, default=None)


def spans(removed: list[int]) -> str:
    """The removed blocks as runs (`core.plan.gaps_of`), first-last each: ``12-18``, or ``4-7+12-18`` for a greedy
    plan; a run of one block is its index."""
    return "+".join(g.key if len(g) > 1 else str(g.start) for g in gaps_of(removed))


def _stock_method(method: str) -> bool:
    try:
        return ships_stock(method)
    except ValueError:  # a method this version no longer registers: not one that folds here
        return False


def shipping(rows: list[dict], source: str) -> list[str]:
    """ "What can I ship at depth n, and how good is it": per depth the best stock checkpoint (view, criterion,
    blocks removed, parameters, perplexity) beside the best one that keeps operators; with students, each
    followed by its fine-tuned answer (the student, the view it started from, its perplexity)."""

    def cell(r: dict | None) -> str:
        if r is None:
            return "- | - | -"
        return f"{r['view']} ({r['criterion']}, {r['removed'] or '-'}) | {r['params'] / 1e6:.1f}M | {r['ppl']:.2f}"

    def tuned(r: dict | None) -> str:
        if r is None:
            return "- | -"
        return f"{r['view']} (from {r['from']} at {r['start_ppl']:.2f}, {r['removed']}) | {r['ppl']:.2f}"

    free, ft = best_by_depth(rows, source), best_by_depth(rows, source, fine_tuned=True)
    # Per side (stock: True), its best training-free checkpoint and, with students, its fine-tuned answer.
    sides = {
        True: ("best stock checkpoint", "stock, fine-tuned"),
        False: ("best with operators", "with operators, fine-tuned"),
    }
    head = "".join(
        f" {best} | params | PPL |" + (f" {student} | PPL |" if ft else "") for best, student in sides.values()
    )
    lines = [f"| blocks removed |{head}", "|---|" + "---|" * head.count("|")]
    for n in sorted(set(free) | set(ft)):
        pair, tuned_pair = free.get(n, {}), ft.get(n, {})
        cells = [cell(pair.get(side)) + (f" | {tuned(tuned_pair.get(side))}" if ft else "") for side in sides]
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return lines


def _fmt(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def pivot(rows: list[dict], source: str) -> list[str]:
    """One line per depth, one column per view and criterion: its perplexity and the blocks it removes
    (first–last), the lowest of the depth in bold. The frontier at a glance."""
    mine = [r for r in rows if r["source"] == source and r["view"] != "dense"]
    present = {(r["view"], r["criterion"]) for r in mine}
    views = dict.fromkeys(r["view"] for r in mine)  # pruned, then the recovery entries in the config's order
    columns = [(v, c) for v in views for c in (*CRITERIA, FINE_TUNED) if (v, c) in present]
    cells = {(r["blocks_removed"], r["view"], r["criterion"]): r for r in mine}
    lines = [
        "| blocks removed | " + " | ".join(f"{v} ({c})" for v, c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for n in sorted({r["blocks_removed"] for r in mine}):
        here = [cells.get((n, v, c)) for v, c in columns]
        best = min((r["ppl"] for r in here if r is not None and not flag(r, rows)), default=None)
        texts = []
        for r in here:
            text = "-" if r is None else f"{r['ppl']:.2f} ({r['removed'] or '-'})"
            texts.append(f"**{text}**" if r is not None and r["ppl"] == best and not flag(r, rows) else text)
        lines.append(f"| {n} | " + " | ".join(texts) + " |")
    return lines


def markdown(points: list[dict], spec: dict, students: list[dict] = ()) -> str:
    rows = flat_rows(points, students)
    sources = list(dict.fromkeys(r["source"] for r in rows))
    lines = [
        "# ghostdistill frontier",
        "",
        f"- base config: `{spec['base']}`; depths {spec['num_layers']}; criteria {spec['criteria']}",
        "- per depth: `streamline` is the run of blocks with the highest cosine; `repair` is each view's own run "
        "with the lowest KL(dense ‖ repaired) on the selection windows (`pruned`: the lowest pruned KL); "
        "`greedy` starts from the view's plan of the depth before with the lowest selection KL and removes one "
        "block at a time, each the lowest selection KL (`repair_greedy`): plans of any shape",
        "- KL is KL(dense ‖ view) per token in nats on the evaluation source; selection KL is the criterion's",
    ]
    if students:
        config = spec["students"]["config"]
        lines.append(
            f"- fine-tuned: one `fit` of `{config}` per depth and student (its data, steps and evaluation), from the "
            "depth's best stock repair and best operator view on their plans; runs in "
            + ", ".join(f"`{s['run']}`" for s in students)
        )
    lines.append("")
    for source in sources:
        dense = next((r["ppl"] for r in rows if r["source"] == source and r["view"] == "dense"), None)
        lines += [
            f"## {source}: perplexity by depth" + (f" (dense {dense:.2f})" if dense is not None else ""),
            "",
            *pivot(rows, source),
            "",
            f"## {source}: what you can ship at each depth",
            "",
            "Stock: the model's own architecture (the pruned model, or a repair folded into the weights), which "
            "transformers, vLLM and llama.cpp run as they are. With operators: the operator module, served through "
            "transformers' remote code or vLLM's Transformers backend, no GGUF.",
            "",
            *shipping(rows, source),
            "",
            f"## {source}",
            "",
            "| blocks removed | criterion | view | removed | params | PPL | KL | top-1 | selection KL |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            if r["source"] == source:
                lines.append(
                    f"| {r['blocks_removed']} | {r['criterion']} | {r['view']} | {r['removed'] or '-'} | "
                    f"{r['params'] / 1e6:.1f}M | {r['ppl']:.2f} | {_fmt(r['kl'], 3)} | {_fmt(r['top1'], 3)} | "
                    f"{_fmt(r['selection_kl'], 4)} |"
                )
        lines.append("")
        flags = [(r, flag(r, rows)) for r in rows if r["source"] == source]
        flags = [f"- n={r['blocks_removed']}, {r['criterion']}: {r['view']} is {why}" for r, why in flags if why]
        if flags:
            lines += [f"Not recommended above (no bold, not the best of its depth) on {source}:", "", *flags, ""]
    costs = [p["costs"] for p in points]
    if costs:
        lines.append(
            "Seconds per depth (planning: streamline pass, candidate statistics, fits and scoring; evaluation): "
            + ", ".join(f"n={p['n']}: {c['planning_s']:.0f} + {c['evaluation_s']:.0f}" for p, c in zip(points, costs))
        )
        lines.append("")
    return "\n".join(lines)


def plot(points: list[dict], path: Path, students: list[dict] = ()) -> None:
    rows = flat_rows(points, students)
    source = rows[0]["source"]  # the first evaluation source
    rows = [r for r in rows if r["source"] == source]
    with figure(path, figsize=(7.5, 4.2)) as (fig, ax):
        dense = next((r for r in rows if r["view"] == "dense"), None)
        if dense is not None:
            ax.axhline(dense["ppl"], color="black", linewidth=0.8, linestyle=":", label=f"dense ({dense['ppl']:.1f})")
        lines = sorted({(r["view"], r["criterion"]) for r in rows if r["view"] != "dense" and not r["fine_tuned"]})
        for view, criterion in lines:
            pts = sorted(
                (r["blocks_removed"], r["ppl"]) for r in rows if (r["view"], r["criterion"]) == (view, criterion)
            )
            style = {"repair": "-", "greedy": "-."}.get(criterion, "--")
            ax.plot(*zip(*pts), marker="o", markersize=3, linestyle=style, label=f"{view} ({criterion})")
        envelopes = (
            (False, True, "best stock", "-", "black"),
            (False, False, "best with operators", ":", "black"),
            (True, True, "stock, fine-tuned", "-", "tab:red"),
            (True, False, "with operators, fine-tuned", ":", "tab:red"),
        )
        for fine_tuned, stock, label, style, color in envelopes:
            best = best_by_depth(rows, source, fine_tuned)
            depths = [n for n in sorted(best) if stock in best[n]]
            if depths:
                ax.plot(
                    depths,
                    [best[n][stock]["ppl"] for n in depths],
                    color=color,
                    marker="s" if fine_tuned else None,
                    linewidth=2.2,
                    alpha=0.35 if not fine_tuned else 0.6,
                    linestyle=style,
                    label=label,
                )
        ax.set_yscale("log")
        ax.set_xlabel("blocks removed")
        ax.set_ylabel(f"{source} perplexity (log scale)")
        ax.legend(fontsize=7, ncol=2)


def write(root: Path, points: list[dict], spec: dict, students: list[dict] = ()) -> dict:
    """frontier.json, .csv, .md and .png in `root`; returns what frontier.json holds."""
    root.mkdir(parents=True, exist_ok=True)
    rows = flat_rows(points, students)
    report = {"spec": spec, "points": points, "students": list(students), "rows": rows}
    atomic_write_json(root / "frontier.json", report)
    atomic_write_text(root / "frontier.csv", csv_text(rows))
    atomic_write_text(root / "frontier.md", markdown(points, spec, students))
    plot(points, root / "frontier.png", students=students)
    return report
