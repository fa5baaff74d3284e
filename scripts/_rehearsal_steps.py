"""The steps of the CPU rehearsals (`scripts/rehearsal_8b.py`, `scripts/rehearsal_offload.py`) and the GPU check
(`scripts/device_check.py`): the `fit` arguments they run, the worker that runs one step in its own process
(`python scripts/rehearsal_8b.py worker <kind> <out> ...`, started by `_rehearsal.run_worker`), a step's resume,
an exported folder's reload, and the per-phase peaks and seconds of a rehearsal's JSON line."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

from _rehearsal import ACTIVE, C4_HEAD, ROOT, Phases, export_hooks, fit_hooks, run_worker
from _rehearsal_model import EVAL_SOURCE, build_model_dir

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


def phase_stat(summary: dict, name: str, key: str) -> float | None:
    return (summary.get("phases") or {}).get(name, {}).get(key)


def peaks(runs: dict, exports: dict, reloads: dict) -> dict:
    """Peak RSS above the loaded model per phase: the operators run's phases, the LoRA run's distillation,
    the highest export and the highest reload (each above its own process's loaded model)."""
    key = "peak_rss_above_model_gib"
    a, b = runs.get("operators", {}), runs.get("lora", {})
    out = {name: phase_stat(a, name, key) for name in ("load", "calibration", "fit", "distillation", "evaluation")}
    out["distillation_lora"] = phase_stat(b, "distillation", key)
    out["analysis"] = phase_stat(a, "analysis", key)
    values = [phase_stat(e, "export", key) for e in exports.values()]
    out["export"] = max((v for v in values if v is not None), default=None)
    values = [max(phase_stat(r, "reload", key) or 0, phase_stat(r, "reload_run", key) or 0) for r in reloads.values()]
    out["reload"] = max(values, default=None)
    return out


def seconds(runs: dict, exports: dict, reloads: dict) -> dict:
    key = "seconds"
    a, b = runs.get("operators", {}), runs.get("lora", {})
    out = {name: phase_stat(a, name, key) for name in ("load", "calibration", "fit", "distillation", "evaluation")}
    out["distillation_lora"] = phase_stat(b, "distillation", key)
    out["analysis"] = phase_stat(a, "analysis", key)
    out["export"] = round(sum(phase_stat(e, "export", key) or 0 for e in exports.values()), 2)
    out["reload"] = round(
        sum((phase_stat(r, "reload", key) or 0) + (phase_stat(r, "reload_run", key) or 0) for r in reloads.values()), 2
    )
    out["total_wall"] = round(sum(r.get("wall_s", 0) for group in (runs, exports, reloads) for r in group.values()), 1)
    return out
