"""AdamW over every student's parameters, one group per (student, part) so that each part has its
learning rate and each student can be clipped on its own (`clip_per_student`), and a warm-up + cosine
schedule over optimizer steps ``step = 0, 1, …``:

    lr(step) = lr · (step + 1) / warmup                             for step < warmup
             = lr · (r + (1 − r) · ½ (1 + cos(π · progress)))       after, progress = (step − warmup) / (total − warmup)

with r = `min_lr_ratio` (LinearPatch decays to lr/20: r = 0.05). `LambdaLR` evaluates the multiplier
at step 0 when it is built, so the first optimizer step runs at lr/warmup (``step / warmup`` would give
it lr 0, a wasted step) and step ``warmup − 1`` is the first at the full lr. lr · r is reached at
``step = total``, after the last of `total` steps.
"""

from __future__ import annotations

import math

import torch

from .config import DistillConfig
from .interface import get_part
from .students import StudentParams


def param_groups(params: dict[str, StudentParams], cfg: DistillConfig) -> list[dict]:
    """One group per (student, part), at that student's learning rate for the part (`Part.lr_key`)."""
    groups = [
        {"params": tensors, "lr": get_part(kind).lr(cfg.recipe(view)), "name": f"{view}/{kind}", "student": view}
        for view, p in params.items()
        for kind, tensors in p.items()
        if tensors
    ]
    if not groups:
        raise ValueError("distillation has nothing to train: check distill.methods, distill.students and their train")
    return groups


def warmup_cosine(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """The multiplier of the base learning rate at optimizer step `step` of `total`."""
    if warmup and step < warmup:
        return (step + 1) / warmup
    if total <= warmup:
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def make_optimizer(params: dict[str, StudentParams], cfg: DistillConfig, total_steps: int):
    optimizer = torch.optim.AdamW(param_groups(params, cfg), weight_decay=cfg.weight_decay, betas=tuple(cfg.betas))
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: warmup_cosine(step, total_steps, cfg.warmup_steps, cfg.min_lr_ratio)
    )
    return optimizer, scheduler


def clip_per_student(optimizer: torch.optim.Optimizer, value: float | None, algorithm: str | None) -> None:
    """Clip each student's gradients on its own, over the parameter groups that share a ``student`` key:
    one global norm over all students would let one student's gradients shrink another's, and the
    comparison would not be the same recipe for each.

    Args:
        value: the norm (or value) bound; falsy: no clipping.
        algorithm: ``norm`` (or None, Lightning's default) clips each student's total 2-norm; any other
            (Lightning allows only ``value``) clips every gradient element to [−value, value].
    """
    if not value:
        return
    by_student: dict[str, list] = {}
    for group in optimizer.param_groups:
        by_student.setdefault(group.get("student", ""), []).extend(group["params"])
    for params in by_student.values():
        if algorithm in (None, "norm"):
            torch.nn.utils.clip_grad_norm_(params, value)
        else:
            torch.nn.utils.clip_grad_value_(params, value)
