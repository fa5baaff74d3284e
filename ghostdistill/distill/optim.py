"""AdamW over every student's parameters, one group per (student, kind) so that each kind has its
learning rate and each student can be clipped on its own, and a warm-up + cosine schedule.

    lr(step) = lr · step / warmup                                   for step < warmup
             = lr · (r + (1 − r) · ½ (1 + cos(π · progress)))       after, progress = (step − warmup) / (total − warmup)

with r = `min_lr_ratio` (LinearPatch decays to lr/20: r = 0.05).
"""

from __future__ import annotations

import math

import torch

from .config import DistillConfig
from .students import StudentParams


def param_groups(params: dict[str, StudentParams], cfg: DistillConfig) -> list[dict]:
    groups = []
    for view, p in params.items():
        for kind, lr, tensors in (
            ("operators", cfg.lr, p.operators),
            ("lora", cfg.lora.lr, p.lora),
            ("blocks", cfg.block_lr, p.blocks),
        ):
            if tensors:
                groups.append({"params": tensors, "lr": lr, "name": f"{view}/{kind}", "student": view})
    if not groups:
        raise ValueError("distillation has nothing to train: check distill.methods and distill.train")
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
