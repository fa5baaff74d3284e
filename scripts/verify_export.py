"""Export views of a finished run and check the folders against the run, in a fresh process each.

1. The run is rebuilt from its folder (`ghostdistill export`'s path: statistics from calibration_state.pt,
   fine-tuned values from checkpoints/last.ckpt) and each view is exported to `--dir`.
2. In this process, each in-memory view greedily continues the prompts (batched, left-padded, KV cache).
3. For each folder, `scripts/reload_check.py` runs in a fresh process where ghostdistill cannot be
   imported: it loads the folder with `trust_remote_code=True`, continues the same prompts and scores the
   run's own evaluation windows (first evaluation source).
4. Printed: whether the tokens are identical, the decoded text, and the folder's perplexity beside the
   one in the run's results.json.

    .venv/bin/python scripts/verify_export.py runs/smollm2_distill_10 --views ghost ghost_ft --dir runs/exported
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ghostdistill.cli import load_run_config
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run")
    parser.add_argument("--views", nargs="+", required=True)
    parser.add_argument("--dir", required=True)
    parser.add_argument("--new", type=int, default=24, help="tokens to generate per prompt")
    parser.add_argument("--json", default=None, help="write the comparison here too")
    args = parser.parse_args()
    run = Path(args.run)
    cfg, seed = load_run_config(run)
    loaded = load_run(run, cfg, args.views)
    options = ExportOptions(args.views, overwrite=True)
    paths = export_views(loaded.pruned, loaded.tokenizer, loaded.report, cfg, Path(args.dir), options, seed=seed)
    results = loaded.report
    tok = loaded.tokenizer
    tok.padding_side = "left"
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    source = cfg.data.evaluation.sources[0].label
    windows = loaded.data.eval_ids(cfg.data.evaluation.sources[0])
    report = {}
    with tempfile.TemporaryDirectory() as tmp:
        inputs = Path(tmp) / "inputs.pt"
        torch.save(
            {
                "ids": enc["input_ids"],
                "mask": enc["attention_mask"],
                "new": args.new,
                "windows": windows,
                "batch_size": cfg.data.batch_size,
            },
            inputs,
        )
        for view, folder in zip(args.views, paths):
            with torch.no_grad(), loaded.pruned.use(view) as model:
                expected = model.generate(
                    input_ids=enc["input_ids"],
                    attention_mask=enc["attention_mask"],
                    max_new_tokens=args.new,
                    do_sample=False,
                )
            out = Path(tmp) / f"{view}.pt"
            env = {
                **os.environ,
                "PYTHONPATH": "",
                "HF_MODULES_CACHE": str(Path(tmp) / "modules"),
            }
            done = subprocess.run(
                [
                    sys.executable,
                    str(ROOT / "scripts" / "reload_check.py"),
                    str(Path(folder).resolve()),
                    str(inputs),
                    str(out),
                ],
                env=env,
                capture_output=True,
                text=True,
                cwd=tmp,
                check=False,
            )
            if done.returncode:
                raise SystemExit(f"{view}: the fresh process failed:\n{done.stderr[-3000:]}")
            got = torch.load(out)
            run_ppl = results["views"][view]["metrics"][source]["ppl"]
            report[view] = {
                "folder": str(folder),
                "class": got["class"],
                "same_tokens": bool(torch.equal(got["tokens"], expected)),
                "text": tok.batch_decode(
                    got["tokens"][:, enc["input_ids"].shape[1] :],
                    skip_special_tokens=True,
                ),
                "ppl_run": run_ppl,
                "ppl_folder": got["ppl"],
                "rel_diff": abs(got["ppl"] - run_ppl) / run_ppl,
                "tokens_scored": got["tokens_scored"],
            }
            r = report[view]
            print(
                f"{view}: {folder} loaded as {r['class']} in a fresh process; greedy tokens identical to the run's "
                f"view: {r['same_tokens']}; {source} PPL run {run_ppl:.4f}, folder {r['ppl_folder']:.4f} "
                f"(relative difference {r['rel_diff']:.1e}, {r['tokens_scored']} tokens)"
            )
            for prompt, text in zip(PROMPTS, r["text"]):
                print(f"    {prompt!r} -> {text!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
