"""Peak memory of evaluating one batch against vocabulary size: the full-logits path against the chunked one.

For each vocabulary size, a tiny LLaMA (hidden 64, 4 blocks, 2 removed) scores one batch of
`--batch` × `--seq-len` random tokens for the dense and the pruned view, each path in a fresh process
(peak RSS above the level after building the model and the batch; peak CUDA memory on a GPU):

- ``full`` (the earlier `test_step`): each view's whole logits [batch, seq-1, V] from the model's
  forward, `score_tokens` over them, the dense log-probabilities of the whole batch kept as the
  reference for KL and top-1;
- ``chunked`` (now, `pipeline.evaluate.score_views`): each view's final hidden states, the head applied
  a chunk of tokens at a time for the dense and the view together (`evaluation.metrics.score_hidden`;
  the default chunk is sized by the vocabulary, `core.head.tokens_per_chunk`).

The script also checks that both paths give the same perplexity, KL and top-1 (printed).

    .venv/bin/python scripts/benchmark_eval_memory.py --vocab 32768 131072 262144 --batch 4 --seq-len 512
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
from _measure import peak_since, start_peak

from ghostdistill.core.head import final_hidden, output_head, tokens_per_chunk
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.evaluation.metrics import (
    next_token_targets,
    score_hidden,
    score_tokens,
)


def _model(vocab: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
    )
    return AutoModelForCausalLM.from_config(config).eval()


@torch.no_grad()
def probe(args) -> dict:
    """Runs in a fresh process: peak memory of scoring one batch with `args.path`."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = _model(args.vocab).to(device)
    pm = PrunedModel(model, PruningPlan.from_layers([1, 2], 4))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq_len), generator=g).to(device)
    mask = torch.ones_like(ids)
    targets, valid = next_token_targets(ids, mask)
    base = start_peak(device)
    if args.path == "full":
        reference = None
        for view in ("dense", "pruned"):
            with pm.use(view) as m:
                logits = m(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1]
            scores = score_tokens(
                logits,
                targets,
                reference=reference,
                chunk=args.chunk or 1024,
                keep_logprobs=reference is None,
            )
            del logits
            if reference is None:
                reference = scores.logprobs
        nll, kl, top1 = scores.nll[valid], scores.kl[valid], scores.top1[valid]
    else:
        hidden = {}
        for view in ("dense", "pruned"):
            with pm.use(view) as m:
                hidden[view] = final_hidden(m, ids, mask)[:, :-1]
        chunk = tokens_per_chunk(args.vocab, args.chunk)
        scores = score_hidden(hidden, output_head(model), targets, valid, reference="dense", chunk=chunk)["pruned"]
        nll, kl, top1 = scores.nll, scores.kl, scores.top1
    peak = peak_since(device, base)
    return {
        "peak_mib": peak / 2**20,
        "ppl": float(nll.double().mean().exp()),
        "kl": float(kl.double().mean()),
        "top1": float(top1.double().mean()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, nargs="+", default=[32768, 131072, 262144])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument(
        "--chunk",
        type=int,
        default=None,
        help="positions per chunk of the full path (default 1024, its old default); tokens per chunk of "
        "the chunked path (default: evaluation.logit_chunk null, sized by the vocabulary)",
    )
    p.add_argument("--path", choices=["full", "chunked"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.path is not None:  # the fresh-process probe
        args.vocab = args.vocab[0]
        print(json.dumps(probe(args)))
        return
    print(f"batch {args.batch} x {args.seq_len} tokens, dense + pruned view, chunk {args.chunk or 'default'}")
    print(
        "| vocabulary | full logits: peak MiB | chunked: peak MiB | ratio | PPL full / chunked | KL full / chunked | top-1 full / chunked |"
    )
    print("|---|---|---|---|---|---|---|")
    for vocab in args.vocab:
        row = {}
        for path in ("full", "chunked"):
            cmd = [
                sys.executable,
                __file__,
                "--path",
                path,
                "--vocab",
                str(vocab),
                "--batch",
                str(args.batch),
                "--seq-len",
                str(args.seq_len),
                *(["--chunk", str(args.chunk)] if args.chunk else []),
            ]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            row[path] = json.loads(out.strip().splitlines()[-1])
        f, c = row["full"], row["chunked"]
        print(
            f"| {vocab:,} | {f['peak_mib']:,.0f} | {c['peak_mib']:,.0f} | {c['peak_mib'] / f['peak_mib']:.3f} | "
            f"{f['ppl']:.4f} / {c['ppl']:.4f} | {f['kl']:.6f} / {c['kl']:.6f} | {f['top1']:.4f} / {c['top1']:.4f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
