"""A prepared GPU check: the paper's setting (configs/llama3_11.yaml) at full size on one H200, in under 8 minutes.

What it runs, through the real code path (`ghostdistill.cli.main(["fit", ...])`, in this process):

1. a random-weight model of Meta-Llama-3-8B's shape (32 blocks, hidden 4096, 32 heads, 8 KV heads, MLP
   14,336, vocabulary 128,256, rope θ 5e5, untied head; 8.03B parameters) built in bfloat16 on the GPU and
   saved with a small byte-level BPE tokenizer trained on the shipped excerpts (no hub);
2. run A, `fit` of configs/llama3_11.yaml on one GPU (`--trainer.devices 1 --trainer.strategy auto`) with the
   explicit plan of layers 20–30 (11 blocks; the deepest run the streamline criterion may choose, since
   `keep_last: 1` protects block 31 — 21..31 would need `allow_edges`; the real model's streamline choice is
   not known here, and a gap this deep is the cheap end for distillation: the students run only block 31
   after the shared prefix), its recovery list (ghost, ghost_paper, linearpatch), calibration on 128 × 2048
   tokens of the shipped C4 excerpt (random windows; ids from the small tokenizer), 20 distillation steps in
   `bf16-true` (batches of 4 × 2048) of its three students: ghost_ft and linearpatch_ft (operators) and
   ghost_lora_ft (operators + LoRA, adapters on every kept block), validation on 2 × 2048 tokens at the start
   and the end, evaluation on 8 × 2048 tokens of the shipped WikiText-2 excerpt, export of ghost_ft and
   ghost_lora_ft (LoRA merged);
3. run B, the fair pair alone (`students: []`: ghost_ft and linearpatch_ft, operators), resuming run A's
   calibration statistics (its calibration_state.pt copied over: the pass is not repeated), export of
   linearpatch_ft; beside run A it prices the third student.

Written to `--out` (default `$OUT/device_check.json` when `$OUT` is set, else `device_check.json`), after
every run so that a timeout keeps what was measured: seconds and peak GPU memory per phase
(`torch.cuda.max_memory_allocated`, reset at each phase; above the loaded model too), tokens per second per
student, model FLOP utilisation against the H200's ~790 TFLOP/s of bfloat16, and the time implied for
configs/llama3_11.yaml's 500 steps. `--tiny` runs the same on a hidden-64 model on the CPU in seconds (what
tests/test_device_check.py runs, so the script cannot rot); `--dir` is the work folder (model, runs).

Sizing (FLOPs per token, forward; a frozen block's backward computes activation gradients only, ≈ its
forward; causal attention at 2048 adds 2·2·2048·4096/2 ≈ 17 MFLOP per block):
    block   F_b = 2·(2·4096² + 2·4096·1024 + 3·4096·14336) + 17M ≈ 0.453 GFLOP
    head    F_h = 2·4096·128,256 ≈ 1.05 GFLOP
    loss    per student: teacher logits twice (forward, recomputed under checkpointing) + student logits
            three times (forward, recompute, backward) = 5 F_h ≈ 5.25 GFLOP
    calibration   31 blocks (stops at block 31's input) × F_b = 14.0 GFLOP × 262,144 tokens = 3.7 PFLOP
    student, operators    block 31 forward + backward (0.9) + the operator (0.1) + loss 5.25 ≈ 6.25 GFLOP
    student, + LoRA       adapters on every kept block: no shared prefix, 21 blocks forward and backward
                          (19.0) + the operator + loss 5.25 ≈ 24.4 GFLOP
    step, run A           teacher 32 F_b (14.5) + 2 × 6.25 + 24.4 ≈ 51 GFLOP × 8,192 tokens = 0.42 PFLOP per
                          step, 8.4 PFLOP for 20 steps
    step, run B           14.5 + 2 × 6.25 ≈ 27 GFLOP × 8,192 = 0.22 PFLOP per step, 4.4 PFLOP for 20 steps
    evaluation            dense 32 F_b + F_h, 21-block views 21 F_b + F_h (seven in run A, six in B):
                          90 and 79 GFLOP × 16,384 = 1.5 and 1.3 PFLOP
    total                 ≈ 20 PFLOP (both runs; validation and analysis add < 1): 25 s at 790 TFLOP/s,
                          63 s at a realistic 40% of it (316 TFLOP/s).
Add what is not FLOPs: building and saving 16 GB of weights (~30–60 s), loading them twice (~20 s each),
writing three exported views of 11.3 GB (21 blocks + embeddings + head; ~60 s), the analysis's SVDs of five
4096² operators per run, on the CPU (~15 s per run on 16 cores; 77 s on 2), Python and CUDA start-up
(~30 s): about 4–5 minutes expected, under 8 with a 2× margin on the I/O. `--budget` (default 450 s) skips
run B when run A has used so much that B (A's time less its calibration) would not finish; the JSON says so.

Memory on the GPU (estimates; the JSON has the measurements): weights 16.1 GB; statistics 0.8 GB (ghost
first_weighted + ghost_paper plain: 3 groups × 2 C×C float64; 1.6 GB when every group is kept) plus
~1.5 GB of float64 taps per batch; an operators student ≈ 1.4 GB of activations (block 31 at 8,192 tokens ×
~176 kB), ghost_lora_ft ≈ 29 GB (21 blocks), every student's graph alive until the one backward: ≈ 50 GiB at
run A's peak, which fits an 80 GB GPU too; two LoRA students would not (docs/gpu.md).

The device (one H200, 10 minutes a command, 15 minutes in all, no internet, no hub) has torch 2.11,
lightning 2.6, peft and transformers 5.17, and lacks jsonargparse, datasets, lm-eval and gguf. The fit path
needs (checked: `python scripts/device_check.py --tiny` with only these added to such an image):
    transformers==5.24.0        ghostdistill requires transformers>=5.19 (pyproject.toml; the suite runs on
                                5.19 and 5.24), and 5.17 is untested
    huggingface_hub==1.33.0     transformers 5.24 checks huggingface-hub>=1.31 at import; 5.17 needs only
                                >=1.5, so the image's may be older (1.33 keeps hub 1.x's dependencies)
    jsonargparse==4.53.0, docstring_parser==0.18.0, typeshed_client==2.15.0    LightningCLI's parser
datasets, gguf and lm-eval are imported only for hub text sources, GGUF files and zero-shot: never here.
Bring them (15.4 MB, 14.7 MiB, in all) in `.whl/`, which .gitignore ignores, so it travels only when named in
the device tool's `carry` (`carry: [".whl"]`):
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \\
        -d .whl transformers==5.24.0 huggingface_hub==1.33.0 jsonargparse==4.53.0 docstring_parser==0.18.0 \\
        typeshed_client==2.15.0
and on the device:
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \\
        && export PYTHONPATH=/tmp/site:$PWD && python3 scripts/device_check.py --out $OUT/device_check.json
If the image has no matplotlib, the report's plots are skipped (the JSON says so) rather than the run.
"""

from __future__ import annotations

import argparse
import gc
import importlib
import importlib.util
import json
import os
import platform
import shutil
import time
from pathlib import Path

from _device_sizing import (
    FAIR_PAIR,
    LLAMA3_11,
    LLAMA3_11_STUDENTS,
    Sizes,
    flops_per_token,
    implied_llama3_11,
    sizing,
    step_summary,
)
from _rehearsal import ACTIVE, GIB, Phases, fit_hooks
from _rehearsal_model import build_model_dir
from _rehearsal_steps import fit_args


def preflight() -> dict:
    """Versions, and what the fit path needs but cannot import (checked before minutes of work)."""
    info: dict = {"python": platform.python_version(), "versions": {}, "missing": [], "problems": []}
    for name in ("torch", "lightning", "transformers", "peft", "jsonargparse", "huggingface_hub", "matplotlib"):
        try:
            info["versions"][name] = importlib.import_module(name).__version__
        except Exception as err:  # noqa: BLE001 - a broken install is as missing as an absent one
            info["missing"].append(f"{name} ({type(err).__name__}: {err})"[:300])
    for name in ("docstring_parser", "typeshed_client"):
        if importlib.util.find_spec(name) is None:
            info["missing"].append(name)
    version = info["versions"].get("transformers", "0")
    if tuple(int(x) for x in version.split(".")[:2] if x.isdigit()) < (5, 19):
        info["problems"].append(f"transformers {version}: ghostdistill needs >=5.19 (pyproject.toml); bring 5.24")
    import torch

    info["cuda"] = torch.cuda.is_available()
    if info["cuda"]:
        info["device"] = torch.cuda.get_device_name(0)
        info["gpu_memory_gib"] = round(torch.cuda.get_device_properties(0).total_memory / GIB, 1)
    return info


def skip_plots_without_matplotlib() -> bool:
    """The plots need matplotlib; without it the report writes results.json and .md only."""
    if importlib.util.find_spec("matplotlib") is not None:
        return False
    import ghostdistill.reporting.results as results

    for name in ("plot", "plot_training", "plot_analysis"):
        setattr(results, name, lambda *args, **kwargs: None)
    return True


def free_memory() -> None:
    gc.collect()
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def one_run(name: str, args: list[str], sizes: Sizes, flops: dict, students: int) -> dict:
    """`fit` with the phases marked; the run's summary."""
    from ghostdistill.cli import main

    phases = Phases(cuda=sizes.device == "cuda")
    steps = fit_hooks(phases)
    start = time.perf_counter()
    out: dict = {"ok": False}
    try:
        cli = main(args)
        del cli
        out["ok"] = True
    except Exception as err:  # noqa: BLE001 - recorded in the JSON; the other run may still work
        import traceback

        out["error"] = f"{type(err).__name__}: {err}"[:2000]
        out["traceback"] = traceback.format_exc()[-4000:]
    finally:
        free_memory()
        out.update(phases.close())
        out["wall_s"] = round(time.perf_counter() - start, 2)
        out["throughput"] = step_summary(steps, flops, students)
        out["validate_s"] = ACTIVE["timings"].get("validate_s", [])
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="a hidden-64 model on the CPU (seconds)")
    parser.add_argument("--out", default=None, help="the JSON file (default $OUT/device_check.json)")
    parser.add_argument("--dir", default=None, help="work folder (default /tmp/ghostdistill_device_check)")
    parser.add_argument("--budget", type=float, default=450.0, help="seconds after which run B is skipped")
    parser.add_argument("--keep", action="store_true", help="keep the exported views")
    parser.add_argument(
        "--sizing", nargs="?", const=str(LLAMA3_11), default=None, metavar="CONFIG",
        help="print the full check's sizing (parameters, FLOPs per token) for CONFIG's students and exit",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.sizing is not None:
        try:
            print(json.dumps(sizing(Path(args.sizing))))
        except ValueError as err:
            raise SystemExit(f"--sizing {args.sizing}: {err}") from None
        return {"ok": True}
    start = time.perf_counter()
    out_path = Path(args.out or Path(os.environ.get("OUT", ".")) / "device_check.json")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    work = Path(args.dir or ("/tmp/ghostdistill_device_check" + ("_tiny" if args.tiny else "")))
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    sizes = Sizes(args.tiny)
    result: dict = {"ok": False, "tiny": args.tiny, "preflight": preflight(), "runs": {}}

    def save() -> None:
        result["seconds_total"] = round(time.perf_counter() - start, 1)
        out_path.write_text(json.dumps(result, indent=1))

    pre = result["preflight"]
    critical = [m for m in pre["missing"] if not m.startswith("matplotlib")] + pre["problems"]
    if critical:
        save()
        raise SystemExit(f"missing on this machine: {critical} (see the docstring for the wheels to bring)")
    if not args.tiny and not pre["cuda"]:
        save()
        raise SystemExit("no CUDA device: the full check needs a GPU (use --tiny on a CPU)")
    result["plots_skipped"] = skip_plots_without_matplotlib()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    model_dir = work / "model"
    began = time.perf_counter()
    built = build_model_dir(model_dir, sizes.shape, sizes.num_layers, dtype="bfloat16", device=sizes.device)
    free_memory()
    folder_bytes = sum(p.stat().st_size for p in model_dir.iterdir())
    result["model"] = {
        **built,
        "layers": sizes.num_layers,
        "shape": {k: v for k, v in sizes.shape.items() if k != "num_hidden_layers"},
        "folder_gib": round(folder_bytes / GIB, 2),
        "build_and_save_s": round(time.perf_counter() - began, 1),
    }
    result["plan"] = {
        "layers": sizes.layers,
        "why": "explicit: the deepest 11 blocks streamline may choose (keep_last 1 protects the last block)",
    }
    save()

    common = dict(
        layers=sizes.layers,
        recovery=None,  # configs/llama3_11.yaml's: ghost, ghost_paper (plain), linearpatch
        steps=sizes.steps,
        samples=sizes.samples,
        seq_len=sizes.seq_len,
        eval_windows=sizes.eval_windows,
        val_windows=sizes.val_windows,
        batch_size=sizes.batch_size,
        accelerator=sizes.accelerator,
        precision="bf16-true",
        keep="best",  # configs/llama3_11.yaml's recipe
        lr=1e-4,
    )
    # Run A is the config's students (None: as configs/llama3_11.yaml lists them), run B the fair pair alone.
    runs = {
        "llama3_11": (None, LLAMA3_11_STUDENTS, ["ghost_ft", "ghost_lora_ft"]),
        "fair_pair": ([], FAIR_PAIR, ["linearpatch_ft"]),
    }
    first = None
    for name, (students, kinds, export) in runs.items():
        run_dir = work / f"run_{name}"
        elapsed = time.perf_counter() - start
        if first is not None:
            # B does what A does but the calibration pass (resumed) and the third student.
            done = result["runs"][first]
            needed = done.get("wall_s", 0) - (done.get("phases", {}).get("calibration") or {}).get("seconds", 0.0)
            if elapsed + needed > args.budget:
                result["runs"][name] = {"skipped": f"{elapsed:.0f} s used; run B needs ~{needed:.0f} s of the budget"}
                continue
            # Run B resumes run A's statistics: same model, plan, data and recovery, so the same fingerprint.
            state = work / f"run_{first}" / "calibration_state.pt"
            if state.is_file():
                run_dir.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(state, run_dir / "calibration_state.pt")
        flops = flops_per_token(sizes.shape, sizes.num_layers, sizes.layers, sizes.seq_len, kinds)
        argv_fit = fit_args(
            model_dir, run_dir, "bfloat16", train="operators", students=students, export=export, **common
        )
        argv_fit += ["--export.dir", str(work / f"export_{name}")]
        result["runs"][name] = one_run(name, argv_fit, sizes, flops, len(kinds))
        if not args.keep:
            shutil.rmtree(work / f"export_{name}", ignore_errors=True)
        first = first or name
        save()

    run_a = result["runs"].get("llama3_11", {})
    result["llama3_11_implied"] = implied_llama3_11(run_a, sizes)
    result["ok"] = all(r.get("ok") or "skipped" in r for r in result["runs"].values()) and run_a.get("ok", False)
    save()
    if not args.keep:
        shutil.rmtree(model_dir, ignore_errors=True)
    print(json.dumps({k: result[k] for k in ("ok", "seconds_total", "llama3_11_implied")}))
    return result


if __name__ == "__main__":
    if not main()["ok"]:
        raise SystemExit(1)
