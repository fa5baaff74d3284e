"""Serve the plain views of a finished run with llama.cpp and check them against transformers.

For each view whose export is the plain architecture (pruned, magnitude, ReplaceMe, `rotation_through`, students
merged into those; operator views are refused with the reason, as `export --format gguf` refuses them):

1. GGUF files, one per type (F32, F16, Q8_0), written by ghostdistill's writer (`export.gguf`).
2. Greedy tokens: `llama-greedy-ids` (scripts/serving/llama_greedy.cpp, built beside llama.cpp's tools) continues
   each prompt, given as token ids, and prints token ids; they are compared with transformers' greedy tokens of
   the same view (`generate`, KV cache, end-of-text not stopping it). F32 files run with a float32 KV cache,
   the others with llama.cpp's default float16 one.
3. Perplexity: llama.cpp's own `llama-perplexity` on the run's WikiText-2 windows. The tool reads text, so it
   gets the text the run tokenized, cut a little past the last window, with `--no-escape` (otherwise `\\n` in
   the text would become a newline); `llama-tokenize` on the same file confirms that llama.cpp's tokens are the
   run's windows (`same_windows`). With `-c <seq_len> --chunks <windows>` its chunks are exactly those windows.
   The tool scores only the second half of each chunk (positions ⌊c/2⌋ … c-2 predicting the next token: the
   first half is context; it has no option to score every token, and `--ppl-stride` uses other windows), so
   transformers' figure is computed the same way on the same windows: exp(mean NLL of tokens c/2+1 … c-1 of
   each window), each window's first token replaced by BOS where the tokenizer adds one (Gemma), as the tool
   does. Tolerances on that figure: 1% for F32 and F16, 3% for Q8_0. The run's own figure (every
   token but the first of each window) is reported beside it.
4. Converter parity (`--parity`): llama.cpp's own `convert_hf_to_gguf.py` on the view's Hugging Face folder,
   as F32, against our F32 file: the same tensor names, shapes and values, and the metadata keys that differ.

Writes a JSON of everything measured and a markdown table:

    bash scripts/serving/llama_cpp.sh          # once: builds .serve/llama.cpp (about 6 min on 2 cores)
    python scripts/serving/check_llama_cpp.py runs/smollm2_serving --dir runs/smollm2_serving/serving/llama_cpp \\
        --json runs/smollm2_serving/serving/llama_cpp.json --markdown runs/smollm2_serving/serving/llama_cpp.md

`scripts/check_serving.py --stacks llama.cpp` runs the same check inside the cross-stack one.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from ghostdistill.export.quantize import find_tools, llama_cpp_root, llama_tokens, run_tool, threads

if __package__:  # imported from scripts/ as serving.check_llama_cpp (check_serving.py, quantize_table.py)
    from serving.report import common_prefix, divergence_margins, llama_cpp_table
else:  # run as scripts/serving/check_llama_cpp.py: its folder is the first entry of sys.path
    from report import common_prefix, divergence_margins, llama_cpp_table

LLAMA_CPP = llama_cpp_root()
TYPES = ("F32", "F16", "Q8_0")
TOLERANCE = {"F32": 0.01, "F16": 0.01, "Q8_0": 0.03}
PROMPTS = [
    "The capital of France is",
    "In 1969, the first humans",
    "A layer-pruned language model is",
    "Once upon a time",
]
TOOLS = ("llama-greedy-ids", "llama-perplexity", "llama-tokenize")


def tools(root: Path = LLAMA_CPP) -> dict[str, Path]:
    """The built tools (`export.quantize.find_tools`), or SystemExit naming the build command."""
    try:
        return find_tools(root, TOOLS, what="The serving check's tokens and perplexities")
    except FileNotFoundError as err:
        raise SystemExit(str(err)) from None


def greedy(tool: Path, model: Path, prompts: list[list[int]], new: int, f32_cache: bool) -> list[list[int]]:
    stdin = "\n".join(" ".join(map(str, p)) for p in prompts) + "\n"
    done = run_tool([tool, model, new] + (["f32"] if f32_cache else []), tool.name, input=stdin)
    return [[int(t) for t in line.split()] for line in done.stdout.splitlines() if line.strip()]


def perplexity(tool: Path, model: Path, text: Path, n_ctx: int, chunks: int, f32_cache: bool) -> dict:
    # --no-repack: the weights as the file lays them out, as llama-greedy-ids reads them (llama_greedy.cpp says why).
    cmd = [tool, "-m", model, "-f", text, "-c", n_ctx, "--chunks", chunks, "--no-escape", "-t", threads(), "-nr"]
    if f32_cache:
        cmd += ["-ctk", "f32", "-ctv", "f32"]
    start = time.perf_counter()
    done = run_tool(cmd, tool.name)
    found = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", done.stdout + done.stderr)
    if not found:
        raise SystemExit(f"{tool}: no final estimate in its output:\n{(done.stdout + done.stderr)[-3000:]}")
    return {"ppl": float(found.group(1)), "ppl_err": float(found.group(2)), "seconds": time.perf_counter() - start}


def eval_text(cfg, tokenizer, source, tokens: int, folder: Path) -> Path:
    """The text the run tokenized into its windows, cut 64 tokens past the last one (the cut cannot change the
    tokens before it), written verbatim."""
    from ghostdistill.data.sources import load_documents

    text = source.join.join(load_documents(source, for_eval=True))
    enc = tokenizer(text, return_offsets_mapping=True, add_special_tokens=False)
    stop = min(tokens + 64, len(enc.input_ids))
    end = enc.offset_mapping[stop - 1][1] if stop < len(enc.input_ids) else len(text)
    path = folder / f"{source.label}.txt"
    path.write_bytes(text[:end].encode("utf-8"))
    return path


def llama_cpp_windows(windows: torch.Tensor, tokenizer) -> torch.Tensor:
    """The windows as llama-perplexity runs them: with a tokenizer that adds BOS (Gemma, Llama), each chunk's first
    token is replaced by BOS (`tools/perplexity/perplexity.cpp`); SmolLM2's adds none, and its windows are the
    run's."""
    from ghostdistill.export.gguf_vocab import adds

    bos = tokenizer.bos_token_id
    if not adds(tokenizer, bos)[0]:
        return windows
    windows = windows.clone()
    windows[:, 0] = bos
    return windows


@torch.no_grad()
def transformers_figures(model, windows: torch.Tensor, batch_size: int) -> dict:
    """exp(mean NLL) over every token but the first of each window (the run's protocol) and over the second
    half (llama-perplexity's: positions c/2 … c-2 predicting the next token); `windows` as llama-perplexity runs
    them (`llama_cpp_windows`)."""
    seq = windows.shape[1]
    first = seq // 2
    nll_all = nll_half = 0.0
    for chunk in windows.split(batch_size):
        logits = model(input_ids=chunk, use_cache=False).logits[:, :-1].float()
        nll = torch.nn.functional.cross_entropy(logits.flatten(0, 1), chunk[:, 1:].flatten(), reduction="none")
        nll = nll.view(chunk.shape[0], seq - 1)
        nll_all += nll.sum().item()
        nll_half += nll[:, first:].sum().item()
    n = windows.shape[0]
    return {
        "ppl": math.exp(nll_all / (n * (seq - 1))),
        "ppl_second_half": math.exp(nll_half / (n * (seq - 1 - first))),
    }


def converter_parity(folder: Path, ours: Path, work: Path, root: Path = LLAMA_CPP) -> dict:
    """llama.cpp's convert_hf_to_gguf.py on `folder` (F32) against our F32 file."""
    import gguf

    theirs = work / f"{folder.name}.convert.F32.gguf"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src" / "gguf-py"), str(root / "pydeps")])}
    convert = [sys.executable, root / "src" / "convert_hf_to_gguf.py", folder, "--outfile", theirs, "--outtype", "f32"]
    run_tool(convert, "convert_hf_to_gguf.py", env=env)
    a, b = gguf.GGUFReader(str(ours)), gguf.GGUFReader(str(theirs))
    ta, tb = {t.name: t for t in a.tensors}, {t.name: t for t in b.tensors}
    diffs = {}
    for name in sorted(set(ta) & set(tb)):
        x, y = np.asarray(ta[name].data), np.asarray(tb[name].data)
        diffs[name] = float(np.abs(x.astype(np.float64) - y.astype(np.float64)).max()) if x.shape == y.shape else None
    fa, fb = a.fields, b.fields
    skip = ("GGUF.", "general.")
    keys_a = {k for k in fa if not k.startswith(skip) and not k.startswith("ghostdistill.")}
    keys_b = {k for k in fb if not k.startswith(skip)}
    differing = []
    for key in sorted(keys_a & keys_b):
        va, vb = fa[key].contents(), fb[key].contents()
        if va != vb:
            differing.append(key)
    theirs.unlink()
    return {
        "only_ours": sorted(set(ta) - set(tb)),
        "only_theirs": sorted(set(tb) - set(ta)),
        "shape_mismatch": sorted(n for n, d in diffs.items() if d is None),
        "max_abs_diff": max((d for d in diffs.values() if d is not None), default=0.0),
        "same_tensors": set(ta) == set(tb) and all(d == 0.0 for d in diffs.values()),
        "metadata_only_ours": sorted(keys_a - keys_b),
        "metadata_only_theirs": sorted(keys_b - keys_a),
        "metadata_differing": differing,
    }


def check_views(
    loaded,
    cfg,
    views: list[str],
    out: Path,
    *,
    types=TYPES,
    new: int = 20,
    parity: bool = False,
    root: Path = LLAMA_CPP,
    seed=None,
    discard: bool = False,
    log=print,
) -> dict:
    """The llama.cpp check of `views` of a loaded run (`pipeline.reload.load_run`); GGUF and folders go to `out`.

    With `discard`, each file is deleted once it has been checked (and a view's folder that this check wrote
    itself, once its converter parity is done), so the disk holds one view's files at a time: a float32 GGUF of
    SmolLM2-135M is 439 MB, and three views of three types with folders run a small disk out (CI did)."""
    from ghostdistill.export.gguf import refusal
    from ghostdistill.export.options import ExportOptions
    from ghostdistill.methods import ships_stock
    from ghostdistill.pipeline.export import export_views

    found = tools(root)
    source = cfg.data.evaluation.sources[0]
    windows = loaded.data.eval_ids(source)
    n, seq = windows.shape
    prompts = [loaded.tokenizer(p).input_ids for p in PROMPTS]
    report: dict = {
        "llama_cpp": str(root),
        "prompts": PROMPTS,
        "new": new,
        "source": source.label,
        "windows": [n, seq],
        "scored": "second half of each window (llama-perplexity's default), both stacks",
        "tolerance": TOLERANCE,
        "views": {},
    }
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        text = eval_text(cfg, loaded.tokenizer, source, n * seq, tmp)
        for view in views:
            method = cfg.method_of(view)
            if not ships_stock(method):
                report["views"][view] = {"refused": refusal(view, method)}
                log(f"llama.cpp {view}: refused (operators)")
                continue
            # With --parity the view's Hugging Face folder is needed too (check_serving.py has written it already).
            formats = ["hf", "gguf"] if parity and not (out / view / "config.json").is_file() else ["gguf"]
            wrote_folder = "hf" in formats
            paths = export_views(
                loaded.pruned,
                loaded.tokenizer,
                loaded.report,
                cfg,
                out,
                ExportOptions([view], overwrite=True, format=list(formats), gguf_types=list(types)),
                seed=seed,
            )
            files = {t: p for t, p in zip(types, paths[-len(types) :])}
            with loaded.pruned.use(view) as model:
                expected = [
                    model.generate(input_ids=torch.tensor([p]), max_new_tokens=new, do_sample=False, eos_token_id=None)[
                        0, len(p) :
                    ].tolist()
                    for p in prompts
                ]
                reference = transformers_figures(
                    model, llama_cpp_windows(windows, loaded.tokenizer), cfg.data.batch_size
                )
            entry: dict = {
                "transformers": {"tokens": expected, **reference},
                "ppl_run": loaded.report["views"][view]["metrics"][source.label]["ppl"],
            }
            tokens = llama_tokens(found, files[types[0]], text)
            entry["same_windows"] = tokens[: n * seq] == windows.flatten().tolist()
            for gguf_type, path in files.items():
                f32 = gguf_type == "F32"
                got = greedy(found["llama-greedy-ids"], path, prompts, new, f32)
                ppl = perplexity(found["llama-perplexity"], path, text, seq, n, f32)
                rel = (ppl["ppl"] - reference["ppl_second_half"]) / reference["ppl_second_half"]
                entry[gguf_type] = {
                    "file": str(path),
                    "bytes": path.stat().st_size,
                    "tokens": got,
                    "same_tokens": got == expected,
                    "same_prompts": sum(a == b for a, b in zip(got, expected)),
                    "same_prefix": [common_prefix(a, b) for a, b in zip(got, expected)],
                    "divergence": divergence_margins(loaded.pruned, view, prompts, expected, got),
                    **ppl,
                    "rel_diff": rel,
                    "within_tolerance": abs(rel) <= TOLERANCE[gguf_type],
                }
                log(
                    f"llama.cpp {view} {gguf_type}: tokens identical {got == expected} "
                    f"({entry[gguf_type]['same_prompts']}/{len(prompts)}), PPL {ppl['ppl']:.4f} vs transformers "
                    f"{reference['ppl_second_half']:.4f} ({100 * rel:+.3f}%)"
                )
                if discard and not (parity and f32):  # the parity below reads our F32 file
                    path.unlink()
            if parity:
                entry["converter_parity"] = converter_parity(out / view, files["F32"], tmp, root)
                log(f"llama.cpp {view}: convert_hf_to_gguf.py parity {entry['converter_parity']}")
                if discard:
                    files["F32"].unlink()
                    if wrote_folder:
                        shutil.rmtree(out / view)
            entry["discarded"] = discard
            report["views"][view] = entry
    return report


def main() -> None:
    from ghostdistill.cli import load_run_config
    from ghostdistill.pipeline.reload import load_run

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run", help="a finished run folder")
    parser.add_argument("--views", nargs="+", default=None, help="default: every view but dense")
    parser.add_argument("--dir", required=True, help="where the GGUF files (and, with --parity, folders) go")
    parser.add_argument("--types", nargs="+", default=list(TYPES), choices=TYPES)
    parser.add_argument("--new", type=int, default=20, help="tokens to generate per prompt")
    parser.add_argument("--parity", action="store_true", help="also compare with llama.cpp's convert_hf_to_gguf.py")
    parser.add_argument("--llama-cpp", default=str(LLAMA_CPP), help="the build of scripts/serving/llama_cpp.sh")
    parser.add_argument(
        "--discard", action="store_true", help="delete each file once checked (one view's files on disk at a time)"
    )
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    root = Path(args.llama_cpp)
    tools(root)
    run = Path(args.run)
    cfg, seed = load_run_config(run)
    views = args.views or [v for v in cfg.views() if v != "dense"]
    loaded = load_run(run, cfg, views)
    report = check_views(
        loaded,
        cfg,
        views,
        Path(args.dir),
        types=args.types,
        new=args.new,
        parity=args.parity,
        root=root,
        seed=seed,
        discard=args.discard,
    )
    report["run"] = str(run)
    text = llama_cpp_table(report, TYPES)
    print("\n" + text)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2))
    if args.markdown:
        Path(args.markdown).parent.mkdir(parents=True, exist_ok=True)
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
