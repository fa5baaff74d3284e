"""Does a repair survive 4 bits? Each view of finished runs as GGUF at F16, Q8_0 (ghostdistill's writer), Q6_K,
Q5_K_M and Q4_K_M (llama.cpp's `llama-quantize`, with the importance matrix `llama-imatrix` computes over the
run's calibration windows, as `export --format gguf` does), and Q4_K_M without the matrix; `llama-perplexity` on
each, beside transformers' float32 figure over the same tokens.

The tokens: the run's WikiText-2 windows. `llama-perplexity -c <seq_len> --chunks <windows>` on the text the run
tokenized makes each chunk one window (`llama-tokenize` confirms it, `same_windows`), and it scores the second
half of each chunk, so transformers' figure is over those tokens too (scripts/serving/check_llama_cpp.py, whose
functions this uses). Files are deleted once measured (one view's files on disk at a time).

Per column the methods are ranked by perplexity (`order`), and per file the loss to quantization is its
perplexity over the same view's F16 figure. `--tensors` also writes, for each view's Q4_K_M with and without the
matrix, every tensor's relative error ‖Ŵ − W‖_F / ‖W‖_F against the F32 weights, its storage type, and its
outlier ratio max|W| / rms(W), to see where a repair loses more than the pruned model.

    bash scripts/serving/llama_cpp.sh            # once: llama.cpp's tools, llama-quantize and llama-imatrix too
    python scripts/quantize_table.py runs/q42_7 runs/q42_11 --dir /tmp/quant --json quant.json --markdown quant.md
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
from serving import check_llama_cpp  # scripts/serving/check_llama_cpp.py

from ghostdistill.export.quantize import llama_tokens

TYPES = ("F16", "Q8_0", "Q6_K", "Q5_K_M", "Q4_K_M")
PLAIN = "Q4_K_M no imatrix"
COLUMNS = (*TYPES, PLAIN)


def tensor_errors(f32: Path, quantized: Path) -> dict:
    """Per tensor: storage type, relative error against the F32 file, and max|W| / rms(W) of the F32 weight."""
    import gguf

    ref = {t.name: t for t in gguf.GGUFReader(str(f32)).tensors}
    out = {}
    for t in gguf.GGUFReader(str(quantized)).tensors:
        w = np.asarray(ref[t.name].data, dtype=np.float64)
        q = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(w.shape)
        rms = float(np.sqrt(np.mean(w**2))) or 1.0
        out[t.name] = {
            "type": t.tensor_type.name,
            "rel_error": float(np.linalg.norm(q - w) / (np.linalg.norm(w) or 1.0)),
            "outlier_ratio": float(np.abs(w).max() / rms),
        }
    return out


def measure_run(run: Path, views: list[str] | None, out: Path, llama_cpp: Path, tensors: bool, log=print) -> dict:
    from ghostdistill.cli import load_run_config
    from ghostdistill.export.gguf import export_gguf
    from ghostdistill.export.options import provenance
    from ghostdistill.methods import ships_stock
    from ghostdistill.pipeline.reload import load_run

    os.environ["GHOSTDISTILL_LLAMA_CPP"] = str(llama_cpp)
    tools = check_llama_cpp.tools(llama_cpp)
    cfg, seed = load_run_config(run)
    views = views or [v for v in cfg.views() if ships_stock(cfg.method_of(v))]
    loaded = load_run(run, cfg, views)
    source = cfg.data.evaluation.sources[0]
    windows = loaded.data.eval_ids(source)
    n, seq = windows.shape
    report: dict = {"run": str(run), "plan": loaded.report.get("plan", {}).get("removed"), "windows": [n, seq]}
    report["views"] = {}
    with tempfile.TemporaryDirectory() as tmp_name:
        text = check_llama_cpp.eval_text(cfg, loaded.tokenizer, source, n * seq, Path(tmp_name))
        for view in views:
            method = cfg.method_of(view)
            info = provenance(loaded.report, view, method, seed)
            start = time.perf_counter()
            with loaded.pruned.use(view) as model:
                ours = check_llama_cpp.llama_cpp_windows(windows, loaded.tokenizer)
                reference = check_llama_cpp.transformers_figures(model, ours, cfg.data.batch_size)
            entry: dict = {"transformers_f32": reference["ppl_second_half"], "ppl_run": reference["ppl"]}
            root = out / run.name / view
            common = dict(method=method, tokenizer=loaded.tokenizer, info=info, overwrite=True, log=log)
            paths = export_gguf(
                loaded.pruned, view, root, types=["F32", *TYPES], calibration=loaded.data.calibration_ids, **common
            )
            files = dict(zip(["F32", *TYPES], paths))
            (files[PLAIN],) = export_gguf(
                loaded.pruned, view, root / "plain", types=["Q4_K_M"], imatrix=False, **common
            )
            tokens = llama_tokens(tools, files["F16"], text)
            entry["same_windows"] = tokens[: n * seq] == windows.flatten().tolist()
            for column in COLUMNS:
                ppl = check_llama_cpp.perplexity(tools["llama-perplexity"], files[column], text, seq, n, False)
                entry[column] = {"bytes": files[column].stat().st_size, **ppl}
                log(
                    f"{run.name} {view} {column}: PPL {ppl['ppl']:.3f} (transformers F32 {entry['transformers_f32']:.3f})"
                )
            if tensors:
                entry["tensors"] = {c: tensor_errors(files["F32"], files[c]) for c in ("Q4_K_M", PLAIN)}
            shutil.rmtree(root)
            entry["seconds"] = time.perf_counter() - start
            report["views"][view] = entry
    return report


def spans(blocks: list[int]) -> str:
    """[4, 5, 6, 7, 12, …, 18] -> '4–7+12–18'."""
    runs: list[list[int]] = []
    for b in sorted(blocks):
        if runs and b == runs[-1][-1] + 1:
            runs[-1].append(b)
        else:
            runs.append([b])
    return "+".join(f"{r[0]}–{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)


def table(reports: list[dict]) -> str:
    head = ["plan", "view", "transformers F32"] + list(COLUMNS) + ["Q4_K_M / F16", "no imatrix / F16"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for report in reports:
        plan = spans(report["plan"] or [])
        for view, e in report["views"].items():
            cells = [plan, view, f"{e['transformers_f32']:.2f}"] + [f"{e[c]['ppl']:.2f}" for c in COLUMNS]
            cells += [f"{100 * (e['Q4_K_M']['ppl'] / e['F16']['ppl'] - 1):+.1f}%"]
            cells += [f"{100 * (e[PLAIN]['ppl'] / e['F16']['ppl'] - 1):+.1f}%"]
            lines.append("| " + " | ".join(cells) + " |")
        views = report["views"]
        reference = sorted(views, key=lambda v: views[v]["transformers_f32"])
        order = {c: sorted(views, key=lambda v: views[v][c]["ppl"]) for c in COLUMNS}
        cells = [plan, "order", " < ".join(reference)]
        cells += ["same" if order[c] == reference else " < ".join(order[c]) for c in COLUMNS]
        cells += ["unchanged" if all(o == reference for o in order.values()) else "changed", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("runs", nargs="+", help="finished run folders")
    parser.add_argument("--views", nargs="+", default=None, help="default: every view GGUF can hold")
    parser.add_argument("--dir", required=True, help="where the files go while they are measured")
    parser.add_argument("--llama-cpp", default=str(check_llama_cpp.LLAMA_CPP), help="the build of llama_cpp.sh")
    parser.add_argument("--tensors", action="store_true", help="per-tensor errors of the Q4_K_M files")
    parser.add_argument("--json", default=None)
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args()
    reports = []
    for run in args.runs:
        reports.append(measure_run(Path(run), args.views, Path(args.dir), Path(args.llama_cpp), args.tensors))
        if args.json:  # after each run: a long measurement loses nothing when it stops
            Path(args.json).write_text(json.dumps(reports, indent=2))
    text = table(reports)
    print("\n" + text)
    if args.markdown:
        Path(args.markdown).write_text(text + "\n")


if __name__ == "__main__":
    main()
