"""What the frontier recommends (`python -m ghostdistill frontier`): per depth the best stock and the best operator
row (`best_by_depth`, frontier.md's shipping table and the envelopes of frontier.png), where each depth's students
start (`student_starts`), and what is never recommended (`flag`, `reporting.flags`: a repair whose assumption
failed, `rotation_anchored` on a family without a massive first position, was 17.6 times worse than pruned, issue
39). frontier.md lists the rows it passes over, with why.
"""

from __future__ import annotations

from math import inf

from .flags import flag


def best_by_depth(rows: list[dict], source: str, fine_tuned: bool = False) -> dict[int, dict[bool, dict]]:
    """Per depth, the lowest-perplexity row among the stock views (key True) and among the others (False):
    training-free, or with `fine_tuned` among the students; never a row `flag` passes over."""
    best: dict[int, dict[bool, dict]] = {}
    for r in rows:
        if r["source"] != source or r["view"] == "dense" or r.get("fine_tuned", False) != fine_tuned or flag(r, rows):
            continue
        here = best.setdefault(r["blocks_removed"], {})
        if r["stock"] not in here or r["ppl"] < here[r["stock"]]["ppl"]:
            here[r["stock"]] = r
    return best


def student_starts(point: dict) -> dict[str, dict]:
    """Where a depth's students start (`frontier` with `students`): ``stock``, the stock recovery view with the
    lowest selection KL (the held-out windows every plan was chosen on; the pruned model has no closed form to
    start from), and ``operators``, the operator view with the lowest; each its frontier row (view, method,
    criterion, removed blocks). The evaluation windows play no part in the choice. Never a view no better than
    no repair (selection KL at or above the depth's lowest pruned one) or bigger than the dense model. A kind the
    depth has no view of is absent."""
    rows, starts = point["rows"], {}
    floor = min(
        (r["selection_kl"] for r in rows if r["view"] == "pruned" and r["selection_kl"] is not None), default=inf
    )
    dense = next((r["params"] for r in rows if r["view"] == "dense"), inf)
    for row in rows:
        kl = row.get("selection_kl")
        if row["view"] in ("dense", "pruned") or kl is None or kl >= floor or row["params"] > dense:
            continue
        kind = "stock" if row["stock"] else "operators"
        if kind not in starts or kl < starts[kind]["selection_kl"]:
            starts[kind] = row
    return starts
