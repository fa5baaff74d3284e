"""The prepared GPU check's sizes and arithmetic (`scripts/device_check.py`, whose docstring derives it): the
check's sizes (`Sizes`: the H200's and `--tiny`'s), a config's students as the kinds the arithmetic prices, model
FLOPs per token of a distillation step, a step's throughput and MFU, the time configs/llama3_11.yaml implies,
and the `--sizing` summary."""

from __future__ import annotations

import statistics
from pathlib import Path

from _rehearsal import LLAMA3_8B, TINY
from _rehearsal_model import parameter_count

PEAK_BF16_FLOPS = 790e12  # H200, bfloat16 dense, as the issue states it (the SXM datasheet says 989 TFLOP/s)
LLAMA3_11_STEPS = 500  # configs/llama3_11.yaml: trainer.max_steps
LLAMA3_11_VALIDATIONS = 11  # val_every 50 over 500 steps: at 0, 50, ..., 500
LLAMA3_11_VAL_WINDOWS = 16


class Sizes:
    """The check's sizes: the real one (H200) and `--tiny` (CPU, seconds)."""

    def __init__(self, tiny: bool) -> None:
        self.tiny = tiny
        self.shape = TINY if tiny else LLAMA3_8B
        self.num_layers = 6 if tiny else 32
        self.layers = [2, 3] if tiny else list(range(20, 31))
        self.samples = 4 if tiny else 128
        self.seq_len = 64 if tiny else 2048
        self.batch_size = 2 if tiny else 4
        self.steps = 2 if tiny else 20
        self.eval_windows = 2 if tiny else 8
        self.val_windows = 1 if tiny else 2
        self.accelerator = "cpu" if tiny else "gpu"
        self.device = "cpu" if tiny else "cuda"


LLAMA3_11 = Path(__file__).resolve().parents[1] / "configs" / "llama3_11.yaml"


def config_students(path: Path = LLAMA3_11, extra: bool = True) -> dict[str, str]:
    """A config's students, name → the kind `flops_per_token` prices ("lora" when adapters train, else
    "operators"), resolved as `fit` resolves them (`DistillConfig.specs`); `extra=False` keeps the
    `methods` shorthand only (what `--model.distill.students []` leaves: the fair pair)."""
    import yaml

    from ghostdistill.distill.config import DistillConfig, StudentConfig

    distill = yaml.safe_load(path.read_text())["model"]["distill"]
    cfg = DistillConfig(
        methods=list(distill.get("methods") or []),
        train=list(distill.get("train") or ["operators"]),
        students=[
            StudentConfig(name=s["name"], method=s["method"], train=s.get("train"))
            for s in (distill.get("students") or [] if extra else [])
        ],
    )
    kinds = {}
    for student in cfg.specs():
        if not set(student.train) <= {"operators", "lora"}:
            raise ValueError(
                f"{path.name}: student {student.name} trains {list(student.train)}; the sizing prices "
                "operators and LoRA only: extend flops_per_token first"
            )
        kinds[student.name] = "lora" if "lora" in student.train else "operators"
    return kinds


LLAMA3_11_STUDENTS = tuple(config_students().values())  # run A: ghost_ft, linearpatch_ft, ghost_lora_ft
FAIR_PAIR = tuple(config_students(extra=False).values())  # run B: ghost_ft, linearpatch_ft


def flops_per_token(shape: dict, num_layers: int, layers: list[int], seq_len: int, students=LLAMA3_11_STUDENTS):
    """Model FLOPs per training token of one distillation step (the arithmetic of device_check.py's docstring);
    `students` one kind per student: "operators" (runs the blocks after the last gap) or "lora" (adapters on
    every kept block, so it runs them all)."""
    counts = parameter_count(shape, num_layers)
    c, v = shape["hidden_size"], shape["vocab_size"]
    block = 2 * (counts["block"] - 2 * c) + 2 * seq_len * c  # linears + causal attention (QKᵀ and AV, half)
    head = 2 * c * v
    teacher = num_layers * block
    after = num_layers - max(layers) - 1  # blocks after the (last) gap
    kept = num_layers - len(layers)
    operator = 3 * 2 * c * c  # forward, weight gradient, input gradient
    loss = 5 * head
    per_kind = {
        kind: 2 * (kept if kind == "lora" else after) * block + operator + loss  # forward + activation backward
        for kind in ("operators", "lora")
    }
    unknown = sorted(set(students) - set(per_kind))
    if unknown:
        raise ValueError(f"student kinds {unknown}: each is one of {sorted(per_kind)}")
    return {
        "teacher": teacher,
        **{f"per_student_{kind}": value for kind, value in per_kind.items()},
        "total": teacher + sum(per_kind[kind] for kind in students),
        "block": block,
        "head": head,
    }


def step_summary(steps: list[dict], flops: dict, students: int = len(LLAMA3_11_STUDENTS)) -> dict:
    """Median step (after the first two, which warm up kernels and the allocator), tokens/s, MFU."""
    if not steps:
        return {}
    times = [s["seconds"] for s in steps]
    settled = times[2:] or times
    median = statistics.median(settled)
    tokens = steps[-1]["tokens"]
    achieved = flops["total"] * tokens / median
    return {
        "steps": len(steps),
        "step_s": [round(t, 3) for t in times],
        "median_step_s": round(median, 4),
        "tokens_per_step": tokens,
        "tokens_per_s_per_student": round(tokens / median, 1),
        "flops_per_token": {k: round(val / 1e9, 3) for k, val in flops.items()},  # GFLOP
        "achieved_tflops": round(achieved / 1e12, 2),
        "mfu": round(achieved / PEAK_BF16_FLOPS, 4),
        "students": students,
    }


def implied_llama3_11(run: dict, sizes: Sizes) -> dict:
    """configs/llama3_11.yaml per GPU from run A's measurements: 500 steps at the median step, calibration as
    measured (one GPU: with DDP each rank streams its share), 11 validations of 16 windows at the measured
    cost per window. Evaluation (WikiText-2, C4 and PTB test at 2048, up to 256 windows each) is given per
    window and view; its window count depends on the tokenizer."""
    tp = run.get("throughput") or {}
    if not tp:
        return {}
    phases = run.get("phases", {})
    val = run.get("validate_s") or []
    per_val_window = (statistics.median(val) / sizes.val_windows) if val else None
    distill = LLAMA3_11_STEPS * tp["median_step_s"]
    calibration = (phases.get("calibration") or {}).get("seconds", 0.0)
    validation = LLAMA3_11_VALIDATIONS * LLAMA3_11_VAL_WINDOWS * per_val_window if per_val_window else 0.0
    evaluation = (phases.get("evaluation") or {}).get("seconds")
    return {
        "steps": LLAMA3_11_STEPS,
        "distill_s": round(distill, 1),
        "calibration_s": round(calibration, 1),
        "validation_s": round(validation, 1),
        "total_s": round(distill + calibration + validation, 1),
        "evaluation_s_per_window_all_views": round(evaluation / sizes.eval_windows, 3) if evaluation else None,
        "note": "estimate from run A's median step (the config's three students); DDP adds the all-reduce of "
        "3 × 16.8M operator gradients and ghost_lora_ft's 13.6M adapter gradients",
    }


def sizing(config: Path) -> dict:
    """The full check's arithmetic for `config`'s students (`--sizing`): parameters, FLOPs per token of run A
    (the config's students) and run B (the fair pair), and what a step of one second would achieve."""
    sizes = Sizes(tiny=False)
    kinds = {"llama3_11": config_students(config), "fair_pair": config_students(config, extra=False)}
    tokens = sizes.batch_size * sizes.seq_len
    out: dict = {"shape": LLAMA3_8B, "params": parameter_count(LLAMA3_8B, sizes.num_layers), "students": kinds}
    out["flops_per_token"], out["one_second_step"] = {}, {}
    for run, students in kinds.items():
        flops = flops_per_token(LLAMA3_8B, sizes.num_layers, sizes.layers, sizes.seq_len, tuple(students.values()))
        out["flops_per_token"][run] = flops
        out["one_second_step"][run] = step_summary([{"seconds": 1.0, "tokens": tokens}] * 3, flops, len(students))
    return out
