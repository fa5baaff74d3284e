"""The students study: several fine-tuning recipes of one run side by side
(configs/studies/students/smollm2_students.yaml).

For each finished run folder given (one per depth):

1. the table: per student its recipe, WikiText-2 PPL / KL / top-1 at the end, its best validation KL and
   step, trainable parameters, parameters at inference (the exported folder's) and the extra ones over
   the closed form it started from;
2. cost, measured side by side in this call: each student trained alone for `--steps` steps (after one
   warm-up step) in its own process, from the run's saved statistics, on the run's first training batches:
   seconds per step (one teacher pass + that student's forward, backward and optimizer step) and the
   peak RSS above the process's RSS before the first step;
3. how many training tokens the first student (ghost_ft) needs to reach the anchor's (linearpatch_ft)
   final validation KL, interpolated linearly between validations, and the other way round how many the
   anchor needs to reach ghost's closed form (its step-0 validation KL): the head start in tokens;
4. one plot per run: validation KL against training tokens and against wall seconds (steps × the
   student's seconds per step).

Writes <out>/students.md, students.json and students_<run>.png (default out: the first run's parent).

    .venv/bin/python scripts/studies/study_students.py runs/smollm2_students runs/smollm2_students_11
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from ghostdistill.core.measure import SampledPeak, status_bytes

ROOT = Path(__file__).resolve().parents[2]


def cost_worker(run: str, student: str, steps: int, out: str) -> None:
    """In this process: the run rebuilt from its statistics, `student` alone, `steps` timed steps."""
    import torch

    from ghostdistill.cli import load_run_config
    from ghostdistill.distill.config import ft_view
    from ghostdistill.distill.optim import make_optimizer
    from ghostdistill.pipeline.reload import load_run
    from ghostdistill.pipeline.train import build_students, distill_step

    cfg, _ = load_run_config(Path(run))
    spec = next(s for s in cfg.distill.specs() if s.name == student)
    loaded = load_run(Path(run), cfg, [spec.method], log=lambda m: None)
    # The run's distill settings with only this student (from the `methods` shorthand or `students`).
    alone = replace(
        cfg.distill,
        methods=[m for m in cfg.distill.methods if ft_view(m) == student],
        students=[s for s in cfg.distill.students if s.name == student],
    )
    ids = loaded.data.train_ids()
    size = cfg.data.batch_size
    batches = [{"input_ids": ids[i * size : (i + 1) * size]} for i in range(steps + 1)]
    for b in batches:
        b["attention_mask"] = torch.ones_like(b["input_ids"])
    students = build_students(loaded.pruned, alone, batches[0], cfg.methods())
    optimizer, scheduler = make_optimizer(students.params, alone, steps + 1)
    seconds = []
    before, peak = status_bytes("VmRSS"), SampledPeak()  # RSS every 10 ms
    for batch in batches:
        start = time.perf_counter()
        loss = sum(distill_step(students, batch).values())
        loss.backward()
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        seconds.append(time.perf_counter() - start)
    (peak_rss,) = peak.close()
    result = {
        "student": student,
        "seconds_per_step": sorted(seconds[1:])[len(seconds[1:]) // 2],  # median after the warm-up step
        "steps_timed": len(seconds) - 1,
        "peak_rss_above_start_gib": (peak_rss - before) / 2**30,
        "tokens_per_step": int(batches[0]["input_ids"].numel()),
    }
    from ghostdistill.core.io import atomic_write_json

    atomic_write_json(out, result)


def measure_costs(run: Path, students: list[str], steps: int) -> dict[str, dict]:
    """Each student's cost in its own process, one after the other."""
    out = {}
    for student in students:
        path = run / f".cost_{student}.json"
        proc = subprocess.run(
            [sys.executable, __file__, "worker", str(run), student, str(steps), str(path)],
            capture_output=True,
            text=True,
            cwd=ROOT,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"cost of {student} in {run} failed:\n{proc.stderr[-3000:]}")
        out[student] = json.loads(path.read_text())
        path.unlink()
    return out


def tokens_to_reach(history: list[dict], view: str, target: float, tokens_per_step: int) -> float | None:
    """Training tokens at which `view`'s validation KL first reaches `target` (linear between validations);
    0 if it starts there, None if it never does."""
    points = [(h["step"], h[view]["kl"]) for h in history if view in h]
    if not points:
        return None
    if points[0][1] <= target:
        return 0.0
    for (s0, k0), (s1, k1) in zip(points, points[1:]):
        if k1 <= target:
            frac = (k0 - target) / (k0 - k1) if k0 != k1 else 1.0
            return (s0 + frac * (s1 - s0)) * tokens_per_step
    return None


def head_start(history: list[dict], tokens_per_step: int, steps: int) -> dict:
    """The closed form's head start in tokens, both ways: the tokens ghost_ft needs to reach linearpatch_ft's
    final validation KL (0 when ghost's closed form is already below it), and the tokens linearpatch_ft
    needs to reach ghost's closed form, ghost_ft's step-0 validation KL (None: more than the run's)."""
    anchor = [h["linearpatch_ft"]["kl"] for h in history if "linearpatch_ft" in h][-1]
    start = [h["ghost_ft"]["kl"] for h in history if "ghost_ft" in h][0]
    return {
        "ghost_ft_tokens_to_linearpatch_ft_final_kl": {
            "target_val_kl": anchor,
            "tokens": tokens_to_reach(history, "ghost_ft", anchor, tokens_per_step),
        },
        "linearpatch_ft_tokens_to_ghost_start_kl": {
            "target_val_kl": start,
            "tokens": tokens_to_reach(history, "linearpatch_ft", start, tokens_per_step),
            "run_tokens": steps * tokens_per_step,
        },
    }


def summarise(run: Path, costs: dict[str, dict] | None, source: str | None = None) -> dict:
    """The study's numbers for one run (`source`: the evaluation source reported; default the first)."""
    from ghostdistill.cli import load_run_config

    cfg, _ = load_run_config(run)
    data = cfg.data
    tokens_per_step = data.batch_size * (
        data.train.seq_len if data.train.source is not None else data.calibration.seq_len
    )
    source = source or data.evaluation.sources[0].label
    report = json.loads((run / "results.json").read_text())
    d = report["distill"]
    views = report["views"]
    rows = {}
    for view, spec in d["resolved"].items():
        metrics = views[view]["metrics"][source]
        start = views[spec["method"]]
        cost = (costs or {}).get(view, {})
        rows[view] = {
            "method": spec["method"],
            "train": spec["train"] + ([f"k={spec['tail_blocks']}"] if "tail" in spec["train"] else []),
            "hidden_weight": spec["loss"].get("hidden_weight", 0.0),
            "ppl": metrics["ppl"],
            "kl": metrics.get("kl"),
            "top1": metrics.get("top1"),
            "closed_form_ppl": start["metrics"][source]["ppl"],
            "best_val_kl": d["best"][view]["val_kl"],
            "best_step": d["best"][view]["step"],
            "trainable_params": spec.get("trainable_params"),
            "inference_params": views[view]["params"],
            "extra_inference_params": views[view]["params"] - start["params"],
            **{k: cost.get(k) for k in ("seconds_per_step", "peak_rss_above_start_gib")},
        }
    summary = {
        "run": str(run),
        "source": source,
        "removed": report["plan"]["removed"],
        "steps": d["steps"],
        "tokens_per_step": tokens_per_step,
        "rows": rows,
    }
    if {"ghost_ft", "linearpatch_ft"} <= set(rows) and tokens_per_step:
        summary.update(head_start(d["history"], tokens_per_step, d["steps"]))
    summary["history"] = d["history"]
    return summary


def markdown(summaries: list[dict]) -> str:
    lines = ["# Students side by side", ""]
    for s in summaries:
        removed = s["removed"]
        lines += [
            f"## {len(removed)} blocks removed ({removed[0]}–{removed[-1]}): {s['run']}",
            "",
            f"{s['steps']} steps of {s['tokens_per_step']} tokens each.",
            "",
            f"| student | trains | {s['source']} PPL | KL | top-1 | closed form PPL | best val KL (step) | trainable | "
            "extra at inference | s/step alone | peak RSS (GiB) |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for view, r in s["rows"].items():
            trains = ", ".join(r["train"]) + (f", hidden ×{r['hidden_weight']}" if r["hidden_weight"] else "")
            sec = "-" if r["seconds_per_step"] is None else f"{r['seconds_per_step']:.2f}"
            mem = "-" if r["peak_rss_above_start_gib"] is None else f"{r['peak_rss_above_start_gib']:.2f}"
            lines.append(
                f"| {view} | {trains} | {r['ppl']:.2f} | {r['kl']:.3f} | {r['top1']:.3f} | "
                f"{r['closed_form_ppl']:.2f} | {r['best_val_kl']:.4f} ({r['best_step']}) | "
                f"{r['trainable_params']:,} | {r['extra_inference_params']:,} | {sec} | {mem} |"
            )
        reach = s.get("ghost_ft_tokens_to_linearpatch_ft_final_kl")
        if reach:
            tokens = reach["tokens"]
            text = "never, within the run" if tokens is None else f"{tokens:,.0f} training tokens"
            lines += [
                "",
                f"ghost_ft reaches linearpatch_ft's final validation KL ({reach['target_val_kl']:.4f}): {text}.",
            ]
        back = s.get("linearpatch_ft_tokens_to_ghost_start_kl")
        if back:
            tokens = back["tokens"]
            text = (
                f"not within the run's {back['run_tokens']:,} tokens"
                if tokens is None
                else f"{tokens:,.0f} training tokens"
            )
            lines.append(
                f"linearpatch_ft reaches ghost's closed-form validation KL ({back['target_val_kl']:.4f}, "
                f"step 0): {text}."
            )
        lines.append("")
    return "\n".join(lines)


def plot(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    history = summary["history"]
    for view, r in summary["rows"].items():
        steps = [h["step"] for h in history if view in h]
        kl = [h[view]["kl"] for h in history if view in h]
        axes[0].plot([x * (summary["tokens_per_step"] or 0) for x in steps], kl, marker="o", ms=3, label=view)
        if r["seconds_per_step"] is not None:
            axes[1].plot([x * r["seconds_per_step"] for x in steps], kl, marker="o", ms=3, label=view)
    axes[0].set_xlabel("training tokens")
    axes[1].set_xlabel("wall seconds (steps × the student's s/step alone)")
    for ax in axes:
        ax.set_ylabel("validation KL(teacher ‖ student)")
        if ax.lines:  # the wall-seconds axis is empty with --no-cost
            ax.legend(fontsize=7)
    removed = summary["removed"]
    fig.suptitle(f"students, removed blocks {removed[0]}–{removed[-1]}", fontsize=9)
    fig.tight_layout()
    from ghostdistill.core.io import atomic_savefig

    atomic_savefig(fig, path)
    plt.close(fig)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "runs", nargs="+", type=Path, help="finished run folders of configs/studies/students/smollm2_students.yaml"
    )
    parser.add_argument("--steps", type=int, default=4, help="timed steps per student (after one warm-up)")
    parser.add_argument("--no-cost", action="store_true", help="skip the per-student cost measurement")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    out = args.out or args.runs[0].parent
    out.mkdir(parents=True, exist_ok=True)
    summaries = []
    for run in args.runs:
        report = json.loads((run / "results.json").read_text())
        students = list(report["distill"]["resolved"])
        costs = None if args.no_cost else measure_costs(run, students, args.steps)
        summary = summarise(run, costs)
        plot(summary, out / f"students_{run.name}.png")
        summaries.append(summary)
    from ghostdistill.core.io import atomic_write_json, atomic_write_text

    atomic_write_json(out / "students.json", summaries)
    atomic_write_text(out / "students.md", markdown(summaries))
    print(markdown(summaries))
    return summaries


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        cost_worker(*sys.argv[2:4], int(sys.argv[4]), sys.argv[5])
    else:
        main()
