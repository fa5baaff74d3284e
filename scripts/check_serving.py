"""Serve the views of a finished run in every stack and check them against transformers, token for token.

1. The run is rebuilt from its folder (`ghostdistill export`'s path) and each view is exported to `--dir`
   as a Hugging Face folder.
2. transformers: each folder is loaded in a fresh process where ghostdistill cannot be imported
   (`scripts/reload_check.py`, `trust_remote_code=True`); it continues the prompts greedily (each alone, KV
   cache, a fixed number of tokens) and scores the run's own evaluation windows. Its tokens are the
   reference; its perplexity is checked against the run's results.json.
3. vLLM (`--stacks vllm`): `scripts/serving/vllm_check.py` in the environment that has vLLM
   (`--vllm-python`, default `.venv-serve/bin/python`, which `bash scripts/setup.sh --serve` makes): the
   same prompts (as token ids) and windows (perplexity from prompt log-probabilities, within 0.5% of
   transformers'); with `--throughput`, prefill and decode tokens per second of ghost beside pruned, in
   interleaved repeats. With `--schemes W8A8 W4A16`, each view is also quantized by llm-compressor
   (`export --format compressed-tensors`, in `.venv-quantize`, calibrated on the run's calibration windows) and
   served in vLLM beside its float folder: perplexity on the same windows beside the float view's in vLLM, and
   greedy tokens against the float view's (how many of the prompts identical, and where the first parts).
4. llama.cpp (`--stacks llama.cpp`): `scripts/serving/check_llama_cpp.py` with the tools that
   `bash scripts/serving/llama_cpp.sh` builds into `.serve/llama.cpp` (`--llama-cpp`): each plain view as GGUF
   F32 / F16 / Q8_0 files in `--dir`, greedy tokens (as token ids) against transformers', and
   `llama-perplexity` on the same windows, compared with transformers' figure over the same tokens: the
   second half of each window, which is all the tool scores (within 1% for F32 / F16, 3% for Q8_0). Operator
   views are refused, as `export --format gguf` refuses them. `--parity` adds llama.cpp's own
   `convert_hf_to_gguf.py` on each folder against our F32 file.

Prints one table (a row per view, a column per stack: tokens identical ✔/✗ and the perplexity there) and
writes everything measured to `--json`; `--markdown` writes the table.

    .venv-serve/bin/python scripts/check_serving.py runs/smollm2_serving --dir runs/smollm2_serving/served \
        --stacks transformers vllm llama.cpp --throughput --json runs/smollm2_serving/serving.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from serving import check_llama_cpp  # scripts/serving/check_llama_cpp.py
from serving.report import parted, stacks_table  # scripts/serving/report.py

from ghostdistill.cli import load_run_config
from ghostdistill.export.compressed import SCHEMES, compressed_path
from ghostdistill.export.formats import view_kind
from ghostdistill.export.options import ExportOptions
from ghostdistill.pipeline.export import export_views
from ghostdistill.pipeline.reload import load_run

ROOT = Path(__file__).resolve().parents[1]

PROMPTS = [
    "The capital of France is",
    "In 1969, the first humans",
    "A layer-pruned language model is",
    "Once upon a time",
]
# Relative perplexity tolerances against transformers' figure on the same windows.
VLLM_TOLERANCE = 0.005


def fresh_transformers(folder: Path, inputs: Path, out: Path, tmp: Path) -> dict:
    """`scripts/reload_check.py` on `folder` in a process where ghostdistill cannot be imported."""
    env = {**os.environ, "PYTHONPATH": "", "HF_MODULES_CACHE": str(tmp / "modules")}
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "reload_check.py"), str(folder.resolve()), str(inputs), str(out)],
        env=env,
        capture_output=True,
        text=True,
        cwd=tmp,
        check=False,
    )
    if done.returncode:
        raise SystemExit(f"{folder}: transformers failed in a fresh process:\n{done.stderr[-3000:]}")
    return torch.load(out)


def run_vllm(python: str, request: dict, tmp: Path, retry: bool = True) -> dict:
    """`scripts/serving/vllm_check.py` under `python` (an environment with vLLM). A process that aborted after
    writing every result counts as done; one that aborted part way (vLLM's CPU engine has died between views,
    `terminate called without an active exception`, once in many CI runs) is run once more for the views it did
    not reach, and says so. A view that fails the same way twice fails the check."""
    path, out = tmp / "vllm_request.pt", tmp / "vllm.json"
    out.unlink(missing_ok=True)
    torch.save(request, path)
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    # Output to files, not pipes, and in a session of its own: an aborted process leaves vLLM's engine processes
    # behind, which would hold pipes open (and this wait) for ever; they go with the session once it has ended.
    with open(tmp / "vllm.out", "w+") as stdout, open(tmp / "vllm.err", "w+") as stderr:
        command = [python, str(ROOT / "scripts" / "serving" / "vllm_check.py"), str(path), str(out)]
        process = subprocess.Popen(command, env=env, stdout=stdout, stderr=stderr, cwd=tmp, start_new_session=True)
        try:
            process.wait()
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        stdout.seek(0), stderr.seek(0)
        done = subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())
    served = json.loads(out.read_text()) if out.is_file() else None
    if not done.returncode or (served and served.get("done")):
        if done.returncode:
            print(f"vLLM's process ended with code {done.returncode} after writing every result", file=sys.stderr)
        return served
    failed = f"vLLM failed (exit code {done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    measured = (served or {}).get("views", {})
    if not retry or not measured:
        raise SystemExit(failed)
    rest = sorted(set(request["views"]) - set(measured))
    print(
        f"vLLM's process ended with code {done.returncode} after {sorted(measured)}: once more for {rest}",
        file=sys.stderr,
    )
    again = run_vllm(python, request | {"skip": sorted(measured)}, tmp, retry=False)
    return again | {"views": measured | again["views"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a finished run folder")
    parser.add_argument("--views", nargs="+", default=None, help="default: every view but dense")
    parser.add_argument("--dir", required=True, help="where the exported folders go")
    parser.add_argument(
        "--stacks",
        nargs="+",
        default=["transformers", "vllm", "llama.cpp"],
        choices=["transformers", "vllm", "llama.cpp"],
    )
    parser.add_argument("--new", type=int, default=20, help="tokens to generate per prompt")
    parser.add_argument("--vllm-python", default=str(ROOT / ".venv-serve" / "bin" / "python"))
    parser.add_argument("--vllm-compile", action="store_true", help="let vLLM compile the model (default: eager)")
    parser.add_argument("--throughput", action="store_true", help="vLLM prefill / decode of ghost beside pruned")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved throughput repeats")
    parser.add_argument(
        "--schemes", nargs="*", default=[], choices=SCHEMES, help="also serve each view quantized (compressed-tensors)"
    )
    parser.add_argument("--quantize-python", default=None, help="llm-compressor's Python (default .venv-quantize)")
    parser.add_argument(
        "--llama-cpp", default=str(check_llama_cpp.LLAMA_CPP), help="scripts/serving/llama_cpp.sh's build"
    )
    parser.add_argument("--gguf-types", nargs="+", default=list(check_llama_cpp.TYPES), choices=check_llama_cpp.TYPES)
    parser.add_argument("--parity", action="store_true", help="llama.cpp's convert_hf_to_gguf.py against our GGUF")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    run = Path(args.run)
    cfg, seed = load_run_config(run)
    views = args.views or [v for v in cfg.views() if v != "dense"]
    if "vllm" in args.stacks and not Path(args.vllm_python).is_file():
        raise SystemExit(
            f"{args.vllm_python} does not exist: run `bash scripts/setup.sh --serve`, or name --vllm-python"
        )
    if "llama.cpp" in args.stacks:
        check_llama_cpp.tools(Path(args.llama_cpp))
    loaded = load_run(run, cfg, views)
    folders = dict(
        zip(
            views,
            export_views(
                loaded.pruned,
                loaded.tokenizer,
                loaded.report,
                cfg,
                Path(args.dir),
                ExportOptions(views, overwrite=True),
                seed=seed,
            ),  # fmt: skip
        )
    )
    not_quantized: dict[str, str] = {}
    for view in views if args.schemes else []:
        for scheme in args.schemes:
            # One folder at a time, so that a scheme llm-compressor cannot apply to a view is reported, not fatal.
            try:
                options = ExportOptions(
                    [view], overwrite=True, format=["compressed-tensors"], schemes=[scheme],
                    quantize_python=args.quantize_python,
                )  # fmt: skip
                export_views(
                    loaded.pruned, loaded.tokenizer, loaded.report, cfg, Path(args.dir), options, seed=seed,
                    calibration=loaded.data.calibration_ids,
                )  # fmt: skip
            except RuntimeError as error:
                not_quantized[f"{view}.{scheme}"] = str(error)
                print(f"not quantized: {error}", flush=True)
    source = cfg.data.evaluation.sources[0]
    windows = loaded.data.eval_ids(source)
    prompts = [loaded.tokenizer(p).input_ids for p in PROMPTS]
    report: dict = {
        "run": str(run),
        "prompts": PROMPTS,
        "new": args.new,
        "source": source.label,
        "schemes": args.schemes,
        "views": {},
    }
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        inputs = tmp / "inputs.pt"
        torch.save({"prompts": prompts, "new": args.new, "windows": windows, "batch_size": cfg.data.batch_size}, inputs)
        for view, folder in folders.items():
            with torch.no_grad(), loaded.pruned.use(view) as model:
                expected = [
                    model.generate(
                        input_ids=torch.tensor([p]), max_new_tokens=args.new, do_sample=False, eos_token_id=None
                    )[0, len(p) :].tolist()
                    for p in prompts
                ]
            got = fresh_transformers(folder, inputs, tmp / f"{view}.pt", tmp)
            kind = view_kind(cfg.method_of(view))
            report["views"][view] = {
                "folder": str(folder),
                "kind": kind,
                "ppl_run": loaded.report["views"][view]["metrics"][source.label]["ppl"],
                "transformers": {
                    "tokens": got["prompt_tokens"],
                    "same_tokens_as_run": got["prompt_tokens"] == expected,
                    "ppl": got["ppl"],
                    "class": got["class"],
                },
            }
            print(
                f"transformers {view}: tokens as the run's view {got['prompt_tokens'] == expected}, PPL {got['ppl']:.4f}",
                flush=True,
            )
        if "vllm" in args.stacks:
            quantized = {
                f"{v}.{s}": str(compressed_path(args.dir, v, s).resolve())
                for v in folders
                for s in args.schemes
                if f"{v}.{s}" not in not_quantized
            }
            request = {
                "views": {v: str(Path(f).resolve()) for v, f in folders.items()} | quantized,
                "keep_going": list(quantized),
                "prompts": prompts,
                "new": args.new,
                "windows": windows,
                "dtype": cfg.model.dtype,
                "eager": not args.vllm_compile,
                "throughput": None,
            }
            if args.throughput:
                if not {"ghost", "pruned"} <= set(folders):
                    raise SystemExit(
                        "--throughput measures ghost beside pruned: export both (--views ... ghost pruned)"
                    )
                request["throughput"] = {
                    # pruned twice: through vLLM's own Llama and through the Transformers backend that serves
                    # ghost, so the operator's cost is told apart from the backend's.
                    "variants": {
                        "ghost": ["ghost", "transformers"],
                        "pruned_backend": ["pruned", "transformers"],
                        "pruned": ["pruned", "auto"],
                    },
                    "repeats": args.repeats,
                    "prefill": [16, 512],
                    "decode": [16, 16, 128],
                }
            served = run_vllm(args.vllm_python, request, tmp)
            for name in quantized:
                view, scheme = name.split(".", 1)
                entry, float_entry = served["views"][name], served["views"][view]
                report["views"][view][f"vllm {scheme}"] = (
                    {"error": entry["error"]}
                    if "error" in entry
                    else {
                        "tokens": entry["tokens"],
                        "parted": parted(entry["tokens"], float_entry["tokens"]),
                        "ppl": entry["ppl"],
                        "rel_diff": (entry["ppl"] - float_entry["ppl"]) / float_entry["ppl"],
                        "load_s": entry["load_s"],
                    }
                )
            for name, error in not_quantized.items():
                view, scheme = name.split(".", 1)
                report["views"][view][f"vllm {scheme}"] = {"error": f"llm-compressor: {error}"}
            for view, entry in served["views"].items():
                if view in quantized:
                    continue
                ref = report["views"][view]["transformers"]
                report["views"][view]["vllm"] = {
                    "same_tokens": entry["tokens"] == ref["tokens"],
                    "tokens": entry["tokens"],
                    "ppl": entry["ppl"],
                    "rel_diff": (entry["ppl"] - ref["ppl"]) / ref["ppl"],
                    "within_tolerance": abs(entry["ppl"] - ref["ppl"]) / ref["ppl"] <= VLLM_TOLERANCE,
                    "load_s": entry["load_s"],
                }
            report["vllm"] = {
                "version": served["vllm"],
                "eager": served["eager"],
                "throughput": served.get("throughput"),
            }
    if "llama.cpp" in args.stacks:
        served = check_llama_cpp.check_views(
            loaded,
            cfg,
            views,
            Path(args.dir),
            types=args.gguf_types,
            new=args.new,
            parity=args.parity,
            root=Path(args.llama_cpp),
            seed=seed,
        )
        report["llama.cpp"] = {k: v for k, v in served.items() if k != "views"}
        for view, entry in served["views"].items():
            for gguf_type in args.gguf_types:
                if "refused" in entry:
                    report["views"][view][f"llama.cpp {gguf_type}"] = {"refused": entry["refused"]}
                    continue
                got = entry[gguf_type]
                report["views"][view][f"llama.cpp {gguf_type}"] = {
                    **got,
                    "reference": entry["transformers"]["ppl_second_half"],
                    "same_windows": entry["same_windows"],
                }
            if "converter_parity" in entry:
                report["views"][view]["converter_parity"] = entry["converter_parity"]
    text = stacks_table(report, args.stacks, args.gguf_types)
    print("\n" + text)
    tp = (report.get("vllm") or {}).get("throughput")
    if tp:
        for what in ("prefill_tok_s", "decode_tok_s"):
            print(
                f"vLLM {what}: ghost {tp['ghost'][what]:.1f}, pruned through the same backend "
                f"{tp['pruned_backend'][what]:.1f} (ratio {tp['ghost'][what] / tp['pruned_backend'][what]:.3f}), "
                f"pruned through vLLM's own model {tp['pruned'][what]:.1f}"
            )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
