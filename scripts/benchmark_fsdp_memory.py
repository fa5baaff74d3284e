"""Parameter memory per process: one process holding the whole model against N processes sharding it with FSDP2
from the start (`core.sharded.load_sharded`, what `fit` does under `ModelParallelStrategy`), side by side.

A LLaMA of random weights (`--hidden`, `--blocks`, `--vocab`, float32) is saved once as safetensors. Then, each
in fresh processes on the CPU (gloo): one process loads it whole (`core.model.load_model`), and N processes load
it sharded. Every process reports the bytes of the parameters it holds (a sharded block tensor's local rows, a
replicated tensor whole), its resident memory after one batch (VmRSS) and the anonymous part of it (RssAnon:
one process's `from_pretrained` leaves the weights in the memory-mapped checkpoint, resident as file pages,
where the shards are copies of their rows), and the logits of that batch, which must agree with one process's.

    .venv/bin/python scripts/benchmark_fsdp_memory.py --processes 2 --hidden 1024 --blocks 16 --vocab 8192

The expected ratio of parameter bytes is (E + B/N) / (E + B): E the replicated embeddings and head, B the blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from ghostdistill.core.measure import status_bytes

ROOT = Path(__file__).resolve().parents[1]


def build(folder: Path, hidden: int, blocks: int, vocab: int) -> dict:
    """Save a random-weight LLaMA of this size; returns its parameter counts (blocks, the rest)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "llama",
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=blocks,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 128),
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(folder)
    total = sum(p.numel() for p in model.parameters())
    in_blocks = sum(p.numel() for p in model.model.layers.parameters())
    return {"block_params": in_blocks, "other_params": total - in_blocks}


def child(args) -> None:
    """One process: load (whole, or sharded among `--world`), measure, run one batch, print a JSON line."""
    import torch.distributed as dist

    from ghostdistill.core.model import ModelConfig, load_model
    from ghostdistill.core.sharded import load_sharded

    torch.set_num_threads(1)
    cfg = ModelConfig(source=str(args.dir), cache_gguf=False)
    if args.world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
        dist.init_process_group("gloo", rank=args.rank, world_size=args.world)
        from torch.distributed.device_mesh import init_device_mesh

        model = load_sharded(cfg, init_device_mesh("cpu", (args.world,)), "cpu")
    else:
        model = load_model(cfg)
    held = 0
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        held += local.numel() * local.element_size()
    ids = torch.arange(8, 8 + 4 * 32).view(4, 32) % model.config.vocab_size
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    rss, rss_anon = status_bytes("VmRSS"), status_bytes("RssAnon")
    print(
        json.dumps(
            {
                "rank": args.rank,
                "world": args.world,
                "param_bytes": held,
                "rss": rss,
                "rss_anon": rss_anon,
                "logits_sum": float(logits.double().sum()),
                "logits_abs_sum": float(logits.double().abs().sum()),
            }
        )
    )
    if args.world > 1:
        dist.destroy_process_group()


def launch(folder: Path, world: int, port: int) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    base = [sys.executable, __file__, "--child", "--dir", str(folder), "--world", str(world), "--port", str(port)]
    procs = [
        subprocess.Popen([*base, "--rank", str(r)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        for r in range(world)
    ]
    rows = []
    for p in procs:
        out, err = p.communicate(timeout=1800)
        if p.returncode != 0:
            raise RuntimeError(f"a process of {world} failed:\n{err[-3000:]}")
        rows.append(json.loads(out.strip().splitlines()[-1]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--blocks", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--json", type=Path, default=None, help="write the rows and ratios here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--world", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=29541, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    folder = Path(tempfile.mkdtemp(prefix="fsdp_memory_"))
    try:
        counts = build(folder, args.hidden, args.blocks, args.vocab)
        one = launch(folder, 1, args.port)[0]
        many = launch(folder, args.processes, args.port + 1)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    e, b, n = counts["other_params"], counts["block_params"], args.processes
    expected = (e + b / n) / (e + b)
    print(f"LLaMA, hidden {args.hidden}, {args.blocks} blocks, vocabulary {args.vocab}, float32: {e + b:,} parameters")
    print(
        f"{'processes':>9} | {'rank':>4} | {'parameter MiB':>13} | {'ratio':>6} | {'VmRSS MiB':>9} | {'ratio':>6} | "
        f"{'RssAnon MiB':>11}"
    )
    for row in [one, *many]:
        print(
            f"{row['world']:>9} | {row['rank']:>4} | {row['param_bytes'] / 2**20:>13.1f} | "
            f"{row['param_bytes'] / one['param_bytes']:>6.3f} | {row['rss'] / 2**20:>9.1f} | "
            f"{row['rss'] / one['rss']:>6.3f} | {row['rss_anon'] / 2**20:>11.1f}"
        )
    diff = max(abs(r["logits_sum"] - one["logits_sum"]) / max(one["logits_abs_sum"], 1e-30) for r in many)
    print(f"expected parameter ratio (E + B/{n}) / (E + B) = {expected:.3f}; logits of one batch agree to {diff:.1e}")
    if args.json is not None:
        summary = {"counts": counts, "one": one, "sharded": many, "expected_ratio": expected, "logits_rel_diff": diff}
        args.json.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
