"""How much distinct text each budget of a distillation run saw (docs/results/budgets.md, issue 51).

A run trains on `data.train.num_samples` random windows, visited in the order `lit.datamodule.StepWindows`
gives them (one seeded permutation per epoch). For each token budget this prints how many of the tokens seen
so far were distinct and how many repeated. A token counts as repeated when the same 31 tokens around it
(15 either side, clipped at its window's edges) were seen before: windows drawn from overlapping offsets of
one document (or of the joined short documents) share text, so "distinct" is about the source text, not the
window index.

    .venv/bin/python scripts/studies/budget_data.py runs/smollm2_budgets 20480 81920 307200 1003520
"""

from __future__ import annotations

import argparse
from pathlib import Path

import yaml

from ghostdistill.core.model import ModelConfig, load_tokenizer
from ghostdistill.data.sources import TextSource
from ghostdistill.data.windows import calibration_windows
from ghostdistill.lit.datamodule import StepWindows

HALF = 15


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a run folder (its config.yaml names the training data)")
    parser.add_argument("budgets", type=int, nargs="+", help="training tokens per student")
    args = parser.parse_args()
    if not (args.run / "config.yaml").is_file():
        parser.error(f"{args.run} holds no config.yaml: give the folder of a fit run (its trainer.default_root_dir)")
    if any(b < 1 for b in args.budgets):
        parser.error(f"budgets {args.budgets}: give positive token counts, e.g. 20480 81920")
    cfg = yaml.safe_load((args.run / "config.yaml").read_text())
    data, train = cfg["data"], cfg["data"]["train"]
    tok = load_tokenizer(ModelConfig(**{k: v for k, v in cfg["model"]["model"].items() if k != "offload_folder"}))
    ids = calibration_windows(tok, TextSource(**train["source"]), train["seq_len"], train["num_samples"], train["seed"])
    stream = StepWindows(ids, data["batch_size"], train["seed"], 0, 1, 0)
    seen: set[int] = set()
    tokens = repeated = 0
    budgets = sorted(args.budgets)
    print(f"{len(ids)} windows of {ids.shape[1]} tokens ({ids.numel():,} tokens)")
    print("| tokens per student | distinct | repeated |\n|---|---|---|")
    for batch in stream:
        w = batch["input_ids"].tolist()
        for p in range(len(w)):
            key = hash(tuple(w[max(0, p - HALF) : p + HALF + 1]))
            repeated += key in seen
            seen.add(key)
        tokens += len(w)
        while budgets and tokens >= budgets[0]:
            print(f"| {budgets.pop(0):,} | {tokens - repeated:,} | {repeated:,} |")
        if not budgets:
            break


if __name__ == "__main__":
    main()
