"""results.json (everything), results.md (a table to read), results.png (perplexity per view) and, after
distillation, training.png (validation KL and perplexity of every fine-tuned view against the step), curve.png
(the budget curve: perplexity against training tokens) and, for a plan chosen by ``repair``, plan.png (pruned and
repaired KL of every candidate)."""

from __future__ import annotations

from pathlib import Path

from ..core.io import atomic_write_json, atomic_write_text
from ..distill.interface import get_part
from ..distill.interface import parts as part_names
from . import figure
from .analysis import analysis_section, plot_analysis
from .flags import view_warnings
from .planning import plan_section, plot_plan
from .report import RunReport


def chat_sources(report: dict) -> list[str]:
    """The evaluation sources that are chat scores (their views have a `prefix`, `data.run_chat`)."""
    views = report.get("views", {}).values()
    return [
        s
        for s in dict.fromkeys(s for e in views for s in e["metrics"])
        if any("prefix" in e["metrics"].get(s, {}) for e in views)
    ]


def _sources(report: dict) -> list[str]:
    """The evaluation sources, in order (every view has the same)."""
    views = report.get("views") or {}
    return list(next(iter(views.values()))["metrics"]) if views else []


def markdown_table(report: dict) -> str:
    """Per view: parameters, and per source perplexity, KL and top-1; a chat source shows KL, top-1 and the
    shared prefix instead (its perplexity is that of the dense model's own answers: in results.json)."""
    views: dict = report.get("views", {})
    sources = _sources(report)
    chat = chat_sources(report)
    head = ["view", "params (M)"]
    for s in sources:
        head += [f"{s} KL", f"{s} top-1", f"{s} prefix"] if s in chat else [f"{s} PPL", f"{s} KL", f"{s} top-1"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for view, entry in views.items():
        row = [view, f"{entry['params'] / 1e6:.1f}"]
        for s in sources:
            m = entry["metrics"][s]
            row += [] if s in chat else [f"{m['ppl']:.2f}"]
            row += [f"{m['kl']:.3f}" if "kl" in m else "–", f"{m['top1']:.3f}" if "top1" in m else "–"]
            row += [f"{m['prefix']:.1f}" if "prefix" in m else "–"] if s in chat else []
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def check_scored(report: dict) -> None:
    """A run that scored no token on some evaluation source has no result to show: an error, not a table
    of perplexity 1.00 and KL 0."""
    empty = sorted({s for e in report.get("views", {}).values() for s, m in e["metrics"].items() if not m["tokens"]})
    if not report.get("views") or empty:
        ev = report.get("evaluation") or {}
        raise ValueError(
            f"the evaluation scored no tokens ({'sources ' + str(empty) if empty else 'no views'}; windows of "
            f"{ev.get('seq_len')} tokens): no results to report; give each evaluation source at least one window "
            "of 2 or more tokens (data.evaluation.seq_len, max_windows)"
        )


def rank_warning(report: dict) -> str:
    """A line that flags operators fitted from fewer calibration tokens than the hidden size (empty when
    the fit was full-rank), with what to do about it."""
    cal = report.get("calibration") or {}
    tokens, c = cal.get("tokens"), cal.get("hidden_size")
    fitted = [v for v, fit in (report.get("recovery") or {}).items() if fit.get("method", v) != "none"]
    if tokens is None or c is None or tokens >= c or not fitted:
        return ""
    return (
        f"**Warning: rank-deficient fit.** {tokens} calibration tokens for hidden size {c}: XᵀX has rank at most "
        f"{tokens} < {c}, so the operators of {', '.join(fitted)} are minimum-norm solutions fitted to too little "
        f"data and their rows above are not to be trusted. Calibrate on at least {c} tokens "
        f"(data.calibration.num_samples × seq_len ≥ {c}; several times {c} for a good fit)."
    )


def zeroshot_table(report: dict) -> str:
    views = {v: e["zeroshot"] for v, e in report.get("views", {}).items() if "zeroshot" in e}
    if not views:
        return ""
    first = next(iter(views.values()))
    tasks = [t for t in first if t != "average"]
    head = ["view", *(f"{t} (n={first[t]['n']})" for t in tasks), "average acc"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for view, scores in views.items():
        norm = {t: f" ({scores[t]['acc_norm']:.3f})" if "acc_norm" in scores[t] else "" for t in tasks}
        cells = [f"{scores[t]['acc']:.3f}{norm[t]}" for t in tasks]
        lines.append(f"| {view} | " + " | ".join(cells) + f" | {scores['average']['acc']:.3f} |")
    zs = report.get("zeroshot", {})
    limit = zs.get("limit")
    if limit is None or (isinstance(limit, dict) and all(n is None for n in limit.values())):
        scope = "every item of each task"
    elif isinstance(limit, dict):
        firsts = ", ".join(f"the first {n} of {t}" for t, n in limit.items() if n is not None)
        scope = f"{firsts}; every item of the others"
    else:
        scope = f"the first {limit} items of each task"
    source = f"local files in {zs['data_dir']}" if zs.get("data_dir") else "lm-eval's hub datasets"
    return (
        f"Zero-shot accuracy (lm-evaluation-harness, acc with acc_norm in parentheses; n = items scored: "
        f"{scope}; {source}):\n\n" + "\n".join(lines)
    )


def distill_section(report: dict) -> str:
    """What was distilled, with which budget, and which step each fine-tuned view shows."""
    d = report.get("distill")
    if not d:
        return ""
    budget = f"{d['steps']} steps"
    if tr := report.get("evaluation", {}).get("train", {}):
        budget += f" of batches from {tr.get('windows')} training windows of {tr.get('seq_len')} tokens"
    lines = [
        f"Fine-tuned views, each from its method's closed form, distilled against the dense teacher on the same "
        f"batches; AdamW (warm-up {d['warmup_steps']}, cosine to ×{d['min_lr_ratio']}); {budget}.",
        "",
        "| student | from | trains (learning rate) | loss | trainable params |",
        "|---|---|---|---|---|",
    ]
    for view, s in (d.get("resolved") or {}).items():
        loss = s["loss"]
        text = f"{loss['kind']} KL, τ {loss['temperature']}"
        text += f", teacher top-{loss['top_k']}" if loss.get("top_k") else ""
        text += f", CE {loss['ce_weight']}" if loss.get("ce_weight") else ""
        text += f", + {loss['hidden_weight']} × hidden {loss['hidden_kind']}" if loss.get("hidden_weight") else ""
        trains = ", ".join(_part_cell(kind, s) for kind in s["train"])
        count = s.get("trainable_params")
        lines.append(f"| {view} | {s['method']} | {trains} | {text} | {'-' if count is None else f'{count:,}'} |")
    lines.append("")
    if best := d.get("best", {}):
        shown = "the best validation step" if d["kept"] == "best" else "the last step"
        lines += [f"Each fine-tuned view shows {shown} ({d['steps']} taken):", ""]
        lines += [f"- {view}: best validation KL {b['val_kl']:.4f} at step {b['step']}" for view, b in best.items()]
        lines.append("")
    if curve := d.get("curve"):
        views = [v for v in curve[0] if isinstance(curve[0][v], dict)]
        lines += [
            f"Budget curve (curve.png): every student as it stood at each budget, on {curve[0]['source']} "
            "(perplexity / KL to the dense model):",
            "",
            "| tokens per student | step | " + " | ".join(views) + " |",
            "|---|---|" + "---|" * len(views),
        ]
        for p in curve:
            cells = " | ".join(f"{p[v]['ppl']:.2f} / {p[v]['kl']:.3f}" for v in views)
            lines.append(f"| {p['tokens']:,} | {p['step']} | {cells} |")
        lines.append("")
    return "\n".join(lines)


def _part_cell(kind: str, student: dict) -> str:
    """A trained part with its learning rate and its own settings (``tail (1e-05, k = 3)``)."""
    if kind not in part_names():
        return kind  # a part of a plug-in this process has not registered
    part = get_part(kind)
    extra = "".join(f", {k} = {v}" for k, v in part.settings(student).items())
    return f"{kind} ({part.lr(student):g}{extra})"


def render_markdown(report: dict) -> str:
    plan = report.get("plan", {})
    cal = report.get("calibration", {})
    ev = report.get("evaluation", {})
    src = cal.get("source", {})
    parts = [
        "# ghostdistill results",
        "",
        f"- model: `{report.get('model', {}).get('source')}` ({report.get('model', {}).get('dtype')})",
        f"- removed layers ({plan.get('chosen_by')}): {plan.get('removed')} — gaps {plan.get('gaps')}",
        f"- calibration: {src.get('source')} (documents from {src.get('first_document')}), "
        f"{cal.get('windows')} × {cal.get('seq_len')} tokens, seed {cal.get('seed')}",
        f"- evaluation: windows of {ev.get('seq_len')} tokens; "
        + ", ".join(_source_text(k, v) for k, v in ev.get("sources", {}).items()),
        "- KL is KL(dense ‖ view) per token in nats; top-1 is agreement with the dense model's argmax.",
    ]
    if chat_sources(report):
        parts.append(
            "- the chat score (prefix: how many answer tokens the view's own greedy answer shares with the dense "
            "one before they first differ, mean per instruction): KL and top-1 on the dense model's answer tokens."
        )
    parts += ["", markdown_table(report), ""]
    for warning in (rank_warning(report), *view_warnings(report)):
        if warning:
            parts += [warning, ""]
    for make, after in ((plan_section, []), (distill_section, []), (zeroshot_table, [""]), (analysis_section, [])):
        section = make(report)
        parts += [section, *after] if section else []
    if groups := cal.get("token_groups", {}):
        parts += ["First-position tokens given their own map / massive activations seen (per gap):", ""]
        for gap, c in groups.items():
            parts.append(
                f"- gap {gap}: {c['first']} first-position tokens, {c['regular']} others; massive activations "
                f"after the gap: {c['massive_first']} at the first position, {c['massive_other']} elsewhere"
            )
        parts.append("")
    if timings := report.get("timings", {}):
        parts += ["Timings (s): " + ", ".join(f"{k.removesuffix('_s')} {v}" for k, v in timings.items()), ""]
    if phases := report.get("phases", {}):
        parts += ["Phases (s, peak memory GiB): " + ", ".join(_phase_cell(k, p) for k, p in phases.items()), ""]
    return "\n".join(parts)


def _source_text(name: str, source: dict) -> str:
    if "chat" not in source:
        return f"{name}: {source.get('windows')} windows of {source.get('source')}"
    where = "the shipped held-out instructions" if source.get("source") == "generate" else source.get("source")
    return (
        f"{name}: the dense model's greedy answers (at most {source.get('answer_tokens')} tokens) to "
        f"{source.get('windows')} instructions ({where})"
    )


def _phase_cell(name: str, phase: dict) -> str:
    times = f" ×{phase['count']}" if phase.get("count", 1) > 1 else ""
    peak = phase.get("peak_gib")
    return f"{name} {phase['seconds']}{times}" + (f" ({peak})" if peak is not None else "")


def plot(report: dict, path: Path) -> None:
    """Perplexity per view on each text source (`write_report` plots only a report that has one)."""
    views = report["views"]
    sources = [s for s in _sources(report) if s not in chat_sources(report)]
    with figure(path, figsize=(1.6 + 1.3 * len(views) * max(1, len(sources)) / 2, 3.6)) as (fig, ax):
        width = 0.8 / len(sources)
        for j, s in enumerate(sources):
            vals = [views[v]["metrics"][s]["ppl"] for v in views]
            bars = ax.bar([i + j * width for i in range(len(views))], vals, width, label=s)
            ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks([i + width * (len(sources) - 1) / 2 for i in range(len(views))], list(views), rotation=20)
        ax.set_yscale("log")
        ax.set_ylabel("perplexity (log scale)")
        ax.set_title(f"removed layers {report.get('plan', {}).get('removed')}", fontsize=9)
        ax.legend(fontsize=8)


def plot_training(report: dict, path: Path) -> None:
    history = report["distill"]["history"]
    views = [k for k in history[0] if k not in ("step", "ranks_in_sync")]
    steps = [h["step"] for h in history]
    with figure(path, 1, 2, figsize=(10, 3.6)) as (fig, axes):
        for metric, ax in zip(("kl", "ppl"), axes):
            for view in views:
                ax.plot(steps, [h[view][metric] for h in history], marker="o", markersize=3, label=view)
            ax.set_xlabel("optimizer step")
            ax.set_ylabel("validation " + ("KL(teacher ‖ student)" if metric == "kl" else "perplexity"))
            ax.legend(fontsize=8)
        fig.suptitle(f"distillation, removed layers {report.get('plan', {}).get('removed')}", fontsize=9)


def plot_curve(report: dict, path: Path) -> None:
    """Perplexity of every student against its training tokens (log x): the budget curve."""
    curve = report["distill"]["curve"]
    views = [v for v in curve[0] if isinstance(curve[0][v], dict)]
    tokens = [p["tokens"] for p in curve]
    with figure(path, figsize=(6, 4)) as (fig, ax):
        for view in views:
            ax.plot(tokens, [p[view]["ppl"] for p in curve], marker="o", markersize=3, label=view)
        ax.set_xscale("log")
        # Ticks at the budgets themselves (20k, 82k, 307k, 1.0M): log-axis minor labels overlap at these spans.
        ax.set_xticks(tokens, [f"{t / 1e6:.1f}M" if t >= 1e6 else f"{t / 1e3:.0f}k" for t in tokens])
        ax.minorticks_off()
        ax.set_xlabel("training tokens per student (log scale)")
        ax.set_ylabel(f"perplexity on {curve[0]['source']}")
        ax.set_title(f"budget curve, removed layers {report.get('plan', {}).get('removed')}", fontsize=9)
        ax.legend(fontsize=8)


def write_report(run_dir: Path, report: RunReport | dict) -> list[Path]:
    """results.json, results.md, results.png and, where the run has them, analysis.png and training.png."""
    if isinstance(report, RunReport):
        report = report.to_dict()
    run_dir.mkdir(parents=True, exist_ok=True)
    paths = [run_dir / "results.json", run_dir / "results.md"]
    atomic_write_json(paths[0], report)
    atomic_write_text(paths[1], render_markdown(report))
    figures = {
        "results.png": (plot, len(chat_sources(report)) < len(_sources(report))),
        "plan.png": (plot_plan, any("repaired_kl" in r for r in report.get("plan", {}).get("candidates", {}).values())),
        "analysis.png": (plot_analysis, report.get("analysis", {}).get("gaps")),
        "training.png": (plot_training, report.get("distill", {}).get("history")),
        "curve.png": (plot_curve, report.get("distill", {}).get("curve")),
    }
    for name, (draw, wanted) in figures.items():
        if wanted:
            paths.append(run_dir / name)
            draw(report, paths[-1])
    return paths
