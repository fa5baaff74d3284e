"""How much distinct text each budget of a distillation run saw (docs/results/budgets.md, issue 51).

A run trains on its `data.train` windows (random or disjoint windows of its text, and the windows the dense model
generated, read from the run folder where the run kept them), visited in the order `lit.datamodule.StepWindows`
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

from ghostdistill.cli.export import load_run_config
from ghostdistill.core.model import load_tokenizer, model_key
from ghostdistill.data.run import RunData
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
    cfg, _ = load_run_config(args.run)
    # The run's own training windows: random or disjoint windows of its text, and the generated windows it kept.
    data = RunData(cfg.data, load_tokenizer(cfg.model), args.run, model_key=model_key(cfg.model), write=False)
    ids = data.train_ids()
    stream = StepWindows(ids, cfg.data.batch_size, cfg.data.train.seed, 0, 1, 0)
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
