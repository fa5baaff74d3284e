"""The frontier report (`python -m ghostdistill frontier`): how deep can one cut, and with which repair.

A frontier file names a base fit config (model, recovery entries, calibration, selection and evaluation
data), the run root, the depths and the criteria:

    base: configs/smollm2_frontier.yaml
    root: runs/smollm2_frontier
    num_layers: {first: 1, last: 14}      # or a list: [7, 11]
    criteria: [streamline, repair]

`pipeline.frontier.run_frontier` computes the points; this module checks the file and writes
frontier.json (every row), frontier.csv (one row per depth, criterion, view and source), frontier.md (a
table per evaluation source) and frontier.png (perplexity against blocks removed, log scale, one line per
view and criterion).

What a user can ship: per depth, the best *stock* point (a view that exports as the model's own
architecture, `methods.ships_stock`: the pruned model and the folding methods, e.g. ``rotation_anchored``)
beside the best point that needs the operator module (remote code in transformers, vLLM's Transformers
backend, no GGUF): `shipping` in frontier.md, two envelope lines in frontier.png. The parameter column
counts what the export holds: a folded rotation unties a tied embedding (+ vocab × hidden).
"""

from __future__ import annotations

import csv
import io
from pathlib import Path

from ..core.io import atomic_savefig, atomic_write_json, atomic_write_text, read_mapping
from ..methods import ships_stock

SPEC_KEYS = {"base", "root", "num_layers", "criteria"}
CRITERIA = ("streamline", "repair")


def load_frontier_spec(path: str) -> dict:
    spec = read_mapping(path, "frontier file")
    unknown = set(spec) - SPEC_KEYS
    if unknown:
        raise ValueError(f"frontier file {path}: unknown keys {sorted(unknown)}; valid: {', '.join(sorted(SPEC_KEYS))}")
    for key in ("base", "num_layers"):
        if key not in spec:
            raise ValueError(f"frontier file {path}: missing {key!r}")
    if not isinstance(spec["base"], str) or not Path(spec["base"]).is_file():
        raise FileNotFoundError(f"frontier file {path}: base config {spec['base']!r} does not exist")
    depths = spec["num_layers"]
    if isinstance(depths, dict):
        ends = [depths.get("first"), depths.get("last")]
        if set(depths) != {"first", "last"} or not all(isinstance(e, int) and not isinstance(e, bool) for e in ends):
            raise ValueError(
                f"frontier file {path}: num_layers {depths!r} must be a list of depths or {{first: a, last: b}} "
                "with integers a <= b"
            )
        depths = list(range(ends[0], ends[1] + 1))
    if not isinstance(depths, list) or not depths or not all(isinstance(d, int) and d >= 1 for d in depths):
        raise ValueError(f"frontier file {path}: num_layers {spec['num_layers']!r} must name depths >= 1")
    spec["num_layers"] = sorted(set(depths))
    spec.setdefault("criteria", list(CRITERIA))
    if not isinstance(spec["criteria"], list):
        raise ValueError(f"frontier file {path}: criteria {spec['criteria']!r} must be a list; choose among {CRITERIA}")
    bad = [c for c in spec["criteria"] if c not in CRITERIA]
    if bad or not spec["criteria"]:
        raise ValueError(f"frontier file {path}: criteria {spec['criteria']!r}; choose among {', '.join(CRITERIA)}")
    spec.setdefault("root", "runs/frontier")
    return spec


def flat_rows(points: list[dict]) -> list[dict]:
    """One row per depth, criterion, view and evaluation source (the dense model once, at depth 0)."""
    rows, dense_seen = [], False
    for point in points:
        for row in point["rows"]:
            if row["view"] == "dense":
                if dense_seen:
                    continue
                dense_seen = True
            for source, m in row["metrics"].items():
                rows.append(
                    {
                        "blocks_removed": row["n"],
                        "criterion": row["criterion"],
                        "view": row["view"],
                        "method": row["method"],
                        "removed": "-".join(str(i) for i in row["removed"][:1] + row["removed"][-1:]),
                        "params": row["params"],
                        "source": source,
                        "ppl": m["ppl"],
                        "kl": m.get("kl"),
                        "top1": m.get("top1"),
                        "selection_kl": row["selection_kl"],
                        # Points written before the flag existed: from the method, as the run decides it.
                        "stock": row.get("stock", _stock_method(row["method"])),
                    }
                )
    return rows


def _stock_method(method: str) -> bool:
    try:
        return ships_stock(method)
    except ValueError:  # a method this version no longer registers: not one that folds here
        return False


def best_by_depth(rows: list[dict], source: str) -> dict[int, dict[bool, dict]]:
    """Per depth, the lowest-perplexity row among the stock views (key True) and among the others (False)."""
    best: dict[int, dict[bool, dict]] = {}
    for r in rows:
        if r["source"] != source or r["view"] == "dense":
            continue
        here = best.setdefault(r["blocks_removed"], {})
        if r["stock"] not in here or r["ppl"] < here[r["stock"]]["ppl"]:
            here[r["stock"]] = r
    return best


def shipping(rows: list[dict], source: str) -> list[str]:
    """ "What can I ship at depth n, and how good is it": per depth the best stock checkpoint (view, criterion,
    blocks removed, parameters, perplexity) beside the best one that keeps operators."""

    def cell(r: dict | None) -> str:
        if r is None:
            return "- | - | -"
        return f"{r['view']} ({r['criterion']}, {r['removed'] or '-'}) | {r['params'] / 1e6:.1f}M | {r['ppl']:.2f}"

    lines = [
        "| blocks removed | best stock checkpoint | params | PPL | best with operators | params | PPL |",
        "|---|---|---|---|---|---|---|",
    ]
    for n, pair in sorted(best_by_depth(rows, source).items()):
        lines.append(f"| {n} | {cell(pair.get(True))} | {cell(pair.get(False))} |")
    return lines


def _fmt(v, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def pivot(rows: list[dict], source: str) -> list[str]:
    """One line per depth, one column per view and criterion: its perplexity and the blocks it removes
    (first–last), the lowest of the depth in bold. The frontier at a glance."""
    mine = [r for r in rows if r["source"] == source and r["view"] != "dense"]
    present = {(r["view"], r["criterion"]) for r in mine}
    views = dict.fromkeys(r["view"] for r in mine)  # pruned, then the recovery entries in the config's order
    columns = [(v, c) for v in views for c in CRITERIA if (v, c) in present]
    cells = {(r["blocks_removed"], r["view"], r["criterion"]): r for r in mine}
    lines = [
        "| blocks removed | " + " | ".join(f"{v} ({c})" for v, c in columns) + " |",
        "|---|" + "---|" * len(columns),
    ]
    for n in sorted({r["blocks_removed"] for r in mine}):
        here = [cells.get((n, v, c)) for v, c in columns]
        best = min(r["ppl"] for r in here if r is not None)
        texts = []
        for r in here:
            if r is None:
                texts.append("-")
                continue
            text = f"{r['ppl']:.2f} ({r['removed'] or '-'})"
            texts.append(f"**{text}**" if r["ppl"] == best else text)
        lines.append(f"| {n} | " + " | ".join(texts) + " |")
    return lines


def markdown(points: list[dict], spec: dict) -> str:
    rows = flat_rows(points)
    sources = list(dict.fromkeys(r["source"] for r in rows))
    lines = [
        "# ghostdistill frontier",
        "",
        f"- base config: `{spec['base']}`; depths {spec['num_layers']}; criteria {spec['criteria']}",
        "- per depth: `streamline` is the run of blocks with the highest cosine; `repair` is each view's own run "
        "with the lowest KL(dense ‖ repaired) on the selection windows (`pruned`: the lowest pruned KL)",
        "- KL is KL(dense ‖ view) per token in nats on the evaluation source; selection KL is the criterion's",
        "",
    ]
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
    costs = [p["costs"] for p in points]
    if costs:
        lines.append(
            "Seconds per depth (planning: streamline pass, candidate statistics, fits and scoring; evaluation): "
            + ", ".join(f"n={p['n']}: {c['planning_s']:.0f} + {c['evaluation_s']:.0f}" for p, c in zip(points, costs))
        )
        lines.append("")
    return "\n".join(lines)


def plot(points: list[dict], path: Path, source: str | None = None) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in flat_rows(points) if source is None or r["source"] == source]
    source = source or rows[0]["source"]
    rows = [r for r in rows if r["source"] == source]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    dense = next((r for r in rows if r["view"] == "dense"), None)
    if dense is not None:
        ax.axhline(dense["ppl"], color="black", linewidth=0.8, linestyle=":", label=f"dense ({dense['ppl']:.1f})")
    lines = sorted({(r["view"], r["criterion"]) for r in rows if r["view"] != "dense"})
    for view, criterion in lines:
        mine = sorted(
            (r for r in rows if (r["view"], r["criterion"]) == (view, criterion)), key=lambda r: r["blocks_removed"]
        )
        ax.plot(
            [r["blocks_removed"] for r in mine],
            [r["ppl"] for r in mine],
            marker="o",
            markersize=3,
            linestyle="-" if criterion == "repair" else "--",
            label=f"{view} ({criterion})",
        )
    best = best_by_depth(rows, source)
    for stock, label, style in ((True, "best stock", "-"), (False, "best with operators", ":")):
        depths = [n for n in sorted(best) if stock in best[n]]
        if depths:
            ax.plot(
                depths,
                [best[n][stock]["ppl"] for n in depths],
                color="black",
                linewidth=2.2,
                alpha=0.35,
                linestyle=style,
                label=label,
            )
    ax.set_yscale("log")
    ax.set_xlabel("blocks removed")
    ax.set_ylabel(f"{source} perplexity (log scale)")
    ax.legend(fontsize=7, ncol=2)
    atomic_savefig(fig, path)
    plt.close(fig)


def write(root: Path, points: list[dict], spec: dict) -> list[Path]:
    root.mkdir(parents=True, exist_ok=True)
    rows = flat_rows(points)
    paths = [root / "frontier.json", root / "frontier.csv", root / "frontier.md", root / "frontier.png"]
    atomic_write_json(paths[0], {"spec": spec, "points": points, "rows": rows})
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    atomic_write_text(paths[1], buf.getvalue())
    atomic_write_text(paths[2], markdown(points, spec))
    plot(points, paths[3])
    return paths
