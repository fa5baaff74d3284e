"""The compare report's files from its rows (`reporting.compare.gather`): compare.csv, compare.md (a table per
evaluation source, the chat score's own, zero-shot, the views not to ship) and compare.png."""

from __future__ import annotations

from pathlib import Path

from . import figure
from .flags import flagged


def to_markdown(report: dict) -> str:
    rows = report["rows"]
    plans = list(dict.fromkeys(r["plan"] for r in rows))
    views = list(dict.fromkeys(r["view"] for r in rows))
    sources = list(dict.fromkeys(r["source"] for r in rows if not r["source"].startswith("zeroshot/")))
    chat = [s for s in sources if any(r.get("prefix") is not None for r in rows if r["source"] == s)]
    cal, ev = report["calibration"], report["evaluation"]
    lines = [
        "# ghostdistill compare",
        "",
        f"- model: `{report['model']['source']}` ({report['model']['dtype']})",
        f"- calibration: {cal['source']['source']} (documents {cal['source']['first_document']}–"
        f"{'end' if cal['source']['max_documents'] is None else cal['source']['first_document'] + cal['source']['max_documents'] - 1}), "
        f"{cal['windows']} × {cal['seq_len']} tokens, seed {cal['seed']}",
        f"- evaluation: windows of {ev['seq_len']} tokens; "
        + ", ".join(f"{k}: {v['windows']} windows of {v['source']}" for k, v in ev["sources"].items()),
        "- removed layers: " + "; ".join(f"{p}: {next(r['removed'] for r in rows if r['plan'] == p)}" for p in plans),
        "",
    ]
    for source in sources:
        at = {(r["plan"], r["view"]): r for r in rows if r["source"] == source}
        if source in chat:
            cells = {
                k: f"{r['kl']:.3f} ({r['top1']:.3f}; {r['prefix']:.1f})" for k, r in at.items() if r["kl"] is not None
            }
            title = (
                f"Chat score on {source}: KL to dense on the dense model's greedy answers (top-1 agreement; tokens the "
                "view's greedy answer shares with the dense one before they differ, mean per instruction):"
            )
            lines += _table(title, plans, views, cells)
            continue
        cells = {k: f"{r['ppl']:.2f}" + (f" ({r['kl']:.3f})" if r["kl"] is not None else "") for k, r in at.items()}
        times = {
            v: " / ".join(f"{r['fit_s']:.1f}" for p in plans if (r := at.get((p, v))) and r["fit_s"] is not None)
            for v in views
        }
        title = f"Perplexity on {source} (KL to dense in parentheses; fit time in seconds, after the shared statistics pass):"
        lines += _table(title, plans, views, cells, times)
    if any(r["source"] == "zeroshot/average" for r in rows):
        cells = {(r["plan"], r["view"]): f"{r['acc']:.3f}" for r in rows if r["source"] == "zeroshot/average"}
        lines += _table("Zero-shot average accuracy (lm-evaluation-harness):", plans, views, cells)
    flags = flagged(rows)
    if flags:
        lines += ["Not to ship (flagged as under each run's table, `reporting.results.view_warnings`):", ""]
        lines += [*(f"- {f}" for f in flags), ""]
    stats = {p: next(r["statistics_s"] for r in rows if r["plan"] == p) for p in plans}
    lines += ["Shared statistics pass (s): " + ", ".join(f"{p} {t}" for p, t in stats.items()), ""]
    return "\n".join(lines)


def _table(title: str, plans: list[str], views: list[str], cells: dict, times: dict | None = None) -> list[str]:
    """`title` over a table of a row per view and a column per plan (`cells[plan, view]`, "–" where none);
    with `times`, a last column of each view's fit times."""
    head = plans if times is None else [*plans, "fit time (s)"]
    lines = [title, "", "| method | " + " | ".join(head) + " |", "|---|" + "---|" * len(head)]
    for view in views:
        row = [cells.get((p, view), "–") for p in plans] + ([] if times is None else [times[view] or "–"])
        lines.append(f"| {view} | " + " | ".join(row) + " |")
    return [*lines, ""]


def plot(report: dict, path: Path) -> None:
    rows = [r for r in report["rows"] if r["ppl"] is not None]
    source = rows[0]["source"]
    criteria = list(dict.fromkeys(r["criterion"] for r in rows))
    with figure(path, 1, len(criteria), figsize=(5.2 * len(criteria), 4), squeeze=False) as (fig, axes):
        for ax, crit in zip(axes[0], criteria):
            sub = [r for r in rows if r["criterion"] == crit and r["source"] == source]
            for view in dict.fromkeys(r["view"] for r in sub):
                pts = sorted((r["layers_removed"], r["ppl"]) for r in sub if r["view"] == view)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=view)
            ax.set_yscale("log")
            ax.set_xlabel("layers removed")
            ax.set_ylabel(f"{source} perplexity (log scale)")
            ax.set_title(f"criterion: {crit}", fontsize=9)
            ax.legend(fontsize=7)
