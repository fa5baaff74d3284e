"""The repair-aware criteria's candidates in results.md (a table) and plan.png (KL by start block)."""

from __future__ import annotations

from pathlib import Path

from . import figure


def plan_section(report: dict) -> str:
    """Markdown: for ``repair`` one row per candidate run (streamline's cosine, pruned and repaired KL);
    for ``repair_greedy`` one row per step (the block kept, its KL, the runner-up). Empty for other plans."""
    plan = report.get("plan", {})
    candidates = plan.get("candidates") or {}
    if not candidates:
        return ""
    costs = plan.get("costs", {})
    chosen = "-".join(str(i) for i in (plan["removed"][0], plan["removed"][-1]))
    lines = [f"## Plan candidates ({plan.get('chosen_by')})", ""]
    if all("repaired_kl" in row for row in candidates.values()):
        lines += ["| blocks | streamline cosine | pruned KL | repaired KL | repaired top-1 |", "|---|---|---|---|---|"]
        best_cos = max(candidates, key=lambda k: candidates[k]["cosine"])
        for key, row in candidates.items():
            mark = " **(chosen)**" if key == chosen else (" (streamline's)" if key == best_cos else "")
            lines.append(
                f"| {key}{mark} | {row['cosine']:.4f} | {row['pruned_kl']:.4f} | {row['repaired_kl']:.4f} "
                f"| {row['repaired_top1']:.4f} |"
            )
        if costs:
            lines += [
                "",
                f"{costs.get('candidates')} candidates, {costs.get('dense_passes')} dense pass(es) of statistics; "
                f"{costs.get('total_s', 0):.1f} s in all, {costs.get('relative_to_streamline', 0):.1f}× the "
                f"streamline pass ({costs.get('streamline_s', 0):.2f} s) measured in the same run.",
            ]
    else:
        lines += ["| step | block kept | KL after it | runner-up (KL) |", "|---|---|---|---|"]
        for step, row in candidates.items():
            tried = sorted(row["tried"].items(), key=lambda kv: kv[1])
            runner = f"{tried[1][0]} ({tried[1][1]:.4f})" if len(tried) > 1 else "-"
            taken = " (taken)" if row.get("reused") else ""
            lines.append(f"| {step.removeprefix('step ')}{taken} | {row['kept']} | {row['kl']:.4f} | {runner} |")
        if costs:
            reused = costs.get("reused_steps") or 0
            lines += [
                "",
                (f"Steps 1–{reused} taken from plan.greedy_from's run (searched there); here: " if reused else "")
                + (f"started from plan.greedy_start {costs['start']} removed; " if costs.get("start") else "")
                + f"{costs.get('dense_passes')} dense and {costs.get('student_passes')} student passes of statistics, "
                f"{costs.get('selection_forwards')} candidate forwards over the selection windows; "
                f"{costs.get('total_s', 0):.1f} s.",
            ]
    return "\n".join(lines + [""])


def plot_plan(report: dict, path: Path) -> None:
    """Pruned and repaired KL (log scale) by the candidate's start block, streamline's cosine beside."""
    plan = report["plan"]
    rows = sorted(plan["candidates"].values(), key=lambda r: r["start"])
    starts = [r["start"] for r in rows]
    with figure(path, figsize=(7, 3.6)) as (fig, ax):
        ax.plot(starts, [r["pruned_kl"] for r in rows], marker="o", markersize=3, label="pruned KL")
        ax.plot(starts, [r["repaired_kl"] for r in rows], marker="o", markersize=3, label="repaired KL")
        ax.set_yscale("log")
        ax.set_xlabel(f"first removed block (runs of {len(plan['removed'])})")
        ax.set_ylabel("KL(dense ‖ candidate), selection windows")
        twin = ax.twinx()
        twin.plot(starts, [r["cosine"] for r in rows], color="grey", linestyle=":", label="streamline cosine")
        twin.set_ylabel("streamline cosine")
        ax.axvline(plan["removed"][0], color="black", linewidth=0.8, linestyle="--")
        handles = ax.get_legend_handles_labels()[0] + twin.get_legend_handles_labels()[0]
        ax.legend(handles, [h.get_label() for h in handles], fontsize=8)
        ax.set_title(f"{plan.get('chosen_by')}: chose {plan['removed'][0]}-{plan['removed'][-1]}", fontsize=9)
