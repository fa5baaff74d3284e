"""An 8B-width rehearsal on the CPU: LLaMA-3-8B's width with 4 blocks, random weights, through the real CLI.

The model has Meta-Llama-3-8B's shapes everywhere but depth (`hidden_size` 4096, 32 heads, 8 KV heads,
`intermediate_size` 14,336, `vocab_size` 128,256, rope θ 5e5, untied output head; 4 blocks instead of 32), so
what only the real width can break breaks here: the 4096 Hadamard matrix of LinearPatch, grouped-query shapes,
the untied head, the chunked head with 128k logits, dtype casts. Per `--dtype` (float32, then bfloat16 with
`--model.model.dtype bfloat16`, from the same float32 folder):

1. `fit` (configs/llama3_11.yaml with CPU overrides): explicit plan `--model.plan.layers [1]`, calibration on
   4 × 64 tokens of the shipped C4 excerpt, recovery ghost, ghost_paper (fit: plain), linearpatch (Hadamard
   at 4096), replaceme and magnitude, two distillation steps of ghost and linearpatch (`train: [operators]`),
   validation on one window, evaluation on 2 × 64 tokens of the shipped WikiText-2 excerpt (the config's
   third student, ghost_lora_ft with operators + LoRA, is left out: each of its two recipes has a run);
2. the same with `train: [lora]` (recovery ghost and linearpatch only);
3. `export <run> --views ghost ghost_ft linearpatch replaceme` of the first run, `ghost_ft` of the second
   (LoRA merged);
4. each exported folder reloaded in a fresh process without ghostdistill (`scripts/reload_check.py`): greedy
   generation, and its perplexity on the run's evaluation windows against the run's results.json.

Every step runs in its own process (`python scripts/rehearsal_8b.py worker ...`), measured by
`scripts/_rehearsal.py`'s `Phases` through the package's measurer (`ghostdistill.core.measure`: its RSS sampled
every 10 ms, /proc/self/status VmRSS), and the phases are marked by an observer of the run's phases
(`PhaseMarks`, installed by `fit_hooks` and `export_hooks` through `ghostdistill.pipeline.run.observe`). Printed: one JSON line per
dtype, with per phase (load, calibration, fit, distillation, distillation_lora, evaluation, export, reload)
the seconds and the peak RSS above the loaded model (RSS right after that process loaded its model, its
weights made resident: `from_pretrained` maps safetensors files lazily; for `load` itself the overshoot of
loading above the loaded model), plus the checks.

    .venv/bin/python scripts/rehearsal_8b.py --dtype float32 bfloat16 --dir /tmp/rehearsal_8b
    .venv/bin/python scripts/rehearsal_8b.py --dtype bfloat16 --windows 16 16 1 --dir /tmp/rehearsal_8b

(the second on a CPU without bfloat16 arithmetic, where a bfloat16 backward at the default windows takes
hours: `scripts/benchmark_bf16_gemm.py`).

Needs about 14 GB of free RAM in float32 (the 7.7 GB of weights, 1.9 GB of ghost statistics, copies of the
blocks that a fold or a LoRA merge changes) and 45 GB of disk (the float32 folder, four exported views of
6.8 GB; each exported folder is deleted once reloaded unless `--keep`). `--tiny` runs the same steps on a
hidden-64 model in seconds (what tests/test_rehearsal.py runs). The steps themselves (`fit_args`, the worker,
a step's resume, the reload, the report's peaks and seconds) live in `scripts/_rehearsal_steps.py`, which
`scripts/device_check.py` shares, as it shares `scripts/_rehearsal.py`'s `Phases` and `fit_hooks` and
`scripts/_rehearsal_model.py`'s builders.
"""

from __future__ import annotations

import argparse
import functools
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _rehearsal import GIB, LLAMA3_8B, TINY, run_worker
from _rehearsal_model import parameter_count, reload_inputs, same_model
from _rehearsal_steps import (
    RECOVERY_ALL,
    RECOVERY_DISTILLED,
    fit_args,
    inputs_len,
    peaks,
    phase_stat,
    reload_view,
    seconds,
    step,
    worker,
)


def rehearse(
    model_dir: Path, work: Path, dtype: str, tiny: bool, keep: bool, log: Path, windows: dict | None = None
) -> dict:
    """Both runs, the exports and the reloads for one dtype; the JSON line's content. `windows`: `samples`,
    `seq_len` and `batch_size` of `fit_args` (default 4 × 64 tokens, batches of 2)."""
    windows = {"samples": 4, "seq_len": 64, "batch_size": 2, **(windows or {})}

    shape = TINY if tiny else LLAMA3_8B
    result: dict = {
        "dtype": dtype,
        "width": "tiny" if tiny else "llama3_8b",
        "blocks": 4,
        "windows": windows,
        "checks": {},
    }
    counts = parameter_count(shape, 4)
    bytes_per = 4 if dtype == "float32" else 2
    result["model"] = {
        **{k: shape[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "vocab_size")},
        "intermediate_size": shape["intermediate_size"],
        "params": counts["total"],
        "weights_gib": round(counts["total"] * bytes_per / GIB, 3),
    }
    failures: list[str] = []
    # Each finished step's summary: a rerun with the same --dir and windows resumes after it.
    steps = work / (
        "steps"
        if windows == {"samples": 4, "seq_len": 64, "batch_size": 2}
        else "steps_{samples}x{seq_len}_b{batch_size}".format(**windows)
    )
    runs = {}
    for name, train, recovery in (("operators", "operators", RECOVERY_ALL), ("lora", "lora", RECOVERY_DISTILLED)):
        run = work / f"run_{dtype}_{name}"
        # The fair pair with one recipe per run (operators, then LoRA): the config's ghost_lora_ft student
        # trains both, each measured here at the real width.
        args = fit_args(model_dir, run, dtype, train=train, recovery=recovery, layers=[1], students=[], **windows)
        runs[name] = step(
            steps / f"{dtype}_fit_{name}.json",
            [run / "results.json"],
            run,
            functools.partial(run_worker, "fit", args, log),
        )
        if not runs[name]["ok"]:
            failures.append(f"fit {name}: exit {runs[name]['returncode']}")
    exports, reloads = {}, {}
    plan = {"operators": ["ghost", "ghost_ft", "linearpatch", "replaceme"], "lora": ["ghost_ft"]}
    inputs = work / f"inputs_{dtype}.pt"
    reload_inputs(model_dir, windows["seq_len"], 2, dtype, inputs)
    tol = 1e-4 if dtype == "float32" else 2e-2
    for name, views in plan.items():
        run = work / f"run_{dtype}_{name}"
        if not runs[name]["ok"]:
            continue
        folder = work / f"export_{dtype}_{name}"
        report = json.loads((run / "results.json").read_text())
        remaining = [v for v in views if not (steps / f"{dtype}_reload_{name}_{v}.json").is_file()]
        args = ["export", str(run), "--views", *views, "--dir", str(folder), "--overwrite"]
        exports[name] = step(
            steps / f"{dtype}_export_{name}.json",
            [folder / v / "config.json" for v in remaining],
            folder,
            functools.partial(run_worker, "export", args, log),
        )
        if not exports[name]["ok"]:
            failures.append(f"export {name}: exit {exports[name]['returncode']}")
            continue
        for view in views:
            key = f"{name}/{view}"
            reloads[key] = step(
                steps / f"{dtype}_reload_{name}_{view}.json",
                [],
                None,
                functools.partial(reload_view, folder / view, inputs, work, log, report, view),
            )
            if not reloads[key]["ok"]:
                failures.append(f"reload {key}: exit {reloads[key]['returncode']}")
                continue
            ppl = reloads[key]["ppl"]
            rel = ppl["relative_difference"]
            result["checks"][f"ppl {key}"] = rel <= tol
            if rel > tol:
                failures.append(f"reload {key}: perplexity {ppl['reloaded']:.6g}, run {ppl['run']:.6g} (rel {rel:.2e})")
            result["checks"][f"generates {key}"] = reloads[key]["generated_shape"] == [4, inputs_len(inputs) + 8]
            if view.endswith("_ft"):
                # The trained values reached the folder: the fine-tuned view is not its closed form.
                moved = abs(ppl["reloaded"] - ppl["closed_form"]) / ppl["closed_form"]
                trained = moved > max(1e-4, 3 * rel)  # clearly more than the export's own round-off
                result["checks"][f"trained {key}"] = trained
                if not trained:
                    failures.append(f"reload {key}: perplexity {ppl['reloaded']:.6g} is the closed form's")
        if not keep:
            shutil.rmtree(folder, ignore_errors=True)
    result["peak_above_model_gib"] = peaks(runs, exports, reloads)
    result["seconds"] = seconds(runs, exports, reloads)
    result["loaded_rss_gib"] = runs["operators"].get("loaded_rss_gib")
    result["distill_step_s"] = {
        name: [round(s["seconds"], 2) for s in r.get("steps", [])] for name, r in runs.items() if r.get("steps")
    }
    result["reload_ppl"] = {k: r["ppl"] for k, r in reloads.items() if "ppl" in r}
    result["failures"] = failures
    result["ok"] = not failures
    result["logs"] = str(log)
    return result


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--dir", default=None, help="work folder (model, runs, exports); default a temporary one")
    parser.add_argument("--tiny", action="store_true", help="a hidden-64 model: the same steps in seconds")
    parser.add_argument("--keep", action="store_true", help="keep the exported folders (and a temporary --dir)")
    parser.add_argument("--out", default=None, help="also append the JSON lines to this file")
    parser.add_argument(
        "--windows",
        type=int,
        nargs=3,
        default=None,
        metavar=("SAMPLES", "SEQ_LEN", "BATCH"),
        help="calibration windows (training reads them) and their length, and the batch size (default 4 64 2; "
        "with --offload 8 128 4). "
        "On a CPU without bfloat16 arithmetic (no AVX-512 BF16/AMX) a bfloat16 backward takes a scalar GEMM "
        "path hundreds of times slower than float32: 16 16 1 keeps the calibration at 256 tokens and a "
        "distillation step at 16",
    )
    parser.add_argument(
        "--offload",
        choices=["none", "cpu", "disk"],
        default="none",
        help="model.model.offload: with cpu or disk, the full-depth rehearsal (scripts/rehearsal_offload.py): "
        "training-free, `--blocks` blocks, one --dtype",
    )
    parser.add_argument("--blocks", type=int, default=None, help="with --offload: the depth (default 32)")
    parser.add_argument("--eval-windows", type=int, default=4, help="with --offload: evaluation windows (default 4)")
    parser.add_argument("--json", default=None, help="with --offload: write the result JSON to this file")
    args = parser.parse_args(argv)
    if args.offload != "none":
        return [offload_main(args)]
    if args.blocks not in (None, 4):
        parser.error(f"--blocks {args.blocks}: the rehearsal with distillation has 4 blocks; pass --offload disk")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rehearsal_8b_"))
    work.mkdir(parents=True, exist_ok=True)
    log = work / "rehearsal.log"
    model_dir = work / ("model_tiny" if args.tiny else "model_llama3_8b_width_4_blocks")
    shape = TINY if args.tiny else LLAMA3_8B
    build = None
    if not same_model(model_dir, shape, 4):
        shutil.rmtree(model_dir, ignore_errors=True)
        build = run_worker("build", [str(model_dir), json.dumps({"shape": shape, "layers": 4})], log)
        if not build["ok"]:
            raise SystemExit(f"building the model failed:\n{build.get('log_tail', '')}")
    lines = []
    try:
        for dtype in args.dtype:
            windows = dict(zip(("samples", "seq_len", "batch_size"), args.windows or [4, 64, 2]))
            result = rehearse(model_dir, work, dtype, args.tiny, args.keep, log, windows)
            if build is not None:
                result["build"] = {
                    **build.get("model", {}),
                    "peak_rss_gib": phase_stat(build, "startup", "peak_rss_gib"),
                }
            line = json.dumps(result)
            print(line, flush=True)
            if args.out:
                with open(args.out, "a") as f:
                    f.write(line + "\n")
            lines.append(result)
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return lines


def offload_main(args) -> dict:
    """The full-depth rehearsal with offloaded weights (scripts/rehearsal_offload.py), one dtype."""
    from rehearsal_offload import rehearse

    if len(args.dtype) != 1:
        raise SystemExit(f"--offload {args.offload}: give one --dtype (got {' '.join(args.dtype)})")
    work = Path(args.dir) if args.dir else Path(tempfile.mkdtemp(prefix="rehearsal_offload_"))
    work.mkdir(parents=True, exist_ok=True)
    samples, seq_len, batch = args.windows or [8, 128, 4]
    windows = {"samples": samples, "seq_len": seq_len, "batch_size": batch, "eval_windows": args.eval_windows}
    try:
        result = rehearse(
            work, args.blocks or 32, args.dtype[0], args.offload, args.tiny, args.keep, windows, work / "rehearsal.log"
        )
    finally:
        if not args.dir and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    line = json.dumps(result)
    print(line, flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "worker":
        worker(sys.argv[2], sys.argv[3], sys.argv[4:])
    else:
        results = main()
        if not all(r["ok"] for r in results):
            raise SystemExit(1)
