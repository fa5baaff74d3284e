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
hidden-64 model in seconds (what tests/test_rehearsal.py runs). `scripts/device_check.py` reuses `fit_args`
and, from `scripts/_rehearsal.py`, `Phases`, `fit_hooks` and the model and tokenizer builders.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

from _rehearsal import (
    ACTIVE,
    C4_HEAD,
    EVAL_SOURCE,
    GIB,
    LLAMA3_8B,
    ROOT,
    TINY,
    Phases,
    build_model_dir,
    export_hooks,
    fit_hooks,
    parameter_count,
    reload_inputs,
    run_worker,
    same_model,
)

# -------------------------------------------------------------------------------------------- the runs

RECOVERY_ALL = [
    {"name": "ghost"},
    {"name": "ghost_paper", "fit": "plain"},
    {"name": "linearpatch", "method": "linearpatch"},
    {"name": "replaceme", "method": "replaceme"},
    {"name": "magnitude", "method": "magnitude"},
]
RECOVERY_DISTILLED = RECOVERY_ALL[:1] + RECOVERY_ALL[2:3]


def fit_args(
    model_dir: Path,
    run: Path,
    dtype: str,
    *,
    train: str,
    recovery: list[dict] | None,
    layers: list[int],
    steps: int = 2,
    samples: int = 4,
    seq_len: int = 64,
    eval_windows: int = 2,
    val_windows: int = 1,
    batch_size: int = 2,
    accelerator: str = "cpu",
    precision: str | None = None,
    export: list[str] | None = None,
    keep: str = "last",
    lr: float = 1e-2,
    students: list[dict] | None = None,
) -> list[str]:
    """`fit` arguments: configs/llama3_11.yaml (the paper's setting) with one device, the shipped excerpts and
    the given sizes (calibration and training on `samples` × `seq_len` tokens of C4, evaluation on
    `eval_windows` × `seq_len` of WikiText-2, validation on `val_windows` C4 windows after document 50). The
    students keep their last step, at a learning rate (operators and adapters) large enough that two steps
    change them measurably: an exported `_ft` view then differs from its closed form. `students`: the
    config's extra students (llama3_11's ghost_lora_ft) when None, else these (`[]`: the fair pair only)."""
    args = [
        "fit",
        "--config",
        str(ROOT / "configs" / "llama3_11.yaml"),
        "--trainer.accelerator",
        accelerator,
        "--trainer.devices",
        "1",
        "--trainer.strategy",
        "auto",
        "--trainer.max_steps",
        str(steps),
        "--trainer.default_root_dir",
        str(run),
        "--trainer.enable_progress_bar",
        "false",
        "--calibration.progress",
        "false",
        "--model.model.source",
        str(model_dir),
        "--model.model.dtype",
        dtype,
        "--model.plan.layers",
        json.dumps(layers),
        "--model.plan.num_layers",
        "null",
        "--model.distill.methods",
        "[ghost, linearpatch]",
        "--model.distill.train",
        f"[{train}]",
        "--model.distill.warmup_steps",
        "1",
        "--model.distill.val_every",
        "0",
        "--model.distill.keep",  # the fine-tuned views end at the last step: exports carry trained values
        keep,
        "--model.distill.lr",
        str(lr),
        "--model.distill.lora.lr",
        str(lr),
        "--data.calibration.source",
        json.dumps({"source": str(C4_HEAD)}),
        "--data.calibration.num_samples",
        str(samples),
        "--data.calibration.seq_len",
        str(seq_len),
        "--data.train.source",
        "null",
        "--data.train.seq_len",  # unused (training reads the calibration windows), but checked against the model
        str(seq_len),
        "--data.validation.source",
        json.dumps({"source": str(C4_HEAD), "first_document": 50}),
        "--data.validation.num_windows",
        str(val_windows),
        "--data.validation.seq_len",
        str(seq_len),
        "--data.evaluation.sources",
        json.dumps([EVAL_SOURCE]),
        "--data.evaluation.seq_len",
        str(seq_len),
        "--data.evaluation.max_windows",
        str(eval_windows),
        "--data.batch_size",
        str(batch_size),
    ]
    if recovery is not None:
        args += ["--model.recovery", json.dumps(recovery)]
    if students is not None:
        args += ["--model.distill.students", json.dumps(students)]
    if precision:
        args += ["--trainer.precision", precision]
    if export:
        args += ["--export.views", json.dumps(export), "--export.overwrite", "true"]
    return args


def worker(kind: str, out: str, args: list[str]) -> None:
    """One step in this process: `fit` or `export` through `ghostdistill.cli.main`, or `reload`
    (scripts/reload_check.py, ghostdistill unimportable); writes the phase summary to `out`."""
    phases = Phases()
    status = {"kind": kind, "ok": False}
    try:
        if kind == "build":
            spec = json.loads(args[1])
            status["model"] = build_model_dir(Path(args[0]), spec["shape"], spec["layers"])
        elif kind == "fit":
            steps = fit_hooks(phases)
            from ghostdistill.cli import main

            main(args)
            status["steps"] = steps
            status["timings"] = ACTIVE["timings"]
        elif kind == "export":
            export_hooks(phases)
            from ghostdistill.cli import main

            main(args)
        elif kind == "build_streamed":
            from rehearsal_offload import build_streamed

            spec = json.loads(args[1])
            status["model"] = build_streamed(Path(args[0]), spec["shape"], spec["layers"], spec["dtype"])
        elif kind == "gguf":
            from rehearsal_offload import gguf_check

            gguf_check(*args)
        elif kind == "reload":
            spec = importlib.util.spec_from_file_location("reload_check", ROOT / "scripts" / "reload_check.py")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)  # makes ghostdistill unimportable in this process
            auto = module.AutoModelForCausalLM
            original = auto.from_pretrained

            def from_pretrained(*a, **k):
                phases.enter("reload")
                model = original(*a, **k)
                phases.mark_loaded(model)
                phases.enter("reload_run")
                return model

            auto.from_pretrained = staticmethod(from_pretrained)
            module.main(*args)
        else:
            raise ValueError(f"unknown worker {kind!r}")
        status["ok"] = True
    finally:
        status.update(phases.close())
        Path(out).write_text(json.dumps(status))


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


def step(record: Path, outputs: list[Path], fresh: Path | None, make) -> dict:
    """A step's summary: the one `record` holds when the step finished before and its `outputs` still exist
    (a rehearsal interrupted by a signal resumes after its last finished step); otherwise `make()` runs (after
    removing `fresh`, so that a run is measured from its start) and a successful summary is recorded."""
    if record.is_file() and all(p.exists() for p in outputs):
        return {**json.loads(record.read_text()), "resumed": True}
    if fresh is not None:
        shutil.rmtree(fresh, ignore_errors=True)
    summary = make()
    if summary.get("ok"):
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(summary))
    return summary


def reload_view(folder: Path, inputs: Path, work: Path, log: Path, report: dict, view: str) -> dict:
    """scripts/reload_check.py on an exported folder in a fresh process without ghostdistill; its perplexity
    beside the run's (and, for a fine-tuned view, its closed form's)."""
    import torch

    out = work / f"reload_{folder.parent.name}_{view}.pt"
    # The worker measures through ghostdistill (`core.measure`), imported before reload_check.py makes it unimportable.
    env = {"HF_MODULES_CACHE": str(work / "modules")}
    summary = run_worker("reload", [str(folder), str(inputs), str(out)], log, env=env)
    if not summary["ok"]:
        return summary
    got = torch.load(out)
    out.unlink()
    metrics = report["views"]
    want = metrics[view]["metrics"]["wikitext2"]["ppl"]
    summary["ppl"] = {"run": want, "reloaded": got["ppl"], "relative_difference": abs(got["ppl"] - want) / want}
    if view.endswith("_ft"):
        summary["ppl"]["closed_form"] = metrics[view.removesuffix("_ft")]["metrics"]["wikitext2"]["ppl"]
    summary["generated_shape"] = list(got["tokens"].shape)
    return summary


def inputs_len(path: Path) -> int:
    import torch

    return int(torch.load(path)["ids"].shape[1])


def _phase(summary: dict, name: str, key: str) -> float | None:
    return (summary.get("phases") or {}).get(name, {}).get(key)


def peaks(runs: dict, exports: dict, reloads: dict) -> dict:
    """Peak RSS above the loaded model per phase: the operators run's phases, the LoRA run's distillation,
    the highest export and the highest reload (each above its own process's loaded model)."""
    key = "peak_rss_above_model_gib"
    a, b = runs.get("operators", {}), runs.get("lora", {})
    out = {name: _phase(a, name, key) for name in ("load", "calibration", "fit", "distillation", "evaluation")}
    out["distillation_lora"] = _phase(b, "distillation", key)
    out["analysis"] = _phase(a, "analysis", key)
    values = [_phase(e, "export", key) for e in exports.values()]
    out["export"] = max((v for v in values if v is not None), default=None)
    values = [max(_phase(r, "reload", key) or 0, _phase(r, "reload_run", key) or 0) for r in reloads.values()]
    out["reload"] = max(values, default=None)
    return out


def seconds(runs: dict, exports: dict, reloads: dict) -> dict:
    key = "seconds"
    a, b = runs.get("operators", {}), runs.get("lora", {})
    out = {name: _phase(a, name, key) for name in ("load", "calibration", "fit", "distillation", "evaluation")}
    out["distillation_lora"] = _phase(b, "distillation", key)
    out["analysis"] = _phase(a, "analysis", key)
    out["export"] = round(sum(_phase(e, "export", key) or 0 for e in exports.values()), 2)
    out["reload"] = round(
        sum((_phase(r, "reload", key) or 0) + (_phase(r, "reload_run", key) or 0) for r in reloads.values()), 2
    )
    out["total_wall"] = round(sum(r.get("wall_s", 0) for group in (runs, exports, reloads) for r in group.values()), 1)
    return out


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
                result["build"] = {**build.get("model", {}), "peak_rss_gib": _phase(build, "startup", "peak_rss_gib")}
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
