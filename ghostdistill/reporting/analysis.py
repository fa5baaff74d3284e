"""The analysis section of results.md and `analysis.png`: per gap and method, the antisymmetric share
of the operator, its spectrum, and the held-out alignment error (see `ghostdistill.analysis`)."""

from __future__ import annotations

from pathlib import Path

from . import figure


def _fmt(value, spec: str = ".3f") -> str:
    return "–" if value is None else format(value, spec)


def analysis_section(report: dict) -> str:
    a = report.get("analysis")
    if not a:
        return ""
    less = f", less {a['overlapping_windows']} that overlap calibration" if a.get("overlapping_windows") else ""
    lines = [
        f"Operator anatomy and alignment error on {a['held_out_windows']} held-out windows (the first evaluation "
        f"windows{less}; e = ‖X_pre W − X_post‖ / ‖X_post − X_pre‖ on the dense model's streams, 1 = no better "
        "than pruned; antisym = ‖(M − Mᵀ)/2‖² / ‖M‖², of W likewise; eff. rank of M = exp(entropy of σ²)):",
        "",
        "| gap | view | antisym M | antisym W | ‖M‖ | σ₁(M) | eff. rank M | e other | e first |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for gap, views in a["gaps"].items():
        for view, row in views.items():
            an = row.get("anatomy")
            if isinstance(an, dict):
                keys = ("antisym_share_M", "antisym_share_W", "norm_M", "spectral_norm_M", "effective_rank_M")
                cells = [_fmt(an[k], spec) for k, spec in zip(keys, (".3f", ".4f", ".2f", ".3f", ".1f"))]
            else:
                cells = ["n/a"] * 5
            cells += [_fmt(row.get("held_out_other")), _fmt(row.get("held_out_first"))]
            lines.append(f"| {gap} | {view} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_analysis(report: dict, path: Path) -> None:
    """Three panels: antisymmetric share of M per gap and view, singular values of M (each view, every
    gap), held-out alignment error per gap and view (other tokens solid, first position hatched)."""
    gaps = report["analysis"]["gaps"]
    views = list(dict.fromkeys(v for rows in gaps.values() for v in rows))
    with figure(path, 1, 3, figsize=(15, 4)) as (fig, axes):
        width = 0.8 / max(1, len(views))
        for j, view in enumerate(views):
            xs = [i + j * width for i in range(len(gaps))]
            shares = [
                r["anatomy"]["antisym_share_M"] if isinstance((r := rows.get(view, {})).get("anatomy"), dict) else 0.0
                for rows in gaps.values()
            ]
            axes[0].bar(xs, shares, width, label=view)
            other = [rows.get(view, {}).get("held_out_other") or 0.0 for rows in gaps.values()]
            first = [rows.get(view, {}).get("held_out_first") or 0.0 for rows in gaps.values()]
            bars = axes[2].bar(xs, other, width / 2, label=f"{view} (other)")
            axes[2].bar(
                [x + width / 2 for x in xs],
                first,
                width / 2,
                color=bars.patches[0].get_facecolor(),
                hatch="//",
                alpha=0.5,
            )
            for g, rows in gaps.items():
                an = rows.get(view, {}).get("anatomy")
                if isinstance(an, dict):
                    axes[1].semilogy(an["singular_values"], label=f"{view} {g}", linewidth=1)
        ticks = [i + width * (len(views) - 1) / 2 for i in range(len(gaps))]
        titles = ("antisymmetric share of M", "held-out alignment error e (hatched: first position)")
        for ax, title in zip(axes[::2], titles):
            ax.set_xticks(ticks, [f"gap {g}" for g in gaps])
            ax.set_title(title, fontsize=9)
        axes[0].set_ylim(0, 1)
        axes[0].legend(fontsize=7)
        axes[2].axhline(1.0, color="grey", linewidth=0.8, linestyle="--")
        axes[2].set_yscale("log")  # a method that mangles the massive first token is off the scale otherwise
        axes[1].set_title("singular values of M (descending)", fontsize=9)
        axes[1].set_xlabel("index")
        axes[1].legend(fontsize=6)
        fig.suptitle(f"operator analysis, removed layers {report.get('plan', {}).get('removed')}", fontsize=9)
